"""triton_kernels/interpreter_bfloat16.py: under the interpreter, a Triton kernel's float32 to bfloat16
cast rounds as torch (and a GPU) do, to nearest even (toward zero where it asks for that), and its
bfloat16 tl.dot multiplies the values; where the interpreter cannot be mended, the triton backend
refuses bfloat16 on CPU tensors. The kernel's test runs on a GPU too."""
import numpy as np
import pytest
import torch

from targets import DEVICE, TRITON_MISSING

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
pytestmark = pytest.mark.skipif(**TRITON_MISSING)


@triton.jit
def _cast_and_dot(x_ptr, a_ptr, b_ptr, rounded_ptr, product_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(rounded_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    tl.store(product_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))


def test_a_kernels_cast_and_product():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, generator=gen)
    a, b = (torch.randn(16, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    rounded, product = torch.empty(16, dtype=torch.bfloat16), torch.empty(16, 16)
    args = [t.to(DEVICE) for t in (x, a, b, rounded, product)]
    _cast_and_dot[(1,)](*args, N=16)
    assert torch.equal(args[3].cpu(), x.to(torch.bfloat16))
    # (float32 sums of exact products, in any order; a product of bit patterns is off by orders of magnitude)
    torch.testing.assert_close(args[4].cpu(), a.double().matmul(b.double()).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's")
def test_the_interpreters_casts_round_as_torch_and_as_asked():
    from triton.runtime import interpreter

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=gen) * 10.0 ** torch.randint(-44, 38, (20000,), generator=gen).float()
    x = torch.cat([x, torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0, 1e-45])])

    def cast(rounding):
        bits = interpreter._convert_float(x.numpy(), tl.float32, tl.bfloat16, rounding)
        return torch.from_numpy(bits.astype(np.uint16).view(np.int16))

    expected = x.to(torch.bfloat16)
    got = cast(None).view(torch.bfloat16)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int16), expected[~expected.isnan()].view(torch.int16))
    # toward zero, left to the interpreter: the pattern's high half (for normal values: its own cast
    # mishandles float32's subnormals, which no kernel casts so)
    normal = x.isfinite() & (x.abs() >= torch.finfo(torch.float32).tiny)
    toward_zero = cast(interpreter._ir.ROUNDING_MODE.RTZ)
    assert torch.equal(toward_zero[normal], (x.view(torch.int32) >> 16).to(torch.int16)[normal])


def test_bfloat16_on_cpu_tensors_needs_the_mended_interpreter(monkeypatch):
    from ms_loss_cuda import multi_similarity_loss
    from ms_loss_cuda.triton_kernels import launcher

    if DEVICE != "cpu":
        pytest.skip("CUDA tensors: no interpreter")
    assert launcher.BFLOAT16_INTERPRETED  # (so the suite's bfloat16 runs of the kernels compute as a GPU)
    monkeypatch.setattr(launcher, "BFLOAT16_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="computes bfloat16 unlike a GPU"):
        multi_similarity_loss(torch.randn(8, 4, dtype=torch.bfloat16), torch.arange(8) // 2, backend="triton")
    assert multi_similarity_loss(torch.randn(8, 4), torch.arange(8) // 2, backend="triton") > 0
