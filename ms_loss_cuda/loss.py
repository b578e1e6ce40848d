"""The public API: input checks, backend choice and the one call path every backend shares."""
import math
import os
import warnings

import torch

from . import ops, reference

BACKENDS = ("auto", "reference", "cpu", "triton", "cuda")
# What "auto" tries on CUDA tensors, in order: the faster backend as measured on an H100
# (bench/results/gpu/, README), Triton for every dtype (float32 too: in IEEE float32 faster at B = 4096
# and on the memory banks, 8-10% slower at B = 16384 and 65536; 5x faster under TF32), then CUDA.
AUTO_ON_CUDA = ("triton", "cuda")
REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---- backends ---------------------------------------------------------------------------------
def _triton_kernels():
    """The Triton backend module, or the ImportError that keeps it from loading."""
    try:
        from . import triton_kernels
    except ImportError as error:
        return error
    return triton_kernels


def _check_backend_name(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _unavailable_reason(backend, device, dtype=None):
    """Why `backend` (a name from BACKENDS other than "auto") cannot run on `device` with
    embeddings of `dtype` (None: any), or None."""
    if backend == "reference":
        return None
    if backend in ("triton", "cuda") and dtype is not None and dtype not in ops.GPU_DTYPES:
        return f"it takes float32, float16 or bfloat16 embeddings, got {dtype}"
    if backend in ("cpu", "cuda") and ops.LOAD_ERROR is not None:
        return f"the C++ extension ms_loss_cuda._C is not built or failed to load ({ops.LOAD_ERROR})"
    if backend == "cpu":
        return None if device.type == "cpu" else f"it takes CPU tensors, got {device}"
    if backend == "cuda":
        if not torch._C._dispatch_has_kernel_for_dispatch_key("ms_loss_cuda::ms_loss_forward", "CUDA"):
            return "the CUDA kernels were not built (install with a CUDA build of torch and nvcc)"
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"it takes CUDA tensors on a visible GPU, got {device}"
        if torch.cuda.get_device_capability(device) < (8, 0):  # bfloat16 tensor cores, the built targets
            return f"it needs a GPU of compute capability 8.0 or newer, got {torch.cuda.get_device_capability(device)}"
        return None
    if backend == "triton":
        kernels = _triton_kernels()
        if isinstance(kernels, ImportError):
            return f"Triton could not be imported ({kernels}); install triton"
        if device.type == "cpu" and not kernels.INTERPRETED:
            return "on CPU tensors it needs TRITON_INTERPRET=1 set before ms_loss_cuda.triton_kernels is imported"
        if device.type not in ("cpu", "cuda"):
            return f"it takes CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device}"
        if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
            # Triton's supported GPUs; compiled for sm_75 its 16-bit kernels have no tensor-core
            # instructions and spill kilobytes a thread (bench/kernel_resources.py --cc 75)
            return (f"it needs a GPU of compute capability 8.0 or newer (as Triton does), "
                    f"got {torch.cuda.get_device_capability(device)}")
    return None


def available_backends(device="cpu"):
    """The backends this install can run on tensors of `device` (default CPU)."""
    device = torch.device(device)
    return [b for b in BACKENDS[1:] if _unavailable_reason(b, device) is None]


_warned_fallback = False


def _resolve_backend(backend, device, dtype):
    _check_backend_name(backend)  # here, so that a bad name raises ValueError under torch.compile too
    return _choose_backend(backend, device, dtype)


# Decided outside any torch.compile graph: Dynamo calls this at trace time and keeps the name it returns
# (the checks query the dispatcher and import modules, which it cannot trace). So a compiled function
# keeps the backend, and the $MS_LOSS_BACKEND, of the time it was traced.
@torch.compiler.assume_constant_result
def _choose_backend(backend, device, dtype):
    if backend == "auto":
        backend = os.environ.get("MS_LOSS_BACKEND", "auto") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"MS_LOSS_BACKEND must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        reason = _unavailable_reason(backend, device, dtype)
        if reason is not None:
            raise RuntimeError(f"backend {backend!r} cannot run: {reason}")
        return backend
    if device.type == "cuda":
        preferred = AUTO_ON_CUDA if dtype in ops.GPU_DTYPES else ()
    else:
        preferred = ("cpu",) if device.type == "cpu" else ()
    reasons = []
    for candidate in preferred:
        reason = _unavailable_reason(candidate, device, dtype)
        if reason is None:
            return candidate
        reasons.append(f"{candidate}: {reason}")
    global _warned_fallback
    if reasons and not _warned_fallback:  # (once a process: the dense backend holds B x R matrices)
        _warned_fallback = True
        warnings.warn("ms_loss_cuda: using the dense reference backend (" + "; ".join(reasons) + ")")
    return "reference"


# ---- input checks -----------------------------------------------------------------------------
def _check_embeddings(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, D], got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _check_keys(name, t, of_name, of):
    """`t`: one integer key per row of the tensor `of` (named `of_name` in the error)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != of.shape[0]:
        raise ValueError(f"{name} must have shape [{of.shape[0]}] to match {of_name} {tuple(of.shape)}, "
                         f"got {tuple(t.shape)}")


def _check_hyper_parameters(alpha, beta, base, epsilon, reduction):
    for name, value, ok, rule in (
        ("alpha", alpha, lambda v: v > 0, "> 0"),
        ("beta", beta, lambda v: v > 0, "> 0"),
        ("epsilon", epsilon, lambda v: v >= 0, ">= 0"),
        ("base", base, lambda v: True, "finite"),
    ):
        if not (math.isfinite(value) and ok(value)):
            raise ValueError(f"{name} must be finite and {rule}, got {value}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _check_inputs(embeddings, labels, ref_embeddings, ref_labels, ids, ref_ids):
    """Every tensor's type and shape, and one device for all. (On every eager step: error messages are
    only built on failure.)"""
    _check_embeddings("embeddings", embeddings)
    _check_keys("labels", labels, "embeddings", embeddings)
    if (ref_embeddings is None) != (ref_labels is None):
        raise ValueError("ref_embeddings and ref_labels must be given together")
    if ref_embeddings is not None:
        _check_embeddings("ref_embeddings", ref_embeddings)
        if ref_embeddings.shape[1] != embeddings.shape[1]:
            raise ValueError(
                f"ref_embeddings {tuple(ref_embeddings.shape)} and embeddings "
                f"{tuple(embeddings.shape)} must have the same D"
            )
        _check_keys("ref_labels", ref_labels, "ref_embeddings", ref_embeddings)
        if (ids is None) != (ref_ids is None):
            raise ValueError("with a reference set, ids and ref_ids must be given together")
    elif ref_ids is not None:
        raise ValueError("ref_ids needs ref_embeddings (in the self case ids serve both ends)")
    if ids is not None:
        _check_keys("ids", ids, "embeddings", embeddings)
    if ref_ids is not None:
        _check_keys("ref_ids", ref_ids, "ref_embeddings", ref_embeddings)
    named = (("embeddings", embeddings), ("labels", labels), ("ref_embeddings", ref_embeddings),
             ("ref_labels", ref_labels), ("ids", ids), ("ref_ids", ref_ids))
    device = embeddings.device
    if any(t is not None and t.device != device for _, t in named):
        raise ValueError("all tensors must be on one device, got " +
                         ", ".join(f"{name} on {t.device}" for name, t in named if t is not None))


# ---- the call path ----------------------------------------------------------------------------
def unit_rows(t):
    """Rows scaled to unit L2 norm, in t's own dtype. Under CUDA autocast F.normalize returns float32
    (its norm is an autocast float32 op), which would send 16-bit embeddings to the float32 kernels;
    here only the norm is float32 (float64 for float64), the rows keep their dtype."""
    return _UnitRows.apply(t)


def _row_norms(t):
    """max(|t_i|, 1e-12) per row, in float32 (float64 for float64). The squares of float32 and bfloat16
    rows are summed in float64: in float32 they overflow from |t_i| of about 1.8e19 on (F.normalize
    then makes the row 0); only a norm beyond float32's range itself is still lost."""
    return torch.linalg.vector_norm(t, dim=1, keepdim=True, dtype=squares_dtype(t.dtype)).to(ops._compute_dtype(t)
                                                                                             ).clamp_min(1e-12)


def squares_dtype(dtype):
    """What the squares of a row of `dtype` are summed in for its norm (_row_norms; the triton row kernels)."""
    return torch.float32 if dtype == torch.float16 else torch.float64


class _UnitRows(torch.autograd.Function):
    """y = t / max(|t|, 1e-12) row by row, with the analytic backward dt = (g - y (g . y)) / |t| (just
    g / 1e-12 where the norm was clamped): three passes over [B, D], where autograd's chain through
    the division and the norm makes six. The backward is built from t and y with differentiable ops,
    so second derivatives stay exact. 16-bit rows are divided by the float32 norm and rounded once:
    a float16 norm would be inf above 65504 (and the row 0)."""

    generate_vmap_rule = True

    @staticmethod
    @ops.fixed_signature
    def forward(t):
        y = t / _row_norms(t)
        return y if y.dtype == t.dtype else y.to(t.dtype)  # (torch 2.11's compiled backward was 0 after a no-op .to)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, g):
        t, y = ctx.saved_tensors
        norm = _row_norms(t)
        along = (g * y).sum(dim=1, keepdim=True, dtype=norm.dtype).masked_fill_(norm <= 1e-12, 0)
        return (torch.addcmul(g, y, along.to(g.dtype), value=-1) / norm).to(g.dtype)


def _normalizer(backend):
    """unit_rows, or for eager calls of the triton backend its own two kernels, one launch each way
    (traced calls keep torch's ops, which the compiler fuses itself). The eager triton loss
    normalises inside its one autograd node (triton_kernels.eager_loss)."""
    return _triton_kernels().unit_rows if backend == "triton" and not ops._traced() else unit_rows


def normalized_rows(t, backend="auto"):
    """The rows of `t` normalised as the loss normalises them with `backend` (CrossBatchMemory and the
    distributed loss normalise once, then call the loss with normalize=False)."""
    return _normalizer(_resolve_backend(backend, t.device, t.dtype))(t)


def _nan_if_nonfinite(loss, *inputs):
    """NaN or Inf anywhere in the embeddings makes the result NaN (never a finite number). Checked on
    each tensor's extremes, which NaN propagates to: one pass without a temporary of the tensor's
    size (torch.isfinite(t).all() took 10x longer, the max-norm 15x on CPU). Each extreme is added
    times 0 (alpha=0: 0, or NaN where it is not finite): three ops in the self case, none in the
    backward (each op is a GPU launch that costs host time)."""
    for t in inputs:
        if t is not None and t.numel() > 0:
            for extreme in torch.aminmax(t.detach()):
                loss = torch.add(loss, extreme, alpha=0)
    return loss


def _anchor_losses(backend, x, labels, ids, ref, ref_labels, ref_ids, options):
    """Per-anchor losses [B] from the chosen backend (x and ref already normalised)."""
    if backend == "reference":
        return reference.multi_similarity_loss(
            x, labels, ref, ref_labels, ids, ref_ids, reduction="none", **options
        )
    hyper_parameters = [options[name] for name in ops.HYPER_PARAMETERS]
    if backend != "triton":
        return ops.fused_forward(x, labels, ids, ref, ref_labels, ref_ids, *hyper_parameters)[0]
    return _triton_kernels().fused_forward(x, *_triton_keys(labels, ids, ref, ref_labels, ref_ids),
                                           *hyper_parameters)[0]


def _triton_keys(labels, ids, ref, ref_labels, ref_ids):
    """(labels, ids, ref, ref_labels, ref_ids) with the keys as the Triton kernels compare them, int32
    ranks: made once here, not in each op (the self case's labels by the forward's sort of them,
    which the backward reuses)."""
    kernels = _triton_kernels()
    if ref is not None:
        labels, ref_labels = kernels.int32_keys(labels, ref_labels)
    if ids is not None:
        ids, ranked = kernels.int32_keys(ids, ids if ref_ids is None else ref_ids)
        ref_ids = None if ref_ids is None else ranked
    return labels, ids, ref, ref_labels, ref_ids


def multi_similarity_loss(
    embeddings,
    labels,
    *,
    alpha=2.0,
    beta=50.0,
    base=0.5,
    epsilon=0.1,
    mining=True,
    normalize=True,
    reduction="mean",
    ref_embeddings=None,
    ref_labels=None,
    ids=None,
    ref_ids=None,
    skip_incomplete_anchors=False,
    backend="auto",
):
    """Multi-Similarity loss (Wang et al., CVPR 2019) of `embeddings` [B, D] with `labels` [B].

    Pairs are taken against `ref_embeddings`/`ref_labels` [R, D]/[R] when given (a memory bank,
    gathered batches), else against the batch itself without the diagonal. `ids`/`ref_ids` are
    sample identities: pairs of equal identity are skipped. `mining` applies the MS miner
    (epsilon); `normalize` L2-normalises rows first (cosine similarity). `reduction` is "mean"
    (over all B anchors), "sum" or "none" ([B]). `skip_incomplete_anchors=True` zeroes anchors
    whose mined positive or negative set is empty, as the authors' code does.
    The loss comes back in the embeddings' dtype, as torch's losses do (float32 under autocast, as
    theirs): every similarity, exponent and sum is float32 (float64 for float64 inputs) and only the
    result is cast (a float16 "sum" above 65504 is inf, its gradient still finite and exact).
    `backend`: "auto" (or $MS_LOSS_BACKEND), "reference", "cpu", "triton" or "cuda";
    on a GPU "triton" takes its chunked backward with 256 MiB of pair weights at a time;
    $MS_LOSS_TRITON_CHUNK_MB sets that budget (MiB; 0: the fused backward, no buffer; see the README).
    """
    return _loss(embeddings, labels, ref_embeddings, ref_labels, ids, ref_ids, None,
                 dict(alpha=alpha, beta=beta, base=base, epsilon=epsilon, mining=mining,
                      skip_incomplete_anchors=skip_incomplete_anchors),
                 normalize, reduction, backend)


def _loss(embeddings, labels, ref_embeddings, ref_labels, ids, ref_ids, masks, options,
          normalize, reduction, backend):
    _check_inputs(embeddings, labels, ref_embeddings, ref_labels, ids, ref_ids)
    options = dict(options, **{k: float(options[k]) for k in ("alpha", "beta", "base", "epsilon")})
    _check_hyper_parameters(options["alpha"], options["beta"], options["base"], options["epsilon"], reduction)
    backend = "reference" if masks is not None else _resolve_backend(backend, embeddings.device, embeddings.dtype)
    if backend == "triton" and not ops._traced():  # eager: the whole call one autograd node
        return _triton_kernels().eager_loss(
            embeddings, *_triton_keys(labels, ids, ref_embeddings, ref_labels, ref_ids),
            [options[name] for name in ops.HYPER_PARAMETERS], normalize, reduction, _loss_dtype(embeddings))
    x, ref = embeddings, ref_embeddings
    if normalize:
        normalized = _normalizer(backend)
        x = normalized(x)
        ref = None if ref is None else normalized(ref)
    if masks is not None:
        losses = reference.multi_similarity_loss(x, labels, ref, reduction="none", masks=masks, **options)
    else:
        losses = _anchor_losses(backend, x, labels, ids, ref, ref_labels, ref_ids, options)
    loss = reference.reduce_losses(losses, reduction)  # float32 (float64) sums, then the embeddings' dtype
    return _nan_if_nonfinite(loss, embeddings, ref_embeddings).to(_loss_dtype(embeddings))


def _loss_dtype(embeddings):
    """The embeddings' dtype, as torch's losses return; under autocast float32, as torch's losses run
    there (so a GradScaler's factor of 2^16 never meets a float16 loss)."""
    if embeddings.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(embeddings.device.type):
        return torch.float32
    return embeddings.dtype


class MultiSimilarityLoss(torch.nn.Module):
    """Drop-in for pytorch-metric-learning's MultiSimilarityLoss + MultiSimilarityMiner.

    `forward(embeddings, labels, indices_tuple=None, ref_emb=None, ref_labels=None)` has
    pytorch-metric-learning's signature. Without `indices_tuple` the loss mines itself
    (`mining=True`, epsilon) on the fused backend; with `indices_tuple` (a1, p, a2, n) or
    (anchor, positive, negative) from any miner, the loss is computed on exactly those pairs
    by the dense reference backend. Options are those of `multi_similarity_loss`.
    """

    def __init__(self, alpha=2.0, beta=50.0, base=0.5, epsilon=0.1, *, mining=True, normalize=True,
                 reduction="mean", skip_incomplete_anchors=False, backend="auto"):
        super().__init__()
        self.options = dict(alpha=alpha, beta=beta, base=base, epsilon=epsilon, mining=mining,
                            skip_incomplete_anchors=skip_incomplete_anchors)
        _check_hyper_parameters(float(alpha), float(beta), float(base), float(epsilon), reduction)
        _check_backend_name(backend)
        self.normalize, self.reduction, self.backend = normalize, reduction, backend

    def extra_repr(self):
        return ", ".join(f"{k}={v}" for k, v in self.options.items()) + f", backend={self.backend!r}"

    def forward(self, embeddings, labels, indices_tuple=None, ref_emb=None, ref_labels=None):
        masks = None
        if indices_tuple is not None:
            masks = _pair_masks_from_indices(indices_tuple, embeddings, ref_emb)
        return _loss(embeddings, labels, ref_emb, ref_labels, None, None, masks, self.options,
                     self.normalize, self.reduction, self.backend)


def _pair_masks_from_indices(indices_tuple, embeddings, ref_emb):
    """Boolean [B, R] (positive, negative) masks from (a1, p, a2, n) or (anchor, positive, negative)."""
    if len(indices_tuple) == 3:
        anchors, positives, negatives = indices_tuple
        indices_tuple = (anchors, positives, anchors, negatives)
    if len(indices_tuple) != 4:
        raise ValueError(f"indices_tuple must hold 3 or 4 index tensors, got {len(indices_tuple)}")
    rows = embeddings.shape[0]
    cols = rows if ref_emb is None else ref_emb.shape[0]
    masks = []
    for anchors, others in (indices_tuple[:2], indices_tuple[2:]):
        mask = torch.zeros(rows, cols, dtype=torch.bool, device=embeddings.device)
        mask[anchors.long(), others.long()] = True
        masks.append(mask)
    return tuple(masks)
