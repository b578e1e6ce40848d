"""How far a backend's loss and gradient are from the float64 reference at the benchmark's sizes and
data (bench/providers.py: make_inputs), for each dtype and float32 matmul precision asked for.

The parity suite (tests/) checks every backend at small sizes within fixed tolerances; this measures
the error where the benchmark times, where sums run over tens of thousands of pairs. Errors are
relative: |loss - ref| / |ref|, and for the gradient the largest |dx - dx_ref| over the largest
|dx_ref| (the scale the parity suite uses) and the norm of the difference over the norm of dx_ref.
The reference runs in float64 on the same device (the B x R matrix in memory).
16-bit gradients take a grad_output of --grad-scale (1024 by default: a loss scale, as
torch.amp.GradScaler gives) and are divided by it before the comparison: the gradient of a mean over
B anchors has entries of about 1/B times a pair weight, below float16's normal range (6.1e-5) from a
few thousand anchors on, where any float16 gradient, of any implementation, keeps few bits unless
the loss is scaled. float32 takes grad_output 1. --row-norm N compares rows of norm N as they are
(normalize=False): pair exponents beta (S - base) up to 50 N^2, where a kernel that rounds the
hardest pair's exponent in one place and not in another (an FMA) is off by up to half its ulp.

    python bench/accuracy.py --device cuda --sizes 4096 16384 --bank 262144 \
        --dtypes float32 float16 bfloat16 --precisions highest high --out bench/results/gpu/accuracy.txt
"""
import argparse
import contextlib
import time

import torch

import ms_loss_cuda
from benchmark import build_name  # (bench/, this script's folder)
from providers import make_inputs
from triton_internals import fp16x3_tiles, tiles


def loss_and_grad(x, labels, ref, ref_labels, backend, scale=1.0, normalize=True):
    x = x.detach().clone().requires_grad_()
    loss = ms_loss_cuda.multi_similarity_loss(x, labels, ref_embeddings=ref, ref_labels=ref_labels, backend=backend,
                                              normalize=normalize)
    loss.backward(torch.full_like(loss, scale))
    return loss.detach().double(), x.grad.double() / scale


def errors(backend, dtype, batch, ref_rows, device, dim, scale, row_norm=None):
    x, labels, ref, ref_labels = make_inputs(batch, dim, ref_rows=ref_rows, device=device)
    if row_norm is not None:  # (the rows as they are compared: normalize=False)
        x, ref = (None if t is None else row_norm * torch.nn.functional.normalize(t.double(), dim=1) for t in (x, ref))
    x, ref = x.to(dtype), None if ref is None else ref.to(dtype)
    normalize = row_norm is None
    loss, grad = loss_and_grad(x, labels, ref, ref_labels, backend, scale, normalize)
    # the reference sees the same (rounded) inputs, in float64
    ref_loss, ref_grad = loss_and_grad(x.double(), labels, None if ref is None else ref.double(), ref_labels,
                                       "reference", normalize=normalize)
    return {"loss": (abs(loss - ref_loss) / abs(ref_loss)).item(),
            "grad_max": ((grad - ref_grad).abs().max() / ref_grad.abs().max()).item(),
            "grad_norm": ((grad - ref_grad).norm() / ref_grad.norm()).item(),
            "finite": bool(torch.isfinite(loss) and torch.isfinite(grad).all())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--sizes", type=int, nargs="*", default=[1024])
    parser.add_argument("--bank", type=int, nargs="*", default=[], metavar="R",
                        help="memory banks of R rows against --bank-batch anchors")
    parser.add_argument("--bank-batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--precisions", nargs="+", default=["highest"], choices=("highest", "high", "medium"),
                        help="torch.set_float32_matmul_precision for the float32 runs (highest is torch's default)")
    parser.add_argument("--grad-scale", type=float, default=1024.0,
                        help="the 16-bit runs' grad_output (a loss scale; the gradient is divided by it)")
    parser.add_argument("--fp16x3", action="store_true",
                        help="triton: its float32 S tiles as three float16 products (bench/triton_internals.py)")
    parser.add_argument("--row-norm", type=float, metavar="N",
                        help="rows of norm N compared as they are (normalize=False), not normalised ones")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()

    shapes = [(b, None) for b in args.sizes] + [(args.bank_batch, r) for r in args.bank]
    variant = (" (float32 S tiles as fp16x3)" if args.fp16x3 else "") + \
        (f" (rows of norm {args.row_norm:g}, normalize=False)" if args.row_norm is not None else "")
    lines = [f"{args.backend}{variant} against the float64 reference, D = {args.dim}, {args.device} "
             f"({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), torch {torch.__version__}, "
             f"build {build_name()}, {time.strftime('%Y-%m-%d')}",
             f"{'dtype':<18} {'shape':>16} {'loss':>9} {'dx (max)':>9} {'dx (norm)':>9}  grad_output  finite"]
    print("\n".join(lines), flush=True)
    runs = [(d, p) for d in args.dtypes for p in (args.precisions if d == "float32" else ["highest"])]
    for dtype, precision in runs:
        torch.set_float32_matmul_precision(precision)
        name = dtype + (f" ({precision})" if dtype == "float32" else "")
        for batch, ref_rows in shapes:
            scale = 1.0 if dtype == "float32" else args.grad_scale
            with contextlib.ExitStack() as variants:  # (the reference backend has no tiles or products to vary)
                if args.fp16x3:
                    variants.enter_context(tiles(fp16x3_tiles()))
                e = errors(args.backend, getattr(torch, dtype), batch, ref_rows, args.device, args.dim, scale,
                           args.row_norm)
            shape = f"{batch}" if ref_rows is None else f"{batch} x {ref_rows}"
            lines.append(f"{name:<18} {shape:>16} {e['loss']:>9.2g} {e['grad_max']:>9.2g} {e['grad_norm']:>9.2g}"
                         f"  {scale:>11g}  {e['finite']}")
            print(lines[-1], flush=True)
    torch.set_float32_matmul_precision("highest")
    if args.out:
        with open(args.out, "w") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
