"""The backward's launch plans: the fused backward, and the chunked one that hands its products to cuBLAS.

`backward_plan` recomputes S from the forward's statistics and turns it into the gradient, in one of
two forms (launcher.tile_config's CHUNK_BYTES, from $MS_LOSS_TRITON_CHUNK_MB):
- fused: `scales_kernel`, then `grad_kernel`, which accumulates H @ b in registers;
- chunked (a GPU's default): `scales_kernel`, then per chunk `weights_kernel` writes the lifted pair
  weights H of a block of rows (or columns) into a buffer within the budget, and `Product` multiplies
  it by cuBLAS with float32 sums. In the self case H is symmetric, so where chunks are tall enough a
  chunk takes only the columns from its first row on (the triangle), and the transposed product gives
  the later rows' share; within each chunk's own square the weights kernel computes the tiles right
  of the diagonal once for both places (MIRROR): about half of S.
The self case runs in the forward's label order (operands.saved_label_order) and puts the rows of
dx back in the caller's order at the end (`Reorder`). Every row of a gradient is summed in a fixed
order: the same bits on every run, where the chunks' products are too (cuBLAS's are, on one GPU,
unless streams share its workspace: torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG).
"""
from typing import NamedTuple, Optional

import torch

from . import launcher
from .backward_kernels import capped_lifts_kernel, grad_kernel, mirrored_grid, scales_kernel, weights_kernel
from .launcher import INTERPRETED, Launch, cdiv
from .operands import (block_ranges, check_beta, check_dtypes, check_ref_norms, column_splits, plan_operands,
                       saved_label_order, shared_identities)
from .row_kernels import divided_rows_kernel, rows_launch, split_rows_kernel


class Unlift(NamedTuple):
    """A step of the chunked backward, after scales_kernel: out = numerator / lift, row by row. With
    numerator norm, out [n, 1] takes the products of lifted weights back (`Product`): one lift per
    row, or one for all ([1, 1]). (The triangle's rows of x: `divided_rows_kernel`.)"""
    out: torch.Tensor
    numerator: torch.Tensor
    lift: torch.Tensor

    def __call__(self):
        torch.div(self.numerator, self.lift[:, None], out=self.out)


class Reorder(NamedTuple):
    """The chunked backward's last step in the self case, which runs in label order: out[order[r]] =
    grad[r], the gradient's rows in the caller's order (out None: a plan made with reorder=False, whose
    caller reads the rows in label order and drops this step)."""
    out: torch.Tensor
    grad: torch.Tensor
    order: torch.Tensor

    def __call__(self):
        self.out.index_put_((self.order,), self.grad)  # (int32 indices, which index_copy_ refuses)


class Product(NamedTuple):
    """A step of the chunked backward: out (float32) = (w @ b) * unlift by cuBLAS, or out += that; the
    rows of w come lifted (see scales_kernel) and `Unlift` or capped_lifts_kernel made their unlift.
    With w_lo and b_lo, w and b are float32 values as float16 pieces (pairs.float16_parts: w + w_lo / 2^11 and b + b_lo / 2^11),
    multiplied as w b + (w b_lo + w_lo b) / 2^11: three float16 products where one float32 product
    would run on CUDA cores, for each half of the rows in turn, so that its two float32 results at a
    time take what one of all rows takes."""
    w: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    unlift: torch.Tensor
    accumulate: bool
    w_lo: Optional[torch.Tensor] = None
    b_lo: Optional[torch.Tensor] = None

    def __call__(self):  # (under `run`'s no_grad and autocast off)
        if self.w.dtype == torch.float32:  # IEEE or TF32, as torch's float32 matmul precision says
            self.put(self.w @ self.b)
        elif self.w_lo is None:
            self.put(_float32_product(self.w, self.b))
        else:
            half = -(-self.w.shape[0] // 2)
            for rows in (slice(0, half), slice(half, None)):
                w, w_lo = self.w[rows], self.w_lo[rows]
                rest = _float32_product(w, self.b_lo)
                rest += _float32_product(w_lo, self.b)
                self.put(_float32_product(w, self.b).add_(rest, alpha=2.0 ** -11), rows)

    def put(self, product, rows=None):
        """out = product * unlift, or out += that (with `rows`, in those rows of out): the float32 result
        of w @ b (of those rows of w), however it was made."""
        out, unlift = self.out, self.unlift
        if rows is not None:
            out, unlift = out[rows], unlift if unlift.shape[0] == 1 else unlift[rows]
        if self.accumulate:
            out.addcmul_(product, unlift)
        else:
            torch.mul(product, unlift, out=out)


def _float32_product(w, b):
    """w @ b of 16-bit matrices with float32 sums and result: on a GPU one cuBLAS call on tensor cores
    (torch >= 2.8); on CPU tensors (the interpreter's tests) the same sums of the 16-bit values."""
    if w.is_cuda:
        return torch.mm(w, b, out_dtype=torch.float32)
    return w.float() @ b.float()


def _columns(w, first, last, split):
    """(weights, rests) of columns [first, last) of a chunk's buffer view w: w's own (rests None), or
    with `split` the float16 pieces of weights_kernel's SPLIT (each row its high parts, then its rests)."""
    if not split:
        return w[:, first:last], None
    half = w.shape[1] // 2
    return w[:, first:last], w[:, half + first:half + last]


# ---- chunks --------------------------------------------------------------------------------------
def even_chunks(total, block, other, element_size, budget):
    """[begin, end) chunks of `total` rows (or columns) of equal size, whole `block`s, as few as keep a
    weights buffer [chunk, other] within `budget` bytes (one block at the least)."""
    if total == 0:
        return []
    most = max(budget // max(other * element_size, 1) // block, 1) * block
    count = cdiv(total, most)
    size = cdiv(cdiv(total, count), block) * block
    return [(begin, min(begin + size, total)) for begin in range(0, total, size)]


def triangle_chunks(total, block, element_size, budget):
    """[begin, end) chunks of the self case's `total` anchor rows for the triangle, chunk [r0, r1)
    against the columns r0 ... total: each the most whole `block`s whose weights (rows padded to
    `_padded`) stay within `budget` bytes, one block at the least; later chunks, narrower, take more
    rows, and where the rest would leave a sliver the last two halve it, so that no launch is left
    with a few programs."""
    chunks, begin = [], 0
    while begin < total:
        width = total - begin
        rows = max(budget // (_padded(width) * element_size) // block, 1) * block
        if rows < width < 2 * rows:
            rows = cdiv(cdiv(width, 2), block) * block
        chunks.append((begin, min(begin + rows, total)))
        begin += rows
    return chunks


def _padded(columns):
    """A weights buffer's row length: a multiple of 16 elements (aligned rows for cuBLAS, and Triton's
    divisibility hint on w_stride: without it the weights kernel stores 2 bytes at a time)."""
    return columns + (-columns % 16)


# ---- the plans -----------------------------------------------------------------------------------
# the chunked backward's programs per row block for its positive range: the tiles of a P x M batch's
# range (about 70 columns for 64 rows: 2 or 3 tiles of 64) at once
RANGE_PROGRAMS = 4
MOST_GRID_Y = 65535  # CUDA's most blocks on a grid's second axis
# half a multiprocessor's 64K registers: a program's share where two must fit on one
TWO_PROGRAMS_REGISTERS = 65536 // 2
ANCHOR_BLOCK = 1024  # anchors a program of the per-anchor launches (scales_kernel, capped_lifts_kernel)
# the most a row holding other anchors' weights may be lifted: in the fused backward's self case, where
# each weight is at most 1, absolutely; in the chunked one's whole rows, times the smallest anchor lift
# (capped_lifts_kernel), which lifts the largest column weight to at most 1
LIFT_WITH_COLUMN_ANCHORS = 2.0 ** 14
# the most each end of a weight is lifted in the chunked triangle (a weight then stays <= 2^8; the
# rows of x are divided by it, and a larger one would push more of them below float16's normals)
TRIANGLE_LIFT = 2.0 ** 7
# cuBLAS returns each product's float32 result beside dx before it is added (torch takes float32 sums
# of 16-bit products into a new tensor only). The triangle's transposed products write every later
# row of dx, and a reference set's chunks every anchor's: one product would hold (B - r1) x D or B x D
# of them, 124 MiB at B = 65536, D = 512. So they go in pieces of rows whose result stays within an
# eighth of the budget, at least this many rows.
LEAST_PIECE_ROWS = 1024


def _spans(begin, end, most):
    """[begin, end) in consecutive (first, last + 1) spans of at most `most`."""
    return ((first, min(first + most, end)) for first in range(begin, end, most))


def _rows_piece(args, begin, end):
    """A weights launch's arguments for rows [begin, end) of its chunk (whose weights start at
    args["w_ptr"], row args["row_begin"])."""
    skip = begin - args["row_begin"]
    return dict(args, w_ptr=args["w_ptr"][skip:], copy_ptr=args["copy_ptr"][skip:], row_begin=begin, row_end=end)


def piece_rows(budget, dim):
    """The most rows of dx one product writes (see LEAST_PIECE_ROWS)."""
    return max(budget // (8 * 4 * dim), LEAST_PIECE_ROWS)


def backward_plan(grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base, epsilon,
                  mining, skip_incomplete_anchors, ref_grad=True, interpret=INTERPRETED, multiprocessors=None,
                  capability=None, grad_divisor=1, float32=False, rows_in_label_order=None, reorder=True,
                  ref_norms=None, unit_rows=False):
    """(grad_x, grad_ref or empty [0], launches that fill them) for the loss's gradient grad_loss /
    grad_divisor (the eager loss's "mean": grad_output expanded to [B], divided by B); no dref launch
    without ref_grad. The chunked backward's gradients are float32, the fused one's in the inputs'
    dtype, or float32 with `float32` (the eager loss's gradient for grad_output 1, which a 16-bit
    "mean" would leave subnormal). A gradient whose launch splits its columns comes as float32 partials
    [splits, rows, D], to be summed over the first axis. `rows_in_label_order`: the self case's rows
    in the forward's label order where the caller has them (the eager loss: its forward's copy,
    `forward_plan_keeping_rows`), else gathered here. `reorder` False: the self case's chunked dx is
    left in label order, its last step a `Reorder` without an output (B x D float32 values fewer),
    which gives the caller the order. `ref_norms`: float16 rows of a reference set that takes no
    gradient, as they are, compared as unit rows (operands.check_ref_norms): S as the forward computes
    it (the rows times the reciprocals of their norms, B_SCALES), so that both mine the same pairs up
    to the last bits of S, and the products take its unit rows, which the chunked backward makes a
    chunk at a time (`_chunked_plan`), the fused one whole. `unit_rows`: the rows of x and ref are unit
    rows (the eager loss's under `normalize`): float32 ones then enter the chunked backward's products as
    float16 pieces (`split_products`)."""
    check_dtypes(x, ref)
    check_beta(beta)
    check_ref_norms(x, ref, ref_norms)
    if ref_norms is not None and ref_grad:
        raise ValueError("a reference set compared through its norms (ref_norms) takes no gradient here")
    a, b, a_labels, a_ids, b_labels, b_ids = plan_operands(x, labels, ids, ref, ref_labels, ref_ids,
                                                           default_ids=ref is not None)
    num_x, dim = a.shape
    if grad_loss.shape != (num_x,):
        raise ValueError(f"grad_loss must have shape [{num_x}] to match x, got {tuple(grad_loss.shape)}")
    stats = stats.contiguous()
    # Pair weights enter the second product in the input dtype: scaled to |.| <= 1 (grad/B under
    # "mean" would be subnormal in float16) and then, row by row, back up towards 1 (scales_kernel).
    # One gradient for all anchors (an expanded one, as "mean" and "sum" give): its norm from scales_kernel.
    uniform = num_x > 0 and grad_loss.stride(0) == 0
    if uniform:
        norm = torch.empty(1, dtype=torch.float32, device=x.device)
    elif num_x:
        norm = torch.linalg.vector_norm(grad_loss.to(torch.float32), float("inf")).reshape(1)
        norm = (norm if grad_divisor == 1 else norm / grad_divisor).clamp_min_(1e-30)
    else:
        norm = torch.ones(1, dtype=torch.float32, device=x.device)
    capability = capability or launcher.device_capability(x.device)
    config, warps, stages = launcher.split_config(launcher.tile_config("backward", a.dtype, dim, interpret, capability))
    chunk_bytes = config.pop("CHUNK_BYTES")
    if a.dtype == torch.float16 and torch.backends.cuda.matmul.allow_fp16_accumulation:
        chunk_bytes = 0  # (cuBLAS refuses float32 results of float16 products then: the fused form instead)
    copy, triangle = ref is not None and ref_grad, False
    split = bool(chunk_bytes) and split_products(a.dtype, unit_rows)
    if chunk_bytes:
        # (a table may give the weights launches COLUMN_TILES and RESIDENT_D: weights_kernel; the shipped one does
        # not; it gives MIRROR)
        tiles = {"COLUMN_TILES": 1, "RESIDENT_D": 0, "MIRROR": False,
                 **launcher.tile_config("weights", a.dtype, dim, interpret, capability)}
        triangle_rows, range_tiles = tiles.pop("TRIANGLE_ROWS"), tiles.pop("RANGE_TILES")
        triangle_tiles = tiles.pop("TRIANGLE_TILES", {})
        rectangles, triangle = chunk_rectangles(ref is None, num_x, b.shape[0], tiles,
                                                a.element_size() * (1 + copy), chunk_bytes, triangle_rows,
                                                dim if ref_norms is not None or (split and ref is not None) else 0)
        if triangle and tiles["BLOCK_M"] % triangle_tiles.get("BLOCK_M", 1) == 0:  # (its chunks are whole blocks)
            tiles.update(triangle_tiles)
        # the self case: each chunk's own square at about half its tiles, where the tiles allow
        tiles["MIRROR"] = (ref is None and tiles["MIRROR"] and tiles["COLUMN_TILES"] == 1
                           and tiles["BLOCK_M"] % tiles["BLOCK_N"] == 0)
    order, label_order = None, dict(range_ptr=norm, shared_ids_ptr=norm)  # (read in the self case only)
    if ref is None:
        # the self case runs in label order: a tile beside its row block's positive range holds negatives
        # only and takes its weights without labels (LABEL_ORDER); the gradient's rows go back at the end
        # (the forward's, from stats: no sort)
        order, a_labels = saved_label_order(stats, num_x)
        label_order["range_ptr"] = block_ranges(a_labels, range_tiles["BLOCK_M"] if chunk_bytes else config["BLOCK_M"])
        a = a.index_select(0, order) if rows_in_label_order is None else rows_in_label_order
        stats = stats[:4].index_select(1, order)
        a_ids = order if a_ids is None else a_ids.index_select(0, order)  # (default ids: the row index)
        b, b_labels, b_ids = a, a_labels, a_ids
        grad_loss = grad_loss.index_select(0, order) if grad_loss.stride(0) else grad_loss  # ("mean": expanded)
        if ids is not None:
            label_order["shared_ids_ptr"] = shared_identities(a_ids, a_labels)
    label_order_flags = dict(LABEL_ORDER=ref is None, CHECK_IDS=ref is None and ids is not None)
    scale = torch.empty(num_x, dtype=torch.float32, device=x.device)
    anchor_scale = torch.empty_like(scale)
    # the chunked self case's whole rows: each lift capped relative to the smallest (capped_lifts_kernel)
    capped = bool(chunk_bytes) and ref is None and not triangle
    column_lift = (torch.full((1,), 2.0 ** 64, dtype=torch.float32, device=x.device)
                   if copy or capped else norm)  # (the smallest anchor lift, for dref or `capped`; else never read)
    scales = Launch(scales_kernel, (cdiv(num_x, ANCHOR_BLOCK),),
                    dict(grad_ptr=grad_loss, grad_stride=grad_loss.stride(0), grad_divisor=float(grad_divisor),
                         stats_ptr=stats, norm_ptr=norm, scale_ptr=scale, lift_ptr=anchor_scale,
                         column_lift_ptr=column_lift, num_anchors=num_x, alpha=alpha, beta=beta, base=base,
                         epsilon=epsilon, max_lift=TRIANGLE_LIFT if triangle else
                         LIFT_WITH_COLUMN_ANCHORS if ref is None and not capped else 2.0 ** 64),
                    dict(MINING=mining, SKIP_INCOMPLETE=skip_incomplete_anchors, COLUMN_LIFT=copy or capped,
                         HALF_LIFT=triangle,
                         UNIFORM=uniform, BLOCK=ANCHOR_BLOCK),
                    4, 1)
    shared = dict(stats_ptr=stats, scale_ptr=scale, num_anchors=num_x, dim=dim, alpha=alpha, beta=beta, base=base,
                  epsilon=epsilon)
    if chunk_bytes:
        weights_args = dict(shared, a_ptr=a, b_ptr=b, a_labels_ptr=a_labels, a_ids_ptr=a_ids, b_labels_ptr=b_labels,
                            b_ids_ptr=b_ids, copy_scale_ptr=column_lift, **label_order,
                            b_scale_ptr=norm if ref_norms is None else ref_norms[1])  # (read with B_SCALES only)
        tiles = dict(tiles, MINING=mining, SKIP_INCOMPLETE=skip_incomplete_anchors, B_ANCHORS=ref is None,
                     BOTH_LIFTS=triangle, COPY=copy, B_SCALES=ref_norms is not None, SPLIT=split, **label_order_flags)
        grad_x, grad_ref, steps = _chunked_plan(x, a, b, rectangles, weights_args, tiles, range_tiles, norm,
                                                anchor_scale, column_lift, scales, piece_rows(chunk_bytes, dim),
                                                ref_norms, capped)
        if order is not None:
            steps.append(Reorder(torch.empty_like(grad_x) if reorder else None, grad_x, order))
            grad_x = steps[-1].out if reorder else grad_x
        return grad_x, grad_ref, steps
    grid_d = cdiv(dim, config["BLOCK_D"])
    multiprocessors = multiprocessors or launcher.device_multiprocessors(x.device, interpret)
    config.update(MINING=mining, SKIP_INCOMPLETE=skip_incomplete_anchors, **label_order_flags)

    def grad_launch(rows, rows_keys, cols, cols_keys, a_anchors, b_anchors, product_rows=None, scales=None):
        row_programs = cdiv(rows.shape[0], config["BLOCK_M"])
        splits, cols_per_split = column_splits(row_programs * grid_d, cols.shape[0], config["BLOCK_N"],
                                               multiprocessors)
        out = torch.empty_like(rows, dtype=torch.float32 if float32 else None) if splits == 1 else \
            rows.new_empty((splits, *rows.shape), dtype=torch.float32)
        args = dict(a_ptr=rows, b_ptr=cols, product_ptr=cols if product_rows is None else product_rows,
                    b_scale_ptr=norm if scales is None else scales, a_labels_ptr=rows_keys[0], a_ids_ptr=rows_keys[1],
                    b_labels_ptr=cols_keys[0], b_ids_ptr=cols_keys[1], out_ptr=out, norm_ptr=norm,
                    row_scale_ptr=anchor_scale if a_anchors else column_lift,  # (a reference set's rows: one lift)
                    num_a=rows.shape[0], num_b=cols.shape[0], cols_per_split=cols_per_split,
                    out_rows_ptr=norm if order is None else order, **label_order, **shared)
        return out, Launch(grad_kernel, (row_programs, grid_d, splits), args,
                           dict(config, A_ANCHORS=a_anchors, B_ANCHORS=b_anchors, B_SCALES=scales is not None), warps,
                           stages)

    if ref is None:  # row block I builds G_IJ + G_JI^T itself
        grad_x, launch = grad_launch(a, (a_labels, a_ids), a, (a_labels, a_ids), True, True)
        return grad_x, x.new_empty((0,)), [scales, launch]
    steps, unit = [scales], None
    if ref_norms is not None:  # the bank's unit rows, whole, for the products (its S as the forward's)
        unit = torch.empty_like(b)
        steps.append(rows_launch(divided_rows_kernel, b.shape, {}, t_ptr=b, divisor_ptr=ref_norms[0], y_ptr=unit))
    grad_x, launch_x = grad_launch(a, (a_labels, a_ids), b, (b_labels, b_ids), True, False, unit,
                                   None if ref_norms is None else ref_norms[1])
    if not ref_grad:  # a memory bank: no gradient for it, and no launch
        return grad_x, x.new_empty((0,)), steps + [launch_x]
    grad_ref, launch_ref = grad_launch(b, (b_labels, b_ids), a, (a_labels, a_ids), False, True)
    return grad_x, grad_ref, steps + [launch_x, launch_ref]


def split_products(dtype, unit_rows):
    """Whether the chunked backward's products take float32 rows as float16 pieces (weights_kernel's
    SPLIT, split_rows_kernel, `Product`): under torch's float32 matmul precision "highest", where cuBLAS
    would multiply float32 on CUDA cores, for unit rows only (the pieces hold values up to float16's
    largest and keep a float32's precision down to about 2^-14; a unit row's weights are lifted into
    that range, and its values lie in it but for entries too small to matter at the row's scale). Not
    where torch lets float16 products accumulate in float16 (cuBLAS then refuses float32 results)."""
    return (dtype == torch.float32 and unit_rows and launcher.float32_precision() == "tf32x3"
            and not torch.backends.cuda.matmul.allow_fp16_accumulation)


def chunk_rectangles(self_case, num_x, num_b, tiles, element_size, budget, triangle_rows, column_rows=0):
    """The chunked backward's chunks, ((row_begin, row_end), (col_begin, col_end)) each, and whether
    they are the self case's triangle: its chunks when they are at least
    triangle_rows tall (and more than one), else chunks of whole rows. `column_rows`: the elements
    each column of a reference set's chunk also holds in the budget (a bank's unit rows, D)."""
    if not self_case:
        columns = even_chunks(num_b, tiles["BLOCK_N"], num_x + column_rows, element_size, budget)
        return [((0, num_x), chunk) for chunk in columns], False
    chunks = triangle_chunks(num_x, tiles["BLOCK_M"], element_size, budget)
    if len(chunks) > 1 and chunks[0][1] - chunks[0][0] >= triangle_rows:
        return [((begin, end), (begin, num_b)) for begin, end in chunks], True
    return [(rows, (0, num_b)) for rows in even_chunks(num_x, tiles["BLOCK_M"], num_b, element_size, budget)], False


def _chunked_plan(x, a, b, rectangles, weights_args, tiles, range_tiles, norm, lift, column_lift, scales, piece,
                  ref_norms, capped):
    """backward_plan's result for the chunked backward: weights_kernel writes the lifted pair weights
    of a chunk (`chunk_rectangles`) into a buffer, and `Product` multiplies them by cuBLAS, the
    buffers within the budget and reused by every chunk.
    Self case, the triangle (tiles["BOTH_LIFTS"]): H is symmetric (H_pq = H_qp), so chunk [r0, r1) of
    the anchor rows computes only its columns from r0 on (`triangle_chunks`): dx[r0:r1] +=
    H[r0:r1, r0:] @ x[r0:], and the part right of its own square gives the later rows' share,
    dx[r1:] += H[r0:r1, r1:]^T @ x[r0:r1], in pieces of at most `piece` rows (piece_rows). S costs
    half a GEMM-equivalent (each chunk's square mirrored: weights_kernel's MIRROR), where all
    columns would cost one; the products still one, but the second reads and writes all later rows
    of dx once per chunk, memory-bound for short chunks: so the triangle needs chunks of at least
    TRIANGLE_ROWS (tile_config). A weight enters a product from either side
    there, so H_pq is lifted by both ends' lifts, l_p l_q (`scales_kernel`'s HALF_LIFT: about the
    square roots of the rows' own, at most TRIANGLE_LIFT), and both products take the rows of x
    divided by theirs (`Unlift`): (H L) (L^-1 x) row by row, unlifted by each output row's own. So an
    anchor whose grad_output is far below the largest keeps its precision, up to lifts of 2^14 in
    all, where whole rows lift a row up to 2^14 times the smallest anchor lift alone. Otherwise:
    chunks of whole rows, each writing its rows of dx once.
    Reference set: all anchors against chunks of its rows, dx summed over them in order (each chunk's
    products, for dx and for dref, in pieces of at most `piece` rows, as their float32 results are
    temporaries); with a
    gradient (tiles["COPY"]), a second buffer holds the weights lifted by the reference rows' one
    lift (column_lift) and gives dref of the chunk's rows, so S is computed once for both. A memory bank
    compared through its norms (ref_norms, no gradient): the weights kernel scales S as the forward
    does (B_SCALES), and each chunk's product takes the chunk's unit rows, made just before it
    (divided_rows_kernel) into one buffer within the budget beside the weights: the bank's unit rows
    never exist whole (R x D, 256 MiB for 262,144 float16 rows of 512).
    `capped`: the self case's whole rows, whose lifts capped_lifts_kernel caps relative to the smallest
    one that `scales` took (backward_plan decides, as it makes that launch).
    Every gradient row is summed in a fixed order (the products' sums in cuBLAS's: see the module)."""
    tiles, warps, stages = launcher.split_config(tiles)
    (num_x, dim), num_b, copy, triangle = a.shape, b.shape[0], tiles["COPY"], tiles["BOTH_LIFTS"]
    split = tiles["SPLIT"]  # (float32 weights and rows as float16 pieces: each weight two halves, in its bytes)
    size = max([(row_end - row_begin) * _padded(col_end - col_begin)
                for (row_begin, row_end), (col_begin, col_end) in rectangles], default=0)
    # each chunk's weights a [rows, _padded(columns)] view of it ([rows, 2 _padded(columns)] split)
    buffer = a.new_empty(2 * size, dtype=torch.float16) if split else a.new_empty(size)
    copy_buffer = torch.empty_like(buffer) if copy else buffer  # (else never written: any pointer will do)
    grad_x = (torch.empty if rectangles else torch.zeros)(num_x, dim, dtype=torch.float32, device=a.device)
    grad_ref = b.new_empty(num_b, dim, dtype=torch.float32) if copy else x.new_empty((0,))
    unlift, unlift_ref = norm.new_empty(lift.shape[0], 1), norm.new_empty(1, 1)
    if capped:  # (the self case's whole rows: scales_kernel took the smallest lift, backward_plan)
        steps = [scales, Launch(capped_lifts_kernel, (cdiv(num_x, ANCHOR_BLOCK),),
                                dict(lift_ptr=lift, least_lift_ptr=column_lift, norm_ptr=norm, unlift_ptr=unlift,
                                     num_rows=num_x, headroom=LIFT_WITH_COLUMN_ANCHORS),
                                dict(BLOCK=ANCHOR_BLOCK), 4, 1)]
    else:
        steps = [scales, Unlift(unlift, norm, lift)]
    half = _padded(dim)

    def rows_for_products(t, divisor=None, out=None):
        """(rows, rests) of t for the products, made by a launch added to steps: t / divisor row by row
        (or t itself, rests None, where there is nothing to do), as float16 pieces where `split`."""
        if split:  # (each row: its high parts, then from column `half` on its rests, aligned for cuBLAS)
            out = t.new_empty(t.shape[0], 2 * half, dtype=torch.float16) if out is None else out[:t.shape[0]]
            steps.append(rows_launch(split_rows_kernel, t.shape, dict(DIVIDE=divisor is not None), t_ptr=t,
                                     divisor_ptr=norm if divisor is None else divisor, y_ptr=out, half=half))
            return out[:, :dim], out[:, half:half + dim]
        if divisor is None:
            return t, None
        out = torch.empty_like(t) if out is None else out[:t.shape[0]]
        steps.append(rows_launch(divided_rows_kernel, t.shape, {}, t_ptr=t, divisor_ptr=divisor, y_ptr=out))
        return out, None

    if triangle:  # the rows of x that enter both products, each divided by its lift
        a_unlifted = rows_for_products(a, lift)
    # the rows of x for the other products (the self case's whole rows, dref) and a chunk's rows of b
    a_rows = rows_for_products(a) if split and (copy or not triangle and b is a) else (a, None)
    widest = max([end - begin for _, (begin, end) in rectangles], default=0)
    chunk_rows = (b.new_empty(widest, dim) if ref_norms is not None else  # (a chunk's unit rows of the bank)
                  b.new_empty(widest, 2 * half, dtype=torch.float16) if split and b is not a else None)
    steps += [Unlift(unlift_ref, norm, column_lift)] if copy else []
    for chunk, ((row_begin, row_end), (col_begin, col_end)) in enumerate(rectangles):
        rows, cols = row_end - row_begin, col_end - col_begin
        # the range launch's row blocks must be the ranges' (the label-free tiles' weights in a range are wrong),
        # and a mirrored square's tiles left of the diagonal the transposes of those right of it
        assert not tiles["LABEL_ORDER"] or row_begin % range_tiles["BLOCK_M"] == 0
        assert not tiles["MIRROR"] or (row_begin - col_begin) % tiles["BLOCK_N"] == 0
        width = _padded(cols) * (1 + split)
        w, w_copy = (t[:rows * width].view(rows, width) for t in (buffer, copy_buffer))
        args = dict(weights_args, row_scale_ptr=lift, w_ptr=w, copy_ptr=w_copy, w_stride=w.stride(0),
                    row_begin=row_begin, row_end=row_end, col_begin=col_begin, col_end=col_end)
        # the row blocks on the grid's second axis, which CUDA caps at 65535: a chunk of more rows (a
        # reference set's chunks hold every anchor: from 8.4M anchors on) takes one launch per piece of them
        most_rows = MOST_GRID_Y * tiles["BLOCK_M"]
        for begin, end in _spans(row_begin, row_end, most_rows):
            part = _rows_piece(args, begin, end)
            # (identities: the range launch's; with a bank's scales, the registers capped where two programs
            # share a multiprocessor, which a Hopper program fits without spilling; 255 is PTX's most)
            grid = (mirrored_grid(end - begin, cols, begin - col_begin, tiles["BLOCK_M"], tiles["BLOCK_N"])
                    if tiles["MIRROR"] else
                    (cdiv(cols, tiles["BLOCK_N"] * tiles["COLUMN_TILES"]), cdiv(end - begin, tiles["BLOCK_M"])))
            steps.append(Launch(weights_kernel, grid,
                                part, dict(tiles, RANGE_TILES=False, CHECK_IDS=False), warps, stages,
                                min(TWO_PROGRAMS_REGISTERS // (32 * warps), 255) if tiles["B_SCALES"] else None))
        if tiles["LABEL_ORDER"]:  # the positive ranges' columns, classified, over the label-free tiles' weights
            range_config, range_warps, range_stages = launcher.split_config(range_tiles)
            # (the same cap on the grid's second axis, at the range launch's own row blocks)
            for begin, end in _spans(row_begin, row_end, MOST_GRID_Y * range_config["BLOCK_M"]):
                steps.append(Launch(weights_kernel, (RANGE_PROGRAMS, cdiv(end - begin, range_config["BLOCK_M"])),
                                    _rows_piece(args, begin, end),
                                    dict(tiles, **range_config, RANGE_TILES=True, COLUMN_TILES=1, RESIDENT_D=0,
                                         MIRROR=False),
                                    range_warps, range_stages))
        if triangle:
            w_rows, w_rests = _columns(w, 0, cols, split)
            steps.append(Product(w_rows, a_unlifted[0][col_begin:], grad_x[row_begin:row_end],
                                 unlift[row_begin:row_end], chunk > 0, w_rests, _rows(a_unlifted[1], col_begin)))
            # (the first chunk writes every row of dx, its own and the later ones; the rest add)
            for begin, end in _spans(row_end, num_x, piece):  # (w's column c: row col_begin + c)
                w_rows, w_rests = _columns(w, begin - col_begin, end - col_begin, split)
                steps.append(Product(w_rows.T, a_unlifted[0][row_begin:row_end], grad_x[begin:end],
                                     unlift[begin:end], chunk > 0, _transposed(w_rests),
                                     _rows(a_unlifted[1], row_begin, row_end)))
            continue
        columns = (b[col_begin:col_end], None) if b is not a else (a_rows[0][col_begin:col_end],
                                                                  _rows(a_rows[1], col_begin, col_end))
        if chunk_rows is not None:  # the chunk's rows made for its product: a bank's unit rows, or float16 pieces
            columns = rows_for_products(b[col_begin:col_end], None if ref_norms is None else
                                        ref_norms[0, col_begin:col_end], chunk_rows)
        for begin, end in _spans(row_begin, row_end, piece):  # (cuBLAS's float32 result of each within the budget)
            w_rows, w_rests = _columns(w[begin - row_begin:end - row_begin], 0, cols, split)
            steps.append(Product(w_rows, columns[0], grad_x[begin:end], unlift[begin:end], col_begin > 0, w_rests,
                                 columns[1]))
        for begin, end in _spans(0, cols if copy else 0, piece):  # (dref of the chunk's rows, in such pieces too)
            w_rows, w_rests = _columns(w_copy, begin, end, split)
            steps.append(Product(w_rows.T, a_rows[0], grad_ref[col_begin + begin:col_begin + end], unlift_ref,
                                 False, _transposed(w_rests), a_rows[1]))
    return grad_x, grad_ref, steps


def _rows(t, begin, end=None):
    """t[begin:end], or None for None (a Product's rests where there are none)."""
    return None if t is None else t[begin:end]


def _transposed(t):
    return None if t is None else t.T

