"""Forward+backward time and peak memory of the MS loss providers, side by side in one run.

Providers: `floor` (forward+backward of X @ X.T alone: the GEMM work no exact method avoids),
`matmul4` (four X @ X.T products: the issues' GPU yardstick, as the fused forward+backward does
four GEMM-equivalents), `reference` (dense PyTorch), the fused backends `cpu`, `triton` and
`cuda`, `triton-graph` (the triton step captured once in a CUDA graph and replayed: no host work
per step; CUDA only; on a GPU its backward is the chunked one: pair weights to memory 256 MiB at a
time, the second product by cuBLAS), `triton-fused` and `triton-fused-graph` (the same with the
triton backend's fused backward, MS_LOSS_TRITON_CHUNK_MB=0), `triton-tuned` and
`triton-tuned-graph` (with --tuned tune.json: the triton step on the winners of
bench/tune_triton.py's sweep at B = 16384 for this dtype, forward tiles and backward form, so that
one GPU call can sweep and time them beside the shipped entries), and `pml`
(pytorch-metric-learning's MultiSimilarityLoss + MultiSimilarityMiner).
The data is a P x M batch (M = 4 samples per class around class centres); --hardness sets the
noise and so the fraction of pairs mining keeps, which every result records (`mined`: kept pairs
over all pairs of distinct identity, counted on the first 256 anchors): easy (noise 1.2, under 0.1%),
typical (2.0, about 12%), hard (3.0, about 75%).
On CPU every (provider, B) runs in a fresh process, so its peak memory is its own: the process's
high-water mark above the inputs (reset through /proc/self/clear_refs), timed with perf_counter,
best of --repeats (of more for short steps: as many as fit 1 s, at most 100). On CUDA everything
runs in this process: peak memory is torch.cuda.max_memory_allocated above the inputs, time the
median of --repeats runs between CUDA events after a warm-up (which also compiles), and TFLOP/s
counts 4 GEMM-equivalents (4 * 2 * B * R * D flops) per step. --bank R1 R2 .. adds the memory-bank
shape: --bank-batch anchors against R reference rows (gradient to the anchors only, as a memory
bank takes none). A provider whose
predicted peak (linear in B * R from its last size) would not fit in the free memory, or whose
predicted time is over --max-seconds, is recorded as skipped.

    python bench/benchmark.py --sizes 1024 4096 --out bench/results/demo
    python bench/benchmark.py --device cuda --dtype float16 --sizes 4096 16384 --bank 262144 \
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

TRITON = ("triton", "triton-graph", "triton-fused", "triton-fused-graph")
TUNED = ("triton-tuned", "triton-tuned-graph")  # with --tuned
PROVIDERS = ("floor", "matmul4", "reference", "cpu", *TRITON, *TUNED, "cuda", "pml")
FUSED = ("cpu", *TRITON, *TUNED, "cuda")
DEFAULT_PROVIDERS = {"cpu": ("floor", "reference", "cpu", "pml"),
                     "cuda": ("matmul4", "reference", *TRITON, "cuda", "pml")}
HARDNESS = {"easy": 1.2, "typical": 2.0, "hard": 3.0}  # noise around the class centres
PER_CLASS = 4


# ---- data ---------------------------------------------------------------------------------------
def make_inputs(batch, dim, noise=HARDNESS["typical"], ref_rows=None, device="cpu", seed=0):
    """SOP-like P x M data, float32: a batch of `batch` rows (PER_CLASS per class) and, when
    `ref_rows` is given, a memory bank of that many rows of the same classes (and more)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    rows = batch if ref_rows is None else max(batch, ref_rows)
    centres = torch.randn(rows // PER_CLASS + 1, dim, generator=gen, device=device)

    def draw(n):
        labels = torch.arange(n, device=device) // PER_CLASS
        return centres[labels] + noise * torch.randn(n, dim, generator=gen, device=device), labels

    x, labels = draw(batch)
    ref, ref_labels = draw(ref_rows) if ref_rows is not None else (None, None)
    return x, labels, ref, ref_labels


def step_function(provider, labels, ref=None, ref_labels=None, mining=True, tuned=None):
    """One forward+backward of `provider` on embeddings x (and the fixed bank `ref`); mining=False:
    every pair (pytorch-metric-learning's loss without its miner); `tuned`: the tile table of the
    triton-tuned providers."""
    if provider == "floor":
        return lambda x: (x @ (x if ref is None else ref).T).sum().backward()
    if provider == "matmul4":
        def four_products(x):
            for _ in range(4):
                x.detach() @ (x if ref is None else ref).detach().T  # each freed before the next
        return four_products
    if provider == "pml":
        from pytorch_metric_learning import losses, miners

        loss, miner = losses.MultiSimilarityLoss(), miners.MultiSimilarityMiner()
        if not mining:
            return lambda x: loss(x, labels, ref_emb=ref, ref_labels=ref_labels).backward()
        if ref is None:
            return lambda x: loss(x, labels, miner(x, labels)).backward()
        return lambda x: loss(x, labels, miner(x, labels, ref, ref_labels), ref, ref_labels).backward()
    import ms_loss_cuda

    if provider.endswith("-graph"):
        return graphed(step_function(provider[:-len("-graph")], labels, ref, ref_labels, mining, tuned))
    step = lambda x: ms_loss_cuda.multi_similarity_loss(  # noqa: E731
        x, labels, ref_embeddings=ref, ref_labels=ref_labels, mining=mining,
        backend="triton" if provider.startswith("triton") else provider).backward()
    if provider.startswith("triton"):  # the shipped backward, or the fused one (the tuned table names its own)
        step = with_chunk_budget(step, "0" if provider == "triton-fused" else None)
        return with_tiles(step, tuned) if provider == "triton-tuned" else step
    return step


def with_chunk_budget(step, mib):
    """`step` under MS_LOSS_TRITON_CHUNK_MB=mib (0: the triton backend's fused backward; None: unset,
    the shipped default), set before each call, as every triton provider does (one setenv: mock.patch.dict
    copied and restored the whole environment, 77 us a step on this project's CPU machines, inside the
    timed host work)."""
    def run(x):
        if mib is None:
            os.environ.pop("MS_LOSS_TRITON_CHUNK_MB", None)
        else:
            os.environ["MS_LOSS_TRITON_CHUNK_MB"] = mib
        step(x)

    return run


def with_tiles(step, table):
    """`step` with the triton backend's tile table (ms_loss.tile_config, read by every launch plan)
    replaced by `table` during the call."""
    import ms_loss_cuda.triton_kernels.ms_loss as kernels

    def run(x):
        shipped, kernels.tile_config = kernels.tile_config, table
        try:
            step(x)
        finally:
            kernels.tile_config = shipped

    return run


def graphed(step):
    """`step`, captured in a CUDA graph on its first call (after warm-up runs on a side stream, as
    torch.cuda.graphs asks) and replayed afterwards: what a training loop gets from
    torch.cuda.make_graphed_callables or torch.compile(mode="reduce-overhead"). Each replay writes
    x.grad in the graph's own memory."""
    import torch

    graph = torch.cuda.CUDAGraph()
    captured = []

    def run(x):
        if not captured:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    x.grad = None
                    step(x)
            torch.cuda.current_stream().wait_stream(side)
            x.grad = None
            with torch.cuda.graph(graph):
                step(x)
            captured.append(True)
        graph.replay()

    return run


def tuned_from(path, dtype):
    """(tile table, what it holds) from a sweep of bench/tune_triton.py for `dtype` ("float32-tf32": none
    yet, the sweep runs IEEE float32); (None, why) when the sweep has no winner for it."""
    import tune_triton  # (bench/, this script's folder)

    try:
        with open(path) as f:
            found = tune_triton.winners(json.load(f), dtype)
    except (OSError, ValueError) as error:
        return None, f"{path} unreadable: {error}"
    if not found:
        return None, f"{path} has no winners for {dtype}"
    return tune_triton.tuned_table(found), {kind: repr(config) for kind, config in found.items()}


# ---- one measurement ----------------------------------------------------------------------------
def _rss_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def track_peak_rss():
    """Resets this process's resident high-water mark (/proc/self/clear_refs) and returns a function
    that gives the peak since then, in MiB above the resident size now."""
    base_kib = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return lambda: (_rss_kib("VmHWM") - base_kib) / 1024


def measure_cpu(provider, batch, args):
    """Run in a fresh process (see run_worker): peak resident memory above the inputs."""
    import torch

    x0, labels, _, _ = make_inputs(batch, args.dim, HARDNESS[args.hardness])
    x = x0.to(getattr(torch, args.dtype)).requires_grad_()
    step = step_function(provider, labels, mining=not args.no_mining)
    peak_rss_mib = track_peak_rss()
    start = time.perf_counter()
    step(x)  # also the warm-up
    first = time.perf_counter() - start
    peak_mib = peak_rss_mib()
    times = []
    # at least --repeats runs; short steps repeat for 1 s (up to 100 runs): at B = 1024 a single
    # 10 ms step moves by 30% between runs on this shared VM
    while (len(times) < args.repeats or (sum(times) < 1.0 and len(times) < 100)) \
            and sum(times) + first < args.max_seconds:
        x.grad = None
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    return {"seconds": min(times or [first]), "runs": len(times) or 1, "peak_extra_mib": peak_mib,
            "threads": torch.get_num_threads()}


def measure_cuda(provider, inputs, args):
    """In this process: median of CUDA-event timings after a warm-up, peak allocation above the inputs."""
    import statistics

    import torch

    x0, labels, ref, ref_labels = inputs
    x = x0.detach().clone().requires_grad_()
    step = step_function(provider, labels, ref, ref_labels, mining=not args.no_mining, tuned=args.tuned_table)

    def run():
        x.grad = None
        step(x)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run()  # the warm-up: compiles, and measures the peak
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    times = []
    while len(times) < args.repeats and sum(times) < args.max_seconds:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        run()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    seconds = statistics.median(times)
    # back to back: steps issued without waiting for the GPU in between, as a training loop that reads
    # nothing back issues them; the host's work then overlaps the previous step's kernels
    repeats = max(1, min(20, int(args.max_seconds / 4 / seconds)))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return {"seconds": seconds, "runs": len(times), "first_seconds": first, "peak_extra_mib": peak_mib,
            "spread": (max(times) - min(times)) / seconds,
            "back_to_back_seconds": begin.elapsed_time(end) / 1e3 / repeats, "back_to_back_runs": repeats}


# ---- the driver ---------------------------------------------------------------------------------
def machine_info():
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "platform": platform.platform(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
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
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
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
               "--dtype", args.dtype, "--hardness", args.hardness] + (["--no-mining"] if args.no_mining else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        killed = done.returncode in (-9, 137)
        return {"status": "out of memory (killed)" if killed else f"failed: {done.stderr.strip()[-300:]}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), status="ok")


def pairs(row):
    return row["batch"] * (row["ref"] or row["batch"])


def predicted_skip(previous, row, args):
    """Why this shape is skipped, from the provider's last measured shape (linear in B * R), or None."""
    if previous is None:
        return None
    grow = pairs(row) / pairs(previous)
    need_mib = previous["peak_extra_mib"] * grow
    if need_mib > 0.9 * available_mib(args.device):
        return f"out of memory (needs ~{need_mib / 1024:.0f} GiB)"
    if previous["seconds"] * grow > 2 * args.max_seconds:
        return f"skipped (~{previous['seconds'] * grow:.0f} s per step)"
    return None


def write_results(rows, info, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"machine": info, "results": rows}, f, indent=1)
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["provider", "batch", "ref", "dim", "device", "dtype", "hardness",
                                               "mined", "status", "seconds", "tflops", "peak_extra_mib", "runs",
                                               "back_to_back_seconds", "threads"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def shape_name(batch, ref):
    return f"{batch}" if ref is None else f"{batch} x {ref}"


def table(rows, shapes, providers, time_key="seconds"):
    """Markdown table: time, TFLOP/s (CUDA) and peak extra memory per provider and shape, then each
    fused backend against the yardstick (floor on CPU, matmul4 on CUDA) and pml against it.
    time_key="back_to_back_seconds": the times alone, of steps issued back to back (CUDA)."""
    by = {(r["provider"], r["batch"], r["ref"]): {**r, "seconds": r.get(time_key)} for r in rows}

    def cell(r):
        if r.get("status") != "ok":
            return r.get("status", "-")
        if time_key != "seconds":
            return f"{r['seconds']:.3g} s"
        rate = f" / {r['tflops']:.0f} TFLOP/s" if "tflops" in r else ""
        return f"{r['seconds']:.3g} s{rate} / {r['peak_extra_mib']:.0f} MiB"

    base = "matmul4" if "matmul4" in providers else "floor"
    ratios = [(f, base) for f in FUSED if f in providers] + [("pml", f) for f in FUSED if f in providers and "pml" in providers]
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1024, 4096, 8192, 16384, 65536],
                        help="batch sizes of the self case")
    parser.add_argument("--bank", type=int, nargs="*", default=[], metavar="R",
                        help="memory-bank sizes: --bank-batch anchors against R rows (CUDA only)")
    parser.add_argument("--bank-batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--hardness", default="typical", choices=tuple(HARDNESS))
    parser.add_argument("--tf32", action="store_true",
                        help="torch.set_float32_matmul_precision('high'): float32 products on TF32 tensor cores, "
                             "in cuBLAS (matmul4, reference, pml) and in the triton backend alike")
    parser.add_argument("--no-mining", action="store_true", help="every pair, no miner (the 'mining off' level)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS,
                        help="default: " + "; ".join(f"{d}: {' '.join(p)}" for d, p in DEFAULT_PROVIDERS.items()))
    parser.add_argument("--tuned", metavar="TUNE_JSON",
                        help="add the triton-tuned providers: the winners of bench/tune_triton.py's sweep (CUDA only)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="stop repeating after this much time")
    parser.add_argument("--out", default="bench/results/latest")
    parser.add_argument("--worker", nargs=2, metavar=("PROVIDER", "B"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure_cpu(args.worker[0], int(args.worker[1]), args)))
        return
    if (args.bank or args.tuned) and args.device != "cuda":
        parser.error("--bank and --tuned need --device cuda")
    providers = args.providers or DEFAULT_PROVIDERS[args.device] + (TUNED if args.tuned else ())
    shapes = [(b, None) for b in sorted(args.sizes)] + [(args.bank_batch, r) for r in sorted(args.bank)]

    import torch

    from ms_loss_cuda import reference

    if args.tf32:
        torch.set_float32_matmul_precision("high")
    info = machine_info()
    info["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    tuned_dtype = args.dtype + ("-tf32" if args.tf32 else "")
    args.tuned_table, info["tuned"] = tuned_from(args.tuned, tuned_dtype) if args.tuned else (None, None)
    if args.tuned_table is None and set(TUNED) & set(providers):
        if not args.tuned:
            parser.error("the triton-tuned providers need --tuned")
        providers = [p for p in providers if p not in TUNED]  # (no winners for this dtype: info["tuned"] says so)
    print(f"machine: {info}", flush=True)
    rows, last = [], {}
    for batch, ref_rows in shapes:
        inputs = make_inputs(batch, args.dim, HARDNESS[args.hardness], ref_rows, args.device)
        mined = 1.0 if args.no_mining else reference.mined_fraction(*inputs)
        if args.device == "cuda":
            torch.cuda.empty_cache()  # (its similarity block would hide free memory from predicted_skip)
        dtype = getattr(torch, args.dtype)
        inputs = tuple(t if t is None or not t.is_floating_point() else t.to(dtype) for t in inputs)
        for provider in providers:
            row = {"provider": provider, "batch": batch, "ref": ref_rows, "dim": args.dim, "device": args.device,
                   "dtype": args.dtype, "hardness": "mining off" if args.no_mining else args.hardness,
                   "mined": mined}
            skip = predicted_skip(last.get((provider, ref_rows is None)), row, args)
            print(f"[{shape_name(batch, ref_rows):>14}] {provider:<9} ", end="", flush=True)
            if skip:
                row["status"] = skip
            elif args.device == "cpu":
                row.update(run_worker(provider, batch, args))
            else:
                try:
                    row.update(measure_cuda(provider, inputs, args), status="ok")
                    row["tflops"] = 4 * 2 * pairs(row) * args.dim / row["seconds"] / 1e12
                except torch.cuda.OutOfMemoryError:
                    row["status"] = "out of memory"
                except Exception as error:  # noqa: BLE001  (recorded, and the run goes on)
                    row["status"] = f"failed: {type(error).__name__}: {str(error)[:300]}"
                torch.cuda.empty_cache()
            if row["status"] == "ok":
                last[(provider, ref_rows is None)] = row
                print(f"{row['seconds']:.4g} s, peak +{row['peak_extra_mib']:.0f} MiB", flush=True)
            else:
                print(row["status"], flush=True)
            rows.append(row)
            write_results(rows, info, args.out)
        del inputs
    print()
    print(table(rows, shapes, providers))
    if args.device == "cuda":
        print("\nBack to back (each step issued without waiting for the last):")
        print(table(rows, shapes, providers, "back_to_back_seconds"))
    plot(rows, info, args.out, providers)
    print(f"\nwrote {args.out}/results.json, results.csv and results.png")


if __name__ == "__main__":
    main()
