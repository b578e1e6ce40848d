"""How much of each row's float16 precision the chunked Triton backward keeps in the self case, in its
three forms: the fused backward (each row's own lift), chunks of whole rows (each row's own lift) and
the triangle (both ends' lifts, about the square roots of theirs: triton_kernels/backward.py).
Under the Triton interpreter on CPU tensors, no GPU needed.
Two groups of 100 anchors in orthogonal halves of D = 64 (beta = 50, mining off), the second group's
grad_outputs 2^-17 or 2^-20 of the first's; "pulled" moves the second group 0.7 of the way towards the
first's centre (their pairs then weigh), "small rows" scales every row to norm 1e-3 (normalize=False:
float16 values near the subnormals). Printed per form: the largest error of a row of dx relative to
that row's largest entry, for each group, against the float64 reference (float32 dx, before the
public API rounds it to float16).
    python bench/triangle_precision.py --out bench/results/cpu/triangle-precision.txt
"""
import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is imported)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ms_loss_cuda  # noqa: E402
from host_time import report  # noqa: E402  (bench/)
from ms_loss_cuda.triton_kernels import backward_plan, forward_plan, launcher  # noqa: E402

SCENARIOS = {  # name: (pull towards the first group's centre, log2 of the second group's grad_output, row norm)
    "isolated, 2^-17": (0.0, -17, 1.0),
    "isolated, 2^-20": (0.0, -20, 1.0),
    "pulled 0.7, 2^-20": (0.7, -20, 1.0),
    "small rows, 2^-17": (0.0, -17, 1e-3),
}
FORMS = {"fused": ("0", None), "whole rows": ("1e-6", 10 ** 9), "triangle": ("1e-6", 1)}  # (MiB, TRIANGLE_ROWS)
HYPER = (2.0, 50.0, 0.5, 0.1, False, False)  # alpha, beta, base, epsilon, mining, skip_incomplete_anchors
GROUP = 100


def two_groups(pull, log2_grad, norm):
    gen = torch.Generator().manual_seed(3)
    x = torch.zeros(2 * GROUP, 64, dtype=torch.float64)
    for group, columns in ((slice(0, GROUP), slice(0, 32)), (slice(GROUP, None), slice(32, 64))):
        x[group, columns] = (torch.randn(1, 32, generator=gen, dtype=torch.float64)
                             + 0.2 * torch.randn(GROUP, 32, generator=gen, dtype=torch.float64))
    x = F.normalize(x, dim=1)
    x[GROUP:] = F.normalize(x[GROUP:] + pull * F.normalize(x[:GROUP].mean(0), dim=0), dim=1)
    labels = torch.cat([torch.randint(0, 10, (GROUP,), generator=gen), torch.randint(10, 20, (GROUP,), generator=gen)])
    grad_output = torch.cat([torch.ones(GROUP), torch.full((GROUP,), 2.0 ** log2_grad)])
    return (x * norm).half(), labels, grad_output


def reference_dx(x, labels, grad_output):
    x = x.double().requires_grad_()
    loss = ms_loss_cuda.multi_similarity_loss(x, labels, alpha=HYPER[0], beta=HYPER[1], base=HYPER[2],
                                              epsilon=HYPER[3], mining=False, normalize=False, reduction="none",
                                              backend="reference")
    return torch.autograd.grad(loss, x, grad_output.double())[0]


def kernel_dx(x, labels, grad_output, chunk_mib, triangle_rows):
    """float32 dx of the triton backend's plans, the form chosen by the chunk budget and TRIANGLE_ROWS."""
    os.environ["MS_LOSS_TRITON_CHUNK_MB"] = chunk_mib
    shipped = launcher.tile_config
    if triangle_rows is not None:
        launcher.tile_config = launcher.with_triangle_rows(triangle_rows, shipped)
    try:
        operands = (x, labels, None, None, None, None)
        _, stats = launcher.run(forward_plan, x.device, *operands, *HYPER)
        dx = launcher.run(backward_plan, x.device, grad_output, stats, *operands, *HYPER)[0]
    finally:
        launcher.tile_config = shipped
    return (dx.sum(0) if dx.dim() == 3 else dx)[:, :x.shape[1]].double()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = ["the self case's float16 dx in the triton backend's three backward forms (interpreter, float32 dx): "
             "the largest error of a row relative to its largest entry, first group / second group"]
    for name, (pull, log2_grad, norm) in SCENARIOS.items():
        x, labels, grad_output = two_groups(pull, log2_grad, norm)
        want = reference_dx(x, labels, grad_output)
        cells = []
        for form, (chunk_mib, triangle_rows) in FORMS.items():
            error = ((kernel_dx(x, labels, grad_output, chunk_mib, triangle_rows) - want).abs().amax(1)
                     / want.abs().amax(1))
            cells.append(f"{form} {error[:GROUP].max():.1e} / {error[GROUP:].max():.1e}")
        lines.append(f"  {name:18s} " + "   ".join(cells))
        print(lines[-1], flush=True)
    report(lines, args.out)


if __name__ == "__main__":
    main()
