"""Public API: input checks, degenerate batches, non-finite inputs, extreme hyper-parameters, the modules."""
import math

import pytest
import torch

import ms_loss_cuda
from ms_loss_cuda import MultiSimilarityLoss, available_backends, multi_similarity_loss, ops

from conftest import TOLERANCE, assert_close, make_batch

BACKENDS = [b for b in ("reference", "cpu") if b in available_backends()]


def call(x=None, labels=None, **kwargs):
    if x is None:
        x, labels = make_batch(8, 4, 3)
    return multi_similarity_loss(x, labels, **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(x=torch.randn(8), labels=torch.zeros(8, dtype=torch.long)), r"embeddings must be 2-D.*\(8,\)"),
    (dict(x=torch.randn(8, 4), labels=torch.zeros(8, 1, dtype=torch.long)), r"labels must have shape \[8\].*\(8, 1\)"),
    (dict(x=torch.randn(8, 4), labels=torch.zeros(7, dtype=torch.long)), r"labels must have shape \[8\].*\(7,\)"),
    (dict(ref_embeddings=torch.randn(5, 4)), "ref_embeddings and ref_labels must be given together"),
    (dict(ref_embeddings=torch.randn(5, 3), ref_labels=torch.zeros(5, dtype=torch.long)), r"\(5, 3\).*\(8, 4\).*same D"),
    (dict(ref_embeddings=torch.randn(5, 4), ref_labels=torch.zeros(4, dtype=torch.long)), r"ref_labels must have shape \[5\]"),
    (dict(ids=torch.arange(7)), r"ids must have shape \[8\]"),
    (dict(ref_ids=torch.arange(8)), "ref_ids needs ref_embeddings"),
    (dict(ref_embeddings=torch.randn(5, 4), ref_labels=torch.zeros(5, dtype=torch.long), ids=torch.arange(8)),
     "ids and ref_ids must be given together"),
    (dict(alpha=0.0), "alpha"), (dict(alpha=-1.0), "alpha"), (dict(beta=0.0), "beta"), (dict(epsilon=-0.1), "epsilon"),
    (dict(alpha=math.nan), "alpha"), (dict(base=math.inf), "base"),
    (dict(alpha=1e39), "alpha must be at least float32's smallest normal number .* and finite in float32"),
    (dict(alpha=1e-50), "alpha must be at least float32's smallest normal"), (dict(beta=1e-39), "beta"),
    (dict(base=-1e39), "base"),
    (dict(beta=1e38, base=-9.0), r"alpha and beta times \(1 \+ \|base\|\)"),
    (dict(x=torch.randn(8, 0), labels=torch.zeros(8, dtype=torch.long)), r"at least one column.*\(8, 0\)"),
    (dict(reduction="max"), "reduction"), (dict(backend="gpu"), "backend"),
])
def test_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        call(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(x=torch.randint(0, 3, (8, 4)), labels=torch.zeros(8, dtype=torch.long)),
    dict(x=torch.randn(8, 4), labels=torch.zeros(8)),
    dict(x=torch.randn(8, 4), labels=torch.zeros(8, dtype=torch.bool)),
    dict(x=torch.randn(8, 4), labels=torch.zeros(8, dtype=torch.long), ids=torch.zeros(8)),
    dict(x=torch.randn(8, 4), labels=torch.zeros(8, dtype=torch.uint64), ref_embeddings=torch.randn(5, 4),
         ref_labels=torch.zeros(5, dtype=torch.int64)),
    dict(x=torch.randn(8, 4).to_sparse(), labels=torch.zeros(8, dtype=torch.long)),
    dict(x=torch.randn(8, 4), labels=torch.arange(8).to_sparse()),
])
def test_type_errors(kwargs):
    with pytest.raises(TypeError):
        call(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(alpha=None), "alpha must be a real number, got None"),
    (dict(beta=torch.tensor([2.0, 3.0])), "beta must be a real number"),
    (dict(alpha="2"), "alpha must be a real number, got '2'"),
    (dict(alpha=True), "alpha must be a real number, got True"),
    (dict(alpha=torch.tensor(True).numpy()[()]), "alpha must be a real number, got"),
    (dict(beta=torch.tensor(True)), "beta must be a real number"),
    (dict(base=b"0.5"), "base must be a real number"),
    (dict(alpha=torch.tensor(3 + 0j)), "alpha must be a real number"),
    (dict(beta=torch.tensor(3 + 2j).numpy()[()]), "beta must be a real number"),  # (numpy's takes its real part)
    (dict(alpha=torch.tensor(2.0, requires_grad=True)), "alpha must be a number or a tensor that does not require"),
    (dict(mining="no"), "mining must be True or False, got 'no'"),
    (dict(skip_incomplete_anchors=2), "skip_incomplete_anchors must be True or False"),
    (dict(normalize="False"), "normalize must be True or False, got 'False'"),
    (dict(normalize=None), "normalize must be True or False, got None"),
])
def test_hyper_parameters_of_the_wrong_type_are_named(kwargs, message):
    for make in (lambda: call(**kwargs), lambda: MultiSimilarityLoss(**kwargs),
                 lambda: ms_loss_cuda.CrossBatchMemory(16, 4, **kwargs)):
        with pytest.raises(TypeError, match=message):
            make()


def test_an_integer_past_floats_range_is_named():
    with pytest.raises(ValueError, match="alpha must be finite in float32, got an integer of 1329 bits"):
        call(alpha=10 ** 400)
    with pytest.raises(ValueError, match="weight must be a finite number >= 0, got an integer of 16610 bits"):
        ms_loss_cuda.CrossBatchMemory(4, 4, weight=10 ** 5000)  # (past the decimal form's 4300 digits)


def test_tensor_hyper_parameters_are_kept_as_numbers():
    module = MultiSimilarityLoss(alpha=torch.tensor(3.0), mining=torch.tensor(True))
    assert type(module.options["alpha"]) is float and module.options["alpha"] == 3.0
    assert module.options["mining"] is True
    memory = ms_loss_cuda.CrossBatchMemory(16, 4, beta=torch.tensor(40.0))
    assert type(memory.loss_options["beta"]) is float


def test_reprs_show_every_option():
    assert "normalize=False, reduction='sum'" in repr(MultiSimilarityLoss(normalize=False, reduction="sum"))
    memory = repr(ms_loss_cuda.CrossBatchMemory(16, 4, normalize=False, alpha=3.0, backend="reference"))
    assert "normalize=False, alpha=3.0, beta=50.0," in memory and "reduction='mean', backend='reference'" in memory


NEW_VALUES = dict(alpha=3.0, beta=10.0, base=0.2, epsilon=0.5, mining=False, skip_incomplete_anchors=True)


@pytest.mark.parametrize("make", [lambda **kw: MultiSimilarityLoss(**kw),
                                  lambda **kw: ms_loss_cuda.CrossBatchMemory(64, 16, **kw)],
                         ids=["loss", "memory"])
def test_hyper_parameters_set_as_attributes_are_checked_and_used(make):
    """pytorch-metric-learning's loss has `alpha`, `beta` and `base` as attributes: ours has every
    option so, checked when set (the module unchanged by a refused value) and used from the next call,
    as a module built with the new values computes."""
    x, labels = make_batch(24, 16, 6, dtype=torch.float64, seed=7)
    ids = torch.arange(24)
    module, built = make(), make(backend="cpu", reduction="sum", **NEW_VALUES)
    module.backend, module.reduction = "cpu", "sum"
    for name, value in NEW_VALUES.items():
        setattr(module, name, torch.tensor(value) if name == "alpha" else value)
        assert getattr(module, name) == value and type(getattr(module, name)) is type(value)
    refused = [("alpha", "3", TypeError), ("beta", -1.0, ValueError), ("mining", 2, TypeError),
               ("base", float("nan"), ValueError), ("reduction", "avg", ValueError), ("backend", "gpu", ValueError)]
    if isinstance(module, MultiSimilarityLoss):  # (a memory's normalize is fixed: test_memory.py)
        refused.append(("normalize", 2, TypeError))
    for name, bad, error in refused:
        with pytest.raises(error, match=name):
            setattr(module, name, bad)
    assert module.options == built.options and repr(module) == repr(built)
    args = (x, labels) if isinstance(module, MultiSimilarityLoss) else (x, labels, ids)
    expected = built(*args)
    assert_close(module(*args), expected, 0)
    assert expected > 0
    # the new values against the float64 reference's: the memory's first call adds its term against the
    # batch alone, which it has just stored (each row's own copy skipped), so it counts the loss twice
    reference = multi_similarity_loss(x, labels, backend="reference", reduction="sum", **NEW_VALUES)
    assert_close(expected, reference * (1 if isinstance(module, MultiSimilarityLoss) else 2), TOLERANCE[torch.float64])


def test_a_module_pickled_with_its_settings_under_their_own_names_still_reads_them():
    """normalize, reduction and backend are kept as attributes "_" + name: torch 2.8's torch.compile (CI
    runs 2.13) recursed without end when they were kept in the instance's dict under their own names. A
    module pickled with that layout reads them."""
    module = MultiSimilarityLoss(normalize=False, reduction="sum", backend="reference")
    assert not {"normalize", "reduction", "backend"} & set(vars(module))
    state = dict(vars(module))
    for name in ("normalize", "reduction", "backend"):
        state[name] = state.pop("_" + name)
    old = MultiSimilarityLoss.__new__(MultiSimilarityLoss)
    old.__setstate__(state)
    assert (old.normalize, old.reduction, old.backend) == (False, "sum", "reference")
    x, labels = make_batch(12, 8, 3, dtype=torch.float64, seed=3)
    assert_close(old(x, labels), module(x, labels), 0)
    old.reduction = "none"
    assert old(x, labels).shape == (12,)
    del vars(old)["normalize"]
    with pytest.raises(AttributeError, match="normalize"):
        old.normalize


def test_flags_that_equal_a_bool_are_taken_as_one():
    expected = call(mining=False, skip_incomplete_anchors=True)
    for off, on in ((0, 1), (torch.tensor(False), torch.tensor(True)), (torch.tensor(False).numpy()[()], 1)):
        torch.testing.assert_close(call(mining=off, skip_incomplete_anchors=on), expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.usefixtures("overflow_checked")
def test_keys_of_other_integer_dtypes_at_both_ends(backend):
    """Labels and ids of any integer dtype, a different one at each end (but uint64, which needs uint64
    opposite), are compared by value."""
    x, labels = make_batch(12, 4, 3)
    ref, ref_labels = make_batch(9, 4, 3, seed=1)
    expected = multi_similarity_loss(x, labels, ref_embeddings=ref, ref_labels=ref_labels, ids=torch.arange(12),
                                     ref_ids=torch.arange(12, 21), backend=backend)
    for dtype, ref_dtype in ((torch.uint16, torch.int64), (torch.uint32, torch.int8), (torch.int32, torch.uint8)):
        loss = multi_similarity_loss(x, labels.to(dtype), ref_embeddings=ref, ref_labels=ref_labels.to(ref_dtype),
                                     ids=torch.arange(12).to(dtype), ref_ids=torch.arange(12, 21).to(ref_dtype),
                                     backend=backend)
        torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_device_mismatch_names_devices():
    x, labels = make_batch(8, 4, 3)
    with pytest.raises(ValueError, match="embeddings on cpu.*labels on meta"):
        multi_similarity_loss(x, labels.to("meta"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("labels", [torch.zeros(0, dtype=torch.long), torch.tensor([3]),
                                    torch.full((6,), 2), torch.arange(6)],
                         ids=["B=0", "B=1", "one_class", "all_distinct"])
def test_degenerate_batches_give_zero_loss_and_zero_grads(backend, reduction, labels):
    x = torch.randn(len(labels), 5, requires_grad=True)
    loss = multi_similarity_loss(x, labels, backend=backend, reduction=reduction)
    assert torch.equal(loss, torch.zeros_like(loss))
    (grad,) = torch.autograd.grad(loss.sum(), x)
    assert torch.equal(grad, torch.zeros_like(x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["embeddings", "ref_embeddings"])
@pytest.mark.parametrize("normalize", [True, False])
def test_non_finite_inputs_give_nan(backend, bad, where, normalize):
    x, labels = make_batch(12, 4, 3, dtype=torch.float32)
    ref, ref_labels = make_batch(9, 4, 3, dtype=torch.float32, seed=1)
    (x if where == "embeddings" else ref)[3, 1] = bad
    loss = multi_similarity_loss(x, labels, ref_embeddings=ref, ref_labels=ref_labels, backend=backend,
                                 normalize=normalize)
    assert torch.isnan(loss)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hyper", [dict(beta=1000.0), dict(alpha=0.01), dict(base=-1.0),
                                   dict(alpha=0.01, beta=1000.0, base=-1.0), dict(alpha=100.0, base=2.0)])
@pytest.mark.parametrize("mining,reduction", [(True, "mean"), (False, "sum"), (True, "none")])
def test_extreme_hyper_parameters_are_finite_and_exact(backend, hyper, mining, reduction):
    x, labels = make_batch(50, 8, 5, dtype=torch.float32)
    x.requires_grad_()
    x64 = x.detach().double().requires_grad_()
    loss, expected = (multi_similarity_loss(t, labels, backend=b, mining=mining, reduction=reduction, **hyper)
                      for t, b in ((x, backend), (x64, "reference")))
    weights = torch.linspace(0.3, 1.7, loss.numel()).reshape(loss.shape)  # a grad_output other than 1
    (grad,) = torch.autograd.grad(loss, x, weights.float())
    (grad64,) = torch.autograd.grad(expected, x64, weights.double())
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all() and expected.sum() > 0
    torch.testing.assert_close(loss.double(), expected, rtol=2e-5, atol=2e-5 * expected.abs().max().item())
    torch.testing.assert_close(grad.double(), grad64, rtol=1e-4, atol=1e-4 * grad64.abs().max().item())


def test_module_matches_function_and_has_pml_signature():
    import inspect

    params = list(inspect.signature(MultiSimilarityLoss.forward).parameters)
    assert params == ["self", "embeddings", "labels", "indices_tuple", "ref_emb", "ref_labels"]
    x, labels = make_batch(30, 6, 4)
    module = MultiSimilarityLoss(alpha=3.0, beta=30.0, base=0.4, epsilon=0.05, reduction="sum")
    expected = multi_similarity_loss(x, labels, alpha=3.0, beta=30.0, base=0.4, epsilon=0.05, reduction="sum")
    torch.testing.assert_close(module(x, labels), expected)
    with pytest.raises(ValueError, match="alpha"):
        MultiSimilarityLoss(alpha=-1)


def test_indices_tuple_is_checked():
    x, labels = make_batch(6, 4, 3)
    module, a, p, n = MultiSimilarityLoss(), torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([2, 4])
    for pairs, error, message in [
        ((a, torch.tensor([1, 9]), a, n), ValueError, r"p must hold row indices in \[0, 6\), got values from 1 to 9"),
        ((a, p, torch.tensor([-1, 0]), n), ValueError, r"a2 must hold row indices in \[0, 6\)"),
        ((a, p[:1], a, n), ValueError, "a1 and p must be as long as each other"),
        ((a, p, n.float()), TypeError, "negative must be a 1-D integer tensor"),
        ((a, p, a, n, n), ValueError, "3 or 4"),
    ]:
        with pytest.raises(error, match=message):
            module(x, labels, indices_tuple=pairs)
    ref = torch.randn(9, 4)
    with pytest.raises(ValueError, match=r"n must hold row indices in \[0, 9\)"):
        module(x, labels, (a, p, a, torch.tensor([2, 9])), ref, torch.zeros(9, dtype=torch.long))
    assert module(x, labels, indices_tuple=(a, p, a, n)) > 0
    # the embeddings and the tuple itself are checked before the pairs are read against their sizes
    for rows, pairs, error, message in [(x.tolist(), (a, p, a, n), TypeError, "embeddings must be a tensor, got list"),
                                        (x[:, 0], (a, p, a, n), ValueError, r"embeddings must be 2-D \[N, D\]"),
                                        (x, 5, TypeError, "indices_tuple must be a tuple of 3 or 4 index tensors")]:
        with pytest.raises(error, match=message):
            module(rows, labels, indices_tuple=pairs)
    with pytest.raises(ValueError, match="ref_emb and ref_labels must be given together"):
        module(x, labels, ref_emb=ref)


def test_indices_tuple_without_labels_as_pytorch_metric_learning_takes_it():
    """With an indices_tuple the pairs replace the labels, which may then be left out (ref_labels too)."""
    x, labels = make_batch(9, 4, 3)
    ref, ref_labels = torch.randn(7, 4), torch.arange(7) % 3
    module, a, p, n = MultiSimilarityLoss(), torch.tensor([0, 1, 2]), torch.tensor([1, 0, 5]), torch.tensor([4, 6, 3])
    for ref_args in ((), (ref, ref_labels)):
        expected = module(x, labels, (a, p, a, n), *ref_args)
        torch.testing.assert_close(module(x, None, (a, p, a, n), *ref_args[:1]), expected, rtol=0, atol=0)
        # the labels play no part: other ones give the same loss
        torch.testing.assert_close(module(x, labels.flip(0), (a, p, a, n), *ref_args), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs labels, unless an indices_tuple gives the pairs"):
        module(x, None)
    # the labels left out take the dtype of those given at the other end, which must match
    wide = ref_labels.to(torch.uint64)
    expected = module(x, labels, (a, p, a, n), ref, ref_labels)
    torch.testing.assert_close(module(x, None, (a, p, a, n), ref, wide), expected)


def test_indices_tuple_under_torch_compile():
    """The indices' range is checked eagerly; a traced call (fullgraph) skips it rather than guard on data."""
    x, labels = make_batch(8, 4, 4)
    module, a, p, n = MultiSimilarityLoss(), torch.tensor([0, 1, 2]), torch.tensor([1, 0, 3]), torch.tensor([4, 5, 6])
    compiled = torch.compile(lambda x, labels: module(x, labels, (a, p, a, n)), fullgraph=True)
    torch.testing.assert_close(compiled(x, labels), module(x, labels, (a, p, a, n)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_unit_rows_is_normalize_in_the_input_dtype(dtype):
    from ms_loss_cuda.common import unit_rows

    gen = torch.Generator().manual_seed(0)  # (unseeded, about 1 draw in 40 failed the bfloat16 gradient)
    x = torch.randn(9, 5, dtype=torch.float64, generator=gen).to(dtype)
    x[3] = 0  # the all-zero row stays zero, as with F.normalize
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    mine, theirs = unit_rows(a), torch.nn.functional.normalize(b, dim=1)
    assert mine.dtype == dtype
    torch.testing.assert_close(mine, theirs)
    weights = torch.randn(9, 5, dtype=torch.float64, generator=gen).to(dtype)
    (mine * weights).sum().backward()
    (theirs * weights).sum().backward()
    loose = dict(rtol=2e-2, atol=1e-2) if dtype == torch.bfloat16 else {}  # (the norm is float32 here)
    torch.testing.assert_close(a.grad, b.grad, **loose)


@pytest.mark.parametrize("dtype,scale", [(torch.float16, 3e3), (torch.bfloat16, 1e25), (torch.float32, 1e25)])
def test_unit_rows_of_rows_whose_norm_overflows_their_dtype(dtype, scale):
    """float16 rows of norm above 65504, float32 and bfloat16 rows whose squares overflow float32:
    the unit rows and their gradient as in float64 (F.normalize gives rows of 0 for the last two)."""
    from ms_loss_cuda.common import unit_rows

    gen = torch.Generator().manual_seed(3)
    t = (torch.randn(5, 1000, generator=gen, dtype=torch.float64) * scale).to(dtype)
    g = torch.randn(5, 1000, generator=gen, dtype=torch.float64)
    results = []
    for rows in (t.clone(), t.double()):
        rows.requires_grad_()
        y = unit_rows(rows)
        results.append((y, torch.autograd.grad(y, rows, g.to(rows.dtype))[0]))
    (y, dt), (y64, dt64) = results
    assert y.dtype == dt.dtype == dtype
    assert_close(y, y64, TOLERANCE[dtype])
    assert_close(dt, dt64, TOLERANCE[dtype])


def test_unit_rows_second_derivatives_and_vmap():
    from ms_loss_cuda.common import unit_rows

    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(unit_rows, (x,))
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    assert torch.autograd.gradgradcheck(
        lambda t: multi_similarity_loss(t, labels, backend="reference", mining=False), (x,))
    batched = torch.randn(4, 6, 3, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(unit_rows)(batched), torch.nn.functional.normalize(batched, dim=2))


TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (on CPU: the interpreter)


@pytest.mark.parametrize("backend", [b for b in ("cpu", "triton", "triton_chunked")
                                     if b.split("_")[0] in available_backends("cpu" if b == "cpu" else TRITON_DEVICE)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("with_ref", ["none", "bank", "ref_grad"])
@pytest.mark.parametrize("traced", [False, True])
def test_fused_backends_refuse_a_second_derivative(backend, with_ref, normalize, traced, monkeypatch):
    """create_graph=True gives the exact first derivative, with a reference set that takes a gradient
    too; differentiating it again raises (the kernels' backward has no derivative), where it silently
    left the kernels' share out. Eager calls (one autograd node) and the path torch.compile traces (the
    ops and their registered autograd; ops.traced patched).
    triton: its fused backward; triton_chunked: its chunked one (the cuBLAS products under grad mode)."""
    monkeypatch.setattr(ops, "traced", lambda: traced)
    if backend.startswith("triton"):
        monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "1e-6" if backend == "triton_chunked" else "0")
        backend = "triton"
    device = "cpu" if backend == "cpu" else TRITON_DEVICE
    x, labels = make_batch(37, 16, 5, dtype=torch.float32)
    ref, ref_labels = make_batch(20, 16, 5, dtype=torch.float32, seed=1) if with_ref != "none" else (None, None)
    x, labels = x.to(device).requires_grad_(), labels.to(device)
    if ref is not None:
        ref, ref_labels = ref.to(device).requires_grad_(with_ref == "ref_grad"), ref_labels.to(device)
    kwargs = dict(ref_embeddings=ref, ref_labels=ref_labels, normalize=normalize, backend=backend)
    (grad,) = torch.autograd.grad(multi_similarity_loss(x, labels, **kwargs), x, create_graph=True)
    (plain,) = torch.autograd.grad(multi_similarity_loss(x, labels, **kwargs), x)
    torch.testing.assert_close(grad, plain, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(grad.square().sum(), x, retain_graph=True)
    if with_ref == "ref_grad":  # (with respect to the reference set alone too: tied to x alone, None there)
        with pytest.raises(RuntimeError, match="no second derivative"):
            torch.autograd.grad(grad.square().sum(), ref)


@pytest.mark.parametrize("backend", [b for b in ("cpu", "triton") if b in available_backends(
    "cpu" if b == "cpu" else TRITON_DEVICE)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_bank_written_before_the_backward(backend, reduction):
    """A memory bank that takes no gradient may be written in place between the forward and the
    backward (a queue of past batches): with unit rows, which the forward keeps, the backward gives the
    gradient of the bank as it was."""
    device = "cpu" if backend == "cpu" else TRITON_DEVICE
    x, labels = make_batch(29, 16, 5, dtype=torch.float32)
    bank, bank_labels = make_batch(40, 16, 5, dtype=torch.float32, seed=1)
    x, labels, bank, bank_labels = (t.to(device) for t in (x, labels, bank, bank_labels))
    x.requires_grad_()
    grad_output = torch.rand(29 if reduction == "none" else (), device=device) + 0.5
    kwargs = dict(ref_labels=bank_labels, reduction=reduction, backend=backend)
    (expected,) = torch.autograd.grad(multi_similarity_loss(x, labels, ref_embeddings=bank, **kwargs), x, grad_output)
    loss = multi_similarity_loss(x, labels, ref_embeddings=bank, **kwargs)
    bank[:5] = torch.randn(5, 16, device=device)
    (grad,) = torch.autograd.grad(loss, x, grad_output)
    assert torch.equal(grad, expected) and expected.abs().sum() > 0


@pytest.mark.parametrize("backend", ["reference"] + [b for b in ("cpu", "triton") if b in available_backends(
    "cpu" if b == "cpu" else TRITON_DEVICE)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_keys_made_under_inference_mode(backend, reduction):
    """Labels and identities made under torch.inference_mode (which autograd cannot save) train as any
    others: the fused backends keep a copy of them for the backward."""
    device = "cpu" if backend in ("cpu", "reference") else TRITON_DEVICE
    x, labels = make_batch(21, 8, 4, dtype=torch.float32)
    x, labels = x.to(device).requires_grad_(), labels.to(device)
    ids = torch.arange(21, device=device, dtype=torch.int32)
    with torch.inference_mode():
        frozen_labels, frozen_ids = labels.clone(), ids.clone()
    grad_output = torch.rand(21 if reduction == "none" else (), device=device) + 0.5
    grads = [torch.autograd.grad(multi_similarity_loss(x, keys[0], ids=keys[1], reduction=reduction, backend=backend),
                                 x, grad_output)[0] for keys in ((labels, ids), (frozen_labels, frozen_ids))]
    assert torch.equal(grads[1], grads[0]) and grads[0].abs().sum() > 0


@pytest.mark.skipif("triton" not in available_backends(TRITON_DEVICE), reason="needs Triton (or its interpreter)")
@pytest.mark.parametrize("with_ref", [False, True])
def test_the_chunked_backward_keeps_float32_products_under_autocast(with_ref, monkeypatch):
    """A backward taken inside autocast: the chunked form's cuBLAS products of float32 weights stay
    float32 (autocast would run them in bfloat16 on CPU, float16 on CUDA: about 1e-3 off)."""
    monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "1e-6")
    x, labels = make_batch(37, 16, 5, dtype=torch.float32)
    ref, ref_labels = make_batch(20, 16, 5, dtype=torch.float32, seed=1) if with_ref else (None, None)
    grads, device = [], TRITON_DEVICE
    for dtype, backend in ((torch.float32, "triton"), (torch.float64, "reference")):
        leaf = x.to(device, dtype).requires_grad_()
        with torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda" else torch.bfloat16,
                            enabled=backend == "triton"):
            loss = multi_similarity_loss(leaf, labels.to(device), ref_labels=None if ref is None else ref_labels.to(device),
                                         ref_embeddings=None if ref is None else ref.to(device, dtype), backend=backend)
            grads += torch.autograd.grad(loss, leaf)
    torch.testing.assert_close(grads[0].double(), grads[1], rtol=1e-5, atol=1e-6 * grads[1].abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast needs a GPU")
def test_16_bit_embeddings_stay_16_bit_under_autocast():
    from ms_loss_cuda.common import unit_rows

    x = torch.randn(8, 16, device="cuda", dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        assert unit_rows(x).dtype == torch.float16  # (F.normalize gives float32 here)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_loss_in_the_embeddings_dtype_mixes_with_peer_code(backend, dtype):
    """16-bit embeddings give a 16-bit loss (accumulated in float32, cast at the end), so it compares
    and adds with other losses of the same dtype, as pytorch-metric-learning's does."""
    if backend not in available_backends("cpu"):
        pytest.skip(f"{backend} not available")
    x, labels = make_batch(37, 8, 5, dtype=dtype)
    loss = multi_similarity_loss(x, labels, backend=backend)
    exact = multi_similarity_loss(x.double(), labels, backend="reference")
    assert loss.dtype == dtype and torch.isclose(loss, exact.to(dtype), rtol=1e-2)
    assert (loss + torch.zeros((), dtype=dtype)).dtype == dtype


def test_float16_sum_overflows_to_inf_with_an_exact_gradient():
    """A float16 "sum" beyond 65504 is inf, like any float16 sum; its gradient (taken in float32
    inside) stays finite and equals the float32 one."""
    x, labels = make_batch(4000, 4, 2000, spread=3.0)
    x16 = x.half().requires_grad_()
    x32 = x16.detach().float().requires_grad_()
    loss16 = multi_similarity_loss(x16, labels, reduction="sum", beta=0.5, base=-0.5, mining=False, backend="reference")
    loss32 = multi_similarity_loss(x32, labels, reduction="sum", beta=0.5, base=-0.5, mining=False, backend="reference")
    assert loss32 > 65504 and loss16.isinf()
    loss16.backward()
    loss32.backward()
    assert torch.isfinite(x16.grad).all()
    torch.testing.assert_close(x16.grad.float(), x32.grad, rtol=2e-3, atol=2e-3 * x32.grad.abs().max().item())


def test_under_autocast_the_loss_is_float32_as_torchs_losses():
    x, labels = make_batch(37, 8, 5, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = multi_similarity_loss(x, labels, backend="reference")
    assert loss.dtype == torch.float32
    assert multi_similarity_loss(x, labels, backend="reference").dtype == torch.bfloat16
