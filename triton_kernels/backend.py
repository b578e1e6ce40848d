"""The Triton backend as the public API sees it (common.Backend): where it runs, and the call path.

An eager call takes `op.eager_loss`, one autograd node (CrossBatchMemory's step
`op.eager_memory_loss`, one node for both its terms); a traced call (torch.compile, export, fake
tensors) takes the custom ops through the common path, whose normalisation the compiler fuses
itself. Both get their keys as the kernels compare them: int32 ranks, made once for both ops
(operands.ranked_keys).
"""
import torch

from .. import ops
from ..common import GPU_DTYPES, Backend, hyper_parameters_of, loss_dtype, unit_rows
from . import launcher, op
from .operands import ranked_keys


class TritonBackend(Backend):
    name = "triton"
    auto_devices = ("cuda",)
    dtypes = GPU_DTYPES

    def unavailable_reason(self, device, dtype=None):
        reason = super().unavailable_reason(device, dtype)
        if reason is not None:
            return reason
        if launcher.TRITON_TOO_OLD:
            return launcher.TRITON_TOO_OLD
        if device.type == "cpu" and not launcher.INTERPRETED:
            return "on CPU tensors it needs TRITON_INTERPRET=1 set before ms_loss_cuda.triton_kernels is imported"
        if device.type == "cpu" and dtype == torch.bfloat16 and not launcher.BFLOAT16_INTERPRETED:
            return "this Triton's interpreter computes bfloat16 unlike a GPU (triton_kernels/interpreter_bfloat16.py)"
        if device.type not in ("cpu", "cuda"):
            return f"it takes CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device}"
        if device.type == "cuda" and not torch.cuda.is_available():
            return f"it takes CUDA tensors on a visible GPU, got {device} where torch sees none"
        # Triton's supported GPUs; compiled for sm_75 its 16-bit kernels have no tensor-core instructions
        # and spill (bench/kernel_resources.py --cc 75). (Asked at every call: the capability is the
        # launcher's, queried once a device.)
        if device.type == "cuda":
            capability = launcher.device_capability(device)
            if capability < (8, 0):
                return f"it needs a GPU of compute capability 8.0 or newer (as Triton does), got {capability}"
            if launcher.TORCH_TOO_OLD:
                return launcher.TORCH_TOO_OLD
        return None

    def unit_rows(self, t):
        return unit_rows(t) if ops.traced() else op.unit_rows(t)

    def anchor_losses(self, x, labels, ids, ref, ref_labels, ref_ids, options):
        hyper_parameters = hyper_parameters_of(options)
        return op.fused_forward(x, *ranked_keys(labels, ids, ref, ref_labels, ref_ids), *hyper_parameters)[0]

    def memory_loss(self, x, labels, ids, slots, memory, filled, weight, options, normalize, reduction):
        if ops.traced():
            return None
        return op.eager_memory_loss(x, labels, ids, slots, *memory, filled, weight,
                                    hyper_parameters_of(options), normalize, reduction, loss_dtype(x))

    def loss(self, embeddings, labels, ids, ref, ref_labels, ref_ids, options, normalize, reduction):
        if ops.traced():
            return super().loss(embeddings, labels, ids, ref, ref_labels, ref_ids, options, normalize, reduction)
        return op.eager_loss(embeddings, labels, ids, ref, ref_labels, ref_ids,
                             hyper_parameters_of(options), normalize, reduction, loss_dtype(embeddings))


BACKEND = TritonBackend()
