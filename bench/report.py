"""The benchmark's results (bench/benchmark.py) as files and text: results.json and results.csv, the
markdown table of each provider's time and peak memory per shape with the ratio columns, the legend
that says what its columns hold, and results.png (time and memory against B)."""
import csv
import json
import os

from providers import COMPILED, FUSED, describe  # (bench/, this module's folder)


def write_results(rows, info, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"machine": info, "results": rows}, f, indent=1)
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["provider", "batch", "ref", "dim", "device", "dtype", "hardness",
                                               "mined", "status", "seconds", "tflops", "peak_extra_mib", "kept_mib",
                                               "runs", "first_seconds", "back_to_back_seconds", "threads"],
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def shape_name(batch, ref):
    return f"{batch}" if ref is None else f"{batch} x {ref}"


def ratio_columns(providers):
    """(a, b) of each "a / b" column: each fused backend against the yardstick (matmul4 on CUDA, floor on
    CPU), compiled against each fused backend (compiled-graph against each -graph one), pml against each."""
    base = "matmul4" if "matmul4" in providers else "floor"
    fused = [f for f in FUSED if f in providers]
    return ([(f, base) for f in fused if base in providers]
            + [(c, f) for c in COMPILED if c in providers
               for f in fused if c.endswith("-graph") == f.endswith("-graph")]
            + [("pml", f) for f in fused if "pml" in providers])


def table(rows, shapes, providers, time_key="seconds"):
    """Markdown table: time, TFLOP/s (CUDA) and peak extra memory per provider and shape, then the ratios
    of ratio_columns. time_key="back_to_back_seconds": the times alone, of steps issued back to back (CUDA)."""
    by = {(r["provider"], r["batch"], r["ref"]): {**r, "seconds": r.get(time_key)} for r in rows}

    def cell(r):
        if r.get("status") != "ok":
            return r.get("status", "-")
        if time_key != "seconds":
            return f"{r['seconds']:.3g} s"
        rate = f" / {r['tflops']:.0f} TFLOP/s" if "tflops" in r else ""
        return f"{r['seconds']:.3g} s{rate} / {r['peak_extra_mib']:.0f} MiB"

    ratios = ratio_columns(providers)
    lines = ["| B (x R) | mined | " + " | ".join(providers) + "".join(f" | {a} / {b}" for a, b in ratios) + " |",
             "|---|---|" + "---|" * (len(providers) + len(ratios))]
    for batch, ref in shapes:
        here = {p: by.get((p, batch, ref), {}) for p in providers}
        ok = {p: r["seconds"] for p, r in here.items() if r.get("status") == "ok"}
        mined = next((r["mined"] for r in here.values() if "mined" in r), None)
        ratio = lambda a, b: f"{ok[a] / ok[b]:.2f}x" if a in ok and b in ok else "-"  # noqa: E731
        lines.append(f"| {shape_name(batch, ref)} | " + ("-" if mined is None else f"{100 * mined:.3g}%") + " | "
                     + " | ".join(cell(here[p]) for p in providers)
                     + "".join(f" | {ratio(a, b)}" for a, b in ratios) + " |")
    return "\n".join(lines)


def legend(rows, providers):
    """What the table's columns and cells hold: the lines printed under it."""
    ok = [r for r in rows if r.get("status") == "ok"]
    cuda = any(r["device"] == "cuda" for r in rows)
    counts = sorted({r["runs"] for r in ok}) or [1]
    runs = f"{counts[0]}" if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
    how = (f"median of {runs} runs between CUDA events" if cuda else
           f"best of {runs} runs (at least --repeats, more as fit 1 s; each provider and B in a fresh process)")
    lines = ["B (x R): B anchors against the batch itself (the diagonal skipped); B x R: against a memory bank of "
             "R rows.",
             "mined: the share of the pairs of distinct identity that the MS miner keeps (first 256 anchors).",
             "cell: time" + (" / TFLOP/s" if cuda else "") + " / peak memory. Time: of one forward+backward, "
             f"{how}, after an untimed warm-up"
             + ("; TFLOP/s: 4 * 2 * B * R * D flops a step over it" if cuda else "")
             + "; peak memory: above the inputs, " + ("during the warm-up" if cuda else
                                                       "in the warm-up step (the second call: the first one, "
                                                       "untimed, compiles and makes the one-time allocations)")
             + "."]
    if not cuda and counts[0] == 0:
        lines.append("0 runs: a step longer than --max-seconds is timed once, in its warm-up (the second call).")
    lines += [f"{p}: {describe(p)}." for p in providers]
    if ratio_columns(providers):
        lines.append("a / b: a's time over b's (above 1: b is faster).")
    for provider in (p for p in COMPILED if p in providers):
        first = [f"B = {shape_name(r['batch'], r['ref'])}: {r['first_seconds']:.1f} s"
                 for r in ok if r["provider"] == provider]
        if first:
            compile = "the compile" if cuda else "a compile from an empty cache"
            lines.append(f"{provider}'s first call ({compile}, and one step; untimed): " + ", ".join(first) + ".")
    return "\n".join(lines)


def plot(rows, info, out, providers):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for provider in providers:
        ok = [r for r in rows if r["provider"] == provider and r["status"] == "ok" and r["ref"] is None]
        if ok:
            batches = [r["batch"] for r in ok]
            ax_time.loglog(batches, [r["seconds"] for r in ok], "o-", label=provider, base=2)
            ax_mem.loglog(batches, [max(r["peak_extra_mib"], 1) for r in ok], "o-", label=provider, base=2)
    first = rows[0]
    ax_time.set(xlabel="batch size B", ylabel="forward+backward time (s)",
                title=f"time (D={first['dim']}, {first['dtype']}, {first['device']}, {first['hardness']})")
    ax_mem.set(xlabel="batch size B", ylabel="peak memory above inputs (MiB)", title="peak memory")
    for ax in (ax_time, ax_mem):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    where = info.get("gpu") if first["device"] == "cuda" else f"{info['cpu']}, {info['threads']} threads"
    fig.suptitle(f"{where}, torch {info['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "results.png"), dpi=110)
