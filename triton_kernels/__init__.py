"""Triton kernels of the MS loss, installed as ms_loss_cuda.triton_kernels (see ms_loss.py).

Importing this package needs Triton; it registers torch.ops.ms_loss_cuda.triton_forward/_backward.
Set TRITON_INTERPRET=1 before importing it to run the kernels on CPU tensors.
"""
from .ms_loss import (INTERPRETED, backward_plan, column_splits, eager_loss, forward_plan, fused_forward, int32_keys,
                      plan_cost, positive_ranges, tile_config, triton_backward, triton_forward, unit_rows)

__all__ = ["INTERPRETED", "backward_plan", "column_splits", "eager_loss", "forward_plan", "fused_forward", "int32_keys",
           "plan_cost", "positive_ranges", "tile_config", "triton_backward", "triton_forward", "unit_rows"]
