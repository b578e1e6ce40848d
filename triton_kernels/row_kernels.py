"""Row kernels (one pass over [rows, D]) and the label order's kernel, with their launch plans.

- `unit_rows_kernel` / `unit_rows_grad_kernel`: the normalisation of an eager triton call (F.normalize
  in the rows' own dtype, the norm in float32) and its backward, one launch each way; the forward
  also flags rows that hold a NaN or an infinity, so that the loss turns NaN without reading them
  again.
- `divided_rows_kernel`: rows divided by one number each: the triangle's rows of x by their lifts, a
  memory bank's rows by their norms (its unit rows for the backward's products).
- `split_rows_kernel`: float32 rows as float16 pieces, for the chunked backward's float32 products.
- `stored_rows_kernel`: CrossBatchMemory's store, rows with their labels and ids into the memory's
  slots, in one launch.
- `label_order_kernel`: everything the self case's label order needs after torch sorts the labels
  (operands.label_order): the stable order of all keys (rows of up to operands.ONE_KERNEL_SORT
  keys, each sorted by torch in one kernel, merged here by binary search), each key's rank, each
  block's positive range, and the label-ordered copies of the rows and identities.
"""
import torch
import triton
import triton.language as tl

from ..common import squares_dtype
from .launcher import Launch, cdiv, pow2_at_least_16
from .pairs import store_float16_parts


@triton.jit
def _row_block(t_ptr, rows, k, num_rows, dim, stride, BLOCK_D: tl.constexpr):
    """Columns k .. k + BLOCK_D of `rows` of a [num_rows, dim] tensor with rows `stride` elements apart,
    as float32 (0 outside)."""
    ks = k + tl.arange(0, BLOCK_D)
    at = rows[:, None].to(tl.int64) * stride + ks[None, :]
    ok = (rows < num_rows)[:, None] & (ks < dim)[None, :]
    return tl.load(t_ptr + at, mask=ok, other=0.0).to(tl.float32), at, ok


@triton.jit
def unit_rows_kernel(t_ptr, y_ptr, norm_ptr, finite_ptr, num_rows, dim, WIDE_SUMS: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """y = t / max(|t|, 1e-12) row by row, and that clamped norm (float32): ms_loss_cuda.common.unit_rows
    in one launch where torch's ops take four (the norm, its clamp and cast, the division). WIDE_SUMS (float32
    and bfloat16 rows): the squares summed in float64, as there (float32's overflow from 1.8e19 on).
    finite: 0 for a row of finite values, NaN for one with a NaN or an infinity (the sum of t * 0) or
    whose norm passes float32's range (its row would divide to zeros), which the eager loss adds to its
    result instead of reading t again. ROWS False: no rows, y holds the
    norms' reciprocals ([num_rows] float32: a memory bank whose tiles the kernels scale by them,
    pairs.pair_tile)."""
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
    norm = tl.maximum(norm, 1e-12, propagate_nan=tl.PropagateNan.ALL)  # (a NaN norm stays NaN, as in torch's clamp)
    finite += norm * 0.0  # (inf * 0: NaN)
    tl.store(norm_ptr + rows, norm, mask=rows < num_rows)
    tl.store(finite_ptr + rows, finite, mask=rows < num_rows)
    if ROWS:
        for k in range(0, dim, BLOCK_D):  # (the block's rows again, from L1/L2)
            t, at, ok = _row_block(t_ptr, rows, k, num_rows, dim, dim, BLOCK_D)
            tl.store(y_ptr + at, tl.div_rn(t, norm[:, None]).to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(y_ptr + rows, tl.div_rn(tl.full((BLOCK_R,), 1.0, tl.float32), norm), mask=rows < num_rows)


@triton.jit
def divided_rows_kernel(t_ptr, divisor_ptr, y_ptr, num_rows, dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """y = t / divisor row by row, in t's dtype, in one pass where torch's division of 16-bit rows by
    float32 numbers takes several. Divided by their norms, a bank's rows are unit_rows_kernel's, bit
    for bit. The triangle's rows of x for both of its products (see backward_plan) are divided by
    their lifts, powers of 2 up to backward_plan.TRIANGLE_LIFT: exact, but where float16 values fall
    below its normal range (|x| < 2^-7 at 2^7): unit rows hardly lose anything, rows of small norm do
    (bench/triangle_precision.py, bench/results/cpu/triangle-precision.txt)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    divisor = tl.load(divisor_ptr + rows, mask=rows < num_rows, other=1.0)
    for k in range(0, dim, BLOCK_D):
        t, at, ok = _row_block(t_ptr, rows, k, num_rows, dim, dim, BLOCK_D)
        tl.store(y_ptr + at, tl.div_rn(t, divisor[:, None]).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def split_rows_kernel(t_ptr, divisor_ptr, y_ptr, num_rows, dim, half, DIVIDE: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """Float32 rows t (with DIVIDE, divided by one number each, as divided_rows_kernel divides them) as
    float16 pieces (pairs.float16_parts): row r of y [num_rows, 2 half] holds the high parts, then from
    column `half` on (dim rounded up to 16: aligned for cuBLAS) the scaled rests. The chunked
    backward's products take them for float32 rows of x (see backward_plan)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if DIVIDE:
        divisor = tl.load(divisor_ptr + rows, mask=rows < num_rows, other=1.0)
    for k in range(0, dim, BLOCK_D):
        t, _, ok = _row_block(t_ptr, rows, k, num_rows, dim, dim, BLOCK_D)
        if DIVIDE:
            t = tl.div_rn(t, divisor[:, None])
        at = rows[:, None].to(tl.int64) * (2 * half) + k + tl.arange(0, BLOCK_D)[None, :]
        store_float16_parts(y_ptr + at, t, half, ok)


@triton.jit
def stored_rows_kernel(t_ptr, labels_ptr, ids_ptr, slots_ptr, y_ptr, y_labels_ptr, y_ids_ptr, num_rows, dim,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row r of t (contiguous [num_rows, dim], y's dtype) to row slots[r] of y, its label and id to slots[r]
    of y_labels and y_ids (in their dtype): CrossBatchMemory's store in one launch, where index_copy_
    takes one a buffer. The slots are distinct, so any order gives the same."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < num_rows
    slots = tl.load(slots_ptr + rows, mask=ok, other=0).to(tl.int64)
    tl.store(y_labels_ptr + slots, tl.load(labels_ptr + rows, mask=ok).to(y_labels_ptr.dtype.element_ty), mask=ok)
    tl.store(y_ids_ptr + slots, tl.load(ids_ptr + rows, mask=ok).to(y_ids_ptr.dtype.element_ty), mask=ok)
    for k in range(0, dim, BLOCK_D):
        ks = k + tl.arange(0, BLOCK_D)
        block_ok = ok[:, None] & (ks < dim)[None, :]
        values = tl.load(t_ptr + rows[:, None].to(tl.int64) * dim + ks[None, :], mask=block_ok)
        tl.store(y_ptr + slots[:, None] * dim + ks[None, :], values, mask=block_ok)  # (as they are: bit for bit)


@triton.jit
def _grad_block(g_ptr, g_stride, at_g, rows, k, num_rows, dim, ORDERED: tl.constexpr, BLOCK_D: tl.constexpr):
    """unit_rows_grad_kernel's block of g: rows at_g, g_stride apart (ORDERED), else the rows of y."""
    if ORDERED:
        g, _, _ = _row_block(g_ptr, at_g, k, num_rows, dim, g_stride, BLOCK_D)
    else:
        g, _, _ = _row_block(g_ptr, rows, k, num_rows, dim, dim, BLOCK_D)
    return g


@triton.jit
def unit_rows_grad_kernel(g_ptr, g_stride, y_ptr, norm_ptr, dt_ptr, order_ptr, num_rows, dim, ORDERED: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """dt = (g - y (g . y)) / |t| row by row (g / 1e-12 where the norm was clamped, as torch's): one
    launch where torch's ops (ms_loss_cuda.common.unit_rows's backward) take ten. g: of any float
    dtype, contiguous rows; ORDERED: row p of g (g_stride elements apart: the chunked backward's
    padded float32 rows, where it left them) belongs to row order[p] of y, norm and dt (the self
    case's label order). (Contiguous g shares y's offsets: a stride of its own would spill.)"""
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
def label_order_kernel(sorted_ptr, order_ptr, saved_ptr, ranks_ptr, range_ptr, rows_ptr, ordered_ptr, ids_ptr,
                       ordered_ids_ptr, num, segment, segments, steps, block_m, dim, ROWS: tl.constexpr,
                       IDS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """`label_order` after its sort, in one launch where torch's ops take six. The sort: `segments` rows
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


# ---- launch plans ------------------------------------------------------------------------------
def rows_launch(kernel, shape, constexprs, **tensors):
    """A launch of one of the row kernels over a contiguous [rows, D] tensor: blocks of 2048 elements
    (at most 512 columns), 16 a thread."""
    block_d = min(pow2_at_least_16(shape[1]), 512)
    return Launch(kernel, (cdiv(shape[0], 2048 // block_d),), dict(tensors, num_rows=shape[0], dim=shape[1]),
                  dict(constexprs, BLOCK_R=2048 // block_d, BLOCK_D=block_d), 4, 1)


def unit_rows_plan(t):
    """(y, the clamped norms, finite, launches): rows of a contiguous `t` scaled to unit L2 norm; finite
    (float32) 0 for each row of finite values, NaN for each other one."""
    y, norm, finite = torch.empty_like(t), *t.new_empty((2, t.shape[0]), dtype=torch.float32)
    return y, norm, finite, [_unit_rows_launch(t, y, norm, finite, True)]


def row_norms_plan(t):
    """(norms, finite, launches): unit_rows_plan's clamped norms of a contiguous `t`, without its rows:
    norms [2, rows] float32 (contiguous rows) holds them and their reciprocals; finite as there."""
    rows = t.shape[0]
    # one allocation: the norms, reciprocals and flags, each row 16-byte aligned (the kernels that read
    # them are compiled for aligned pointers)
    norms = t.new_empty((3, cdiv(rows, 4) * 4), dtype=torch.float32)[:, :rows]
    return norms[:2], norms[2], [_unit_rows_launch(t, norms[1], norms[0], norms[2], False)]


def _unit_rows_launch(t, y, norm, finite, rows):
    return rows_launch(unit_rows_kernel, t.shape, dict(WIDE_SUMS=squares_dtype(t.dtype) == torch.float64, ROWS=rows),
                       t_ptr=t, y_ptr=y, norm_ptr=norm, finite_ptr=finite)


def unit_rows_grad_plan(grad, y, norm, order=None, dtype=None):
    """(dt, launches): the gradient of unit_rows_plan's y (contiguous), from the first D columns of
    `grad` (rows of any float dtype; with `order`, row p of grad is row order[p] of y, read where it
    is, else copied to contiguous rows where they are not); dt in `dtype` (None: y's)."""
    if order is None:
        grad = grad[:, :y.shape[1]].contiguous()
    assert grad.stride(1) == 1, "the kernel reads grad's rows as contiguous"
    dt = torch.empty_like(y, dtype=dtype)
    return dt, [rows_launch(unit_rows_grad_kernel, y.shape, dict(ORDERED=order is not None), g_ptr=grad,
                            g_stride=grad.stride(0), y_ptr=y, norm_ptr=norm, dt_ptr=dt,
                            order_ptr=norm if order is None else order)]  # (unordered: never read)


def stored_rows_plan(t, labels, ids, slots, memory, memory_labels, memory_ids):
    """(memory, launches): `stored_rows_kernel`'s store of the rows of a contiguous `t` (the memory's dtype)
    with their labels and ids at `slots` (distinct) of the memory's contiguous buffers."""
    if t.dtype != memory.dtype or not all(x.is_contiguous() for x in (t, labels, ids, slots, memory, memory_labels,
                                                                       memory_ids)):
        raise ValueError("the store takes contiguous rows of the memory's dtype, keys and buffers")
    return memory, [rows_launch(stored_rows_kernel, t.shape, {}, t_ptr=t, labels_ptr=labels, ids_ptr=ids,
                                slots_ptr=slots, y_ptr=memory, y_labels_ptr=memory_labels, y_ids_ptr=memory_ids)]
