"""The fused CPU operator against the float64 reference: loss and gradients over every option."""
import pytest
import torch
import torch.nn.functional as F

import ms_loss_cuda
from ms_loss_cuda import multi_similarity_loss, ops

from conftest import assert_close, build_case, check_against_reference, loss_and_grads, make_batch, threshold_crossing

pytestmark = pytest.mark.skipif(ops.LOAD_ERROR is not None, reason=f"extension not built: {ops.LOAD_ERROR}")

def test_the_op_names_the_shapes_it_refuses():
    """A direct call with labels of the wrong length gets an error that prints both shapes. Printing a
    number from the extension crashes the process when _C.so carries its own statically linked
    libstdc++ (a build by another compiler than torch's, such as a GPU image's /opt/gcc): its
    iostreams are never set up."""
    x, labels = make_batch(16, 8, 3, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"got \[16, 8\] and \[15\]"):
        ops.forward_op(x, labels[:-1], None, None, None, None, 2.0, 50.0, 0.5, 0.1, True, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("case", ["self", "self_ids", "ref", "ref_ids", "ref_own_copy"])
def test_matches_reference(case, mining, reduction, dtype):
    kwargs = build_case(case, 97, 130, dtype)
    ref_loss, ref_grads = check_against_reference("cpu", kwargs, dtype, reduction, mining=mining)
    assert ref_loss.abs().sum() > 0 and ref_grads[0].abs().sum() > 0  # the case is not trivial


@pytest.mark.parametrize("reduction", ["none", "mean"])  # the self case's backward differs (see below)
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_options(case, skip, normalize, reduction):
    kwargs = build_case(case, 61, 7, torch.float32, seed=3)
    kwargs["labels"] = kwargs["labels"].clone()
    kwargs["labels"][:5] = 1000 + torch.arange(5)  # anchors without positives: with skip, they do not count
    if not normalize:
        kwargs["embeddings"] = F.normalize(kwargs["embeddings"], dim=1) * 0.9
    check_against_reference("cpu", kwargs, torch.float32, reduction, skip_incomplete_anchors=skip, normalize=normalize,
                            alpha=3.0, beta=20.0, base=0.4, epsilon=0.05)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("mining", [True, False])
def test_large_exponents(mining, reduction):
    """Pair exponents above 60 (beta = 250, base = 0: up to 75 here): the self case's passes shift every exponent by
    its anchor's largest instead of sharing one unshifted exponential."""
    kwargs = build_case("self", 97, 130, torch.float64, seed=8)
    check_against_reference("cpu", kwargs, torch.float64, reduction, mining=mining, beta=250.0, base=0.0)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_unnormalised_rows_of_large_norm(monkeypatch, case, recompute):
    """Rows of norm 30 compared as they are: exponents beta (S - base) up to about 45,000, where half an
    ulp is 2e-3. The hardest pair's exponent must be rounded alike in the shifts, the sums and the
    weights (setup.py, ms_math.h), or each anchor's weights are off by up to that, relative."""
    if recompute:
        monkeypatch.setenv("MS_LOSS_CPU_SAVED_MB", "0")
    kwargs = build_case(case, 67, 40, torch.float64, seed=12)
    for name in ("embeddings", "ref_embeddings"):
        if name in kwargs:
            kwargs[name] = (30 * F.normalize(kwargs[name], dim=1)).float()
    for reduction in ("mean", "none"):
        check_against_reference("cpu", kwargs, torch.float32, reduction, normalize=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_huge_similarity_between_equal_identities_stays_out(dtype):
    """Two rows of one identity with a similarity of 400 (unnormalised) and different labels: the pair
    is never weighted, and its exponent (about 20000) must not turn into inf * 0 = NaN."""
    gen = torch.Generator().manual_seed(2)
    x = torch.zeros(40, 9, dtype=torch.float64)
    x[:, 1:] = F.normalize(torch.randn(40, 8, generator=gen, dtype=torch.float64), dim=1)
    x[:2] = 0
    x[:2, 0] = 20.0
    labels, ids = torch.arange(40) % 8, torch.arange(40)
    ids[1] = 0
    kwargs = dict(embeddings=x.to(dtype), labels=labels, ids=ids)
    check_against_reference("cpu", kwargs, dtype, "mean", normalize=False, base=3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_pair_the_backward_puts_across_a_threshold_gets_no_weight(monkeypatch, dtype):
    """A backward that recomputes S (MS_LOSS_CPU_SAVED_MB=0) may sum it in another order than its
    forward did. An anchor whose mined sets are empty in the forward, with a negative that crosses
    the threshold in the backward, must still get no weight there: the forward saves an empty set's
    LP and LN as +inf. The ops are given a negative moved by about 1e-3 in between; without the
    sentinel the gradient is about 4."""
    monkeypatch.setenv("MS_LOSS_CPU_SAVED_MB", "0")
    x, bank, moved, labels, ref_labels, hyper = threshold_crossing(dtype)
    loss, stats = torch.ops.ms_loss_cuda.ms_loss_forward(x, labels, None, bank, ref_labels, None, *hyper)
    assert stats.shape == (4, 1) and stats[2:].isinf().all()  # (recomputing; both sets empty)
    grad_x, _ = torch.ops.ms_loss_cuda.ms_loss_backward(torch.ones_like(loss), stats, x, labels, None, moved,
                                                        ref_labels, None, *hyper, False)
    assert loss.item() == 0 and torch.equal(grad_x, torch.zeros_like(grad_x))


@pytest.mark.parametrize("budget", ["abc", "-5", "nan", "inf", "1e13", "12MB"])
def test_a_budget_that_is_not_a_number_of_mib_is_refused(monkeypatch, budget):
    monkeypatch.setenv("MS_LOSS_CPU_SAVED_MB", budget)
    x, labels = torch.randn(8, 4), torch.arange(8) // 2
    with pytest.raises(RuntimeError, match=f"MS_LOSS_CPU_SAVED_MB must be a number of MiB >= 0 .*got '{budget}'"):
        ms_loss_cuda.multi_similarity_loss(x, labels, backend="cpu")


@pytest.mark.parametrize("batch,dim", [(1, 3), (2, 1), (2, 3), (97, 1), (97, 3), (97, 130), (1031, 3), (1031, 130)])
@pytest.mark.parametrize("mining", [True, False])
def test_sizes(batch, dim, mining):
    for case in ("self", "ref"):
        check_against_reference("cpu", build_case(case, batch, dim, torch.float32, seed=batch), torch.float32, mining=mining)


@pytest.mark.parametrize("mining,mode", [(True, "dense"), (False, "dense"), (True, "sparse"), (True, "recompute")])
def test_several_row_chunks(monkeypatch, mining, mode):
    # 4500 x 4500 float64 similarities do not fit one 64 MiB chunk: rows go in 3 chunks (sparse,
    # recompute); the dense self case keeps K = G + G^T in 18 strips (a partial last one).
    _set_budget(monkeypatch, mode, 4500, 4500, 8, True)
    x, labels = make_batch(4500, 8, 1125, dtype=torch.float64, seed=7, spread=0.4)  # mining keeps about 4%
    _, stats = torch.ops.ms_loss_cuda.ms_loss_forward(F.normalize(x, dim=1), labels, None, None, None, None,
                                                      2.0, 50.0, 0.5, 0.1, mining, False)
    assert _saved_code(stats, 4500) == {"dense": 5 if mining else 4, "sparse": 2, "recompute": 0}[mode]
    # the dense self case's backward has a path for one grad_output shared by all anchors (K's product)
    # and one for a grad_output each; the others have only the second
    for reduction in ("mean", "none") if mode == "dense" else ("none",):
        check_against_reference("cpu", dict(embeddings=x, labels=labels), torch.float64, reduction, mining=mining)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs_compute_in_float32(dtype):
    kwargs = build_case("ref_ids", 97, 130, torch.float64, seed=5)
    for key in ("embeddings", "ref_embeddings"):  # unit rows, exactly representable in `dtype`
        kwargs[key] = F.normalize(kwargs[key], dim=1).to(dtype)
    check_against_reference("cpu", kwargs, dtype, "none", normalize=False)


def test_int32_labels_and_non_contiguous_inputs():
    kwargs = build_case("ref_ids", 97, 130, torch.float32, seed=9, labels_dtype=torch.int32)
    wide = torch.randn(97, 260, dtype=torch.float32)
    wide[:, ::2] = kwargs["embeddings"]
    kwargs["embeddings"] = wide[:, ::2]  # stride 2
    kwargs["ref_embeddings"] = kwargs["ref_embeddings"].T.contiguous().T  # column-major
    kwargs["ids"] = kwargs["ids"].to(torch.int32)
    assert not kwargs["embeddings"].is_contiguous() and not kwargs["ref_embeddings"].is_contiguous()
    check_against_reference("cpu", kwargs, torch.float32, "sum")


def test_own_copy_in_reference_set_is_skipped():
    # A bank that is a copy of the batch, with the batch's identities, gives the self-case loss:
    # each anchor's own copy is skipped by identity, not by comparing its similarity with 1.
    x, labels = make_batch(40, 8, 5, seed=2)
    ids = torch.randperm(40, generator=torch.Generator().manual_seed(0)) + 100
    for backend in ("cpu", "reference"):
        bank = multi_similarity_loss(x, labels, ref_embeddings=x.clone(), ref_labels=labels, ids=ids, ref_ids=ids,
                                     backend=backend, reduction="none")
        self_case = multi_similarity_loss(x, labels, backend=backend, reduction="none")
        assert self_case.abs().sum() > 0
        torch.testing.assert_close(bank, self_case, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mining", [True, False])
def test_gradcheck_fused_op(mining):
    kwargs = build_case("ref_ids", 11, 3, torch.float64, seed=4)
    x, ref = kwargs.pop("embeddings").requires_grad_(), kwargs.pop("ref_embeddings").requires_grad_()
    fn = lambda a, b: multi_similarity_loss(a, ref_embeddings=b, backend="cpu", mining=mining, beta=5.0, **kwargs)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, ref))
    x2, labels = make_batch(11, 3, 3, seed=6)
    fn_self = lambda a: multi_similarity_loss(a, labels, backend="cpu", mining=mining, beta=5.0, reduction="none")  # noqa: E731
    assert torch.autograd.gradcheck(fn_self, (x2.requires_grad_(),))


@pytest.fixture
def threads(request):
    """torch's intra-op threads for one test (`make test` gives each pytest-xdist worker one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 3], indirect=True)
def test_backward_is_bitwise_deterministic(threads):
    """The same bits on every run for a given number of threads (the BLAS products' blocking may
    change with it), and, with several, the parallel loops still match the reference."""
    kwargs = build_case("self", 1031, 130, torch.float32, seed=8)
    ref_kwargs = build_case("ref_ids", 1031, 64, torch.float32, seed=8)
    for k in (kwargs, ref_kwargs):
        first = loss_and_grads(k, "cpu", torch.ones_like)
        for _ in range(2):
            again = loss_and_grads(k, "cpu", torch.ones_like)
            assert torch.equal(first[0], again[0])
            assert all(torch.equal(a, b) for a, b in zip(first[1], again[1]))
        check_against_reference("cpu", k, torch.float32, "none")


def op_args(case):
    kwargs = build_case(case, 29, 16, torch.float32, seed=1)
    x = F.normalize(kwargs["embeddings"], dim=1).requires_grad_()
    ref = kwargs.get("ref_embeddings")
    ref = None if ref is None else F.normalize(ref, dim=1).requires_grad_()
    return (x, kwargs["labels"], kwargs.get("ids"), ref, kwargs.get("ref_labels"), kwargs.get("ref_ids"),
            2.0, 50.0, 0.5, 0.1, True, False)


@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_opcheck(case):
    args = op_args(case)
    torch.library.opcheck(torch.ops.ms_loss_cuda.ms_loss_forward.default, args)
    loss, stats = torch.ops.ms_loss_cuda.ms_loss_forward(*args)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.ms_loss_cuda.ms_loss_backward.default,
                          (torch.rand_like(loss), stats.detach()) + detached)


def test_a_bank_that_takes_no_gradient_gets_none():
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in op_args("ref_ids"))
    loss, stats = torch.ops.ms_loss_cuda.ms_loss_forward(*args)
    grad = torch.rand_like(loss)
    full = torch.ops.ms_loss_cuda.ms_loss_backward(grad, stats, *args)
    bank = torch.ops.ms_loss_cuda.ms_loss_backward(grad, stats, *args, False)
    assert bank[1].numel() == 0 and full[1].shape == args[3].shape and torch.equal(bank[0], full[0])
    torch.library.opcheck(torch.ops.ms_loss_cuda.ms_loss_backward.default, (grad, stats) + args + (False,))


def test_torch_compile_of_public_function():
    kwargs = build_case("ref_ids", 64, 32, torch.float32, seed=12)
    compiled = torch.compile(ms_loss_cuda.multi_similarity_loss, backend="aot_eager", fullgraph=True)
    x = kwargs.pop("embeddings").requires_grad_()
    loss = compiled(x, backend="cpu", **kwargs)
    (grad,) = torch.autograd.grad(loss, x)
    x_eager = x.detach().clone().requires_grad_()
    eager = multi_similarity_loss(x_eager, backend="cpu", **kwargs)
    (grad_eager,) = torch.autograd.grad(eager, x_eager)
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(grad, grad_eager)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("case", ["self", "bank", "ref"])
def test_the_eager_node_is_the_ops_path(monkeypatch, case, normalize, reduction, dtype):
    """An eager call (ops.eager_loss, one autograd node) gives the bits of the path that torch.compile
    traces (the ops with torch's normalisation, reduction and cast; ops.traced patched to True), for a
    grad_output other than 1, with a bank (no gradient) and a reference set that takes one; and both
    are NaN for a row holding an infinity."""
    kwargs = build_case("self" if case == "self" else "ref_ids", 53, 19, dtype, seed=5)
    grad_output = torch.rand(53 if reduction == "none" else (), dtype=dtype) + 0.5
    inputs = [kwargs.pop("embeddings").requires_grad_()]
    if case == "ref":
        inputs.append(kwargs.pop("ref_embeddings").requires_grad_())

    def run(traced):
        monkeypatch.setattr(ops, "traced", lambda: traced)
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        loss = multi_similarity_loss(*leaves[:1], **({"ref_embeddings": leaves[1]} if case == "ref" else {}),
                                     **kwargs, normalize=normalize, reduction=reduction, backend="cpu")
        return (loss, *torch.autograd.grad(loss, leaves, grad_output))

    eager, traced = run(False), run(True)
    assert eager[1].abs().sum() > 0
    for i, (a, b) in enumerate(zip(eager, traced)):
        assert a.dtype == b.dtype
        if i and normalize and dtype == torch.float16:  # (the eager node rounds the gradient once, the ops twice)
            torch.testing.assert_close(a, b, rtol=2 ** -9, atol=2 ** -9 * b.abs().max().item())
        else:
            assert torch.equal(a, b)
    inputs[-1] = inputs[-1].detach().clone()
    inputs[-1][3, 0] = float("inf")
    assert run(False)[0].isnan().all() and run(True)[0].isnan().all()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_a_scaled_float16_gradient_that_fits_float16_stays_finite(backend, reduction):
    """Rows of norm about 12 and a loss scaled by 2^16 (a GradScaler's start; under autocast the loss
    is float32): the gradient of the unit rows is about 12 times the embeddings' and passes float16's
    65,504 where the embeddings' does not; the normalisation's backward divides it in float32 and
    rounds once, so the float16 gradient is the float64 one, where rounding it first gave inf and NaN."""
    x, labels = make_batch(32, 16, 8, dtype=torch.float64, seed=3)
    norms = 12 + torch.rand(32, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x = (norms * F.normalize(x, dim=1)).half()
    grad_output = torch.full((32,) if reduction == "none" else (), 2.0 ** 16, dtype=torch.float64)
    wide = x.double().requires_grad_()  # (the float16 rows themselves, in float64)
    (expected,) = torch.autograd.grad(multi_similarity_loss(wide, labels, reduction=reduction, backend="reference"),
                                      wide, grad_output)
    assert 2 ** 12 < expected.abs().max() < 65504
    half = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = multi_similarity_loss(half, labels, reduction=reduction, backend=backend)
    (got,) = torch.autograd.grad(loss, half, grad_output.float())
    assert torch.isfinite(got).all()
    assert_close(got, expected, 2e-3)


@pytest.mark.parametrize("case", ["self", "ref"])
def test_sparse_backward_path(case):
    # Well separated classes of 4: mining keeps far fewer than 1 pair in 16, so the backward takes
    # the sparse product (the dense GEMM path is covered by mining=False above).
    x, labels = make_batch(1031, 64, 258, spread=0.6, seed=13)
    kwargs = dict(embeddings=x, labels=labels)
    if case == "ref":
        noise = torch.randn(500, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        kwargs.update(ref_embeddings=x[:500] + 0.6 * noise, ref_labels=labels[:500])
    xn = F.normalize(x, dim=1)
    rn = xn if case == "self" else F.normalize(kwargs["ref_embeddings"], dim=1)
    s = xn @ rn.T
    pos, neg = ms_loss_cuda.reference.pair_masks(labels, kwargs.get("ref_labels"))
    minpos = torch.where(pos, s, torch.inf).amin(1, keepdim=True)
    maxneg = torch.where(neg, s, -torch.inf).amax(1, keepdim=True)
    kept = (pos & (s - 0.1 < maxneg)) | (neg & (s + 0.1 > minpos))
    assert 0 < kept.sum() * 2 < s.numel() / 16  # G + G^T has at most twice as many non-zeros
    check_against_reference("cpu", kwargs, torch.float64, "none")
    check_against_reference("cpu", {k: (v.float() if v.is_floating_point() else v) for k, v in kwargs.items()},
                            torch.float32, "mean")


# ---- the pair weights the forward keeps: dense, sparse (CSR) or none (recomputed) ---------------
SAVED_CODES = {"dense": 1, "sparse": 2, "overflow": 3, "symmetric": 4, "symmetric gathers": 5}  # (the self case's K)


def _set_budget(monkeypatch, mode, batch, ref_rows, elem_size, self_case):
    """Sets MS_LOSS_CPU_SAVED_MB so that the forward keeps its weights `mode`-wise: sparse with room for
    about half of the dense payload (B x R, or the self case's triangle), which does not fit then
    (mining keeps fewer pairs; without mining the forward overflows and the backward recomputes)."""
    monkeypatch.setenv("MS_LOSS_CPU_SAVED_MB", "0" if mode == "recompute" else "256")
    if mode == "sparse":  # one row of stats short of the dense payload: capacity (elements - 1 - (B + 1)) / 2
        elements = (ops.cpu_saved_rows(batch, ref_rows, elem_size, self_case) - 1) * batch
        monkeypatch.setenv("MS_LOSS_CPU_SAVED_MB", repr(elements * elem_size / 2 ** 20))


def _saved_code(stats, batch):
    return 0 if stats.shape[0] == 4 else int(stats.reshape(-1)[4 * batch].item())


def _clustered(case, dtype):
    """97 anchors (and a reference set of 60) around the same class centres: mining keeps about 3.5% of
    the pairs (under 1 in 16, where the forward keeps a sparse payload rather than recompute)."""
    x, labels = make_batch(157, 24, 30, dtype=dtype, seed=21, spread=0.8)
    kwargs = dict(embeddings=x[:97], labels=labels[:97])
    if case == "ref_ids":
        kwargs.update(ref_embeddings=x[97:], ref_labels=labels[97:], ids=torch.arange(97), ref_ids=torch.arange(97, 157))
    return kwargs


@pytest.mark.parametrize("mode", ["dense", "sparse", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_saved_weights_every_mode(monkeypatch, mode, case, mining, dtype):
    kwargs = _clustered(case, dtype)
    ref_rows = kwargs["ref_embeddings"].shape[0] if "ref_embeddings" in kwargs else 97
    _set_budget(monkeypatch, mode, 97, ref_rows, dtype.itemsize, case == "self")
    x = F.normalize(kwargs["embeddings"], dim=1)
    ref = F.normalize(kwargs["ref_embeddings"], dim=1) if "ref_embeddings" in kwargs else None
    _, stats = torch.ops.ms_loss_cuda.ms_loss_forward(x, kwargs["labels"], kwargs.get("ids"), ref,
                                                      kwargs.get("ref_labels"), kwargs.get("ref_ids"),
                                                      2.0, 50.0, 0.5, 0.1, mining, False)
    dense = (5 if mining else 4) if case == "self" else 1  # (mining keeps few pairs: K's backward gathers)
    expected = {"dense": [dense], "recompute": [0], "sparse": [2] if mining else [3]}[mode]
    assert _saved_code(stats, 97) in expected
    assert stats.shape == (4 + ms_loss_cuda.ops.cpu_saved_rows(97, ref_rows, dtype.itemsize, case == "self"), 97)
    for reduction in ("sum", "none"):
        check_against_reference("cpu", kwargs, dtype, reduction, mining=mining)


@pytest.mark.parametrize("mode", ["dense", "sparse", "overflow"])
@pytest.mark.parametrize("case", ["self", "ref"])
def test_a_reused_buffer_gives_the_same_bits(monkeypatch, mode, case):
    """The forward reuses the last freed buffer of saved weights (over 2 MiB): every element of stats
    is written again, whatever the buffer held."""
    monkeypatch.setenv("MS_LOSS_CPU_SAVED_MB", "256" if mode == "dense" else "3")
    batch = 1600 if case == "self" else 1100  # (the self case's triangle: 5.6 MB, over the 3 MB budget)
    data, data_labels = make_batch(2500, 16, 300, dtype=torch.float32, seed=4, spread=0.2 if mode == "sparse" else 1.0)
    data = F.normalize(data, dim=1)

    def forward(seed):  # (the rows in another order for another seed)
        order = torch.randperm(2500, generator=torch.Generator().manual_seed(seed))
        x, labels = data[order], data_labels[order]
        ref, ref_labels = (None, None) if case == "self" else (x[batch:batch + 900], labels[batch:batch + 900])
        return torch.ops.ms_loss_cuda.ms_loss_forward(x[:batch], labels[:batch], None, ref, ref_labels, None,
                                                      2.0, 50.0, 0.5, 0.1, mode != "overflow", False)

    out = forward(0)
    first, buffer = [t.clone() for t in out], out[1].data_ptr()
    assert first[1].numel() * 4 > 2 << 20
    expected = {"dense": (4, 5) if case == "self" else (1,), "sparse": (2,), "overflow": (3,)}[mode]
    assert _saved_code(first[1], batch) in expected
    del out
    other = forward(1)  # other contents in the same buffer
    assert other[1].data_ptr() == buffer and not torch.equal(other[1], first[1])
    del other
    again = forward(0)
    assert again[1].data_ptr() == buffer
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.parametrize("batch", [1, 2, 127, 128, 129, 600, 2048, 2049, 2300])
def test_fake_kernel_knows_the_triangle(batch):
    """The self case's saved triangle (strips of 128 rows up to B = 2048, then 256) has the size the
    fake kernel predicts."""
    x, labels = make_batch(batch, 5, 7, dtype=torch.float32, seed=batch)
    _, stats = torch.ops.ms_loss_cuda.ms_loss_forward(F.normalize(x, dim=1), labels, None, None, None, None,
                                                      2.0, 50.0, 0.5, 0.1, True, False)
    assert stats.shape == (4 + ms_loss_cuda.ops.cpu_saved_rows(batch, batch, 4, True), batch)
    assert _saved_code(stats, batch) in (SAVED_CODES["symmetric"], SAVED_CODES["symmetric gathers"])


@pytest.mark.parametrize("mode", ["dense", "sparse"])
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_saved_weights_are_deterministic_and_pass_opcheck(monkeypatch, mode, case):
    kwargs = _clustered(case, torch.float32)
    x = F.normalize(kwargs["embeddings"], dim=1).requires_grad_()
    ref = F.normalize(kwargs["ref_embeddings"], dim=1).requires_grad_() if "ref_embeddings" in kwargs else None
    args = (x, kwargs["labels"], kwargs.get("ids"), ref, kwargs.get("ref_labels"), kwargs.get("ref_ids"),
            2.0, 50.0, 0.5, 0.1, True, False)
    _set_budget(monkeypatch, mode, 97, 97 if ref is None else ref.shape[0], 4, ref is None)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    loss, stats = torch.ops.ms_loss_cuda.ms_loss_forward(*detached)
    assert _saved_code(stats, 97) == SAVED_CODES["symmetric gathers" if mode == "dense" and ref is None else mode]
    torch.library.opcheck(torch.ops.ms_loss_cuda.ms_loss_forward.default, args)
    for grad in (torch.rand_like(loss), torch.full_like(loss, 0.37)):  # one grad_output each, or the same
        first = torch.ops.ms_loss_cuda.ms_loss_backward(grad, stats, *detached)
        for _ in range(2):
            again_loss, again_stats = torch.ops.ms_loss_cuda.ms_loss_forward(*detached)
            assert torch.equal(again_loss, loss) and torch.equal(again_stats, stats)
            again = torch.ops.ms_loss_cuda.ms_loss_backward(grad, again_stats, *detached)
            assert all(torch.equal(a, b) for a, b in zip(again, first))
        torch.library.opcheck(torch.ops.ms_loss_cuda.ms_loss_backward.default, (grad, stats) + detached)


def test_a_second_backward_sees_the_same_saved_weights():
    """retain_graph: the backward never changes what the forward saved."""
    x, labels = make_batch(50, 8, 7, dtype=torch.float32)
    x.requires_grad_()
    loss = multi_similarity_loss(x, labels, backend="cpu")
    (first,) = torch.autograd.grad(loss, x, retain_graph=True)
    (second,) = torch.autograd.grad(loss, x)
    assert torch.equal(first, second)
