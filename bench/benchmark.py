"""Forward+backward time and peak memory of the MS loss providers, side by side in one run: the
measuring, the driver and its command line. What is timed, the providers and the data, is
bench/providers.py's; the result files, the table with its legend and the plot, bench/report.py's.

Providers: floor, matmul4, reference, cpu, triton, triton-fused, triton-tuned (with --tuned), cuda,
compiled (bench/compiled_loss.py under torch.compile), pml, and on CUDA the -graph variants
(bench/providers.py describes each). The data is a P x 4 batch; --hardness sets the fraction of pairs
mining keeps, which every result records (`mined`: kept pairs over all pairs of distinct identity,
counted on the first 256 anchors). With a compiled provider the run first checks, once, that the
compiled loss and its gradient match ms_loss_cuda's reference on small float64 data
(bench/compiled_loss.py: check), and stops if not.
On CPU every (provider, B) runs in a fresh process, so its peak memory is its own: a first call, neither
timed nor in the peak (`first_seconds` keeps its time), makes the allocations that last, such as thread
pools, and for `compiled` the compile (from an empty inductor cache); the peak is then the process's
high-water mark above the inputs (reset through /proc/self/clear_refs) in the next call, the warm-up;
time: perf_counter, best of --repeats (of more for short steps: as many as fit 1 s, at most 100). On
CUDA everything runs in this process: peak memory is torch.cuda.max_memory_allocated above the inputs
(and `kept_mib` what stays between steps, CUDA graphs' private pools included),
time the median of --repeats runs between CUDA events after a warm-up (which also compiles), and
TFLOP/s counts 4 GEMM-equivalents (4 * 2 * B * R * D flops) per step. --bank R1 R2 .. adds the
memory-bank shape: --bank-batch anchors against R reference rows (gradient to the anchors only, as a
memory bank takes none). A provider whose predicted peak (linear in B * R from its last size) would
not fit in the free memory, or whose predicted time is over --max-seconds, is recorded as skipped.

    python bench/benchmark.py --sizes 1024 4096 --out bench/results/demo
    python bench/benchmark.py --device cuda --dtype float16 --sizes 4096 16384 --bank 262144 \
        --providers matmul4 triton cuda compiled pml --out bench/results/gpu
write results.json, results.csv and results.png there and print a table.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

# (bench/, this script's folder; the other bench scripts take make_inputs, step_function and HARDNESS from here)
from providers import (COMPILED, DEFAULT_PROVIDERS, HARDNESS, PER_CLASS, PROVIDERS, SELF_CASE, TUNED, make_inputs,
                       step_function)
from report import legend, plot, shape_name, table, write_results


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


def release_free_memory():
    """Hands the C heap's free pages back to the system (glibc malloc_trim), so that the resident
    high-water mark of the next step counts what it allocates, not reuse of what the first call left free."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_cpu(provider, batch, args):
    """Run in a fresh process (see run_worker): a first call, untimed, which compiles (compiled) and makes
    the allocations that last (thread pools); then the warm-up, whose peak resident memory above the
    inputs is the step's; then the timed runs."""
    import torch

    x0, labels, _, _ = make_inputs(batch, args.dim, HARDNESS[args.hardness])
    x = x0.to(getattr(torch, args.dtype)).requires_grad_()
    step = step_function(provider, labels, mining=not args.no_mining)
    start = time.perf_counter()
    step(x)
    first = time.perf_counter() - start
    x.grad = None
    release_free_memory()
    peak_rss_mib = track_peak_rss()
    start = time.perf_counter()
    step(x)  # the warm-up, which measures the peak
    warm = time.perf_counter() - start
    peak_mib = peak_rss_mib()
    times = []
    # at least --repeats runs; short steps repeat for 1 s (up to 100 runs): a single short step's time
    # moves a lot between runs on a shared machine
    while (len(times) < args.repeats or (sum(times) < 1.0 and len(times) < 100)) \
            and sum(times) + warm < args.max_seconds:
        x.grad = None
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    return {"seconds": min(times or [warm]), "runs": len(times), "peak_extra_mib": peak_mib,
            "first_seconds": first, "threads": torch.get_num_threads()}


def kept_between_steps_mib(base):
    """What a provider keeps on the GPU between steps, in MiB: the tensors still allocated above `base`,
    and the free part of CUDA graphs' private pools, which nothing else allocates from (None where
    torch's memory snapshot does not name the pools)."""
    import torch

    segments = torch.cuda.memory_snapshot()
    if any("segment_pool_id" not in segment for segment in segments):
        return None
    pools = sum(segment["total_size"] - segment["allocated_size"] for segment in segments
                if tuple(segment["segment_pool_id"]) != (0, 0))
    return (torch.cuda.memory_allocated() - base + pools) / 2**20


def measure_cuda(provider, inputs, args):
    """In this process: median of CUDA-event timings after a warm-up, peak allocation above the inputs
    during the warm-up's three calls (the compiles; the CUDA graphs' warm-up and recording, and what
    they keep)."""
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
    # two more: CUDA graphs (torch's, and the triton backend's replay) record at the second call and
    # replay from the third; what they keep between steps is in the peak
    for _ in range(2):
        run()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    x.grad = None
    torch.cuda.synchronize()
    kept_mib = kept_between_steps_mib(base)
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
            "kept_mib": kept_mib,
            "spread": (max(times) - min(times)) / seconds,
            "back_to_back_seconds": begin.elapsed_time(end) / 1e3 / repeats, "back_to_back_runs": repeats}


# ---- the driver ---------------------------------------------------------------------------------
def require_device(parser, device):
    """A parser error, before any work, where `device` is cuda and torch sees no GPU."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: this torch ({torch.__version__}) sees no CUDA GPU")


def build_name():
    """The checkout's commit, with "+ uncommitted changes" where its tracked files differ; "unknown"
    outside a git checkout (a copy of the tree)."""
    def git(*command):
        return subprocess.run(["git", *command], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    return commit + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine_info():
    import torch

    info = {"build": build_name(), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "platform": platform.platform(), "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d")}
    settings = {name: value for name, value in sorted(os.environ.items()) if name.startswith("MS_LOSS_")}
    if settings:  # (the backends' budgets and switches, where set: bench workers inherit them)
        info["settings"] = settings
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
               "--dtype", args.dtype, "--hardness", args.hardness] + (["--no-mining"] if args.no_mining else []) \
        + (["--tf32"] if args.tf32 else [])
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:  # a compile from an empty cache, as at first
        result, failure = run_json_worker(command, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache))
    return {"status": failure} if failure else dict(result, status="ok")


def run_json_worker(command, env=None):
    """Runs a bench script's worker `command` in a fresh process, whose last line of output is a JSON
    dict: (that dict, None), or (None, why it failed: killed, out of memory, or its error's last line)."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][-300:]
        return None, "out of memory (killed)" if done.returncode in (-9, 137) else f"failed: {last}"
    return json.loads(done.stdout.strip().splitlines()[-1]), None


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


def check_compiled(providers, args):
    """Once a run: each compiled provider's loss and gradient against ms_loss_cuda's reference on small
    float64 data, on --device, the self case (and the bank with --bank); stops the run on a mismatch.
    Returns what info records: the largest relative error and the seconds the check took (compiles)."""
    import compiled_loss

    start, error = time.perf_counter(), 0.0
    for provider in providers:
        graphs = provider == "compiled-graph"
        loss = compiled_loss.compiled(graphs)
        for bank in (False, True) if args.bank else (False,):
            error = max(error, compiled_loss.check(loss, args.device, bank, not args.no_mining, 3 if graphs else 1))
    seconds = time.perf_counter() - start
    print(f"compiled loss against the reference (float64): largest relative error {error:.2g} ({seconds:.0f} s)",
          flush=True)
    return {"largest_relative_error": error, "seconds": seconds}


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
        if args.tf32:  # (a worker times under the precision its parent records)
            import torch

            torch.set_float32_matmul_precision("high")
        print(json.dumps(measure_cpu(args.worker[0], int(args.worker[1]), args)))
        return
    if (args.bank or args.tuned) and args.device != "cuda":
        parser.error("--bank and --tuned need --device cuda")
    counts = (("sizes", min(args.sizes, default=1)), ("bank", min(args.bank, default=1)),
              ("bank-batch", args.bank_batch), ("dim", args.dim), ("repeats", args.repeats))
    small = [(name, value) for name, value in counts if value < 1]
    if small or not args.max_seconds > 0:
        parser.error(f"--{small[0][0]} must be at least 1, got {small[0][1]}" if small else "--max-seconds must be > 0")
    if not args.sizes and not args.bank:
        parser.error("nothing to measure: give --sizes (or --bank)")
    uneven = [b for b in args.sizes + [args.bank_batch] * bool(args.bank) if b % PER_CLASS]
    if uneven:
        parser.error(f"batch sizes are P classes of {PER_CLASS} samples: {uneven[0]} is not a multiple of {PER_CLASS}")
    require_device(parser, args.device)
    import torch

    providers = args.providers or DEFAULT_PROVIDERS[args.device] + (TUNED if args.tuned else ())
    shapes = [(b, None) for b in sorted(args.sizes)] + [(args.bank_batch, r) for r in sorted(args.bank)]

    from ms_loss_cuda import reference

    if args.tf32:
        torch.set_float32_matmul_precision("high")
    info = machine_info()
    info["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    tuned_dtype = args.dtype + ("-tf32" if args.tf32 else "")
    args.tuned_table, info["tuned"] = None, None
    if args.tuned:
        from triton_internals import tuned_from

        args.tuned_table, info["tuned"] = tuned_from(args.tuned, tuned_dtype)
    if args.tuned_table is None and set(TUNED) & set(providers):
        if not args.tuned:
            parser.error("the triton-tuned providers need --tuned")
        providers = [p for p in providers if p not in TUNED]  # (no winners for this dtype: info["tuned"] says so)
    print(f"machine: {info}", flush=True)
    if set(COMPILED) & set(providers):
        info["compiled_check"] = check_compiled([p for p in providers if p in COMPILED], args)
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
            if provider in SELF_CASE and ref_rows is not None:
                skip = "skipped (the self case's variant: a bank runs as triton)"
            print(f"[{shape_name(batch, ref_rows):>14}] {provider:<14} ", end="", flush=True)
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
                if provider in COMPILED:
                    torch.compiler.reset()  # (frees its CUDA graphs' memory for the providers after it)
                if provider.startswith("triton"):
                    from ms_loss_cuda.triton_kernels import replay

                    replay.clear()  # (the same for the triton backend's)
                torch.cuda.empty_cache()
            if row["status"] == "ok":
                last[(provider, ref_rows is None)] = row
                compile_note = f" (first call {row['first_seconds']:.1f} s)" if provider in COMPILED else ""
                kept = f", kept {row['kept_mib']:.0f} MiB" if row.get("kept_mib") is not None else ""
                print(f"{row['seconds']:.4g} s, peak +{row['peak_extra_mib']:.0f} MiB{kept}{compile_note}", flush=True)
            else:
                print(row["status"], flush=True)
            rows.append(row)
            write_results(rows, info, args.out)
        del inputs
    print()
    print(table(rows, shapes, providers))
    print("\n" + legend(rows, providers))
    if args.device == "cuda":
        print("\nBack to back (each step issued without waiting for the last):")
        print(table(rows, shapes, providers, "back_to_back_seconds"))
    plot(rows, info, args.out, providers)
    print(f"\nwrote {args.out}/results.json, results.csv and results.png")


if __name__ == "__main__":
    main()
