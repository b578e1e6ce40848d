"""The Triton backend of the MS loss, installed as ms_loss_cuda.triton_kernels.

Importing it needs Triton; it registers torch.ops.ms_loss_cuda.triton_forward/_backward. Set
TRITON_INTERPRET=1 before importing it to run the kernels on CPU tensors (the tests do).

Modules, from the per-pair math up (docs/triton.md explains the algorithm):
- pairs.py: the per-pair math and the similarity tiles every kernel is built from;
- forward_kernels.py, backward_kernels.py, row_kernels.py: the Triton kernels;
- launcher.py: direct launches, the tile table, running a plan;
- interpreter_bfloat16.py: Triton's interpreter (CPU tensors) made to compute bfloat16 as a GPU does;
- operands.py: aligned rows, int32 keys, the label order, the positive ranges, column splits;
- forward.py, backward.py: the launch plans of the forward and of both backwards;
- op.py: the custom ops, their autograd and the eager one-node loss;
- replay.py: the eager step captured as a CUDA graph and replayed;
- backend.py: the backend the public API calls (BACKEND).
"""
from .backend import BACKEND
from .backward import backward_plan
from .forward import forward_plan
from .launcher import INTERPRETED
from .op import eager_loss, fused_forward, triton_backward, triton_forward, unit_rows

__all__ = ["BACKEND", "INTERPRETED", "backward_plan", "eager_loss", "forward_plan", "fused_forward",
           "triton_backward", "triton_forward", "unit_rows"]
