"""Where one forward+backward step's time goes on a GPU: each kernel's device time per step (torch
profiler), their sum, the step's wall time, so launch overhead and host syncs show as the gap, the
host's time to issue a step (from an idle GPU until the step returns, median of --steps), and the
host ops that take most of it (their own CPU time under the profiler); --cprofile N: also the N
Python functions with the most own time in --steps steps (cProfile), where the host's Python goes;
--idle N: N steps each from an idle GPU (as the benchmark's first column times them), and where
the GPU waited inside them: when the first kernel began after the step did, when the host
returned, and the median step's kernels in order, each with when the host issued it, when it began,
how long it ran and how long the GPU was idle before it.
    python bench/kernel_times.py --dtype float16 --shapes 4096 16384 1024x1048576 --providers triton cuda
Shapes: B (self case) or BxR (B anchors against a memory bank of R rows). Data as bench/benchmark.py
(P x M batches, typical hardness).
"""
import argparse
import cProfile
import pstats
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from benchmark import HARDNESS, make_inputs, step_function
from host_time import host_time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--shapes", nargs="+", default=["4096", "16384"])
    parser.add_argument("--providers", nargs="+", default=["triton"])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--idle", type=int, default=0, metavar="N")
    args = parser.parse_args()
    for shape in args.shapes:
        batch, _, ref_rows = shape.partition("x")
        x0, labels, ref, ref_labels = make_inputs(int(batch), args.dim, HARDNESS["typical"],
                                                  int(ref_rows) if ref_rows else None, "cuda")
        dtype = getattr(torch, args.dtype)
        x0, ref = x0.to(dtype), None if ref is None else ref.to(dtype)
        for provider in args.providers:
            x = x0.clone().requires_grad_()
            step = step_function(provider, labels, ref, ref_labels)
            for _ in range(2):  # warm-up: compiles
                x.grad = None
                step(x)
            host = host_time(step, x, args.steps, torch.cuda.synchronize)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                for _ in range(args.steps):
                    x.grad = None
                    step(x)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - start) / args.steps
            kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
            kernels.sort(key=lambda e: -e.device_time_total)
            total = sum(e.device_time_total for e in kernels) / args.steps / 1e3
            print(f"\n== {provider} {args.dtype} {shape}: wall {wall * 1e3:.3f} ms/step, kernels {total:.3f} ms/step, "
                  f"host {host * 1e3:.3f} ms/step")
            for e in kernels[:12]:
                print(f"  {e.device_time_total / args.steps / 1e3:8.3f} ms  x{e.count // args.steps:<3} {e.key[:90]}")
            # the host's side: ops and Python-visible calls by their own CPU time (inflated by the profiler)
            host_ops = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                              key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in host_ops) / args.steps / 1e3
            print(f"  host, self CPU time a step (profiled): {total:.3f} ms")
            for e in host_ops[:12]:
                print(f"  {e.self_cpu_time_total / args.steps / 1e3:8.3f} ms  x{e.count // args.steps:<3} {e.key[:90]}")
            if args.cprofile:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.steps):
                    x.grad = None
                    step(x)
                profiler.disable()
                torch.cuda.synchronize()
                print(f"  Python functions by own time, {args.steps} steps (cProfile):")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
            if args.idle:
                idle_steps(step, x, args.idle)


IDLE_STEP = "idle step"


def idle_steps(step, x, count, min_gap=5):
    """`count` steps, each after a synchronize, under the profiler; per step (µs from the host's start
    of it): the first kernel's start, the host's return, the last kernel's end, and the GPU's idle
    time in between; for the step of median length each kernel with when the host issued it, and
    the GPU's idle time before it where min_gap us or more. (The profiler adds host work of its own:
    the host's times are upper bounds.)"""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(count):
            torch.cuda.synchronize()
            x.grad = None
            with record_function(IDLE_STEP):
                step(x)
        torch.cuda.synchronize()
    events = prof.events()
    hosts = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == IDLE_STEP and e.device_type == DeviceType.CPU)
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and e.name != IDLE_STEP)  # (its GPU-side annotation)
    # the host's call that issued each kernel (a runtime event with the kernel's correlation id)
    calls = {e.id: e.time_range.start for e in events if e.device_type == DeviceType.CPU and e.name.startswith(
        ("cudaLaunch", "cuLaunch", "cudaMemsetAsync", "cudaMemcpyAsync"))}
    issued = {e.time_range.start: calls[e.id] for e in events if e.device_type == DeviceType.CUDA and e.id in calls}
    rows = [gaps(begin, end, [k for k in kernels if begin <= k[0] < following])
            for (begin, end), following in zip(hosts, [h[0] for h in hosts[1:]] + [float("inf")])]
    rows = sorted((row for row in rows if row is not None), key=lambda row: row["span"])
    if not rows:
        print("  no kernel ran in the idle steps")
        return
    print(f"  {len(rows)} steps from an idle GPU (us from the step's start; min / median / max):")
    for key, label in (("first", "first kernel starts"), ("host", "host returns"), ("span", "last kernel ends"),
                       ("idle", "GPU idle in between")):
        values = sorted(row[key] for row in rows)
        print(f"    {label:20} {values[0]:8.0f} {values[len(values) // 2]:8.0f} {values[-1]:8.0f}")
    median = rows[len(rows) // 2]
    print(f"  the median step's kernels (us: issued by the host, started, length, the GPU idle before it where "
          f"{min_gap} us or more):")
    for start, end, name in median["kernels"]:
        idle, issue = median["idle_before"].get(start, 0), issued.get(start + median["begin"])
        issue = "" if issue is None else f"{issue - median['begin']:8.0f}"
        print(f"    {issue:8} {start:8.0f} {end - start:7.0f} "
              f"{f'{idle:7.0f}' if idle >= min_gap else '':7}  {name[:70]}")


def gaps(begin, host_end, kernels):
    """One step's GPU timeline from its kernels' (start, end, name), in µs after `begin`: None without
    kernels; else the first kernel's start, the host's return, the last kernel's end, the idle time
    before and between kernels, the kernels and, by a kernel's start, the GPU's idle time before it."""
    if not kernels:
        return None
    busy_until, idle_before = begin, {}
    for start, end, _ in kernels:
        if start > busy_until:
            idle_before[start - begin] = start - busy_until
        busy_until = max(busy_until, end)
    return {"first": kernels[0][0] - begin, "host": host_end - begin, "span": busy_until - begin,
            "idle": sum(idle_before.values()), "idle_before": idle_before, "begin": begin,
            "kernels": [(start - begin, end - begin, name) for start, end, name in kernels]}


if __name__ == "__main__":
    main()
