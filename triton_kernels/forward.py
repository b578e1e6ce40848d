"""The forward's launch plan: the loss [B] and the statistics the backward reuses, in three launches.

`forward_plan` builds the operands (operands.py), the label order (self case) or the positive ranges
(reference set), the column splits, and the launches of forward_kernels.py: minpos_kernel over each
block's positive range, negatives_kernel over every column once, finish_kernel to combine them. The
statistics are [4, B] (minpos, maxneg, LP, LN), and in the self case [6, B]: two more rows hold the
label order, which the backward reads instead of sorting again.
"""
import torch

from . import launcher
from .forward_kernels import finish_kernel, minpos_kernel, negatives_kernel, symmetric_negatives_kernel
from .launcher import INTERPRETED, Launch, cdiv
from .operands import (SAVED_ROWS, check_beta, check_dtypes, check_ref_norms, column_splits, label_order,
                       plan_operands, positive_ranges, shared_identities, sortable)
from .row_kernels import label_order_kernel


def forward_plan(x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base, epsilon, mining,
                 skip_incomplete_anchors, interpret=INTERPRETED, multiprocessors=None, capability=None, ref_norms=None):
    """(loss [B], stats [4, B], launches that fill them): the hardest positive from each block's
    positive range, one pass over all columns (per column split) for the negatives, and one launch
    that combines the splits and sums the positives (`positive_ranges`). Self case: stats [6, B],
    the last two rows its label order for the backward (`label_order`, `saved_label_order`).
    `ref_norms`: float16 rows of `ref` as they are, compared as unit rows (operands.check_ref_norms)."""
    check_dtypes(x, ref)
    check_beta(beta)
    check_ref_norms(x, ref, ref_norms)
    a, b, a_labels, a_ids, b_labels, b_ids = plan_operands(x, labels, ids, ref, ref_labels, ref_ids)
    num_x, dim = a.shape
    loss = torch.empty(num_x, dtype=torch.float32, device=x.device)  # (finish_kernel writes every row)
    stats = torch.empty(4 + SAVED_ROWS * (ref is None), num_x, dtype=torch.float32, device=x.device)
    capability = capability or launcher.device_capability(x.device)
    config, warps, stages = launcher.split_config(launcher.tile_config("forward", a.dtype, dim, interpret, capability))
    # (NEGATIVES_TILES: the negatives pass's own BLOCK_N, warps, stages or RESIDENT_D, never its BLOCK_M, or
    # SYMMETRIC: the self case's symmetric_negatives_kernel, on square tiles of the row blocks, whatever BLOCK_N;
    # the shipped table gives it to float32 on sm_90)
    negatives_tiles = dict(config.pop("NEGATIVES_TILES", {}))
    assert "BLOCK_M" not in negatives_tiles, "the negatives kernel's row blocks are the forward's (their ranges)"
    row_programs = cdiv(num_x, config["BLOCK_M"])
    launches, labels_given = [], a_labels
    if ref is None:  # one sort of the labels, kept in stats for the backward; the rows in label order too
        in_order = label_order(a_labels, config["BLOCK_M"], stats[4:].view(torch.int32), a,
                               a_ids if ids is not None else None)
        a_labels, row_order, ranges, launches = in_order.ranks, in_order.order, in_order.ranges, [in_order.launch]
        b_labels, col_order, segment_end, column_shift = a_labels, row_order, None, None
    else:
        row_order, col_order, segment_end, column_shift, ranges = positive_ranges(a_labels, b_labels,
                                                                                  config["BLOCK_M"])
    multiprocessors = multiprocessors or launcher.device_multiprocessors(x.device, interpret)
    symmetric = negatives_tiles.pop("SYMMETRIC", False) and ref is None
    if symmetric:  # (within SYMMETRIC_PARTIALS_BYTES)
        parts, per_part, splits = symmetric_parts(row_programs, multiprocessors)
        symmetric = 3 * splits * num_x * 4 <= SYMMETRIC_PARTIALS_BYTES
    if not symmetric:
        splits, cols_per_split = column_splits(row_programs, b.shape[0], config["BLOCK_N"], multiprocessors)
    minpos = torch.empty(2, num_x, dtype=torch.float32, device=x.device)  # (and the positive ranges' maxneg)
    partials = torch.empty(3, splits, num_x, dtype=torch.float32, device=x.device)
    tensors = dict(x_ptr=a, ref_ptr=b, labels_ptr=a_labels, ids_ptr=a_ids, ref_labels_ptr=b_labels,
                   ref_ids_ptr=b_ids, ref_scale_ptr=minpos if ref_norms is None else ref_norms[1],
                   row_order_ptr=row_order, range_ptr=ranges, minpos_ptr=minpos, num_x=num_x,
                   dim=dim)  # (ref_scale_ptr: read with REF_SCALES only)
    config["REF_SCALES"] = ref_norms is not None
    negatives_config, negatives_warps, negatives_stages = launcher.split_config(
        {**config, "num_warps": warps, "num_stages": stages, "RESIDENT_D": 0, **negatives_tiles})
    segmented = segment_end is not None  # (unsegmented: the kernels never read the two, any pointer will do)
    positives = dict(col_order_ptr=col_order, segment_end_ptr=segment_end if segmented else col_order,
                     column_shift_ptr=column_shift if segmented else col_order)
    # Self case: the negatives kernel reads the anchors in label order (a copy, B x D) and skips each block's
    # positive range (negatives_kernel's SKIP_RANGE). A reference set keeps its order: no copy of a memory bank.
    skip_range, check_ids = ref is None, ref is None and ids is not None
    columns = dict(shared_ids_ptr=a_ids)  # (read with CHECK_IDS only: any pointer will do otherwise)
    if skip_range:
        columns["ref_ptr"] = in_order.rows
    if check_ids:  # (torch's ops, issued before the launches: the labels as given)
        columns.update(ref_ids_ptr=in_order.ids, shared_ids_ptr=shared_identities(a_ids, sortable(labels_given)))
    # The positive ranges take at most 64 columns a tile: about 130 columns in a P x M batch (two tiles
    # of 128 would be half empty), and finish_kernel's two sums spill on 128 x 128 tiles
    in_range = dict(config, BLOCK_N=min(config["BLOCK_N"], 64))
    if symmetric:
        assert not negatives_config["RESIDENT_D"] and "BLOCK_N" not in negatives_tiles, \
            "the symmetric pass reads its rows tile by tile, on square tiles of its row blocks"
        negatives = Launch(symmetric_negatives_kernel, (row_programs, parts),
                           dict(ordered_ptr=in_order.rows, order_ptr=row_order,
                                ordered_ids_ptr=in_order.ids if check_ids else row_order, range_ptr=ranges,
                                shared_ids_ptr=columns["shared_ids_ptr"], minpos_ptr=minpos, part_ptr=partials,
                                num_x=num_x, dim=dim, parts=parts, per_part=per_part, beta=beta, base=base,
                                epsilon=epsilon),
                           dict(MINING=mining, CHECK_IDS=check_ids, BLOCK=config["BLOCK_M"],
                                BLOCK_K=negatives_config["BLOCK_K"], PRECISION=config["PRECISION"]),
                           negatives_warps, negatives_stages)
    else:
        negatives = Launch(negatives_kernel, (row_programs, splits),
                           dict(tensors, **columns, part_ptr=partials, num_ref=b.shape[0], splits=splits,
                                cols_per_split=cols_per_split, beta=beta, base=base, epsilon=epsilon),
                           dict(negatives_config, MINING=mining, SKIP_RANGE=skip_range, CHECK_IDS=check_ids),
                           negatives_warps, negatives_stages)
    launches += [
        Launch(minpos_kernel, (row_programs,), dict(tensors, **positives), dict(in_range, SEGMENTED=segmented),
               warps, stages),
        negatives,
        Launch(finish_kernel, (row_programs,),
               dict(tensors, **positives, part_ptr=partials, stats_ptr=stats, loss_ptr=loss, splits=splits,
                    alpha=alpha, beta=beta, base=base, epsilon=epsilon),
               dict(in_range, MINING=mining, SKIP_INCOMPLETE=skip_incomplete_anchors, SEGMENTED=segmented,
                    SKIP_RANGE=skip_range), warps, stages),
    ]
    return loss, stats, launches


# The symmetric pass's partials (3 floats an anchor for each of its column tiles: B^2 / (2 BLOCK_M) x 12
# bytes) are at most this large; a larger batch takes negatives_kernel, whose partials are a few per anchor.
SYMMETRIC_PARTIALS_BYTES = 256 << 20


def symmetric_parts(row_blocks, multiprocessors):
    """(parts, distances per part, partial slots) of symmetric_negatives_kernel: each row block's
    distances 1 .. row_blocks // 2 are cut into parts of equal length, enough for two programs a
    multiprocessor where there are enough distances; the partials hold a slot per part (the rows'
    sums) and one per distance (the columns')."""
    half = row_blocks // 2
    wanted = min(cdiv(2 * multiprocessors, max(row_blocks, 1)), max(half, 1))
    parts = max(cdiv(half, max(half // wanted, 1)), 1)  # (at least `wanted`)
    per_part = max(cdiv(half, parts), 1)
    return parts, per_part, parts + half


def forward_plan_keeping_rows(*args, **kwargs):
    """forward_plan's (loss, stats), the self case's rows in label order that its negatives kernel reads
    (else None: a reference set keeps its order), and the launches: a backward issued right after
    reads them where it would gather them again."""
    loss, stats, launches = forward_plan(*args, **kwargs)
    rows = launches[0].args["ordered_ptr"] if launches and launches[0].kernel is label_order_kernel else None
    return loss, stats, rows, launches

