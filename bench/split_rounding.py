"""How close the chunked backward's float32 products come to the float64 product when made of
float16 pieces on tensor cores (backward.split_products), in a model of the hardware's sums, on the
benchmark's data. Measured runs come from a GPU (make gpu-check's accuracy step); this says what to
expect and why.

The products are dx = W x: W [rows, K] the pair weights of a row block (each row lifted so that its
largest weight is 1, as scales_kernel lifts them), x [K, D] unit rows, K the columns summed (the
batch, in the self case). Each operand is split into float16 pieces (pairs.float16_parts) and
W x = W_hi x_hi + (W_hi x_lo + W_lo x_hi) / 2^11. Tensor cores multiply float16 exactly and add
each instruction's products (16 of them a row here) into a float32 accumulator; published models of
A100 and H100 tensor cores round that sum toward zero (RZ), a bias that grows with K where float32
rounding to nearest (RN) does not. Both are modelled, for one product over all K and for products
over K in pieces of --k-pieces columns added in float64, and compared with float64. The weights come
from the dense loss of bench/compiled_loss.py in float64 (autograd of its similarities).
    python bench/split_rounding.py --sizes 4096 8192 --out bench/results/cpu/split-rounding.txt
"""
import argparse

import numpy as np
import torch

from benchmark import HARDNESS
from compiled_loss import loss_of_similarities
from host_time import report
from providers import make_inputs


def float16_parts(v):
    """(hi, lo) of float32 values as float64: hi rounded to float16, lo = (v - hi) 2^11 rounded to float16."""
    hi = v.astype(np.float16)
    return hi.astype(np.float64), ((v - hi.astype(np.float32)) * 2048).astype(np.float16).astype(np.float64)


def toward_zero(v):
    """float64 values rounded to float32 toward zero."""
    f = v.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(v)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


def tensor_core_product(w, b, rz, piece, step=16):
    """w @ b summed as a tensor core sums it: `step` exact products at a time into a float32 accumulator
    (rounded toward zero with rz, else to nearest), over pieces of `piece` columns added in float64."""
    out = np.zeros((w.shape[0], b.shape[1]))
    for first in range(0, w.shape[1], piece):
        acc = np.zeros(out.shape, np.float32)
        for k in range(first, min(first + piece, w.shape[1]), step):
            exact = acc.astype(np.float64) + w[:, k:k + step] @ b[k:k + step]
            acc = toward_zero(exact) if rz else exact.astype(np.float32)
        out += acc
    return out


def weights(batch, dim, rows):
    """(W [rows, batch] lifted row by row, x [batch, dim] unit rows), float32 values in float64."""
    x, labels, _, _ = make_inputs(batch, dim, HARDNESS["typical"], None, "cpu")
    x = torch.nn.functional.normalize(x.double(), dim=1)
    s = (x @ x.T).requires_grad_()
    loss_of_similarities(s, labels, labels, True).backward()
    w = (s.grad + s.grad.T)[:rows]  # (the self case: a pair's weight from both its anchors)
    w = w / w.abs().amax(1, keepdim=True)
    return w.float().double().numpy(), x.float().double().numpy()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64, help="the rows of W modelled (the first ones)")
    parser.add_argument("--k-pieces", type=int, default=1024)
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = [f"float16 pieces of float32 products W x against float64, the benchmark's data (typical), D = {args.dim}, "
             f"the first {args.rows} rows of W (all of them where B is smaller); largest error over the largest "
             f"entry of W x"]
    lines.append(f"{'B (= K)':>8} {'sums':>4} {'one product':>12} {f'K in {args.k_pieces}s':>12}")
    for batch in args.sizes:
        w, x = weights(batch, args.dim, args.rows)
        exact = w @ x
        (w_hi, w_lo), (x_hi, x_lo) = float16_parts(w.astype(np.float32)), float16_parts(x.astype(np.float32))
        for rz in (True, False):
            errors = []
            for piece in (batch, args.k_pieces):
                got = (tensor_core_product(w_hi, x_hi, rz, piece) + (tensor_core_product(w_hi, x_lo, rz, piece)
                                                                      + tensor_core_product(w_lo, x_hi, rz, piece)) / 2048)
                errors.append(np.abs(got - exact).max() / np.abs(exact).max())
            lines.append(f"{batch:>8} {'RZ' if rz else 'RN':>4} {errors[0]:>12.1e} {errors[1]:>12.1e}")
            print(lines[-1], flush=True)
    report(lines, args.out)


if __name__ == "__main__":
    main()
