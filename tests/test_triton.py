"""The Triton backend against the float64 reference: on CUDA tensors when a GPU is present, else
under TRITON_INTERPRET=1 on CPU tensors (conftest sets it before the kernels are imported)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
import ms_loss_cuda.triton_kernels as kernels  # noqa: E402
from ms_loss_cuda import loss as api, multi_similarity_loss  # noqa: E402

from conftest import build_case, check_against_reference, loss_and_grads, make_batch, to  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not kernels.INTERPRETED,
                                reason="no GPU, and TRITON_INTERPRET=1 was not set before the kernels were imported")
# the targets: 1e-5 relative in float32; float16 / bfloat16 rounding of the weights that
# enter the second product (interpreted bfloat16 tiles are upcast, so that case is tighter there)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def check(kwargs, dtype, reduction="mean", **options):
    return check_against_reference("triton", kwargs, dtype, reduction, device=DEVICE, rtol=TOLERANCE[dtype],
                                   **options)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("case", ["self", "self_ids", "ref", "ref_ids", "ref_own_copy"])
def test_matches_reference(case, mining, reduction):
    # 97 rows and D = 130 leave partial row, column and K tiles, and split D over two programs
    ref_loss, ref_grads = check(build_case(case, 97, 130, torch.float32), torch.float32, reduction, mining=mining)
    assert ref_loss.abs().sum() > 0 and ref_grads[0].abs().sum() > 0  # the case is not trivial


@pytest.mark.parametrize("batch,dim", [(1, 3), (2, 3), (2, 64), (37, 3), (37, 130), (97, 64), (300, 3), (300, 130)])
@pytest.mark.parametrize("mining", [True, False])
def test_sizes(batch, dim, mining):
    for case in ("self", "ref"):
        check(build_case(case, batch, dim, torch.float32, seed=batch), torch.float32, mining=mining)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_16_bit_inputs(case, mining, dtype):
    kwargs = build_case(case, 97, 130, torch.float64, seed=5)
    for key in ("embeddings", "ref_embeddings"):  # unit rows, exactly representable in `dtype`
        if key in kwargs:
            kwargs[key] = F.normalize(kwargs[key], dim=1).to(dtype)
    check(kwargs, dtype, "none", normalize=False, mining=mining)


def test_mixed_input_dtypes():
    kwargs = build_case("ref", 37, 64, torch.float32, seed=6)
    kwargs["embeddings"] = F.normalize(kwargs["embeddings"], dim=1).half()
    check(kwargs, torch.float16, normalize=False)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_options(case, skip):
    kwargs = build_case(case, 61, 7, torch.float32, seed=3)
    kwargs["embeddings"] = F.normalize(kwargs["embeddings"], dim=1) * 0.9
    check(kwargs, torch.float32, "none", skip_incomplete_anchors=skip, normalize=False,
          alpha=3.0, beta=20.0, base=0.4, epsilon=0.05)


def test_empty_reference_set_gives_zero():
    x, labels = make_batch(5, 3, 2, dtype=torch.float32)
    loss, (grad_x, grad_ref) = loss_and_grads(
        to(dict(embeddings=x, labels=labels, ref_embeddings=torch.zeros(0, 3), ref_labels=labels[:0]), DEVICE),
        "triton", torch.ones_like)
    assert loss.item() == 0 and grad_x.abs().sum() == 0 and grad_ref.shape == (0, 3)


def test_backward_is_bitwise_deterministic():
    for kwargs in (build_case("self", 300, 64, torch.float32, seed=8), build_case("ref_ids", 300, 64, torch.float32)):
        kwargs = to(kwargs, DEVICE)
        first = loss_and_grads(kwargs, "triton", torch.ones_like)
        again = loss_and_grads(kwargs, "triton", torch.ones_like)
        assert torch.equal(first[0], again[0])
        assert all(torch.equal(a, b) for a, b in zip(first[1], again[1]))


@pytest.mark.parametrize("case", ["self", "ref_ids"])
def test_opcheck(case):
    kwargs = to(build_case(case, 29, 16, torch.float32, seed=1), DEVICE)
    x = F.normalize(kwargs["embeddings"], dim=1).requires_grad_()
    ref = kwargs.get("ref_embeddings")
    ref = None if ref is None else F.normalize(ref, dim=1).requires_grad_()
    args = (x, kwargs["labels"], kwargs.get("ids"), ref, kwargs.get("ref_labels"), kwargs.get("ref_ids"),
            2.0, 50.0, 0.5, 0.1, True, False)
    torch.library.opcheck(torch.ops.ms_loss_cuda.triton_forward.default, args)
    loss, stats = torch.ops.ms_loss_cuda.triton_forward(*args)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.ms_loss_cuda.triton_backward.default, (torch.rand_like(loss), stats.detach()) + detached)


def test_matches_cpu_kernel_stats():
    # the two fused backends save the same per-anchor statistics
    kwargs = build_case("ref_ids", 97, 64, torch.float32, seed=4)
    x, ref = F.normalize(kwargs["embeddings"], dim=1), F.normalize(kwargs["ref_embeddings"], dim=1)
    args = (kwargs["labels"], kwargs["ids"], ref, kwargs["ref_labels"], kwargs["ref_ids"], 2.0, 50.0, 0.5, 0.1, True, False)
    _, stats = torch.ops.ms_loss_cuda.triton_forward(x.to(DEVICE), *[a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args])
    _, cpu_stats = torch.ops.ms_loss_cuda.ms_loss_forward(x, *args)
    torch.testing.assert_close(stats.cpu(), cpu_stats, rtol=1e-5, atol=1e-6)


def test_float64_is_refused_with_a_clear_error():
    x, labels = make_batch(8, 4, 3)
    with pytest.raises(RuntimeError, match="backend 'triton' cannot run: .*float32, float16 or bfloat16.*float64"):
        multi_similarity_loss(x.to(DEVICE), labels.to(DEVICE), backend="triton")
    with pytest.raises(TypeError, match="float64"):
        torch.ops.ms_loss_cuda.triton_forward(x, labels, None, None, None, None, 2.0, 50.0, 0.5, 0.1, True, False)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    x, labels = make_batch(8, 4, 3, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="backend 'triton' cannot run: .*TRITON_INTERPRET=1"):
        multi_similarity_loss(x, labels, backend="triton")
    assert "triton" not in api.available_backends("cpu")
