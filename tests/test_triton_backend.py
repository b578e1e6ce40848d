"""The Triton backend's own machinery, beyond the parity suite: its label order and positive ranges,
its two backwards and their lifts, the eager one-node loss and the forward that issues the backward,
the tile table under the interpreter, the normalisation's row kernels, and how few torch ops an eager
step issues. On CPU tensors under TRITON_INTERPRET=1 (conftest sets it) where there is no GPU.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ms_loss_cuda import available_backends, multi_similarity_loss
from ms_loss_cuda.common import unit_rows

from conftest import (INTERPRETER_CHANGED, assert_close, build_case, check_against_reference, label_order_by_torch,
                      loss_and_grads, make_batch, threshold_crossing, to)
from targets import (DEVICE, REDUCTIONS, TOLERANCE, TRITON_MISSING, Target, check, chunk_choices, gpu_tile_table,
                     in_turn, recorded_launches, triton_kernels)

if triton_kernels is not None:
    import triton
    import triton.language as tl

    from ms_loss_cuda.triton_kernels import launcher, op, operands, row_kernels

    @triton.jit
    def _int32_sum_kernel(out_ptr, a, b):
        tl.store(out_ptr, a + b)


@pytest.mark.skipif(**TRITON_MISSING)
# (each dtype, mining on and off, each with one of the two gradient paths: one grad_output or one each)
@pytest.mark.parametrize("dtype,mining,reduction", [(torch.float32, True, "mean"), (torch.float32, False, "none"),
                                                    (torch.float16, True, "none"), (torch.float16, False, "mean")])
def test_the_chunked_self_case_in_whole_rows_matches_reference(monkeypatch, dtype, mining, reduction):
    """Chunks shorter than TRIANGLE_ROWS take whole rows (each row of dx written once, each row's own
    lift): several chunks of one tile row each, where the triton_chunked target runs the triangle."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "1e-6")  # (1 byte)
    chosen = chunk_choices(monkeypatch, triangle_rows=10 ** 9)
    target = Target("triton_chunked", "triton", DEVICE, torch.ops.ms_loss_cuda.triton_forward.default,
                    torch.ops.ms_loss_cuda.triton_backward.default, True)
    check(target, build_case("self", 200, 130, dtype), dtype, reduction, mining=mining)
    assert chosen and all(len(chunks) > 1 and not triangle for chunks, triangle in chosen)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("kind", ["ref_ids", "self_ids"])
def test_a_chunk_of_more_row_blocks_than_a_grid_axis_holds_takes_a_launch_per_piece(monkeypatch, kind):
    """CUDA caps the grid's second axis, the weights launches' row blocks, at 65535; a reference set's
    chunk holds every anchor, so from 8.4M anchors on it takes one launch per piece of rows, and so does
    the self case's launch of its positive ranges, whose row blocks are smaller than the chunk's: here a
    cap of one row block, against the float64 reference."""
    from ms_loss_cuda.triton_kernels import backward

    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "1e-6")  # (1 byte)
    monkeypatch.setattr(backward, "MOST_GRID_Y", 1)
    launches = recorded_launches(monkeypatch)
    check_against_reference("triton", build_case(kind, 150, 40, torch.float32, seed=2), torch.float32, "sum",
                            device=DEVICE)
    weights = [launch for launch in launches if launch.kernel.fn.__name__ == "weights_kernel"]
    assert len(weights) > 2 and all(launch.grid[1] == 1 for launch in weights)
    assert (kind == "self_ids") == any(launch.constexprs["RANGE_TILES"] for launch in weights)


@pytest.mark.skipif(triton_kernels is None, reason="Triton missing")
def test_a_reference_set_past_int32_rows_is_refused(monkeypatch):
    """Rows are indexed in int32 (keys' ranks, default identities, offsets of up to 4 B): 2^29 rows with
    the batch are refused before any launch (a reference set of one row expanded, which takes no
    memory; copying its rows, which the plan would do next, would take 16 GiB)."""
    monkeypatch.setattr(operands, "_aligned_rows", lambda *args: pytest.fail("the rows were copied before the check"))
    rows = 2 ** 29 - 4
    ref, ref_labels = torch.zeros(1, 16).expand(rows, 16), torch.zeros(1, dtype=torch.int64).expand(rows)
    with pytest.raises(ValueError, match=r"hold 536870912 rows together, at most 2\^29 - 1"):
        operands.plan_operands(torch.randn(4, 16), torch.arange(4), None, ref, ref_labels, None)


@pytest.mark.skipif(not INTERPRETER_CHANGED, reason="runs the interpreter as it ships (tests/fast_interpreter.py)")
@pytest.mark.parametrize("checked", [False, True])
def test_the_interpreters_overflow_checks_are_on_where_a_test_asks_for_them(request, checked):
    """The suite runs the interpreter without its integer overflow checks, and the overflow_checked
    fixture turns them on for a test: int32 2^31 - 1 + 1 wraps, or is refused."""
    if checked:
        request.getfixturevalue("overflow_checked")
    out = torch.zeros(1, dtype=torch.int32)
    if checked:
        with pytest.raises(Exception, match="int32 overflow detected"):
            _int32_sum_kernel[(1,)](out, 2 ** 31 - 1, 1)
    else:
        _int32_sum_kernel[(1,)](out, 2 ** 31 - 1, 1)
        assert out.item() == -2 ** 31


@pytest.mark.skipif(triton_kernels is None, reason="Triton missing")
def test_identities_shared_across_labels_are_found():
    # (the flag that makes the self case's negatives kernel compare the caller's identities)
    shared = operands.shared_identities
    labels = torch.tensor([0, 0, 1, 1, 2], dtype=torch.int32)
    assert shared(torch.tensor([5, 6, 7, 8, 9], dtype=torch.int32), labels).tolist() == [0]  # distinct
    assert shared(torch.tensor([5, 5, 7, 7, 9], dtype=torch.int32), labels).tolist() == [0]  # within a label
    assert shared(torch.tensor([5, 6, 7, 5, 9], dtype=torch.int32), labels).tolist() == [1]  # labels 0 and 1
    assert shared(torch.tensor([9, 6, 7, 8, 9], dtype=torch.int32), labels).tolist() == [1]  # labels 0 and 2
    assert shared(torch.tensor([3], dtype=torch.int32), labels[:1]).tolist() == [0]


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("labels_dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.uint16,
                                          torch.uint32, torch.uint64])
@pytest.mark.usefixtures("overflow_checked")
def test_the_triton_self_case_keeps_its_label_order_for_the_backward(labels_dtype):
    """The self case's forward sorts the labels once and keeps the order and the sorted labels' ranks
    in its stats' last two rows (int32 bits), which the backward reads instead of sorting again; for
    every integer dtype, from labels that are not contiguous (no warning either), with the same loss
    and gradient as int64 labels."""
    x, labels = make_batch(97, 16, 9, dtype=torch.float32)
    labels = torch.stack([labels * 37 + 5, labels], 1).to(labels_dtype)[:, 0]  # (not their own ranks; strided)
    x, labels = F.normalize(x, dim=1).to(DEVICE), labels.to(DEVICE)
    args = (None, None, None, None, 2.0, 50.0, 0.5, 0.1, True, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (torch warns about a strided searchsorted input)
        loss, stats = torch.ops.ms_loss_cuda.triton_forward(x, labels, *args)
        grad = torch.ops.ms_loss_cuda.triton_backward(torch.ones_like(loss), stats, x, labels, *args)[0]
    order, ranks = (row.cpu().long() for row in operands.saved_label_order(stats, 97))
    wide = labels.cpu().long()
    assert torch.equal(order, torch.sort(wide, stable=True).indices)
    assert torch.equal(ranks, torch.searchsorted(wide[order], wide[order]))  # equal exactly where the labels are
    loss64, stats64 = torch.ops.ms_loss_cuda.triton_forward(x, labels.long(), *args)
    assert torch.equal(loss, loss64) and torch.equal(stats, stats64)
    assert torch.equal(grad, torch.ops.ms_loss_cuda.triton_backward(torch.ones_like(loss), stats, x, wide.to(DEVICE),
                                                                    *args)[0])
    for wrong in (stats[:4], stats[:, :96]):
        with pytest.raises(ValueError, match="stats must be the triton forward's"):
            torch.ops.ms_loss_cuda.triton_backward(torch.ones_like(loss), wrong, x, labels, *args)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("case", ["self", "ref"])
@pytest.mark.parametrize("chunk_mib", ["0", "1"])
def test_one_gradient_for_all_anchors_is_the_same_as_a_vector_of_them(monkeypatch, case, chunk_mib):
    """The triton backward takes an expanded grad_loss (stride 0: "mean" and "sum" of the eager loss)
    as one value, its norm worked out by the scales kernel (UNIFORM), and grad_divisor divides it there
    (the eager loss's "mean": grad_output / B, no op for it): the same gradients as from the vector
    of those values, fused and chunked, within a few float32 ulps (GPU divisions are approximate)."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
    kwargs = to(build_case(case, 53, 24, torch.float32, seed=2), DEVICE)
    x = F.normalize(kwargs["embeddings"], dim=1)
    ref = None if case == "self" else F.normalize(kwargs["ref_embeddings"], dim=1)
    keys = (kwargs["labels"], None, ref, kwargs.get("ref_labels"), None)
    hyper = (2.0, 50.0, 0.5, 0.1, True, False)
    loss, stats = torch.ops.ms_loss_cuda.triton_forward(x, *keys, *hyper)
    grad_output = torch.tensor(-0.37, device=DEVICE)
    backward = op.backward_of_checked_inputs
    uniform = backward(grad_output.expand(53), stats, x, *keys, *hyper, grad_divisor=53)
    vector = backward((grad_output / 53).expand(53).contiguous(), stats, x, *keys, *hyper)
    for got, want in list(zip(uniform, vector))[:1 if ref is None else 2]:  # (the self case: no grad_ref)
        assert got.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("ref_grad", [False, True])
def test_an_eager_triton_loss_is_one_autograd_node(ref_grad):
    """Eager calls of the triton backend take the whole loss (normalisation, the loss op, reduction,
    finiteness check, cast) as one autograd node: its inputs' gradients accumulate directly, with no
    node of torch's between them (each costs the host its own launches; see the test above)."""
    kwargs = to(build_case("ref", 40, 16, torch.float16), DEVICE)
    x = kwargs["embeddings"].requires_grad_()
    ref = kwargs["ref_embeddings"].requires_grad_(ref_grad)
    loss = multi_similarity_loss(x, kwargs["labels"], ref_embeddings=ref, ref_labels=kwargs["ref_labels"],
                                 backend="triton")
    leaves = [next_function for next_function, _ in loss.grad_fn.next_functions if next_function is not None]
    assert [type(f).__name__ for f in leaves] == ["AccumulateGrad"] * (1 + ref_grad)
    assert leaves[0].variable is x and (not ref_grad or leaves[1].variable is ref)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("chunk_mib", ["0", "1e-6"])
@pytest.mark.parametrize("dtype,ref_grad,through_norms", [(torch.float16, False, True), (torch.float16, True, False),
                                                          (torch.float32, False, False)])
def test_a_float16_bank_is_compared_through_its_norms(monkeypatch, chunk_mib, dtype, ref_grad, through_norms):
    """A normalised float16 bank that takes no gradient enters the kernels as it is, with its norms,
    where a bank that takes one (or of another dtype) is normalised first. Rows of norms from 1e-3 to
    1e3, every reduction and a grad_output other than 1: the reference's loss and gradients, with the
    fused backward and the chunked one (chunks of one tile, each making its unit rows); a bank row
    holding an infinity makes the loss NaN."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
    compared = []
    shipped = triton_kernels.forward.forward_plan
    monkeypatch.setattr(triton_kernels.forward, "forward_plan",
                        lambda *args, **kwargs: (compared.append(kwargs.get("ref_norms")), shipped(*args, **kwargs))[1])
    kwargs = build_case("ref_own_copy", 61, 40, torch.float64, seed=3)
    norms = 10.0 ** torch.linspace(-3, 3, kwargs["ref_embeddings"].shape[0], dtype=torch.float64)
    order = torch.randperm(norms.shape[0], generator=torch.Generator().manual_seed(3))
    bank = F.normalize(kwargs["ref_embeddings"], dim=1) * norms[order][:, None]
    kwargs = dict(kwargs, embeddings=kwargs["embeddings"].to(dtype), ref_embeddings=bank.to(dtype))
    for reduction in REDUCTIONS:
        compared.clear()
        check_against_reference("triton", kwargs, dtype, reduction, DEVICE, ref_grad=ref_grad)
        assert [norms is not None for norms in compared] == [through_norms]
        # (94 rows: the norms' and reciprocals' rows still start 16-byte aligned, as the kernels are compiled)
        assert not through_norms or all(row.data_ptr() % 16 == 0 for row in compared[0])
    kwargs["ref_embeddings"][7, 2] = float("inf")
    assert torch.isnan(multi_similarity_loss(**to(kwargs, DEVICE), backend="triton"))


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("chunk_mib", ["0", "1e-6"])
def test_a_pair_the_backward_puts_across_a_threshold_gets_no_weight(monkeypatch, chunk_mib):
    """The backward recomputes S, which may differ from the forward's in the last bits (another order of
    sums). An anchor whose mined sets are empty in the forward, with a negative that crosses the
    threshold in the backward, must still get no weight there (its weights' lift is the largest,
    2^64): a gradient of 0, not inf. The ops are given a negative moved by about 1e-3 in between."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
    x, bank, moved, labels, ref_labels, hyper = threshold_crossing(torch.float16, DEVICE)
    loss, stats = torch.ops.ms_loss_cuda.triton_forward(x, labels, None, bank, ref_labels, None, *hyper)
    grad_x, _ = torch.ops.ms_loss_cuda.triton_backward(torch.ones_like(loss), stats, x, labels, None, moved,
                                                       ref_labels, None, *hyper, False)
    assert loss.item() == 0 and torch.equal(grad_x, torch.zeros_like(grad_x))


@pytest.mark.skipif(**TRITON_MISSING)
def test_the_eager_loss_issues_its_backward_in_its_forward(monkeypatch):
    """"mean" and "sum" under grad mode: the eager forward launches the backward's kernels too (for
    grad_output 1), and the backward only scales their float32 result by grad_output: the same
    gradient as the backward of "none" weighted alike, twice alike under retain_graph (the kept
    gradient is not scaled in place). Without a gradient to take (no_grad, inputs that take none),
    or for "none", the forward launches the forward's kernels only."""
    launches = recorded_launches(monkeypatch)
    kwargs = to(build_case("self", 45, 16, torch.float32, seed=4), DEVICE)
    x = kwargs["embeddings"].requires_grad_()

    def forward_kernels(x, reduction):
        launches.clear()
        loss = multi_similarity_loss(x, kwargs["labels"], reduction=reduction, backend="triton")
        return loss, {launch.kernel.fn.__name__ for launch in launches}

    loss, launched = forward_kernels(x, "mean")
    assert "scales_kernel" in launched and "unit_rows_grad_kernel" in launched
    (first,) = torch.autograd.grad(loss, x, torch.tensor(-2.5, device=DEVICE), retain_graph=True)
    (again,) = torch.autograd.grad(loss, x, torch.tensor(-2.5, device=DEVICE))
    assert torch.equal(first, again)
    losses, launched = forward_kernels(x, "none")
    assert "scales_kernel" not in launched
    (want,) = torch.autograd.grad(losses, x, torch.full_like(losses, -2.5 / 45))
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    with torch.no_grad():
        assert "scales_kernel" not in forward_kernels(x, "sum")[1]
    assert "scales_kernel" not in forward_kernels(x.detach(), "sum")[1]


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("chunk_mib", ["0", "1"])
def test_a_scaled_grad_output_keeps_the_small_entries_of_16_bit_gradients(monkeypatch, chunk_mib):
    """The eager "mean" computes its gradient in the forward for grad_output 1 and scales it in the
    backward: it must keep it in float32, or the small entries of a 16-bit "mean" gradient (about
    1/B) go subnormal before a loss scaler's factor (2^10 here) lifts them, and lose their bits. The
    same gradient as "none" with grad_output / B for each anchor, which the kernels take at that
    scale (fused with one column split, as at large B on a GPU, and chunked; no normalisation)."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
    monkeypatch.setattr(launcher, "device_multiprocessors", lambda device, interpret: 1)
    kwargs = to(build_case("self", 301, 16, torch.float32, seed=6), DEVICE)
    x = F.normalize(kwargs["embeddings"], dim=1).half().requires_grad_()
    scale, labels = 2.0 ** 10, kwargs["labels"]
    loss = multi_similarity_loss(x, labels, normalize=False, backend="triton")
    (got,) = torch.autograd.grad(loss, x, torch.tensor(scale, dtype=loss.dtype, device=DEVICE))
    losses = multi_similarity_loss(x, labels, normalize=False, reduction="none", backend="triton")
    (want,) = torch.autograd.grad(losses, x, torch.full_like(losses, scale / 301))
    assert (want.float().abs() < 6.1e-5 * scale).float().mean() > 0.01  # (entries below float16's normals at 1)
    torch.testing.assert_close(got, want, rtol=5e-3, atol=1e-6 * want.abs().max().item())


@pytest.mark.skipif(triton_kernels is None or DEVICE != "cpu" or not triton_kernels.INTERPRETED,
                    reason="runs the GPU's tiles under the interpreter (on a GPU every test does)")
# the fused backward ("0") and the chunked one in several chunks, in turn: each case and each tile
# table entry meets both
@pytest.mark.parametrize("dtype,capability,case,chunk_mib",
                         in_turn(["0", "0.05"], [(torch.float16, (9, 0)), (torch.float16, (8, 0)),
                                                 (torch.float16, (12, 0)), (torch.float32, (9, 0)),
                                                 (torch.bfloat16, (9, 0))],
                                 ["self_ids", "ref_ids", "memory_bank"]))
def test_the_gpu_tile_table_under_the_interpreter(monkeypatch, case, dtype, capability, chunk_mib):
    """The interpreter's own tiles are small (tile_config); here the kernels run on the tiles a GPU of
    that capability gets, at B = 300 (row blocks of 128 in the forward, whose reference-set positive
    lists take seven halvings to search; the range launch's 64 rows under the weights' 128; the self
    case's chunks in the triangle, on its own tiles, at any height; float32's symmetric negatives
    pass on sm_90, three row blocks of it)."""
    gpu_tile_table(monkeypatch, capability)
    chosen = chunk_choices(monkeypatch, triangle_rows=1)
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
    kwargs = build_case("ref_ids" if case == "memory_bank" else case, 300, 64, torch.float64, seed=14)
    for key in ("embeddings", "ref_embeddings"):  # unit rows, exactly representable in `dtype`
        if key in kwargs:
            kwargs[key] = F.normalize(kwargs[key], dim=1).to(dtype)
    check_against_reference("triton", kwargs, dtype, "none", device=DEVICE, rtol=TOLERANCE[dtype],
                            ref_grad=case != "memory_bank", normalize=False)
    assert all(triangle == (case == "self_ids") for _, triangle in chosen)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("beta", [0.0, -1.0, float("nan"), 1e-45])  # (1e-45: 0 in float32)
def test_the_triton_ops_refuse_a_beta_that_is_not_positive(beta):
    # (the public API refuses it before; a direct call of the ops would sum exp(beta * -inf) = NaN)
    x, labels = make_batch(8, 4, 3, dtype=torch.float32)
    x, labels = x.to(DEVICE), labels.to(DEVICE)
    with pytest.raises(ValueError, match="beta must be > 0"):
        torch.ops.ms_loss_cuda.triton_forward(x, labels, None, None, None, None, 2.0, beta, 0.5, 0.1, True, False)
    _, stats = torch.ops.ms_loss_cuda.triton_forward(x, labels, None, None, None, None, 2.0, 50.0, 0.5, 0.1, True,
                                                     False)
    with pytest.raises(ValueError, match="beta must be > 0"):
        torch.ops.ms_loss_cuda.triton_backward(torch.ones(8, device=DEVICE), stats, x, labels, None, None, None, None,
                                               2.0, beta, 0.5, 0.1, True, False)


@pytest.mark.skipif(triton_kernels is None or DEVICE != "cpu", reason="about the interpreter on a machine without GPU")
def test_triton_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(launcher, "INTERPRETED", False)
    x, labels = make_batch(8, 4, 3, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="backend 'triton' cannot run: .*TRITON_INTERPRET=1"):
        multi_similarity_loss(x, labels, backend="triton")
    assert "triton" not in available_backends("cpu")


@pytest.mark.skipif(triton_kernels is None, reason="needs Triton")
@pytest.mark.parametrize("row_programs,num_cols,block_n", [(1, 1000, 64), (8, 1 << 20, 64), (300, 5000, 64),
                                                           (3, 0, 64), (2, 130, 64)])
def test_column_splits_cover_every_column_once(row_programs, num_cols, block_n):
    splits, per_split = operands.column_splits(row_programs, num_cols, block_n, 132)
    assert splits >= 1 and per_split % block_n == 0
    assert (splits - 1) * per_split < max(num_cols, 1) <= splits * per_split  # none empty, all covered
    if num_cols > 0:
        assert row_programs * splits >= min(2 * 132, row_programs * -(-num_cols // block_n))


@pytest.mark.skipif(triton_kernels is None, reason="needs Triton")
@pytest.mark.parametrize("batch,ref_rows,classes,block_m", [(257, 1000, 90, 128), (97, 5, 40, 32), (64, 3000, 2, 64),
                                                            (1, 7, 1, 64), (0, 5, 1, 64)])
def test_positive_lists_hold_exactly_each_blocks_labels(batch, ref_rows, classes, block_m):
    """positive_ranges' contract, walked slot by slot as _positive_columns does (a search for the slot's
    segment, then the shifted column order): each block's list is exactly the columns whose label one
    of its anchors has, each once."""
    gen = torch.Generator().manual_seed(batch)
    row_keys = torch.randint(0, classes, (batch,), generator=gen, dtype=torch.int32)
    col_keys = torch.randint(0, classes, (ref_rows,), generator=gen, dtype=torch.int32)
    row_order, col_order, segment_end, column_shift, ranges = operands.positive_ranges(row_keys, col_keys,
                                                                                       block_m)
    assert sorted(row_order.tolist()) == list(range(batch)) and ranges.shape == (-(-batch // block_m), 2)
    for k, (start, end) in enumerate(ranges.tolist()):
        anchors = row_order[k * block_m:(k + 1) * block_m].long()
        slots = torch.arange(start, end)
        owner = k * block_m + torch.searchsorted(segment_end[k * block_m:(k + 1) * block_m], slots, right=True)
        columns = col_order[(slots + column_shift[owner]).long()].long()
        wanted = torch.isin(col_keys, row_keys[anchors]).nonzero().flatten()
        assert sorted(columns.tolist()) == wanted.tolist()


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("one_kernel_sort", [4096, 32, 7])  # (one sort; rows of keys merged, some padded; too many rows)
@pytest.mark.parametrize("batch,classes,block_m,keys_dtype,rows_dtype", [
    (300, 70, 64, torch.int64, torch.float16), (97, 40, 32, torch.uint8, torch.float32),
    (130, 3, 64, torch.int16, torch.bfloat16), (257, 257, 128, torch.int32, None), (1, 1, 64, torch.int64, torch.float32),
    (0, 1, 64, torch.int64, torch.float16)])
@pytest.mark.usefixtures("overflow_checked")
def test_the_label_order_kernel_sorts_ranks_and_copies_the_rows(monkeypatch, one_kernel_sort, batch, classes, block_m,
                                                                keys_dtype, rows_dtype):
    """operands.label_order (a sort, then label_order_kernel): the stable order, the keys' ranks in the caller's
    order and their first positions in the sorted one (saved), each block's positive range (exactly the
    columns of its labels, each once) and the rows and identities in that order, bit for bit; int64
    keys equal in their low 32 bits stay apart, uint8 keys of 255 beside the padding's 255. Sorted
    whole, or as rows of one_kernel_sort keys that the kernel merges (at most 16 rows)."""
    monkeypatch.setattr(operands, "ONE_KERNEL_SORT", one_kernel_sort)
    gen = torch.Generator().manual_seed(batch)
    keys = torch.randint(0, classes, (batch,), generator=gen)
    if keys_dtype == torch.int64:
        keys = keys * 2**33 - 7
    if keys_dtype == torch.uint8:
        keys = keys + 255 - classes + 1  # (the largest keys are 255)
    keys = keys.to(keys_dtype).to(DEVICE)
    rows = None if rows_dtype is None else torch.randn(batch, 37, generator=gen).to(rows_dtype).to(DEVICE)
    ids = torch.randperm(batch, generator=gen).to(torch.int32).to(DEVICE)
    saved = torch.full((2, batch), -1, dtype=torch.int32, device=DEVICE)
    in_order = operands.label_order(keys, block_m, saved, rows, ids)
    launcher.issue([in_order.launch])
    wide = keys.cpu().long()
    order, first, ranks, ranges = label_order_by_torch(wide, block_m)
    assert torch.equal(in_order.order.cpu().long(), order) and torch.equal(saved[0].cpu().long(), order)
    assert torch.equal(saved[1].cpu().long(), first) and torch.equal(in_order.ranks.cpu().long(), ranks)
    assert torch.equal(in_order.ids, ids[order.to(DEVICE)])
    if rows is not None:
        assert torch.equal(in_order.rows, rows[order.to(DEVICE)])
    assert torch.equal(in_order.ranges.cpu().long(), ranges.reshape(-1, 2))
    for k, (start, end) in enumerate(in_order.ranges.tolist()):
        wanted = torch.isin(wide, wide[order[k * block_m:(k + 1) * block_m]]).nonzero().flatten()
        assert sorted(order[start:end].tolist()) == wanted.tolist()


@pytest.mark.skipif(DEVICE == "cpu" or triton_kernels is None, reason="GPU sizes (the interpreter: minutes)")
@pytest.mark.parametrize("batch", [16384, 65536, 16383])
def test_the_merged_sort_gives_one_sorts_step_at_gpu_sizes(monkeypatch, batch):
    """An eager float16 step whose labels are sorted as rows of 4096 and merged by label_order_kernel
    (4, 16 and 4 padded rows) has the loss, gradient and statistics of the same step after one
    global sort, bit for bit."""
    x, labels = make_batch(batch, 64, batch // 4, dtype=torch.float16)
    x, labels = x.to(DEVICE), labels.to(DEVICE)
    results = []
    for one_kernel_sort in (4096, 10 ** 9):
        monkeypatch.setattr(operands, "ONE_KERNEL_SORT", one_kernel_sort)
        embeddings = x.clone().requires_grad_()
        loss = multi_similarity_loss(embeddings, labels, backend="triton")
        loss.backward()
        stats = torch.ops.ms_loss_cuda.triton_forward(x, labels, None, None, None, None, 2.0, 50.0, 0.5, 0.1,
                                                      True, False)[1]
        results.append((loss, embeddings.grad, stats))
    assert all(torch.equal(merged, whole) for merged, whole in zip(*results))


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("chunk_mib", ["0", "1e-6"])  # the fused backward; the chunked one, the self case's triangle
def test_float16_weights_keep_their_precision_under_a_tiny_grad_output(monkeypatch, chunk_mib):
    """grad_output 1e-6 for every anchor: the lifts must take each row's float16 weights (about 1/200)
    back towards 1, whatever the grad_output's scale (in the triangle each weight takes both its
    anchors' lifts). Compared before the gradient is rounded to float16 (where 1e-6 x S would be
    subnormal): the backward plan's float32 dx against the float64 reference."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", chunk_mib)
    gen = torch.Generator().manual_seed(17)
    x = F.normalize(torch.randn(200, 64, generator=gen, dtype=torch.float64), dim=1).half()
    labels = torch.randint(0, 40, (200,), generator=gen)
    hyper = (2.0, 10.0, 0.5, 0.1, False, False)  # (alpha, beta, base, epsilon, mining, skip_incomplete_anchors)
    on_device = (x.to(DEVICE), labels.to(DEVICE), None, None, None, None)
    _, stats = launcher.run(triton_kernels.forward_plan, on_device[0].device, *on_device, *hyper)
    grad_output = torch.full((200,), 1e-6, dtype=torch.float32, device=DEVICE)
    dx = launcher.run(triton_kernels.backward_plan, grad_output.device, grad_output, stats, *on_device, *hyper)[0]
    dx = dx.sum(0) if dx.dim() == 3 else dx  # (split partials)
    want = loss_and_grads(dict(embeddings=x.double(), labels=labels), "reference",
                          lambda loss: torch.full_like(loss, 1e-6), reduction="none", mining=False, normalize=False,
                          beta=10.0)[1][0]
    assert_close(dx[:, :64], want, 4e-3)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("form", ["fused", "whole_rows", "triangle"])
def test_float16_weights_of_a_group_with_tiny_grad_outputs_keep_their_precision(monkeypatch, form):
    """The self case's lifts: two groups of 100 anchors in orthogonal halves of the embedding (pairs
    across them weigh about e^-25 under beta = 50), the second's grad_output 2^-17 of the first's,
    so its rows of dx come from its own weights alone, in float16 subnormals unless lifted. With
    each row's lift every row holds 1.5e-3 of its own scale (every lift set to 1: 0.4). The fused backward, and the chunked one in
    chunks of whole rows and in the triangle (a GPU's choice for 16-bit batches whose weights need
    several chunks: B above about 11,600 at the default 256 MiB), whose weights take both ends' lifts."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "0" if form == "fused" else "1e-6")
    chosen = chunk_choices(monkeypatch, {"fused": None, "whole_rows": 10 ** 9, "triangle": 1}[form])
    gen, n = torch.Generator().manual_seed(3), 100
    x = torch.zeros(2 * n, 64, dtype=torch.float64)
    for group, columns in enumerate((slice(0, 32), slice(32, 64))):  # each around a centre of its own
        x[group * n:(group + 1) * n, columns] = (torch.randn(1, 32, generator=gen, dtype=torch.float64)
                                                 + 0.2 * torch.randn(n, 32, generator=gen, dtype=torch.float64))
    x = F.normalize(x, dim=1).half()
    labels = torch.cat([torch.randint(0, 10, (n,), generator=gen), torch.randint(10, 20, (n,), generator=gen)])
    grad_output = torch.cat([torch.ones(n), torch.full((n,), 2.0 ** -17)])
    hyper = (2.0, 50.0, 0.5, 0.1, False, False)  # (alpha, beta, base, epsilon, mining, skip_incomplete_anchors)
    on_device = (x.to(DEVICE), labels.to(DEVICE), None, None, None, None)
    _, stats = launcher.run(triton_kernels.forward_plan, on_device[0].device, *on_device, *hyper)
    dx = launcher.run(triton_kernels.backward_plan, on_device[0].device, grad_output.to(DEVICE), stats, *on_device, *hyper)[0]
    dx = (dx.sum(0) if dx.dim() == 3 else dx)[:, :64].double().cpu()  # (split partials; float32, before rounding)
    want = loss_and_grads(dict(embeddings=x.double(), labels=labels), "reference", lambda loss: grad_output.double(),
                          reduction="none", mining=False, normalize=False, beta=50.0)[1][0]
    error = (dx - want).abs().amax(dim=1) / want.abs().amax(dim=1)
    assert error.max() < 4e-3, f"worst row {error.argmax().item()}: {error.max().item():.2e} of its own scale"
    assert [triangle for _, triangle in chosen] == ([] if form == "fused" else [form == "triangle"])


@pytest.mark.skipif(triton_kernels is None, reason="needs Triton")
def test_float32_products_follow_torchs_matmul_precision():
    """float32's accuracy under "highest" (torch's default: three TF32 products), one TF32 product under
    "high"/"medium"."""
    before = torch.get_float32_matmul_precision()
    try:
        for precision, expected in (("highest", "tf32x3"), ("high", "tf32"), ("medium", "tf32")):
            torch.set_float32_matmul_precision(precision)
            for kind in ("forward", "backward"):
                assert launcher.tile_config(kind, torch.float32, 512, interpret=False)["PRECISION"] == expected
            assert launcher.tile_config("forward", torch.float16, 512, interpret=False)["PRECISION"] == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.skipif(DEVICE == "cpu" or triton_kernels is None, reason="TF32 needs a GPU (the interpreter computes IEEE)")
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_triton_float32_under_tf32(case):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        check_against_reference("triton", build_case(case, 97, 130, torch.float32), torch.float32, "none",
                                device=DEVICE, rtol=3e-3)
    finally:
        torch.set_float32_matmul_precision(before)


class _TensorOps(TorchDispatchMode):
    """Records the torch ops that do work (views and dtype queries aside) of the code run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func is torch.ops.aten.promote_types.default):
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 130), (5, 1000), (3, 1), (0, 4)])
def test_the_triton_normalisation_matches_torchs(dtype, shape):
    """triton_kernels.unit_rows (the triton backend's eager normalisation; D = 1000 in two blocks of
    columns) against torch's ops in float64, on a non-contiguous input: the rows and their gradient,
    a zero row and one of norm 1e-14 in float32 (the clamp at 1e-12; in 16-bit the gradient there,
    g / 1e-12, overflows as torch's does), and a row holding a NaN: all of its row and gradient NaN
    (the clamp keeps a NaN norm; one that dropped it would make the row t * 1e12, its gradient 0).
    With create_graph=True the same gradient, and a second derivative raises (the kernel's backward
    has none) rather than leave its share out."""
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(shape[::-1], generator=gen, dtype=torch.float64).t()
    if dtype == torch.float32 and shape[0] >= 3:
        t[1], t[2] = 0.0, t[2] / t[2].norm() * 1e-14
    if shape[0] >= 5:
        t[4, 0] = float("nan")
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = t.to(DEVICE, dtype).requires_grad_()
    y = triton_kernels.unit_rows(x)
    (dx,) = torch.autograd.grad(y, x, g.to(DEVICE, dtype), retain_graph=True)
    t64 = t.clone().requires_grad_()
    (dx64,) = torch.autograd.grad(unit_rows(t64), t64, g)
    assert y.dtype == dx.dtype == dtype and y.shape == dx.shape == shape
    finite = torch.arange(shape[0]) != 4
    if shape[0] >= 5:
        assert y[4].isnan().all() and dx[4].isnan().all() and dx64[4].isnan().all()
    assert_close(y[finite], unit_rows(t)[finite], TOLERANCE[dtype])
    assert_close(dx[finite], dx64[finite], TOLERANCE[dtype])
    (graphed,) = torch.autograd.grad(y, x, g.to(DEVICE, dtype), create_graph=True)
    torch.testing.assert_close(graphed, dx, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(graphed.square().sum(), x)


@pytest.mark.skipif(**TRITON_MISSING)
@pytest.mark.parametrize("case,rows,most", [("self", 2, 30), ("memory_bank", 4, 50)])
def test_an_eager_triton_step_issues_few_torch_ops(monkeypatch, case, rows, most):
    """On a GPU each torch op is a launch that costs the host several microseconds, and up to
    B = 16384 the host's time to issue an eager step is a large part of it (docs/benchmarks.md). One
    eager forward and backward after a first call (normalised 16-bit rows, "mean", the fused
    backward; the chunked one, a GPU's default, issues its cuBLAS products and buffers besides)
    issues the loss's 5 kernel launches (6 in the self case: its label order), `rows` of the row
    kernels (the batch's normalisation forward and backward; the bank's norms, and its unit rows for
    the fused backward's product) and at most `most` other torch ops (the gradient's scaling by
    grad_output among them). The kernels are stubbed out, but for label_order_kernel, whose order the
    backward's plan reads."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "0")
    launched = []
    launch = launcher.Launch.__call__

    def stub(self):
        launched.append(self.kernel)
        if self.kernel is row_kernels.label_order_kernel:  # (it runs, uncounted: the backward's plan reads its order)
            with _disable_current_modes():
                launch(self)

    monkeypatch.setattr(launcher.Launch, "__call__", stub)
    x, labels = make_batch(97, 128, 12, dtype=torch.float16)
    x, labels = x.to(DEVICE).requires_grad_(), labels.to(DEVICE)
    bank = {}
    if case == "memory_bank":  # no gradient for the bank
        ref, ref_labels = make_batch(300, 128, 12, dtype=torch.float16, seed=1)
        bank = dict(ref_embeddings=ref.to(DEVICE), ref_labels=ref_labels.to(DEVICE))
    multi_similarity_loss(x, labels, backend="triton", **bank).backward()  # (a first call makes what steps reuse)
    launched.clear()
    x.grad = None
    with _TensorOps() as tensor_ops:
        multi_similarity_loss(x, labels, backend="triton", **bank).backward()
    assert len(launched) == 5 + (case == "self") + rows
    assert len(tensor_ops.names) <= most, " ".join(tensor_ops.names)

