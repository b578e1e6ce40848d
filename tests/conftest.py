"""Shared test data: structured embeddings (classes whose mined sets are real subsets) and helpers."""
import pytest
import torch


def make_batch(batch, dim, classes, *, dtype=torch.float64, seed=0, spread=1.0, labels_dtype=torch.int64):
    """Embeddings drawn around class centres: positives are mostly close, some are hard, and some
    negatives are hard, so mining keeps a proper subset of the pairs."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (batch,), generator=gen)
    centres = torch.randn(classes, dim, generator=gen, dtype=torch.float64)
    x = centres[labels] + spread * torch.randn(batch, dim, generator=gen, dtype=torch.float64)
    return x.to(dtype), labels.to(labels_dtype)


def assert_close(actual, expected, rtol, min_scale=1e-2):
    """|actual - expected| <= rtol * (|expected| + max(|expected|)) elementwise: relative to the
    tensor's largest entry, so gradients whose true value is ~0 compare at the right scale
    (min_scale keeps an all-but-zero tensor from demanding exact zeros)."""
    actual = actual.detach().double()
    expected = expected.detach().double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    atol = rtol * max(scale, min_scale)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("MS_LOSS_BACKEND", raising=False)
