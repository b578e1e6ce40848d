"""The host's share of an eager step of the triton backend: the time Python, autograd and torch take
to issue one forward+backward (from an idle device until the step returns). Side by side in one run,
alternating: the shipped eager path as it runs from a shape's third call on (`replayed`: one
autograd node for the whole call, triton_kernels' eager_loss, whose step replays a CUDA graph), the
same step with its launches issued (`eager`: MS_LOSS_CUDA_GRAPHS=0, the first call of a shape and
the steps not captured) and the custom ops that torch.compile traces, with torch's normalisation
and reduction (`custom-ops`). Median of --steps steps per round; the spread over --rounds rounds
(bench/host_time_versus.py compares two checkouts). Each result counts the step's Triton launches
and cuBLAS products.
--device cpu (default, no GPU needed): a stand-in for a GPU host's work. The GPU's launch plans
(an H100's tiles, 132 multiprocessors, the chunked backward) are made for CPU tensors, and each
launch goes through Triton's own launch path (argument binding, specialisation, cache lookup)
down to the driver call, which a stand-in driver drops (--launches launcher; each kernel is
compiled for sm_90 on its first launch), or is dropped whole (--launches stubbed). torch's ops run
on small CPU tensors; the cuBLAS products are left out. A stand-in graph replays nothing (on a GPU
a replay is one driver call). --device cuda: the real step, launches and graphs included.
    python bench/host_time.py --out bench/results/cpu/host-time.txt
    python bench/host_time.py --device cuda --batch 4096 --ref-rows 262144 --dim 512
"""
import argparse
import json
import statistics
import time


# the self case, a memory bank (no gradient), and a full CrossBatchMemory of the bank's size (its step:
# the store, the batch's term and the memory's)
CASES = ("self", "memory bank", "cross-batch memory")


def add_size_options(parser):
    """The step's sizes (--batch, --ref-rows, --dim), one set of defaults for the host-time scripts,
    whose figures compare at equal sizes only."""
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--ref-rows", type=int, default=512)
    parser.add_argument("--dim", type=int, default=128)


def step_times(step, x, steps, synchronize):
    """Seconds from an idle device until step(x) returns, for each of `steps` steps (bench/benchmark.py's)."""
    times = []
    for _ in range(steps):
        x.grad = None
        synchronize()
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    return times


def host_time(step, x, steps, synchronize):
    """The median of `step_times`."""
    return statistics.median(step_times(step, x, steps, synchronize))


def without_driver_calls():
    """Triton's launches on CPU tensors, from the JIT function's argument binding to the compiled
    kernel's launcher, whose driver call is dropped: a stand-in driver (device 0, stream 0, an
    H100's target) for Triton 3.4-3.9. The real launcher's own C work (the pointers read, the
    driver's launch: a few us) is left out."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import CompiledKernel

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(Driver())

    def init_handles(kernel):  # (in place of loading the binary, which sets the launcher)
        if "_run" in vars(kernel):  # Triton 3.5 on: the `run` property returns `_run`
            kernel._run = kernel._run or (lambda *args: None)
        else:  # 3.4: `run` itself
            vars(kernel).setdefault("run", lambda *args: None)

    CompiledKernel._init_handles = init_handles


def cpu_stand_in(launches):
    """The GPU's step on CPU tensors: the triton backend's launch plans as they are; each launch through
    Triton's launch path (launches="launcher") or dropped whole ("stubbed"); the cuBLAS products left
    out; the self case's label order zeroed (one op)."""
    import torch

    from ms_loss_cuda.triton_kernels import BACKEND, backward, launcher, row_kernels

    torch.set_num_threads(1)  # the host's work is one thread's
    BACKEND.unavailable_reason = lambda device, dtype=None: None  # (CPU tensors, without the interpreter)
    # no products either: on CPU they would compute, on the launches' unwritten (garbage, often
    # subnormal) weights, where a GPU's host only issues two ops
    backward.Product.__call__ = lambda product: None
    if launches == "stubbed":
        launcher.Launch.__call__ = lambda launch: None
    else:
        without_driver_calls()
    launch = launcher.Launch.__call__

    def with_label_order(self):
        launch(self)
        if self.kernel is row_kernels.label_order_kernel:  # valid indices for the backward's plan to read,
            self.args["saved_ptr"].zero_()  # where the kernel writes the label order (an op a GPU's step has not)

    launcher.Launch.__call__ = with_label_order


class StandInGraph:
    """A CUDA graph's stand-in on CPU: the capture ran the step once; a replay does nothing."""

    def replay(self):
        pass


def stand_in_graphs():
    """CPU steps captured and replayed as a GPU's are, with `StandInGraph`s."""
    from ms_loss_cuda.triton_kernels import replay

    replay.capturable = lambda device: True
    replay.capture = lambda step, inputs: (StandInGraph(), step(*inputs))


def memory_step(labels, ref, ref_labels):
    """A training step's loss with a full CrossBatchMemory (triton backend) that holds the rows `ref`
    (normalised) and their labels, ids 0 ... R - 1 (the batch's come after)."""
    import torch

    from memory_benchmark import full_memory

    memory = full_memory(torch.nn.functional.normalize(ref.float(), dim=1).to(ref.dtype), ref_labels, "triton")
    ids = torch.arange(ref.shape[0], ref.shape[0] + labels.shape[0], device=labels.device)
    return lambda x: memory(x, labels, ids).backward()


def path_step(path, case, labels, ref, ref_labels):
    """The step of one of the paths the module's docstring names, for one of CASES."""
    from benchmark import step_function
    from providers import as_if_traced, with_settings

    if case == "cross-batch memory":
        step = with_settings(memory_step(labels, ref, ref_labels), None, path != "eager")
    else:
        step = step_function("triton-direct" if path == "eager" else "triton", labels, ref, ref_labels)
    return as_if_traced(step) if path == "custom-ops" else step


def count_launches():
    """{"launches": Triton launches, "launch_s": their time, "products": cuBLAS products} issued so
    far (counting wrappers)."""
    from ms_loss_cuda.triton_kernels.backward import Product
    from ms_loss_cuda.triton_kernels.launcher import Launch

    counts = {"launches": 0, "launch_s": 0.0, "products": 0}
    launch, product = Launch.__call__, Product.__call__

    def counted_launch(self):
        start = time.perf_counter()
        launch(self)
        counts["launches"] += 1
        counts["launch_s"] += time.perf_counter() - start

    def counted_product(self):
        counts["products"] += 1
        product(self)

    Launch.__call__, Product.__call__ = counted_launch, counted_product
    return counts


def report(lines, out=None, machine=None):
    """Prints the result's lines and the machine's (`machine`, benchmark.machine_info's, taken now where
    not given), and writes them to the file `out` when given."""
    from benchmark import machine_info

    lines = lines + ["machine: " + json.dumps(machine or machine_info())]
    print("\n".join(lines))
    if out:
        with open(out, "w") as file:
            file.write("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser()
    add_size_options(parser)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--launches", default="launcher", choices=("launcher", "stubbed"),
                        help="--device cpu: Triton's launch path down to the driver call, or none of it")
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch
    from benchmark import HARDNESS, machine_info, make_inputs
    machine = machine_info()  # (before the steps, which set MS_LOSS_CUDA_GRAPHS for their paths)
    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.device == "cpu":
        cpu_stand_in(args.launches)
        stand_in_graphs()
    launched = count_launches()
    paths = ("replayed", "eager", "custom-ops")
    results, counts = {}, {}
    for case in CASES:
        ref_rows = None if case == "self" else args.ref_rows
        x, labels, ref, ref_labels = make_inputs(args.batch, args.dim, HARDNESS["typical"], ref_rows, args.device)
        x, ref = x.half().requires_grad_(), None if ref is None else ref.half()
        steps = {path: path_step(path, case, labels, ref, ref_labels) for path in paths}
        rounds = {path: [] for path in paths}
        for _ in range(args.rounds):
            for path, step in steps.items():
                host_time(step, x, 10, synchronize)  # warm-up (and the capture)
                rounds[path].append(host_time(step, x, args.steps, synchronize))
        results[case] = {path: [round(t * 1e3, 3) for t in times] for path, times in rounds.items()}
        for path in paths[:2]:
            launched.update(launches=0, launch_s=0.0, products=0)
            host_time(steps[path], x, args.steps, synchronize)
            counts[case, path] = {key: value / args.steps for key, value in launched.items()}
    how = {"cuda": "", "stubbed": ", GPU plans, launches stubbed",
           "launcher": ", GPU plans, launches through Triton's launch path, no driver calls"}
    mode = "cuda" if args.device == "cuda" else args.launches
    lines = [f"host time of one eager triton step on {args.device}{how[mode]}, float16, P x 4 batches of typical "
             f"hardness (bench/benchmark.py), B = {args.batch}, "
             f"R = {args.ref_rows} (memory bank, cross-batch memory), D = {args.dim}, 'mean'; ms, median of "
             f"{args.steps} steps, "
             f"{args.rounds} alternating rounds"]
    for case, by_path in results.items():
        for path, times in by_path.items():
            lines.append(f"  {case:18s} {path:10s} median {statistics.median(times):.3f}  "
                         f"range {min(times):.3f}-{max(times):.3f}")
        for path in paths[:2]:
            count = counts[case, path]
            lines.append(f"  {case:18s} a {path} step: {count['launches']:.0f} Triton launches "
                         f"({count['launch_s'] * 1e3:.3f} ms of it), {count['products']:.0f} cuBLAS products")
    report(lines, args.out, machine)


if __name__ == "__main__":
    main()
