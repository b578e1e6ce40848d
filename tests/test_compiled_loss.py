"""The benchmark's `compiled` provider computes the library's function: bench/compiled_loss.py's dense
loss, loss and gradient, against ms_loss_cuda's reference backend in float64, on data where mining
keeps a proper subset of the pairs, in the self case and against a memory bank. Eager and traced
through torch.compile's graph capture and autograd (backend "aot_eager": seconds); the benchmark
checks the inductor build itself once per run, as it compiles anyway (about 10 s a shape on two cores)."""
import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import compiled_loss  # noqa: E402
from compiled_loss import check, dense_ms_loss  # noqa: E402


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bank", [False, True])
@pytest.mark.parametrize("mining", [True, False])
def test_dense_loss_matches_reference(device, bank, mining):
    assert check(dense_ms_loss, device, bank=bank, mining=mining) <= 1e-9


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bank", [False, True])
def test_traced_loss_matches_reference(device, bank):
    torch.compiler.reset()
    assert check(torch.compile(dense_ms_loss, backend="aot_eager"), device, bank=bank) <= 1e-9


def test_mining_matters_on_the_check_data():
    """The check data tells mining from none, and the miner's epsilon: a loss that mines otherwise fails."""
    ignores_mining = lambda *args, mining: dense_ms_loss(*args, mining=False)  # noqa: E731
    for wrong in (ignores_mining, functools.partial(dense_ms_loss, epsilon=0.05)):
        with pytest.raises(AssertionError):
            check(wrong)


def test_check_data_mines_a_proper_subset():
    from ms_loss_cuda import reference

    for bank in (False, True):
        kept = reference.mined_fraction(*compiled_loss.check_data(bank), anchors=64)
        assert 0.2 < kept < 0.8
