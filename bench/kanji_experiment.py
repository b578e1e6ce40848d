"""Does a bigger batch (or a memory) help at an equal number of images seen? The kanji experiment:
SOP's protocol on KanjiVG drawings (train on half of the 6,703 characters, retrieve among the
unseen other half: 3,352 classes, 16,760 drawings), one run of the training command per setting.

Settings (`--images` images each, the same optimizer, learning rate and cosine schedule):
batch 64, batch 512, batch 4096 (embedding-gradient caching, chunks of 512) and batch 256 with a
cross-batch memory of 16,384 (used after the first 10% of the steps). Writes results.json,
results.md (the table) and recall.png (Recall@1 against images seen) under --out.

    python bench/kanji_experiment.py --out bench/results/experiment     # make experiment
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

SETTINGS = {  # name: training command arguments
    "batch 64": ["--batch-size", "64"],
    "batch 512": ["--batch-size", "512"],
    "batch 4096 (chunks of 512)": ["--batch-size", "4096", "--chunk-size", "512"],
    "batch 256 + memory 16384": ["--batch-size", "256", "--memory-size", "16384"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/experiment")
    parser.add_argument("--images", type=int, default=307200, help="images seen by every setting")
    parser.add_argument("--evaluations", type=int, default=4, help="evaluations after the untrained one")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more training command arguments")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for name in args.settings:
        batch = int(SETTINGS[name][SETTINGS[name].index("--batch-size") + 1])
        steps = args.images // batch
        run_dir = os.path.join(args.out, name.split(" (")[0].replace(" + ", "_").replace(" ", "_"))
        command = [sys.executable, "-m", "ms_loss_cuda.train", "--data", "kanji", "--root",
                   os.path.join(args.out, "data"), "--steps", str(steps),
                   "--eval-every", str(max(1, steps // args.evaluations)), "--out", run_dir, "--no-progress",
                   *SETTINGS[name], *args.extra]
        if "--memory-size" in SETTINGS[name]:
            command += ["--memory-warmup", str(steps // 10)]
        print(f"== {name}: {steps} steps\n   {' '.join(command)}", flush=True)
        started = time.perf_counter()
        subprocess.run(command, check=True)
        with open(os.path.join(run_dir, "metrics.json")) as handle:
            results[name] = {"steps": steps, "wall_seconds": round(time.perf_counter() - started, 1),
                             "history": json.load(handle)}
    import torch

    info = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "images": args.images,
            "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump({"info": info, "results": results}, handle, indent=1)
    lines = ["| setting | steps | Recall@1 | Recall@10 | Recall@100 | Recall@1000 | MAP@R | train s |",
             "|---|---|---|---|---|---|---|---|"]
    untrained = next(iter(results.values()))["history"][0]
    lines.append("| untrained | 0 | " + " | ".join(f"{100 * untrained[k]:.2f}" for k in
                                                   ("recall@1", "recall@10", "recall@100", "recall@1000", "map_at_r")) + " | - |")
    for name, result in results.items():
        last = result["history"][-1]
        lines.append(f"| {name} | {result['steps']} | " + " | ".join(
            f"{100 * last[k]:.2f}" for k in ("recall@1", "recall@10", "recall@100", "recall@1000", "map_at_r"))
            + f" | {last['train_seconds']:.0f} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "results.md"), "w") as handle:
        handle.write(f"{info}\n\n{table}\n")
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        history = result["history"]
        ax.plot([r["images_seen"] for r in history], [100 * r["recall@1"] for r in history], marker="o", label=name)
    ax.set_xlabel("images seen")
    ax.set_ylabel("Recall@1, unseen classes (%)")
    ax.set_title(f"KanjiVG, SOP protocol, {info['cpus']} CPU cores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "recall.png"), dpi=120)


if __name__ == "__main__":
    main()
