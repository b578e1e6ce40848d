"""The chunked backward's mirrored squares (weights_kernel's MIRROR), under the interpreter against the
float64 reference: in the self case, each chunk's tiles of its own square that lie right of their
rows' diagonal block are computed once and stored at both places, and those left of it are not
computed. Chunks of several row blocks, in whole rows and in the triangle, on the interpreter's
square tiles and on a GPU's (128 x 64 and 128 x 32 tiles, whose diagonal blocks span several column
tiles), with a partial last block, the caller's identities shared across labels, mining off, float32
as float16 pieces and every 16-bit dtype. A chunk of one row block has only diagonal tiles: the
parity suites' chunked target runs those."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import build_case, check_against_reference, make_batch
from targets import DEVICE, TOLERANCE, chunk_choices, gpu_tile_table, recorded_launches, triton_kernels

pytestmark = pytest.mark.skipif(triton_kernels is None or DEVICE != "cpu" or not triton_kernels.INTERPRETED,
                                reason="runs a GPU's tiles under the interpreter (on a GPU the parity suites do)")

BATCH, DIM = 300, 64  # (300 = 4 x 64 + 44 = 2 x 128 + 44: a partial last block in either table)


def _chunked(monkeypatch, form, capability, dtype, chunk_rows):
    """The chunked backward in `form` (whole rows or the triangle) on the interpreter's tiles (capability
    None) or a GPU's, its budget (MS_LOSS_TRITON_CHUNK_MB) the weights of chunks of `chunk_rows` rows;
    the plans' chunks, as chunk_choices records them."""
    if capability is not None:
        gpu_tile_table(monkeypatch, capability)
    chosen = chunk_choices(monkeypatch, triangle_rows=1 if form == "triangle" else 10 ** 9)
    columns = BATCH + (-BATCH % 16) if form == "triangle" else BATCH  # (the triangle's rows are padded)
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", f"{(chunk_rows + 0.5) * columns * dtype.itemsize / 2 ** 20:.6f}")
    return chosen


def _batch():
    """Classes close enough that mining keeps about 13% of the negatives (and 70% of the positives): the
    label-free tiles' weights matter."""
    return make_batch(BATCH, DIM, BATCH // 6, spread=1.25, seed=14)


# (form, GPU capability or None for the interpreter's table, dtype, chunk rows, case, reduction, mining)
CASES = [
    ("whole_rows", None, torch.float32, 128, "self", "none", True),
    ("whole_rows", None, torch.float16, BATCH, "ids", "mean", True),
    ("whole_rows", None, torch.bfloat16, 192, "self", "sum", False),
    ("triangle", None, torch.float32, 128, "self", "sum", True),
    ("triangle", None, torch.float16, 192, "self", "none", False),
    ("whole_rows", (9, 0), torch.float16, BATCH, "ids", "none", True),
    ("whole_rows", (8, 0), torch.float32, BATCH, "self", "mean", True),
    ("triangle", (9, 0), torch.float16, 256, "self", "mean", True),
    # (identities shared across labels: the range launch rewrites every column, over the mirrored weights)
    ("triangle", (9, 0), torch.float16, 256, "shared_ids", "sum", True),
    ("triangle", (9, 0), torch.float32, 256, "self", "none", True),
]


@pytest.mark.parametrize("form,capability,dtype,chunk_rows,case,reduction,mining", CASES)
def test_mirrored_squares_match_the_reference(monkeypatch, form, capability, dtype, chunk_rows, case, reduction,
                                              mining):
    chosen = _chunked(monkeypatch, form, capability, dtype, chunk_rows)
    launches = recorded_launches(monkeypatch)
    x, labels = _batch()
    kwargs = dict(embeddings=x, labels=labels)
    if case != "self":  # the caller's identities: distinct, or shared by rows of different labels
        kwargs["ids"] = torch.arange(BATCH) * 3 % (BATCH + 1) if case == "ids" else torch.arange(BATCH) % 97
    # 16-bit: unit rows as the dtype holds them (normalised by the loss, they would put some pairs within
    # their rounding of a mining threshold, where every backend and form departs from the reference);
    # float32: normalised by the loss, whose unit rows enter the products as float16 pieces
    unit = dtype != torch.float32
    if unit:
        kwargs["embeddings"] = F.normalize(kwargs["embeddings"], dim=1)
    kwargs["embeddings"] = kwargs["embeddings"].to(dtype)
    # (beta 10 and base 0.2: the negatives, most of them in label-free tiles, weigh as much as the positives)
    check_against_reference("triton", kwargs, dtype, reduction, device=DEVICE, rtol=TOLERANCE[dtype], mining=mining,
                            beta=10.0, base=0.2, normalize=not unit)
    (chunks, triangle), = chosen
    assert triangle == (form == "triangle") and any(end - begin >= 2 * 64 for (begin, end), _ in chunks), chunks
    weights = [launch.constexprs for launch in launches if launch.kernel.fn.__name__ == "weights_kernel"]
    assert any(c["MIRROR"] for c in weights) and all(c["SPLIT"] == (dtype == torch.float32) for c in weights)


def test_a_reference_set_and_non_dividing_tiles_are_not_mirrored(monkeypatch):
    """MIRROR only where each chunk's square is its own transpose: the self case, on tiles whose rows
    hold whole column tiles; and not on the table of the benchmark's triton-unmirrored."""
    from ms_loss_cuda.triton_kernels import backward, launcher

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from triton_internals import unmirrored_tiles

    def weights_launches(case, table):
        monkeypatch.setattr(launcher, "tile_config", table)
        kwargs = build_case(case, 256, 32, torch.float16)
        stats = launcher.run(triton_kernels.forward_plan, torch.device("cpu"), kwargs["embeddings"],
                             kwargs["labels"], None, kwargs.get("ref_embeddings"), kwargs.get("ref_labels"), None,
                             2.0, 50.0, 0.5, 0.1, True, False)[1]
        steps = backward.backward_plan(torch.ones(256), stats, kwargs["embeddings"], kwargs["labels"], None,
                                       kwargs.get("ref_embeddings"), kwargs.get("ref_labels"), None, 2.0, 50.0, 0.5,
                                       0.1, True, False, interpret=True)[-1]
        return [step.constexprs["MIRROR"] for step in steps
                if isinstance(step, launcher.Launch) and step.kernel.fn.__name__ == "weights_kernel"]

    shipped = launcher.tile_config
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "1")
    assert weights_launches("self", shipped) == [True, False]  # (the label-free tiles, then the range launch)
    assert set(weights_launches("ref", shipped)) == {False}
    narrow_rows = lambda kind, *args: dict(shipped(kind, *args), **({"BLOCK_M": 32} if kind == "weights" else {}))
    assert set(weights_launches("self", narrow_rows)) == {False}  # (32 rows over 64 columns)
    assert set(weights_launches("self", unmirrored_tiles(shipped))) == {False}


@pytest.mark.parametrize("form,capability,dtype", [("whole_rows", (9, 0), torch.float16),
                                                    ("triangle", None, torch.float16),
                                                    ("whole_rows", None, torch.float32),
                                                    ("triangle", (9, 0), torch.float32)])
def test_mirrored_weights_fill_their_chunk_and_nothing_past_it(monkeypatch, form, capability, dtype):
    """Each chunk's weights into a buffer of NaN followed by rows of NaN: every place of the chunk is
    written (the mirrored places too: the tiles left of the diagonal block write none), and nothing
    past it (a transposed tile's rows beyond the batch). float32 as float16 pieces: both halves."""
    from ms_loss_cuda.triton_kernels import backward, launcher

    chosen = _chunked(monkeypatch, form, capability, dtype, 128 if form == "triangle" else BATCH)
    x, labels = _batch()
    x = F.normalize(x, dim=1).to(dtype)
    hyper = (2.0, 10.0, 0.2, 0.1, True, False)
    device = torch.device("cpu")
    stats = launcher.run(triton_kernels.forward_plan, device, x, labels, None, None, None, None, *hyper)[1]
    *_, steps = backward.backward_plan(torch.ones(BATCH), stats, x, labels, None, None, None, None, *hyper,
                                       unit_rows=True)
    guarded = {}
    for i, step in enumerate(steps):
        if isinstance(step, launcher.Launch) and step.kernel.fn.__name__ == "weights_kernel":
            w, chunk = step.args["w_ptr"], (step.args["row_begin"], step.args["col_begin"])
            if chunk not in guarded:  # (the chunk's weights, which its range launch rewrites in part)
                guarded[chunk] = (torch.full((w.shape[0] + 16, w.shape[1]), float("nan"), dtype=w.dtype),
                                  step.args["col_end"] - step.args["col_begin"], step.constexprs)
            steps[i] = step._replace(args=dict(step.args, w_ptr=guarded[chunk][0][:w.shape[0]]))
    with torch.no_grad():
        launcher.issue(steps)
    (chunks, triangle), = chosen
    assert triangle == (form == "triangle") and len(guarded) == len(chunks)
    for buffer, cols, constexprs in guarded.values():
        assert constexprs["MIRROR"] and constexprs["SPLIT"] == (dtype == torch.float32)
        rows, half = buffer.shape[0] - 16, buffer.shape[1] // 2
        chunk = buffer[:rows, :cols] if not constexprs["SPLIT"] else torch.cat([buffer[:rows, :cols],
                                                                                 buffer[:rows, half:half + cols]], 1)
        assert not chunk.isnan().any(), f"{int(chunk.isnan().sum())} places of a chunk unwritten"
        assert buffer[rows:].isnan().all(), "written past the chunk's rows"
