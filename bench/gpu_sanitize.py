"""Small forward+backward cases of every GPU kernel, for compute-sanitizer (bench/gpu_check.sh runs
this under memcheck, racecheck and synccheck): each dtype, the self case, a reference set with
and without a gradient (a memory bank takes none), mining on and off, partial row/column/K tiles
and column splits (B = 97, R = 151, D = 130); triton-chunked: the triton backend with its chunked
backward, one tile row (or column) of weights per chunk. Exits non-zero when a result is not finite.
Usage: python bench/gpu_sanitize.py --backend triton|triton-chunked|cuda
"""
import argparse
import os

import torch

import ms_loss_cuda


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True, choices=("triton", "triton-chunked", "cuda"))
    args = parser.parse_args()
    if args.backend == "triton-chunked":
        os.environ["MS_LOSS_TRITON_CHUNK_MB"] = "1e-6"  # (1 byte: one tile row or column a chunk)
    backend = args.backend.split("-")[0]
    gen = torch.Generator().manual_seed(0)
    batch, ref_rows, dim = 97, 151, 130
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for with_ref in (False, True, "bank"):
            for mining in (True, False):
                x = torch.randn(batch, dim, generator=gen).to("cuda", dtype).requires_grad_()
                labels = torch.randint(0, 12, (batch,), generator=gen).cuda()
                extra = {}
                if with_ref:
                    ref = torch.randn(ref_rows, dim, generator=gen).to("cuda", dtype).requires_grad_(with_ref is True)
                    extra = dict(ref_embeddings=ref, ref_labels=torch.randint(0, 12, (ref_rows,), generator=gen).cuda())
                loss = ms_loss_cuda.multi_similarity_loss(x, labels, mining=mining, backend=backend, **extra)
                grads = torch.autograd.grad(loss, [x] + ([extra["ref_embeddings"]] if with_ref is True else []))
                torch.cuda.synchronize()
                finite = torch.isfinite(loss).item() and all(torch.isfinite(g).all().item() for g in grads)
                print(f"{args.backend} {dtype} ref={with_ref} mining={mining}: loss {loss.item():.5f}"
                      + ("" if finite else "  NOT FINITE"), flush=True)
                if not finite:
                    raise SystemExit(1)


if __name__ == "__main__":
    main()
