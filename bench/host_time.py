"""The host's share of an eager step of the triton backend: the time Python, autograd and torch take
to issue one forward+backward (from an idle device until the step returns). Side by side in one run,
alternating: the shipped eager path (`eager`: a plain autograd.Function, the normalisation's two row
kernels), the same with torch's normalisation ops (`eager-torch-norm`: what eager steps ran before
the row kernels), and the custom ops that torch.compile traces, with torch's normalisation
(`custom-ops`: what every eager step went through before that). Median of --steps steps per round;
the spread over --rounds rounds.
--device cpu (default, no GPU needed): CPU tensors under the Triton interpreter with the kernel
launches stubbed out, so the torch ops run on small CPU tensors instead of launching: a stand-in
for a GPU host's work. --device cuda: the real step, launches included.
    python bench/host_time.py --out bench/results/cpu/host-time.txt
    python bench/host_time.py --device cuda --batch 4096 --ref-rows 262144 --dim 512
"""
import argparse
import json
import os
import statistics
import time


def host_time(step, x, steps, synchronize):
    """Median seconds from an idle device until step(x) returns (bench/benchmark.py's steps)."""
    times = []
    for _ in range(steps):
        x.grad = None
        synchronize()
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--ref-rows", type=int, default=512)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported: CPU tensors are taken
    import torch
    from benchmark import HARDNESS, machine_info, make_inputs, step_function
    from ms_loss_cuda import loss, ops, triton_kernels
    from ms_loss_cuda.triton_kernels import ms_loss as triton_ms_loss

    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.device == "cpu":
        torch.set_num_threads(1)  # the host's work is one thread's
        triton_ms_loss.Launch.__call__ = lambda launch: None
    shipped = (ops._traced, triton_kernels.unit_rows)
    paths = {"eager": shipped, "eager-torch-norm": (ops._traced, loss.unit_rows),
             "custom-ops": (lambda: True, triton_kernels.unit_rows)}  # (traced: torch's normalisation)
    results = {}
    for case, ref_rows in (("self", None), ("memory bank", args.ref_rows)):
        x, labels, ref, ref_labels = make_inputs(args.batch, args.dim, HARDNESS["typical"], ref_rows, args.device)
        x, ref = x.half().requires_grad_(), None if ref is None else ref.half()
        step = step_function("triton", labels, ref, ref_labels)
        rounds = {path: [] for path in paths}
        for _ in range(args.rounds):
            for path, (ops._traced, triton_kernels.unit_rows) in paths.items():
                host_time(step, x, 10, synchronize)  # warm-up
                rounds[path].append(host_time(step, x, args.steps, synchronize))
        ops._traced, triton_kernels.unit_rows = shipped
        results[case] = {path: [round(t * 1e3, 3) for t in times] for path, times in rounds.items()}
    stubbed = ", launches stubbed" if args.device == "cpu" else ""
    lines = [f"host time of one eager triton step on {args.device}{stubbed}, float16, P x 4 batches of typical "
             f"hardness (bench/benchmark.py), B = {args.batch}, "
             f"R = {args.ref_rows} (memory bank), D = {args.dim}, 'mean'; ms, median of {args.steps} steps, "
             f"{args.rounds} alternating rounds"]
    for case, by_path in results.items():
        for path, times in by_path.items():
            lines.append(f"  {case:12s} {path:16s} median {statistics.median(times):.3f}  "
                         f"range {min(times):.3f}-{max(times):.3f}")
    lines.append("machine: " + json.dumps(machine_info()))
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
