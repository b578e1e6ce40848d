"""The backward's kernels: pair weights recomputed from the forward's statistics, and their products.

The forward keeps four numbers per anchor (minpos, maxneg, LP, LN); the backward recomputes S tile by
tile and turns each pair into its weight H_ij = g_i dL_i/dS_ij (+ g_j dL_j/dS_ji in the self case,
where S is symmetric), then multiplies: dx = H r, dref = H^T x.
- `scales_kernel` (one launch first): each anchor's gradient scale g_i / max|g| and the lift of its
  row of weights, a power of 2 that brings the row's largest weight into (1/2, 1], so that weights
  enter the product in the input dtype without falling into float16's subnormals
  (`capped_lifts_kernel` then caps the chunked self case's rows).
- `grad_kernel`, the fused backward: program (row block I, D block, column split) recomputes S_IJ
  for its columns and accumulates H_IJ @ b_J in registers (self case: H_IJ = G_IJ + G_JI^T from the
  statistics at both ends, no atomics).
- `weights_kernel`, the chunked backward's first half: one tile of H, lifted, written in the input
  dtype (or, for float32 rows, as float16 pieces) to a buffer that cuBLAS then multiplies
  (backward_plan's `Product`).
In the self case both run in the forward's label order: a tile beside its row block's positive range
holds negatives only and takes its weights with one FMA and one exp2 a pair and end, no labels.
"""
import triton
import triton.language as tl

from .pairs import (anchor_counts, anchor_stats, anchor_terms, column_range, load_keys, negative_offset,
                    negative_weights, pair_classes, pair_tile, resident_rows, scaled_weights, set_flags,
                    similarity_tile, store_float16_parts)


@triton.jit
def scales_kernel(grad_ptr, grad_stride, grad_divisor, stats_ptr, norm_ptr, scale_ptr, lift_ptr, column_lift_ptr,
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
    largest lift. COLUMN_LIFT: also the smallest anchor lift (an atomic minimum into column_lift_ptr,
    which starts at 2^64: the same result in any order), the one lift of a reference set's rows, which
    hold every anchor's weights, and what capped_lifts_kernel caps the self case's rows by. HALF_LIFT (the
    self case's triangle, where each weight takes its row's and its column's lift: backward_plan): the
    power of 2 at or below the lift's square root, at most max_lift (backward_plan.TRIANGLE_LIFT)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < num_anchors
    if UNIFORM:
        g = tl.div_rn(tl.load(grad_ptr).to(tl.float32), grad_divisor)  # (rounded as torch's grad / B)
        norm = tl.maximum(tl.abs(g), 1e-30)
        if tl.program_id(0) == 0:
            tl.store(norm_ptr, norm)  # (for the launches after this one)
        scale = tl.where(ok, g / norm, 0.0)
    else:
        # (64-bit offsets: a direct call of the op may pass a strided grad_loss, B x stride past 2^31)
        g = tl.div_rn(tl.load(grad_ptr + i.to(tl.int64) * grad_stride, mask=ok, other=0.0).to(tl.float32),
                      grad_divisor)
        scale = g / tl.load(norm_ptr)
    minpos, maxneg, lp, ln = anchor_stats(stats_ptr, num_anchors, i, ok)
    has_positive, has_negative = set_flags(minpos, maxneg, epsilon, MINING)
    largest = tl.maximum(tl.where(has_positive, -alpha * (minpos - base) - lp, -float("inf")),
                         tl.where(has_negative, beta * (maxneg - base) - ln, -float("inf")))
    counted = tl.where(anchor_counts(minpos, maxneg, epsilon, MINING, SKIP_INCOMPLETE), tl.abs(scale), 0.0)
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
def capped_lifts_kernel(lift_ptr, least_lift_ptr, norm_ptr, unlift_ptr, num_rows, headroom, BLOCK: tl.constexpr):
    """The chunked self case's whole rows, after scales_kernel (COLUMN_LIFT, uncapped): each row's lift
    capped at `headroom` times the smallest anchor lift (least_lift_ptr), in place, and unlift = norm /
    lift. A row holds its column anchors' weights beside its own, each at most 1 / the smallest lift, so
    they stay below headroom; a batch whose weights are all small keeps them lifted towards 1, where a
    fixed cap would leave them in float16's subnormals."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < num_rows
    lift = tl.minimum(tl.load(lift_ptr + r, mask=ok, other=1.0), tl.load(least_lift_ptr) * headroom)
    tl.store(lift_ptr + r, lift, mask=ok)
    tl.store(unlift_ptr + r, tl.div_rn(tl.load(norm_ptr), lift), mask=ok)  # (as torch divides)


@triton.jit
def grad_kernel(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr, b_scale_ptr, product_ptr,
                stats_ptr, scale_ptr, norm_ptr, row_scale_ptr, range_ptr, shared_ids_ptr, out_rows_ptr, out_ptr,
                num_a, num_b, num_anchors, dim, cols_per_split, alpha, beta, base, epsilon,
                MINING: tl.constexpr, SKIP_INCOMPLETE: tl.constexpr,
                A_ANCHORS: tl.constexpr, B_ANCHORS: tl.constexpr, LABEL_ORDER: tl.constexpr, CHECK_IDS: tl.constexpr,
                B_SCALES: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                EARLY_COLUMN_TERMS: tl.constexpr, PRECISION: tl.constexpr):
    """out[split, rows, d-block] = sum over the split's J of H_IJ @ b_J[:, d-block], H_IJ = dL/dS_IJ
    (anchors on the rows of a when A_ANCHORS) + (dL/dS_JI)^T (anchors on the rows of b when B_ANCHORS).
    Row r of H enters the product times row_scale[r] (a power of 2, see scales_kernel) and leaves it
    divided by it. EARLY_COLUMN_TERMS: the column anchors' stats are loaded before S, not after, so
    that their latency hides behind its products (a register cost that sm_80 cannot pay without
    spilling).
    LABEL_ORDER (self case): a = b are the anchors in label order (`label_order`), so a tile outside
    the row block's positive range (range_ptr) holds negatives only, and takes its weights without
    labels (`negative_weights`), unless identities the caller gave are shared by rows of different
    labels (CHECK_IDS: the flag at shared_ids_ptr, `shared_identities`), where every tile classifies
    its pairs; row r of the result goes to row out_rows[r] of out, the caller's order. The product takes
    the rows at product_ptr: b's, or with B_SCALES (see pairs.pair_tile) the bank's unit rows."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_a
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    label_i, id_i = load_keys(a_labels_ptr, a_ids_ptr, rows, row_ok)
    if A_ANCHORS:
        minpos_i, maxneg_i, lp_i, ln_i, scale_i = anchor_terms(
            stats_ptr, scale_ptr, num_anchors, rows, row_ok, epsilon, MINING, SKIP_INCOMPLETE)
        offset_i = negative_offset(ln_i, beta, base)  # (once: in the loop it spilled 8 bytes)
        row_scale = tl.load(row_scale_ptr + rows, mask=row_ok, other=1.0)
    else:  # a reference set's rows: one lift for all (scales_kernel)
        row_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(row_scale_ptr)
    if LABEL_ORDER:
        range_begin = tl.load(range_ptr + 2 * tl.program_id(0)).to(tl.int32)
        range_end = tl.load(range_ptr + 2 * tl.program_id(0) + 1).to(tl.int32)
        # identities shared across labels (a flag, CHECK_IDS) leave no tile label-free: each compares them
        distinct_ids = tl.load(shared_ids_ptr) == 0 if CHECK_IDS else True
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    begin, end = column_range(num_b, cols_per_split, 2)
    for start in range(begin, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        if B_ANCHORS and EARLY_COLUMN_TERMS:  # loaded before S: their latency hides behind its products
            minpos_j, maxneg_j, lp_j, ln_j, scale_j = anchor_terms(
                stats_ptr, scale_ptr, num_anchors, cols, col_ok, epsilon, MINING, SKIP_INCOMPLETE)
        label_free = False
        if LABEL_ORDER:  # a tile beside the block's positive range: all its pairs are negatives
            s = similarity_tile(a_ptr, b_ptr, rows, row_ok, cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
            label_free = ((start + BLOCK_N <= range_begin) | (start >= range_end)) & distinct_ids
        else:  # (a reference set: the classes' keys loaded before S, as the measured kernel did)
            s, positive, negative = pair_tile(a_ptr, b_ptr, b_labels_ptr, b_ids_ptr, b_scale_ptr, rows, row_ok,
                                              label_i, id_i, cols, col_ok, dim, B_SCALES, BLOCK_M, BLOCK_N, BLOCK_K,
                                              PRECISION)
        if B_ANCHORS and not EARLY_COLUMN_TERMS:
            minpos_j, maxneg_j, lp_j, ln_j, scale_j = anchor_terms(
                stats_ptr, scale_ptr, num_anchors, cols, col_ok, epsilon, MINING, SKIP_INCOMPLETE)
        if label_free:  # (a constant False without LABEL_ORDER: the compiler drops the branch)
            # every tile masked, where a branch for the split's last tile would cost registers and spill
            s = tl.where(col_ok[None, :], s, -float("inf"))
            h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if A_ANCHORS:
                h += negative_weights(s, minpos_i[:, None], offset_i[:, None], scale_i[:, None], beta, epsilon,
                                      MINING)
            if B_ANCHORS:
                h += negative_weights(s, minpos_j[None, :], negative_offset(ln_j, beta, base)[None, :],
                                      scale_j[None, :], beta, epsilon, MINING)
        else:
            if LABEL_ORDER:
                label_j, id_j = load_keys(b_labels_ptr, b_ids_ptr, cols, col_ok)
                positive, negative = pair_classes(label_i, id_i, label_j, id_j, col_ok)
            h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if A_ANCHORS:
                h += scaled_weights(s, positive, negative, minpos_i[:, None], maxneg_i[:, None], lp_i[:, None],
                                    ln_i[:, None], scale_i[:, None], alpha, beta, base, epsilon, MINING)
            if B_ANCHORS:  # classes are symmetric; the column anchors' own stats decide their sets
                h += scaled_weights(s, positive, negative, minpos_j[None, :], maxneg_j[None, :], lp_j[None, :],
                                    ln_j[None, :], scale_j[None, :], alpha, beta, base, epsilon, MINING)
        b = tl.load(product_ptr + cols[:, None].to(tl.int64) * dim + ds[None, :],
                    mask=col_ok[:, None] & (ds[None, :] < dim), other=0.0)
        # (fp16x3 is the S tiles' alone: these weights are not unit rows)
        acc = tl.dot((h * row_scale[:, None]).to(b.dtype), b, acc,
                     input_precision="tf32x3" if PRECISION == "fp16x3" else PRECISION)
    acc = acc * (tl.load(norm_ptr) / row_scale)[:, None]
    out_ptr += tl.program_id(2).to(tl.int64) * num_a * dim
    if LABEL_ORDER:
        rows = tl.load(out_rows_ptr + rows, mask=row_ok, other=0)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * dim + ds[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (ds[None, :] < dim))


@triton.jit
def _weights_tile(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr, b_scale_ptr, stats_ptr, scale_ptr,
                  row_scale_ptr, w_ptr, copy_ptr, copy_scale_ptr, w_stride, rows, row_ok, row_begin, cols, col_ok,
                  col_begin, num_anchors, dim, alpha, beta, base, epsilon, MINING: tl.constexpr,
                  SKIP_INCOMPLETE: tl.constexpr, B_ANCHORS: tl.constexpr, BOTH_LIFTS: tl.constexpr, COPY: tl.constexpr,
                  LABEL_FREE: tl.constexpr, B_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                  a_rows=None, RESIDENT_D: tl.constexpr = 0, MIRROR: tl.constexpr = False, mirrored=False,
                  row_end=0):
    """weights_kernel's work on one tile: H of the rows against the columns, lifted, stored (a_rows,
    RESIDENT_D: pairs.similarity_tile's; SPLIT: weights_kernel's). With MIRROR, a tile that is
    `mirrored` also stores its transpose, H_qp = H_pq at the columns' rows q of the chunk (they end
    before row_end), each lifted as its row: by both ends' lifts (BOTH_LIFTS, the same values), else
    by the column's."""
    if LABEL_FREE:
        s = similarity_tile(a_ptr, b_ptr, rows, row_ok, cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                            a_rows, RESIDENT_D)
    else:
        label_i, id_i = load_keys(a_labels_ptr, a_ids_ptr, rows, row_ok)
        s, positive, negative = pair_tile(a_ptr, b_ptr, b_labels_ptr, b_ids_ptr, b_scale_ptr, rows, row_ok, label_i,
                                          id_i, cols, col_ok, dim, B_SCALES, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                                          a_rows, RESIDENT_D)
    minpos_i, maxneg_i, lp_i, ln_i, scale_i = anchor_terms(
        stats_ptr, scale_ptr, num_anchors, rows, row_ok, epsilon, MINING, SKIP_INCOMPLETE)
    if B_ANCHORS:
        minpos_j, maxneg_j, lp_j, ln_j, scale_j = anchor_terms(
            stats_ptr, scale_ptr, num_anchors, cols, col_ok, epsilon, MINING, SKIP_INCOMPLETE)
    if LABEL_FREE:
        h = negative_weights(s, minpos_i[:, None], negative_offset(ln_i, beta, base)[:, None], scale_i[:, None],
                             beta, epsilon, MINING)
        if B_ANCHORS:  # (always: the self case)
            h += negative_weights(s, minpos_j[None, :], negative_offset(ln_j, beta, base)[None, :],
                                  scale_j[None, :], beta, epsilon, MINING)
    else:
        h = scaled_weights(s, positive, negative, minpos_i[:, None], maxneg_i[:, None], lp_i[:, None],
                           ln_i[:, None], scale_i[:, None], alpha, beta, base, epsilon, MINING)
        if B_ANCHORS:
            h += scaled_weights(s, positive, negative, minpos_j[None, :], maxneg_j[None, :], lp_j[None, :],
                                ln_j[None, :], scale_j[None, :], alpha, beta, base, epsilon, MINING)
    offsets = (rows - row_begin)[:, None].to(tl.int64) * w_stride + (cols - col_begin)[None, :]
    # each row's lift, and with BOTH_LIFTS each column's too
    lift = tl.load(row_scale_ptr + rows, mask=row_ok, other=1.0)[:, None]
    if BOTH_LIFTS:
        lift = lift * tl.load(row_scale_ptr + cols, mask=col_ok, other=1.0)[None, :]
    if SPLIT:  # float16 pieces (pairs.float16_parts): a row's high parts, then its rests, each w_stride / 2 long
        ok = row_ok[:, None] & (cols - col_begin < w_stride // 2)[None, :]
        store_float16_parts(w_ptr + offsets, h * lift, w_stride // 2, ok)
        if COPY:
            store_float16_parts(copy_ptr + offsets, h * tl.load(copy_scale_ptr), w_stride // 2, ok)
    else:
        ok = row_ok[:, None] & (cols - col_begin < w_stride)[None, :]
        tl.store(w_ptr + offsets, (h * lift).to(w_ptr.dtype.element_ty), mask=ok)
        if COPY:
            tl.store(copy_ptr + offsets, (h * tl.load(copy_scale_ptr)).to(copy_ptr.dtype.element_ty), mask=ok)
    if MIRROR:
        if mirrored:  # (a branch: the tiles beside the diagonal and outside the square skip it)
            # (names of their own: a branch may not give a name another shape)
            mirror_lift = lift if BOTH_LIFTS else tl.load(row_scale_ptr + cols, mask=col_ok, other=1.0)[None, :]
            mirror_at = w_ptr + (cols - row_begin)[:, None].to(tl.int64) * w_stride + (rows - col_begin)[None, :]
            mirror_ok = (col_ok & (cols < row_end))[:, None] & row_ok[None, :]
            if SPLIT:
                store_float16_parts(mirror_at, h * mirror_lift, w_stride // 2, mirror_ok, True)
            else:
                tl.store(mirror_at, tl.trans((h * mirror_lift).to(w_ptr.dtype.element_ty)), mask=mirror_ok)


def mirrored_grid(rows, cols, row_offset, block_m, block_n):
    """The grid of weights_kernel's MIRROR launch for a chunk of `rows` rows and `cols` columns whose
    square starts `row_offset` columns in: one program a computed tile (`_unfolded`). Row block i
    (of n) computes every column block (c of them) but the i * block_m / block_n of the square left of
    its diagonal block, so row blocks i and n - 1 - i together compute w = 2 c - (n - 1) block_m /
    block_n tiles, and an odd n's middle block w / 2: n w / 2 in all."""
    row_blocks, column_blocks = -(-rows // block_m), -(-cols // block_n)
    assert row_offset % block_n == 0 and block_m % block_n == 0
    assert column_blocks >= row_offset // block_n + (row_blocks - 1) * block_m // block_n, "the square within the chunk"
    return (row_blocks * (2 * column_blocks - (row_blocks - 1) * (block_m // block_n)) // 2, 1)


@triton.jit
def _unfolded(row_begin, row_end, col_begin, col_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row block, column block) of a MIRROR program (`mirrored_grid`): the programs in runs of w, run r
    (from 0) row block r's column blocks, then those of row block n - 1 - r, each row block's without
    the square's blocks left of its diagonal block (an odd n's middle block: half a run, alone)."""
    ratio = BLOCK_M // BLOCK_N
    columns = tl.cdiv(col_end - col_begin, BLOCK_N)
    row_blocks = tl.cdiv(row_end - row_begin, BLOCK_M)
    run = 2 * columns - (row_blocks - 1) * ratio
    first, at = tl.program_id(0) // run, tl.program_id(0) % run
    count = columns - first * ratio  # (the column blocks row block `first` computes)
    second = at >= count
    row_block = tl.where(second, row_blocks - 1 - first, first)
    local = tl.where(second, at - count, at)
    square = (row_begin - col_begin) // BLOCK_N  # (the column blocks left of the square)
    return row_block, tl.where(local < square, local, local + row_block * ratio)


@triton.jit
def weights_kernel(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr, b_scale_ptr, stats_ptr, scale_ptr,
                   row_scale_ptr, range_ptr, shared_ids_ptr, w_ptr, copy_ptr, copy_scale_ptr, w_stride, row_begin,
                   row_end, col_begin, col_end, num_anchors, dim, alpha, beta, base, epsilon,
                   MINING: tl.constexpr, SKIP_INCOMPLETE: tl.constexpr, B_ANCHORS: tl.constexpr,
                   BOTH_LIFTS: tl.constexpr, COPY: tl.constexpr, LABEL_ORDER: tl.constexpr, CHECK_IDS: tl.constexpr,
                   RANGE_TILES: tl.constexpr, B_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, COLUMN_TILES: tl.constexpr,
                   RESIDENT_D: tl.constexpr, SPLIT: tl.constexpr, MIRROR: tl.constexpr):
    """The chunked backward's first half: one tile of H (as in grad_kernel; the rows of a are anchors, and so are
    b's when B_ANCHORS), lifted, written in the input dtype to w[rows - row_begin, cols - col_begin] for
    cuBLAS products (`Product`), the columns up to the buffer's padded row length w_stride. The lift: each
    row's (row_scale[rows]), and with BOTH_LIFTS each column's too (the self case's triangle, where a weight
    enters a product from either side: backward_plan). COPY (a reference set that takes a gradient): H times
    the reference rows' one lift (copy_scale) too, to copy_ptr at the same place, for dref. Grid: (column
    blocks, row blocks), one-dimensional with MIRROR; CUDA allows 65535 on the second axis, and
    backward_plan splits a chunk of more rows.
    LABEL_ORDER (self case, in label order): every pair is taken as a negative, with no labels (about two
    thirds of the instructions of a classifying tile); the columns of each row block's positive range,
    which hold its positives, are rewritten afterwards by a RANGE_TILES launch of smaller tiles, whose
    program (t, k) walks tiles t, t + RANGE_PROGRAMS, ... of row block k's range (range_ptr, for its
    BLOCK_M; row blocks counted from row 0, row_begin a whole number of them) within the chunk's columns
    and writes their weights classified. So the padding past col_end holds weights of zero-padded
    columns: cuBLAS never reads it. Outside RANGE_TILES a program takes COLUMN_TILES column tiles one
    after another (grid: blocks of BLOCK_N * COLUMN_TILES columns), with RESIDENT_D (not 0) on its rows
    loaded once and kept (pairs.resident_rows), so that each tile reads only its columns. SPLIT (float32
    rows): w (and copy) are float16, each buffer row the weights' high parts (pairs.float16_parts), then
    their rests: w_stride / 2 columns each, for products on float16 tensor cores with a float32 product's
    accuracy (backward_plan).
    MIRROR (self case; one tile a program, BLOCK_M a multiple of BLOCK_N, the chunk's rows starting on
    a row block): H is symmetric, so within the chunk's own square, the columns [row_begin, row_end),
    a tile wholly right of its rows' diagonal block is computed once for both places, storing its
    transpose too, and a tile wholly left of it is not computed: the square costs about half of its
    tiles. (A tile that meets the diagonal block is computed as it is; with BLOCK_M a multiple of
    BLOCK_N the pairs of a tile left of it are exactly the transposes of pairs in tiles right of it.)
    Its grid is one-dimensional, a program for each computed tile alone (`mirrored_grid`)."""
    row_block, column_block = tl.program_id(1), tl.program_id(0)
    if MIRROR:
        row_block, column_block = _unfolded(row_begin, row_end, col_begin, col_end, BLOCK_M, BLOCK_N)
    rows = row_begin + row_block * BLOCK_M + tl.arange(0, BLOCK_M)
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
            _weights_tile(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr, b_scale_ptr, stats_ptr,
                          scale_ptr, row_scale_ptr, w_ptr, copy_ptr, copy_scale_ptr, w_stride, rows, row_ok,
                          row_begin, cols, cols < col_end, col_begin, num_anchors, dim, alpha, beta, base, epsilon,
                          MINING, SKIP_INCOMPLETE, B_ANCHORS, BOTH_LIFTS, COPY, False, B_SCALES, BLOCK_M, BLOCK_N,
                          BLOCK_K, PRECISION, SPLIT)
    elif COLUMN_TILES == 1:  # (no loop for one tile: the shipped launches compile as they did before the loop)
        cols = col_begin + column_block * BLOCK_N + tl.arange(0, BLOCK_N)
        mirrored = False
        if MIRROR:  # the chunk's own square: right of the diagonal block, once for both places
            first_row, first_col = row_begin + row_block * BLOCK_M, col_begin + column_block * BLOCK_N
            mirrored = (first_col >= first_row + BLOCK_M) & (first_col < row_end)  # (columns from row_begin on)
        _weights_tile(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr, b_scale_ptr, stats_ptr,
                      scale_ptr, row_scale_ptr, w_ptr, copy_ptr, copy_scale_ptr, w_stride, rows, row_ok, row_begin,
                      cols, cols < col_end, col_begin, num_anchors, dim, alpha, beta, base, epsilon, MINING,
                      SKIP_INCOMPLETE, B_ANCHORS, BOTH_LIFTS, COPY, LABEL_ORDER, B_SCALES, BLOCK_M, BLOCK_N, BLOCK_K,
                      PRECISION, SPLIT, None, 0, MIRROR, mirrored, row_end)
    else:
        a_rows = None
        if RESIDENT_D:
            a_rows = resident_rows(a_ptr, rows, row_ok, dim, RESIDENT_D)
        first = col_begin + tl.program_id(0) * (BLOCK_N * COLUMN_TILES)
        for start in range(first, tl.minimum(first + BLOCK_N * COLUMN_TILES, col_end), BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            _weights_tile(a_ptr, b_ptr, a_labels_ptr, a_ids_ptr, b_labels_ptr, b_ids_ptr, b_scale_ptr, stats_ptr,
                          scale_ptr, row_scale_ptr, w_ptr, copy_ptr, copy_scale_ptr, w_stride, rows, row_ok,
                          row_begin, cols, cols < col_end, col_begin, num_anchors, dim, alpha, beta, base, epsilon,
                          MINING, SKIP_INCOMPLETE, B_ANCHORS, BOTH_LIFTS, COPY, LABEL_ORDER, B_SCALES, BLOCK_M,
                          BLOCK_N, BLOCK_K, PRECISION, SPLIT, a_rows, RESIDENT_D)

