"""Peak memory and time of one training step with a full CrossBatchMemory on CPU: a memory of 65536
rows, a batch of 1000, D = 512 (issue target: under 1 GB above the inputs), fused CPU backend. The
memory is filled directly (what 66 earlier steps would have stored), then one step runs.
    python bench/memory_benchmark.py --out bench/results/memory
"""
import argparse
import json
import os
import time

import torch

from benchmark import track_peak_rss  # (bench/ is on the path of a script run from it)
from ms_loss_cuda import CrossBatchMemory


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--out", default="bench/results/memory")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    classes = args.size // 4
    memory = CrossBatchMemory(args.size, args.dim, backend="cpu")
    memory.embeddings.copy_(torch.nn.functional.normalize(torch.randn(args.size, args.dim, generator=gen), dim=1))
    memory.labels.copy_(torch.arange(args.size) // 4)
    memory.ids.copy_(torch.arange(args.size))
    memory.filled = args.size
    x = torch.randn(args.batch, args.dim, generator=gen).requires_grad_()
    labels = torch.randint(0, classes, (args.batch,), generator=gen)
    ids = torch.arange(args.size, args.size + args.batch)
    peak_rss_mib = track_peak_rss()
    start = time.perf_counter()
    memory(x, labels, ids).backward()
    result = dict(vars(args), seconds=time.perf_counter() - start, peak_extra_mib=peak_rss_mib(),
                  threads=torch.get_num_threads(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    print(result)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
