"""tests/interpreter_bfloat16.py: under the interpreter, a Triton kernel's float32 to bfloat16 cast
rounds as torch (and a GPU) do, to nearest even, and its bfloat16 tl.dot multiplies the values."""
import numpy as np
import pytest
import torch

from interpreter_bfloat16 import bfloat16_bits, bfloat16_values
from targets import DEVICE

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def test_the_rounding_is_torchs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=gen) * 10.0 ** torch.randint(-44, 38, (20000,), generator=gen).float()
    x = torch.cat([x, torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0, 1e-45])])
    expected = x.to(torch.bfloat16)
    got = torch.from_numpy(bfloat16_bits(x.numpy()).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int16), expected[~expected.isnan()].view(torch.int16))
    values = torch.from_numpy(bfloat16_values(expected.view(torch.int16).numpy().view(np.uint16)))
    assert torch.equal(values[~values.isnan()], expected.float()[~expected.isnan()])


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
