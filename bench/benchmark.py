"""Forward+backward time and peak memory of the MS loss providers, side by side in one run.

Providers: `floor` (forward+backward of X @ X.T alone: the GEMM work no exact method avoids),
`matmul4` (four X @ X.T products: the issues' GPU yardstick, as the fused forward+backward does
four GEMM-equivalents), `reference` (dense PyTorch), the fused backends `cpu`, `triton` and
`cuda`, and `pml` (pytorch-metric-learning's MultiSimilarityLoss + MultiSimilarityMiner).
Every (provider, B) runs in a fresh process, so its peak memory is its own: on CPU the process's
high-water mark above the inputs (reset through /proc/self/clear_refs), on CUDA
torch.cuda.max_memory_allocated above the inputs. CPU steps are timed with perf_counter; on CUDA
`triton` is timed with triton.testing.do_bench and every other provider with CUDA events (the
best of --repeats runs in both), and TFLOP/s counts 4 * 2 * B^2 * D flops per step. A provider
whose predicted peak (quadratic from its last size) would not fit in the available memory, or
whose predicted time is over --max-seconds, is recorded as skipped.

    python bench/benchmark.py --sizes 1024 4096 --out bench/results/demo
    python bench/benchmark.py --device cuda --dtype float16 --sizes 4096 16384 \
        --providers matmul4 triton cuda pml --out bench/results/gpu
write results.json, results.csv and results.png there and print a table.
"""
import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time

PROVIDERS = ("floor", "matmul4", "reference", "cpu", "triton", "cuda", "pml")
FUSED = ("cpu", "triton", "cuda")
DEFAULT_PROVIDERS = {"cpu": ("floor", "reference", "cpu", "pml"), "cuda": ("matmul4", "reference", "triton", "cuda", "pml")}


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
    if provider == "floor":
        return lambda x: (x @ x.T).sum().backward()
    if provider == "matmul4":
        return lambda x: [x.detach() @ x.detach().T for _ in range(4)]
    if provider == "pml":
        from pytorch_metric_learning import losses, miners

        loss, miner = losses.MultiSimilarityLoss(), miners.MultiSimilarityMiner()
        return lambda x: loss(x, labels, miner(x, labels)).backward()
    import ms_loss_cuda

    return lambda x: ms_loss_cuda.multi_similarity_loss(x, labels, backend=provider).backward()


def measure_cuda(provider, step, x, repeats):
    import torch

    def run():
        x.grad = None
        step(x)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()  # also the warm-up
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    if provider == "triton":
        from triton.testing import do_bench

        seconds = do_bench(run, return_mode="min") / 1e3
    else:
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        seconds = min(times)
    return {"seconds": seconds, "runs": repeats, "peak_extra_mib": peak_mib, "device_name": torch.cuda.get_device_name()}


def measure(provider, batch, dim, repeats, max_seconds, device="cpu", dtype="float32"):
    import torch

    x0, labels = make_inputs(batch, dim)
    x0, labels = x0.to(device, getattr(torch, dtype)), labels.to(device)
    step = step_function(provider, labels)
    x = x0.clone().requires_grad_()
    if device == "cuda":
        result = measure_cuda(provider, step, x, repeats)
        return dict(result, tflops=4 * 2 * batch * batch * dim / result["seconds"] / 1e12)
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
    if torch.cuda.is_available():
        info["gpu"], info["cuda"] = torch.cuda.get_device_name(), torch.version.cuda
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def available_mib(device="cpu"):
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0] / 2**20
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable")) / 1024


def run_worker(provider, batch, args):
    command = [sys.executable, __file__, "--worker", provider, str(batch), "--dim", str(args.dim),
               "--repeats", str(args.repeats), "--max-seconds", str(args.max_seconds),
               "--device", args.device, "--dtype", args.dtype]
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
    if need_mib > 0.8 * available_mib(args.device):
        return f"out of memory (needs ~{need_mib / 1024:.0f} GiB)"
    if previous["seconds"] * grow > 2 * args.max_seconds:
        return f"skipped (~{previous['seconds'] * grow:.0f} s per step)"
    return None


def write_results(rows, info, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"machine": info, "results": rows}, f, indent=1)
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["provider", "batch", "dim", "device", "dtype", "status", "seconds",
                                               "tflops", "peak_extra_mib", "runs", "threads"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def table(rows, sizes, providers):
    """Markdown table: time, TFLOP/s (CUDA) and peak extra memory per provider and B, then each
    fused backend against the yardstick (floor on CPU, matmul4 on CUDA) and pml against it."""
    by = {(r["provider"], r["batch"]): r for r in rows}

    def cell(r):
        if r.get("status") != "ok":
            return r.get("status", "-")
        rate = f" / {r['tflops']:.1f} TFLOP/s" if "tflops" in r else ""
        return f"{r['seconds']:.3g} s{rate} / {r['peak_extra_mib']:.0f} MiB"

    base = "matmul4" if "matmul4" in providers else "floor"
    ratios = [(f, base) for f in FUSED if f in providers] + [("pml", f) for f in FUSED if f in providers and "pml" in providers]
    lines = ["| B | " + " | ".join(providers) + "".join(f" | {a} / {b}" for a, b in ratios) + " |",
             "|---|" + "---|" * (len(providers) + len(ratios))]
    for batch in sizes:
        ok = {p: by[(p, batch)]["seconds"] for p in providers if by.get((p, batch), {}).get("status") == "ok"}
        ratio = lambda a, b: f"{ok[a] / ok[b]:.2f}x" if a in ok and b in ok else "-"  # noqa: E731
        lines.append(f"| {batch} | " + " | ".join(cell(by.get((p, batch), {})) for p in providers)
                     + "".join(f" | {ratio(a, b)}" for a, b in ratios) + " |")
    return "\n".join(lines)


def plot(rows, info, out, providers):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for provider in providers:
        ok = [r for r in rows if r["provider"] == provider and r["status"] == "ok"]
        if ok:
            batches = [r["batch"] for r in ok]
            ax_time.loglog(batches, [r["seconds"] for r in ok], "o-", label=provider, base=2)
            ax_mem.loglog(batches, [max(r["peak_extra_mib"], 1) for r in ok], "o-", label=provider, base=2)
    ax_time.set(xlabel="batch size B", ylabel="forward+backward time (s)", title=f"time (D={rows[0]['dim']}, {rows[0]['dtype']}, {rows[0]['device']})")
    ax_mem.set(xlabel="batch size B", ylabel="peak memory above inputs (MiB)", title="peak memory")
    for ax in (ax_time, ax_mem):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    where = info.get("gpu") if rows[0]["device"] == "cuda" else f"{info['cpu']}, {info['threads']} threads"
    fig.suptitle(f"{where}, torch {info['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "results.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 65536])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS,
                        help="default: " + "; ".join(f"{d}: {' '.join(p)}" for d, p in DEFAULT_PROVIDERS.items()))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (best is kept)")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="stop repeating after this much time")
    parser.add_argument("--out", default="bench/results/latest")
    parser.add_argument("--worker", nargs=2, metavar=("PROVIDER", "B"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        provider, batch = args.worker[0], int(args.worker[1])
        print(json.dumps(measure(provider, batch, args.dim, args.repeats, args.max_seconds, args.device, args.dtype)))
        return
    providers = args.providers or DEFAULT_PROVIDERS[args.device]

    info = machine_info()
    print(f"machine: {info}", flush=True)
    rows, last = [], {}
    for batch in sorted(args.sizes):
        for provider in providers:
            row = {"provider": provider, "batch": batch, "dim": args.dim, "device": args.device, "dtype": args.dtype}
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
    print(table(rows, sorted(args.sizes), providers))
    plot(rows, info, args.out, providers)
    print(f"\nwrote {args.out}/results.json, results.csv and results.png")


if __name__ == "__main__":
    main()
