"""The MS loss of the global batch under torch.distributed (gloo on CPU, NCCL on GPU; torchrun).

Each process gathers every process's embeddings (with gradient), takes its own anchors against the
gathered batch, and scales its part so that, inside DistributedDataParallel (which averages the
parameter gradients over the processes), the parameter gradients equal those of the single-process
loss on the concatenated batch. The value returned on every rank is that single-process loss.
"""
import torch
import torch.distributed as dist

from .common import FLOAT_DTYPES, check_inputs, loss_dtype
from .loss import multi_similarity_loss as _multi_similarity_loss, normalized_rows

__all__ = ["gather", "multi_similarity_loss"]


def _require_process_group():
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ms_loss_cuda.distributed needs an initialised process group: call "
                           "torch.distributed.init_process_group() (torchrun sets its environment), or use "
                           "ms_loss_cuda.multi_similarity_loss on one process")


class _AllGather(torch.autograd.Function):
    """[world, rows, ...] of every rank's tensor; the backward sums the gradients of all ranks (an
    all-reduce, which every backend has) and keeps this rank's part."""

    @staticmethod
    def forward(ctx, t):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[dist.get_rank()]


def _gather(t, sizes):
    """The concatenation of every rank's `t` (first dimensions `sizes`, padded for the collective)."""
    top = max(sizes)
    padded = torch.cat([t, t.new_zeros((top - t.shape[0], *t.shape[1:]))]) if t.shape[0] < top else t.contiguous()
    parts = _AllGather.apply(padded)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def gather(embeddings, labels, ids=None):
    """(embeddings, labels, ids of the global batch, this rank's ids): the embeddings keep their
    gradient, the keys are int64 (uint64 stays uint64); the default identity of a sample is its
    position in the global batch (rank order). Every rank must give rows of one D and one dtype."""
    _require_process_group()
    if embeddings.dim() != 2:
        raise ValueError(f"embeddings must be [B, D], got shape {tuple(embeddings.shape)}")
    shape = (*embeddings.shape, FLOAT_DTYPES.index(embeddings.dtype) if embeddings.dtype in FLOAT_DTYPES else -1)
    shape = torch.tensor(shape, device=embeddings.device)  # (NCCL: CUDA tensors only)
    shapes = [torch.zeros_like(shape) for _ in range(dist.get_world_size())]
    dist.all_gather(shapes, shape)
    if any(not torch.equal(s[1:], shapes[0][1:]) for s in shapes):  # (every rank finds it: none waits)
        raise ValueError("every process must give embeddings of one D and one dtype; they gave " + ", ".join(
            f"D = {int(s[1])} of {FLOAT_DTYPES[int(s[2])] if s[2] >= 0 else '?'}" for s in shapes))
    sizes = [int(s[0]) for s in shapes]
    if ids is None:
        offset = sum(sizes[:dist.get_rank()])
        ids = torch.arange(offset, offset + embeddings.shape[0], device=embeddings.device)
    return _gather(embeddings, sizes), _gather_keys(labels, sizes), _gather_keys(ids, sizes), ids


def _gather_keys(keys, sizes):
    """_gather of integer keys, as int64 (gloo has no int16 or unsigned type but uint8, and another
    rank's keys may not fit this rank's dtype); uint64 keys' bits reinterpreted, not converted."""
    if keys.dtype == torch.uint64:
        return _gather(keys.view(torch.int64), sizes).view(torch.uint64)
    return _gather(keys.long(), sizes)


def multi_similarity_loss(embeddings, labels, ids=None, *, memory=None, **loss_options):
    """The MS loss of the batch gathered from all processes; `loss_options` are those of
    `ms_loss_cuda.multi_similarity_loss` (reduction "mean" over the global batch, or "sum").

    Every rank gets the single-process value; its gradient is the world size times that of its own
    anchors' share, which DistributedDataParallel's averaging turns into the single-process gradient.
    Unequal per-process batch sizes work. Every rank calls it, and takes its backward (the gathered
    rows' gradient is summed across the ranks there). `memory`: a `CrossBatchMemory` (its loss options and weight
    apply; `ids` are then required); it stores the gathered batch, so every rank holds the same
    memory, and adds its term for this rank's anchors, reduced over the global batch like the rest.
    """
    _require_process_group()
    check_inputs(embeddings, labels, None, None, ids, None)  # (before the gather, which would fail on them less clearly)
    if memory is not None:
        if loss_options:
            raise ValueError(f"with a memory the loss options are the memory's own, got {sorted(loss_options)}")
        if ids is None:
            raise ValueError("with a memory, ids must be the samples' own (stable across steps), not batch positions")
        loss_options = dict(memory.loss_options, normalize=memory.normalize)
    loss_options = dict(loss_options)
    reduction = loss_options.pop("reduction", "mean")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' for the global batch, got {reduction!r}")
    if {"ref_embeddings", "ref_labels", "ref_ids"} & set(loss_options):
        raise ValueError("the reference set is the gathered batch; pass a CrossBatchMemory as `memory` for more")
    everyone, all_labels, all_ids, ids = gather(embeddings, labels, ids)
    total = everyone.shape[0]
    normalize = loss_options.pop("normalize", True)
    # Per-anchor losses summed in float32 (float64): a 16-bit sum over thousands of anchors would overflow.
    compute = torch.float64 if embeddings.dtype == torch.float64 else torch.float32
    # (the loss normalises the rows itself: a fused backend then knows them for unit rows)
    own = _multi_similarity_loss(embeddings, labels, ids=ids, ref_embeddings=everyone, ref_labels=all_labels,
                                 ref_ids=all_ids, normalize=normalize, **dict(loss_options, reduction="none"))
    own = own.to(compute).sum()
    if memory is not None:  # (the memory holds rows as the loss compares them: normalised where it normalises)
        backend = loss_options.get("backend", "auto")
        x, rows = (normalized_rows(t, backend) for t in (embeddings, everyone)) if normalize else (embeddings, everyone)
        term = memory.memory_term(x, labels, ids, rows, all_labels, all_ids, reduction="none")
        own = own if term is None else own + memory.weight * term.to(compute).sum()
    if reduction == "mean":
        own = own / max(total, 1)  # (an empty global batch: 0, as the single-process mean of no anchors)
    value = own.detach().clone()
    dist.all_reduce(value)
    world = dist.get_world_size()
    loss = own * world + (value - own * world).detach()  # the global value, the DDP-scaled gradient
    return loss.to(loss_dtype(embeddings))
