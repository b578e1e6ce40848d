"""The Triton plans' work, counted from the launch plans themselves (`plan_cost`, below): how
many GEMM-equivalents (one = 2 * B * R * D flops) a forward + backward does, and how many programs
each launch that walks every column has on a 132-multiprocessor H100, for the fused backward and
the chunked one. No GPU needed: the plans are made for CPU tensors with the GPU tile table
(interpret=False)."""
import os
import sys

import pytest
import torch
from conftest import label_order_by_torch

triton_kernels = pytest.importorskip("ms_loss_cuda.triton_kernels")
from ms_loss_cuda.triton_kernels import backward, launcher  # noqa: E402
from ms_loss_cuda.triton_kernels.backward import LEAST_PIECE_ROWS, Product, piece_rows  # noqa: E402
from ms_loss_cuda.triton_kernels.launcher import Launch, cdiv  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

H100 = 132
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float32-tf32": torch.float32}


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
        if not isinstance(launch, Launch):
            continue
        c, args, name = launch.constexprs, launch.args, launch.kernel.fn.__name__
        if name == "symmetric_negatives_kernel":  # square tiles; program (I, p) takes part p of distances 1 .. last
            c = dict(c, BLOCK_M=c["BLOCK"], BLOCK_N=c["BLOCK"])
        if "BLOCK_N" not in c:
            continue
        grid = launch.grid + (1,) * (3 - len(launch.grid))
        if "A_ANCHORS" in c:
            name += "[dx]" if c["A_ANCHORS"] else "[dref]"
        name += "[range]" if c.get("RANGE_TILES") else ""
        programs[name] = min(programs.get(name, grid[0] * grid[1] * grid[2]), grid[0] * grid[1] * grid[2])
        s_tile = 2 * c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"] * cdiv(args["dim"], c["BLOCK_K"])
        per_tile = s_tile + (2 * c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_D"] if "BLOCK_D" in c else 0)
        if "col_order_ptr" in args:  # the positive ranges: their tiles, row block by row block
            lengths = (args["range_ptr"][:, 1] - args["range_ptr"][:, 0]).tolist()
            flops += per_tile * sum(cdiv(n, c["BLOCK_N"]) for n in lengths)
            continue
        if c.get("RANGE_TILES"):  # the chunk's row blocks' positive ranges, within its columns
            blocks = args["range_ptr"][args["row_begin"] // c["BLOCK_M"]:][:grid[1]]
            lengths = (blocks[:, 1].clamp(max=args["col_end"]) - blocks[:, 0].clamp(min=args["col_begin"])).tolist()
            flops += s_tile * sum(cdiv(max(n, 0), c["BLOCK_N"]) for n in lengths)
            continue
        if "w_ptr" in args:  # weights_kernel: one tile a program, but those a mirrored square leaves out
            tiles = grid[0] * grid[1]
            if c["MIRROR"]:  # the chunk's tiles but those of its square wholly left of their rows' diagonal block
                row_blocks = cdiv(args["row_end"] - args["row_begin"], c["BLOCK_M"])
                first_rows = args["row_begin"] + c["BLOCK_M"] * torch.arange(row_blocks)[:, None]
                first_cols = args["col_begin"] + c["BLOCK_N"] * torch.arange(
                    cdiv(args["col_end"] - args["col_begin"], c["BLOCK_N"]))[None, :]
                left = (first_cols >= args["row_begin"]) & (first_cols + c["BLOCK_N"] <= first_rows)
                tiles = left.numel() - int(left.sum())
                assert launch.grid == (tiles, 1), (tiles, launch.grid)  # (a program for each)
            programs[name] = min(programs[name], tiles)
            flops += s_tile * tiles
            continue
        if "per_part" in args:
            blocks, per_part = grid[0], args["per_part"]
            half = blocks // 2
            for block in range(blocks):
                last = half if blocks % 2 or block < half else half - 1
                flops += s_tile * sum(max(min(1 + (p + 1) * per_part, last + 1) - (1 + p * per_part), 0)
                                      for p in range(grid[1]))
            continue
        columns, per_split = args.get("num_ref", args.get("num_b")), args["cols_per_split"]
        tiles = sum(cdiv(min(per_split, columns - start), c["BLOCK_N"]) for start in range(0, columns, per_split))
        flops += per_tile * tiles * grid[0] * (grid[1] if "BLOCK_D" in c else 1)
    return {"gemms": flops / max(2 * num_x * num_ref * dim, 1), "programs": programs}


def _forward_plan(x, labels, ref, ref_labels, hyper):
    """forward_plan for an H100; in the self case with what its first launch (label_order_kernel) writes,
    by torch's ops: the positive ranges the cost model reads and the order the backward's plan reads
    (interpreting the kernel at these sizes takes seconds)."""
    loss, stats, forward = triton_kernels.forward_plan(x, labels, None, ref, ref_labels, None, *hyper,
                                                       interpret=False, multiprocessors=H100)
    if ref is None:
        args = forward[0].args
        order, first, _, ranges = label_order_by_torch(labels, args["block_m"])
        args["saved_ptr"].copy_(torch.stack([order, first]))
        args["range_ptr"].copy_(ranges)
    return loss, stats, forward


@pytest.fixture(autouse=True)
def fused_backward_unless_named(monkeypatch):
    """The fused backward (a GPU's default is the chunked one), unless a test sets its own budget."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "0")


def _cost(batch, dim, dtype_name, ref_rows=None, mining=True, ref_grad=True, per_class=4, with_plan=False):
    """plan_cost of a P x M batch (per_class samples a class) against itself or a memory bank of
    ref_rows rows drawn from the same and other classes (and the backward's launches)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype_name.endswith("tf32") else "highest")
    try:
        dtype = DTYPES[dtype_name]
        x, labels = torch.zeros(batch, dim, dtype=dtype), torch.arange(batch) // per_class
        ref = ref_labels = None
        if ref_rows is not None:
            ref = torch.zeros(ref_rows, dim, dtype=dtype)
            ref_labels = torch.randint(0, ref_rows // per_class, (ref_rows,), generator=torch.Generator().manual_seed(0))
        hyper = (2.0, 50.0, 0.5, 0.1, mining, False)
        _, stats, forward = _forward_plan(x, labels, ref, ref_labels, hyper)
        *_, backward = triton_kernels.backward_plan(torch.ones(batch), stats, x, labels, None, ref, ref_labels, None,
                                                    *hyper, ref_grad=ref_grad, interpret=False, multiprocessors=H100)
        cost = plan_cost(forward + backward, batch, batch if ref is None else ref_rows, dim)
        return (cost, backward) if with_plan else cost
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("dim", [32, 64, 128, 256, 384, 512])
@pytest.mark.parametrize("mining", [True, False])
def test_self_case_takes_at_most_4_gemms(dtype_name, dim, mining):
    """One pass for the forward (plus the positive ranges' sliver), S once and one product in the
    backward, for every D up to 512: no recomputation of S per block of D. (384: the product runs
    on a 512-wide accumulator, a third of it padding.)"""
    cost = _cost(16384, dim, dtype_name, mining=mining)
    assert cost["gemms"] <= (3.4 if dim == 384 else 3.1), cost


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_odd_dims_pay_for_their_padding(dtype_name):
    """D = 130: rows padded to 144 (K steps of 16) and a 256-wide accumulator: counted, since the GPU
    does that work."""
    assert _cost(16384, 130, dtype_name)["gemms"] <= 4.25


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("ref_grad,limit", [(True, 5.01), (False, 3.01)])
def test_reference_set_takes_at_most_5_gemms(dtype_name, ref_grad, limit):
    """Forward 1, dx 2 and, when the reference set takes a gradient, dref 2 (a memory bank takes
    none); plus 0.005 for the positive ranges (a class has 4 rows in 65536)."""
    cost = _cost(1024, 512, dtype_name, ref_rows=65536, ref_grad=ref_grad)
    assert cost["gemms"] <= limit, cost
    assert ("grad_kernel[dref]" in cost["programs"]) == ref_grad


def test_a_memory_bank_of_random_classes_costs_no_more():
    """A batch of 256 random classes x 4 against a bank of 65536 rows of 16384 classes: each block's
    positive list holds exactly its labels' columns (not every class between its first and last)."""
    gen = torch.Generator().manual_seed(5)
    labels = torch.randperm(16384, generator=gen)[:256].repeat_interleave(4)
    ref_labels = torch.randint(0, 16384, (65536,), generator=gen)
    x, ref = torch.zeros(1024, 512, dtype=torch.float16), torch.zeros(65536, 512, dtype=torch.float16)
    hyper = (2.0, 50.0, 0.5, 0.1, True, False)
    _, stats, forward = triton_kernels.forward_plan(x, labels, None, ref, ref_labels, None, *hyper,
                                                    interpret=False, multiprocessors=H100)
    ranges = forward[0].args["range_ptr"]
    assert int((ranges[:, 1] - ranges[:, 0]).max()) <= 128 * 16  # a block's labels have about 4 columns each
    *_, backward = triton_kernels.backward_plan(torch.ones(1024), stats, x, labels, None, ref, ref_labels, None,
                                                *hyper, ref_grad=False, interpret=False, multiprocessors=H100)
    assert plan_cost(forward + backward, 1024, 65536, 512)["gemms"] <= 3.01


def test_large_classes_cost_more_but_stay_bounded():
    """Two classes of 8192: every block's positive range is half the columns, so the positive passes
    cost about one GEMM-equivalent more, and never more than two."""
    cost = _cost(16384, 512, "float16", per_class=8192)
    assert 3.5 <= cost["gemms"] <= 5.1, cost


@pytest.mark.parametrize("batch,ref_rows", [(4096, None), (256, 65536), (1024, 1048576)])
def test_launches_fill_an_h100(batch, ref_rows):
    """Every launch that walks all columns has at least two programs per multiprocessor (columns
    split where the row blocks are too few), with no atomic additions: split partials are combined in
    a fixed order afterwards."""
    cost = _cost(batch, 512, "float16", ref_rows=ref_rows)
    walking = {k: v for k, v in cost["programs"].items() if k.startswith(("negatives", "grad"))}
    assert len(walking) == (2 if ref_rows is None else 3)
    assert all(programs >= 2 * H100 for programs in walking.values()), cost["programs"]


@pytest.mark.parametrize("dtype, table", [(torch.float16, "triton-symmetric"), (torch.float32, "triton-symmetric"),
                                          (torch.float32, "shipped")])
@pytest.mark.parametrize("batch", [1024, 4096, 16384, 65536])
def test_the_symmetric_negatives_pass_takes_half_the_tiles(monkeypatch, batch, dtype, table):
    """The symmetric negatives pass (the benchmark's triton-symmetric; float32's on an H100 as shipped)
    computes each pair of row blocks once, B/128 (B/128 - 1) / 2 tiles where the full pass computes all
    (B/128)^2, with two programs a multiprocessor where the distances allow (B = 1024: 8 blocks of 4
    distances, 32 programs of one tile); its partials take 3 floats an anchor per part and per
    distance. float32 (an H100's table: 128 x 64 tiles for the full pass) takes square tiles of its
    row blocks too."""
    from triton_internals import TABLES

    if table != "shipped":
        monkeypatch.setattr(launcher, "tile_config", TABLES[table](launcher.tile_config))
    x, labels = torch.zeros(batch, 512, dtype=dtype), torch.arange(batch) // 4
    _, _, forward = _forward_plan(x, labels, None, None, (2.0, 50.0, 0.5, 0.1, True, False))
    negatives, = (launch for launch in forward if launch.kernel.fn.__name__.endswith("negatives_kernel"))
    assert negatives.kernel.fn.__name__ == "symmetric_negatives_kernel"
    blocks = batch // 128
    assert plan_cost([negatives], batch, batch, 512)["gemms"] == pytest.approx((blocks - 1) / (2 * blocks))
    programs = negatives.grid[0] * negatives.grid[1]
    assert programs >= min(2 * H100, blocks * (blocks // 2))
    assert negatives.args["part_ptr"].shape == (3, negatives.grid[1] + blocks // 2, batch)


MIB = 1 << 20


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("batch,ref_rows,mib,limit,triangle", [
    (16384, None, 64, 2.53, True), (65536, None, 256, 2.51, True), (65536, None, 64, 3.01, False),
    (4096, None, 64, 2.6, False), (1024, 1048576, 64, 3.01, False), (256, 65536, 64, 3.01, False),
    (16384, 65536, 64, 3.01, False)])
def test_the_chunked_backward_works_in_bounded_memory(monkeypatch, dtype_name, batch, ref_rows, mib, limit, triangle):
    """Weights to memory chunk by chunk, then cuBLAS: one product, and S once (a memory bank), or in
    the self case from each chunk's first row on where the chunks are at least 1024 rows tall (the
    triangle), each chunk's own square mirrored (its tiles right of the diagonal computed once for
    both places): about half of S. 4096 rows fit in one chunk of 64 MiB: whole rows, one square,
    about half of S; 65536 rows in 64 MiB make chunks of 512 rows: whole rows, all of S but each
    chunk's half square. In the self case the tiles of each row block's positive range come again,
    classified: 0.008 at B = 16384, 0.03 at 4096. The weights buffer within its budget; every weights
    launch has tiles to compute for an H100 twice over."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", str(mib))
    cost, backward = _cost(batch, 512, dtype_name, ref_rows=ref_rows, ref_grad=False, with_plan=True)
    assert cost["gemms"] <= limit, cost
    assert cost["programs"]["weights_kernel"] >= 2 * H100, cost["programs"]
    launches = [launch for launch in backward if isinstance(launch, Launch)
                and launch.kernel.fn.__name__ == "weights_kernel"]
    weights = [launch for launch in launches if not launch.constexprs["RANGE_TILES"]]
    # the self case's label-free tiles, each chunk's followed by its positive ranges' classified tiles
    assert [launch.constexprs["RANGE_TILES"] for launch in launches] == (
        [False, True] * len(weights) if ref_rows is None else [False] * len(weights))
    # one buffer, reused by every chunk (each chunk a view of it; a memory bank takes no copy)
    assert len({launch.args[name].data_ptr() for launch in weights for name in ("w_ptr", "copy_ptr")}) == 1
    assert not any(launch.constexprs["COPY"] for launch in weights)
    w = weights[0].args["w_ptr"]
    assert w.untyped_storage().nbytes() <= mib * MIB
    products = [step for step in backward if isinstance(step, Product)]
    several = batch * (ref_rows or batch) * w.element_size() > mib * MIB
    assert len(weights) >= (2 if several else 1)
    assert weights[0].constexprs["BOTH_LIFTS"] == triangle
    assert all(launch.constexprs["MIRROR"] == (ref_rows is None) for launch in weights)
    # each chunk's own rows, then (the triangle) its later rows in pieces whose float32 result, a
    # temporary beside dx, stays within an eighth of the budget; a reference set's chunk, every
    # anchor's row, in such pieces too
    piece = piece_rows(mib * MIB, 512)
    assert piece * 512 * 4 <= max(mib * MIB // 8, LEAST_PIECE_ROWS * 512 * 4)
    pieces = [cdiv(batch - launch.args["row_end"], piece) for launch in weights] if triangle else []
    if ref_rows is not None:
        pieces = [cdiv(batch, piece) - 1 for _ in weights]
    assert len(products) == len(weights) + sum(pieces)
    assert all(p.out.shape[0] <= piece for p in products if p.w.stride(0) == 1 or ref_rows is not None)


@pytest.mark.parametrize("batch,ref_rows,mib", [(1024, 262144, 256), (1024, 1048576, 64), (256, 65536, 16)])
def test_a_bank_compared_through_its_norms_makes_one_chunk_of_unit_rows_at_a_time(monkeypatch, batch, ref_rows,
                                                                                  mib):
    """A float16 bank as it is, with its norms (ref_norms): the forward's and the weights kernel's tiles
    scale S (the weights kernel within the registers that let two of its programs share a
    multiprocessor), and each chunk of the chunked backward makes its own unit rows for its product
    (one row launch of the chunk's rows), into one buffer that shares the budget with the weights:
    still S once and one product (3 GEMM-equivalents), and every weights launch fills an H100 twice
    over."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", str(mib))
    x, labels = torch.zeros(batch, 512, dtype=torch.float16), torch.arange(batch) // 4
    ref, ref_labels = torch.zeros(ref_rows, 512, dtype=torch.float16), torch.arange(ref_rows) // 4
    hyper, norms = (2.0, 50.0, 0.5, 0.1, True, False), torch.ones(2, ref_rows)
    _, stats, forward = triton_kernels.forward_plan(x, labels, None, ref, ref_labels, None, *hyper, interpret=False,
                                                    multiprocessors=H100, ref_norms=norms)
    assert all(launch.constexprs["REF_SCALES"] for launch in forward)
    *_, backward = triton_kernels.backward_plan(torch.ones(batch), stats, x, labels, None, ref, ref_labels, None,
                                                *hyper, ref_grad=False, interpret=False, multiprocessors=H100,
                                                ref_norms=norms)
    cost = plan_cost(forward + backward, batch, ref_rows, 512)
    assert cost["gemms"] <= 3.01 and cost["programs"]["weights_kernel"] >= 2 * H100, cost
    weights = [step for step in backward if isinstance(step, Launch) and step.kernel.fn.__name__ == "weights_kernel"]
    units = [step for step in backward if isinstance(step, Launch) and step.kernel.fn.__name__ == "divided_rows_kernel"]
    assert len(weights) == len(units) >= 2
    assert all(launch.constexprs["B_SCALES"] and launch.max_registers == 128 for launch in weights)
    assert len({launch.args["y_ptr"].data_ptr() for launch in units}) == 1  # (one buffer of unit rows)
    assert weights[0].args["w_ptr"].untyped_storage().nbytes() + units[0].args["y_ptr"].untyped_storage().nbytes() \
        <= mib * MIB
    assert sum(launch.args["y_ptr"].shape[0] for launch in units) == ref_rows


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("batch,ref_rows", [(2048, 16384), (1024, 262144), (256, 65536)])
def test_the_chunked_backward_of_a_reference_set_with_gradient_computes_s_once(monkeypatch, dtype_name, batch,
                                                                               ref_rows):
    """dx and dref from the same weights (two copies, two cuBLAS products): 4 GEMM-equivalents where
    the fused launches take 5, both buffers together within the budget; the products' float32
    results, temporaries, within an eighth of it (a chunk of 256 anchors against 32K rows: dref in
    pieces)."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "64")
    cost, backward = _cost(batch, 512, dtype_name, ref_rows=ref_rows, ref_grad=True, with_plan=True)
    assert cost["gemms"] <= 4.03 and set(cost["programs"]) >= {"weights_kernel"}, cost  # (+0.02: positive ranges)
    assert not any(name.startswith("grad_kernel") for name in cost["programs"])
    weights = [launch for launch in backward if getattr(launch, "args", {}).get("copy_ptr") is not None]
    w, w_copy = weights[0].args["w_ptr"], weights[0].args["copy_ptr"]
    assert w.data_ptr() != w_copy.data_ptr() and 2 * w.numel() * w.element_size() <= 64 * MIB
    products = [step for step in backward if isinstance(step, Product)]
    assert all(p.out.shape[0] <= piece_rows(64 * MIB, 512) for p in products)
    assert sum(p.out.shape[0] for p in products if p.out.shape[0] and p.unlift.shape[0] == 1) == ref_rows  # (dref)


@pytest.mark.parametrize("total,block,other,budget", [(16384, 128, 16384, 64 * MIB), (16384, 128, 16384, 1),
                                                      (1000, 64, 3, 10 ** 9), (1048576, 128, 1024, 64 * MIB),
                                                      (300, 128, 1000, 3 * 128 * 1000 * 2 - 1), (0, 64, 5, 1),
                                                      (300, 64, 300, 256 * 300 * 2)])
def test_chunks_cover_everything_once_within_the_budget(total, block, other, budget):
    chunks = backward.even_chunks(total, block, other, 2, budget)
    assert [begin for begin, _ in chunks] == [end for _, end in [(0, 0)] + chunks[:-1]][:len(chunks)]
    assert (chunks[-1][1] if chunks else 0) == total
    sizes = [end - begin for begin, end in chunks]
    assert all(size % block == 0 for size in sizes[:-1]) and len(set(sizes[:-1])) <= 1
    assert len(sizes) <= 1 or (sizes[0] - block) * len(sizes) < total  # balanced: no block to spare in each
    assert all(size * other * 2 <= max(budget, block * other * 2) for size in sizes)
    assert len(chunks) == (0 if total == 0 else -(-total // max(budget // (other * 2) // block * block, block)))


@pytest.mark.parametrize("total,block,budget", [(16384, 128, 64 * MIB), (16384, 128, 1), (65536, 128, 64 * MIB),
                                                (65536, 64, 128 * MIB),
                                                (1000, 64, 10 ** 9), (300, 128, 2 * 128 * 304), (0, 64, 1)])
def test_triangle_chunks_cover_every_row_once_within_the_budget(total, block, budget):
    """The self case's chunks: rows [r0, r1) against columns r0 ... total, each the most whole blocks
    within the budget (or one block), so they grow as the columns shrink; the last two share what
    would have left a sliver."""
    chunks = backward.triangle_chunks(total, block, 2, budget)
    assert [begin for begin, _ in chunks] == [end for _, end in [(0, 0)] + chunks[:-1]][:len(chunks)]
    assert (chunks[-1][1] if chunks else 0) == total
    sizes = [end - begin for begin, end in chunks]
    for k, (begin, end) in enumerate(chunks):
        width = total - begin + (-(total - begin) % 16)
        assert (end - begin) % block == 0 or end == total
        assert (end - begin) * width * 2 <= budget or end - begin <= block
        if k < len(chunks) - 2:
            assert (end - begin + block) * width * 2 > budget  # no room for one more block
    assert sizes[:-2] == sorted(sizes[:-2])
    assert len(sizes) < 2 or sizes[-2] == block or 3 * sizes[-1] >= sizes[-2]


@pytest.mark.parametrize("dtype_name,chunked", [("float16", False), ("bfloat16", True)])
def test_float16_keeps_the_fused_backward_under_float16_accumulation(monkeypatch, dtype_name, chunked):
    """Under torch.backends.cuda.matmul.allow_fp16_accumulation cuBLAS refuses a float32 result of
    float16 products (it raises), so float16 takes the fused backward there; bfloat16 is unaffected."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "64")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", True)
    _, backward = _cost(4096, 512, dtype_name, with_plan=True)
    names = {launch.kernel.fn.__name__ for launch in backward if isinstance(launch, Launch)}
    assert ("weights_kernel" in names) == chunked and ("grad_kernel" in names) != chunked


@pytest.mark.parametrize("text,expected", [(None, 256 * MIB), ("", 256 * MIB), ("0", 0), ("64", 64 * MIB),
                                           ("0.5", MIB // 2), ("1e-6", 1)])
def test_the_chunk_budget_comes_from_the_environment(monkeypatch, text, expected):
    """Unset, a GPU gets the chunked backward at 256 MiB (the sweep's winner), the interpreter the fused one."""
    monkeypatch.delenv("MS_LOSS_TRITON_CHUNK_MB", raising=False)
    if text is not None:
        monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", text)
    assert launcher.chunk_budget(interpret=False) == expected
    assert launcher.tile_config("backward", torch.float16, 512, interpret=False)["CHUNK_BYTES"] == expected
    assert launcher.chunk_budget(interpret=True) == (expected if text else 0)


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "lots"])
def test_a_bad_chunk_budget_is_refused(monkeypatch, text):
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", text)
    with pytest.raises(ValueError, match="MS_LOSS_TRITON_CHUNK_MB must be a number of MiB >= 0"):
        launcher.chunk_budget()
