"""The forward's kernels: each anchor's hardest pairs and both log-sum-exps, in one pass over the columns.

The anchors are taken in label order, in blocks of BLOCK_M (operands.label_order, or
operands.positive_ranges for a reference set), so a block's positives lie in one short list of
columns, its positive range. Three launches fill the loss and the statistics [4, B] = (minpos,
maxneg, LP, LN) that the backward reuses:
- `minpos_kernel`: S over the block's positive range -> each anchor's hardest positive (and the
  hardest negative among those columns);
- `negatives_kernel`: S over all columns of the program's column split, once -> the hardest negative
  and, since the negatives' mining needs only minpos, the sum of exp over the mined negatives,
  rescaled online whenever a larger exponent appears. In the self case it reads the anchors in label
  order and skips the block's positive range, so every column it meets is a negative of the whole
  block and its tiles carry no labels. `symmetric_negatives_kernel` does the self case's pass on
  half the tiles, each summed for its rows and its columns (a tile-table option, which float32 on
  sm_90 takes: launcher.tile_config);
- `finish_kernel`: the column splits combined in a fixed order, then S over the positive range again
  for the sum over the mined positives (their mining needs the final maxneg) and, in the self case,
  the range's own negatives -> LP, LN and the loss.
Every sum runs in a fixed order: the same bits on every run.
"""
import triton
import triton.language as tl

from .pairs import (anchor_counts, column_range, load_keys, mined_negatives, ordered_rows, pair_tile,
                    positive_range_tile, resident_rows, set_flags, shifts, similarity_tile)


@triton.jit
def minpos_kernel(x_ptr, ref_ptr, labels_ptr, ids_ptr, ref_labels_ptr, ref_ids_ptr, ref_scale_ptr, row_order_ptr,
                  col_order_ptr, segment_end_ptr, column_shift_ptr, range_ptr, minpos_ptr, num_x, dim,
                  SEGMENTED: tl.constexpr, REF_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Each anchor's hardest positive, from the columns of its block's positive range alone, and the
    hardest negative among those columns: minpos [2, B]."""
    rows, row_ok = ordered_rows(row_order_ptr, num_x, BLOCK_M)
    label_i, id_i = load_keys(labels_ptr, ids_ptr, rows, row_ok)
    minpos = tl.full((BLOCK_M,), float("inf"), tl.float32)
    maxneg = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    range_end = tl.load(range_ptr + 2 * tl.program_id(0) + 1)
    for start in range(tl.load(range_ptr + 2 * tl.program_id(0)), range_end, BLOCK_N):
        s, positive, negative = positive_range_tile(
            x_ptr, ref_ptr, ref_labels_ptr, ref_ids_ptr, ref_scale_ptr, col_order_ptr, segment_end_ptr,
            column_shift_ptr, rows, row_ok, label_i, id_i, start, range_end, num_x, dim, SEGMENTED, REF_SCALES,
            BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        minpos = tl.minimum(minpos, tl.min(tl.where(positive, s, float("inf")), axis=1))
        maxneg = tl.maximum(maxneg, tl.max(tl.where(negative, s, -float("inf")), axis=1))
    tl.store(minpos_ptr + rows, minpos, mask=row_ok)
    tl.store(minpos_ptr + num_x + rows, maxneg, mask=row_ok)


@triton.jit
def _negative_sums(s, minpos, maxneg, shift, total, slope, offset, epsilon, MINING: tl.constexpr):
    """One tile's negatives added to the anchors' hardest negative and shifted sum (online: the sum is
    rescaled when the shift grows) for the anchors on the tile's rows. `s`: S, -inf outside the
    negatives; `minpos`, `maxneg`, `shift`, `total`: per anchor; slope, offset: beta log2(e) and
    beta base log2(e). Returns (maxneg, shift, total)."""
    tile_max = tl.max(s, axis=1)
    maxneg = tl.maximum(maxneg, tile_max)
    # the tile's largest mined S without a second reduction over the tile: mining keeps the negatives
    # above a threshold of the anchor, so it is the tile's hardest negative where that one is mined, else
    # there is none. The pairs' own test comes after the reduction, where its terms need it (tested
    # before, its predicates were packed into integers to be held across the reduction).
    if MINING:
        tile_max = tl.where(tile_max + epsilon > minpos, tile_max, -float("inf"))
    # base-2 exponents beta (S - base) log2(e), the shift folded in: one FMA and one exp2
    # (ex2.approx.ftz) a pair, where tl.exp takes a multiply and a fix-up for subnormals besides; terms
    # below 2^-126 of the shift flush to 0. (beta > 0: S = -inf outside the negatives adds nothing.)
    new_shift = tl.maximum(shift, tile_max * slope - offset)
    terms = tl.exp2(s * slope - (new_shift + offset)[:, None])
    if MINING:
        terms = tl.where(s + epsilon > minpos[:, None], terms, 0.0)
    return maxneg, new_shift, total * tl.exp2(shift - new_shift) + tl.sum(terms, axis=1)


@triton.jit
def negatives_kernel(x_ptr, ref_ptr, labels_ptr, ids_ptr, ref_labels_ptr, ref_ids_ptr, ref_scale_ptr, row_order_ptr,
                     range_ptr, shared_ids_ptr, minpos_ptr, part_ptr, num_x, num_ref, dim, splits, cols_per_split, beta,
                     base, epsilon,
                     MINING: tl.constexpr, SKIP_RANGE: tl.constexpr, CHECK_IDS: tl.constexpr, REF_SCALES: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr, RESIDENT_D: tl.constexpr):
    """The one pass over all columns (this program's split): the hardest negative, and the sum of
    exp(beta (S - base)) over the mined negatives (which need only minpos, known already), online:
    rescaled whenever a larger exponent appears. Partials [3, splits, B]: maxneg, shift, sum.
    SKIP_RANGE (self case): the columns are the anchors in label order (ref = x[col_order]) and the
    slots of this block's positive range are left out: the columns of the block's labels, whose
    negatives minpos_kernel and finish_kernel take. Every other column has a label that no anchor
    of the block has, so it is a negative of each of them, and the tile needs no labels (comparing
    them for each pair of a tile costs registers that keep a second program off the multiprocessor); only
    identities the caller gave can still make a pair of another label not count (CHECK_IDS,
    ref_ids in the columns' order), and only where one identity is shared by rows of different
    labels (shared_ids_ptr, a flag computed on the device: `shared_identities`), which a batch of
    distinct samples never has. Otherwise pairs are classified by their labels and identities.
    RESIDENT_D (not 0): the program's rows are loaded once, whole, and kept for every column tile
    (pairs.resident_rows), which then reads only its columns."""
    rows, row_ok = ordered_rows(row_order_ptr, num_x, BLOCK_M)
    a_rows = None
    if RESIDENT_D:
        a_rows = resident_rows(x_ptr, rows, row_ok, dim, RESIDENT_D)
    label_i, id_i = load_keys(labels_ptr, ids_ptr, rows, row_ok)
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
    begin, end = column_range(num_ref, cols_per_split, 1)
    for start in range(begin, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        if SKIP_RANGE:
            s = similarity_tile(x_ptr, ref_ptr, rows, row_ok, cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                                a_rows, RESIDENT_D)
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
            s, _, negative = pair_tile(x_ptr, ref_ptr, ref_labels_ptr, ref_ids_ptr, ref_scale_ptr, rows, row_ok,
                                       label_i, id_i, cols, col_ok, dim, REF_SCALES, BLOCK_M, BLOCK_N, BLOCK_K,
                                       PRECISION, a_rows, RESIDENT_D)
        s = tl.where(negative, s, -float("inf"))
        maxneg, shift, total = _negative_sums(s, minpos, maxneg, shift, total, slope, offset, epsilon, MINING)
    split = tl.program_id(1)
    tl.store(part_ptr + split * num_x + rows, maxneg, mask=row_ok)
    tl.store(part_ptr + (splits + split) * num_x + rows, shift * 0.6931471805599453, mask=row_ok)  # (ln(2): back to ln)
    tl.store(part_ptr + (2 * splits + split) * num_x + rows, total, mask=row_ok)


@triton.jit
def symmetric_negatives_kernel(ordered_ptr, order_ptr, ordered_ids_ptr, range_ptr, shared_ids_ptr, minpos_ptr, part_ptr,
                               num_x, dim, parts, per_part, beta, base, epsilon, MINING: tl.constexpr,
                               CHECK_IDS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                               PRECISION: tl.constexpr):
    """negatives_kernel's pass for the self case, on half the tiles: S is symmetric, so one tile of
    blocks I and J (of the label order, `ordered_ptr`) serves I's anchors through its rows and J's
    through its columns. Of the blocks' NB (NB - 1) / 2 pairs, program (I, p) takes those at distances
    d = I + 1 .. I + NB / 2 (mod NB; the pair at distance NB / 2 of an even NB once, from the lower
    block), part p of them. Its rows' maxneg and online sum stay in registers across its tiles and go
    to partial slot p; each tile's columns get one partial of their own, from that tile alone (its
    shift the tile's largest mined exponent of the column), in slot parts + d - 1. Partials [3, parts
    + NB // 2, B], as negatives_kernel's splits; finish_kernel combines them in slot order. A slot no
    tile reaches (an even NB's distance NB / 2 for the lower blocks) is written empty by program
    (I, 0). Each end skips its own block's positive range (the range's negatives are minpos_kernel's
    and finish_kernel's): the rows' range in the columns, the columns' range in the rows; the
    diagonal tile lies inside both ranges and is never computed."""
    block, part = tl.program_id(0), tl.program_id(1)
    blocks = (num_x + BLOCK - 1) // BLOCK
    half = blocks // 2
    last = tl.where((blocks % 2 == 1) | (block < half), half, half - 1)  # this block's farthest distance
    slots_i = block * BLOCK + tl.arange(0, BLOCK)
    row_ok = slots_i < num_x
    rows = tl.load(order_ptr + slots_i, mask=row_ok, other=0)  # (the anchors' own indices: stats, partials)
    minpos_i = tl.load(minpos_ptr + rows, mask=row_ok, other=float("inf"))
    skip_begin_i = tl.load(range_ptr + 2 * block)
    skip_end_i = tl.load(range_ptr + 2 * block + 1)
    maxneg = tl.full((BLOCK,), -float("inf"), tl.float32)
    shift = tl.zeros((BLOCK,), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    slope, offset = beta * 1.4426950408889634, beta * base * 1.4426950408889634  # (log2(e))
    if CHECK_IDS:
        ids_shared = tl.load(shared_ids_ptr) != 0
        id_i = tl.load(ordered_ids_ptr + slots_i, mask=row_ok, other=-1)
    first = 1 + part * per_part
    for d in range(first, tl.minimum(first + per_part, last + 1)):
        other = block + d
        other = tl.where(other >= blocks, other - blocks, other)
        start = other * BLOCK
        slots_j = start + tl.arange(0, BLOCK)
        col_ok = slots_j < num_x
        s = similarity_tile(ordered_ptr, ordered_ptr, slots_i, row_ok, slots_j, col_ok, dim, BLOCK, BLOCK, BLOCK_K,
                            PRECISION)
        if CHECK_IDS:
            if ids_shared:
                id_j = tl.load(ordered_ids_ptr + slots_j, mask=col_ok, other=-1)
                s = tl.where(id_i[:, None] != id_j[None, :], s, -float("inf"))
        # the rows' end: as negatives_kernel, only a tile past the last column or across the rows' range masks
        s_rows = s
        if (start + BLOCK > num_x) | ((start + BLOCK > skip_begin_i) & (start < skip_end_i)):
            s_rows = tl.where((col_ok & ((slots_j < skip_begin_i) | (slots_j >= skip_end_i)))[None, :], s,
                              -float("inf"))
        maxneg, shift, total = _negative_sums(s_rows, minpos_i, maxneg, shift, total, slope, offset, epsilon, MINING)
        # the columns' end: this tile alone, shifted by its own largest mined exponent of each column (or 0).
        # _negative_sums' steps along the other axis, written out so that the hardest negatives are stored
        # as soon as they are known
        skip_begin_j = tl.load(range_ptr + 2 * other)
        skip_end_j = tl.load(range_ptr + 2 * other + 1)
        s_cols = s
        if (block * BLOCK + BLOCK > num_x) | ((block * BLOCK + BLOCK > skip_begin_j) & (block * BLOCK < skip_end_j)):
            s_cols = tl.where((row_ok & ((slots_i < skip_begin_j) | (slots_i >= skip_end_j)))[:, None], s,
                              -float("inf"))
        cols = tl.load(order_ptr + slots_j, mask=col_ok, other=0)
        minpos_j = tl.load(minpos_ptr + cols, mask=col_ok, other=float("inf"))
        col_max = tl.max(s_cols, axis=0)
        slot = parts + d - 1  # (the hardest negatives stored at once: held to the end, they spill on sm_100)
        tl.store(part_ptr + slot * num_x + cols, col_max, mask=col_ok)
        mined_max = tl.where(col_max + epsilon > minpos_j, col_max, -float("inf")) if MINING else col_max
        col_shift = tl.maximum(mined_max * slope - offset, 0.0)
        col_terms = tl.exp2(s_cols * slope - (col_shift + offset)[None, :])
        if MINING:
            col_terms = tl.where(s_cols + epsilon > minpos_j[None, :], col_terms, 0.0)
        col_total = tl.sum(col_terms, axis=0)
        tl.store(part_ptr + (parts + half + slot) * num_x + cols, col_shift * 0.6931471805599453, mask=col_ok)
        tl.store(part_ptr + (2 * (parts + half) + slot) * num_x + cols, col_total, mask=col_ok)
    slots = parts + half  # (the partials' second dimension)
    tl.store(part_ptr + part * num_x + rows, maxneg, mask=row_ok)
    tl.store(part_ptr + (slots + part) * num_x + rows, shift * 0.6931471805599453, mask=row_ok)  # (ln(2))
    tl.store(part_ptr + (2 * slots + part) * num_x + rows, total, mask=row_ok)
    if (part == 0) & (blocks % 2 == 0) & (block < half):  # the slot of distance NB / 2, which no tile reaches
        empty = slots - 1
        tl.store(part_ptr + empty * num_x + rows, tl.full((BLOCK,), -float("inf"), tl.float32), mask=row_ok)
        tl.store(part_ptr + (slots + empty) * num_x + rows, tl.zeros((BLOCK,), tl.float32), mask=row_ok)
        tl.store(part_ptr + (2 * slots + empty) * num_x + rows, tl.zeros((BLOCK,), tl.float32), mask=row_ok)


@triton.jit
def finish_kernel(x_ptr, ref_ptr, labels_ptr, ids_ptr, ref_labels_ptr, ref_ids_ptr, ref_scale_ptr, row_order_ptr,
                  col_order_ptr, segment_end_ptr, column_shift_ptr, range_ptr, minpos_ptr, part_ptr, stats_ptr,
                  loss_ptr, num_x, dim, splits, alpha, beta, base, epsilon, MINING: tl.constexpr,
                  SKIP_INCOMPLETE: tl.constexpr, SEGMENTED: tl.constexpr, SKIP_RANGE: tl.constexpr,
                  REF_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    """The splits combined in their order (maxneg, LN), with the positive range's own negatives where
    the negatives kernel skipped it (SKIP_RANGE: their maxneg from minpos_kernel, their sum here);
    then the positive sum over the positive range (the positives' mining needs the final maxneg);
    stats [4, B] = (minpos, maxneg, LP, LN; +inf for an empty mined set), loss."""
    rows, row_ok = ordered_rows(row_order_ptr, num_x, BLOCK_M)
    label_i, id_i = load_keys(labels_ptr, ids_ptr, rows, row_ok)
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
    # the final shifts: the exponents of the hardest mined pairs (shifts), never below the splits'
    # shift but for the rounding of exponents recomputed from S, so the range's negatives are summed at
    # a fixed shift, as the positives are. No term exceeds 1 (exponent 0) but by that rounding, which
    # rows of large norm (normalize=False) make large enough to overflow the sums: it is cut off there
    shift_p, shift = shifts(minpos, maxneg, alpha, beta, base, epsilon, MINING)
    sum_n *= tl.exp(tl.minimum(shift_n - shift, 0.0))
    sum_p = tl.zeros((BLOCK_M,), tl.float32)
    range_end = tl.load(range_ptr + 2 * tl.program_id(0) + 1)
    for start in range(tl.load(range_ptr + 2 * tl.program_id(0)), range_end, BLOCK_N):
        s, positive, negative = positive_range_tile(
            x_ptr, ref_ptr, ref_labels_ptr, ref_ids_ptr, ref_scale_ptr, col_order_ptr, segment_end_ptr,
            column_shift_ptr, rows, row_ok, label_i, id_i, start, range_end, num_x, dim, SEGMENTED, REF_SCALES,
            BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        if SKIP_RANGE:
            unused_s, mined = mined_negatives(s, negative, minpos[:, None], epsilon, MINING)
            sum_n += tl.sum(tl.exp(tl.minimum(beta * (mined - base) - shift[:, None], 0.0)), axis=1)
        if MINING:
            positive = positive & (s - epsilon < maxneg[:, None])
        sum_p += tl.sum(tl.where(positive, tl.exp(tl.minimum(-alpha * (s - base) - shift_p[:, None], 0.0)), 0.0),
                        axis=1)
    # exp(-m) + sum is at least 1: m is 0, or the exponent of a pair of the set, whose term is 1 but for
    # the rounding of its exponent recomputed from S, which can send it to 0 at large norms
    lp = shift_p + tl.log(tl.maximum(tl.exp(-shift_p) + sum_p, 1.0))
    ln = shift + tl.log(tl.maximum(tl.exp(-shift) + sum_n, 1.0))
    counts = anchor_counts(minpos, maxneg, epsilon, MINING, SKIP_INCOMPLETE)
    tl.store(loss_ptr + rows, tl.where(counts, lp / alpha + ln / beta, 0.0), mask=row_ok)
    tl.store(stats_ptr + rows, minpos, mask=row_ok)
    tl.store(stats_ptr + num_x + rows, maxneg, mask=row_ok)
    # an empty mined set's LP or LN is stored as +inf, so that its weights in the backward are 0 whatever
    # its S: the backward's tiles sum S in another order, and a pair that crossed a threshold in the last
    # bits would otherwise get exp(beta (S - base)) times the largest lift
    has_positive, has_negative = set_flags(minpos, maxneg, epsilon, MINING)
    tl.store(stats_ptr + 2 * num_x + rows, tl.where(has_positive, lp, float("inf")), mask=row_ok)
    tl.store(stats_ptr + 3 * num_x + rows, tl.where(has_negative, ln, float("inf")), mask=row_ok)

