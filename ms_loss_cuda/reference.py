"""The Multi-Similarity loss in plain PyTorch: the exact function in code (the spec every
backend is tested against), and the fallback.

Dense: it builds the B x R similarity matrix and its masks, so memory grows as B * R. Gradients come
from autograd through ordinary torch ops; the mining masks are constants, as in the paper's code
and in pytorch-metric-learning. Inputs are used as given (the public API normalises beforehand).
"""
import contextlib

import torch

from .common import reduce_losses

__all__ = ["mined_fraction", "multi_similarity_loss", "pair_masks"]


def pair_masks(labels, ref_labels, ids=None, ref_ids=None):
    """Boolean [B, R] masks (positive, negative) before mining.

    A pair of equal identity is neither. Without identities the self case (ref_labels is None)
    skips the diagonal and a reference set skips nothing.
    """
    self_case = ref_labels is None
    ref_labels = labels if self_case else ref_labels
    same = _equal(labels, ref_labels)
    if ids is not None:
        skipped = _equal(ids, ids if ref_ids is None else ref_ids)
    elif self_case:
        skipped = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    else:
        skipped = torch.zeros_like(same)
    return same & ~skipped, ~same & ~skipped


def _equal(a, b):
    """[len(a), len(b)]: a_i == b_j by value, whatever the two integer dtypes (torch compares uint16 and
    uint32 only with their own dtype; check_inputs lets uint64 meet only uint64, so int64 holds every
    value compared across dtypes)."""
    if a.dtype != b.dtype:
        a, b = a.long(), b.long()
    return a[:, None] == b[None, :]


def _masked_extreme(s, mask, largest):
    fill = float("-inf") if largest else float("inf")
    padded = torch.cat([torch.where(mask, s, fill), s.new_full((s.shape[0], 1), fill)], dim=1)
    return padded.amax(dim=1) if largest else padded.amin(dim=1)


def _log1p_sum_exp(exponents, mask):
    """log(1 + sum over the mask of exp(exponents)) per row, stable, 0 for an empty row."""
    kept = torch.where(mask, exponents, float("-inf"))
    return torch.logsumexp(torch.cat([kept, kept.new_zeros(kept.shape[0], 1)], dim=1), dim=1)


# (a constant of the device type to torch.compile: the tracing of torch 2.8 cannot call it)
@torch.compiler.assume_constant_result
def _has_autocast(device_type):
    return torch.amp.is_autocast_available(device_type)


def multi_similarity_loss(
    x,
    labels,
    ref_x=None,
    ref_labels=None,
    ids=None,
    ref_ids=None,
    *,
    alpha=2.0,
    beta=50.0,
    base=0.5,
    epsilon=0.1,
    mining=True,
    reduction="mean",
    skip_incomplete_anchors=False,
    masks=None,
):
    """MS loss of x [B, D] against ref_x [R, D] (x itself when None), computed densely.

    masks: optional (positive, negative) boolean [B, R] masks that replace labels, identities and
    mining (the pairs of a pytorch-metric-learning miner's indices_tuple).
    Computes in float32 (float64 for float64 inputs); returns a scalar, or [B] for "none".
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = x.to(compute)
    rs = xs if ref_x is None else ref_x.to(compute)
    # (autocast would make the product 16-bit; meta tensors, for shapes alone, have no autocast)
    no_autocast = torch.autocast(x.device.type, enabled=False) if _has_autocast(x.device.type) \
        else contextlib.nullcontext()
    with no_autocast:
        s = xs @ rs.T
    if masks is None:
        pos, neg = pair_masks(labels, ref_labels, ids, ref_ids)
        if mining:
            sd = s.detach()
            minpos = _masked_extreme(sd, pos, largest=False)
            maxneg = _masked_extreme(sd, neg, largest=True)
            pos = pos & (sd - epsilon < maxneg[:, None])
            neg = neg & (sd + epsilon > minpos[:, None])
    else:
        pos, neg = masks
    losses = (
        _log1p_sum_exp(-alpha * (s - base), pos) / alpha
        + _log1p_sum_exp(beta * (s - base), neg) / beta
    )
    if skip_incomplete_anchors:
        losses = torch.where(pos.any(dim=1) & neg.any(dim=1), losses, 0.0)
    return reduce_losses(losses, reduction)


@torch.no_grad()
def mined_fraction(x, labels, ref_x=None, ref_labels=None, ids=None, ref_ids=None, *, epsilon=0.1, anchors=256):
    """The share of pairs the MS miner keeps: kept pairs over all pairs of distinct identity, counted
    densely for the first `anchors` rows (x and ref_x are normalised here). How hard a batch is."""
    n = min(anchors, x.shape[0])
    a = torch.nn.functional.normalize(x[:n].float(), dim=1)
    b = torch.nn.functional.normalize((x if ref_x is None else ref_x).float(), dim=1)
    s = a @ b.T
    if ref_x is None:  # the self case: identities default to positions, so the diagonal is skipped
        ids = torch.arange(x.shape[0], device=x.device) if ids is None else ids
        ref_labels, ref_ids = labels, ids
    pos, neg = pair_masks(labels[:n], ref_labels, None if ids is None else ids[:n], ref_ids)
    minpos = _masked_extreme(s, pos, largest=False)[:, None]
    maxneg = _masked_extreme(s, neg, largest=True)[:, None]
    kept = (pos & (s - epsilon < maxneg)) | (neg & (s + epsilon > minpos))
    return kept.sum().item() / max((pos | neg).sum().item(), 1)
