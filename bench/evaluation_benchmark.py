"""Time and peak memory of ms_loss_cuda.evaluation at SOP's test size (60,502 x 512), with faiss and with
chunked torch: Recall@{1, 10, 100, 1000}, precision@1 and MAP@R on clustered embeddings (5 per class,
about SOP's). Each backend runs in a fresh process (peak resident memory above the inputs).
    python bench/evaluation_benchmark.py --out bench/results/evaluation
"""
import argparse
import json
import os
import sys
import time

from benchmark import machine_info, run_json_worker, track_peak_rss  # (bench/ is on the path of a script run from it)


def measure(use_faiss, rows, dim):
    import torch

    from ms_loss_cuda import evaluation

    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(rows) // 5
    x = torch.randn(rows // 5 + 1, dim, generator=gen)[labels] + 2.5 * torch.randn(rows, dim, generator=gen)
    peak_rss_mib = track_peak_rss()
    start = time.perf_counter()
    scores = evaluation.evaluate(x, labels, ks=(1, 10, 100, 1000), use_faiss=use_faiss)
    seconds = time.perf_counter() - start
    return dict(scores, seconds=seconds, peak_extra_mib=peak_rss_mib(), threads=torch.get_num_threads())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=60502)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--out", default="bench/results/evaluation")
    parser.add_argument("--worker", choices=("faiss", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker == "faiss", args.rows, args.dim)))
        return
    if args.rows <= 1000 or args.dim < 1:
        parser.error("--rows must be more than 1000 (Recall@1000 ranks 1000 others), --dim at least 1")
    results = {"machine": machine_info(), "rows": args.rows, "dim": args.dim}
    for backend in ("faiss", "torch"):
        measured, failure = run_json_worker([sys.executable, __file__, "--worker", backend, "--rows", str(args.rows),
                                             "--dim", str(args.dim)])
        results[backend] = measured or {"failed": failure}
        print(backend, results[backend], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if any("failed" in results[backend] for backend in ("faiss", "torch")):
        sys.exit(1)


if __name__ == "__main__":
    main()
