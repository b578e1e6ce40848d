"""Forward+backward time and peak memory of the MS loss providers, side by side in one run.

Providers: `floor` (forward+backward of X @ X.T alone: the GEMM work no exact method avoids),
`reference` (dense PyTorch), `cpu` (fused C++ kernel) and `pml` (pytorch-metric-learning's
MultiSimilarityLoss + MultiSimilarityMiner). Every (provider, B) runs in a fresh process, so its
peak memory (the process's high-water mark above the inputs, reset through /proc/self/clear_refs)
is its own. A provider whose predicted peak (quadratic from its last size) would not fit in the
machine's available memory, or whose predicted time is over --max-seconds, is recorded as skipped.

    python bench/benchmark.py --sizes 1024 4096 --out bench/results/demo
writes results.json, results.csv and results.png there and prints a table.
"""
import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time

PROVIDERS = ("floor", "reference", "cpu", "pml")


# ---- one measurement, in its own process --------------------------------------------------------
def _rss_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def make_inputs(batch, dim, seed=0):
    """SOP-like batch: 4 samples per class around class centres, float32."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(batch) // 4
    centres = torch.randn(batch // 4 + 1, dim, generator=gen)
    x = centres[labels] + 1.2 * torch.randn(batch, dim, generator=gen)
    return x, labels


def step_function(provider, labels):
    import torch

    if provider == "floor":
        return lambda x: (x @ x.T).sum().backward()
    if provider == "pml":
        from pytorch_metric_learning import losses, miners

        loss, miner = losses.MultiSimilarityLoss(), miners.MultiSimilarityMiner()
        return lambda x: loss(x, labels, miner(x, labels)).backward()
    import ms_loss_cuda

    return lambda x: ms_loss_cuda.multi_similarity_loss(x, labels, backend=provider).backward()


def measure(provider, batch, dim, repeats, max_seconds):
    import torch

    x0, labels = make_inputs(batch, dim)
    step = step_function(provider, labels)
    x = x0.clone().requires_grad_()
    base_kib = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the high-water mark
    start = time.perf_counter()
    step(x)  # also the warm-up
    first = time.perf_counter() - start
    peak_mib = (_rss_kib("VmHWM") - base_kib) / 1024
    times = []
    while len(times) < repeats and sum(times) + first < max_seconds:
        x.grad = None
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    return {"seconds": min(times or [first]), "runs": len(times) or 1, "peak_extra_mib": peak_mib,
            "threads": torch.get_num_threads()}


# ---- the driver ---------------------------------------------------------------------------------
def machine_info():
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "platform": platform.platform(), "cores": os.cpu_count()}
    try:
        import pytorch_metric_learning

        info["pytorch_metric_learning"] = pytorch_metric_learning.__version__
    except ImportError:
        pass
    with open("/proc/cpuinfo") as cpu:
        info["cpu"] = next((line.split(":", 1)[1].strip() for line in cpu if line.startswith("model name")), "?")
    info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return info


def available_mib():
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable")) / 1024


def run_worker(provider, batch, args):
    command = [sys.executable, __file__, "--worker", provider, str(batch), "--dim", str(args.dim),
               "--repeats", str(args.repeats), "--max-seconds", str(args.max_seconds)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        killed = done.returncode in (-9, 137)
        return {"status": "out of memory (killed)" if killed else f"failed: {done.stderr.strip()[-300:]}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), status="ok")


def predicted_skip(previous, batch, args):
    """Why this size is skipped, from the provider's last measured size (quadratic in B), or None."""
    if previous is None:
        return None
    grow = (batch / previous["batch"]) ** 2
    need_mib = previous["peak_extra_mib"] * grow
    if need_mib > 0.8 * available_mib():
        return f"out of memory (needs ~{need_mib / 1024:.0f} GiB)"
    if previous["seconds"] * grow > 2 * args.max_seconds:
        return f"skipped (~{previous['seconds'] * grow:.0f} s per step)"
    return None


def write_results(rows, info, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"machine": info, "results": rows}, f, indent=1)
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["provider", "batch", "dim", "status", "seconds", "peak_extra_mib",
                                               "runs", "threads"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def table(rows, sizes):
    """Markdown table: time (s) and peak extra memory per provider and B, with cpu/floor and pml/cpu."""
    by = {(r["provider"], r["batch"]): r for r in rows}
    cell = lambda r: (f"{r['seconds']:.3g} s / {r['peak_extra_mib']:.0f} MiB" if r.get("status") == "ok"  # noqa: E731
                      else r.get("status", "-"))
    lines = ["| B | " + " | ".join(PROVIDERS) + " | cpu / floor | pml / cpu |",
             "|---|" + "---|" * (len(PROVIDERS) + 2)]
    for batch in sizes:
        ok = {p: by[(p, batch)]["seconds"] for p in PROVIDERS if by.get((p, batch), {}).get("status") == "ok"}
        ratio = lambda a, b: f"{ok[a] / ok[b]:.2f}x" if a in ok and b in ok else "-"  # noqa: E731
        lines.append(f"| {batch} | " + " | ".join(cell(by.get((p, batch), {})) for p in PROVIDERS)
                     + f" | {ratio('cpu', 'floor')} | {ratio('pml', 'cpu')} |")
    return "\n".join(lines)


def plot(rows, info, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for provider in PROVIDERS:
        ok = [r for r in rows if r["provider"] == provider and r["status"] == "ok"]
        if ok:
            batches = [r["batch"] for r in ok]
            ax_time.loglog(batches, [r["seconds"] for r in ok], "o-", label=provider, base=2)
            ax_mem.loglog(batches, [max(r["peak_extra_mib"], 1) for r in ok], "o-", label=provider, base=2)
    ax_time.set(xlabel="batch size B", ylabel="forward+backward time (s)", title="time (D=%d, float32)" % rows[0]["dim"])
    ax_mem.set(xlabel="batch size B", ylabel="peak memory above inputs (MiB)", title="peak memory")
    for ax in (ax_time, ax_mem):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{info['cpu']}, {info['threads']} threads, torch {info['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "results.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 65536])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (best is kept)")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="stop repeating after this much time")
    parser.add_argument("--out", default="bench/results/latest")
    parser.add_argument("--worker", nargs=2, metavar=("PROVIDER", "B"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        provider, batch = args.worker[0], int(args.worker[1])
        print(json.dumps(measure(provider, batch, args.dim, args.repeats, args.max_seconds)))
        return

    info = machine_info()
    print(f"machine: {info}", flush=True)
    rows, last = [], {}
    for batch in sorted(args.sizes):
        for provider in args.providers:
            row = {"provider": provider, "batch": batch, "dim": args.dim}
            skip = predicted_skip(last.get(provider), batch, args)
            print(f"[B={batch:>6}] {provider:<9} ", end="", flush=True)
            row.update({"status": skip} if skip else run_worker(provider, batch, args))
            if row["status"] == "ok":
                last[provider] = row
                print(f"{row['seconds']:.3f} s, peak +{row['peak_extra_mib']:.0f} MiB", flush=True)
            else:
                print(row["status"], flush=True)
            rows.append(row)
            write_results(rows, info, args.out)
    print()
    print(table(rows, sorted(args.sizes)))
    plot(rows, info, args.out)
    print(f"\nwrote {args.out}/results.json, results.csv and results.png")


if __name__ == "__main__":
    main()
