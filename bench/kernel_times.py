"""Where one forward+backward step's time goes on a GPU: each kernel's device time per step (torch
profiler), their sum, the step's wall time, so launch overhead and host syncs show as the gap, the
host's time to issue a step (from an idle GPU until the step returns, median of --steps), and the
host ops that take most of it (their own CPU time under the profiler); --cprofile N: also the N
Python functions with the most own time in --steps steps (cProfile), where the host's Python goes.
    python bench/kernel_times.py --dtype float16 --shapes 4096 16384 1024x1048576 --providers triton cuda
Shapes: B (self case) or BxR (B anchors against a memory bank of R rows). Data as bench/benchmark.py
(P x M batches, typical hardness).
"""
import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

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


if __name__ == "__main__":
    main()
