"""What the launch plans feed the kernels: aligned rows, int32 keys, the label order, the positive ranges.

- Rows are cast to one dtype and zero-padded to a multiple of 16 elements (aligned vector loads;
  zero columns change no similarity). Labels and identities become int32 ranks (`int32_keys`).
- The anchors are taken in label order, in blocks of BLOCK_M, so that the positives of a block lie
  in one short list of columns, its positive range. In the self case the columns are the anchors
  themselves: one sort of the labels gives the order and each block's range (`label_order`, whose
  kernel is row_kernels.label_order_kernel), and the forward keeps the order in two more rows of its
  statistics for the backward (`saved_label_order`). A reference set keeps its own order; its
  columns are sorted by label and each block's list is built of segments (`positive_ranges`).
- `column_splits` splits the columns over more programs where the row blocks alone would leave the
  GPU half empty (a memory bank of few anchors).
Everything is built on the device with no host synchronisation, so a step can be captured in a CUDA graph.
"""
from typing import NamedTuple, Optional

import torch

from ..common import GPU_DTYPES
from .launcher import Launch, cdiv, pow2_at_least_16
from .row_kernels import label_order_kernel

FLOAT32_TINY = 2.0 ** -126  # float32's smallest normal number


def _aligned_rows(t, dtype):
    """`t` in `dtype`, contiguous, rows zero-padded to a multiple of 16 elements (32-byte aligned
    rows load as vectors; zero columns change no similarity)."""
    pad = -t.shape[1] % 16
    t = t.to(dtype)
    return torch.nn.functional.pad(t, (0, pad)) if pad else t.contiguous()


def int32_keys(a, b):
    """Keys of both ends as int32 tensors that are equal exactly where a's and b's values are: each
    value's rank among all of them (a sort, no device sync). int32 halves the integer work per pair.
    The backend ranks them once before the ops (backend.py), so neither op sorts again (the self
    case's labels excepted: the forward's one sort ranks them, `label_order`)."""
    if a.dtype == torch.int32 and b.dtype == torch.int32:
        return a.contiguous(), b.contiguous()
    both = a.to(torch.int64).contiguous() if a is b else torch.cat([a.to(torch.int64), b.to(torch.int64)])
    ranks = torch.searchsorted(torch.sort(both).values, both).to(torch.int32)
    return (ranks, ranks) if a is b else (ranks[:a.shape[0]], ranks[a.shape[0]:])


def ranked_keys(labels, ids, ref, ref_labels, ref_ids):
    """(labels, ids, ref, ref_labels, ref_ids) with the keys as the kernels compare them (`int32_keys`),
    ranked once before both ops (the self case's labels excepted: the forward's one sort ranks them,
    `label_order`)."""
    if ref is not None:
        labels, ref_labels = int32_keys(labels, ref_labels)
    if ids is not None:
        ids, ranked = int32_keys(ids, ids if ref_ids is None else ref_ids)
        ref_ids = None if ref_ids is None else ranked
    return labels, ids, ref, ref_labels, ref_ids


def plan_operands(x, labels, ids, ref, ref_labels, ref_ids, default_ids=True):
    """Aligned rows of one dtype, int32 identities and, for a reference set, int32 keys of both ends
    (`int32_keys`; the self case's labels as given: its label order ranks them, `label_order`).
    Default identities (default_ids; else None) never collide across ends (self case: the row index,
    so the diagonal is skipped). The inputs are checked before: by the loss, or by the ops (op.py)."""
    batch = x.shape[0]
    rows = batch + (0 if ref is None else ref.shape[0])
    # The kernels index rows in int32, and so the keys' ranks and the default identities: below 2^29 rows,
    # a per-anchor statistic's offset (up to 4 B) and a column split's end (up to about 2 R) stay in range.
    if rows >= 2 ** 29:
        raise ValueError(f"the triton backend indexes rows in int32: the batch and the reference set hold {rows} "
                         f"rows together, at most 2^29 - 1 (use backend='cuda' or 'reference', or a smaller "
                         f"memory bank)")
    dtype = x.dtype if ref is None else torch.promote_types(x.dtype, ref.dtype)
    x = _aligned_rows(x, dtype)
    ref = None if ref is None else _aligned_rows(ref, dtype)
    if ids is None and default_ids:
        ids = torch.arange(batch, device=x.device, dtype=torch.int32)
    if ref is None:
        ids = None if ids is None else int32_keys(ids, ids)[0]
        return x, x, labels, ids, labels, ids
    if ref_ids is None:
        ref_ids = torch.arange(batch, batch + ref.shape[0], device=x.device, dtype=torch.int32)
    labels, ref_labels = int32_keys(labels, ref_labels)
    ids, ref_ids = int32_keys(ids, ref_ids)
    return x, ref, labels, ids, ref_labels, ref_ids


def check_dtypes(x, ref):
    """The plans take float32, float16 and bfloat16 rows."""
    for name, t in (("embeddings", x), ("ref_embeddings", ref)):
        if t is not None and t.dtype not in GPU_DTYPES:
            raise TypeError(f"the triton backend takes float32, float16 or bfloat16 rows, got {name} of {t.dtype} "
                            "(use backend='cpu' or 'reference' for float64)")


def check_ref_norms(x, ref, ref_norms):
    """`ref_norms` (row_kernels.row_norms_plan's: the norms of a reference set's rows and their
    reciprocals, [2, R] float32 of contiguous rows; the kernels then take the rows as they are and
    compare them as unit rows) comes with float16 rows at both ends: a float16 row's norm and its
    similarity with a unit row stay far inside float32's range, where a bfloat16 or float32 row's may
    pass it."""
    if ref_norms is None:
        return
    if ref is None or x.dtype != torch.float16 or ref.dtype != torch.float16:
        raise ValueError("ref_norms takes float16 rows of x and of a reference set")
    if ref_norms.dtype != torch.float32 or ref_norms.shape != (2, ref.shape[0]) or ref_norms.stride(1) != 1:
        raise ValueError(f"ref_norms must be float32 [2, {ref.shape[0]}] of contiguous rows, got {ref_norms.dtype} "
                         f"{tuple(ref_norms.shape)}")


def check_beta(beta):
    """The negatives' sums and label-free weights rely on beta > 0 in float32 (S = -inf marks a pair
    that does not count); the public API refuses beta <= 0 before, a direct call of the ops here."""
    if not beta >= FLOAT32_TINY:
        raise ValueError(f"beta must be > 0 (at least float32's smallest normal number, 1.2e-38), got {beta}")


def column_splits(row_programs, num_cols, block_n, multiprocessors):
    """(splits, columns per split): the columns are split over enough programs that a launch has at
    least two per multiprocessor (a memory bank of B = 1024 has only 8 row blocks), each split a
    whole number of BLOCK_N tiles and none empty. The splits' partial results are combined in a
    fixed order afterwards (no atomic additions: the same bits on every run)."""
    col_tiles = max(cdiv(num_cols, block_n), 1)
    wanted = min(cdiv(2 * multiprocessors, max(row_programs, 1)), col_tiles)
    tiles_per_split = max(col_tiles // wanted, 1)
    return cdiv(col_tiles, tiles_per_split), tiles_per_split * block_n


def positive_ranges(row_keys, col_keys, block_m):
    """Where each row block's positives in a reference set are, built on the device without a host
    sync (so a step can be captured in a CUDA graph): (row order, column order, segment ends, column
    shifts, ranges). The anchors are taken in label order (row order) and the columns too (column
    order), so block k (anchors row_order[k*block_m:(k+1)*block_m]) holds a run of sorted labels, and
    its positive list is slots ranges[k, 0] .. ranges[k, 1] of one numbering that names exactly the
    columns of those labels. (The self case's columns are the anchors: every label of the run has
    all its columns inside one slice of the label order, `label_order`.) A label between two of the
    block's may have columns but no anchor here, so the list is built of segments: the first anchor
    of each label in the block owns the slice of the column order that holds that label's columns;
    slot q of anchor a's segment (segment_end[a - 1] <= q < segment_end[a]) is column
    column_order[q + column_shift[a]] (a memory bank of random classes costs no more than the self
    case)."""
    row_sorted, row_order = torch.sort(row_keys, stable=True)
    row_order = row_order.to(torch.int32)
    col_sorted, col_order = torch.sort(col_keys, stable=True)
    lo = torch.searchsorted(col_sorted, row_sorted)
    hi = torch.searchsorted(col_sorted, row_sorted, right=True)
    # the first anchor of each label in its block (no host value enters a device tensor: capturable)
    first = torch.arange(row_keys.shape[0], device=row_keys.device) % block_m == 0
    first[1:].logical_or_(row_sorted[1:] != row_sorted[:-1])
    lengths = (hi - lo) * first
    segment_end = torch.cumsum(lengths, 0)
    segment_start = segment_end - lengths
    ranges = torch.stack([segment_start[::block_m], _block_lasts(segment_end, block_m)], 1)
    return row_order, col_order.to(torch.int32), segment_end, lo - segment_start, ranges


def _block_lasts(t, block_m):
    """The last entry of each block of block_m entries of `t` (t[::block_m] are the firsts): a view,
    and one copy when the last block is partial (no gather: fewer launches a step)."""
    lasts = t[block_m - 1::block_m]
    return torch.cat([lasts, t[-1:]]) if t.shape[0] % block_m else lasts


def sortable(keys):
    """Contiguous keys of a dtype that torch sorts and compares on every device: uint16-64 as int64,
    where their values stay distinct."""
    if keys.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        keys = keys.to(torch.int64)
    return keys.contiguous()


class LabelOrder(NamedTuple):
    """The self case in label order (`label_order`), filled by `launch`."""
    ranks: torch.Tensor  # int32 [B]: each key's rank, in the caller's order (equal exactly where the keys are)
    order: torch.Tensor  # int32 [B]: the stable order that sorts the keys (saved[0])
    ranges: torch.Tensor  # int32 [blocks, 2]
    rows: Optional[torch.Tensor]  # the rows in that order (with `rows`), else None
    ids: Optional[torch.Tensor]  # the identities in that order (with `ids`), else None
    launch: Launch


# torch sorts a row of up to ONE_KERNEL_SORT keys in one kernel on CUDA, where a longer one takes a radix
# pass and a memset for each byte of the keys; up to MOST_SORT_ROWS rows of them
# are merged by binary search in label_order_kernel (each key searches every row)
ONE_KERNEL_SORT, MOST_SORT_ROWS = 4096, 16


def label_order(keys, block_m, saved, rows=None, ids=None):
    """The self case in label order, from one stable sort of its keys (`LabelOrder`). Block k of block_m
    rows in that order has the columns of its labels, its positives among them, in slots ranges[k, 0]
    .. ranges[k, 1] of the same order, and every other column is a negative of all of its rows.
    `saved` (int32 [2, B], contiguous) receives the order and the sorted ranks: the forward's stats
    keep them for the backward (`saved_label_order`), which then sorts nothing. `rows` (contiguous
    [B, D]) and `ids` ([B]): copies of them in that order too. Up to MOST_SORT_ROWS * ONE_KERNEL_SORT
    keys are sorted as rows of at most ONE_KERNEL_SORT (torch's one-kernel sort), which
    `label_order_kernel` merges; all but the sort is its launch."""
    keys = sortable(keys)
    num = keys.shape[0]
    segments = cdiv(num, ONE_KERNEL_SORT)
    segments = segments if 1 < segments <= MOST_SORT_ROWS else 1
    segment = cdiv(num, segments)
    if segments * segment > num:  # (padding of the largest value: after every key in the stable sort)
        keys = torch.cat([keys, keys.new_full((segments * segment - num,), torch.iinfo(keys.dtype).max)])
    sorted_keys, order = torch.sort(keys.view(segments, segment), stable=True)
    ranks = torch.empty(num, dtype=torch.int32, device=keys.device)
    ranges = torch.empty((cdiv(num, block_m), 2), dtype=torch.int32, device=keys.device)
    ordered, ordered_ids = (None if t is None else torch.empty_like(t) for t in (rows, ids))
    block_d = 16 if rows is None else min(pow2_at_least_16(rows.shape[1]), 512)
    launch = Launch(label_order_kernel, (cdiv(num, 2048 // block_d),),
                    dict(sorted_ptr=sorted_keys, order_ptr=order, saved_ptr=saved, ranks_ptr=ranks, range_ptr=ranges,
                         rows_ptr=order if rows is None else rows, ordered_ptr=order if rows is None else ordered,
                         ids_ptr=order if ids is None else ids, ordered_ids_ptr=order if ids is None else ordered_ids,
                         num=num, segment=segment, segments=segments, steps=segment.bit_length(), block_m=block_m,
                         dim=0 if rows is None else rows.shape[1]),  # (pointers never read: any will do)
                    dict(ROWS=rows is not None, IDS=ids is not None, BLOCK_P=2048 // block_d, BLOCK_D=block_d), 4, 1)
    return LabelOrder(ranks, saved[0], ranges, ordered, ordered_ids, launch)


def block_ranges(first, block_m):
    """[blocks, 2] int32: where the keys of each block of block_m rows begin and end in the sorted order,
    from `first`, each sorted key's first position among them (the sorted ranks of `label_order`)."""
    ends = torch.searchsorted(first, first, right=True, out_int32=True)  # (one past each key's last position)
    return torch.stack([first[::block_m], _block_lasts(ends, block_m)], 1)


SAVED_ROWS = 2  # the self case's stats rows after the four statistics: its label order (`label_order`)


def saved_label_order(stats, batch):
    """(order, sorted ranks), int32 views of the self case's stats rows that `label_order` wrote. They
    hold integers as float32 bits: stats must reach the backward as the forward made them (no cast)."""
    if stats.shape != (4 + SAVED_ROWS, batch) or stats.dtype != torch.float32:
        raise ValueError(f"stats must be the triton forward's float32 [{4 + SAVED_ROWS}, {batch}] in the self "
                         f"case, got {stats.dtype} {tuple(stats.shape)}")
    return stats[4:].view(torch.int32).unbind(0)


def shared_identities(ids, labels):
    """int32 [1]: nonzero where one identity is shared by rows of different labels, a pair the self
    case's negatives kernel must then skip by comparing identities (CHECK_IDS); found on the device
    (no host sync): within each run of equal identities, sorted, two neighbours of different labels."""
    ids_sorted, order = torch.sort(ids, stable=True)
    labels_sorted = labels[order]
    clash = (ids_sorted[1:] == ids_sorted[:-1]) & (labels_sorted[1:] != labels_sorted[:-1])
    return clash.any().to(torch.int32).reshape(1)

