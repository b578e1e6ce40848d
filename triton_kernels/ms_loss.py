"""Triton kernels of the Multi-Similarity loss (the function of ms_loss_cuda/reference.py), fused: no
B x R buffer.

Each program takes one block of anchor rows and one split of the columns (`column_splits`: splits
only where the row blocks alone give fewer than two programs per multiprocessor). The forward takes
the anchors in label order, so a block's positives form one short list: the label-sorted columns of
its labels (`positive_ranges`, built on the device with no host sync; in the self case a sort, then
`_label_order_kernel`), and it makes a single pass over all columns:
- `_minpos_kernel`: S over the block's positive range -> each anchor's hardest positive (minpos);
- `_negatives_kernel`: S over all columns, once -> the hardest negative and, since the negatives'
  mining needs only minpos, the sum of exp over the mined negatives, rescaled online. Self case:
  it reads the anchors in label order and skips the block's positive range, so every column it
  sees is a negative of the whole block and its tiles carry no labels (SKIP_RANGE: 128 registers
  for 128 x 64 tiles under Triton 3.6, two programs per multiprocessor, where classifying each
  pair took 179);
- `_finish_kernel`: the splits combined in a fixed order, then S over the positive range again for
  the sum over the mined positives (their mining needs the final maxneg) and, in the self case,
  the range's own negatives (their hardest from _minpos_kernel) -> loss and stats [4, B] =
  (minpos, maxneg, LP, LN);
- `_grad_kernel`: program (I, d, split) recomputes S_IJ for the split's column blocks J and
  accumulates H_IJ @ b_J[:, d-block]. Self case: H_IJ = G_IJ + G_JI^T from the stats at both ends of
  each pair; reference case: dx with anchors on the rows, dref with the anchors on the columns.
  Split partials are summed afterwards in a fixed order: no atomic additions, the same bits on every run.
- The self case's backward runs in the forward's label order, which the forward's stats keep
  (`_label_order`, `saved_label_order`: the anchors, stats and grad_output permuted, no second sort),
  so a tile beside its row block's positive range holds negatives only and
  takes its weights with no labels and one FMA and exp2 per pair and end (LABEL_ORDER,
  `_negative_weights`); the gradient's rows go back to the caller's order as they are stored.
- the chunked backward (a GPU's default; $MS_LOSS_TRITON_CHUNK_MB, `chunk_budget`): `_weights_kernel` writes
  H (lifted, in the input dtype) for a chunk into a buffer within that budget reused by every chunk,
  and cuBLAS makes the second product (`Product`: float32 sums and result), so the 512-wide
  accumulator that holds _grad_kernel to one 8-warp program per multiprocessor goes to cuBLAS.
  Self case: H is symmetric, so where the chunks are tall enough (TRIANGLE_ROWS) a chunk of anchor
  rows takes the columns from its first row on, and its weights give dx of its rows and,
  transposed, the later rows' share: S for half of the pairs (1.62 GEMM-equivalents at B = 16384
  and 64 MiB where _grad_kernel takes 2); else chunks of whole rows. Memory bank: all anchors against
  a chunk of its rows (2, as the fused form). A reference set that takes a gradient gets a second
  copy of the chunk's weights (one lift for its rows) and dref from it: S once for dx and dref, 3
  GEMM-equivalents where the fused form takes 4. Self case: the weights kernel takes every pair as a
  negative, and a second, small launch per chunk (RANGE_TILES) rewrites the columns of each row
  block's positive range with classified weights: the branch would have cost both paths' registers.
`plan_cost` counts the work of a plan's launches in GEMM-equivalents. `eager_loss` (`_EagerLoss`): the
loss of an eager call as one autograd node, whose forward also issues the backward's launches where
a gradient will be taken ("mean", "sum"; its backward scales them by grad_output,
`_scaled_rows_kernel`), its normalisation one launch each way (`_unit_rows_kernel`, which also finds
non-finite rows, `_unit_rows_grad_kernel`, which takes the chunked backward's float32 rows in label
order as they are); `unit_rows`: that normalisation alone (CrossBatchMemory, the distributed loss).
`Launch` calls a compiled kernel's launcher directly where Triton's launch path would pick the same
one: the host's work before an eager step's first heavy kernel is the GPU's idle time.
The per-pair math lives in the `@triton.jit` helpers below, the Triton twin of csrc/ms_math.h.
Similarities, exponents and sums are float32; 16-bit tiles go through `tl.dot` (tensor cores)
with float32 accumulation; float32 tiles use IEEE float32 products, or TF32 tensor cores when
torch.get_float32_matmul_precision() allows them (`float32_precision`).

Verified on GPUs (torch 2.11, triton 3.6), 2026-11-26, on an H100: this build (fdf7284: the sort as
rows merged by `_label_order_kernel`) with tests/test_gpu_backends.py on CUDA tensors, and its
merged label order against one global sort at B = 16384, 65536 and 16383 (the same bits); the
build before (f196f71: `_label_order_kernel` after one sort, direct launches,
`_unlifted_rows_kernel`, `_scaled_rows_kernel`, the normalisation's finite rows) with the same tests
and compute-sanitizer memcheck on the fused, chunked and triangle backwards (bench/gpu_sanitize.py,
whose batches of up to 300 rows take one sort); timings in bench/results/gpu/h100/. Racecheck and
synccheck have not run on these kernels. The build before (ef4968a: the eager forward
that also issues the backward's launches) on an H200: the same test file and memcheck, timings in
bench/results/gpu/h200/. Before that (c7cd9de: the eager loss as one node
`_EagerLoss`, the scales kernel's one gradient for all anchors UNIFORM, the normalisation's
backward from strided float32 rows in label order ORDERED) on an H100: the parity suite against the
float64 reference on CUDA tensors (TF32 too; the fused and the chunked backward each as a target,
the triangle's two-sided lifts by the precision test), memcheck, racecheck on half of the cases,
timings in bench/results/gpu/h100/. Earlier builds on an H100
(2026-11-22 to 25): the same suite, memcheck, synccheck and racecheck, and the timings that made the
chunked backward (2.0-3.8x faster than the fused one) a GPU's default. The sm_80 entries of the tile
table have only been compiled. Without a GPU: the same suite under
TRITON_INTERPRET=1 on CPU tensors (tests/test_gpu_backends.py, the chunked backward as a target of
its own), and the PTX/ptxas facts of every shipped configuration and of the chunked backward's
kernel compiled ahead of time for sm_80 and sm_90 (tests/test_triton_compile.py).
"""
import contextlib
import functools
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .. import ops
from ..loss import _check_inputs, _nan_if_nonfinite, squares_dtype
from ..reference import reduce_losses

# jit functions are interpreted (numpy on CPU tensors) when this is set before they are defined
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The kernels read no global constants (their infinities and logs are literals): Triton compares each
# global a kernel reads with its value at compile time on every launch, about 5 us a global.
FLOAT32_TINY = 2.0 ** -126


# ---- per-pair math --------------------------------------------------------------------------
@triton.jit
def _pair_classes(label_i, id_i, label_j, id_j, col_ok):
    """[M, N] positive / negative pairs of rows i and columns j; equal identities are skipped."""
    same = label_i[:, None] == label_j[None, :]
    kept = (id_i[:, None] != id_j[None, :]) & col_ok[None, :]
    return same & kept, (same == 0) & kept


@triton.jit
def _mined_sets(s, positive, negative, minpos, maxneg, epsilon, MINING: tl.constexpr):
    """Similarity-P: a positive harder than the hardest negative by epsilon, and vice versa."""
    if MINING:
        positive = positive & (s - epsilon < maxneg)
        negative = negative & (s + epsilon > minpos)
    return positive, negative


@triton.jit
def _mined_negatives(s, negative, minpos, epsilon, MINING: tl.constexpr):
    """(the similarities of the negatives, -inf elsewhere; of the mined ones, -inf elsewhere): one
    float32 tile carries both the value and the set, where a mask beside S would hold registers."""
    s = tl.where(negative, s, -float("inf"))
    if MINING:
        return s, tl.where(s + epsilon > minpos, s, -float("inf"))
    return s, s


@triton.jit
def _set_flags(minpos, maxneg, epsilon, MINING: tl.constexpr):
    """Whether P_i and N_i are non-empty: decided by the anchor's hardest pairs alone."""
    has_positive = minpos < float("inf")
    has_negative = maxneg > -float("inf")
    if MINING:
        has_positive = has_positive & (minpos - epsilon < maxneg)
        has_negative = has_negative & (maxneg + epsilon > minpos)
    return has_positive, has_negative


@triton.jit
def _anchor_counts(minpos, maxneg, epsilon, MINING: tl.constexpr, SKIP_INCOMPLETE: tl.constexpr):
    """skip_incomplete_anchors: an anchor lacking either mined set contributes nothing."""
    has_positive, has_negative = _set_flags(minpos, maxneg, epsilon, MINING)
    if SKIP_INCOMPLETE:
        return has_positive & has_negative
    return has_positive | True


@triton.jit
def _shifts(minpos, maxneg, alpha, beta, base, epsilon, MINING: tl.constexpr):
    """m = max(0, largest exponent of the set): the largest exponent belongs to the hardest pair."""
    has_positive, has_negative = _set_flags(minpos, maxneg, epsilon, MINING)
    shift_p = tl.where(has_positive, tl.maximum(-alpha * (minpos - base), 0.0), 0.0)
    shift_n = tl.where(has_negative, tl.maximum(beta * (maxneg - base), 0.0), 0.0)
    return shift_p, shift_n


@triton.jit
def _pair_weights(s, positive, negative, lp, ln, alpha, beta, base):
    """dL_i/dS_ij (General Pair Weighting); 0 outside the mined sets. One exponential per pair: its
    class picks the exponent. (Not the base-2 form of _negatives_kernel: in _weights_kernel it took
    141-150 registers under Triton 3.6 instead of 128, one program per multiprocessor instead of two,
    and it saved _grad_kernel's small tiles nothing.)"""
    w = tl.exp(tl.where(positive, -alpha * (s - base) - lp, beta * (s - base) - ln))
    return tl.where(positive, -w, tl.where(negative, w, 0.0))


@triton.jit
def _scaled_weights(s, positive, negative, minpos, maxneg, lp, ln, scale, alpha, beta, base, epsilon,
                    MINING: tl.constexpr):
    """scale x dL/dS of the anchors at one end of the pairs: their stats come as [M, 1] columns (row
    anchors) or [1, N] rows (column anchors)."""
    p, n = _mined_sets(s, positive, negative, minpos, maxneg, epsilon, MINING)
    return scale * _pair_weights(s, p, n, lp, ln, alpha, beta, base)


@triton.jit
def _negative_offset(ln, beta, base):
    """An anchor's (LN + beta base) log2(e), for `_negative_weights`."""
    return (ln + beta * base) * 1.4426950408889634  # log2(e)


@triton.jit
def _negative_weights(s, minpos, offset, scale, beta, epsilon, MINING: tl.constexpr):
    """scale x dL/dS of pairs that are all negatives of their anchors (a label-free tile; S = -inf where a
    pair does not count; the anchors' terms as [M, 1] columns or [1, N] rows): exp(beta (S - base) - LN)
    in base 2, one FMA and one exp2 a pair (offset: `_negative_offset`), where the negative is mined.
    Exponents are <= 0 there, as LN >= beta (maxneg - base) (`_shifts`)."""
    w = scale * tl.exp2(s * (beta * 1.4426950408889634) - offset)  # (log2(e))
    if MINING:
        w = tl.where(s + epsilon > minpos, w, 0.0)
    return w


# ---- tiles ----------------------------------------------------------------------------------
@triton.jit
def _similarity_tile(a_ptr, b_ptr, rows, row_ok, cols, col_ok, dim,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] tile of a[rows] @ b[cols]^T: any row and column indices (a block,
    or a gathered list), rows of both `dim` long; 64-bit offsets (B * D may pass 2^31)."""
    s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, dim, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * dim + ks[None, :],
                    mask=row_ok[:, None] & (ks[None, :] < dim), other=0.0)
        b_t = tl.load(b_ptr + cols[None, :].to(tl.int64) * dim + ks[:, None],
                      mask=col_ok[None, :] & (ks[:, None] < dim), other=0.0)
        if UPCAST:  # the interpreter multiplies bfloat16 bit patterns: upcast there
            a = a.to(tl.float32)
            b_t = b_t.to(tl.float32)
        s = tl.dot(a, b_t, s, input_precision=PRECISION)
    return s


@triton.jit
def _load_keys(labels_ptr, ids_ptr, index, ok):
    return tl.load(labels_ptr + index, mask=ok, other=0), tl.load(ids_ptr + index, mask=ok, other=-1)


@triton.jit
def _pair_tile(a_ptr, b_ptr, b_labels_ptr, b_ids_ptr, rows, row_ok, label_i, id_i, cols, col_ok, dim,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """(S, positive, negative) of the rows against the columns `cols` (valid where col_ok)."""
    label_j, id_j = _load_keys(b_labels_ptr, b_ids_ptr, cols, col_ok)
    s = _similarity_tile(a_ptr, b_ptr, rows, row_ok, cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
    positive, negative = _pair_classes(label_i, id_i, label_j, id_j, col_ok)
    return s, positive, negative


@triton.jit
def _ordered_rows(row_order_ptr, num_x, BLOCK_M: tl.constexpr):
    """This program's anchors: the next BLOCK_M of the anchors sorted by label (indices into x)."""
    slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = slots < num_x
    return tl.load(row_order_ptr + slots, mask=row_ok, other=0), row_ok


@triton.jit
def _positive_columns(col_order_ptr, segment_end_ptr, column_shift_ptr, start, end, num_x,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENTED: tl.constexpr):
    """Slots start .. start + BLOCK_N (before `end`) of this program's positive list, as columns
    (`positive_ranges`). Unsegmented (self case), slot q is column col_order[q]. Segmented, the list
    is the segments of the block's anchors one after another: each slot's segment is found by a
    binary search over the block's segment ends, then its column read from the shifted order."""
    slots = start + tl.arange(0, BLOCK_N)
    col_ok = slots < end
    if SEGMENTED:
        first = tl.program_id(0) * BLOCK_M
        low = tl.zeros((BLOCK_N,), tl.int32) + first  # [low, high]: the anchors whose segment may hold the slot
        high = tl.zeros((BLOCK_N,), tl.int32) + tl.minimum(first + BLOCK_M, num_x) - 1
        tl.static_assert(BLOCK_M <= 256)  # 8 halvings of [low, high] find it (more leave it in place)
        for _ in tl.static_range(8):
            middle = (low + high) // 2
            after = tl.load(segment_end_ptr + middle) <= slots
            low = tl.where(after, middle + 1, low)
            high = tl.where(after, high, middle)
        slots += tl.load(column_shift_ptr + low, mask=col_ok, other=0)
    return tl.load(col_order_ptr + slots, mask=col_ok, other=0), col_ok


@triton.jit
def _positive_range_tile(x_ptr, ref_ptr, ref_labels_ptr, ref_ids_ptr, col_order_ptr, segment_end_ptr, column_shift_ptr,
                         rows, row_ok, label_i, id_i, start, end, num_x, dim, SEGMENTED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """(S, positive, negative) of the rows against slots start .. start + BLOCK_N (before `end`) of
    their block's positive list."""
    cols, col_ok = _positive_columns(col_order_ptr, segment_end_ptr, column_shift_ptr, start, end, num_x, BLOCK_M,
                                     BLOCK_N, SEGMENTED)
    return _pair_tile(x_ptr, ref_ptr, ref_labels_ptr, ref_ids_ptr, rows, row_ok, label_i, id_i, cols, col_ok, dim,
                      BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)


# ---- kernels --------------------------------------------------------------------------------
@triton.jit
def _column_range(num_ref, cols_per_split, split_axis: tl.constexpr):
    """The columns of this program's split: [begin, end)."""
    begin = tl.program_id(split_axis) * cols_per_split
    return begin, tl.minimum(begin + cols_per_split, num_ref)


@triton.jit
def _minpos_kernel(x_ptr, ref_ptr, labels_ptr, ids_ptr, ref_labels_ptr, ref_ids_ptr, row_order_ptr, col_order_ptr,
                   segment_end_ptr, column_shift_ptr, range_ptr, minpos_ptr, num_x, dim, SEGMENTED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Each anchor's hardest positive, from the columns of its block's positive range alone, and the
    hardest negative among those columns: minpos [2, B]."""
    rows, row_ok = _ordered_rows(row_order_ptr, num_x, BLOCK_M)
    label_i, id_i = _load_keys(labels_ptr, ids_ptr, rows, row_ok)
    minpos = tl.full((BLOCK_M,), float("inf"), tl.float32)
    maxneg = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    range_end = tl.load(range_ptr + 2 * tl.program_id(0) + 1)
    for start in range(tl.load(range_ptr + 2 * tl.program_id(0)), range_end, BLOCK_N):
        s, positive, negative = _positive_range_tile(
            x_ptr, ref_ptr, ref_labels_ptr, ref_ids_ptr, col_order_ptr, segment_end_ptr, column_shift_ptr, rows, row_ok,
            label_i, id_i, start, range_end, num_x, dim, SEGMENTED, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
        minpos = tl.minimum(minpos, tl.min(tl.where(positive, s, float("inf")), axis=1))
        maxneg = tl.maximum(maxneg, tl.max(tl.where(negative, s, -float("inf")), axis=1))
    tl.store(minpos_ptr + rows, minpos, mask=row_ok)
    tl.store(minpos_ptr + num_x + rows, maxneg, mask=row_ok)


@triton.jit
def _negatives_kernel(x_ptr, ref_ptr, labels_ptr, ids_ptr, ref_labels_ptr, ref_ids_ptr, row_order_ptr, range_ptr,
                      shared_ids_ptr, minpos_ptr, part_ptr, num_x, num_ref, dim, splits, cols_per_split, beta, base,
                      epsilon,
                      MINING: tl.constexpr, SKIP_RANGE: tl.constexpr, CHECK_IDS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """The one pass over all columns (this program's split): the hardest negative, and the sum of
    exp(beta (S - base)) over the mined negatives (which need only minpos, known already), online:
    rescaled whenever a larger exponent appears. Partials [3, splits, B]: maxneg, shift, sum.
    SKIP_RANGE (self case): the columns are the anchors in label order (ref = x[col_order]) and the
    slots of this block's positive range are left out: the columns of the block's labels, whose
    negatives _minpos_kernel and _finish_kernel take. Every other column has a label that no anchor
    of the block has, so it is a negative of each of them, and the tile needs no labels (their
    [M, N] comparisons took 61 of the 247 registers of a 128 x 128 tile under Triton 3.6); only
    identities the caller gave can still make a pair of another label not count (CHECK_IDS,
    ref_ids in the columns' order), and only where one identity is shared by rows of different
    labels (shared_ids_ptr, a flag computed on the device: `_shared_identities`), which a batch of
    distinct samples never has. Otherwise pairs are classified by their labels and identities."""
    rows, row_ok = _ordered_rows(row_order_ptr, num_x, BLOCK_M)
    label_i, id_i = _load_keys(labels_ptr, ids_ptr, rows, row_ok)
    minpos = tl.load(minpos_ptr + rows, mask=row_ok, other=float("inf"))
    maxneg = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    shift = tl.zeros((BLOCK_M,), tl.float32)  # >= 0: the 1 in log(1 + sum) never overflows either
    total = tl.zeros((BLOCK_M,), tl.float32)
    slope, offset = beta * 1.4426950408889634, beta * base * 1.4426950408889634  # (log2(e))
    if SKIP_RANGE:
        skip_begin = tl.load(range_ptr + 2 * tl.program_id(0)).to(tl.int32)
        skip_end = tl.load(range_ptr + 2 * tl.program_id(0) + 1).to(tl.int32)
    if CHECK_IDS:
        ids_shared = tl.load(shared_ids_ptr) != 0
    begin, end = _column_range(num_ref, cols_per_split, 1)
    for start in range(begin, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        if SKIP_RANGE:
            s = _similarity_tile(x_ptr, ref_ptr, rows, row_ok, cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST,
                                 PRECISION)
            # only a tile across the split's end or the skipped range needs its columns masked; the rest,
            # nearly all, skip the comparisons
            if (start + BLOCK_N > end) | ((start + BLOCK_N > skip_begin) & (start < skip_end)):
                s = tl.where((col_ok & ((cols < skip_begin) | (cols >= skip_end)))[None, :], s, -float("inf"))
            if CHECK_IDS:
                if ids_shared:
                    other_ids = tl.load(ref_ids_ptr + cols, mask=col_ok, other=-1)
                    s = tl.where(id_i[:, None] != other_ids[None, :], s, -float("inf"))
            negative = True  # (-inf marks the rest)
        else:
            s, _, negative = _pair_tile(x_ptr, ref_ptr, ref_labels_ptr, ref_ids_ptr, rows, row_ok, label_i, id_i,
                                        cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
        s, mined = _mined_negatives(s, negative, minpos[:, None], epsilon, MINING)
        maxneg = tl.maximum(maxneg, tl.max(s, axis=1))
        # base-2 exponents beta (S - base) log2(e), the shift folded in: one FMA and one exp2
        # (ex2.approx.ftz) a pair, where tl.exp took a multiply and a fix-up for subnormals besides; terms
        # below 2^-126 of the shift flush to 0. (beta > 0: -inf outside the mined negatives, adding nothing.)
        # With the unmasked tiles above: 1256 SASS instructions for the 128 x 128 tile where masking
        # every tile and tl.exp took 1832 (sm_90, Triton 3.6)
        new_shift = tl.maximum(shift, tl.max(mined, axis=1) * slope - offset)
        total = total * tl.exp2(shift - new_shift) + tl.sum(tl.exp2(mined * slope - (new_shift + offset)[:, None]),
                                                             axis=1)
        shift = new_shift
    split = tl.program_id(1)
    tl.store(part_ptr + split * num_x + rows, maxneg, mask=row_ok)
    tl.store(part_ptr + (splits + split) * num_x + rows, shift * 0.6931471805599453, mask=row_ok)  # (ln(2): back to ln)
    tl.store(part_ptr + (2 * splits + split) * num_x + rows, total, mask=row_ok)


@triton.jit
def _finish_kernel(x_ptr, ref_ptr, labels_ptr, ids_ptr, ref_labels_ptr, ref_ids_ptr, row_order_ptr, col_order_ptr,
                   segment_end_ptr, column_shift_ptr, range_ptr, minpos_ptr, part_ptr, stats_ptr, loss_ptr, num_x, dim,
                   splits, alpha, beta, base, epsilon, MINING: tl.constexpr, SKIP_INCOMPLETE: tl.constexpr,
                   SEGMENTED: tl.constexpr, SKIP_RANGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """The splits combined in their order (maxneg, LN), with the positive range's own negatives where
    the negatives kernel skipped it (SKIP_RANGE: their maxneg from _minpos_kernel, their sum here);
    then the positive sum over the positive range (the positives' mining needs the final maxneg);
    stats [4, B] = (minpos, maxneg, LP, LN), loss."""
    rows, row_ok = _ordered_rows(row_order_ptr, num_x, BLOCK_M)
    label_i, id_i = _load_keys(labels_ptr, ids_ptr, rows, row_ok)
    maxneg = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    shift_n = tl.zeros((BLOCK_M,), tl.float32)
    sum_n = tl.zeros((BLOCK_M,), tl.float32)
    for k in range(0, splits):
        maxneg = tl.maximum(maxneg, tl.load(part_ptr + k * num_x + rows, mask=row_ok, other=-float("inf")))
        shift_k = tl.load(part_ptr + (splits + k) * num_x + rows, mask=row_ok, other=0.0)
        total_k = tl.load(part_ptr + (2 * splits + k) * num_x + rows, mask=row_ok, other=0.0)
        new_shift = tl.maximum(shift_n, shift_k)
        sum_n = sum_n * tl.exp(shift_n - new_shift) + total_k * tl.exp(shift_k - new_shift)
        shift_n = new_shift
    minpos = tl.load(minpos_ptr + rows, mask=row_ok, other=float("inf"))
    if SKIP_RANGE:
        maxneg = tl.maximum(maxneg, tl.load(minpos_ptr + num_x + rows, mask=row_ok, other=-float("inf")))
    # the final shifts: the exponents of the hardest mined pairs (_shifts), never below the splits'
    # shift (up to a few ulps of rounding), so the range's negatives are summed at a fixed shift, as the
    # positives are
    shift_p, shift = _shifts(minpos, maxneg, alpha, beta, base, epsilon, MINING)
    sum_n *= tl.exp(shift_n - shift)
    sum_p = tl.zeros((BLOCK_M,), tl.float32)
    range_end = tl.load(range_ptr + 2 * tl.program_id(0) + 1)
    for start in range(tl.load(range_ptr + 2 * tl.program_id(0)), range_end, BLOCK_N):
        s, positive, negative = _positive_range_tile(
            x_ptr, ref_ptr, ref_labels_ptr, ref_ids_ptr, col_order_ptr, segment_end_ptr, column_shift_ptr, rows, row_ok,
            label_i, id_i, start, range_end, num_x, dim, SEGMENTED, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
        if SKIP_RANGE:
            unused_s, mined = _mined_negatives(s, negative, minpos[:, None], epsilon, MINING)
            sum_n += tl.sum(tl.exp(beta * (mined - base) - shift[:, None]), axis=1)
        if MINING:
            positive = positive & (s - epsilon < maxneg[:, None])
        sum_p += tl.sum(tl.where(positive, tl.exp(-alpha * (s - base) - shift_p[:, None]), 0.0), axis=1)
    lp = shift_p + tl.log(tl.exp(-shift_p) + sum_p)
    ln = shift + tl.log(tl.exp(-shift) + sum_n)
    counts = _anchor_counts(minpos, maxneg, epsilon, MINING, SKIP_INCOMPLETE)
    tl.store(loss_ptr + rows, tl.where(counts, lp / alpha + ln / beta, 0.0), mask=row_ok)
    tl.store(stats_ptr + rows, minpos, mask=row_ok)
    tl.store(stats_ptr + num_x + rows, maxneg, mask=row_ok)
    tl.store(stats_ptr + 2 * num_x + rows, lp, mask=row_ok)
    tl.store(stats_ptr + 3 * num_x + rows, ln, mask=row_ok)


@triton.jit
def _anchor_stats(stats_ptr, num_anchors, index, ok):
    """(minpos, maxneg, LP, LN) of the anchors `index` from stats [4, num_anchors]; an invalid one has
    empty sets."""
    minpos = tl.load(stats_ptr + index, mask=ok, other=float("inf"))
    maxneg = tl.load(stats_ptr + num_anchors + index, mask=ok, other=-float("inf"))
    lp = tl.load(stats_ptr + 2 * num_anchors + index, mask=ok, other=0.0)
    ln = tl.load(stats_ptr + 3 * num_anchors + index, mask=ok, other=0.0)
    return minpos, maxneg, lp, ln


@triton.jit
def _anchor_terms(stats_ptr, scale_ptr, num_anchors, index, ok, epsilon,
                  MINING: tl.constexpr, SKIP_INCOMPLETE: tl.constexpr):
    """Stats of the anchors `index` and their gradient scale (0 where the anchor does not count)."""
    minpos, maxneg, lp, ln = _anchor_stats(stats_ptr, num_anchors, index, ok)
    scale = tl.load(scale_ptr + index, mask=ok, other=0.0)
    scale = tl.where(_anchor_counts(minpos, maxneg, epsilon, MINING, SKIP_INCOMPLETE), scale, 0.0)
    return minpos, maxneg, lp, ln, scale


@triton.jit
def _scales_kernel(grad_ptr, grad_stride, grad_divisor, stats_ptr, norm_ptr, scale_ptr, lift_ptr, column_lift_ptr,
                   num_anchors, alpha, beta, base, epsilon, max_lift, MINING: tl.constexpr,
                   SKIP_INCOMPLETE: tl.constexpr, COLUMN_LIFT: tl.constexpr, HALF_LIFT: tl.constexpr,
                   UNIFORM: tl.constexpr, BLOCK: tl.constexpr):
    """Per anchor: its gradient scale g_i / norm, g_i = grad_i / grad_divisor (norm = max |g| clamped at
    1e-30, so |scale| <= 1; UNIFORM, one gradient for all anchors: the norm |g_0| clamped, worked out
    and written here) and the lift of its row of pair weights, the power of 2 in
    [1, min(2^64, max_lift)] that takes |scale_i| times the row's largest weight into (1/2, 1].
    Weights enter the backward's product in the input dtype, and a large reference set without
    mining (weights about 1/R, subnormal in float16 beyond R = 16k) or a small grad_output would
    lose their precision without it. The
    largest weight is bounded from the stats in the log domain, each set only when it is not empty:
    exp(-alpha (minpos - base) - LP) for the mined positives, exp(beta (maxneg - base) - LN) for the
    mined negatives; no overflow, no NaN. An anchor without weights (or that does not count) gets the
    largest lift. COLUMN_LIFT: also the one lift of a reference set's rows, which hold every anchor's
    weights: the smallest anchor lift, at most LIFT_WITH_COLUMN_ANCHORS (an atomic minimum into
    column_lift_ptr, which starts there: the same result in any order). HALF_LIFT (the self case's
    triangle, where each weight takes its row's and its column's lift: `_chunked_plan`): the power of
    2 at or below the lift's square root, at most max_lift (TRIANGLE_LIFT)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < num_anchors
    if UNIFORM:
        g = tl.div_rn(tl.load(grad_ptr).to(tl.float32), grad_divisor)  # (rounded as torch's grad / B)
        norm = tl.maximum(tl.abs(g), 1e-30)
        if tl.program_id(0) == 0:
            tl.store(norm_ptr, norm)  # (for the launches after this one)
        scale = tl.where(ok, g / norm, 0.0)
    else:
        g = tl.div_rn(tl.load(grad_ptr + i * grad_stride, mask=ok, other=0.0).to(tl.float32), grad_divisor)
        scale = g / tl.load(norm_ptr)
    minpos, maxneg, lp, ln = _anchor_stats(stats_ptr, num_anchors, i, ok)
    has_positive, has_negative = _set_flags(minpos, maxneg, epsilon, MINING)
    largest = tl.maximum(tl.where(has_positive, -alpha * (minpos - base) - lp, -float("inf")),
                         tl.where(has_negative, beta * (maxneg - base) - ln, -float("inf")))
    counted = tl.where(_anchor_counts(minpos, maxneg, epsilon, MINING, SKIP_INCOMPLETE), tl.abs(scale), 0.0)
    bound = tl.log2(tl.where(counted > 0, counted, 1.0)) + largest * 1.4426950408889634  # (1 / ln 2)
    exponent = tl.where(counted > 0, tl.floor(-bound), 64.0)
    exponent = tl.where(exponent == exponent, tl.minimum(tl.maximum(exponent, 0.0), 64.0), 64.0)  # NaN: 64
    if HALF_LIFT:
        lift = tl.minimum(tl.exp2(tl.floor(exponent * 0.5)), max_lift)
    else:
        lift = tl.minimum(tl.exp2(exponent), max_lift)
    tl.store(scale_ptr + i, scale, mask=ok)
    tl.store(lift_ptr + i, lift, mask=ok)
    if COLUMN_LIFT:
        tl.atomic_min(column_lift_ptr, tl.min(tl.where(ok, lift, float("inf")), axis=0))


@triton.jit
def _grad_kernel(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr,
                 stats_ptr, scale_ptr, norm_ptr, row_scale_ptr, range_ptr, shared_ids_ptr, out_rows_ptr, out_ptr,
                 num_a, num_b, num_anchors, dim, cols_per_split, alpha, beta, base, epsilon,
                 MINING: tl.constexpr, SKIP_INCOMPLETE: tl.constexpr,
                 A_ANCHORS: tl.constexpr, B_ANCHORS: tl.constexpr, LABEL_ORDER: tl.constexpr, CHECK_IDS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                 EARLY_COLUMN_TERMS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """out[split, rows, d-block] = sum over the split's J of H_IJ @ b_J[:, d-block], H_IJ = dL/dS_IJ
    (anchors on the rows of a when A_ANCHORS) + (dL/dS_JI)^T (anchors on the rows of b when B_ANCHORS).
    Row r of H enters the product times row_scale[r] (a power of 2, see _scales_kernel) and leaves it
    divided by it. EARLY_COLUMN_TERMS: the column anchors' stats are loaded before S, not after (a
    register cost that sm_80 cannot pay without spilling).
    LABEL_ORDER (self case): a = b are the anchors in label order (`_label_order`), so a tile outside
    the row block's positive range (range_ptr) holds negatives only, and takes its weights without
    labels (`_negative_weights`), unless identities the caller gave are shared by rows of different
    labels (CHECK_IDS: the flag at shared_ids_ptr, `_shared_identities`), where every tile classifies
    its pairs; row r of the result goes to row out_rows[r] of out, the caller's order. Both paths
    compile without spills for every dtype on sm_80 and sm_90 (Triton 3.6; 3.9 parks 8 bytes on sm_80
    at a B that is not a multiple of 16, with identities) since the label-free tiles mask every tile."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_a
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    label_i, id_i = _load_keys(a_labels_ptr, a_ids_ptr, rows, row_ok)
    if A_ANCHORS:
        minpos_i, maxneg_i, lp_i, ln_i, scale_i = _anchor_terms(
            stats_ptr, scale_ptr, num_anchors, rows, row_ok, epsilon, MINING, SKIP_INCOMPLETE)
        offset_i = _negative_offset(ln_i, beta, base)  # (once: in the loop it spilled 8 bytes)
        row_scale = tl.load(row_scale_ptr + rows, mask=row_ok, other=1.0)
    else:  # a reference set's rows: one lift for all (_scales_kernel)
        row_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(row_scale_ptr)
    if LABEL_ORDER:
        range_begin = tl.load(range_ptr + 2 * tl.program_id(0)).to(tl.int32)
        range_end = tl.load(range_ptr + 2 * tl.program_id(0) + 1).to(tl.int32)
        # identities shared across labels (a flag, CHECK_IDS) leave no tile label-free: each compares them
        distinct_ids = tl.load(shared_ids_ptr) == 0 if CHECK_IDS else True
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    begin, end = _column_range(num_b, cols_per_split, 2)
    for start in range(begin, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        if B_ANCHORS and EARLY_COLUMN_TERMS:  # loaded before S: their latency hides behind its products
            minpos_j, maxneg_j, lp_j, ln_j, scale_j = _anchor_terms(
                stats_ptr, scale_ptr, num_anchors, cols, col_ok, epsilon, MINING, SKIP_INCOMPLETE)
        label_free = False
        if LABEL_ORDER:  # a tile beside the block's positive range: all its pairs are negatives
            s = _similarity_tile(a_ptr, b_ptr, rows, row_ok, cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST,
                                 PRECISION)
            label_free = ((start + BLOCK_N <= range_begin) | (start >= range_end)) & distinct_ids
        else:  # (a reference set: the classes' keys loaded before S, as the measured kernel did)
            s, positive, negative = _pair_tile(a_ptr, b_ptr, b_labels_ptr, b_ids_ptr, rows, row_ok, label_i, id_i,
                                               cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
        if B_ANCHORS and not EARLY_COLUMN_TERMS:
            minpos_j, maxneg_j, lp_j, ln_j, scale_j = _anchor_terms(
                stats_ptr, scale_ptr, num_anchors, cols, col_ok, epsilon, MINING, SKIP_INCOMPLETE)
        if label_free:  # (a constant False without LABEL_ORDER: the compiler drops the branch)
            # every tile masked: a branch for the split's last tile took 255 registers and 2024 SASS
            # instructions, and spilled 8 bytes at B not a multiple of 16; this 233, 1792 and none (sm_90, 3.6)
            s = tl.where(col_ok[None, :], s, -float("inf"))
            h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if A_ANCHORS:
                h += _negative_weights(s, minpos_i[:, None], offset_i[:, None], scale_i[:, None], beta, epsilon,
                                       MINING)
            if B_ANCHORS:
                h += _negative_weights(s, minpos_j[None, :], _negative_offset(ln_j, beta, base)[None, :],
                                       scale_j[None, :], beta, epsilon, MINING)
        else:
            if LABEL_ORDER:
                label_j, id_j = _load_keys(b_labels_ptr, b_ids_ptr, cols, col_ok)
                positive, negative = _pair_classes(label_i, id_i, label_j, id_j, col_ok)
            h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if A_ANCHORS:
                h += _scaled_weights(s, positive, negative, minpos_i[:, None], maxneg_i[:, None], lp_i[:, None],
                                     ln_i[:, None], scale_i[:, None], alpha, beta, base, epsilon, MINING)
            if B_ANCHORS:  # classes are symmetric; the column anchors' own stats decide their sets
                h += _scaled_weights(s, positive, negative, minpos_j[None, :], maxneg_j[None, :], lp_j[None, :],
                                     ln_j[None, :], scale_j[None, :], alpha, beta, base, epsilon, MINING)
        b = tl.load(b_ptr + cols[:, None].to(tl.int64) * dim + ds[None, :],
                    mask=col_ok[:, None] & (ds[None, :] < dim), other=0.0)
        if UPCAST:
            b = b.to(tl.float32)
        acc = tl.dot((h * row_scale[:, None]).to(b.dtype), b, acc, input_precision=PRECISION)
    acc = acc * (tl.load(norm_ptr) / row_scale)[:, None]
    out_ptr += tl.program_id(2).to(tl.int64) * num_a * dim
    if LABEL_ORDER:
        rows = tl.load(out_rows_ptr + rows, mask=row_ok, other=0)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * dim + ds[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (ds[None, :] < dim))


@triton.jit
def _weights_tile(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr, stats_ptr, scale_ptr, row_scale_ptr,
                  w_ptr, copy_ptr, copy_scale_ptr, w_stride, rows, row_ok, row_begin, cols, col_ok,
                  col_begin, num_anchors, dim, alpha, beta, base, epsilon, MINING: tl.constexpr,
                  SKIP_INCOMPLETE: tl.constexpr, B_ANCHORS: tl.constexpr, BOTH_LIFTS: tl.constexpr, COPY: tl.constexpr,
                  LABEL_FREE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """_weights_kernel's work on one tile: H of the rows against the columns, lifted, stored."""
    if LABEL_FREE:
        s = _similarity_tile(a_ptr, b_ptr, rows, row_ok, cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST,
                             PRECISION)
    else:
        label_i, id_i = _load_keys(a_labels_ptr, a_ids_ptr, rows, row_ok)
        s, positive, negative = _pair_tile(a_ptr, b_ptr, b_labels_ptr, b_ids_ptr, rows, row_ok, label_i, id_i, cols,
                                           col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
    minpos_i, maxneg_i, lp_i, ln_i, scale_i = _anchor_terms(
        stats_ptr, scale_ptr, num_anchors, rows, row_ok, epsilon, MINING, SKIP_INCOMPLETE)
    if B_ANCHORS:
        minpos_j, maxneg_j, lp_j, ln_j, scale_j = _anchor_terms(
            stats_ptr, scale_ptr, num_anchors, cols, col_ok, epsilon, MINING, SKIP_INCOMPLETE)
    if LABEL_FREE:
        h = _negative_weights(s, minpos_i[:, None], _negative_offset(ln_i, beta, base)[:, None], scale_i[:, None],
                              beta, epsilon, MINING)
        if B_ANCHORS:  # (always: the self case)
            h += _negative_weights(s, minpos_j[None, :], _negative_offset(ln_j, beta, base)[None, :],
                                   scale_j[None, :], beta, epsilon, MINING)
    else:
        h = _scaled_weights(s, positive, negative, minpos_i[:, None], maxneg_i[:, None], lp_i[:, None],
                            ln_i[:, None], scale_i[:, None], alpha, beta, base, epsilon, MINING)
        if B_ANCHORS:
            h += _scaled_weights(s, positive, negative, minpos_j[None, :], maxneg_j[None, :], lp_j[None, :],
                                 ln_j[None, :], scale_j[None, :], alpha, beta, base, epsilon, MINING)
    offsets = (rows - row_begin)[:, None].to(tl.int64) * w_stride + (cols - col_begin)[None, :]
    ok = row_ok[:, None] & (cols - col_begin < w_stride)[None, :]
    # each row's lift, and with BOTH_LIFTS each column's too
    lift = tl.load(row_scale_ptr + rows, mask=row_ok, other=1.0)[:, None]
    if BOTH_LIFTS:
        lift = lift * tl.load(row_scale_ptr + cols, mask=col_ok, other=1.0)[None, :]
    tl.store(w_ptr + offsets, (h * lift).to(w_ptr.dtype.element_ty), mask=ok)
    if COPY:
        tl.store(copy_ptr + offsets, (h * tl.load(copy_scale_ptr)).to(copy_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _weights_kernel(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr, stats_ptr, scale_ptr,
                    row_scale_ptr, range_ptr, shared_ids_ptr, w_ptr, copy_ptr, copy_scale_ptr, w_stride, row_begin,
                    row_end, col_begin, col_end, num_anchors, dim, alpha, beta, base, epsilon,
                    MINING: tl.constexpr, SKIP_INCOMPLETE: tl.constexpr, B_ANCHORS: tl.constexpr,
                    BOTH_LIFTS: tl.constexpr, COPY: tl.constexpr, LABEL_ORDER: tl.constexpr, CHECK_IDS: tl.constexpr,
                    RANGE_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """The chunked backward's first half: one tile of H (as in _grad_kernel; the rows of a are
    anchors, and so are b's when B_ANCHORS), lifted, written in the input dtype to
    w[rows - row_begin, cols - col_begin] for cuBLAS products (`Product`), the columns up to the
    buffer's padded row length w_stride. The lift: each row's (row_scale[rows]), and with BOTH_LIFTS
    each column's too (the self case's triangle, where a weight enters a product from either side:
    `_chunked_plan`). COPY (a reference set that takes a gradient): H times the reference rows' one
    lift (copy_scale) too, to copy_ptr at the same place, for dref. Grid: (column blocks, row blocks),
    the longer axis first (CUDA allows 65535 on the second).
    LABEL_ORDER (self case, in label order): every pair is taken as a negative, with no labels (128
    registers and 1112 SASS instructions where classifying pairs took 128 and 1856: 128 x 64, sm_90,
    Triton 3.6); the columns of each row block's positive range, which hold its positives, are
    rewritten afterwards by a RANGE_TILES launch of smaller tiles, whose program (t, k) walks tiles
    t, t + RANGE_PROGRAMS, ... of row block k's range (range_ptr, for its BLOCK_M; row blocks counted
    from row 0, row_begin a whole number of them) within the chunk's columns and writes their weights
    classified. So the padding past col_end holds weights of zero-padded columns: cuBLAS never reads it."""
    rows = row_begin + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    if RANGE_TILES:  # (whole tiles: the columns past the range's end get their weights again, classified)
        block = row_begin // BLOCK_M + tl.program_id(1)
        range_begin = tl.maximum(tl.load(range_ptr + 2 * block).to(tl.int32), col_begin)
        range_end = tl.minimum(tl.load(range_ptr + 2 * block + 1).to(tl.int32), col_end)
        if CHECK_IDS:  # identities shared across labels: every tile is rewritten, comparing them
            if tl.load(shared_ids_ptr) != 0:
                range_begin, range_end = col_begin, col_end
        for start in range(range_begin + tl.program_id(0) * BLOCK_N, range_end, tl.num_programs(0) * BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            _weights_tile(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr, stats_ptr, scale_ptr,
                          row_scale_ptr, w_ptr, copy_ptr, copy_scale_ptr, w_stride, rows, row_ok,
                          row_begin, cols, cols < col_end, col_begin, num_anchors, dim, alpha, beta, base, epsilon,
                          MINING, SKIP_INCOMPLETE, B_ANCHORS, BOTH_LIFTS, COPY, False, BLOCK_M, BLOCK_N,
                          BLOCK_K, UPCAST, PRECISION)
    else:
        cols = col_begin + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        _weights_tile(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr, stats_ptr, scale_ptr,
                      row_scale_ptr, w_ptr, copy_ptr, copy_scale_ptr, w_stride, rows, row_ok,
                      row_begin, cols, cols < col_end, col_begin, num_anchors, dim, alpha, beta, base, epsilon,
                      MINING, SKIP_INCOMPLETE, B_ANCHORS, BOTH_LIFTS, COPY, LABEL_ORDER, BLOCK_M, BLOCK_N,
                      BLOCK_K, UPCAST, PRECISION)


@triton.jit
def _row_block(t_ptr, rows, k, num_rows, dim, stride, BLOCK_D: tl.constexpr):
    """Columns k .. k + BLOCK_D of `rows` of a [num_rows, dim] tensor with rows `stride` elements apart,
    as float32 (0 outside)."""
    ks = k + tl.arange(0, BLOCK_D)
    at = rows[:, None].to(tl.int64) * stride + ks[None, :]
    ok = (rows < num_rows)[:, None] & (ks < dim)[None, :]
    return tl.load(t_ptr + at, mask=ok, other=0.0).to(tl.float32), at, ok


@triton.jit
def _unit_rows_kernel(t_ptr, y_ptr, norm_ptr, finite_ptr, num_rows, dim, WIDE_SUMS: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """y = t / max(|t|, 1e-12) row by row, and that clamped norm (float32): ms_loss_cuda.loss.unit_rows
    in one launch where it takes four (the norm, its clamp and cast, the division). WIDE_SUMS (float32
    and bfloat16 rows): the squares summed in float64, as there (float32's overflow from 1.8e19 on).
    finite: 0 for a row of finite values, NaN for one with a NaN or an infinity (the sum of t * 0),
    which the eager loss adds to its result instead of reading t again."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    squares = tl.zeros((BLOCK_R,), tl.float32)
    finite = tl.zeros((BLOCK_R,), tl.float32)
    if WIDE_SUMS:
        squares = squares.to(tl.float64)
    for k in range(0, dim, BLOCK_D):
        t, _, _ = _row_block(t_ptr, rows, k, num_rows, dim, dim, BLOCK_D)
        finite += tl.sum(t * 0.0, axis=1)
        if WIDE_SUMS:
            t = t.to(tl.float64)
        squares += tl.sum(t * t, axis=1)
    if WIDE_SUMS:
        norm = tl.sqrt(squares).to(tl.float32)  # (float64's square root is rounded correctly)
    else:
        norm = tl.sqrt_rn(squares)
    norm = tl.maximum(norm, 1e-12)
    tl.store(norm_ptr + rows, norm, mask=rows < num_rows)
    tl.store(finite_ptr + rows, finite, mask=rows < num_rows)
    for k in range(0, dim, BLOCK_D):  # (the block's rows again, from L1/L2)
        t, at, ok = _row_block(t_ptr, rows, k, num_rows, dim, dim, BLOCK_D)
        tl.store(y_ptr + at, tl.div_rn(t, norm[:, None]).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _unlifted_rows_kernel(t_ptr, lift_ptr, y_ptr, num_rows, dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """y = t / lift row by row, in t's dtype: the triangle's rows of x for both of its products (see
    `_chunked_plan`), in one pass where torch's division of 16-bit rows by float32 lifts took three
    times as long (35 us at B = 16384, D = 512 on an H100). The lifts are powers of 2 up to
    TRIANGLE_LIFT, so that is exact but where float16 values fall below its normal range (|x| < 2^-7
    at 2^7): for unit rows of D = 512 at most 3.4e-5 of a row's scale; bench/triangle_precision.py's
    rows of norm 1e-3 lose 1.1e-2 (1.2e-3 at norm 1e-2, 3.1e-4 in whole rows)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    lift = tl.load(lift_ptr + rows, mask=rows < num_rows, other=1.0)
    for k in range(0, dim, BLOCK_D):
        t, at, ok = _row_block(t_ptr, rows, k, num_rows, dim, dim, BLOCK_D)
        tl.store(y_ptr + at, tl.div_rn(t, lift[:, None]).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _scaled_rows_kernel(g_ptr, g_stride, scale_ptr, y_ptr, num_rows, dim, BLOCK_R: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """y = g * scale (one value, any float dtype) in y's dtype, rows of g g_stride elements apart: the
    eager loss's float32 gradient for grad_output 1 times the grad_output, in one pass where torch's
    mul into another dtype took twice as long (31 us at B = 16384, D = 512 on an H100)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    scale = tl.load(scale_ptr).to(tl.float32)
    for k in range(0, dim, BLOCK_D):
        g, _, ok = _row_block(g_ptr, rows, k, num_rows, dim, g_stride, BLOCK_D)
        at = rows[:, None].to(tl.int64) * dim + (k + tl.arange(0, BLOCK_D))[None, :]
        tl.store(y_ptr + at, (g * scale).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _grad_block(g_ptr, g_stride, at_g, rows, k, num_rows, dim, ORDERED: tl.constexpr, BLOCK_D: tl.constexpr):
    """_unit_rows_grad_kernel's block of g: rows at_g, g_stride apart (ORDERED), else the rows of y."""
    if ORDERED:
        g, _, _ = _row_block(g_ptr, at_g, k, num_rows, dim, g_stride, BLOCK_D)
    else:
        g, _, _ = _row_block(g_ptr, rows, k, num_rows, dim, dim, BLOCK_D)
    return g


@triton.jit
def _unit_rows_grad_kernel(g_ptr, g_stride, y_ptr, norm_ptr, dt_ptr, order_ptr, num_rows, dim, ORDERED: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """dt = (g - y (g . y)) / |t| row by row (g / 1e-12 where the norm was clamped, as torch's): one
    launch where torch's ops (ms_loss_cuda/loss.py, _UnitRows.backward) take ten. g: of any float
    dtype, contiguous rows; ORDERED: row p of g (g_stride elements apart: the chunked backward's
    padded float32 rows, where it left them) belongs to row order[p] of y, norm and dt (the self
    case's label order). (Contiguous g shares y's offsets: with a stride of its own, 8 bytes spill
    on sm_90 under Triton 3.6.)"""
    at_g = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = at_g
    if ORDERED:
        rows = tl.load(order_ptr + at_g, mask=at_g < num_rows, other=num_rows)
    along = tl.zeros((BLOCK_R,), tl.float32)
    for k in range(0, dim, BLOCK_D):
        g = _grad_block(g_ptr, g_stride, at_g, rows, k, num_rows, dim, ORDERED, BLOCK_D)
        y, _, _ = _row_block(y_ptr, rows, k, num_rows, dim, dim, BLOCK_D)
        along += tl.sum(g * y, axis=1)
    norm = tl.load(norm_ptr + rows, mask=rows < num_rows, other=1.0)
    along = tl.where(norm > 1e-12, along, 0.0)
    for k in range(0, dim, BLOCK_D):
        g = _grad_block(g_ptr, g_stride, at_g, rows, k, num_rows, dim, ORDERED, BLOCK_D)
        y, at, ok = _row_block(y_ptr, rows, k, num_rows, dim, dim, BLOCK_D)
        tl.store(dt_ptr + at, tl.div_rn(g - y * along[:, None], norm[:, None]).to(dt_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _search(sorted_ptr, key, num, steps, ok, RIGHT: tl.constexpr):
    """Where `key` goes in sorted_ptr[:num] (steps >= num.bit_length() halvings): before its equals, or
    after them (RIGHT), as torch.searchsorted."""
    lo = tl.zeros_like(key).to(tl.int32)
    hi = lo + num
    for _ in range(steps):
        active = ok & (lo < hi)
        mid = (lo + hi) // 2
        value = tl.load(sorted_ptr + mid, mask=active, other=0)
        if RIGHT:
            after = value <= key
        else:
            after = value < key
        lo = tl.where(active & after, mid + 1, lo)
        hi = tl.where(active & ~after, mid, hi)
    return lo


@triton.jit
def _label_order_kernel(sorted_ptr, order_ptr, saved_ptr, ranks_ptr, range_ptr, rows_ptr, ordered_ptr, ids_ptr,
                        ordered_ids_ptr, num, segment, segments, steps, block_m, dim, ROWS: tl.constexpr,
                        IDS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """`_label_order` after its sort, in one launch where torch's ops took six. The sort: `segments` rows
    of `segment` keys, each sorted stably on its own (sorted keys, each one's int64 index in its row;
    the last row's slots from num on are padding, sorted last). Each key's position p in the stable
    order of all num keys: its place in its row, plus the keys before it in each other row (in rows
    before its own, those equal to it too), by binary search: a merge of the rows. Then saved[0, p]
    = its index in the caller's order (order), saved[1, p] = the first position of its key (the
    keys below it in all rows), ranks[order] = that too (each key's rank, in the caller's order);
    ranges[k] = (the first position of block k's first key, one past the last of its last key's) for
    blocks of block_m positions; ROWS: ordered[p] = rows[order] (contiguous [num, dim]); IDS:
    ordered_ids[p] = ids[order]."""
    slot = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = slot < num  # (the padding takes the last row's last slots)
    row = slot // segment
    key = tl.load(sorted_ptr + slot, mask=ok, other=0)
    p, first, end = slot % segment, tl.zeros_like(slot), tl.zeros_like(slot)
    for other in range(0, segments):
        length = tl.minimum(segment, num - other * segment)
        below = _search(sorted_ptr + other * segment, key, length, steps, ok, False)
        upto = _search(sorted_ptr + other * segment, key, length, steps, ok, True)
        first += below
        end += upto
        p += tl.where(other < row, upto, tl.where(other > row, below, 0))
    order = (row * segment + tl.load(order_ptr + slot, mask=ok, other=0)).to(tl.int32)
    tl.store(saved_ptr + p, order, mask=ok)
    tl.store(saved_ptr + num + p, first, mask=ok)
    tl.store(ranks_ptr + order, first, mask=ok)
    block, at = p // block_m, p % block_m
    tl.store(range_ptr + 2 * block, first, mask=ok & (at == 0))
    tl.store(range_ptr + 2 * block + 1, end, mask=ok & ((at == block_m - 1) | (p == num - 1)))
    if IDS:
        tl.store(ordered_ids_ptr + p, tl.load(ids_ptr + order, mask=ok), mask=ok)
    if ROWS:
        for k in range(0, dim, BLOCK_D):
            ks = k + tl.arange(0, BLOCK_D)
            column_ok = ok[:, None] & (ks < dim)[None, :]
            row_values = tl.load(rows_ptr + order[:, None].to(tl.int64) * dim + ks[None, :], mask=column_ok)
            tl.store(ordered_ptr + p[:, None].to(tl.int64) * dim + ks[None, :], row_values, mask=column_ok)


# ---- launch plans -----------------------------------------------------------------------------
class Launch(NamedTuple):
    """One kernel launch: tensors and scalars in `args`, specialisations in `constexprs`."""
    kernel: object
    grid: tuple
    args: dict
    constexprs: dict
    num_warps: int
    num_stages: int

    def __call__(self):
        key = None if INTERPRETED else self._key()
        known = _compiled_kernels.get(key)
        if known is None or _launch_hooks_set() or self.kernel.pre_run_hooks:
            compiled = self.kernel[self.grid](**self.args, **self.constexprs, num_warps=self.num_warps,
                                              num_stages=self.num_stages)
            if key is not None:
                _compiled_kernels[key] = compiled, tuple(param.name for param in self.kernel.params)
            return
        compiled, names = known
        values = self.args | self.constexprs
        grid = self.grid + (1,) * (3 - len(self.grid))
        compiled.run(*grid, triton.runtime.driver.active.get_current_stream(key[1]), compiled.function,
                     compiled.packed_metadata, None, None, None, *[values[name] for name in names])

    def _key(self):
        """What selects the compiled kernel that Triton's own launch would pick (how it specialises each
        argument: a tensor's dtype and 16-byte alignment, an integer's width, whether it is 1 and a
        multiple of 16), with the device and the compile options; None for an argument of another
        kind (then every launch takes Triton's path)."""
        spec, aligned = [], 0
        for value in self.args.values():
            if isinstance(value, torch.Tensor):
                spec.append(value.dtype)
                aligned = aligned << 1 | (value.data_ptr() % 16 == 0)
            elif type(value) is int:
                spec.append((value % 16 == 0) + 2 * (value == 1) + 4 * (-0x80000000 <= value <= 0x7fffffff)
                            + 8 * (value >= 0) + 16 * (value >= 2 ** 63))
            elif type(value) is float or type(value) is bool:
                spec.append(type(value))
            else:
                return None
        return (id(self.kernel), triton.runtime.driver.active.get_current_device(), self.num_warps, self.num_stages,
                tuple(self.args), tuple(spec), aligned, tuple(self.constexprs.items()), _compile_options(self.kernel))


def _compile_options(kernel):
    """The options besides the arguments that Triton's launch compiles for (3.6-3.9: debug, the
    instrumentation mode, 3.9's float sanitizer casts)."""
    compilation = triton.knobs.compilation
    return (kernel.debug or triton.knobs.runtime.debug, compilation.instrumentation_mode,
            getattr(compilation, "fpsan_homomorphic_casts", None))


def _launch_hooks_set():
    """Whether a launch hook is set (Triton 3.6-3.9 keep them as HookChains, older ones as None)."""
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook))


# Direct launches (`Launch`): Triton's launch path binds and specialises every argument and looks up
# its cache on each call, about 25 us of host time a launch, which an eager step from an idle GPU
# waits for before its heavy kernels start; a launch whose arguments specialise as an earlier one's
# calls that compiled kernel's launcher directly (the arguments as Triton passes them, every
# parameter in order). Launch hooks (a profiler such as Proton) take Triton's path.
_compiled_kernels = {}


class Unlift(NamedTuple):
    """A step of the chunked backward, after _scales_kernel: out = numerator / lift, row by row. With
    numerator norm, out [n, 1] takes the products of lifted weights back (`Product`): one lift per
    row, or one for all ([1, 1]). (The triangle's rows of x: `_unlifted_rows_kernel`.)"""
    out: torch.Tensor
    numerator: torch.Tensor
    lift: torch.Tensor

    def __call__(self):
        torch.div(self.numerator, self.lift[:, None], out=self.out)


class Reorder(NamedTuple):
    """The chunked backward's last step in the self case, which runs in label order: out[order[r]] =
    grad[r], the gradient's rows in the caller's order."""
    out: torch.Tensor
    grad: torch.Tensor
    order: torch.Tensor

    def __call__(self):
        self.out.index_put_((self.order,), self.grad)  # (int32 indices, which index_copy_ refuses)


class Product(NamedTuple):
    """A step of the chunked backward: out (float32) = (w @ b) * unlift by cuBLAS, or out += that; the
    rows of w come lifted (see _scales_kernel) and `Unlift` made their unlift."""
    w: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    unlift: torch.Tensor
    accumulate: bool

    def __call__(self):  # (under `_run`'s no_grad and autocast off)
        if self.w.dtype == torch.float32:  # IEEE or TF32, as torch's float32 matmul precision says
            product = self.w @ self.b
        elif self.w.is_cuda:  # 16-bit tensor cores, float32 sums and result (torch >= 2.8)
            product = torch.mm(self.w, self.b, out_dtype=torch.float32)
        else:  # CPU tensors (the interpreter's tests): the same float32 sums of the 16-bit values
            product = self.w.float() @ self.b.float()
        if self.accumulate:
            self.out.addcmul_(product, self.unlift)
        else:
            torch.mul(product, self.unlift, out=self.out)


def _chunks(total, block, other, element_size, budget):
    """[begin, end) chunks of `total` rows (or columns) of equal size, whole `block`s, as few as keep a
    weights buffer [chunk, other] within `budget` bytes (one block at the least)."""
    if total == 0:
        return []
    most = max(budget // max(other * element_size, 1) // block, 1) * block
    count = _cdiv(total, most)
    size = _cdiv(_cdiv(total, count), block) * block
    return [(begin, min(begin + size, total)) for begin in range(0, total, size)]


def _triangle_chunks(total, block, element_size, budget):
    """[begin, end) chunks of the self case's `total` anchor rows for `_chunked_plan`, chunk [r0, r1)
    against the columns r0 ... total: each the most whole `block`s whose weights (rows padded to
    `_padded`) stay within `budget` bytes, one block at the least; later chunks, narrower, take more
    rows, and where the rest would leave a sliver the last two halve it, so that no launch is left
    with a few programs."""
    chunks, begin = [], 0
    while begin < total:
        width = total - begin
        rows = max(budget // (_padded(width) * element_size) // block, 1) * block
        if rows < width < 2 * rows:
            rows = _cdiv(_cdiv(width, 2), block) * block
        chunks.append((begin, min(begin + rows, total)))
        begin += rows
    return chunks


def _padded(columns):
    """A weights buffer's row length: a multiple of 16 elements (aligned rows for cuBLAS, and Triton's
    divisibility hint on w_stride: without it the weights kernel stores 2 bytes at a time)."""
    return columns + (-columns % 16)


def _cdiv(a, b):
    """ceil(a / b) for the launch plans: triton.cdiv does the same behind a constexpr-function wrapper
    that cost a step's host 26 us over its 11 calls (bench/host_time.py, CPU)."""
    return -(-a // b)


def _pow2_at_least_16(n):
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def tile_config(kind, dtype, dim, interpret=INTERPRETED, capability=(9, 0)):
    """Tile sizes, warps and pipeline stages per kernel kind ("forward", "backward", "weights": the
    chunked backward's _weights_kernel), dtype, D and the GPU's compute capability.

    From sweeps on an H100 (bench/tune_triton.py, B = 16384, D = 512, 2026-11-22; results in
    bench/results/gpu/). 16-bit forward: 128 x 128 tiles, 8 warps (two Hopper warpgroups), 3
    stages: 1.14 ms against 1.31 for 128 x 64, both one program per multiprocessor then (247 and 179
    registers under Triton 3.6). Since the self case's negatives kernel stopped classifying pairs
    (SKIP_RANGE) and took its exponentials in base 2 they take 198 and 128: 128 x 64 now fits two
    programs, to be timed again.
    16-bit backward: 64 rows, 64 x 32 pair tiles, a float32 accumulator of up to 512 columns of D
    (S computed once per pair tile for D <= 512), 3 stages: 4.48 ms against 5.71 with 2 stages and
    5.44 for 256 columns (which computes S twice at D = 512); 2 stages for D <= 256, where 3 spill
    on sm_80. On sm_90 (capability >= 9.0) the column anchors' statistics are loaded before S
    (EARLY_COLUMN_TERMS: 3.85 ms against 4.50 in one run), which spills on sm_80.
    Faster entries that spill registers were left out (64 x 64 backward tiles: 4.00 ms against 4.35,
    308 bytes of spills on sm_90; float32: 45 ms forward, 193 ms backward against 82 and 377).
    float32 runs IEEE FMA products on small single-stage
    tiles (32 backward rows: 64 spill a few bytes at small D), or TF32 tensor-core products when
    torch's float32 matmul precision allows them (float32_precision; those tiles are not tuned: 27.8 ms
    at B = 16384 on the H100, against 159 ms in IEEE float32).
    Rows are padded to a multiple of 16 elements first (`_operands`): unaligned rows spill.
    The interpreter gets few, larger tiles: its cost is per tile op.
    The backward entry's CHUNK_BYTES picks its form: 0, the fused _grad_kernel; else the chunked
    form at that budget of pair weights (`backward_plan`): $MS_LOSS_TRITON_CHUNK_MB, 256 MiB on a GPU
    when unset (`chunk_budget`).
    The weights kernel takes the forward's tiles, but 128 x 64 with K steps of 32 and 4 stages in
    16-bit: with the anchor statistics of both ends, 128 x 128 spills on sm_90 (84 bytes with Triton
    3.6, the GPU machines' version; 200-800 with 3.9), and 128 x 64 takes 128 registers with 3.6
    in the self case's label order, 113 for a reference set (two 8-warp programs a multiprocessor;
    recounted 2026-11-26) and 194 with 3.9.
    Its TRIANGLE_TILES: the self case's triangle, whose weights take both ends' lifts: with the
    columns' lifts 128 x 64 takes 141 registers (3.6, sm_90), one program a multiprocessor, and
    its weights took 1.14 ms at B = 16384 against 0.87 with one lift (H200, 2026-11-26, float16);
    64 x 64 tiles of 4 warps (142 registers, three programs) brought the chunked backward from
    1.67 to 1.47 ms, the single lift's time on the H100 (bench/results/gpu/tune-weights-float16.json).
    Its RANGE_TILES: the tiles of the launch that rewrites the self case's positive ranges with
    classified weights (`_weights_kernel`): 64 x 64, 8 warps, one stage, no spills on sm_80 or sm_90
    for any dtype (at 128 rows, or with more stages, they spill under Triton 3.9).
    Its TRIANGLE_ROWS: the self case computes half of S (`_chunked_plan`) when its chunks are at
    least this tall. A chunk of c rows moves all later rows of dx (float32, 16 bytes a value: the
    product, then the sum) for 2 c flops a value: c / 8 flops a byte, 128 at c = 1024, where an
    H100 needs about 300 to keep its tensor cores busy. So at 1024 rows the second product takes
    about 1.4x its flops' time, still less than the S it saves; at 256 rows it would take 5.6x.
    Under the interpreter one block, so that the tests run it.
    Every configuration this returns for a GPU is compiled for sm_80 and sm_90 (with capability 8.0
    and 9.0) by the tests.
    """
    precision = float32_precision() if dtype == torch.float32 else "tf32"  # (unused for 16-bit)
    if kind == "weights":  # (the shipped forward entry, also where a tuned table stands in for this one)
        config = _SHIPPED_TILE_CONFIG("forward", dtype, dim, interpret, capability)
        if dtype != torch.float32 and not interpret:
            config.update(BLOCK_N=64, BLOCK_K=min(config["BLOCK_K"], 32), num_stages=4)
        config["TRIANGLE_ROWS"] = config["BLOCK_M"] if interpret else 1024
        config["TRIANGLE_TILES"] = (dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4)
                                    if dtype != torch.float32 and not interpret else {})
        config["RANGE_TILES"] = (dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=config["BLOCK_K"], num_warps=4, num_stages=1)
                                 if interpret else
                                 dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=min(config["BLOCK_K"], 32), num_warps=8,
                                      num_stages=1))
        return config
    if interpret:
        config = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, BLOCK_D=128, num_warps=4, num_stages=1)
    elif dtype == torch.float32 and precision == "tf32":  # not tuned yet: 16-bit shapes, half the K depth
        config = (dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3) if kind == "forward" else
                  dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, BLOCK_D=512, num_warps=8, num_stages=2))
    elif dtype == torch.float32:
        config = (dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, num_warps=8, num_stages=1) if kind == "forward" else
                  dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, BLOCK_D=512, num_warps=8, num_stages=1))
    elif kind == "forward":
        config = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    else:
        config = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, BLOCK_D=512, num_warps=8, num_stages=3 if dim > 256 else 2)
    padded = dim + (-dim % 16)  # (_aligned_rows) K steps that divide it: no step over zero padding
    config["BLOCK_K"] = min(config["BLOCK_K"], padded & -padded)
    if kind == "forward":
        config.pop("BLOCK_D", None)
    else:
        config["BLOCK_D"] = min(config["BLOCK_D"], _pow2_at_least_16(dim))
        config["EARLY_COLUMN_TERMS"] = dtype != torch.float32 and capability >= (9, 0)
        config["CHUNK_BYTES"] = chunk_budget(interpret)
    config["UPCAST"] = interpret and dtype == torch.bfloat16
    config["PRECISION"] = precision
    return config


_SHIPPED_TILE_CONFIG = tile_config


def with_triangle_rows(rows, table=tile_config):
    """`table` (the shipped tile_config unless given) with TRIANGLE_ROWS = rows: the chunk height from
    which the self case takes the triangle (1: at any height; 10 ** 9: never, chunks of whole rows),
    for the tests and benches that pick the chunked backward's form."""
    def config(kind, *args, **kwargs):
        entry = table(kind, *args, **kwargs)
        return dict(entry, TRIANGLE_ROWS=rows) if kind == "weights" else entry

    return config


DEFAULT_CHUNK_MIB = 256  # the chunked backward's budget where $MS_LOSS_TRITON_CHUNK_MB is unset, on a GPU


def chunk_budget(interpret=INTERPRETED):
    """The chunked backward's budget of pair weights in bytes: $MS_LOSS_TRITON_CHUNK_MB (MiB, a
    fraction allowed; 0: the fused backward). Unset: DEFAULT_CHUNK_MIB on a GPU, where the sweep
    (bench/tune_triton.py, H100, float16, 2026-11-25) timed the chunked form 2.5-3.2x faster than the
    fused one (1.46 against 3.69 ms at B = 16384; 1.89 against 6.02 ms for 1024 x 262144), and 0 under
    the interpreter, whose tests name the form they run. float16 keeps the fused backward under
    torch.backends.cuda.matmul.allow_fp16_accumulation, where cuBLAS refuses float32 results."""
    text = os.environ.get("MS_LOSS_TRITON_CHUNK_MB", "")
    if not text:
        return 0 if interpret else DEFAULT_CHUNK_MIB << 20
    try:
        mib = float(text)
    except ValueError:
        mib = float("nan")
    if not 0 <= mib < 2 ** 40:
        raise ValueError(f"MS_LOSS_TRITON_CHUNK_MB must be a number of MiB >= 0 (0: the fused backward), got {text!r}")
    return int(mib * (1 << 20))


def float32_precision():
    """How float32 products run, as torch.matmul's do: IEEE under torch.get_float32_matmul_precision()
    "highest" (the default: within 1e-5 of float64), TF32 tensor cores under "high" or "medium"
    (a 10-bit mantissa: about 1e-3 relative)."""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _aligned_rows(t, dtype):
    """`t` in `dtype`, contiguous, rows zero-padded to a multiple of 16 elements (32-byte aligned
    rows load as vectors; zero columns change no similarity)."""
    pad = -t.shape[1] % 16
    t = t.to(dtype)
    return torch.nn.functional.pad(t, (0, pad)) if pad else t.contiguous()


def int32_keys(a, b):
    """Keys of both ends as int32 tensors that are equal exactly where a's and b's values are: each
    value's rank among all of them (a sort, no device sync). int32 halves the integer work per pair.
    The loss ranks them once before the ops (ms_loss_cuda/loss.py), so neither op sorts again (the
    self case's labels excepted: the forward's one sort ranks them, `_label_order`)."""
    if a.dtype == torch.int32 and b.dtype == torch.int32:
        return a.contiguous(), b.contiguous()
    both = a.to(torch.int64).contiguous() if a is b else torch.cat([a.to(torch.int64), b.to(torch.int64)])
    ranks = torch.searchsorted(torch.sort(both).values, both).to(torch.int32)
    return (ranks, ranks) if a is b else (ranks[:a.shape[0]], ranks[a.shape[0]:])


def _operands(x, labels, ids, ref, ref_labels, ref_ids, default_ids=True):
    """Aligned rows of one dtype, int32 identities and, for a reference set, int32 keys of both ends
    (`int32_keys`; the self case's labels as given: its label order ranks them, `_label_order`).
    Default identities (default_ids; else None) never collide across ends (self case: the row index,
    so the diagonal is skipped). The inputs are checked before: by the loss, or by the ops (`_forward`)."""
    batch = x.shape[0]
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


def _split(config):
    config = dict(config)
    return config, config.pop("num_warps"), config.pop("num_stages")


def _check_dtypes(*tensors):
    for t in tensors:
        if t is not None and t.dtype not in ops.GPU_DTYPES:
            raise TypeError(f"the triton backend takes float32, float16 or bfloat16 embeddings, got {t.dtype} "
                            "(use backend='cpu' or 'reference' for float64)")


def _check_beta(beta):
    """The negatives' sums and label-free weights rely on beta > 0 in float32 (S = -inf marks a pair
    that does not count); the public API refuses beta <= 0 before, a direct call of the ops here."""
    if not beta >= FLOAT32_TINY:
        raise ValueError(f"beta must be > 0 (at least float32's smallest normal number, 1.2e-38), got {beta}")


def _multiprocessors(device, interpret):
    """What the column splits are sized for: the GPU's multiprocessors; under the interpreter a few
    (so that the tests run split launches); for plans made on CPU tensors without it, an H100's 132."""
    if device.type == "cuda":
        return _device_facts(device)[1]
    return 4 if interpret else 132


def _capability(device):
    """What the tile table is chosen for: the GPU's compute capability; for plans made on CPU tensors, an H100's."""
    return _device_facts(device)[0] if device.type == "cuda" else (9, 0)


@functools.cache
def _device_facts(device):
    """(compute capability, multiprocessors) of a GPU, asked once: every step's plans need them, and
    each query costs the host a few microseconds."""
    properties = torch.cuda.get_device_properties(device)
    return (properties.major, properties.minor), properties.multi_processor_count


RANGE_PROGRAMS = 4  # the chunked backward's programs per row block for its positive range: the tiles of
# a P x M batch's range (about 70 columns for 64 rows: 2 or 3 tiles of 64) at once
LIFT_WITH_COLUMN_ANCHORS = 2.0 ** 14  # the most a row holding other anchors' weights (each <= 1) may be lifted
# the most each end of a weight is lifted in the chunked triangle (a weight then stays <= 2^8; the
# rows of x are divided by it, and a larger one would push more of them below float16's normals)
TRIANGLE_LIFT = 2.0 ** 7


def column_splits(row_programs, num_cols, block_n, multiprocessors):
    """(splits, columns per split): the columns are split over enough programs that a launch has at
    least two per multiprocessor (a memory bank of B = 1024 has only 8 row blocks), each split a
    whole number of BLOCK_N tiles and none empty. The splits' partial results are combined in a
    fixed order afterwards (no atomic additions: the same bits on every run)."""
    col_tiles = max(_cdiv(num_cols, block_n), 1)
    wanted = min(_cdiv(2 * multiprocessors, max(row_programs, 1)), col_tiles)
    tiles_per_split = max(col_tiles // wanted, 1)
    return _cdiv(col_tiles, tiles_per_split), tiles_per_split * block_n


def positive_ranges(row_keys, col_keys, block_m):
    """Where each row block's positives in a reference set are, built on the device without a host
    sync (so a step can be captured in a CUDA graph): (row order, column order, segment ends, column
    shifts, ranges). The anchors are taken in label order (row order) and the columns too (column
    order), so block k (anchors row_order[k*block_m:(k+1)*block_m]) holds a run of sorted labels, and
    its positive list is slots ranges[k, 0] .. ranges[k, 1] of one numbering that names exactly the
    columns of those labels. (The self case's columns are the anchors: every label of the run has
    all its columns inside one slice of the label order, `_label_order`.) A label between two of the
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


def _sortable(keys):
    """Contiguous keys of a dtype that torch sorts and compares on every device: uint16-64 as int64,
    where their values stay distinct."""
    if keys.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        keys = keys.to(torch.int64)
    return keys.contiguous()


class LabelOrder(NamedTuple):
    """The self case in label order (`_label_order`), filled by `launch`."""
    ranks: torch.Tensor  # int32 [B]: each key's rank, in the caller's order (equal exactly where the keys are)
    order: torch.Tensor  # int32 [B]: the stable order that sorts the keys (saved[0])
    ranges: torch.Tensor  # int32 [blocks, 2]
    rows: Optional[torch.Tensor]  # the rows in that order (with `rows`), else None
    ids: Optional[torch.Tensor]  # the identities in that order (with `ids`), else None
    launch: Launch


# torch sorts a row of up to ONE_KERNEL_SORT keys in one kernel on CUDA, where a longer one takes about
# twenty launches (64-bit keys: 8 radix passes, each with a memset); up to MOST_SORT_ROWS rows of them
# are merged by binary search in _label_order_kernel (each key searches every row)
ONE_KERNEL_SORT, MOST_SORT_ROWS = 4096, 16


def _label_order(keys, block_m, saved, rows=None, ids=None):
    """The self case in label order, from one stable sort of its keys (`LabelOrder`). Block k of block_m
    rows in that order has the columns of its labels, its positives among them, in slots ranges[k, 0]
    .. ranges[k, 1] of the same order, and every other column is a negative of all of its rows.
    `saved` (int32 [2, B], contiguous) receives the order and the sorted ranks: the forward's stats
    keep them for the backward (`saved_label_order`), which then sorts nothing. `rows` (contiguous
    [B, D]) and `ids` ([B]): copies of them in that order too. Up to MOST_SORT_ROWS * ONE_KERNEL_SORT
    keys are sorted as rows of at most ONE_KERNEL_SORT (torch's one-kernel sort), which
    `_label_order_kernel` merges; all but the sort is its launch."""
    keys = _sortable(keys)
    num = keys.shape[0]
    segments = _cdiv(num, ONE_KERNEL_SORT)
    segments = segments if 1 < segments <= MOST_SORT_ROWS else 1
    segment = _cdiv(num, segments)
    if segments * segment > num:  # (padding of the largest value: after every key in the stable sort)
        keys = torch.cat([keys, keys.new_full((segments * segment - num,), torch.iinfo(keys.dtype).max)])
    sorted_keys, order = torch.sort(keys.view(segments, segment), stable=True)
    ranks = torch.empty(num, dtype=torch.int32, device=keys.device)
    ranges = torch.empty((_cdiv(num, block_m), 2), dtype=torch.int32, device=keys.device)
    ordered, ordered_ids = (None if t is None else torch.empty_like(t) for t in (rows, ids))
    block_d = 16 if rows is None else min(_pow2_at_least_16(rows.shape[1]), 512)
    launch = Launch(_label_order_kernel, (_cdiv(num, 2048 // block_d),),
                    dict(sorted_ptr=sorted_keys, order_ptr=order, saved_ptr=saved, ranks_ptr=ranks, range_ptr=ranges,
                         rows_ptr=order if rows is None else rows, ordered_ptr=order if rows is None else ordered,
                         ids_ptr=order if ids is None else ids, ordered_ids_ptr=order if ids is None else ordered_ids,
                         num=num, segment=segment, segments=segments, steps=segment.bit_length(), block_m=block_m,
                         dim=0 if rows is None else rows.shape[1]),  # (pointers never read: any will do)
                    dict(ROWS=rows is not None, IDS=ids is not None, BLOCK_P=2048 // block_d, BLOCK_D=block_d), 4, 1)
    return LabelOrder(ranks, saved[0], ranges, ordered, ordered_ids, launch)


def _block_ranges(first, block_m):
    """[blocks, 2] int32: where the keys of each block of block_m rows begin and end in the sorted order,
    from `first`, each sorted key's first position among them (the sorted ranks of `_label_order`)."""
    ends = torch.searchsorted(first, first, right=True, out_int32=True)  # (one past each key's last position)
    return torch.stack([first[::block_m], _block_lasts(ends, block_m)], 1)


SAVED_ROWS = 2  # the self case's stats rows after the four statistics: its label order (`_label_order`)


def saved_label_order(stats, batch):
    """(order, sorted ranks), int32 views of the self case's stats rows that `_label_order` wrote. They
    hold integers as float32 bits: stats must reach the backward as the forward made them (no cast)."""
    if stats.shape != (4 + SAVED_ROWS, batch) or stats.dtype != torch.float32:
        raise ValueError(f"stats must be the triton forward's float32 [{4 + SAVED_ROWS}, {batch}] in the self "
                         f"case, got {stats.dtype} {tuple(stats.shape)}")
    return stats[4:].view(torch.int32).unbind(0)


def _shared_identities(ids, labels):
    """int32 [1]: nonzero where one identity is shared by rows of different labels, a pair the self
    case's negatives kernel must then skip by comparing identities (CHECK_IDS); found on the device
    (no host sync): within each run of equal identities, sorted, two neighbours of different labels."""
    ids_sorted, order = torch.sort(ids, stable=True)
    labels_sorted = labels[order]
    clash = (ids_sorted[1:] == ids_sorted[:-1]) & (labels_sorted[1:] != labels_sorted[:-1])
    return clash.any().to(torch.int32).reshape(1)


def forward_plan(x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base, epsilon, mining,
                 skip_incomplete_anchors, interpret=INTERPRETED, multiprocessors=None, capability=None):
    """(loss [B], stats [4, B], launches that fill them): the hardest positive from each block's
    positive range, one pass over all columns (per column split) for the negatives, and one launch
    that combines the splits and sums the positives (`positive_ranges`). Self case: stats [6, B],
    the last two rows its label order for the backward (`_label_order`, `saved_label_order`)."""
    _check_dtypes(x, ref)
    _check_beta(beta)
    a, b, a_labels, a_ids, b_labels, b_ids = _operands(x, labels, ids, ref, ref_labels, ref_ids)
    num_x, dim = a.shape
    loss = torch.empty(num_x, dtype=torch.float32, device=x.device)  # (_finish_kernel writes every row)
    stats = torch.empty(4 + SAVED_ROWS * (ref is None), num_x, dtype=torch.float32, device=x.device)
    capability = capability or _capability(x.device)
    config, warps, stages = _split(tile_config("forward", a.dtype, dim, interpret, capability))
    row_programs = _cdiv(num_x, config["BLOCK_M"])
    launches, labels_given = [], a_labels
    if ref is None:  # one sort of the labels, kept in stats for the backward; the rows in label order too
        in_order = _label_order(a_labels, config["BLOCK_M"], stats[4:].view(torch.int32), a,
                                a_ids if ids is not None else None)
        a_labels, row_order, ranges, launches = in_order.ranks, in_order.order, in_order.ranges, [in_order.launch]
        b_labels, col_order, segment_end, column_shift = a_labels, row_order, None, None
    else:
        row_order, col_order, segment_end, column_shift, ranges = positive_ranges(a_labels, b_labels,
                                                                                  config["BLOCK_M"])
    splits, cols_per_split = column_splits(row_programs, b.shape[0], config["BLOCK_N"],
                                           multiprocessors or _multiprocessors(x.device, interpret))
    minpos = torch.empty(2, num_x, dtype=torch.float32, device=x.device)  # (and the positive ranges' maxneg)
    partials = torch.empty(3, splits, num_x, dtype=torch.float32, device=x.device)
    tensors = dict(x_ptr=a, ref_ptr=b, labels_ptr=a_labels, ids_ptr=a_ids, ref_labels_ptr=b_labels,
                   ref_ids_ptr=b_ids, row_order_ptr=row_order, range_ptr=ranges, minpos_ptr=minpos, num_x=num_x,
                   dim=dim)
    segmented = segment_end is not None  # (unsegmented: the kernels never read the two, any pointer will do)
    positives = dict(col_order_ptr=col_order, segment_end_ptr=segment_end if segmented else col_order,
                     column_shift_ptr=column_shift if segmented else col_order)
    # Self case: the negatives kernel reads the anchors in label order (a copy, B x D) and skips each block's
    # positive range (_negatives_kernel's SKIP_RANGE). A reference set keeps its order: no copy of a memory bank.
    skip_range, check_ids = ref is None, ref is None and ids is not None
    columns = dict(shared_ids_ptr=a_ids)  # (read with CHECK_IDS only: any pointer will do otherwise)
    if skip_range:
        columns["ref_ptr"] = in_order.rows
    if check_ids:  # (torch's ops, issued before the launches: the labels as given)
        columns.update(ref_ids_ptr=in_order.ids, shared_ids_ptr=_shared_identities(a_ids, _sortable(labels_given)))
    # The positive ranges take at most 64 columns a tile: about 130 columns in a P x M batch (two tiles
    # of 128 would be half empty), and _finish_kernel's two sums spill on 128 x 128 (sm_80, Triton 3.9)
    in_range = dict(config, BLOCK_N=min(config["BLOCK_N"], 64))
    launches += [
        Launch(_minpos_kernel, (row_programs,), dict(tensors, **positives), dict(in_range, SEGMENTED=segmented),
               warps, stages),
        Launch(_negatives_kernel, (row_programs, splits),
               dict(tensors, **columns, part_ptr=partials, num_ref=b.shape[0], splits=splits,
                    cols_per_split=cols_per_split, beta=beta, base=base, epsilon=epsilon),
               dict(config, MINING=mining, SKIP_RANGE=skip_range, CHECK_IDS=check_ids), warps,
               stages),
        Launch(_finish_kernel, (row_programs,),
               dict(tensors, **positives, part_ptr=partials, stats_ptr=stats, loss_ptr=loss, splits=splits,
                    alpha=alpha, beta=beta, base=base, epsilon=epsilon),
               dict(in_range, MINING=mining, SKIP_INCOMPLETE=skip_incomplete_anchors, SEGMENTED=segmented,
                    SKIP_RANGE=skip_range), warps, stages),
    ]
    return loss, stats, launches


def forward_plan_keeping_rows(*args, **kwargs):
    """forward_plan's (loss, stats), the self case's rows in label order that its negatives kernel reads
    (else None: a reference set keeps its order), and the launches: a backward issued right after
    reads them where it would gather them again."""
    loss, stats, launches = forward_plan(*args, **kwargs)
    rows = launches[0].args["ordered_ptr"] if launches and launches[0].kernel is _label_order_kernel else None
    return loss, stats, rows, launches


def backward_plan(grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base, epsilon,
                  mining, skip_incomplete_anchors, ref_grad=True, interpret=INTERPRETED, multiprocessors=None,
                  capability=None, grad_divisor=1, float32=False, rows_in_label_order=None):
    """(grad_x, grad_ref or empty [0], launches that fill them) for the loss's gradient grad_loss /
    grad_divisor (the eager loss's "mean": grad_output expanded to [B], divided by B); no dref launch
    without ref_grad. The chunked backward's gradients are float32, the fused one's in the inputs'
    dtype, or float32 with `float32` (the eager loss's gradient for grad_output 1, which a 16-bit
    "mean" would leave subnormal). A gradient whose launch splits its columns comes as float32 partials
    [splits, rows, D], to be summed over the first axis. `rows_in_label_order`: the self case's rows
    in the forward's label order where the caller has them (the eager loss: its forward's copy,
    `forward_plan_keeping_rows`), else gathered here."""
    _check_dtypes(x, ref)
    _check_beta(beta)
    a, b, a_labels, a_ids, b_labels, b_ids = _operands(x, labels, ids, ref, ref_labels, ref_ids,
                                                       default_ids=ref is not None)
    num_x, dim = a.shape
    if grad_loss.shape != (num_x,):
        raise ValueError(f"grad_loss must have shape [{num_x}] to match x, got {tuple(grad_loss.shape)}")
    stats = stats.contiguous()
    # Pair weights enter the second product in the input dtype: scaled to |.| <= 1 (grad/B under
    # "mean" would be subnormal in float16) and then, row by row, back up towards 1 (_scales_kernel).
    # One gradient for all anchors (an expanded one, as "mean" and "sum" give): its norm from _scales_kernel.
    uniform = num_x > 0 and grad_loss.stride(0) == 0
    if uniform:
        norm = torch.empty(1, dtype=torch.float32, device=x.device)
    elif num_x:
        norm = torch.linalg.vector_norm(grad_loss.to(torch.float32), float("inf")).reshape(1)
        norm = (norm if grad_divisor == 1 else norm / grad_divisor).clamp_min_(1e-30)
    else:
        norm = torch.ones(1, dtype=torch.float32, device=x.device)
    capability = capability or _capability(x.device)
    config, warps, stages = _split(tile_config("backward", a.dtype, dim, interpret, capability))
    chunk_bytes = config.pop("CHUNK_BYTES")
    if a.dtype == torch.float16 and torch.backends.cuda.matmul.allow_fp16_accumulation:
        chunk_bytes = 0  # (cuBLAS refuses float32 results of float16 products then: the fused form instead)
    copy, triangle = ref is not None and ref_grad, False
    if chunk_bytes:
        tiles = tile_config("weights", a.dtype, dim, interpret, capability)
        triangle_rows, range_tiles = tiles.pop("TRIANGLE_ROWS"), tiles.pop("RANGE_TILES")
        triangle_tiles = tiles.pop("TRIANGLE_TILES", {})
        rectangles, triangle = _chunk_rectangles(ref is None, num_x, b.shape[0], tiles,
                                                 a.element_size() * (1 + copy), chunk_bytes, triangle_rows)
        if triangle and tiles["BLOCK_M"] % triangle_tiles.get("BLOCK_M", 1) == 0:  # (its chunks are whole blocks)
            tiles.update(triangle_tiles)
    order, label_order = None, dict(range_ptr=norm, shared_ids_ptr=norm)  # (read in the self case only)
    if ref is None:
        # the self case runs in label order: a tile beside its row block's positive range holds negatives
        # only and takes its weights without labels (LABEL_ORDER); the gradient's rows go back at the end
        # (the forward's, from stats: no sort)
        order, a_labels = saved_label_order(stats, num_x)
        label_order["range_ptr"] = _block_ranges(a_labels, range_tiles["BLOCK_M"] if chunk_bytes else config["BLOCK_M"])
        a = a.index_select(0, order) if rows_in_label_order is None else rows_in_label_order
        stats = stats[:4].index_select(1, order)
        a_ids = order if a_ids is None else a_ids.index_select(0, order)  # (default ids: the row index)
        b, b_labels, b_ids = a, a_labels, a_ids
        grad_loss = grad_loss.index_select(0, order) if grad_loss.stride(0) else grad_loss  # ("mean": expanded)
        if ids is not None:
            label_order["shared_ids_ptr"] = _shared_identities(a_ids, a_labels)
    label_order_flags = dict(LABEL_ORDER=ref is None, CHECK_IDS=ref is None and ids is not None)
    scale = torch.empty(num_x, dtype=torch.float32, device=x.device)
    anchor_scale = torch.empty_like(scale)
    column_lift = (torch.full((1,), LIFT_WITH_COLUMN_ANCHORS, dtype=torch.float32, device=x.device)
                   if copy else norm)  # (dref's one lift for the rows of all anchors' weights; else never read)
    block = 1024
    scales = Launch(_scales_kernel, (_cdiv(num_x, block),),
                    dict(grad_ptr=grad_loss, grad_stride=grad_loss.stride(0), grad_divisor=float(grad_divisor),
                         stats_ptr=stats, norm_ptr=norm, scale_ptr=scale, lift_ptr=anchor_scale,
                         column_lift_ptr=column_lift, num_anchors=num_x, alpha=alpha, beta=beta, base=base,
                         epsilon=epsilon, max_lift=TRIANGLE_LIFT if triangle else
                         LIFT_WITH_COLUMN_ANCHORS if ref is None else 2.0 ** 64),
                    dict(MINING=mining, SKIP_INCOMPLETE=skip_incomplete_anchors, COLUMN_LIFT=copy, HALF_LIFT=triangle,
                         UNIFORM=uniform, BLOCK=block),
                    4, 1)
    shared = dict(stats_ptr=stats, scale_ptr=scale, num_anchors=num_x, dim=dim, alpha=alpha, beta=beta, base=base,
                  epsilon=epsilon)
    if chunk_bytes:
        weights_args = dict(shared, a_ptr=a, b_ptr=b, a_labels_ptr=a_labels, a_ids_ptr=a_ids, b_labels_ptr=b_labels,
                            b_ids_ptr=b_ids, copy_scale_ptr=column_lift, **label_order)
        tiles = dict(tiles, MINING=mining, SKIP_INCOMPLETE=skip_incomplete_anchors, B_ANCHORS=ref is None,
                     BOTH_LIFTS=triangle, COPY=copy, **label_order_flags)
        grad_x, grad_ref, steps = _chunked_plan(x, a, b, rectangles, weights_args, tiles, range_tiles, norm,
                                                anchor_scale, column_lift, scales)
        if order is not None:
            steps.append(Reorder(torch.empty_like(grad_x), grad_x, order))
            grad_x = steps[-1].out
        return grad_x, grad_ref, steps
    grid_d = _cdiv(dim, config["BLOCK_D"])
    multiprocessors = multiprocessors or _multiprocessors(x.device, interpret)
    config.update(MINING=mining, SKIP_INCOMPLETE=skip_incomplete_anchors, **label_order_flags)

    def grad_launch(rows, rows_keys, cols, cols_keys, a_anchors, b_anchors):
        row_programs = _cdiv(rows.shape[0], config["BLOCK_M"])
        splits, cols_per_split = column_splits(row_programs * grid_d, cols.shape[0], config["BLOCK_N"],
                                               multiprocessors)
        out = torch.empty_like(rows, dtype=torch.float32 if float32 else None) if splits == 1 else \
            rows.new_empty((splits, *rows.shape), dtype=torch.float32)
        args = dict(a_ptr=rows, b_ptr=cols, a_labels_ptr=rows_keys[0], a_ids_ptr=rows_keys[1],
                    b_labels_ptr=cols_keys[0], b_ids_ptr=cols_keys[1], out_ptr=out, norm_ptr=norm,
                    row_scale_ptr=anchor_scale if a_anchors else column_lift,  # (a reference set's rows: one lift)
                    num_a=rows.shape[0], num_b=cols.shape[0], cols_per_split=cols_per_split,
                    out_rows_ptr=norm if order is None else order, **label_order, **shared)
        return out, Launch(_grad_kernel, (row_programs, grid_d, splits), args,
                           dict(config, A_ANCHORS=a_anchors, B_ANCHORS=b_anchors), warps, stages)

    if ref is None:  # row block I builds G_IJ + G_JI^T itself
        grad_x, launch = grad_launch(a, (a_labels, a_ids), a, (a_labels, a_ids), True, True)
        return grad_x, x.new_empty((0,)), [scales, launch]
    grad_x, launch_x = grad_launch(a, (a_labels, a_ids), b, (b_labels, b_ids), True, False)
    if not ref_grad:  # a memory bank: no gradient for it, and no launch
        return grad_x, x.new_empty((0,)), [scales, launch_x]
    grad_ref, launch_ref = grad_launch(b, (b_labels, b_ids), a, (a_labels, a_ids), False, True)
    return grad_x, grad_ref, [scales, launch_x, launch_ref]


def _chunk_rectangles(self_case, num_x, num_b, tiles, element_size, budget, triangle_rows):
    """The chunked backward's chunks, ((row_begin, row_end), (col_begin, col_end)) each, and whether
    they are the self case's triangle (`_chunked_plan`): its chunks when they are at least
    triangle_rows tall (and more than one), else chunks of whole rows."""
    if not self_case:
        columns = _chunks(num_b, tiles["BLOCK_N"], num_x, element_size, budget)
        return [((0, num_x), chunk) for chunk in columns], False
    chunks = _triangle_chunks(num_x, tiles["BLOCK_M"], element_size, budget)
    if len(chunks) > 1 and chunks[0][1] - chunks[0][0] >= triangle_rows:
        return [((begin, end), (begin, num_b)) for begin, end in chunks], True
    return [(rows, (0, num_b)) for rows in _chunks(num_x, tiles["BLOCK_M"], num_b, element_size, budget)], False


def _chunked_plan(x, a, b, rectangles, weights_args, tiles, range_tiles, norm, lift, column_lift, scales):
    """backward_plan's result for the chunked backward: _weights_kernel writes the lifted pair weights
    of a chunk (`_chunk_rectangles`) into a buffer, and `Product` multiplies them by cuBLAS, the
    buffers within the budget and reused by every chunk.
    Self case, the triangle (tiles["BOTH_LIFTS"]): H is symmetric (H_pq = H_qp), so chunk [r0, r1) of
    the anchor rows computes only its columns from r0 on (`_triangle_chunks`): dx[r0:r1] +=
    H[r0:r1, r0:] @ x[r0:], and the part right of its own square gives the later rows' share,
    dx[r1:] += H[r0:r1, r1:]^T @ x[r0:r1]. S costs half a GEMM-equivalent plus half of each chunk's
    square, where all columns would cost one; the products still one, but the second reads and
    writes all later rows of dx once per chunk, memory-bound for short chunks: so the triangle
    needs chunks of at least TRIANGLE_ROWS (tile_config). A weight enters a product from either side
    there, so H_pq is lifted by both ends' lifts, l_p l_q (`_scales_kernel`'s HALF_LIFT: about the
    square roots of the rows' own, at most TRIANGLE_LIFT), and both products take the rows of x
    divided by theirs (`Unlift`): (H L) (L^-1 x) row by row, unlifted by each output row's own. A
    single lift for all rows (the anchors' smallest) lost the precision of anchors whose
    grad_output is far below the largest; the two-sided lifts keep most of it, but at most 2^14
    together where whole rows lift a row up to 2^14 alone. Otherwise: chunks of whole rows, each
    writing its rows of dx once.
    Reference set: all anchors against chunks of its rows, dx summed over them in order; with a
    gradient (tiles["COPY"]), a second buffer holds the weights lifted by the reference rows' one
    lift (column_lift) and gives dref of the chunk's rows, so S is computed once for both.
    Every gradient row is summed in a fixed order: the same bits on every run."""
    tiles, warps, stages = _split(tiles)
    (num_x, dim), num_b, copy, triangle = a.shape, b.shape[0], tiles["COPY"], tiles["BOTH_LIFTS"]
    size = max([(row_end - row_begin) * _padded(col_end - col_begin)
                for (row_begin, row_end), (col_begin, col_end) in rectangles], default=0)
    buffer = a.new_empty(size)  # each chunk's weights a [rows, _padded(columns)] view of it
    copy_buffer = torch.empty_like(buffer) if copy else buffer  # (else never written: any pointer will do)
    grad_x = (torch.empty if rectangles else torch.zeros)(num_x, dim, dtype=torch.float32, device=a.device)
    grad_ref = b.new_empty(num_b, dim, dtype=torch.float32) if copy else x.new_empty((0,))
    unlift, unlift_ref = norm.new_empty(lift.shape[0], 1), norm.new_empty(1, 1)  # (by `Unlift`)
    steps = [scales, Unlift(unlift, norm, lift)]
    if triangle:  # the rows of x that enter both products, each divided by its lift
        a_unlifted = torch.empty_like(a)
        steps.append(_rows_launch(_unlifted_rows_kernel, a.shape, {}, t_ptr=a, lift_ptr=lift, y_ptr=a_unlifted))
    steps += [Unlift(unlift_ref, norm, column_lift)] if copy else []
    for chunk, ((row_begin, row_end), (col_begin, col_end)) in enumerate(rectangles):
        rows, cols = row_end - row_begin, col_end - col_begin
        # the range launch's row blocks must be the ranges' (the label-free tiles' weights in a range are wrong)
        assert not tiles["LABEL_ORDER"] or row_begin % range_tiles["BLOCK_M"] == 0
        w, w_copy = (t[:rows * _padded(cols)].view(rows, _padded(cols)) for t in (buffer, copy_buffer))
        grid = (_cdiv(cols, tiles["BLOCK_N"]), _cdiv(rows, tiles["BLOCK_M"]))
        args = dict(weights_args, row_scale_ptr=lift, w_ptr=w, copy_ptr=w_copy, w_stride=w.stride(0),
                    row_begin=row_begin, row_end=row_end, col_begin=col_begin, col_end=col_end)
        steps.append(Launch(_weights_kernel, grid, args, dict(tiles, RANGE_TILES=False, CHECK_IDS=False), warps,
                            stages))  # (identities: the range launch's)
        if tiles["LABEL_ORDER"]:  # the positive ranges' columns, classified, over the label-free tiles' weights
            range_config, range_warps, range_stages = _split(range_tiles)
            steps.append(Launch(_weights_kernel, (RANGE_PROGRAMS, _cdiv(rows, range_config["BLOCK_M"])), args,
                                dict(tiles, **range_config, RANGE_TILES=True), range_warps, range_stages))
        if triangle:
            steps.append(Product(w[:, :cols], a_unlifted[col_begin:], grad_x[row_begin:row_end],
                                 unlift[row_begin:row_end], accumulate=chunk > 0))
            if row_end < num_x:  # (the first chunk writes every row of dx, its own and the later ones; the rest add)
                steps.append(Product(w[:, rows:cols].T, a_unlifted[row_begin:row_end], grad_x[row_end:],
                                     unlift[row_end:], accumulate=chunk > 0))
            continue
        steps.append(Product(w[:, :cols], b[col_begin:col_end], grad_x[row_begin:row_end], unlift[row_begin:row_end],
                             accumulate=col_begin > 0))
        if copy:
            steps.append(Product(w_copy[:, :cols].T, a, grad_ref[col_begin:col_end], unlift_ref, accumulate=False))
    return grad_x, grad_ref, steps


def plan_cost(launches, num_x, num_ref, dim):
    """{"gemms": the launches' multiply-add work in GEMM-equivalents (one = 2 * num_x * num_ref * dim
    flops, a forward X @ R^T), "programs": {kernel: programs of its launch}}, counted from the launch
    plans themselves: grids, tile shapes, the K-steps of every S tile (padding included), each
    program's column range and, for the positive ranges, their actual lengths; a chunked backward's
    cuBLAS products (`Product`) at their shapes, its chunks' programs the fewest of any chunk."""
    flops, programs = 0, {}
    for launch in launches:
        if isinstance(launch, Product):
            flops += 2 * launch.w.shape[0] * launch.w.shape[1] * launch.b.shape[1]
            continue
        if not isinstance(launch, Launch) or "BLOCK_N" not in launch.constexprs:
            continue
        c, args, name = launch.constexprs, launch.args, launch.kernel.fn.__name__
        grid = launch.grid + (1,) * (3 - len(launch.grid))
        if "A_ANCHORS" in c:
            name += "[dx]" if c["A_ANCHORS"] else "[dref]"
        name += "[range]" if c.get("RANGE_TILES") else ""
        programs[name] = min(programs.get(name, grid[0] * grid[1] * grid[2]), grid[0] * grid[1] * grid[2])
        s_tile = 2 * c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"] * _cdiv(args["dim"], c["BLOCK_K"])
        per_tile = s_tile + (2 * c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_D"] if "BLOCK_D" in c else 0)
        if "col_order_ptr" in args:  # the positive ranges: their tiles, row block by row block
            lengths = (args["range_ptr"][:, 1] - args["range_ptr"][:, 0]).tolist()
            flops += per_tile * sum(_cdiv(n, c["BLOCK_N"]) for n in lengths)
            continue
        if c.get("RANGE_TILES"):  # the chunk's row blocks' positive ranges, within its columns
            blocks = args["range_ptr"][args["row_begin"] // c["BLOCK_M"]:][:grid[1]]
            lengths = (blocks[:, 1].clamp(max=args["col_end"]) - blocks[:, 0].clamp(min=args["col_begin"])).tolist()
            flops += s_tile * sum(_cdiv(max(n, 0), c["BLOCK_N"]) for n in lengths)
            continue
        if "w_ptr" in args:  # _weights_kernel: one tile a program
            flops += s_tile * grid[0] * grid[1]
            continue
        columns, per_split = args.get("num_ref", args.get("num_b")), args["cols_per_split"]
        tiles = sum(_cdiv(min(per_split, columns - start), c["BLOCK_N"]) for start in range(0, columns, per_split))
        flops += per_tile * tiles * grid[0] * (grid[1] if "BLOCK_D" in c else 1)
    return {"gemms": flops / max(2 * num_x * num_ref * dim, 1), "programs": programs}


def _rows_launch(kernel, shape, constexprs, **tensors):
    """A launch of one of the row kernels over a contiguous [rows, D] tensor: blocks of 2048 elements
    (at most 512 columns), 16 a thread (under 100 registers on sm_80 and sm_90)."""
    block_d = min(_pow2_at_least_16(shape[1]), 512)
    return Launch(kernel, (_cdiv(shape[0], 2048 // block_d),), dict(tensors, num_rows=shape[0], dim=shape[1]),
                  dict(constexprs, BLOCK_R=2048 // block_d, BLOCK_D=block_d), 4, 1)


def unit_rows_plan(t):
    """(y, the clamped norms, finite, launches): rows of a contiguous `t` scaled to unit L2 norm; finite
    (float32) 0 for each row of finite values, NaN for each other one."""
    y, norm, finite = torch.empty_like(t), *t.new_empty((2, t.shape[0]), dtype=torch.float32)
    return y, norm, finite, [_rows_launch(_unit_rows_kernel, t.shape,
                                          dict(WIDE_SUMS=squares_dtype(t.dtype) == torch.float64),
                                          t_ptr=t, y_ptr=y, norm_ptr=norm, finite_ptr=finite)]


def unit_rows_grad_plan(grad, y, norm, order=None, dtype=None):
    """(dt, launches): the gradient of unit_rows_plan's y (contiguous), from the first D columns of
    `grad` (rows of any float dtype; with `order`, row p of grad is row order[p] of y, read where it
    is, else copied to contiguous rows where they are not); dt in `dtype` (None: y's)."""
    if order is None:
        grad = grad[:, :y.shape[1]].contiguous()
    assert grad.stride(1) == 1, "the kernel reads grad's rows as contiguous"
    dt = torch.empty_like(y, dtype=dtype)
    return dt, [_rows_launch(_unit_rows_grad_kernel, y.shape, dict(ORDERED=order is not None), g_ptr=grad,
                             g_stride=grad.stride(0), y_ptr=y, norm_ptr=norm, dt_ptr=dt,
                             order_ptr=norm if order is None else order)]  # (unordered: never read)


def scaled_rows_plan(g, scale, dtype):
    """(y, launches): g (float32 rows, the columns contiguous) times `scale` (a one-element tensor of
    any float dtype on g's device), as torch.mul computes it in float32, rounded once into `dtype`
    (contiguous rows)."""
    assert g.dim() == 2 and g.stride(1) == 1 and scale.numel() == 1, "rows of contiguous columns, one scale"
    y = torch.empty(g.shape, dtype=dtype, device=g.device)
    return y, [_rows_launch(_scaled_rows_kernel, g.shape, {}, g_ptr=g, g_stride=g.stride(0), scale_ptr=scale,
                            y_ptr=y)]


def _run(plan, device, *args, **kwargs):
    """Runs the plan's launches under `device` (Triton launches on the current CUDA device and stream),
    the cuBLAS products (`Product`) with grad mode off (a backward under create_graph=True runs with
    it on, and its tensors may require a gradient) and autocast too (it would turn their float32
    products into 16-bit ones)."""
    *outputs, launches = plan(*args, **kwargs)
    with _on(device):
        if torch.is_grad_enabled() or torch.is_autocast_enabled(device.type):  # (entered only then: 10-20 us)
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                _launch(launches)
        else:
            _launch(launches)
    return tuple(outputs)


def _on(device):
    """A context that makes `device` the current CUDA device, where it is not already."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()  # (entering torch.cuda.device costs the host two device switches)
    return torch.cuda.device(device)


def _launch(launches):
    for launch in launches:
        if not isinstance(launch, Launch) or all(launch.grid):  # an empty grid has nothing to write
            launch()


# ---- the ops ----------------------------------------------------------------------------------
def _forward(x: torch.Tensor, labels: torch.Tensor, ids: Optional[torch.Tensor], ref: Optional[torch.Tensor],
             ref_labels: Optional[torch.Tensor], ref_ids: Optional[torch.Tensor], alpha: float, beta: float,
             base: float, epsilon: float, mining: bool,
             skip_incomplete_anchors: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # the public API's checks, again for direct calls of the op: a wrong length would read out of
    # bounds, a tensor on another device hand the kernel a foreign pointer
    _check_inputs(x, labels, ref, ref_labels, ids, ref_ids)
    return _run(forward_plan, x.device, x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base, epsilon, mining,
                skip_incomplete_anchors)


def _backward(grad_loss: torch.Tensor, stats: torch.Tensor, x: torch.Tensor, labels: torch.Tensor,
              ids: Optional[torch.Tensor], ref: Optional[torch.Tensor], ref_labels: Optional[torch.Tensor],
              ref_ids: Optional[torch.Tensor], alpha: float, beta: float, base: float, epsilon: float,
              mining: bool, skip_incomplete_anchors: bool,
              ref_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(x, labels, ref, ref_labels, ids, ref_ids)  # (a direct call of the op; see _forward)
    return _backward_of_checked_inputs(grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base,
                                       epsilon, mining, skip_incomplete_anchors, ref_grad)


def _backward_of_checked_inputs(grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base, epsilon,
                                mining, skip_incomplete_anchors, ref_grad=True, grad_divisor=1, float32=False,
                                rows_in_label_order=None):
    """The backward op's work, for inputs that were checked: the forward's (and the eager loss's,
    whose "mean" divides by grad_divisor, without normalisation; `float32`: see `_unpadded`;
    `rows_in_label_order`: see backward_plan)."""
    ref_grad = ref is not None and ref_grad
    grad_x, grad_ref = _run(backward_plan, x.device, grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids,
                            alpha, beta, base, epsilon, mining, skip_incomplete_anchors, ref_grad,
                            grad_divisor=grad_divisor, float32=float32, rows_in_label_order=rows_in_label_order)
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
    step (`Reorder`), and gives the order too (else None): the normalisation's backward reads the
    rows in that order (`unit_rows_grad_plan`), which saves the reordered copy and its cast."""
    grad_x, grad_ref, launches = backward_plan(*args, **kwargs)
    if launches and isinstance(launches[-1], Reorder):
        reorder = launches.pop()
        return reorder.grad, grad_ref, reorder.order, launches
    return grad_x, grad_ref, None, launches


class _UnitRows(torch.autograd.Function):
    """ms_loss_cuda.loss.unit_rows (F.normalize in the rows' own dtype) in one launch each way, for
    the triton backend's eager calls: torch's ops take four launches forward and ten backward, and
    pass over [B, D] (or a memory bank's [R, D]) several times more. No second derivative, as the
    fused loss has none: differentiating the gradient again raises."""

    @staticmethod
    def forward(ctx, t):
        y, norm, _ = _run(unit_rows_plan, t.device, t.contiguous())
        ctx.save_for_backward(t, y, norm)  # (t: what a second derivative would be taken against)
        return y

    @staticmethod
    def backward(ctx, grad):
        t, y, norm = ctx.saved_tensors
        (dt,) = _run(unit_rows_grad_plan, y.device, grad.contiguous(), y, norm)
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


class _EagerLoss(torch.autograd.Function):
    """multi_similarity_loss on the triton backend in eager calls, one autograd node from the embeddings
    to the loss: normalisation, the forward's launches, the reduction, the finiteness check and the
    cast, where the loss op and torch's ops made five nodes and more small ops (each is host time on
    a GPU, the most of an eager step: bench/host_time.py). "mean" and "sum" reach the scales kernel
    as one gradient for all anchors (backward_plan's grad_divisor: no ops to expand, cast and divide
    it, none for its norm), and the normalisation's backward is one launch an input.
    `gradients_now` ("mean" and "sum" under grad mode, an input taking a gradient): the forward also
    issues the backward's launches, for grad_output 1, and keeps their float32 gradients; the
    backward only multiplies them by grad_output. The GPU then runs the backward's kernels while the
    host is still returning from the forward and in the autograd engine, where it waited for them
    before (with the one-node loss, on an H200: a float16 step at B = 16384 from an idle GPU from
    3.78 to 2.99 ms, bench/results/gpu/). The gradient stays float32 until the backward scales it
    (in 16 bits a "mean" gradient's entries of about 1/B would go subnormal before a loss scaler
    lifts them). A forward whose gradient is never taken pays for it, as in Liger-Kernel's fused
    linear cross entropy. "none" takes its backward in the backward.
    Traced calls take the ops (`fused_forward`) instead. No second derivative: differentiating the
    gradient again raises, as for every fused backend."""

    @staticmethod
    def forward(ctx, x, ref, labels, ids, ref_labels, ref_ids, hyper_parameters, normalize, reduction, dtype,
                gradients_now):
        a, a_norm, a_finite = _run(unit_rows_plan, x.device, x.contiguous()) if normalize else (x, None, None)
        b, b_norm, b_finite = ref, None, None
        if normalize and ref is not None:
            b, b_norm, b_finite = _run(unit_rows_plan, x.device, ref.contiguous())
        losses, stats, rows_in_label_order = _run(forward_plan_keeping_rows, x.device, a, labels, ids, b, ref_labels,
                                                  ref_ids, *hyper_parameters)
        saved = (x, ref, a, a_norm, b, b_norm, labels, ids, ref_labels, ref_ids, stats)
        ctx.hyper_parameters, ctx.reduction, ctx.gradients_now = hyper_parameters, reduction, gradients_now
        if gradients_now:
            ones = _float32_one(x.device).expand(a.shape[0])
            ctx.save_for_backward(x, ref, *_EagerLoss.gradients(ctx, saved, ones, True, rows_in_label_order))
        else:
            ctx.save_for_backward(*saved)
        loss = reduce_losses(losses, reduction)
        if not normalize:
            return _nan_if_nonfinite(loss, x, ref).to(dtype)
        for finite in (a_finite, b_finite):  # (NaN from a row with a NaN or an infinity, as _nan_if_nonfinite)
            loss = loss if finite is None else torch.add(loss, finite.sum())
        return loss.to(dtype)

    @staticmethod
    def gradients(ctx, saved, grad_loss, float32=False, rows_in_label_order=None):
        """(dx, dref) of the loss for grad_loss ([B], or one value expanded), None where the input takes
        no gradient; in the inputs' dtypes, or `float32` (`rows_in_label_order`: see backward_plan)."""
        x, ref, a, a_norm, b, b_norm, labels, ids, ref_labels, ref_ids, stats = saved
        batch, ref_grad = a.shape[0], ref is not None and ctx.needs_input_grad[1]
        divisor = batch if ctx.reduction == "mean" and batch else 1
        args = (grad_loss, stats, a, labels, ids, b, ref_labels, ref_ids, *ctx.hyper_parameters, ref_grad)
        options = dict(grad_divisor=divisor, float32=float32, rows_in_label_order=rows_in_label_order)
        if a_norm is None:
            da, db = _backward_of_checked_inputs(*args, **options)
        else:  # then the normalisation's backward, from the loss's float32 gradients where they are
            da, db, order = _run(_backward_plan_in_label_order, x.device, *args, **options)
            dtype = torch.float32 if float32 else None
            da = _run(unit_rows_grad_plan, x.device, _summed(da), a, a_norm, order, dtype)[0] \
                if ctx.needs_input_grad[0] else None
            db = _run(unit_rows_grad_plan, x.device, _summed(db), b, b_norm, None, dtype)[0] if ref_grad else None
        return da if ctx.needs_input_grad[0] else None, db if ref_grad else None

    @staticmethod
    def backward(ctx, grad):
        if ctx.gradients_now:  # the forward's, for grad_output 1: scaled in float32, rounded once to the inputs' dtypes
            x, ref, da, db = ctx.saved_tensors
            da, db = (None if g is None else _run(scaled_rows_plan, t.device, g, grad.detach(), t.dtype)[0]
                      for g, t in ((da, x), (db, ref)))
        else:  # "none" (only it comes here: "mean" and "sum" with a gradient to take have theirs)
            saved = ctx.saved_tensors
            x, ref = saved[:2]
            da, db = _EagerLoss.gradients(ctx, saved, grad)
        return ops.first_derivative_only((x, ref), da, db) + (None,) * 9


def eager_loss(x, labels, ids, ref, ref_labels, ref_ids, hyper_parameters, normalize, reduction, dtype):
    """multi_similarity_loss's result (reduced, in `dtype`) through `_EagerLoss`, for inputs it checked and
    keys it ranked as for the ops (ms_loss_cuda/loss.py, _triton_keys)."""
    gradients_now = reduction != "none" and torch.is_grad_enabled() and (
        x.requires_grad or (ref is not None and ref.requires_grad))
    return _EagerLoss.apply(x, ref, labels, ids, ref_labels, ref_ids, tuple(hyper_parameters), normalize, reduction,
                            dtype, gradients_now)


# the ops (same schema, fakes and autograd as the C++ ops), and the differentiable forward the loss calls
triton_forward = torch.library.custom_op("ms_loss_cuda::triton_forward", _forward, mutates_args=())
triton_backward = torch.library.custom_op("ms_loss_cuda::triton_backward", _backward, mutates_args=())
fused_forward = ops.register_fused_op("ms_loss_cuda::triton_forward", "ms_loss_cuda::triton_backward", _forward,
                                      _backward_of_checked_inputs,
                                      saved_rows=lambda x, ref: SAVED_ROWS if ref is None else 0)
