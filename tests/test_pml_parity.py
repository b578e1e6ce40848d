"""Parity with pytorch-metric-learning: MultiSimilarityLoss (+ MultiSimilarityMiner) in float64."""
import pytest
import torch

from ms_loss_cuda import MultiSimilarityLoss, available_backends

from conftest import make_batch

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
pml_miners = pytest.importorskip("pytorch_metric_learning.miners")

BACKENDS = [b for b in ("reference", "cpu") if b in available_backends()]
HYPER = [dict(alpha=2.0, beta=50.0, base=0.5, epsilon=0.1), dict(alpha=1.0, beta=10.0, base=0.3, epsilon=0.2)]


def loss_and_grads(fn, *tensors):
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    loss = fn(*tensors)
    return loss, torch.autograd.grad(loss, tensors)


def assert_same(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-10, atol=1e-12)
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hyper", HYPER)
@pytest.mark.parametrize("mining", [True, False])
def test_self_case_matches_pml(backend, hyper, mining):
    x, labels = make_batch(64, 16, 8, seed=1)
    pml_loss = pml_losses.MultiSimilarityLoss(hyper["alpha"], hyper["beta"], hyper["base"])
    miner = pml_miners.MultiSimilarityMiner(hyper["epsilon"])
    ours = MultiSimilarityLoss(**hyper, mining=mining, backend=backend)
    theirs = loss_and_grads(lambda e: pml_loss(e, labels, miner(e, labels) if mining else None), x)
    assert theirs[0] > 0
    assert_same(loss_and_grads(lambda e: ours(e, labels), x), theirs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mining", [True, False])
def test_reference_set_matches_pml(backend, mining):
    x, labels = make_batch(48, 16, 6, seed=2)
    ref, ref_labels = make_batch(80, 16, 6, seed=3)
    pml_loss, miner = pml_losses.MultiSimilarityLoss(), pml_miners.MultiSimilarityMiner()
    ours = MultiSimilarityLoss(mining=mining, backend=backend)

    def pml_fn(e, r):
        pairs = miner(e, labels, r, ref_labels) if mining else None
        return pml_loss(e, labels, pairs, r, ref_labels)

    theirs = loss_and_grads(pml_fn, x, ref)
    assert theirs[0] > 0
    assert_same(loss_and_grads(lambda e, r: ours(e, labels, ref_emb=r, ref_labels=ref_labels), x, ref), theirs)


@pytest.mark.parametrize("make_miner", [
    lambda: pml_miners.TripletMarginMiner(margin=0.2, type_of_triplets="semihard"),
    lambda: pml_miners.PairMarginMiner(pos_margin=0.8, neg_margin=0.3),
    lambda: pml_miners.BatchHardMiner(),
], ids=["triplet", "pair_margin", "batch_hard"])
@pytest.mark.parametrize("with_ref", [False, True])
def test_indices_tuple_of_other_miners(make_miner, with_ref):
    x, labels = make_batch(40, 8, 5, seed=4)
    ref, ref_labels = make_batch(30, 8, 5, seed=5) if with_ref else (None, None)
    miner, pml_loss = make_miner(), pml_losses.MultiSimilarityLoss()
    ours = MultiSimilarityLoss(backend="cpu" if "cpu" in BACKENDS else "reference")
    tensors = (x,) if ref is None else (x, ref)

    def run(loss_fn):
        def fn(e, r=None):
            pairs = miner(e, labels, r, ref_labels)
            assert len(pairs[0]) > 0
            return loss_fn(e, labels, pairs, r, ref_labels)
        return loss_and_grads(fn, *tensors)

    theirs = run(pml_loss)
    assert theirs[0] > 0
    assert_same(run(ours), theirs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ref_is_x,mining", [(True, True), (True, False), (False, False)],
                         ids=["x_itself-mined", "x_itself", "a_copy_of_x"])
def test_the_labels_tensor_at_both_ends_makes_the_batch_its_own_reference(backend, mining, ref_is_x):
    """pytorch-metric-learning's loss takes `ref_labels` that is `labels` itself for the batch as its
    own reference set, and skips each row's pair with itself, whatever ref_emb is; so does the module
    (a row's pair with itself would otherwise be a positive of similarity 1). (Its miner asks that
    ref_emb be the embeddings' tensor instead, and with a copy mines pairs its loss then refuses.)"""
    x, labels = make_batch(40, 16, 6, seed=6)
    pml_loss, miner = pml_losses.MultiSimilarityLoss(), pml_miners.MultiSimilarityMiner()
    ours = MultiSimilarityLoss(mining=mining, backend=backend)

    def pair_up(loss_fn):
        def fn(e):
            r = e if ref_is_x else e.detach().clone()
            pairs = miner(e, labels, r, labels) if mining and loss_fn is pml_loss else None
            return loss_fn(e, labels, pairs, r, labels)
        return fn

    theirs = loss_and_grads(pair_up(pml_loss), x)
    assert theirs[0] > 0
    assert_same(loss_and_grads(pair_up(ours), x), theirs)
