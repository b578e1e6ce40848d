"""The reference (the spec in code) against hand-computed values and an independent per-anchor loop."""
import math

import numpy as np
import pytest
import torch

from ms_loss_cuda import reference

from conftest import make_batch


def loop_loss(x, labels, ref=None, ref_labels=None, ids=None, ref_ids=None, *, alpha, beta, base,
              epsilon, mining, skip_incomplete_anchors=False):
    """Per-anchor losses of the MS loss, one anchor and one pair at a time, in numpy float64."""
    x = x.detach().double().numpy()
    self_case = ref is None
    r = x if self_case else ref.detach().double().numpy()
    labels = labels.tolist()
    ref_labels = labels if self_case else ref_labels.tolist()
    losses = []
    for i in range(len(x)):
        pos, neg = [], []
        for j in range(len(r)):
            if ids is not None:
                if ids[i] == (ids if self_case else ref_ids)[j]:
                    continue
            elif self_case and i == j:
                continue
            s = float(np.dot(x[i], r[j]))
            (pos if labels[i] == ref_labels[j] else neg).append(s)
        if mining:
            minpos, maxneg = min(pos, default=math.inf), max(neg, default=-math.inf)
            pos, neg = [s for s in pos if s - epsilon < maxneg], [s for s in neg if s + epsilon > minpos]
        if skip_incomplete_anchors and (not pos or not neg):
            losses.append(0.0)
            continue
        lp = math.log1p(sum(math.exp(-alpha * (s - base)) for s in pos))
        ln = math.log1p(sum(math.exp(beta * (s - base)) for s in neg))
        losses.append(lp / alpha + ln / beta)
    return torch.tensor(losses, dtype=torch.float64)


def test_hand_computed_reference_set_case():
    # One anchor x = [1] against a reference set: S is the reference column itself.
    x = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[0.3], [0.35], [0.1], [0.9]], dtype=torch.float64, requires_grad=True)
    labels, ref_labels = torch.tensor([0]), torch.tensor([0, 1, 1, 0])
    loss = reference.multi_similarity_loss(x, labels, ref, ref_labels, alpha=2, beta=50, base=0.5, epsilon=0.1)
    # Positives 0.3, 0.9; negatives 0.35, 0.1. Mining keeps P = {0.3} (0.2 < 0.35, 0.8 is not)
    # and N = {0.35} (0.45 > 0.3, 0.2 is not).
    lp, ln = math.log(1 + math.exp(-2 * (0.3 - 0.5))), math.log(1 + math.exp(50 * (0.35 - 0.5)))
    assert loss.item() == pytest.approx(lp / 2 + ln / 50, rel=1e-12)
    loss.backward()
    w_pos = -math.exp(-2 * (0.3 - 0.5) - lp)  # dL/dS for the kept positive
    w_neg = math.exp(50 * (0.35 - 0.5) - ln)  # and for the kept negative
    assert x.grad.item() == pytest.approx(w_pos * 0.3 + w_neg * 0.35, rel=1e-12)
    assert ref.grad.flatten().tolist() == pytest.approx([w_pos, w_neg, 0.0, 0.0], rel=1e-12)


def test_hand_computed_self_case_without_mining():
    x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1])
    # S01 = 0.8, S02 = 0, S12 = 0.6
    term_p = lambda s: math.log(1 + math.exp(-2 * (s - 0.5))) / 2  # noqa: E731
    term_n = lambda *s: math.log(1 + sum(math.exp(50 * (v - 0.5)) for v in s)) / 50  # noqa: E731
    expected = [term_p(0.8) + term_n(0.0), term_p(0.8) + term_n(0.6), term_n(0.0, 0.6)]
    got = reference.multi_similarity_loss(x, labels, mining=False, reduction="none")
    assert got.tolist() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("case", ["self", "self_ids", "ref", "ref_ids"])
def test_reference_matches_per_anchor_loop(mining, skip, case):
    x, labels = make_batch(23, 5, 4, seed=1)
    x = torch.nn.functional.normalize(x, dim=1)
    kwargs = dict(alpha=2.0, beta=10.0, base=0.5, epsilon=0.1, mining=mining, skip_incomplete_anchors=skip)
    ref = ref_labels = ids = ref_ids = None
    if case.startswith("ref"):
        ref, ref_labels = make_batch(17, 5, 4, seed=2)
        ref = torch.nn.functional.normalize(ref, dim=1)
    if case.endswith("ids"):
        ids = torch.randint(0, 30, (23,), generator=torch.Generator().manual_seed(3))
        ref_ids = None if ref is None else torch.randint(0, 30, (17,), generator=torch.Generator().manual_seed(4))
    got = reference.multi_similarity_loss(x, labels, ref, ref_labels, ids, ref_ids, reduction="none", **kwargs)
    expected = loop_loss(x, labels, ref, ref_labels, ids, ref_ids, **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert expected.sum() > 0
    if mining:  # the data are structured enough for mining to drop pairs
        assert not torch.allclose(expected, loop_loss(x, labels, ref, ref_labels, ids, ref_ids, **dict(kwargs, mining=False)))


@pytest.mark.parametrize("mining", [True, False])
def test_reference_gradcheck(mining):
    x, labels = make_batch(9, 3, 3, seed=5)
    ref, ref_labels = make_batch(6, 3, 3, seed=6)
    x.requires_grad_(), ref.requires_grad_()
    fn = lambda a, b: reference.multi_similarity_loss(a, labels, b, ref_labels, mining=mining, beta=5.0)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, ref))
    fn_self = lambda a: reference.multi_similarity_loss(a, labels, mining=mining, beta=5.0, reduction="none")  # noqa: E731
    assert torch.autograd.gradcheck(fn_self, (x,))


def test_reference_similarities_stay_float32_under_autocast():
    """Under autocast the product x @ r.T would run in 16 bits; the spec computes every similarity in
    float32 (float64 for float64 inputs), autocast or not."""
    x, labels = make_batch(40, 16, 5, dtype=torch.float32, seed=7)
    x = torch.nn.functional.normalize(x, dim=1)
    plain = reference.multi_similarity_loss(x, labels, reduction="none")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = reference.multi_similarity_loss(x, labels, reduction="none")
    assert under.dtype == torch.float32
    torch.testing.assert_close(under, plain, rtol=1e-6, atol=1e-7)
