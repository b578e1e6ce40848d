"""The host's work of one eager triton step in instructions, counted by valgrind (callgrind), for this
checkout and others side by side. Times of the same step move by 10-20% from one run to the next on
this project's shared CPU machines (bench/host_time_versus.py); the instruction count of two runs of
one build stays within 0.5%, so a change of a few percent shows. The step is bench/host_time.py's
CPU stand-in: the GPU's launch plans on small CPU tensors, each launch through Triton's launch path
down to a stand-in driver (--launches stubbed: none of it), the cuBLAS products left out; with
--replayed each step replayed by a stand-in graph, as a GPU replays it from a shape's third call
(the replay itself, one driver call on a GPU, left out). Only the
--steps counted steps are instrumented (the imports and warm-up run without: about a minute a run);
one valgrind process per checkout and case, all at once. Beside them, once, a bare autograd node
with the replayed backward's ops (`FLOOR`): the least any loss node costs the host. Needs valgrind
(apt install valgrind).
    git worktree add /tmp/before HEAD~1
    python bench/host_instructions.py . /tmp/before --out bench/results/cpu/host-instructions.txt
    python bench/host_instructions.py . /tmp/before --replayed --out bench/results/cpu/host-instructions-replayed.txt
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

from host_time import add_size_options

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = ("self", "memory bank")
FLOOR = "autograd floor"  # measured once, beside the first checkout (it runs none of a checkout's code)


def serve(root, case, launches, replayed, batch, ref_rows, dim):
    """A worker (run under valgrind): builds the step on the checkout `root`, warms it up, then says
    "ready" and runs the steps it is told to, answering "done"."""
    from host_time_versus import import_checkout

    import_checkout(root)
    import torch
    from benchmark import HARDNESS, make_inputs, step_function
    from host_time import cpu_stand_in, stand_in_graphs

    cpu_stand_in(launches)
    if replayed:
        stand_in_graphs()
    bank_rows = ref_rows if case == "memory bank" else None
    x, labels, ref, ref_labels = make_inputs(batch, dim, HARDNESS["typical"], bank_rows, "cpu")
    x, ref = x.half().requires_grad_(), None if ref is None else ref.half()
    step = floor_step(x.shape) if case == FLOOR else step_function("triton", labels, ref, ref_labels)
    for _ in range(10):  # compiles, warms the caches
        x.grad = None
        step(x)
    print("ready", flush=True)
    for _ in range(int(sys.stdin.readline())):
        x.grad = None
        step(x)
    print("done", flush=True)
    sys.stdin.readline()  # (instrumentation is off again: the exit is not counted)


def floor_step(shape):
    """A step through a bare autograd node (`FLOOR`) on rows of `shape`: its forward one torch op (the
    loss), its backward the two of the triton backend's replayed backward (a float32 gradient kept
    from the forward times grad_output, rounded into the rows' dtype), then autograd's engine and
    the gradient's accumulation: what any loss node costs the host before the loss's own work."""
    import torch

    gradient = torch.ones(shape)

    class OneOpEachWay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows):
            return rows.new_zeros(())

        @staticmethod
        def backward(ctx, grad):
            return torch.mul(gradient, grad, out=torch.empty_like(gradient, dtype=torch.float16))

    return lambda x: OneOpEachWay.apply(x).backward()


def count(runs, steps):
    """{(root, case): instructions per step} of the workers in `runs` {(root, case): (process, log)}."""
    for process, _ in runs.values():
        assert process.stdout.readline().strip() == "ready", "a worker failed (its valgrind log has why)"
    for process, _ in runs.values():  # one at a time, so that each counts its own steps only
        subprocess.run(["callgrind_control", "--instr=on", str(process.pid)], check=True, capture_output=True)
        process.stdin.write(f"{steps}\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "done"
        subprocess.run(["callgrind_control", "--instr=off", str(process.pid)], check=True, capture_output=True)
        process.stdin.write("end\n")
        process.stdin.flush()
    counts = {}
    for key, (process, log) in runs.items():
        process.wait()
        with open(log) as file:
            collected = re.search(r"Collected : (\d+)", file.read())
        counts[key] = int(collected.group(1)) / steps
    return counts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("checkouts", nargs="*", help="checkout roots ('.': this one)")
    add_size_options(parser)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--launches", default="launcher", choices=("launcher", "stubbed"))
    parser.add_argument("--replayed", action="store_true", help="each step replayed by a stand-in graph")
    parser.add_argument("--out")
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve[0], args.serve[1], args.launches, args.replayed, args.batch, args.ref_rows, args.dim)
    if not args.checkouts:
        parser.error("name at least one checkout")
    from host_time import report
    from host_time_versus import revision

    roots = [os.path.abspath(root) for root in args.checkouts]
    with tempfile.TemporaryDirectory() as scratch:
        runs = {}
        measured = [(root, case) for root in roots for case in CASES] + [(roots[0], FLOOR)]
        for number, (root, case) in enumerate(measured):
            log = os.path.join(scratch, f"valgrind-{number}.log")
            command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--log-file={log}",
                       f"--callgrind-out-file={scratch}/callgrind-{number}.out", sys.executable, __file__,
                       "--serve", root, case, "--launches", args.launches, "--batch", str(args.batch),
                       "--ref-rows", str(args.ref_rows), "--dim", str(args.dim)] + ["--replayed"] * args.replayed
            runs[root, case] = (subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                                 cwd=HERE, env=dict(os.environ, PYTHONPATH=HERE)), log)
        counts = count(runs, args.steps)
    how = {"launcher": "each launch through Triton's launch path, no driver calls", "stubbed": "launches stubbed"}
    replayed = ", replayed by stand-in graphs" if args.replayed else ""
    lines = [f"instructions (valgrind --tool=callgrind) of one eager triton step on CPU tensors with the GPU's plans, "
             f"{how[args.launches]}{replayed}, float16, P x 4 batches of typical hardness, B = {args.batch}, "
             f"R = {args.ref_rows} (memory bank), D = {args.dim}, 'mean'; per step over {args.steps} steps"]
    for root in roots:
        lines.append(f"  {root}: {revision(root)}")
        lines += [f"    {case:12s} {counts[root, case] / 1e3:8.0f} k" for case in CASES]
    lines.append(f"  {FLOOR} (a bare autograd node, one torch op forward and the replayed backward's two): "
                 f"{counts[roots[0], FLOOR] / 1e3:.0f} k")
    report(lines, args.out)


if __name__ == "__main__":
    main()
