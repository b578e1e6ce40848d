"""The fused operators: their fake kernels and their autograd, shared by every fused backend.

Loading the C++ extension registers torch.ops.ms_loss_cuda.ms_loss_forward/_backward with their
CPU (and, when built, CUDA) kernels; the Triton backend registers its own pair of ops with the same
schema (ms_loss_cuda.triton_kernels). `register_fused_op` gives each pair one fake kernel and one
autograd formula, so `torch.compile` and `opcheck` see every backend the same way, and returns the
differentiable forward op that traced calls of the loss run (`fused_forward` for the C++ ops).
`eager_loss` is the C++ ops' eager call as one autograd node (normalisation, loss, reduction).
`LOAD_ERROR` holds why the extension could not be loaded (None when it was).
"""

import contextlib

import torch

from .common import (HYPER_PARAMETERS, compute_dtype, nan_if_nonfinite, reduce_losses, savable,
                     unit_rows_and_norms, unit_rows_grad)

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


def register_fused_op(forward_name, backward_name, saved_rows=None):
    """Fake kernels and autograd for a (forward, backward) pair of ops with the schemas of
    csrc/ms_loss_schema.h: forward(x, labels, ids?, ref?, ref_labels?, ref_ids?, *hyper) -> (loss [B],
    stats [4 + saved_rows(x, ref), B]: what the backward reuses); backward(grad_loss, stats, x, ...,
    *hyper, ref_grad) -> (grad_x, grad_ref or empty [0]). Autograd asks for grad_ref only when ref
    requires a gradient (a memory bank does not).
    Returns the forward op, differentiable: what a traced call of the loss runs. Eager calls take
    each backend's one-node path instead, which skips the op's Python dispatch layers and torch's
    small ops around it (bench/host_time.py times both for the triton backend, bench/benchmark.py's
    cpu-ops provider the cpu backend's traced path)."""
    backward_kernel = _op(backward_name)

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

    def backward(ctx, grad_loss, grad_stats):
        x, labels, ids, ref, ref_labels, ref_ids, stats = ctx.saved_tensors
        if grad_loss is None:  # an undefined gradient (autograd may pass one; gradcheck does)
            grad_loss = stats.new_zeros(x.shape[0])
        ref_grad = ref is not None and ctx.needs_input_grad[3]
        with torch.no_grad():  # (under create_graph=True too: the kernels' out= products take no autograd)
            grad_x, grad_ref = backward_kernel(grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids,
                                               *ctx.hyper_parameters, ref_grad)
        grad_x, grad_ref = first_derivative_only((x, ref), grad_x, grad_ref)
        grad_ref = grad_ref if ref_grad else None
        return (grad_x, None, None, grad_ref, None, None) + (None,) * len(HYPER_PARAMETERS)

    torch.library.register_autograd(forward_name, backward, setup_context=keep_for_backward)
    return _op(forward_name)


class _EagerLoss(torch.autograd.Function):
    """multi_similarity_loss on the C++ ops (the cpu and cuda backends) in eager calls, as one autograd
    node from the embeddings to the loss: the normalisation, the forward op, the reduction, the
    finiteness check and the cast forward; the backward op and the normalisation's backward. Each
    step of the generic path (common.Backend.loss) would be a node of its own, and at small B the
    nodes and their small ops take longer than the fused kernels. The same ops, the same results.
    `config`: (the keys (labels, ids, ref_labels, ref_ids), hyper_parameters, normalize, reduction,
    dtype), one argument: apply handles each of its arguments on the host."""

    @staticmethod
    def forward(ctx, x, ref, config):
        (labels, ids, ref_labels, ref_ids), hyper_parameters, normalize, reduction, dtype = config
        a, a_norms = unit_rows_and_norms(x) if normalize else (x, None)
        b, b_norms = unit_rows_and_norms(ref) if normalize and ref is not None else (ref, None)
        with _below_autograd():  # (this node is the autograd: the op's own formula would only redispatch)
            losses, stats = forward_op(a, labels, ids, b, ref_labels, ref_ids, *hyper_parameters)
        # (x and ref themselves only where they take a gradient, which first_derivative_only ties to: a
        # bank that takes none may be written in place before the backward, as the ops path allows)
        ctx.save_for_backward(x if ctx.needs_input_grad[0] else None, ref if ctx.needs_input_grad[1] else None,
                              *savable(a, a_norms, b, b_norms, stats, labels, ids, ref_labels, ref_ids))
        ctx.hyper_parameters, ctx.reduction = hyper_parameters, reduction
        loss = reduce_losses(losses, reduction)
        if not normalize:
            return nan_if_nonfinite(loss, a, b, as_they_are=True).to(dtype)
        # a row's norm is NaN where the row holds a NaN or an infinity or where its squares or its
        # norm overflow (common.unit_rows_and_norms), and only where its unit row holds a NaN: the
        # rule of nan_if_nonfinite on the unit rows, from B values instead of B x D
        for norms in (a_norms, b_norms):
            if norms is not None and norms.numel():
                loss = torch.add(loss, norms.amax(), alpha=0)
        return loss.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        x, ref, a, a_norms, b, b_norms, stats, labels, ids, ref_labels, ref_ids = ctx.saved_tensors
        wanted, ref_grad = ctx.needs_input_grad[0], b is not None and ctx.needs_input_grad[1]
        with torch.no_grad():  # (under create_graph=True too: first_derivative_only ties the result)
            # grad_output per anchor, in the compute dtype (as autograd's chain through the cast and the mean)
            grad_loss = grad.to(stats.dtype)
            if ctx.reduction != "none":
                grad_loss = grad_loss.expand(a.shape[0])  # (the kernels make it contiguous)
                grad_loss = grad_loss / a.shape[0] if ctx.reduction == "mean" else grad_loss
            # (the CPU kernel computes in float32 whatever the rows' dtype: given 16-bit unit rows as float32
            # it returns float32 gradients, which the normalisation's backward divides by the norms before
            # they are rounded once; rounded first, they overflow float16 where they are |t| times the
            # embeddings' own: rows of norm 12 under a loss scale of 2^16, say)
            wide = a_norms is not None and a.device.type == "cpu" and a.dtype in (torch.float16, torch.bfloat16)
            rows = (a.float(), None if b is None else b.float()) if wide else (a, b)
            da, db = backward_op(grad_loss, stats, rows[0], labels, ids, rows[1], ref_labels, ref_ids,
                                 *ctx.hyper_parameters, ref_grad)
            if a_norms is not None:
                da = unit_rows_grad(da, a, a_norms).to(a.dtype) if wanted else None
                db = unit_rows_grad(db, b, b_norms).to(b.dtype) if ref_grad else None
        return first_derivative_only((x, ref), da if wanted else None, db if ref_grad else None) + (None,)


def eager_loss(x, labels, ids, ref, ref_labels, ref_ids, hyper_parameters, normalize, reduction, dtype):
    """multi_similarity_loss's result (reduced, in `dtype`) through `_EagerLoss`, for checked inputs."""
    return _EagerLoss.apply(x, ref, ((labels, ids, ref_labels, ref_ids), tuple(hyper_parameters), normalize,
                                     reduction, dtype))


def first_derivative_only(inputs, *grads):
    """`grads` as they are, or in a backward under create_graph=True (grad mode on) tied by
    `_FirstDerivativeOnly` to every one of `inputs` that takes a gradient, so that differentiating
    them again, with respect to any of those, raises (a fused backward's gradients: every fused
    backend, and triton's row kernels)."""
    if torch.is_grad_enabled():
        tied = tuple(t for t in inputs if t is not None and t.requires_grad)
        if tied:
            return _FirstDerivativeOnly.apply(len(tied), *tied, *grads)
    return grads


class _FirstDerivativeOnly(torch.autograd.Function):
    """Copies of a fused backward's gradients, tied to the embeddings, so that differentiating them
    again (create_graph=True, then a second backward) raises: autograd would see no graph behind the
    kernels' gradients and leave their share out of the second derivative without a word."""

    @staticmethod
    def forward(ctx, tied, *tensors):  # (the `tied` inputs, then the gradients)
        return tuple(None if grad is None else grad.clone() for grad in tensors[tied:])

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
# The dispatcher's guard that skips the autograd keys, as torch's own autograd formulas use to reach the
# kernel; a torch without it goes through the op's autograd formula, which then redispatches.
_below_autograd = getattr(torch._C, "_AutoDispatchBelowAutograd", contextlib.nullcontext)


def _op(qualified_name):
    namespace, name = qualified_name.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


if LOAD_ERROR is None:
    forward_op = torch.ops.ms_loss_cuda.ms_loss_forward.default
    backward_op = torch.ops.ms_loss_cuda.ms_loss_backward.default
    fused_forward = register_fused_op(
        "ms_loss_cuda::ms_loss_forward", "ms_loss_cuda::ms_loss_backward",
        saved_rows=lambda x, ref: 0 if x.device.type != "cpu" else cpu_saved_rows(
            x.shape[0], x.shape[0] if ref is None else ref.shape[0], compute_dtype(x).itemsize, ref is None))
