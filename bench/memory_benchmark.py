"""One training step's loss with a full cross-batch memory: ms_loss_cuda's CrossBatchMemory against
pytorch-metric-learning's CrossBatchMemory (MultiSimilarityLoss + MultiSimilarityMiner), a batch of
--batch rows against a memory of --size (XBM's: 1000 against 55,000 at D = 512 by default). Each
memory is filled directly with what earlier steps would have stored, then the step (forward +
backward of the batch's embeddings, the batch enqueued) is timed, each provider in a fresh process.
The two compute different losses: ours XBM's batch term and memory term, pytorch-metric-learning's
the memory term alone (which takes most of the time).
On CPU the second step (after an untimed first) and its peak resident memory above the inputs; on
CUDA the median of --repeats steps
between CUDA events after three warm-up steps, torch.cuda.max_memory_allocated above the inputs
from the first warm-up step on, and what stays between steps (bench/benchmark.py's `kept_mib`).
    python bench/memory_benchmark.py --out bench/results/memory
    python bench/memory_benchmark.py --device cuda --dtype float16 --providers ours pml --out DIR
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

# (bench/: the script's folder)
from benchmark import (kept_between_steps_mib, machine_info, release_free_memory, require_device, run_json_worker,
                       track_peak_rss)
from ms_loss_cuda import CrossBatchMemory

PROVIDERS = ("ours", "pml")


def full_memory(rows, labels, backend="auto"):
    """Our CrossBatchMemory, as full as its size: it holds `rows` (already normalised), their `labels`,
    ids 0 ... len(rows) - 1."""
    memory = CrossBatchMemory(rows.shape[0], rows.shape[1], backend=backend)
    memory.embeddings, memory.labels = rows.clone(), labels.clone()
    memory.ids = torch.arange(rows.shape[0], device=rows.device)
    memory.filled = rows.shape[0]
    return memory


def filled_memory(provider, args, rows, labels):
    """A step function for `provider` whose memory holds `rows` (already normalised) and `labels`."""
    if provider == "ours":
        memory = full_memory(rows, labels)
        return lambda x, y, ids: memory(x, y, ids)
    from pytorch_metric_learning import losses, miners

    memory = losses.CrossBatchMemory(losses.MultiSimilarityLoss(), args.dim, memory_size=args.size,
                                     miner=miners.MultiSimilarityMiner())
    memory.embedding_memory, memory.label_memory = rows.clone(), labels.clone()
    memory.has_been_filled = True
    return lambda x, y, ids: memory(x, y)


def measure(provider, args):
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    rows = torch.nn.functional.normalize(torch.randn(args.size, args.dim, generator=gen), dim=1).to(device, dtype)
    labels = (torch.arange(args.size) // 4).to(device)
    x = torch.randn(args.batch, args.dim, generator=gen).to(device, dtype).requires_grad_()
    y = torch.randint(0, args.size // 4, (args.batch,), generator=gen).to(device)
    ids = torch.arange(args.size, args.size + args.batch, device=device)
    step = filled_memory(provider, args, rows, labels)
    if device.type == "cpu":
        step(x, y, ids).backward()  # (untimed: the first call's one-time work)
        x.grad = None
        release_free_memory()  # (the peak then counts what the step allocates, not reuse of the first's)
        peak = track_peak_rss()
        start = time.perf_counter()
        step(x, y, ids).backward()
        return dict(seconds=time.perf_counter() - start, peak_extra_mib=peak())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):  # (warm-up: compiles; CUDA graphs record at the second call: their memory is in the peak)
        x.grad = None
        step(x, y, ids).backward()
    times = []
    for _ in range(args.repeats):
        x.grad = None
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step(x, y, ids).backward()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    x.grad = None
    torch.cuda.synchronize()
    return dict(seconds=statistics.median(times), peak_extra_mib=(torch.cuda.max_memory_allocated() - base) / 2**20,
                kept_mib=kept_between_steps_mib(base))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=55000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--providers", nargs="+", default=["ours"], choices=PROVIDERS)
    parser.add_argument("--repeats", type=int, default=10, help="CUDA: timed steps")
    parser.add_argument("--out", default="bench/results/memory")
    parser.add_argument("--worker", choices=PROVIDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args)))
        return
    if args.size < 4 or args.batch < 1 or args.dim < 1:
        parser.error("--size must be at least 4 (classes of 4 rows), --batch and --dim at least 1")
    require_device(parser, args.device)
    results, info = [], machine_info()
    options = [f"--{name}={getattr(args, name)}" for name in ("size", "batch", "dim", "device", "dtype", "repeats")]
    for provider in args.providers:
        measured, failure = run_json_worker([sys.executable, __file__, "--worker", provider, *options])
        result = dict(provider=provider, batch=args.batch, size=args.size, dim=args.dim, device=args.device,
                      dtype=args.dtype, **(measured or {"failed": failure}))
        if failure:
            print(f"{provider:5s} {failure}", flush=True)
        else:
            print(f"{provider:5s} {result['seconds'] * 1e3:9.3f} ms  {result['peak_extra_mib']:8.0f} MiB", flush=True)
        results.append(result)
        os.makedirs(args.out, exist_ok=True)  # (after each provider: a later failure keeps the earlier results)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"machine": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
