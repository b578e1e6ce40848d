"""The parity suite: every fused backend against the float64 reference, through the public API and the ops.

Each test runs for every target this machine can run (tests/targets.py): the fused CPU kernel, the
Triton backend with its fused and its chunked backward, the CUDA kernels on a GPU, and the CUDA
kernels emulated on the CPU. Data has structure (classes whose mined sets are real subsets),
sizes leave partial tiles, and every reduction and a grad_output other than 1 are checked.
"""
import threading

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ms_loss_cuda import backends, multi_similarity_loss, ops

from conftest import assert_close, build_case, loss_and_grads, make_batch, to
from targets import DEVICE, REDUCTIONS, TOLERANCE, check, emulated_cuda_ops, in_turn, target  # noqa: F401 (fixtures)


@pytest.mark.parametrize("case,mining,reduction",
                         in_turn(REDUCTIONS, ["self", "self_ids", "ref", "ref_ids", "ref_own_copy"], [True, False]))
def test_matches_reference(target, case, mining, reduction):
    # 97 rows and D = 130 leave partial row, column and K tiles, and split D over two programs
    kwargs = build_case(case, 97, 130, torch.float32)
    ref_loss, ref_grads = check(target, kwargs, torch.float32, reduction, mining=mining)
    assert ref_loss.abs().sum() > 0 and ref_grads[0].abs().sum() > 0  # the case is not trivial


@pytest.mark.parametrize("dtype,mining,reduction", in_turn(REDUCTIONS, [torch.float32, torch.float16], [True, False]))
def test_a_memory_bank_matches_reference(target, dtype, mining, reduction):
    # a bank that takes no gradient, holding the batch's own rows (skipped by identity) and 51 more:
    # 148 columns, several chunks in the chunked backward
    ref_loss, ref_grads = check(target, build_case("ref_own_copy", 97, 130, dtype), dtype, reduction, mining=mining,
                                ref_grad=False)
    assert len(ref_grads) == 1 and ref_grads[0].abs().sum() > 0


def twin_classes_case(batch=97, dim=64, duplicates=10):
    """A self case whose hardest negatives sit next to the anchor in label order (classes 2k and 2k + 1
    have nearly the same centre), so inside a row block's positive range, and whose last rows are
    near-copies of the first under a distant label with the same identity (pairs to skip, which
    would be the hardest negatives of all)."""
    gen = torch.Generator().manual_seed(5)
    classes = batch // 4
    labels = torch.randint(0, classes, (batch,), generator=gen)
    centres = torch.randn(classes, dim, generator=gen, dtype=torch.float64)
    centres[1::2] = centres[0:-1:2] + 0.3 * torch.randn(classes // 2, dim, generator=gen, dtype=torch.float64)
    x = centres[labels] + 0.5 * torch.randn(batch, dim, generator=gen, dtype=torch.float64)
    ids = torch.arange(batch)
    copies = slice(batch - duplicates, batch)
    x[copies] = x[:duplicates] + 0.01 * torch.randn(duplicates, dim, generator=gen, dtype=torch.float64)
    labels[copies] = (labels[:duplicates] + classes // 2) % classes
    ids[copies] = ids[:duplicates]
    return dict(embeddings=x.float(), labels=labels, ids=ids)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("mining", [True, False])
def test_hard_negatives_in_the_positive_range_and_skipped_identities(target, mining, reduction):
    # (the self case's negatives kernel leaves each block's positive range to the positive kernels, and
    # compares identities only when the caller gives them; float32: the near-copies' similarities are too
    # steep under beta = 50 for 16-bit rounding to meet a tolerance)
    check(target, twin_classes_case(), torch.float32, reduction, mining=mining)


# (several row blocks and D split over two programs together: test_matches_reference's 97 x 130)
# (each size with one (mining, reduction) in turn: "none" gives each anchor its own grad_output, which
# the fused backwards take on another path than the one value of "mean" and "sum")
@pytest.mark.parametrize("batch,dim,mining_reduction",
                         in_turn([(True, "none"), (False, "mean"), (True, "sum"), (False, "none"), (True, "mean"),
                                  (False, "sum")],
                                 [(1, 3), (2, 3), (2, 64), (37, 3), (37, 130), (97, 64), (300, 3)]))
def test_sizes(target, batch, dim, mining_reduction):
    mining, reduction = mining_reduction
    for case in ("self", "ref"):
        check(target, build_case(case, batch, dim, torch.float32, seed=batch), torch.float32, reduction,
              mining=mining)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
# D = 300: several column blocks of D; B = 300: several row blocks of the GPU's 16-bit tiles too
@pytest.mark.parametrize("case,batch,dim,mining",
                         in_turn([True, False], ["self", "ref_ids"], [(97, 130), (37, 300), (300, 64)]))
def test_16_bit_inputs(target, case, batch, dim, mining, dtype):
    kwargs = build_case(case, batch, dim, torch.float64, seed=5)
    for key in ("embeddings", "ref_embeddings"):  # unit rows, exactly representable in `dtype`
        if key in kwargs:
            kwargs[key] = F.normalize(kwargs[key], dim=1).to(dtype)
    check(target, kwargs, dtype, "none", normalize=False, mining=mining)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_16_bit_rows_that_the_loss_normalises(target, case, dtype):
    """16-bit rows as a model gives them, normalised by the loss (the default): every backend rounds
    the unit rows to the rows' dtype, as the reference backend does on the same rows, from where both
    compute in float32; so they agree to the 16-bit gradient's rounding."""
    kwargs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in build_case(case, 97, 130, torch.float32,
                                                                                      seed=12).items()}
    grad_output = lambda loss: torch.full_like(loss, 0.7)  # noqa: E731
    loss, grads = loss_and_grads(to(kwargs, target.device), target.backend, grad_output)
    ref_loss, ref_grads = loss_and_grads(kwargs, "reference", grad_output)
    assert_close(loss, ref_loss, TOLERANCE[dtype])
    for g, ref_g in zip(grads, ref_grads, strict=True):
        assert_close(g, ref_g, TOLERANCE[dtype])


def test_mixed_input_dtypes(target):
    kwargs = build_case("ref", 37, 64, torch.float32, seed=6)
    kwargs["embeddings"] = F.normalize(kwargs["embeddings"], dim=1).half()
    check(target, kwargs, torch.float16, normalize=False)


def test_int32_keys_and_non_contiguous_inputs(target):
    kwargs = build_case("ref_ids", 97, 64, torch.float32, seed=9, labels_dtype=torch.int32)
    kwargs["ref_embeddings"] = kwargs["ref_embeddings"].T.contiguous().T  # column-major
    kwargs["ids"] = kwargs["ids"].to(torch.int32)
    check(target, kwargs, torch.float32, "sum")


def test_misaligned_rows_give_the_same_result(target):
    # (called on the ops: the public function would hand them a normalised, fresh copy)
    x, labels = make_batch(97, 64, 16, dtype=torch.float32)
    x, labels = F.normalize(x, dim=1).to(target.device), labels.to(target.device)
    shifted = torch.zeros(x.numel() + 1, device=target.device)[1:].view_as(x).copy_(x)  # 4 bytes off 16
    args = (labels, None, None, None, None, 2.0, 50.0, 0.5, 0.1, True, False)
    loss, stats = target.forward(x, *args)
    shifted_loss, shifted_stats = target.forward(shifted, *args)
    same = dict(rtol=1e-6, atol=1e-7)  # (Triton may compile another variant for an unaligned pointer)
    torch.testing.assert_close(shifted_loss, loss, **same)
    torch.testing.assert_close(shifted_stats, stats, **same)
    grad = target.backward(torch.ones_like(loss), stats, x, *args)[0]
    shifted_grad = target.backward(torch.ones_like(loss), stats, shifted, *args)[0]
    if target.chunked:  # (so may cuBLAS: small entries that cancel compare at the tensor's scale)
        assert_close(shifted_grad, grad, 1e-6)
    else:
        torch.testing.assert_close(shifted_grad, grad, **same)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_options(target, case, skip):
    kwargs = build_case(case, 61, 7, torch.float32, seed=3)
    kwargs["embeddings"] = F.normalize(kwargs["embeddings"], dim=1) * 0.9
    check(target, kwargs, torch.float32, "none", skip_incomplete_anchors=skip, normalize=False,
          alpha=3.0, beta=20.0, base=0.4, epsilon=0.05)


@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("case", ["self", "ref"])
def test_anchors_without_negatives_or_positives(target, case, skip, mining):
    """Anchors with positives only (a one-class batch; in a reference set, the label of every column)
    and with negatives only (a label no column has): each end's terms alone, or with
    skip_incomplete_anchors nothing, also without mining, where having any pair of a set is what
    counts."""
    kwargs = build_case(case, 45, 8, torch.float32, seed=12)
    if case == "self":
        kwargs["labels"] = torch.zeros_like(kwargs["labels"])
    else:
        kwargs["labels"] = kwargs["labels"] % 2
        kwargs["ref_labels"] = torch.zeros_like(kwargs["ref_labels"])
    check(target, kwargs, torch.float32, "none", skip_incomplete_anchors=skip, mining=mining)


@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_negatives_far_below_base_under_a_steep_beta(target, case):
    """Classes on orthogonal directions (negatives at S ~ 0), base = 0.5, beta = 300, no mining: every
    negative's exponent beta (S - base) is about -150, below float32's range once exponentiated. The
    log-sum-exp must keep its shift at 0 there (log(1 + sum), the 1 being exp(-shift)), not at the
    largest exponent, which would make exp(-shift) overflow."""
    kwargs = build_case(case, 61, 16, torch.float32, seed=21)
    for key, label_key in (("embeddings", "labels"), ("ref_embeddings", "ref_labels")):
        if key in kwargs:  # tight clusters around the class's unit vector (at most 10 classes here)
            kwargs[key] = torch.eye(16)[kwargs[label_key]] + 0.05 * torch.randn(kwargs[key].shape,
                                                                          generator=torch.Generator().manual_seed(3))
    check(target, kwargs, torch.float32, "none", rtol=1e-4, mining=False, beta=300.0, base=0.5)


@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("case", ["self_ids", "ref_ids"])
def test_negatives_above_base_in_every_tile(target, case, mining):
    """Every row leans towards one shared direction, so that pairs of different classes reach S = 0.5
    to 0.95, above base: the negatives' exponents beta (S - base) are positive in every tile and their
    largest keeps rising along a column split (B = 300: under the interpreter the self case's launch
    has three splits of two tiles, the reference set's three of one). The online log-sum-exp must
    rescale what it summed before each new largest, and the splits' sums when it combines them; in the
    other tests the exponents mostly stay below 0, where the shift stays 0 and a missing rescale
    changes nothing (test_sizes catches each with one case at most)."""
    kwargs = build_case(case, 300, 16, torch.float32, seed=9)
    lean = F.normalize(torch.randn(16, generator=torch.Generator().manual_seed(2)), dim=0)
    for key in ("embeddings", "ref_embeddings"):
        if key in kwargs:
            kwargs[key] = F.normalize(kwargs[key], dim=1) + 2.0 * lean
    check(target, kwargs, torch.float32, "none", rtol=1e-4, mining=mining)


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e25), (torch.float16, 5e3)])
def test_rows_whose_norm_overflows_their_dtype(target, dtype, scale):
    """Rows scaled far beyond unit norm normalise to the same rows: float16 rows of norm above 65504
    (a float16 norm is inf, the row 0), float32 rows whose squares overflow float32 (from about 1.8e19
    on; F.normalize makes them 0). The loss is that of the unscaled rows."""
    kwargs = build_case("ref_ids", 61, 130, torch.float64, seed=6)
    for key in ("embeddings", "ref_embeddings"):
        kwargs[key] = (kwargs[key] * scale).to(dtype)
    check(target, kwargs, dtype, "none")


@pytest.mark.parametrize("rows", [[8.0, -8.0, -10.0, -10.5], [10.0, 1.0, 0.5, 0.45]])
def test_empty_mined_sets_with_similarities_far_from_base(target, rows):
    """Rows left unnormalised, so S lies far from base: anchor 0 has a positive and two negatives but
    neither set survives mining. A log-sum-exp shift taken from a set with no members (alpha (base -
    minpos) = 129 in the first batch, beta (maxneg - base) = 225 in the second) makes exp(-shift)
    underflow and its LP or LN -inf; the shift of an empty mined set must be 0."""
    x = torch.tensor(rows).unsqueeze(1) * torch.tensor([[1.0, 0.0]])
    kwargs = dict(embeddings=x, labels=torch.tensor([0, 0, 1, 1]))
    check(target, kwargs, torch.float32, "none", normalize=False)


@pytest.mark.parametrize("ref_grad", [True, False])
def test_empty_reference_set_gives_zero(target, ref_grad):
    x, labels = make_batch(5, 3, 2, dtype=torch.float32)
    loss, grads = loss_and_grads(
        to(dict(embeddings=x, labels=labels, ref_embeddings=torch.zeros(0, 3), ref_labels=labels[:0]), target.device),
        target.backend, torch.ones_like, ref_grad)
    assert loss.item() == 0 and torch.equal(grads[0], torch.zeros_like(grads[0]))
    assert len(grads) == 1 + ref_grad and grads[-1].shape == ((0, 3) if ref_grad else (5, 3))


@pytest.mark.parametrize("with_ref", [False, True])
def test_an_empty_batch_gives_zero(target, with_ref):
    """B = 0 (a process whose share of a gathered batch is empty, say): loss 0, an empty gradient for
    the batch and a zero one for the reference set."""
    kwargs = dict(embeddings=torch.zeros(0, 3), labels=torch.zeros(0, dtype=torch.long))
    if with_ref:
        ref, ref_labels = make_batch(5, 3, 2, dtype=torch.float32)
        kwargs.update(ref_embeddings=ref, ref_labels=ref_labels)
    loss, grads = loss_and_grads(to(kwargs, target.device), target.backend, torch.ones_like, reduction="sum")
    assert loss.item() == 0 and grads[0].shape == (0, 3)
    if with_ref:
        assert grads[1].shape == (5, 3) and grads[1].abs().sum() == 0


def test_backward_is_bitwise_deterministic(target):
    for kwargs in (build_case("self", 300, 64, torch.float32, seed=8), build_case("ref_ids", 300, 64, torch.float32)):
        kwargs = to(kwargs, target.device)
        first = loss_and_grads(kwargs, target.backend, torch.ones_like)
        again = loss_and_grads(kwargs, target.backend, torch.ones_like)
        assert torch.equal(first[0], again[0])
        assert all(torch.equal(a, b) for a, b in zip(first[1], again[1]))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_batched_grad_outputs(target, reduction):
    """Several grad_outputs at once (autograd.grad's is_grads_batched: vmap over the backward, as
    jacobian(vectorize=True) takes it): each slice is that grad_output's gradient. The triton kernels
    take one grad_output at a time: batched ones of "none" are refused, naming what works."""
    kwargs = to(build_case("self", 37, 16, torch.float32, seed=4), target.device)
    x = kwargs.pop("embeddings").requires_grad_()
    loss = multi_similarity_loss(x, **kwargs, reduction=reduction, backend=target.backend)
    grad_outputs = torch.randn(3, *loss.shape, generator=torch.Generator().manual_seed(1)).to(target.device)
    if target.backend == "triton" and reduction == "none":
        with pytest.raises(RuntimeError, match="takes one grad_output at a time"):
            torch.autograd.grad(loss, x, grad_outputs, is_grads_batched=True)
        return
    (batched,) = torch.autograd.grad(loss, x, grad_outputs, retain_graph=True, is_grads_batched=True)
    for grad_output, grad in zip(grad_outputs, batched, strict=True):
        assert_close(grad, torch.autograd.grad(loss, x, grad_output, retain_graph=True)[0], 1e-6)


@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_opcheck(target, case):
    kwargs = to(build_case(case, 29, 16, torch.float32, seed=1), target.device)
    x = F.normalize(kwargs["embeddings"], dim=1).requires_grad_()
    ref = kwargs.get("ref_embeddings")
    ref = None if ref is None else F.normalize(ref, dim=1).requires_grad_()
    args = (x, kwargs["labels"], kwargs.get("ids"), ref, kwargs.get("ref_labels"), kwargs.get("ref_ids"),
            2.0, 50.0, 0.5, 0.1, True, False)
    torch.library.opcheck(target.forward, args)
    loss, stats = target.forward(*args)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(target.backward, (torch.rand_like(loss), stats.detach()) + detached)


@pytest.mark.skipif(ops.LOAD_ERROR is not None, reason="compares with the built extension's CPU kernel")
@pytest.mark.parametrize("case", ["ref_ids", "separated"])
def test_saves_the_cpu_kernels_statistics(target, case):
    if target.name == "cpu":
        pytest.skip("the CPU kernel's statistics are what the others are compared with")
    if case == "separated":  # 16 classes at the corners of a simplex (cosine -1/15): every hardest negative is
        # below 0, so a padded column's S = 0 taken for a negative would show in maxneg
        gen = torch.Generator().manual_seed(4)  # (B = 300: a last tile far from some blocks' positive ranges)
        labels = torch.arange(300) % 16
        corners = F.pad(torch.eye(16) - 1 / 16, (0, 48))
        x = F.normalize(corners[labels] + 0.005 * torch.randn(300, 64, generator=gen), dim=1)
        ref, kwargs = None, dict(labels=labels, ids=None, ref_labels=None, ref_ids=None)
    else:
        kwargs = build_case("ref_ids", 97, 64, torch.float32, seed=4)
        x, ref = F.normalize(kwargs["embeddings"], dim=1), F.normalize(kwargs["ref_embeddings"], dim=1)
    args = (kwargs["labels"], kwargs["ids"], ref, kwargs["ref_labels"], kwargs["ref_ids"], 2.0, 50.0, 0.5, 0.1, True, False)
    on_device = [a.to(target.device) if isinstance(a, torch.Tensor) else a for a in args]
    _, stats = target.forward(x.to(target.device), *on_device)
    _, cpu_stats = torch.ops.ms_loss_cuda.ms_loss_forward(x, *args)  # (then the pair weights it keeps)
    saved = 2 if target.backend == "triton" and ref is None else 0  # (then its label order, checked below)
    assert stats.shape == (4 + saved, x.shape[0])
    # every backend stores an empty mined set's LP or LN as +inf (its weights then 0 in a backward that
    # recomputes S), and only those
    minpos, maxneg = cpu_stats[:2]
    empty = torch.stack([~((minpos < float("inf")) & (minpos - 0.1 < maxneg)),
                         ~((maxneg > -float("inf")) & (maxneg + 0.1 > minpos))])
    assert torch.equal(cpu_stats[2:4] == float("inf"), empty)
    assert empty.any() and empty.all() == (case == "separated")  # (ref_ids: some anchors mine, some do not)
    torch.testing.assert_close(stats[:4].cpu(), cpu_stats[:4], rtol=1e-5, atol=1e-6)


def test_float64_is_refused_with_a_clear_error(target):
    if target.name == "cpu":
        pytest.skip("the CPU kernel takes float64 (tests/test_cpu_kernel.py)")
    x, labels = make_batch(8, 4, 3)
    x, labels = x.to(target.device), labels.to(target.device)
    if target.backend != "cpu":  # (the emulation runs under the name of the cpu backend, which takes float64)
        with pytest.raises(RuntimeError, match=f"backend '{target.backend}' cannot run: .*bfloat16.*float64"):
            multi_similarity_loss(x, labels, backend=target.backend)
    with pytest.raises((TypeError, RuntimeError), match="float64"):  # the op itself refuses it too
        target.forward(x, labels, None, None, None, None, 2.0, 50.0, 0.5, 0.1, True, False)


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("choice", ["target", "auto"])
def test_torch_compile_fullgraph(target, choice, dynamic):
    """One graph that calls the target's fused op, with the eager call's loss and gradient; also with
    dynamic=True, where the default hyper-parameters reach the checks as symbolic floats."""
    if choice == "auto" and backends.resolve("auto", torch.device(target.device), torch.float32).name != target.backend:
        pytest.skip(f"auto takes another backend on {target.device}")
    kwargs = to(build_case("ref_ids", 64, 32, torch.float32, seed=12), target.device)
    backend = target.backend if choice == "target" else "auto"
    graphs = CompileCounterWithBackend("aot_eager")
    torch.compiler.reset()  # (each case compiles multi_similarity_loss anew: past Dynamo's limit of 8 in one worker)
    compiled = torch.compile(multi_similarity_loss, backend=graphs, fullgraph=True, dynamic=dynamic)
    x = kwargs.pop("embeddings").requires_grad_()
    loss = compiled(x, backend=backend, **kwargs)
    (grad,) = torch.autograd.grad(loss, x)
    called = {node.target for graph in graphs.graphs for node in graph.graph.nodes if node.op == "call_function"}
    assert target.forward in called, sorted(map(str, called))
    eager = multi_similarity_loss(x, backend=backend, **kwargs)
    (grad_eager,) = torch.autograd.grad(eager, x)
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(grad, grad_eager)


def test_fake_tensors_take_the_op_and_its_fake_kernel(target):
    """Under torch's tracing modes (here fake tensors) the loss calls the op, whose fake kernels give
    the shapes; the eager path would launch the kernels on tensors without data."""
    x, labels = make_batch(37, 32, 5, dtype=torch.float32)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(x.to(target.device)).requires_grad_()
        loss = multi_similarity_loss(x, mode.from_tensor(labels.to(target.device)), backend=target.backend)
        loss.backward()
    assert isinstance(loss, FakeTensor) and loss.shape == () and x.grad.shape == (37, 32)


@pytest.mark.skipif(DEVICE == "cpu" or ops.LOAD_ERROR is not None, reason="needs a GPU and the CUDA kernels built")
def test_cuda_ops_refuse_tensors_on_another_device():
    x, labels = make_batch(16, 8, 3, dtype=torch.float32)
    hyper = (2.0, 50.0, 0.5, 0.1, True, False)
    with pytest.raises(RuntimeError, match="labels is on cpu"):
        ops.forward_op(x.cuda(), labels, None, None, None, None, *hyper)
    loss, stats = ops.forward_op(x.cuda(), labels.cuda(), None, None, None, None, *hyper)
    with pytest.raises(RuntimeError, match="stats is on cpu"):
        ops.backward_op(torch.ones_like(loss), stats.cpu(), x.cuda(), labels.cuda(), None, None, None, None, *hyper)


@pytest.mark.parametrize("case", ["self", "ref"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3e38])
@pytest.mark.parametrize("normalize", [True, False])
def test_non_finite_embeddings_give_nan_and_huge_finite_ones_do_not(target, case, bad, normalize):
    """NaN or an infinity in the embeddings (or the reference set) makes the loss NaN, every reduction,
    whether the eager triton loss takes its gradients in the forward or not (which finds them, with
    normalisation, in its row kernel); a finite 3e38 (float32's squares overflow) does not."""
    if bad == 3e38 and not normalize:
        pytest.skip("unnormalised, a similarity of 3e38 squared overflows")
    x, labels = make_batch(12, 4, 3, dtype=torch.float32)
    ref, ref_labels = make_batch(9, 4, 3, dtype=torch.float32, seed=1) if case == "ref" else (None, None)
    (x if case == "self" else ref)[3, 1] = bad
    bank = {} if ref is None else dict(ref_embeddings=ref.to(target.device), ref_labels=ref_labels.to(target.device))
    for reduction, requires_grad in (("mean", True), ("sum", False), ("none", True)):
        embeddings = x.to(target.device).requires_grad_(requires_grad)
        loss = multi_similarity_loss(embeddings, labels.to(target.device), backend=target.backend,
                                     normalize=normalize, reduction=reduction, **bank)
        assert (torch.isfinite(loss) if bad == 3e38 else torch.isnan(loss)).all(), (reduction, loss)


@pytest.mark.parametrize("case", ["self", "ref"])
@pytest.mark.parametrize("normalize,entry", [(False, 2e19), (True, 3e38)])
def test_finite_rows_past_float32s_range_give_nan(target, case, normalize, entry):
    """Finite rows whose similarities pass float32's range (compared as they are: x_3 . x_4 = 8e38) or
    whose norm does (normalised: 4.2e38) make the loss NaN. Otherwise the similarity is NaN (inf - inf
    in x_3 . x_5), fails every mining comparison and drops its pairs, or the row divides to zeros:
    a finite, wrong loss."""
    x, labels = make_batch(12, 4, 3, dtype=torch.float32)
    ref, ref_labels = make_batch(9, 4, 3, dtype=torch.float32, seed=1) if case == "ref" else (None, None)
    for rows in (x,) if ref is None else (x, ref):
        for row, signs in ((3, (1, 1)), (4, (1, 1)), (5, (1, -1))):
            rows[row, :2] = torch.tensor(signs, dtype=torch.float32) * entry
    bank = {} if ref is None else dict(ref_embeddings=ref.to(target.device), ref_labels=ref_labels.to(target.device))
    for reduction, requires_grad in (("mean", True), ("sum", False)):
        embeddings = x.to(target.device).requires_grad_(requires_grad)
        loss = multi_similarity_loss(embeddings, labels.to(target.device), backend=target.backend,
                                     normalize=normalize, reduction=reduction, **bank)
        assert torch.isnan(loss), (reduction, loss)


@pytest.mark.parametrize("case", ["self", "ref"])
def test_unnormalised_rows_of_large_norm_give_the_reference_loss(target, case):
    """Rows compared as they are at norm 1e5 (exponents of about 5e11, whose float32 rounding is 2^16):
    every anchor's loss within float32's precision of the float64 reference, never below 0, however each
    kernel rounds the exponent of the hardest pair, which the shift and the sums must agree on."""
    x, labels = make_batch(40, 8, 4, dtype=torch.float32)
    x, bank = F.normalize(x, dim=1) * 1e5, {}
    if case == "ref":
        ref, ref_labels = make_batch(30, 8, 4, dtype=torch.float32, seed=1)
        bank = dict(ref_embeddings=F.normalize(ref, dim=1) * 1e5, ref_labels=ref_labels)
    expected = multi_similarity_loss(x.double(), labels, normalize=False, reduction="none", backend="reference",
                                     **to(bank, "cpu", torch.float64))
    loss = multi_similarity_loss(x.to(target.device), labels.to(target.device), normalize=False, reduction="none",
                                 backend=target.backend, **to(bank, target.device)).cpu()
    assert expected.max() > 1e10 and (loss >= 0).all(), loss
    assert_close(loss, expected, 1e-6)


def test_int64_keys_beyond_the_int32_range(target):
    # Keys equal in their low 32 bits: a kernel that truncated them would merge every class.
    kwargs = build_case("ref_ids", 61, 16, torch.float32, seed=13)
    for key in ("labels", "ref_labels", "ids", "ref_ids"):
        kwargs[key] = kwargs[key] * 2**33 - 7
    check(target, kwargs, torch.float32, "none")


def test_a_bank_that_takes_no_gradient_gets_none(target):
    # ref_grad=False (what autograd asks for when the reference set does not require a gradient, as a
    # memory bank does not): the same dx (bit for bit from the same fused launch; the chunked form
    # sums it over chunks whose size depends on ref_grad), and an empty dref.
    kwargs = to(build_case("ref_ids", 61, 16, torch.float32, seed=14), target.device)
    x, ref = F.normalize(kwargs["embeddings"], dim=1), F.normalize(kwargs["ref_embeddings"], dim=1)
    args = (kwargs["labels"], kwargs["ids"], ref, kwargs["ref_labels"], kwargs["ref_ids"], 2.0, 50.0, 0.5, 0.1, True,
            False)
    loss, stats = target.forward(x, *args)
    grad = torch.randn(loss.shape, generator=torch.Generator().manual_seed(3)).to(loss.device)
    full = target.backward(grad, stats, x, *args)
    bank = target.backward(grad, stats, x, *args, False)
    assert bank[1].numel() == 0 and full[1].shape == ref.shape
    if target.chunked:
        assert_close(bank[0], full[0], 1e-6)
    else:
        assert torch.equal(bank[0], full[0])
    torch.library.opcheck(target.backward, (grad, stats, x, *args, False))
    # through autograd, against the float64 reference
    x = kwargs["embeddings"].clone().requires_grad_()
    options = {k: kwargs[k] for k in ("labels", "ids", "ref_embeddings", "ref_labels", "ref_ids")}
    multi_similarity_loss(x, backend=target.backend, **options).backward()
    expected = kwargs["embeddings"].cpu().double().requires_grad_()
    multi_similarity_loss(expected, backend="reference", **to(options, "cpu", torch.float64)).backward()
    assert_close(x.grad, expected.grad, TOLERANCE[torch.float32])


def test_the_ops_refuse_keys_of_the_wrong_length(target):
    # (the public API checks this first; the ops check again for direct calls)
    x, labels = make_batch(16, 8, 3, dtype=torch.float32)
    x, labels = F.normalize(x, dim=1).to(target.device), labels.to(target.device)
    with pytest.raises((ValueError, RuntimeError), match="labels"):
        target.forward(x, labels[:-1], None, None, None, None, 2.0, 50.0, 0.5, 0.1, True, False)


def test_float16_weights_keep_their_precision_row_by_row(target):
    """No mining against 1,500 rows makes every pair weight about 1/1500, and grad_outputs from 1e4
    down to 1 (scaled by the largest: 1 ... 1e-4) shrink some rows' weights to about 7e-8, a single
    float16 subnormal step, without each row's own lift. Every row of dx is compared with the
    float64 reference at its own scale, not only at the tensor's largest (with every lift set to 1,
    each backend's worst row is 5.5e-2 off). A reference set: in the self case a row of dx also
    sums the other anchors' weights of its column, which outweigh its own here (1500 anchors passed
    this test with the Triton kernels' lifts set to 1)."""
    gen = torch.Generator().manual_seed(17)
    batch, rows = 12, 1500
    x = F.normalize(torch.randn(batch, 64, generator=gen, dtype=torch.float64), dim=1).half()
    kwargs = dict(embeddings=x, labels=torch.arange(batch) % 3, ids=torch.arange(batch),
                  ref_embeddings=F.normalize(torch.randn(rows, 64, generator=gen, dtype=torch.float64), dim=1).half(),
                  ref_labels=torch.randint(0, 40, (rows,), generator=gen), ref_ids=torch.arange(batch, batch + rows))
    spread = torch.logspace(4, 0, batch, dtype=torch.float64)  # every row's gradient a normal float16
    grad_output = lambda loss: spread.to(loss.device, loss.dtype)  # noqa: E731
    options = dict(reduction="none", mining=False, normalize=False, beta=10.0)
    dx = loss_and_grads(to(kwargs, target.device), target.backend, grad_output, **options)[1][0]
    want = loss_and_grads(to(kwargs, "cpu", torch.float64), "reference", grad_output, **options)[1][0]
    dx, want = dx.double().cpu(), want.double()
    error = (dx - want).abs().amax(dim=1) / want.abs().amax(dim=1)
    assert error.max() < 4e-3, f"worst row {error.argmax().item()}: {error.max().item():.2e} of its own scale"


def test_a_reference_set_that_is_the_batch_tensor_itself(target):
    """ref_embeddings=x (the same tensor) with other labels is a reference set, not the self case:
    its positives are found among the columns of its own labels."""
    x, labels = make_batch(97, 32, 12, dtype=torch.float32, seed=31)
    x = F.normalize(x, dim=1).to(target.device)
    ref_labels = torch.randint(0, 12, (97,), generator=torch.Generator().manual_seed(3)).to(target.device)
    labels = labels.to(target.device)
    got = multi_similarity_loss(x, labels, ref_embeddings=x, ref_labels=ref_labels, normalize=False,
                                reduction="none", backend=target.backend)
    want = multi_similarity_loss(x.double().cpu(), labels.cpu(), ref_embeddings=x.double().cpu(),
                                 ref_labels=ref_labels.cpu(), normalize=False, reduction="none", backend="reference")
    assert_close(got, want, TOLERANCE[torch.float32])


@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_steep_weights_and_zero_grad_outputs_stay_finite(target, case):
    """beta = 300 makes exp(beta (maxneg - base)) overflow float32 for anchors whose sets are empty;
    with some grad_outputs 0 the per-row lift must still be finite (0 * inf would make it NaN)."""
    kwargs = build_case(case, 61, 16, torch.float32, seed=33)
    gen = torch.Generator().manual_seed(4)
    zeros = (torch.rand(61, generator=gen) < 0.5).double()
    grad_output = lambda loss: (zeros * torch.rand(61, generator=gen, dtype=torch.float64)).to(loss.device, loss.dtype)  # noqa: E731
    options = dict(reduction="none", beta=300.0, base=0.2)
    _, grads = loss_and_grads(to(kwargs, target.device), target.backend, grad_output, **options)
    gen.manual_seed(4)
    zeros = (torch.rand(61, generator=gen) < 0.5).double()
    _, want = loss_and_grads(to(kwargs, "cpu", torch.float64), "reference", grad_output, **options)
    for got, expected in zip(grads, want):
        assert torch.isfinite(got).all()
        assert_close(got, expected, 1e-4)


@pytest.mark.parametrize("case", ["self", "self_ids", "ref_ids"])
def test_a_negative_base_without_mining_keeps_padding_columns_out(target, case):
    """base = -1, beta = 100, no mining: a column past the batch's end (150 rows: tiles of 64 or 32
    leave some) has S = 0, where exp(beta (0 - base)) overflows float32. A tile must mask such columns
    before its exponentials, or 0 x inf = NaN reaches the gradient (in the self case's backward, the
    label-free tiles beside a row block's positive range have no classes that would mask them)."""
    kwargs = build_case(case, 150, 16, torch.float32, seed=8)
    check(target, kwargs, torch.float32, "sum", rtol=1e-4, mining=False, beta=100.0, base=-1.0)


def test_threads_stepping_at_once_get_what_each_call_gets_alone(target):
    """Threads stepping at once (an evaluation beside training, a step per thread) get the losses and
    gradients of the same calls made one at a time, bit for bit: the CPU kernel shares only its spare
    buffer (locked), and the interpreter's launches take turns (it patches triton.language for the
    whole process while one runs)."""
    cases = [to(build_case(case, rows, 24, torch.float32), target.device)
             for case, rows in (("self", 33), ("ref_ids", 29), ("self", 40))]
    step = lambda kwargs: loss_and_grads(kwargs, target.backend, lambda loss: torch.full_like(loss, 0.7))  # noqa: E731
    alone = [step(kwargs) for kwargs in cases]
    results, errors = {}, []

    def steps(i):
        try:
            for turn in range(3):
                results[i, turn] = step(cases[i])
        except Exception as error:  # (raised in the main thread below)
            errors.append(error)

    threads = [threading.Thread(target=steps, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for (i, _), (loss, grads) in results.items():
        assert torch.equal(loss, alone[i][0]) and all(torch.equal(g, a) for g, a in zip(grads, alone[i][1], strict=True))
