"""The fused operators: their fake kernels and their autograd, shared by every fused backend.

Loading the C++ extension registers torch.ops.ms_loss_cuda.ms_loss_forward/_backward with their
CPU (and, when built, CUDA) kernels; the Triton backend registers its own pair of ops with the same
schema (ms_loss_cuda.triton_kernels). `register_fused_op` gives each pair one fake kernel and one
autograd formula, so `torch.compile` and `opcheck` see every backend the same way, and returns the
differentiable forward the loss calls (`fused_forward` for the C++ ops).
`LOAD_ERROR` holds why the extension could not be loaded (None when it was).
"""

import torch

from .common import HYPER_PARAMETERS, compute_dtype

try:
    from . import _C  # noqa: F401  (registers torch.ops.ms_loss_cuda)

    LOAD_ERROR = None
except ImportError as error:  # the package still works through the reference backend
    LOAD_ERROR = error


def cpu_saved_rows(batch, ref_rows, elem_size, self_case):
    """Rows the fused CPU forward adds to stats [4, B] for the pair weights it keeps for the backward,
    under MS_LOSS_CPU_SAVED_MB as set now: the extension's own layout rule (csrc/ms_cpu_saved.h,
    saved_layout), a plain function of _C, so the fake kernel may call it while the op is traced."""
    return _C.cpu_saved_rows(int(batch), int(ref_rows), int(elem_size), bool(self_case))


def register_fused_op(forward_name, backward_name, forward_impl, backward_impl, saved_rows=None):
    """Fake kernels and autograd for a (forward, backward) pair of ops with the schemas of
    csrc/ms_loss_schema.h: forward(x, labels, ids?, ref?, ref_labels?, ref_ids?, *hyper) -> (loss [B],
    stats [4 + saved_rows(x, ref), B]: what the backward reuses); backward(grad_loss, stats, x, ...,
    *hyper, ref_grad) -> (grad_x, grad_ref or empty [0]). Autograd asks for grad_ref only when ref
    requires a gradient (a memory bank does not).
    Returns the differentiable forward: the op where the call is traced (`traced`); in eager mode
    the same implementations, saved tensors and gradient through a plain autograd.Function, which
    skips the op's Python dispatch layers (bench/host_time.py measures both paths)."""
    traced_forward = _op(forward_name)

    @torch.library.register_fake(forward_name)
    def _forward_fake(x, labels, ids, ref, ref_labels, ref_ids, *hyper_parameters):
        batch, dtype = x.shape[0], compute_dtype(x)
        extra = 0 if saved_rows is None else saved_rows(x, ref)
        return x.new_empty((batch,), dtype=dtype), x.new_empty((4 + extra, batch), dtype=dtype)

    @torch.library.register_fake(backward_name)
    def _backward_fake(grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base, epsilon,
                       mining, skip_incomplete_anchors, ref_grad=True):
        return torch.empty_like(x), (torch.empty_like(ref) if ref is not None and ref_grad else x.new_empty((0,)))

    def keep_for_backward(ctx, inputs, output):
        x, labels, ids, ref, ref_labels, ref_ids, *hyper_parameters = inputs
        ctx.save_for_backward(x, labels, ids, ref, ref_labels, ref_ids, output[1])
        ctx.hyper_parameters = hyper_parameters
        # stats takes no gradient; never materialise one (a zero-filled copy of the CPU op's saved
        # pair weights, as large as S, on every backward)
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    def gradient_through(backward_fn):
        def backward(ctx, grad_loss, grad_stats):
            x, labels, ids, ref, ref_labels, ref_ids, stats = ctx.saved_tensors
            if grad_loss is None:  # an undefined gradient (autograd may pass one; gradcheck does)
                grad_loss = stats.new_zeros(x.shape[0])
            ref_grad = ref is not None and ctx.needs_input_grad[3]
            grad_x, grad_ref = backward_fn(
                grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, *ctx.hyper_parameters, ref_grad
            )
            grad_x, grad_ref = first_derivative_only((x, ref), grad_x, grad_ref)
            grad_ref = grad_ref if ref_grad else None
            return (grad_x, None, None, grad_ref, None, None) + (None,) * len(HYPER_PARAMETERS)
        return backward

    torch.library.register_autograd(forward_name, gradient_through(_op(backward_name)),
                                    setup_context=keep_for_backward)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):  # (with ctx: apply binds no signature, as it does for a separate setup_context)
            output = forward_impl(*inputs)
            keep_for_backward(ctx, inputs, output)
            return output

        backward = staticmethod(gradient_through(backward_impl))

    def fused_forward(*inputs):
        return traced_forward(*inputs) if traced() else Eager.apply(*inputs)

    return fused_forward


def first_derivative_only(inputs, *grads):
    """`grads` as they are, or in a backward under create_graph=True (grad mode on) tied by
    `_FirstDerivativeOnly` to the first of `inputs` that takes a gradient, so that differentiating
    them again raises (a fused backward's gradients: every fused backend, and triton's row kernels)."""
    if torch.is_grad_enabled():
        for embeddings in inputs:
            if embeddings is not None and embeddings.requires_grad:
                return _FirstDerivativeOnly.apply(embeddings, *grads)
    return grads


class _FirstDerivativeOnly(torch.autograd.Function):
    """Copies of a fused backward's gradients, tied to the embeddings, so that differentiating them
    again (create_graph=True, then a second backward) raises: autograd would see no graph behind the
    kernels' gradients and leave their share out of the second derivative without a word."""

    @staticmethod
    def forward(ctx, embeddings, *grads):
        return tuple(None if grad is None else grad.clone() for grad in grads)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("the fused backends (cpu, triton, cuda) have no second derivative; use "
                           "backend='reference' to differentiate the loss twice")


def traced():
    """Whether the call is traced rather than run: by torch.compile or export, or under one of torch's
    tracing modes (fake tensors, make_fx proxies, functionalisation), which need the op and its fake."""
    if torch.compiler.is_compiling():
        return True
    for key in _TRACING_MODES:  # (a loop: no generator's call at every step)
        if torch._C._get_dispatch_mode(key) is not None:
            return True
    return False


_TRACING_MODES = tuple(torch._C._TorchDispatchModeKey.__members__.values())


def _op(qualified_name):
    namespace, name = qualified_name.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


if LOAD_ERROR is None:
    forward_op = torch.ops.ms_loss_cuda.ms_loss_forward.default
    backward_op = torch.ops.ms_loss_cuda.ms_loss_backward.default
    fused_forward = register_fused_op(
        "ms_loss_cuda::ms_loss_forward", "ms_loss_cuda::ms_loss_backward", forward_op, backward_op,
        saved_rows=lambda x, ref: 0 if x.device.type != "cpu" else cpu_saved_rows(
            x.shape[0], x.shape[0] if ref is None else ref.shape[0], compute_dtype(x).itemsize, ref is None))
