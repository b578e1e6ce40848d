"""Small forward+backward cases of every GPU kernel, for compute-sanitizer (bench/gpu_check.sh runs
this under memcheck, racecheck and synccheck): each dtype, the self case, a reference set with
and without a gradient (a memory bank takes none), mining on and off, partial row/column/K tiles
and column splits (B = 97, R = 151, D = 130), and the self case with identities over several row
blocks (B = 300: the forward skips each block's positive range and compares the identities): some
shared by rows of different labels (self_ids: the flag that makes every tile compare them) and all
distinct (self_distinct_ids: the label-free tiles of the backward's label order). The triton backend
runs each case three times: with its fused backward, with its chunked one (one tile row or column of
weights per chunk), and with the self case's triangle at any chunk height (B = 300: chunks of one
row block, both ends' lifts). Exits non-zero when a result is not finite.
Usage: python bench/gpu_sanitize.py --backend triton|cuda
"""
import argparse
import itertools
import os

import torch

import ms_loss_cuda
from ms_loss_cuda.triton_kernels import launcher
from triton_internals import tiles  # (bench/, this script's folder)

SHIPPED_TILES = launcher.tile_config
TRIANGLE_AT_ANY_HEIGHT = launcher.with_triangle_rows(1)  # (the tile table, the triangle however short its chunks)


def run_case(backend, dtype, case, mining, gen, batch=97, ref_rows=151, dim=130):
    """One forward+backward of `case` on the GPU: (the loss, whether it and the gradients are finite)."""
    rows = 300 if case.endswith("ids") else batch
    x = torch.randn(rows, dim, generator=gen).to("cuda", dtype).requires_grad_()
    labels = torch.randint(0, 12 if rows == batch else 60, (rows,), generator=gen).cuda()
    extra = {}
    if case.endswith("ids"):
        extra = dict(ids=torch.arange(rows, device="cuda") % (150 if case == "self_ids" else 1000))
    elif case != "self":  # a memory bank takes no gradient
        ref = torch.randn(ref_rows, dim, generator=gen).to("cuda", dtype).requires_grad_(case == "ref")
        extra = dict(ref_embeddings=ref, ref_labels=torch.randint(0, 12, (ref_rows,), generator=gen).cuda())
    loss = ms_loss_cuda.multi_similarity_loss(x, labels, mining=mining, backend=backend, **extra)
    grads = torch.autograd.grad(loss, [x] + ([extra["ref_embeddings"]] if case == "ref" else []))
    torch.cuda.synchronize()
    return loss.item(), torch.isfinite(loss).item() and all(torch.isfinite(g).all().item() for g in grads)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True, choices=("triton", "cuda"))
    args = parser.parse_args()
    os.environ["MS_LOSS_CUDA_GRAPHS"] = "0"  # every case launches its kernels (no replay of an earlier case's graph)
    backwards = ("fused", "chunked", "triangle") if args.backend == "triton" else ("fused",)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for case in ("self", "ref", "bank", "self_ids", "self_distinct_ids"):
            for mining, backward in itertools.product((True, False), backwards):
                if backward == "triangle" and not case.endswith("ids"):  # (97 rows: one chunk; a reference set: none)
                    continue
                # (the chunked backward at 1 byte of weights: one tile row or column a chunk)
                os.environ["MS_LOSS_TRITON_CHUNK_MB"] = "0" if backward == "fused" else "1e-6"
                with tiles(TRIANGLE_AT_ANY_HEIGHT if backward == "triangle" else SHIPPED_TILES):
                    loss, finite = run_case(args.backend, dtype, case, mining, gen)
                print(f"{args.backend} {dtype} {case} mining={mining} {backward} backward: loss {loss:.5f}"
                      + ("" if finite else "  NOT FINITE"), flush=True)
                if not finite:
                    raise SystemExit(1)


if __name__ == "__main__":
    main()
