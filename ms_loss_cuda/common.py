"""What every backend shares: the input checks, the dtype rules, the reduction, the handling of
non-finite inputs, the normalisation, and `Backend`, the small interface each backend implements.

The public API (loss.py) checks its inputs and hyper-parameters here, picks a backend (backends.py)
and calls its `loss`. `Backend.loss` is the one call path: normalise the rows (cosine similarity),
compute the per-anchor losses, reduce them in float32 (float64 for float64 inputs), turn the result
into NaN where an input holds a NaN or an infinity, and cast it to the embeddings' dtype. A backend
supplies its per-anchor losses, and may replace the whole path with a faster one of its own that
keeps these rules (the eager calls of the C++ and Triton backends are one autograd node each).
"""
import inspect

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton and CUDA kernels take
REDUCTIONS = ("mean", "sum", "none")
_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # (its smallest normal number)
# the hyper-parameters every backend takes, in the order of the fused ops' schema (csrc/ms_loss_schema.h)
HYPER_PARAMETERS = ("alpha", "beta", "base", "epsilon", "mining", "skip_incomplete_anchors")


def hyper_parameters_of(options):
    """The values of HYPER_PARAMETERS in that order, a tuple, from a dict of checked options (torch.compile
    traces this; it cannot trace operator.itemgetter)."""
    return tuple([options[name] for name in HYPER_PARAMETERS])


# ---- dtype rules ------------------------------------------------------------------------------
def compute_dtype(x):
    """The dtype of every similarity, exponent, sum and of the loss: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def squares_dtype(dtype):
    """What the squares of a row of `dtype` are summed in for its norm: float64 for float32 and bfloat16
    rows (in float32 they overflow from a norm of about 1.8e19 on), float32 for float16 ones."""
    return torch.float32 if dtype == torch.float16 else torch.float64


def loss_dtype(embeddings):
    """The embeddings' dtype, as torch's losses return; under autocast float32, as torch's losses run
    there (so a GradScaler's factor of 2^16 never meets a float16 loss)."""
    if embeddings.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(embeddings.device.type):
        return torch.float32
    return embeddings.dtype


# ---- input checks -----------------------------------------------------------------------------
def check_dense(name, t):
    """`t` a tensor of the strided layout (sparse ones reach no kernel or sort of this library)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got {t.layout}")


def check_embeddings(name, t):
    check_dense(name, t)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, D], got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if t.shape[1] == 0:
        raise ValueError(f"{name} must have at least one column (D >= 1), got shape {tuple(t.shape)}")


def is_integer(t):
    """Whether tensor `t` holds integers (not bools, floats or complex numbers)."""
    return not (t.dtype == torch.bool or t.is_floating_point() or t.is_complex())


def is_boolean(value):
    """A bool of Python, numpy (its dtype's name) or torch: refused where a number is expected. (Python's
    numbers and torch.compile's symbolic ones first: under dynamic=True a float argument is a SymFloat,
    whose attributes Dynamo cannot look up.)"""
    if isinstance(value, (bool, int, float, torch.SymInt, torch.SymFloat)):
        return isinstance(value, bool)
    return str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def shown(value):
    """`value` as an error message shows it (an integer too long for its decimal form as its size)."""
    return f"an integer of {value.bit_length()} bits" if isinstance(value, int) and value.bit_length() > 64 \
        else repr(value)


def check_keys(name, t, of_name, of):
    """`t`: one integer key per row of the tensor `of` (named `of_name` in the error)."""
    check_dense(name, t)
    if not is_integer(t):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != of.shape[0]:
        raise ValueError(f"{name} must have shape [{of.shape[0]}] to match {of_name} {tuple(of.shape)}, "
                         f"got {tuple(t.shape)}")


def check_key_dtypes(name, t, ref_name, ref):
    """Keys of two dtypes are compared as int64, where a uint64 key of 2^63 or more would wrap onto a
    negative one of the other end: uint64 keys must have uint64 keys opposite."""
    if t.dtype != ref.dtype and torch.uint64 in (t.dtype, ref.dtype):
        raise TypeError(f"{name} ({t.dtype}) and {ref_name} ({ref.dtype}) must share a dtype where either is uint64 "
                        f"(keys of two dtypes are compared as int64)")


def check_hyper_parameters(alpha, beta, base, epsilon, reduction):
    # (comparisons written out rather than a table of rules: this runs at every call)
    # Finite in float32, where every dtype but float64 computes: a larger one would be inf there; alpha
    # and beta at least float32's smallest normal number, where a smaller one would be 0 (or lose its
    # precision) and 1 / alpha or 1 / beta infinite, which an empty set's term of 0 would turn into NaN.
    for name, value, smallest in (("alpha", alpha, _FLOAT32_TINY), ("beta", beta, _FLOAT32_TINY),
                                  ("epsilon", epsilon, 0.0)):
        if not (value >= smallest and value <= _FLOAT32_MAX):
            raise ValueError(f"{name} must be " + ("at least float32's smallest normal number (1.2e-38)"
                                                    if smallest else ">= 0") + f" and finite in float32, got {value}")
    if not abs(base) <= _FLOAT32_MAX:
        raise ValueError(f"base must be finite in float32, got {base}")
    if max(alpha, beta) * (1 + abs(base)) > _FLOAT32_MAX:  # (the exponents of unit rows, |S| <= 1)
        raise ValueError(f"alpha and beta times (1 + |base|) must be finite in float32, got alpha {alpha}, "
                         f"beta {beta}, base {base}")
    check_reduction(reduction)


def check_reduction(reduction):
    if not (isinstance(reduction, str) and reduction in REDUCTIONS):
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_inputs(embeddings, labels, ref_embeddings, ref_labels, ids, ref_ids):
    """Every tensor's type and shape, and one device for all. (On every eager step: error messages are
    only built on failure.)"""
    check_embeddings("embeddings", embeddings)
    check_keys("labels", labels, "embeddings", embeddings)
    if (ref_embeddings is None) != (ref_labels is None):
        raise ValueError("ref_embeddings and ref_labels must be given together")
    if ref_embeddings is not None:
        check_embeddings("ref_embeddings", ref_embeddings)
        if ref_embeddings.shape[1] != embeddings.shape[1]:
            raise ValueError(
                f"ref_embeddings {tuple(ref_embeddings.shape)} and embeddings "
                f"{tuple(embeddings.shape)} must have the same D"
            )
        check_keys("ref_labels", ref_labels, "ref_embeddings", ref_embeddings)
        if (ids is None) != (ref_ids is None):
            raise ValueError("with a reference set, ids and ref_ids must be given together")
    elif ref_ids is not None:
        raise ValueError("ref_ids needs ref_embeddings (in the self case ids serve both ends)")
    if ids is not None:
        check_keys("ids", ids, "embeddings", embeddings)
    if ref_ids is not None:
        check_keys("ref_ids", ref_ids, "ref_embeddings", ref_embeddings)
        check_key_dtypes("ids", ids, "ref_ids", ref_ids)
    if ref_labels is not None:
        check_key_dtypes("labels", labels, "ref_labels", ref_labels)
    device = embeddings.device
    for t in (labels, ref_embeddings, ref_labels, ids, ref_ids):  # (a loop: no generator's call at every step)
        if t is not None and t.device != device:
            named = (("embeddings", embeddings), ("labels", labels), ("ref_embeddings", ref_embeddings),
                     ("ref_labels", ref_labels), ("ids", ids), ("ref_ids", ref_ids))
            raise ValueError("all tensors must be on one device, got " +
                             ", ".join(f"{name} on {t.device}" for name, t in named if t is not None))


def savable(*tensors):
    """`tensors` for ctx.save_for_backward, each as it is but one made under torch.inference_mode (keys
    made there, say), which autograd refuses to save: a copy of it, made outside."""
    return tuple(t.clone() if t is not None and t.is_inference() else t for t in tensors)


# ---- reduction and non-finite inputs ------------------------------------------------------------
def reduce_losses(losses, reduction):
    """"mean" divides by B (every anchor counts, 0 for B = 0), "sum" sums, "none" keeps [B]."""
    if reduction == "none":
        return losses
    return losses.mean() if reduction == "mean" and losses.shape[0] else losses.sum()


def nan_if_nonfinite(loss, *inputs, as_they_are=False):
    """NaN or Inf anywhere in the rows compared makes the result NaN (never a finite number); unit rows
    hold NaN where the input held NaN or Inf, or where a row's norm passes the compute dtype's range.
    Checked on each tensor's extremes, which NaN propagates to: one pass without a temporary of the
    tensor's size, where torch.isfinite(t).all() makes a boolean one and reads it again. Each extreme is
    added times 0 (alpha=0: 0, or NaN where it is not finite): three ops in the self case, none in the
    backward (each op is a GPU launch that costs host time).
    `as_they_are` (normalize=False): the extreme is the largest squared row norm (four ops a tensor),
    so that a row whose squared norm passes the compute dtype's range makes the result NaN as well. Its
    similarities may overflow, and a NaN similarity (inf - inf in a product) fails every mining
    comparison, which would drop its pairs and leave a finite, wrong loss; below that range every
    similarity is bounded by the product of two finite norms."""
    for t in inputs:
        if t is not None and t.numel() > 0:
            t = t.detach()
            extremes = ((torch.linalg.vector_norm(t, dim=1, dtype=compute_dtype(t)).amax().square(),) if as_they_are
                        else torch.aminmax(t))
            for extreme in extremes:
                loss = torch.add(loss, extreme, alpha=0)
    return loss


# ---- the normalisation ----------------------------------------------------------------------------
def fixed_signature(fn):
    """`fn` with its signature worked out once: autograd.Function.apply binds the inputs to the
    signature of a forward that has a separate setup_context, which inspect would rebuild on every
    call."""
    fn.__signature__ = inspect.signature(fn)
    return fn


def unit_rows(t):
    """Rows scaled to unit L2 norm, in t's own dtype. Under CUDA autocast F.normalize returns float32
    (its norm is an autocast float32 op), which would send 16-bit embeddings to the float32 kernels;
    here only the norm is float32 (float64 for float64), the rows keep their dtype."""
    return _UnitRows.apply(t)


def _row_norms(t):
    """max(|t_i|, 1e-12) per row, in float32 (float64 for float64), the squares summed in
    squares_dtype, so that a float32 row of norm above about 1.8e19 keeps its norm, where F.normalize
    makes it zero. A norm beyond float32's range itself is NaN rather than inf: its row would divide
    to zeros, a finite row that is not its unit row, where NaN makes the loss NaN (nan_if_nonfinite)."""
    norms = torch.linalg.vector_norm(t, dim=1, keepdim=True, dtype=squares_dtype(t.dtype)).to(compute_dtype(t))
    return torch.add(norms, norms, alpha=0).clamp_min(1e-12)  # (inf + 0 * inf: NaN)


class _UnitRows(torch.autograd.Function):
    """y = t / max(|t|, 1e-12) row by row, with the analytic backward dt = (g - y (g . y)) / |t| (just
    g / 1e-12 where the norm was clamped): three passes over [B, D], where autograd's chain through
    the division and the norm makes six. The backward is built from t and y with differentiable ops,
    so second derivatives stay exact. 16-bit rows are divided by the float32 norm and rounded once:
    a float16 norm would be inf above 65504 (and the row 0)."""

    generate_vmap_rule = True

    @staticmethod
    @fixed_signature
    def forward(t):
        return unit_rows_and_norms(t)[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, g):
        t, y = ctx.saved_tensors
        return unit_rows_grad(g, y, _row_norms(t))


def unit_rows_in_compute_dtype(t):
    """unit_rows(t)'s values (rounded to t's dtype, as every backend compares them) in t's compute
    dtype, whose gradient stays in the compute dtype through the normalisation's derivative and is
    rounded to t's dtype once. Through unit_rows and a cast, a 16-bit gradient of the unit rows would
    be rounded first: it is |t| times the embeddings' own, and overflows float16 before it (rows of
    norm 12 under a loss scale of 2^16, say). The gradient is unit_rows' of t in the compute dtype,
    exact to any order; the difference of the values, the rounding, is added as a constant."""
    if t.dtype == compute_dtype(t):
        return unit_rows(t)
    wide = unit_rows(t.to(compute_dtype(t)))
    return wide + (unit_rows(t).to(wide.dtype) - wide).detach()


def unit_rows_and_norms(t):
    """(unit rows of t in t's dtype, the norms they were divided by: [B, 1], float32 or float64)."""
    norms = _row_norms(t)
    y = t / norms
    # (no .to where the dtype is t's already: torch 2.11's compiled backward is 0 after a no-op .to)
    return (y if y.dtype == t.dtype else y.to(t.dtype)), norms


def unit_rows_grad(g, y, norms):
    """The gradient through y = unit_rows(t), whose rows were divided by `norms`, of the gradient g of y:
    (g - y (g . y)) / norms, g / 1e-12 where the norm was clamped; in g's dtype."""
    along = (g * y).sum(dim=1, keepdim=True, dtype=norms.dtype).masked_fill_(norms <= 1e-12, 0)
    return (torch.addcmul(g, y, along.to(g.dtype), value=-1) / norms).to(g.dtype)


# ---- the backend interface ----------------------------------------------------------------------
class Backend:
    """What the public API asks of a backend. `name` is what `backend=` takes; `auto_devices` the
    device types on which "auto" may pick it (backends.py tries them in its registry's order), `dtypes`
    the embeddings' dtypes it takes.
    Hyper-parameters come as a dict with every name of HYPER_PARAMETERS, floats checked already."""

    name = None
    auto_devices = ()
    dtypes = FLOAT_DTYPES  # the embeddings' dtypes it takes

    def unavailable_reason(self, device, dtype=None):
        """Why this backend cannot run on `device` with embeddings of `dtype` (None: any; with a reference
        set, the dtype both ends promote to), or None."""
        if dtype is not None and dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"it takes {names} embeddings, got {dtype} (with ref_embeddings: the dtype both ends promote to)"
        return None

    def unit_rows(self, t):
        """The rows of `t` normalised as this backend's loss normalises them."""
        return unit_rows(t)

    def loss_rows(self, t):
        """`unit_rows(t)` as `loss` passes them to `anchor_losses` (their values; a backend that computes
        in the compute dtype may take them there)."""
        return self.unit_rows(t)

    def anchor_losses(self, x, labels, ids, ref, ref_labels, ref_ids, options):
        """The per-anchor losses [B] (compute dtype) of normalised (or raw) rows."""
        raise NotImplementedError

    def memory_loss(self, x, labels, ids, slots, memory, filled, weight, options, normalize, reduction):
        """CrossBatchMemory's step as one call of this backend, for checked inputs: the rows of x
        (normalised where `normalize`), their labels and ids stored at `slots` of `memory` (its
        embeddings, labels and ids buffers), then the loss against the batch plus `weight` times the
        loss against the memory's first `filled` rows. None where the backend has no such call (then
        the memory makes its two loss calls)."""
        return None

    def loss(self, embeddings, labels, ids, ref, ref_labels, ref_ids, options, normalize, reduction):
        """The reduced loss, for inputs that check_inputs accepted."""
        x, r = embeddings, ref
        if normalize:
            x = self.loss_rows(x)
            r = None if r is None else self.loss_rows(r)
        losses = self.anchor_losses(x, labels, ids, r, ref_labels, ref_ids, options)
        loss = reduce_losses(losses, reduction)  # float32 (float64) sums, then the embeddings' dtype
        return nan_if_nonfinite(loss, x, r, as_they_are=not normalize).to(loss_dtype(embeddings))
