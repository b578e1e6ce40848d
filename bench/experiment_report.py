"""The kanji experiment's tables and plot (bench/kanji_experiment.py): results.md and recall.png.

Each setting's runs (one a seed) are summarised by their mean and their spread (half the range
between the seeds), at the last evaluation. The fixed-steps plot puts Recall@1 against the batch size
(log axis) beside the MS paper's supplementary Table 2 (Stanford Online Products, a fixed number of
iterations); the equal-images plot puts each setting's Recall@1 against the images it has seen.
"""
import os
import statistics

# Wang et al., CVPR 2019, supplementary Table 2: SOP Recall@1 (%) at a fixed number of iterations by batch
# size (Adam, 1e-5, embedding 512); on CUB it stays between 64.6 and 65.7
PAPER_SOP_RECALL_AT_1 = {20: 71.40, 40: 73.82, 80: 75.61, 160: 76.63, 320: 77.59, 640: 78.19, 1000: 78.35}
METRICS = (("recall@1", "Recall@1"), ("recall@10", "Recall@10"), ("map_at_r", "MAP@R"))


def summary(runs, key):
    """(mean, half the range) over the seeds of the last evaluation's `key`, in percent."""
    values = [100 * run["history"][-1][key] for run in runs]
    return statistics.mean(values), (max(values) - min(values)) / 2


def table(info, runs):
    """The markdown table: one row per setting, and the untrained model's."""
    seeds = len(next(iter(runs.values())))
    lines = ["| setting | steps | images seen | " + " | ".join(f"{label} (%)" for _, label in METRICS)
             + " | train minutes |", "|---|---|---|" + "---|" * (len(METRICS) + 1)]
    first = next(iter(runs.values()))
    untrained = " | ".join(f"{mean:.2f}" for mean, _ in (summary([dict(r, history=r["history"][:1]) for r in first],
                                                                 key) for key, _ in METRICS))
    lines.append(f"| untrained | 0 | 0 | {untrained} | - |")
    for name, setting_runs in runs.items():
        run = setting_runs[0]
        cells = " | ".join(f"{mean:.2f} ± {spread:.2f}" for mean, spread in (summary(setting_runs, key)
                                                                            for key, _ in METRICS))
        minutes = statistics.mean(r["history"][-1]["train_seconds"] for r in setting_runs) / 60
        lines.append(f"| {name} | {run['steps']} | {run['steps'] * run['batch']:,} | {cells} | {minutes:.1f} |")
    lines.append("")
    lines.append(f"Mean ± half the range over {seeds} seed{'s' if seeds > 1 else ''}, at the last evaluation, "
                 "on the unseen classes.")
    return "\n".join(lines)


def plot(info, runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if info["protocol"] == "equal-images":
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, setting_runs in runs.items():
            history = setting_runs[0]["history"]
            ax.plot([r["images_seen"] for r in history], [100 * r["recall@1"] for r in history], marker="o",
                    label=name)
        ax.set_xlabel("images seen")
        ax.set_ylabel("Recall@1, unseen classes (%)")
        ax.set_title("KanjiVG, an equal number of images for every setting")
        ax.grid(alpha=0.3)
        ax.legend()
    else:
        fig, (ours, paper) = plt.subplots(1, 2, figsize=(11, 4.2))
        plain = {name: r for name, r in runs.items() if "memory" not in name}
        batches = [r[0]["batch"] for r in plain.values()]
        means, spreads = zip(*(summary(r, "recall@1") for r in plain.values()))
        ours.errorbar(batches, means, yerr=spreads, marker="o", capsize=3, label="batch alone")
        memories = [name for name in runs if "memory" in name]
        for offset, name in enumerate(memories, 1):  # (beside their batch's point, not on it)
            mean, spread = summary(runs[name], "recall@1")
            ours.errorbar([runs[name][0]["batch"] * 1.12 ** offset], [mean], yerr=[spread], marker="s", capsize=3,
                          linestyle="", label=name)
        ours.set_xscale("log", base=2)
        ours.set_xlabel("batch size")
        ours.set_ylabel("Recall@1, unseen classes (%)")
        ours.set_title(f"KanjiVG, {info.get('steps')} steps each ({info['device']})")
        ours.grid(alpha=0.3)
        ours.legend(fontsize=8)
        paper.plot(list(PAPER_SOP_RECALL_AT_1), list(PAPER_SOP_RECALL_AT_1.values()), marker="o", color="gray")
        paper.set_xscale("log", base=2)
        paper.set_xlabel("batch size")
        paper.set_ylabel("Recall@1 (%)")
        paper.set_title("MS paper, SOP, fixed iterations (suppl. Table 2)")
        paper.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(info, runs, out):
    """Writes results.md and recall.png under `out`; returns the table."""
    text = table(info, runs)
    with open(os.path.join(out, "results.md"), "w") as handle:
        handle.write(f"{info}\n\n{text}\n")
    plot(info, runs, os.path.join(out, "recall.png"))
    return text
