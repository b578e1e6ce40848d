"""The compiled operators (torch.ops.ms_loss_cuda.*): their fake kernels and their autograd.

Loading the extension registers the schemas and the CPU (and, when built, CUDA) kernels; this
module adds what every backend of the op shares, so `torch.compile` and `opcheck` see one op.
`LOAD_ERROR` holds why the extension could not be loaded (None when it was).
"""
import torch

try:
    from . import _C  # noqa: F401  (registers torch.ops.ms_loss_cuda)

    LOAD_ERROR = None
except ImportError as error:  # the package still works through the reference backend
    LOAD_ERROR = error

HYPER_PARAMETERS = ("alpha", "beta", "base", "epsilon", "mining", "skip_incomplete_anchors")


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


if LOAD_ERROR is None:
    forward_op = torch.ops.ms_loss_cuda.ms_loss_forward.default
    backward_op = torch.ops.ms_loss_cuda.ms_loss_backward.default

    @torch.library.register_fake("ms_loss_cuda::ms_loss_forward")
    def _forward_fake(x, labels, ids, ref, ref_labels, ref_ids, *hyper_parameters):
        batch = x.shape[0]
        dtype = _compute_dtype(x)
        return x.new_empty((batch,), dtype=dtype), x.new_empty((4, batch), dtype=dtype)

    @torch.library.register_fake("ms_loss_cuda::ms_loss_backward")
    def _backward_fake(grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, *hyper_parameters):
        return torch.empty_like(x), (x.new_empty((0,)) if ref is None else torch.empty_like(ref))

    def _setup_context(ctx, inputs, output):
        x, labels, ids, ref, ref_labels, ref_ids, *hyper_parameters = inputs
        ctx.save_for_backward(x, labels, ids, ref, ref_labels, ref_ids, output[1])
        ctx.hyper_parameters = hyper_parameters

    def _backward(ctx, grad_loss, grad_stats):
        x, labels, ids, ref, ref_labels, ref_ids, stats = ctx.saved_tensors
        grad_x, grad_ref = backward_op(
            grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, *ctx.hyper_parameters
        )
        grad_ref = None if ref is None else grad_ref
        return (grad_x, None, None, grad_ref, None, None) + (None,) * len(HYPER_PARAMETERS)

    torch.library.register_autograd(
        "ms_loss_cuda::ms_loss_forward", _backward, setup_context=_setup_context
    )
