"""The memory of one eager triton step with a GPU's launch plans, measured on CPU, for this checkout
and others side by side: the peak of the bytes allocated above the inputs during one forward +
backward of the mean loss (float16 unless --dtype says, D = 512, P x 4 batches of typical hardness).

The step is bench/host_time.py's CPU stand-in with its launches dropped: every tensor the plans and
torch's ops allocate is allocated as on a GPU (the launches only write them), and each cuBLAS
product allocates its float32 result, as torch's product does (a product of float16 pieces, two of
them at a time). torch's profiler records every
allocation and free (profile_memory); their running sum gives the peak. A GPU adds cuBLAS's
workspace (32 MiB on Hopper) and its caching allocator's rounding: on an H100 a step without replay
peaked 32 MiB above what this gives for the same plans at B = 4096 and 16384 (docs/benchmarks.md).
`direct`: the step as it runs without replay (MS_LOSS_CUDA_GRAPHS=0), all its memory its own;
`replayed`: what a step replayed by a (stand-in) CUDA graph allocates outside the graph's memory,
which the graph keeps between steps (about the direct step's peak). Each checkout, shape and budget
(MS_LOSS_TRITON_CHUNK_MB, the chunked backward's) runs in a process of its own.
    git worktree add /tmp/before HEAD~1
    python bench/step_memory.py . /tmp/before --sizes 4096 16384 65536 --bank 262144 --budgets 256 192 128 \
        --out bench/results/cpu/step-memory.txt
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20


def peak_of(step, x):
    """(peak, end): MiB allocated above what was allocated before, during step(x) and after it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        step(x)
    allocated = peak = 0
    events = [e for e in recorded.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        allocated += event.nbytes()
        peak = max(peak, allocated)
    return peak / MIB, allocated / MIB


def stand_in_products(backward):
    """The chunked backward's products (backward.Product) in memory only: cuBLAS's float32 results,
    allocated as its products allocate them and left unwritten (a product of float16 pieces runs
    its own steps, each product a result of its rows)."""
    import torch

    def result(w, b):
        return torch.empty(w.shape[0], b.shape[1], dtype=torch.float32)

    shipped = backward.Product.__call__
    if not hasattr(backward, "_float32_product"):  # (an older checkout: one result a product)
        backward.Product.__call__ = lambda product: result(product.w, product.b)
        return
    backward._float32_product = result
    backward.Product.__call__ = lambda product: (result(product.w, product.b) if product.w.dtype == torch.float32
                                                 else shipped(product))


def serve(root, batch, bank_rows, budget, dim, dtype):
    """A worker: the step on the checkout `root`; prints {"direct": MiB, "replayed": MiB} as JSON."""
    from host_time_versus import import_checkout

    import_checkout(root)
    import torch
    from benchmark import HARDNESS, make_inputs
    from host_time import cpu_stand_in, stand_in_graphs
    from providers import with_settings

    import ms_loss_cuda
    from ms_loss_cuda.triton_kernels import backward

    cpu_stand_in("stubbed")
    stand_in_products(backward)
    x, labels, ref, ref_labels = make_inputs(batch, dim, HARDNESS["typical"], bank_rows, "cpu")
    dtype = getattr(torch, dtype)
    x, ref = x.to(dtype).requires_grad_(), None if ref is None else ref.to(dtype)

    def step(x):
        ms_loss_cuda.multi_similarity_loss(x, labels, ref_embeddings=ref, ref_labels=ref_labels,
                                           backend="triton").backward()

    result = {}
    direct = with_settings(step, budget, replay=False)
    direct(x)  # (the one-time allocations: thread pools, cached constants)
    x.grad = None
    result["direct"] = peak_of(direct, x)[0]
    stand_in_graphs()
    replayed = with_settings(step, budget, replay=True)
    for _ in range(3):  # seen, captured, replayed
        x.grad = None
        replayed(x)
    x.grad = None
    result["replayed"] = peak_of(replayed, x)[0]
    print(json.dumps(result))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("checkouts", nargs="*", help="checkout roots ('.': this one)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--bank", type=int, nargs="*", default=[262144], help="memory banks of R rows")
    parser.add_argument("--bank-batch", type=int, default=1024)
    parser.add_argument("--budgets", type=float, nargs="+", default=[256], help="MS_LOSS_TRITON_CHUNK_MB values")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--out")
    parser.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        root, batch, bank_rows, budget = args.serve
        return serve(root, int(batch), None if bank_rows == "-" else int(bank_rows), budget, args.dim, args.dtype)
    if not args.checkouts:
        parser.error("name at least one checkout")
    from host_time import report
    from host_time_versus import revision

    shapes = [(b, None) for b in args.sizes] + [(args.bank_batch, r) for r in args.bank]
    lines = [f"memory of one eager triton step with a GPU's plans, measured on CPU (bench/step_memory.py): MiB above "
             f"the inputs, {args.dtype}, D = {args.dim}, 'mean'; direct: the step's peak without replay; replayed: "
             f"what a replayed step allocates outside its graph's memory; cuBLAS's workspace not included"]
    for root in map(os.path.abspath, args.checkouts):
        lines.append(f"  {root}: {revision(root)}")
        for (batch, bank_rows), budget in ((shape, budget) for shape in shapes for budget in args.budgets):
            command = [sys.executable, __file__, "--serve", root, str(batch), str(bank_rows or "-"),
                       f"{budget:g}", "--dim", str(args.dim), "--dtype", args.dtype]
            done = subprocess.run(command, capture_output=True, text=True, cwd=HERE,
                                  env=dict(os.environ, PYTHONPATH=HERE, OMP_NUM_THREADS="1"))
            if done.returncode:
                raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            shape = f"{batch}" if bank_rows is None else f"{batch} x {bank_rows}"
            lines.append(f"    {shape:>14}  {budget:5g} MiB budget  direct {measured['direct']:7.1f}  "
                         f"replayed {measured['replayed']:7.1f}")
            print(lines[-1], flush=True)
    report(lines, args.out)


if __name__ == "__main__":
    main()
