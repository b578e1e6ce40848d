"""The public API: `multi_similarity_loss`, the `MultiSimilarityLoss` module, and the rows' normalisation.

Every call is checked here (common.check_inputs, check_hyper_parameters), given to the backend that
`backend=` names or "auto" picks (backends.py), and computed by that backend's `loss`. With an
`indices_tuple` of another miner's pairs the loss is computed on exactly those pairs by the dense
reference (the fused kernels mine for themselves).
"""
import torch

from . import backends
from .common import (check_embeddings, check_hyper_parameters, check_inputs, check_reduction, is_boolean, is_integer,
                     shown, unit_rows)

__all__ = ["BACKENDS", "MultiSimilarityLoss", "available_backends", "multi_similarity_loss", "normalized_rows",
           "unit_rows"]
_COMPLEX = ("complex", "torch.complex")  # (the names of numpy's and torch's complex dtypes begin so)
BACKENDS = backends.NAMES  # what backend= takes


def available_backends(device="cpu"):
    """The backends this install can run on tensors of `device` (default CPU)."""
    return backends.available(device)


def normalized_rows(t, backend="auto"):
    """The rows of `t` normalised as the loss normalises them with `backend` (what CrossBatchMemory stores
    and compares with its memory under `normalize`, calling the loss with normalize=False)."""
    return backends.resolve(backend, t.device, t.dtype).unit_rows(t)


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
    $MS_LOSS_TRITON_CHUNK_MB sets that budget (MiB; 0: the fused backward, no buffer; docs/triton.md).
    """
    return _loss(embeddings, labels, ref_embeddings, ref_labels, ids, ref_ids, None,
                 dict(alpha=alpha, beta=beta, base=base, epsilon=epsilon, mining=mining,
                      skip_incomplete_anchors=skip_incomplete_anchors),
                 normalize, reduction, backend)


def _loss(embeddings, labels, ref_embeddings, ref_labels, ids, ref_ids, masks, options,
          normalize, reduction, backend):
    check_inputs(embeddings, labels, ref_embeddings, ref_labels, ids, ref_ids)
    options = checked_options(options, reduction)
    normalize = checked_flag("normalize", normalize)
    # (both ends compute in their common dtype: a float64 reference set makes a float64 call)
    dtype = embeddings.dtype if ref_embeddings is None else torch.promote_types(embeddings.dtype, ref_embeddings.dtype)
    chosen = backends.resolve(backend, embeddings.device, dtype) if masks is None else backends.GivenPairs(masks)
    return chosen.loss(embeddings, labels, ids, ref_embeddings, ref_labels, ref_ids, options, normalize, reduction)


def checked_options(options, reduction):
    """The hyper-parameters (a dict of every name of common.HYPER_PARAMETERS) as a backend takes them,
    the four numbers as floats, after checking them and `reduction`."""
    options = dict(options)
    for name in ("alpha", "beta", "base", "epsilon"):
        options[name] = checked_number(name, options[name])
    for name in ("mining", "skip_incomplete_anchors"):
        options[name] = checked_flag(name, options[name])
    check_hyper_parameters(options["alpha"], options["beta"], options["base"], options["epsilon"], reduction)
    return options


def checked_number(name, value):
    """`value` as a float: a real number, or a 0-d tensor that takes no gradient (the loss gives the
    hyper-parameters none, so a learnable one would silently stay as it is). A complex one is refused
    (numpy's would convert to its real part with a warning)."""
    if type(value) is float:  # (every call's case: the defaults, and options checked before)
        return value
    if isinstance(value, torch.Tensor) and value.requires_grad:
        raise TypeError(f"{name} must be a number or a tensor that does not require grad: the loss takes no "
                        f"gradient with respect to its hyper-parameters")
    try:
        if not isinstance(value, (str, bytes, bytearray)) and not is_boolean(value) and \
                not str(getattr(value, "dtype", "")).startswith(_COMPLEX):
            return float(value)
    except OverflowError:  # (an integer past float's range)
        raise ValueError(f"{name} must be finite in float32, got {shown(value)}") from None
    except (TypeError, ValueError, RuntimeError):  # (None, a tensor of several values)
        pass
    raise TypeError(f"{name} must be a real number, got {value!r}")


def checked_flag(name, value):
    """`value` as a bool: True, False, or what equals 1 or 0 (numpy's bools, 0-d tensors, 0 and 1)."""
    try:
        if value is True or value is False or value == 1 or value == 0:
            return bool(value)
    except (TypeError, ValueError, RuntimeError):  # (a tensor of several values)
        pass
    raise TypeError(f"{name} must be True or False, got {value!r}")


class _HyperParameter:
    """A hyper-parameter as an attribute of a module that keeps them checked in its `options` dict
    (pytorch-metric-learning's loss has `alpha`, `beta` and `base`): read from `options`; set, it is
    checked as the constructor checks it (against the module's `reduction`), so that a new value takes
    effect at the next call or is refused at once."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, module, owner=None):
        return self if module is None else module.options[self.name]

    def __set__(self, module, value):
        module.options = checked_options(dict(module.options, **{self.name: value}), module.reduction)


class _Setting:
    """An option of the call that is not a hyper-parameter (normalize, reduction, backend), as a plain
    attribute checked when set: `check` returns the value kept or raises. The value is the module's
    attribute "_" + name, which torch.compile reads as any other (torch 2.8's Dynamo recurses into a
    descriptor that reads the instance's dict under the descriptor's own name); a module pickled with
    the value in its dict under the option's own name is read from there."""

    def __init__(self, check):
        self.check = check

    def __set_name__(self, owner, name):
        self.name, self.key = name, "_" + name

    def __get__(self, module, owner=None):
        if module is None:
            return self
        try:
            return getattr(module, self.key)
        except AttributeError:
            if self.name in vars(module):
                return vars(module)[self.name]
            raise

    def __set__(self, module, value):
        setattr(module, self.key, self.check(value))


def _checked_reduction(value):
    check_reduction(value)
    return value


def _checked_backend(value):
    backends.check_name(value)
    return value


class HyperParameters:
    """Every option of the loss as an attribute checked when set: the hyper-parameters as
    `_HyperParameter`s, kept in `options`, and normalize, reduction and backend. The base of
    MultiSimilarityLoss and CrossBatchMemory."""
    alpha, beta, base, epsilon = _HyperParameter(), _HyperParameter(), _HyperParameter(), _HyperParameter()
    mining, skip_incomplete_anchors = _HyperParameter(), _HyperParameter()
    normalize = _Setting(lambda value: checked_flag("normalize", value))
    reduction, backend = _Setting(_checked_reduction), _Setting(_checked_backend)


class MultiSimilarityLoss(HyperParameters, torch.nn.Module):
    """Drop-in for pytorch-metric-learning's MultiSimilarityLoss + MultiSimilarityMiner.

    `forward(embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None)` has
    pytorch-metric-learning's signature. Without `indices_tuple` the loss mines itself
    (`mining=True`, epsilon) on the fused backend; with `indices_tuple` (a1, p, a2, n) or
    (anchor, positive, negative) from any miner, the loss is computed on exactly those pairs
    by the dense reference backend, and the labels may be left out. As in pytorch-metric-learning,
    `ref_labels` that is `labels` itself (the very tensor) makes `ref_emb` the batch: each row's pair
    with itself is skipped. Options are those of `multi_similarity_loss`, and attributes of the
    module: one set after construction (`loss.base = 0.6`) is checked then and used from the next call.
    """

    def __init__(self, alpha=2.0, beta=50.0, base=0.5, epsilon=0.1, *, mining=True, normalize=True,
                 reduction="mean", skip_incomplete_anchors=False, backend="auto"):
        super().__init__()
        # (kept as checked: floats and bools, so that no call converts a tensor again)
        self.options = checked_options(dict(alpha=alpha, beta=beta, base=base, epsilon=epsilon, mining=mining,
                                            skip_incomplete_anchors=skip_incomplete_anchors), reduction)
        self.normalize, self.reduction, self.backend = normalize, reduction, backend

    def extra_repr(self):
        return (", ".join(f"{k}={v}" for k, v in self.options.items())
                + f", normalize={self.normalize}, reduction={self.reduction!r}, backend={self.backend!r}")

    def forward(self, embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None):
        masks = ids = None
        if indices_tuple is not None:
            check_embeddings("embeddings", embeddings)  # (before the masks are built from their sizes)
            if ref_emb is not None:
                check_embeddings("ref_emb", ref_emb)
            masks = _pair_masks_from_indices(indices_tuple, embeddings, ref_emb)
            # (the pairs replace the labels, which pytorch-metric-learning lets the caller leave out)
            given = labels if labels is not None else ref_labels
            labels = _unused_labels(embeddings, given) if labels is None else labels
            ref_labels = _unused_labels(ref_emb, given) if ref_labels is None and ref_emb is not None else ref_labels
        elif labels is None:
            raise ValueError("MultiSimilarityLoss needs labels, unless an indices_tuple gives the pairs")
        elif (ref_emb is None) != (ref_labels is None):
            raise ValueError("ref_emb and ref_labels must be given together (unless an indices_tuple gives the pairs)")
        elif ref_labels is labels and ref_emb is not None:
            # pytorch-metric-learning's rule: the labels' very tensor at both ends makes the reference set
            # the batch itself, so each row's pair with itself is skipped: the self case where ref_emb is
            # the embeddings themselves (its fused path), else by identity, the row's index
            if ref_emb is embeddings:
                ref_emb = ref_labels = None
            else:
                check_embeddings("embeddings", embeddings)  # (before its rows are counted)
                ids = torch.arange(embeddings.shape[0], device=embeddings.device)
        return _loss(embeddings, labels, ref_emb, ref_labels, ids, ids, masks, self.options,
                     self.normalize, self.reduction, self.backend)


def _unused_labels(embeddings, given):
    """Labels for the checks where an indices_tuple gives the pairs (one class: the masks replace them), of
    the dtype of the labels `given` at the other end, if any, so that the two ends' dtypes agree."""
    dtype = given.dtype if isinstance(given, torch.Tensor) and is_integer(given) else torch.int64
    return torch.zeros(embeddings.shape[0], dtype=dtype, device=embeddings.device)


def _pair_masks_from_indices(indices_tuple, embeddings, ref_emb):
    """Boolean [B, R] (positive, negative) masks from (a1, p, a2, n) or (anchor, positive, negative)."""
    if not isinstance(indices_tuple, (tuple, list)):
        raise TypeError(f"indices_tuple must be a tuple of 3 or 4 index tensors, got {type(indices_tuple).__name__}")
    if len(indices_tuple) == 3:
        anchors, positives, negatives = indices_tuple
        indices_tuple, names = (anchors, positives, anchors, negatives), ("anchor", "positive", "anchor", "negative")
    elif len(indices_tuple) == 4:
        names = ("a1", "p", "a2", "n")
    else:
        raise ValueError(f"indices_tuple must hold 3 or 4 index tensors, got {len(indices_tuple)}")
    rows = embeddings.shape[0]
    cols = rows if ref_emb is None else ref_emb.shape[0]
    _check_indices(indices_tuple, names, (rows, cols, rows, cols))
    masks = []
    for (anchors, others), (a_name, o_name) in ((indices_tuple[:2], names[:2]), (indices_tuple[2:], names[2:])):
        if anchors.shape != others.shape:
            raise ValueError(f"indices_tuple's {a_name} and {o_name} must be as long as each other (one pair "
                             f"each), got {anchors.shape[0]} and {others.shape[0]}")
        mask = torch.zeros(rows, cols, dtype=torch.bool, device=embeddings.device)
        mask[anchors.long(), others.long()] = True
        masks.append(mask)
    return tuple(masks)


def _check_indices(tensors, names, sizes):
    """indices_tuple's tensors: each 1-D, integer, its values rows in [0, size). The range takes one
    read back to the host for all of them, and none while torch.compile or a CUDA graph records."""
    for t, name in zip(tensors, names):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or not is_integer(t):
            raise TypeError(f"indices_tuple's {name} must be a 1-D integer tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}")
    recording = torch.compiler.is_compiling() or (tensors[0].is_cuda and torch.cuda.is_current_stream_capturing())
    present = [i for i, t in enumerate(tensors) if t.numel()]
    if recording or not present:
        return
    extremes = torch.stack([torch.stack(torch.aminmax(tensors[i].long())) for i in present]).tolist()
    for i, (low, high) in zip(present, extremes):
        if low < 0 or high >= sizes[i]:
            raise ValueError(f"indices_tuple's {names[i]} must hold row indices in [0, {sizes[i]}), got values "
                             f"from {low} to {high}")
