"""The Triton backend's operators and autograd: the custom ops, and the eager loss as one autograd node.

- `triton_forward` / `triton_backward`: custom ops (torch.ops.ms_loss_cuda.triton_forward/_backward)
  with the C++ ops' schema, fake kernels and autograd (ops.register_fused_op): what torch.compile,
  torch.export and opcheck see. `fused_forward` is the differentiable forward built on them.
- `eager_loss`: an eager call as one autograd node from the embeddings to the loss (`_EagerLoss`):
  the normalisation (row_kernels), the forward's launches, the reduction, the finiteness check and
  the cast, and, where a gradient will be taken, the backward's launches issued right behind the
  forward's, so that the GPU works through them while the host returns.
- `unit_rows`: the backend's normalisation alone, one launch each way (CrossBatchMemory and the
  distributed loss normalise once per step).
The fused backends give the first derivative only: differentiating a gradient again raises.
"""
import functools
from typing import Optional

import torch

from .. import ops
from ..common import check_inputs, nan_if_nonfinite, reduce_losses, savable
from .backward import Reorder, backward_plan
from .forward import forward_plan, forward_plan_keeping_rows
from .launcher import run
from . import replay
from .operands import SAVED_ROWS, ranked_keys
from .row_kernels import row_norms_plan, stored_rows_plan, unit_rows_grad_plan, unit_rows_plan


# ---- the ops ----------------------------------------------------------------------------------
def _forward(x: torch.Tensor, labels: torch.Tensor, ids: Optional[torch.Tensor], ref: Optional[torch.Tensor],
             ref_labels: Optional[torch.Tensor], ref_ids: Optional[torch.Tensor], alpha: float, beta: float,
             base: float, epsilon: float, mining: bool,
             skip_incomplete_anchors: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # the public API's checks, again for direct calls of the op: a wrong length would read out of
    # bounds, a tensor on another device hand the kernel a foreign pointer
    check_inputs(x, labels, ref, ref_labels, ids, ref_ids)
    return run(forward_plan, x.device, x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base, epsilon, mining,
               skip_incomplete_anchors)


def _backward(grad_loss: torch.Tensor, stats: torch.Tensor, x: torch.Tensor, labels: torch.Tensor,
              ids: Optional[torch.Tensor], ref: Optional[torch.Tensor], ref_labels: Optional[torch.Tensor],
              ref_ids: Optional[torch.Tensor], alpha: float, beta: float, base: float, epsilon: float,
              mining: bool, skip_incomplete_anchors: bool,
              ref_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(x, labels, ref, ref_labels, ids, ref_ids)  # (a direct call of the op; see _forward)
    return backward_of_checked_inputs(grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base,
                                      epsilon, mining, skip_incomplete_anchors, ref_grad)


def backward_of_checked_inputs(grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base, epsilon,
                               mining, skip_incomplete_anchors, ref_grad=True, grad_divisor=1, float32=False,
                               rows_in_label_order=None, ref_norms=None, unit_rows=False):
    """The backward op's work, for inputs that were checked: the forward's (and the eager loss's,
    whose "mean" divides by grad_divisor, without normalisation; `float32`: see `_unpadded`;
    `rows_in_label_order`, `ref_norms`, `unit_rows`: see backward_plan)."""
    ref_grad = ref is not None and ref_grad
    grad_x, grad_ref = run(backward_plan, x.device, grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids,
                           alpha, beta, base, epsilon, mining, skip_incomplete_anchors, ref_grad,
                           grad_divisor=grad_divisor, float32=float32, rows_in_label_order=rows_in_label_order,
                           ref_norms=ref_norms, unit_rows=unit_rows)
    return _unpadded(grad_x, x, float32), (_unpadded(grad_ref, ref, float32) if ref_grad else grad_ref)


def _unpadded(grad, like, float32=False):
    """A gradient of backward_plan as the input `like` is: split partials summed in order, its width and
    dtype (mixed dtypes ran promoted); `float32`: its float32 rows as they are (a view, no copy)."""
    grad = _summed(grad)[:, :like.shape[1]]
    return grad if float32 else grad.to(like.dtype).contiguous()


def _summed(grad):
    """A gradient of backward_plan, its split partials [splits, rows, D] summed in order."""
    return grad.sum(0) if grad.dim() == 3 else grad


def _backward_plan_in_label_order(*args, **kwargs):
    """backward_plan's, but the self case's chunked backward leaves dx in label order, without its last
    step (`Reorder`, made without an output), and gives the order too (else None): the
    normalisation's backward reads the rows in that order (`unit_rows_grad_plan`), which saves the
    reordered copy, its memory and its cast."""
    grad_x, grad_ref, launches = backward_plan(*args, reorder=False, **kwargs)
    if launches and isinstance(launches[-1], Reorder):
        reorder = launches.pop()
        return reorder.grad, grad_ref, reorder.order, launches
    return grad_x, grad_ref, None, launches


# ---- the eager path ----------------------------------------------------------------------------
class _UnitRows(torch.autograd.Function):
    """ms_loss_cuda.common.unit_rows (F.normalize in the rows' own dtype) in one launch each way, for
    the triton backend's eager calls: torch's ops take four launches forward and ten backward, and
    pass over [B, D] (or a memory bank's [R, D]) several times more. No second derivative, as the
    fused loss has none: differentiating the gradient again raises."""

    @staticmethod
    def forward(ctx, t):
        y, norm, _ = run(unit_rows_plan, t.device, t.contiguous())
        ctx.save_for_backward(t, y, norm)  # (t: what a second derivative would be taken against)
        return y

    @staticmethod
    def backward(ctx, grad):
        t, y, norm = ctx.saved_tensors
        (dt,) = run(unit_rows_grad_plan, y.device, grad.contiguous(), y, norm)
        return ops.first_derivative_only((t,), dt)[0]


unit_rows = _UnitRows.apply


def _float32_one(device):
    """A float32 1 on `device` (the eager loss's gradient for grad_output 1), made once: no op a step;
    within a CUDA graph's capture a new one (the graph's own memory is not kept beyond it)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.ones(1, dtype=torch.float32, device=device)
    return _kept_float32_one(device)


@functools.cache
def _kept_float32_one(device):
    one = torch.ones(1, dtype=torch.float32, device=device)
    if device.type == "cuda":  # (filled on this call's stream: once, wait for it, before other streams read it)
        torch.cuda.synchronize(device)
    return one


def _unit_rows(t, normalize):
    """(rows, norm, finite): `t` normalised by unit_rows_plan where `normalize` (and t is given), else
    (t, None, None)."""
    return run(unit_rows_plan, t.device, t.contiguous()) if normalize and t is not None else (t, None, None)


def _reference_rows(x, ref, normalize, ref_grad):
    """(rows, norm, finite, ref_norms) of the reference set (`_unit_rows`'s, ref_norms None); for float16
    rows at both ends under `normalize` whose reference set takes no gradient (a memory bank), its rows
    as they are, None, the finite flags and its norms with their reciprocals (row_norms_plan; the
    kernels compare the rows as unit rows through them: forward_plan): no copy of the bank, R x D, at
    every call."""
    if normalize and ref is not None and not ref_grad and x.dtype == ref.dtype == torch.float16:
        ref = ref.contiguous()
        ref_norms, finite = run(row_norms_plan, ref.device, ref)
        return ref, None, finite, ref_norms
    return *_unit_rows(ref, normalize), None


def _reduced(losses, reduction, dtype, x, ref, finite):
    """The loss as multi_similarity_loss returns it: reduced, NaN where an input row is not finite, in
    `dtype`. `finite`: unit_rows_plan's counts of rows with a NaN or an infinity (None for each input
    when the rows were not normalised: then nan_if_nonfinite looks at the inputs, as they are)."""
    loss = reduce_losses(losses, reduction)
    if all(f is None for f in finite):
        return nan_if_nonfinite(loss, x, ref, as_they_are=True).to(dtype)
    for count in finite:
        loss = loss if count is None else torch.add(loss, count.sum())
    return loss.to(dtype)


def _forward_step(x, ref, labels, ids, ref_labels, ref_ids, hyper_parameters, normalize, ref_grad):
    """The eager forward's launches: (losses, stats, rows in label order, saved), `saved` what the
    backward reads (see `_gradients`; `ref_grad`: whether it will take the reference set's gradient)."""
    labels, ids, ref, ref_labels, ref_ids = ranked_keys(labels, ids, ref, ref_labels, ref_ids)
    a, a_norm, a_finite = _unit_rows(x, normalize)
    b, b_norm, b_finite, ref_norms = _reference_rows(x, ref, normalize, ref_grad)
    losses, stats, rows_in_label_order = run(forward_plan_keeping_rows, x.device, a, labels, ids, b, ref_labels,
                                             ref_ids, *hyper_parameters, ref_norms=ref_norms)
    saved = (a, a_norm, b, b_norm, ref_norms, labels, ids, ref_labels, ref_ids, stats)
    return losses, (a_finite, b_finite), rows_in_label_order, saved


def _gradients(saved, grad_loss, hyper_parameters, reduction, wanted, float32=False, rows_in_label_order=None,
               unit_rows=False):
    """(dx, dref) of the loss for grad_loss ([B], or one value expanded), None where `wanted` (a pair of
    booleans) says no; in the inputs' dtypes, or `float32` (`rows_in_label_order`: see backward_plan;
    `unit_rows`: the rows were normalised before the forward, as CrossBatchMemory's step does; those
    normalised by it are known to be)."""
    a, a_norm, b, b_norm, ref_norms, labels, ids, ref_labels, ref_ids, stats = saved
    batch, ref_grad = a.shape[0], b is not None and wanted[1]
    divisor = batch if reduction == "mean" and batch else 1
    args = (grad_loss, stats, a, labels, ids, b, ref_labels, ref_ids, *hyper_parameters, ref_grad)
    options = dict(grad_divisor=divisor, float32=float32, rows_in_label_order=rows_in_label_order,
                   ref_norms=ref_norms, unit_rows=unit_rows or a_norm is not None)
    if a_norm is None:
        da, db = backward_of_checked_inputs(*args, **options)
    else:  # then the normalisation's backward, from the loss's float32 gradients where they are
        da, db, order = run(_backward_plan_in_label_order, a.device, *args, **options)
        dtype = torch.float32 if float32 else None
        da = run(unit_rows_grad_plan, a.device, _summed(da), a, a_norm, order, dtype)[0] if wanted[0] else None
        db = run(unit_rows_grad_plan, a.device, _summed(db), b, b_norm, None, dtype)[0] if ref_grad else None
    return da if wanted[0] else None, db if ref_grad else None


def _step_with_gradients(x, ref, labels, ids, ref_labels, ref_ids, hyper_parameters, normalize, reduction, dtype,
                         wanted):
    """(loss, dx, dref) of an eager call whose gradient is taken now: the forward's launches, then the
    backward's for grad_output 1, the gradients in float32 (see `_EagerLoss`). Every launch is on
    the GPU, without host synchronisation: what replay.call captures."""
    losses, finite, rows_in_label_order, saved = _forward_step(x, ref, labels, ids, ref_labels, ref_ids,
                                                               hyper_parameters, normalize, wanted[1])
    ones = _float32_one(x.device).expand(x.shape[0])
    da, db = _gradients(saved, ones, hyper_parameters, reduction, wanted, True, rows_in_label_order)
    return _reduced(losses, reduction, dtype, x, ref, finite), da, db


def _scaled(g, grad, dtype):
    """g (float32) times grad_output (the 0-d gradient of the 0-d loss: it takes g's float32), rounded
    once into `dtype`: one op, whose kernel casts as it stores (on a GPU; the CPU's goes through a
    float32 copy). A grad_output batched by vmap (autograd.grad's is_grads_batched, jacobian's
    vectorize), which cannot meet an out= op, takes two ops."""
    if torch.is_grad_enabled():  # (a backward under create_graph=True: an out= op takes no autograd)
        with torch.no_grad():
            return _scaled(g, grad, dtype)
    try:
        return torch.mul(g, grad, out=torch.empty_like(g, dtype=dtype, memory_format=torch.contiguous_format))
    except RuntimeError:  # ("Batching rule not implemented for aten::mul.out"; anything else fails again below)
        return (g * grad).to(dtype)


def _in_memory(t):
    """Whether the kernels can read `t`: a tensor with storage, not one batched by vmap."""
    try:
        t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return False
    return True


def _memory_step_with_gradients(x, labels, ids, slots, memory, memory_labels, memory_ids, hyper_parameters, normalize,
                                reduction, dtype, filled, weight):
    """(loss, dx) of CrossBatchMemory's step whose gradient is taken now, dx float32 for grad_output 1:
    the batch's rows (normalised where `normalize`) stored at `slots` of the memory, then MS(batch vs
    batch) + weight * MS(batch vs the memory's first `filled` rows), both terms' gradients summed
    before the normalisation's one backward. Every launch is on the GPU, without host
    synchronisation (what replay.call captures); storing the same rows again is harmless, so the
    capture's warm-up may run it once more."""
    a, a_norm, a_finite = _unit_rows(x, normalize)
    run(stored_rows_plan, x.device, a.contiguous(), labels.contiguous(), ids.contiguous(), slots, memory, memory_labels,
        memory_ids)
    bank = memory[:filled], memory_labels[:filled], memory_ids[:filled]
    ones = _float32_one(x.device).expand(x.shape[0])
    terms, grads = [], []
    for ref, ref_labels, ref_ids in ((None, None, None), bank):
        losses, _, rows_in_label_order, saved = _forward_step(a, ref, labels, ids, ref_labels, ref_ids,
                                                              hyper_parameters, False, False)
        terms.append(reduce_losses(losses, reduction))
        grads.append(_gradients(saved, ones, hyper_parameters, reduction, (True, False), True, rows_in_label_order,
                                normalize)[0])
    loss = nan_if_nonfinite(torch.add(*terms, alpha=weight), bank[0], None if normalize else a,
                            as_they_are=not normalize)
    da = torch.add(*grads, alpha=weight)
    if normalize:
        loss = torch.add(loss, a_finite.sum())
        da = run(unit_rows_grad_plan, x.device, da, a, a_norm, None, torch.float32)[0]
    return loss.to(dtype), da


class _EagerMemoryLoss(torch.autograd.Function):
    """CrossBatchMemory's eager step on the triton backend as one autograd node (see `eager_memory_loss`):
    its forward issues the whole step, backward included, as one sequence of launches that replay.call
    captures (the memory's buffers read and written in place); the backward scales the float32
    gradient by grad_output, as `_EagerLoss` does. `tensors`: (labels, ids, slots, and the memory's
    embeddings, labels and ids), one argument with `options`, as `_EagerLoss` takes its keys."""

    @staticmethod
    def forward(ctx, x, tensors, options):
        filled = options[-2]  # (options: hyper-parameters, normalize, reduction, dtype, filled, weight)
        inputs = (x, *tensors)
        loss, dx = replay.call(lambda *tensors: _memory_step_with_gradients(*tensors, *options), inputs, (4, 5, 6),
                               (1,), options, x.device, x.shape[0] * (x.shape[0] + filled))
        saved, ctx.leases = replay.for_backward((dx,))
        ctx.save_for_backward(x, *saved)
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, dx = ctx.saved_tensors
        dx = replay.use(ctx.leases[0], dx, lambda g: _scaled(g, grad, x.dtype))
        return ops.first_derivative_only((x,), dx) + (None, None)


def eager_memory_loss(x, labels, ids, slots, memory, memory_labels, memory_ids, filled, weight, hyper_parameters,
                      normalize, reduction, dtype):
    """CrossBatchMemory's step (memory.py) for checked inputs whose gradient is taken now ("mean" or
    "sum", grad mode on, x requiring grad): the rows of x stored at `slots` of the memory's buffers,
    then the loss against the batch plus `weight` times the loss against the memory's first `filled`
    rows, as one autograd node; None for any other call (then the memory makes its two loss calls)."""
    if reduction == "none" or not torch.is_grad_enabled() or not x.requires_grad:
        return None
    options = (tuple(hyper_parameters), normalize, reduction, dtype, filled, float(weight))
    return _EagerMemoryLoss.apply(x, (labels, ids, slots, memory, memory_labels, memory_ids), options)


class _EagerLoss(torch.autograd.Function):
    """multi_similarity_loss on the triton backend in eager calls, one autograd node from the embeddings
    to the loss: normalisation, the forward's launches, the reduction, the finiteness check and the
    cast, where the loss op and torch's ops would make five nodes and more small ops (each is host
    time on a GPU, the most of an eager step: bench/host_time.py). "mean" and "sum" reach the scales kernel
    as one gradient for all anchors (backward_plan's grad_divisor: no ops to expand, cast and divide
    it, none for its norm), and the normalisation's backward is one launch an input.
    `gradients_now` ("mean" and "sum" under grad mode, an input taking a gradient): the forward also
    issues the backward's launches, for grad_output 1, and keeps their float32 gradients; the
    backward only multiplies them by grad_output. The GPU then runs the backward's kernels while the
    host is still returning from the forward and in the autograd engine, instead of waiting for the
    host to issue them, and the whole step is one sequence of launches that replay.call captures as a
    CUDA graph and replays. The gradient stays float32 until the backward scales it
    (in 16 bits a "mean" gradient's entries of about 1/B would go subnormal before a loss scaler
    lifts them). A forward whose gradient is never taken pays for it, as in Liger-Kernel's fused
    linear cross entropy. "none" takes its backward in the backward.
    Traced calls take the ops (`fused_forward`) instead. No second derivative: differentiating the
    gradient again raises, as for every fused backend. `config`: (the keys (labels, ids, ref_labels,
    ref_ids), hyper_parameters, normalize, reduction, dtype, gradients_now), one argument: autograd's
    apply handles each of its arguments on the host, and only x and ref may take a gradient."""

    @staticmethod
    def forward(ctx, x, ref, config):
        (labels, ids, ref_labels, ref_ids), hyper_parameters, normalize, reduction, dtype, gradients_now = config
        ctx.hyper_parameters, ctx.reduction, ctx.gradients_now = hyper_parameters, reduction, gradients_now
        ctx.dtypes = (x.dtype, None if ref is None else ref.dtype)
        inputs = (x, ref, labels, ids, ref_labels, ref_ids)
        wanted = (ctx.needs_input_grad[0], ref is not None and ctx.needs_input_grad[1])
        # (x and ref themselves only where they take a gradient, which first_derivative_only ties to: a
        # bank that takes none may be written in place before the backward where the backward does not
        # read it; `saved` holds what it reads)
        tied = tuple(t if w else None for t, w in zip((x, ref), wanted))
        if gradients_now:
            options = (hyper_parameters, normalize, reduction, dtype, wanted)
            pairs = x.shape[0] * (x.shape[0] if ref is None else ref.shape[0])
            loss, *grads = replay.call(lambda *tensors: _step_with_gradients(*tensors, *options), inputs, (1,),
                                       (1, 2), options, x.device, pairs)
            saved, ctx.leases = replay.for_backward(grads)
            ctx.save_for_backward(*tied, *savable(*saved))
            return loss
        losses, finite, _, saved = _forward_step(*inputs, hyper_parameters, normalize, wanted[1])
        ctx.save_for_backward(*tied, *savable(*saved))
        return _reduced(losses, reduction, dtype, x, ref, finite)

    @staticmethod
    def backward(ctx, grad):
        x, ref, *saved = ctx.saved_tensors  # (once: under torch.utils.checkpoint each read unpacks them again)
        if ctx.gradients_now:  # the forward's, for grad_output 1: scaled in float32, rounded once to the inputs' dtypes
            da = replay.use(ctx.leases[0], saved[0], lambda g: _scaled(g, grad, ctx.dtypes[0]))
            db = replay.use(ctx.leases[1], saved[1], lambda g: _scaled(g, grad, ctx.dtypes[1]))
        elif not _in_memory(grad):  # (the kernels take one grad_output at a time: vmap cannot batch a launch)
            raise RuntimeError("the triton backend's gradient of reduction='none' takes one grad_output at a time: "
                               "for batched ones (is_grads_batched, jacobian(vectorize=True)) use backend='cpu' or "
                               "'reference', or one backward per grad_output")
        else:  # "none" (only it comes here: "mean" and "sum" with a gradient to take have theirs)
            da, db = _gradients(saved, grad, ctx.hyper_parameters, ctx.reduction, ctx.needs_input_grad[:2])
        return ops.first_derivative_only((x, ref), da, db) + (None,)


def eager_loss(x, labels, ids, ref, ref_labels, ref_ids, hyper_parameters, normalize, reduction, dtype):
    """multi_similarity_loss's result (reduced, in `dtype`) through `_EagerLoss`, for inputs it checked
    (backend.py)."""
    gradients_now = reduction != "none" and torch.is_grad_enabled() and (
        x.requires_grad or (ref is not None and ref.requires_grad))
    return _EagerLoss.apply(x, ref, ((labels, ids, ref_labels, ref_ids), tuple(hyper_parameters), normalize,
                                     reduction, dtype, gradients_now))


# ---- registration ------------------------------------------------------------------------------
# the ops (same schema, fakes and autograd as the C++ ops), and the differentiable forward that traced calls run
triton_forward = torch.library.custom_op("ms_loss_cuda::triton_forward", _forward, mutates_args=())
triton_backward = torch.library.custom_op("ms_loss_cuda::triton_backward", _backward, mutates_args=())
fused_forward = ops.register_fused_op("ms_loss_cuda::triton_forward", "ms_loss_cuda::triton_backward",
                                      saved_rows=lambda x, ref: SAVED_ROWS if ref is None else 0)

