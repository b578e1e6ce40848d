"""The host time of an eager triton step in this checkout and in another one, side by side: one worker
process per checkout, taking turns every --chunk steps (the order alternating), so that a noisy
machine slows both alike; the 10th percentile, median and 90th percentile of all steps per checkout.
The steps are bench/host_time.py's (the self case, a memory bank, a full CrossBatchMemory): on CPU
(default) the GPU's launch plans on small CPU tensors, every launch through Triton's launch path down
to a stand-in driver, and with --replayed each step replayed by a stand-in graph, as a GPU replays it
from a shape's third call; --device cuda the real step.
    git worktree add /tmp/before HEAD~1
    python bench/host_time_versus.py /tmp/before --out bench/results/cpu/host-time-versus.txt
    python bench/host_time_versus.py /tmp/before --replayed --out bench/results/cpu/host-time-versus-replayed.txt
The other checkout needs no install: its ms_loss_cuda and triton_kernels are imported from its tree
(without its C++ extension, which the triton backend does not use).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys

from host_time import CASES, add_size_options

HERE = os.path.dirname(os.path.abspath(__file__))


def import_checkout(root):
    """ms_loss_cuda (and ms_loss_cuda.triton_kernels, which setup.py maps from triton_kernels/) from
    the checkout at `root`, ahead of any installed copy; SystemExit where `root` holds no ms_loss_cuda
    package (the installed one would be measured in its place)."""
    if not os.path.isfile(os.path.join(root, "ms_loss_cuda", "__init__.py")):
        raise SystemExit(f"{root} is not a checkout of this project: it has no ms_loss_cuda/__init__.py")
    sys.path.insert(0, root)
    kernels = os.path.join(root, "triton_kernels")
    if not os.path.isdir(os.path.join(root, "ms_loss_cuda", "triton_kernels")) and os.path.isdir(kernels):
        import ms_loss_cuda

        spec = importlib.util.spec_from_file_location("ms_loss_cuda.triton_kernels",
                                                      os.path.join(kernels, "__init__.py"),
                                                      submodule_search_locations=[kernels])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = ms_loss_cuda.triton_kernels = module
        spec.loader.exec_module(module)


def revision(root):
    """The checkout's commit, and whether it has uncommitted changes; "no git checkout" for a tree that
    is not a repository's root (a `git archive` unpacked inside another one reads that one's)."""
    def git(*command):
        return subprocess.run(["git", "-C", root, *command], capture_output=True, text=True).stdout.strip()

    top = git("rev-parse", "--show-toplevel")
    if not top or os.path.realpath(top) != os.path.realpath(root):
        return "no git checkout"
    return f"commit {git('rev-parse', '--short', 'HEAD') or '?'}" + (" + uncommitted changes" if git(
        "status", "--porcelain", "--untracked-files=no") else "")


def serve(args):
    """A worker: builds the step on the checkout args.serve, then times `n` steps for each line n it reads."""
    import_checkout(args.serve)
    import torch
    from benchmark import HARDNESS, make_inputs, step_function
    from host_time import cpu_stand_in, memory_step, stand_in_graphs, step_times

    from ms_loss_cuda import triton_kernels

    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.device == "cpu":
        cpu_stand_in("launcher")
        if args.replayed:
            stand_in_graphs()
    x, labels, ref, ref_labels = make_inputs(args.batch, args.dim, HARDNESS["typical"],
                                             None if args.case == "self" else args.ref_rows, args.device)
    x, ref = x.half().requires_grad_(), None if ref is None else ref.half()
    if args.case == "cross-batch memory":
        step = memory_step(labels, ref, ref_labels)
    else:
        step = step_function("triton", labels, ref, ref_labels)
    step_times(step, x, 20, synchronize)  # compiles, warms the caches
    print(json.dumps(triton_kernels.__file__), flush=True)
    for line in sys.stdin:
        print(json.dumps(step_times(step, x, int(line), synchronize)), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("other", nargs="?", help="the other checkout's root")
    add_size_options(parser)
    parser.add_argument("--turns", type=int, default=20, help="turns per checkout and case")
    parser.add_argument("--chunk", type=int, default=50, help="steps per turn")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--replayed", action="store_true",
                        help="--device cpu: steps replayed as host_time.py's stand-in graphs (as on a GPU from a "
                             "shape's third call), else launched")
    parser.add_argument("--out")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)
    checkouts = {"this": os.path.dirname(HERE), "other": os.path.abspath(args.other)}
    how = ", replayed (stand-in graphs)" if args.replayed and args.device == "cpu" else ""
    lines = [f"host time of one eager triton step on {args.device}{how}, float16, P x 4 batches of typical hardness, "
             f"B = {args.batch}, R = {args.ref_rows} (memory bank, cross-batch memory), D = {args.dim}, 'mean'; ms "
             f"over {args.turns} turns of {args.chunk} steps per checkout, the two taking turns (one thread each on "
             f"CPU)"]
    for case in args.cases:
        workers, times = {}, {}
        for name, root in checkouts.items():
            command = [sys.executable, __file__, "--serve", root, "--case", case, "--device", args.device,
                       "--batch", str(args.batch), "--ref-rows", str(args.ref_rows), "--dim", str(args.dim)]
            command += ["--replayed"] if args.replayed else []
            workers[name] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                             cwd=HERE, env=dict(os.environ, PYTHONPATH=HERE))
            times[name] = []
            if case == args.cases[0]:
                lines.append(f"  {name}: {root}, {revision(root)} (kernels from "
                             f"{json.loads(workers[name].stdout.readline())})")
            else:
                workers[name].stdout.readline()
        for turn in range(args.turns):
            for name in (list(workers) if turn % 2 == 0 else list(workers)[::-1]):
                workers[name].stdin.write(f"{args.chunk}\n")
                workers[name].stdin.flush()
                times[name] += json.loads(workers[name].stdout.readline())
        for name, worker in workers.items():
            worker.stdin.close()
            worker.wait()
            ranked = sorted(times[name])
            at = lambda q: ranked[round(q * (len(ranked) - 1))] * 1e3  # noqa: E731
            lines.append(f"  {case:18s} {name:6s} p10 {at(0.1):.3f}  median {at(0.5):.3f}  p90 {at(0.9):.3f}")
    from host_time import report

    report(lines, args.out)


if __name__ == "__main__":
    main()
