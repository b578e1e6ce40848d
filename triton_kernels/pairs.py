"""The per-pair math and the tiles every Triton kernel of the loss is built from.

The per-pair math is the Triton twin of csrc/ms_math.h: which pairs are positives and negatives
(labels equal or not, equal identities skipped), the miner's sets (Similarity-P: a positive is kept
when S - epsilon < the anchor's hardest negative, a negative when S + epsilon > its hardest
positive), the shifts that keep each log(1 + sum exp) stable, and the pair weights dL_i/dS_ij of
the backward (General Pair Weighting). Every similarity, exponent and sum is float32.

A tile is a [BLOCK_M, BLOCK_N] block of S = a @ b^T for some anchor rows and some columns, built by
`tl.dot` over K steps of the padded rows (tensor cores for 16-bit rows, float32 accumulation). The
anchors of a program are a block of the label order (`ordered_rows`), and the columns either a
contiguous split (`column_range`) or slots of the block's positive list (`positive_range_tile`:
the columns of exactly the block's labels, see operands.positive_ranges).

The kernels read no global constants (their infinities and logs are literals): Triton compares each
global a kernel reads with its value at compile time, on every launch.
"""
import triton
import triton.language as tl


# ---- per-pair math ----------------------------------------------------------------------------
@triton.jit
def pair_classes(label_i, id_i, label_j, id_j, col_ok):
    """[M, N] positive / negative pairs of rows i and columns j; equal identities are skipped."""
    same = label_i[:, None] == label_j[None, :]
    kept = (id_i[:, None] != id_j[None, :]) & col_ok[None, :]
    return same & kept, (same == 0) & kept


@triton.jit
def mined_sets(s, positive, negative, minpos, maxneg, epsilon, MINING: tl.constexpr):
    """Similarity-P: a positive harder than the hardest negative by epsilon, and vice versa."""
    if MINING:
        positive = positive & (s - epsilon < maxneg)
        negative = negative & (s + epsilon > minpos)
    return positive, negative


@triton.jit
def mined_negatives(s, negative, minpos, epsilon, MINING: tl.constexpr):
    """(the similarities of the negatives, -inf elsewhere; of the mined ones, -inf elsewhere): one
    float32 tile carries both the value and the set, where a mask beside S would hold registers."""
    s = tl.where(negative, s, -float("inf"))
    if MINING:
        return s, tl.where(s + epsilon > minpos, s, -float("inf"))
    return s, s


@triton.jit
def set_flags(minpos, maxneg, epsilon, MINING: tl.constexpr):
    """Whether P_i and N_i are non-empty: decided by the anchor's hardest pairs alone."""
    has_positive = minpos < float("inf")
    has_negative = maxneg > -float("inf")
    if MINING:
        has_positive = has_positive & (minpos - epsilon < maxneg)
        has_negative = has_negative & (maxneg + epsilon > minpos)
    return has_positive, has_negative


@triton.jit
def anchor_counts(minpos, maxneg, epsilon, MINING: tl.constexpr, SKIP_INCOMPLETE: tl.constexpr):
    """skip_incomplete_anchors: an anchor lacking either mined set contributes nothing."""
    has_positive, has_negative = set_flags(minpos, maxneg, epsilon, MINING)
    if SKIP_INCOMPLETE:
        return has_positive & has_negative
    return has_positive | True


@triton.jit
def shifts(minpos, maxneg, alpha, beta, base, epsilon, MINING: tl.constexpr):
    """m = max(0, largest exponent of the set): the largest exponent belongs to the hardest pair."""
    has_positive, has_negative = set_flags(minpos, maxneg, epsilon, MINING)
    shift_p = tl.where(has_positive, tl.maximum(-alpha * (minpos - base), 0.0), 0.0)
    shift_n = tl.where(has_negative, tl.maximum(beta * (maxneg - base), 0.0), 0.0)
    return shift_p, shift_n


@triton.jit
def pair_weights(s, positive, negative, lp, ln, alpha, beta, base):
    """dL_i/dS_ij (General Pair Weighting); 0 outside the mined sets. One exponential per pair: its
    class picks the exponent. (It keeps tl.exp: the base-2 form of `negative_weights` costs the
    classifying tiles more registers than it saves them. Its sets select the weight after the
    exponential: selecting the exponent instead, as `negative_weights` does, takes a tenth fewer
    instructions on sm_90 but spills the bank's weights tile, capped at 128 registers, on sm_100.)"""
    w = tl.exp(tl.where(positive, -alpha * (s - base) - lp, beta * (s - base) - ln))
    return tl.where(positive, -w, tl.where(negative, w, 0.0))


@triton.jit
def scaled_weights(s, positive, negative, minpos, maxneg, lp, ln, scale, alpha, beta, base, epsilon,
                   MINING: tl.constexpr):
    """scale x dL/dS of the anchors at one end of the pairs: their stats come as [M, 1] columns (row
    anchors) or [1, N] rows (column anchors)."""
    p, n = mined_sets(s, positive, negative, minpos, maxneg, epsilon, MINING)
    return scale * pair_weights(s, p, n, lp, ln, alpha, beta, base)


@triton.jit
def negative_offset(ln, beta, base):
    """An anchor's (LN + beta base) log2(e), for `negative_weights`."""
    return (ln + beta * base) * 1.4426950408889634  # log2(e)


@triton.jit
def negative_weights(s, minpos, offset, scale, beta, epsilon, MINING: tl.constexpr):
    """scale x dL/dS of pairs that are all negatives of their anchors (a label-free tile; S = -inf where a
    pair does not count; the anchors' terms as [M, 1] columns or [1, N] rows): exp(beta (S - base) - LN)
    in base 2, one FMA and one exp2 a pair (offset: `negative_offset`), where the negative is mined.
    Exponents are <= 0 there, as LN >= beta (maxneg - base) (`shifts`). Mining sets the exponent of a
    pair it drops to -inf, rather than the weight to 0 after the exponential: ptxas otherwise packs
    the mining tests into integers to hold them across it (a sixth more instructions in the self
    case's weights tile)."""
    exponent = s * (beta * 1.4426950408889634) - offset  # (log2(e))
    if MINING:
        exponent = tl.where(s + epsilon > minpos, exponent, -float("inf"))
    return scale * tl.exp2(exponent)


# ---- tiles ---------------------------------------------------------------------------------------
@triton.jit
def resident_rows(a_ptr, rows, row_ok, dim, RESIDENT_D: tl.constexpr):
    """a[rows] whole, [BLOCK_M, RESIDENT_D] (RESIDENT_D: a power of 2 at least dim; zero past dim), for a
    program that loads its rows once and keeps them for every column tile (`similarity_tile`'s
    a_rows), in shared memory (128 KiB for 128 rows of 512 in 16 bits): each tile then reads only its
    columns, 8 bytes a pair on 128 x 32 tiles at D = 512, where 128 x 128 tiles that read both read 16."""
    ks = tl.arange(0, RESIDENT_D)
    a = tl.load(a_ptr + rows[:, None].to(tl.int64) * dim + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < dim),
                other=0.0)
    return a


@triton.jit
def _resident_tile(a_rows, b_ptr, cols, col_ok, dim, RESIDENT_D: tl.constexpr, PRECISION: tl.constexpr):
    """similarity_tile's with the rows kept (`resident_rows`): one product over all of D."""
    tl.static_assert(PRECISION != "fp16x3", "resident rows take one product: not fp16x3's three")
    kd = tl.arange(0, RESIDENT_D)
    b_t = tl.load(b_ptr + cols[None, :].to(tl.int64) * dim + kd[:, None], mask=col_ok[None, :] & (kd[:, None] < dim),
                  other=0.0)
    return tl.dot(a_rows, b_t, input_precision=PRECISION)


@triton.jit
def float16_parts(v):
    """(hi, lo) float16 of float32 values v: hi = v rounded to float16, lo = (v - hi) * 2^11, so that v =
    hi + lo / 2^11 to about 2^-22 of |v| (the rest lo leaves out) for |v| up to float16's largest
    (65504) and down to about 2^-14, below which hi turns subnormal and the pair keeps less. Products
    of two such pairs, hi hi + (hi lo + lo hi) / 2^11, give a float32 product's accuracy on float16
    tensor cores (similarity_tile's "fp16x3", the chunked backward's split products)."""
    hi = v.to(tl.float16)
    return hi, ((v - hi.to(tl.float32)) * 2048.0).to(tl.float16)


@triton.jit
def store_float16_parts(at, values, rests_after, ok, TRANSPOSE: tl.constexpr = False):
    """Float32 values as float16 pieces (float16_parts): the high parts at `at`, the rests `rests_after`
    elements on (a buffer row's high parts, then its rests). TRANSPOSE: the pieces of values' transpose
    (`at` and `ok` shaped as it)."""
    hi, lo = float16_parts(values)
    if TRANSPOSE:
        hi, lo = tl.trans(hi), tl.trans(lo)
    tl.store(at, hi, mask=ok)
    tl.store(at + rests_after, lo, mask=ok)


@triton.jit
def similarity_tile(a_ptr, b_ptr, rows, row_ok, cols, col_ok, dim,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, a_rows=None, RESIDENT_D: tl.constexpr = 0):
    """float32 [BLOCK_M, BLOCK_N] tile of a[rows] @ b[cols]^T: any row and column indices (a block,
    or a gathered list), rows of both `dim` long; 64-bit offsets (B * D may pass 2^31).
    PRECISION: a float32 `tl.dot`'s ("tf32x3", "tf32", "ieee"), or "fp16x3", float32 rows of magnitude
    at most 1 (unit rows) as three float16 products: each operand split into its float16 value and the
    rest scaled by 2^11, hi hi + (hi lo + lo hi) / 2^11, which leaves out lo lo (2^-22 of the product).
    RESIDENT_D (not with "fp16x3"): the rows come loaded whole as `a_rows` (`resident_rows`), and the
    tile is one product over all of D."""
    if RESIDENT_D:
        s = _resident_tile(a_rows, b_ptr, cols, col_ok, dim, RESIDENT_D, PRECISION)
    else:
        s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        rest = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (fp16x3's cross terms; unused otherwise)
        for k in range(0, dim, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * dim + ks[None, :],
                        mask=row_ok[:, None] & (ks[None, :] < dim), other=0.0)
            b_t = tl.load(b_ptr + cols[None, :].to(tl.int64) * dim + ks[:, None],
                          mask=col_ok[None, :] & (ks[:, None] < dim), other=0.0)
            if PRECISION == "fp16x3":
                a_hi, a_lo = float16_parts(a)
                b_hi, b_lo = float16_parts(b_t)
                s = tl.dot(a_hi, b_hi, s)
                rest = tl.dot(a_hi, b_lo, rest)
                rest = tl.dot(a_lo, b_hi, rest)
            else:
                s = tl.dot(a, b_t, s, input_precision=PRECISION)
        if PRECISION == "fp16x3":
            s += rest * (1.0 / 2048.0)
    return s


@triton.jit
def load_keys(labels_ptr, ids_ptr, index, ok):
    return tl.load(labels_ptr + index, mask=ok, other=0), tl.load(ids_ptr + index, mask=ok, other=-1)


@triton.jit
def pair_tile(a_ptr, b_ptr, b_labels_ptr, b_ids_ptr, b_scale_ptr, rows, row_ok, label_i, id_i, cols, col_ok, dim,
              B_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PRECISION: tl.constexpr, a_rows=None, RESIDENT_D: tl.constexpr = 0):
    """(S, positive, negative) of the rows against the columns `cols` (valid where col_ok). B_SCALES:
    the rows of b come as they are (a float16 memory bank, never normalised whole), and S of their
    unit rows is a @ b^T times the reciprocals of their norms (b_scale_ptr), one multiply a pair.
    (A division here would cost a Hopper program about 40 registers more.) The keys are loaded before
    S, whose products hide their latency, but with B_SCALES after it: held across S beside the
    scales, they took the negatives kernel past 255 registers on sm_100. a_rows, RESIDENT_D: see
    similarity_tile."""
    if B_SCALES:
        s = similarity_tile(a_ptr, b_ptr, rows, row_ok, cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                            a_rows, RESIDENT_D)
        s = s * tl.load(b_scale_ptr + cols, mask=col_ok, other=1.0)[None, :]
        label_j, id_j = load_keys(b_labels_ptr, b_ids_ptr, cols, col_ok)
    else:
        label_j, id_j = load_keys(b_labels_ptr, b_ids_ptr, cols, col_ok)
        s = similarity_tile(a_ptr, b_ptr, rows, row_ok, cols, col_ok, dim, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                            a_rows, RESIDENT_D)
    positive, negative = pair_classes(label_i, id_i, label_j, id_j, col_ok)
    return s, positive, negative


@triton.jit
def ordered_rows(row_order_ptr, num_x, BLOCK_M: tl.constexpr):
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
def positive_range_tile(x_ptr, ref_ptr, ref_labels_ptr, ref_ids_ptr, ref_scale_ptr, col_order_ptr, segment_end_ptr,
                        column_shift_ptr, rows, row_ok, label_i, id_i, start, end, num_x, dim,
                        SEGMENTED: tl.constexpr, REF_SCALES: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """(S, positive, negative) of the rows against slots start .. start + BLOCK_N (before `end`) of
    their block's positive list (REF_SCALES: see pair_tile's B_SCALES)."""
    cols, col_ok = _positive_columns(col_order_ptr, segment_end_ptr, column_shift_ptr, start, end, num_x, BLOCK_M,
                                     BLOCK_N, SEGMENTED)
    return pair_tile(x_ptr, ref_ptr, ref_labels_ptr, ref_ids_ptr, ref_scale_ptr, rows, row_ok, label_i, id_i, cols,
                     col_ok, dim, REF_SCALES, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)


@triton.jit
def column_range(num_ref, cols_per_split, split_axis: tl.constexpr):
    """The columns of this program's split: [begin, end)."""
    begin = tl.program_id(split_axis) * cols_per_split
    return begin, tl.minimum(begin + cols_per_split, num_ref)


# ---- per-anchor statistics -----------------------------------------------------------------------
@triton.jit
def anchor_stats(stats_ptr, num_anchors, index, ok):
    """(minpos, maxneg, LP, LN) of the anchors `index` from stats [4, num_anchors]; an invalid one has
    empty sets."""
    minpos = tl.load(stats_ptr + index, mask=ok, other=float("inf"))
    maxneg = tl.load(stats_ptr + num_anchors + index, mask=ok, other=-float("inf"))
    lp = tl.load(stats_ptr + 2 * num_anchors + index, mask=ok, other=0.0)
    ln = tl.load(stats_ptr + 3 * num_anchors + index, mask=ok, other=0.0)
    return minpos, maxneg, lp, ln


@triton.jit
def anchor_terms(stats_ptr, scale_ptr, num_anchors, index, ok, epsilon,
                 MINING: tl.constexpr, SKIP_INCOMPLETE: tl.constexpr):
    """Stats of the anchors `index` and their gradient scale (0 where the anchor does not count)."""
    minpos, maxneg, lp, ln = anchor_stats(stats_ptr, num_anchors, index, ok)
    scale = tl.load(scale_ptr + index, mask=ok, other=0.0)
    scale = tl.where(anchor_counts(minpos, maxneg, epsilon, MINING, SKIP_INCOMPLETE), scale, 0.0)
    return minpos, maxneg, lp, ln, scale

