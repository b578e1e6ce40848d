"""How much precision the chunked Triton backward's float16 pair weights kept when the self case's
triangle took one lift for all rows instead of each row's own (its design before the two-sided lifts
of triton_kernels/ms_loss.py:
_scales_kernel, _chunked_plan). A float64 simulation on CPU, no GPU or Triton needed: P x M
batches (M = 4) of unit rows, mining off (weights spread over all B - 4 negatives, the case that
pushes them towards float16's subnormals), the anchors' statistics from all pairs, then for sample
rows i the row of H (both anchors' terms, H_ij = scale_i G_ij + scale_j G_ji), lifted, rounded to
float16, multiplied by the float16 rows of x and unlifted, as the kernels and cuBLAS do. Printed:
the relative error of dx_i (2-norm) against the same product with unrounded weights, for each
row's own lift ("own", what the fused kernels and whole-row chunks use) and for the one lift
("one", the triangle's former: the smallest anchor lift). Scenarios: "mean" (every grad_output equal),
random grad_outputs, and 16 anchors at 1 with the rest at 1e-3.
    python bench/lift_precision.py --batch 65536
"""
import argparse
import math
import platform
import time

import torch

ALPHA, BETA, BASE, MAX_LIFT = 2.0, 50.0, 0.5, 2.0 ** 14  # (the self case's lift cap: LIFT_WITH_COLUMN_ANCHORS)


def pair_terms(s, same, diff, lp, ln):
    """dL_i/dS_ij for the anchors whose LP, LN are given (rows of s), no mining."""
    return torch.where(same, -torch.exp(-ALPHA * (s - BASE) - lp), torch.where(diff, torch.exp(BETA * (s - BASE) - ln), 0.0))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows", type=int, default=24, help="sample rows of dx")
    args = parser.parse_args()
    torch.manual_seed(0)
    batch, dim = args.batch, args.dim
    labels = torch.arange(batch // 4).repeat_interleave(4)
    centres = torch.nn.functional.normalize(torch.randn(batch // 4, dim, dtype=torch.float64), dim=1)
    x = torch.nn.functional.normalize(centres[labels] + torch.randn(batch, dim, dtype=torch.float64) / math.sqrt(dim),
                                      dim=1).to(torch.float16).double()  # the rows the kernels read
    started = time.time()
    lp, ln, largest = (torch.empty(batch, dtype=torch.float64) for _ in range(3))
    for r0 in range(0, batch, 2048):
        r1 = min(r0 + 2048, batch)
        s = x[r0:r1] @ x.T
        diff = labels[r0:r1, None] != labels[None, :]
        same = ~diff
        same[torch.arange(r1 - r0), torch.arange(r0, r1)] = False  # (the anchor itself)
        zero = torch.zeros(r1 - r0, 1, dtype=torch.float64)
        lp[r0:r1] = torch.logsumexp(torch.cat([torch.where(same, -ALPHA * (s - BASE), -math.inf), zero], 1), 1)
        ln[r0:r1] = torch.logsumexp(torch.cat([torch.where(diff, BETA * (s - BASE), -math.inf), zero], 1), 1)
        minpos = torch.where(same, s, math.inf).amin(1)
        maxneg = torch.where(diff, s, -math.inf).amax(1)
        largest[r0:r1] = torch.maximum(-ALPHA * (minpos - BASE) - lp[r0:r1], BETA * (maxneg - BASE) - ln[r0:r1])
    print(f"B = {batch}, D = {dim}, mining off, {args.rows} sample rows; statistics in {time.time() - started:.0f} s "
          f"(torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads)")
    rows = torch.randperm(batch)[:args.rows].tolist()
    grads = {"mean": torch.full((batch,), 1.0 / batch, dtype=torch.float64),
             "random grad_output": torch.randn(batch, dtype=torch.float64),
             "16 anchors at 1, the rest at 1e-3": torch.cat([torch.ones(16), torch.full((batch - 16,), 1e-3)]).double()}
    for name, grad in grads.items():
        scale = grad / grad.abs().max()
        # _scales_kernel: the power of 2 that takes |scale_i| times the row's largest weight into (1/2, 1]
        bound = torch.log2(scale.abs()) + largest / math.log(2)
        lift = torch.exp2(torch.floor(-bound).clamp(0, 64)).clamp(max=MAX_LIFT)
        errors = {"own": [], "one": []}
        for i in rows:
            s = x[i] @ x.T
            diff = labels != labels[i]
            same = ~diff
            same[i] = False
            h = scale[i] * pair_terms(s, same, diff, lp[i], ln[i]) + scale * pair_terms(s, same, diff, lp, ln)
            truth = h @ x
            for key, one_lift in (("own", lift[i]), ("one", lift.min())):
                got = ((h * one_lift).to(torch.float16).double() @ x) / one_lift
                errors[key].append(((got - truth).norm() / truth.norm()).item())
        summary = " | ".join(f"{key}: median {torch.tensor(v).median().item():.1e}, max {max(v):.1e}"
                             for key, v in errors.items())
        print(f"{name}: one lift {lift.min().item():g} (own lifts {lift.min().item():g} ... {lift.max().item():g}) | "
              + summary)


if __name__ == "__main__":
    main()
