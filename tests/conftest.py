"""Shared test data (structured embeddings: classes whose mined sets are real subsets) and the
check every fused backend passes: loss and gradients against the float64 reference."""
import contextlib
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# Without a GPU the Triton kernels run under the interpreter on CPU tensors; it must be chosen
# before they are first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETER_CHANGED = False
if os.environ.get("TRITON_INTERPRET") == "1":
    import fast_interpreter

    INTERPRETER_CHANGED = fast_interpreter.install()

from ms_loss_cuda import multi_similarity_loss, ops  # noqa: E402
from ms_loss_cuda.reference import pair_masks  # noqa: E402


@pytest.fixture
def overflow_checked():
    """The Triton interpreter's integer overflow checks, which the suite otherwise leaves off
    (fast_interpreter), on for the test, an overflow raising: for kernels given keys or indices near
    the int32 range."""
    if not INTERPRETER_CHANGED:
        yield
        return
    before = fast_interpreter.overflow_checks(True)
    try:
        yield
    finally:
        fast_interpreter.restore(before)


# rtol of the loss and of the gradients (relative to their largest entry) per input dtype
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _draw(batch, dim, classes, seed):
    """Labels, each row's class centre and a unit-variance noise of each row (float64)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (batch,), generator=gen)
    centres = torch.randn(classes, dim, generator=gen, dtype=torch.float64)
    return labels, centres[labels], torch.randn(batch, dim, generator=gen, dtype=torch.float64)


def make_batch(batch, dim, classes, *, dtype=torch.float64, seed=0, spread=1.0, labels_dtype=torch.int64):
    """Embeddings drawn around class centres: positives are mostly close, some are hard, and some
    negatives are hard, so mining keeps a proper subset of the pairs."""
    labels, centres, noise = _draw(batch, dim, classes, seed)
    return (centres + spread * noise).to(dtype), labels.to(labels_dtype)


def label_order_by_torch(keys, block_m):
    """The self case's label order by torch's ops (the reference for the triton backend's
    _label_order_kernel): the stable order of the keys, the first position of each sorted key, each
    key's rank in the caller's order and, for blocks of block_m positions, where the first key of
    the block begins and where the last one ends [blocks, 2]; int64 tensors."""
    wide = keys.long()
    sorted_keys, order = torch.sort(wide, stable=True)
    first = torch.searchsorted(sorted_keys, sorted_keys)
    ends = torch.searchsorted(sorted_keys, sorted_keys, right=True)
    lasts = ends[[min(start + block_m, len(keys)) - 1 for start in range(0, len(keys), block_m)]]
    return order, first, torch.searchsorted(sorted_keys, wide), torch.stack([first[::block_m], lasts], 1)


def assert_close(actual, expected, rtol, floor=0.0):
    """|actual - expected| <= rtol * (|expected| + max |expected|) + one step of actual's dtype at 0,
    elementwise. Relative to the tensor's largest entry, so that entries whose true value is about 0
    compare at the tensor's own scale (a "mean" gradient's is small: divided by B), and no finer than
    actual's dtype can hold a value near 0 (its subnormal step, 6e-8 in float16). `floor`: the least
    scale, for values that round relative to a constant rather than to themselves (LOSS_FLOOR)."""
    info = torch.finfo(actual.dtype)
    actual = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    atol = rtol * max(scale, floor) + info.smallest_normal * info.eps
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# a loss sums terms log(1 + sum exp(.)) / alpha (or / beta): one close to 0 rounds at the precision of
# 1 + its sum, not at its own (float32 gives 0 for a term of 3e-12), so losses compare at this scale at least
LOSS_FLOOR = 1e-2


def _anchors_that_mine(x, labels, ref_x, ref_labels, epsilon=0.1):
    """The share of x's rows whose mined sets against ref_x (x itself when None) are not empty."""
    pos, neg = pair_masks(labels, ref_labels)
    s = F.normalize(x, dim=1) @ F.normalize(x if ref_x is None else ref_x, dim=1).T
    minpos = torch.where(pos, s, torch.inf).amin(1, keepdim=True)
    return (neg & (s + epsilon > minpos)).any(1).double().mean().item()


def build_case(case, batch, dim, dtype, seed=0, labels_dtype=torch.int64):
    """Keyword arguments of multi_similarity_loss for one kind of call: rows around batch // 6 class
    centres (a reference set around the same centres, so that its rows of an anchor's class are
    positives), spread so that about half of the anchors keep a proper subset of their pairs and the
    others none."""
    rows = batch + (batch // 2 + 3 if case.startswith("ref") else 0)
    labels, centres, noise = _draw(rows, dim, max(2, batch // 6), seed)
    low, high = -3.0, 3.0  # log2 of the spread, bisected on the share of anchors that mine
    for _ in range(12):
        middle = (low + high) / 2
        x = centres + 2 ** middle * noise
        split = (x[batch:], labels[batch:]) if rows > batch else (None, None)
        low, high = (low, middle) if _anchors_that_mine(x[:batch], labels[:batch], *split) > 0.5 else (middle, high)
    x, labels = x.to(dtype), labels.to(labels_dtype)  # (the last spread tried)
    x, other, labels, other_labels = x[:batch], x[batch:], labels[:batch], labels[batch:]
    kwargs = dict(embeddings=x, labels=labels)
    if case.startswith("ref"):
        if case == "ref_own_copy":  # a memory bank that holds the batch itself: skipped by identity
            other, other_labels = torch.cat([x, other]), torch.cat([labels, other_labels])
        kwargs.update(ref_embeddings=other, ref_labels=other_labels)
    if case in ("self_ids", "ref_ids", "ref_own_copy"):
        kwargs["ids"] = torch.arange(batch) * 3 % (batch + 1)  # distinct, not the row index
        if case.startswith("ref"):
            rows = kwargs["ref_embeddings"].shape[0]
            ref_ids = torch.arange(batch + 5, batch + 5 + rows)
            if case == "ref_own_copy":
                ref_ids[:batch] = kwargs["ids"]
            kwargs["ref_ids"] = ref_ids
    return kwargs


def threshold_crossing(dtype, device="cpu"):
    """(x [1, 64], bank, moved bank, labels, ref_labels, hyper-parameters) of an anchor whose mined sets
    are empty against `bank` (a positive at S = 0.7 and a negative at S = 0.55, epsilon between them),
    while against `moved bank`, its negative moved by about 1e-3, the negative crosses the threshold
    (S_forward + epsilon < minpos < S_backward + epsilon): what a backward that recomputes S in another
    order than its forward may meet, in the rows' dtype on `device`."""
    gen = torch.Generator().manual_seed(0)
    a, other = F.normalize(torch.randn(2, 64, generator=gen, dtype=torch.float64), dim=1)
    other = F.normalize(other - (other @ a) * a, dim=0)
    positive, negative = 0.7 * a + 0.51 ** 0.5 * other, 0.55 * a - (1 - 0.55 ** 2) ** 0.5 * other
    moved = negative + 1e-3 * a  # (S + 1e-3)
    x, bank, moved_bank = (t.to(dtype).to(device) for t in (a[None], torch.stack([positive, negative]),
                                                            torch.stack([positive, moved])))
    s_positive, s_forward, s_backward = (float(x.double() @ r.double()) for r in (bank[0], bank[1], moved_bank[1]))
    epsilon = s_positive - (s_forward + s_backward) / 2
    labels, ref_labels = torch.tensor([0], device=device), torch.tensor([0, 1], device=device)
    return x, bank, moved_bank, labels, ref_labels, (2.0, 50.0, 0.5, epsilon, True, False)


def loss_and_grads(kwargs, backend, grad_output, ref_grad=True, **options):
    """The loss and the gradients of the embeddings (and of the reference set, when there is one and
    ref_grad)."""
    inputs = [kwargs["embeddings"]] + ([kwargs["ref_embeddings"]] if "ref_embeddings" in kwargs and ref_grad else [])
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    call = dict(kwargs, embeddings=inputs[0], **options)
    if len(inputs) == 2:
        call["ref_embeddings"] = inputs[1]
    loss = multi_similarity_loss(backend=backend, **call)
    grads = torch.autograd.grad(loss, inputs, grad_output(loss))
    return loss, grads


def to(kwargs, device, float_dtype=None):
    """kwargs with every tensor on `device` (and floating tensors in `float_dtype` when given)."""
    return {k: v.to(device, float_dtype if float_dtype is not None and v.is_floating_point() else v.dtype)
            for k, v in kwargs.items()}


def check_against_reference(backend, kwargs, dtype, reduction="mean", device="cpu", rtol=None, ref_grad=True,
                            ops_run=None, **options):
    """`backend` on `kwargs` (moved to `device`) against the float64 reference on CPU: loss and
    gradients with a grad_output other than 1, within TOLERANCE[dtype] (or rtol); without ref_grad
    the reference set takes no gradient (a memory bank). And proof that the backend's own kernels
    computed them (a fallback to the dense reference would pass the comparison): a forward and a
    backward Triton kernel launched, or the fused forward and backward ops dispatched (`ops_run`, by
    default the extension's)."""
    def grad_output(loss):  # not 1: a scalar 0.7, or a random vector for "none"
        gen = torch.Generator().manual_seed(11)
        out = torch.full(loss.shape, 0.7) if loss.dim() == 0 else torch.randn(loss.shape, generator=gen)
        return out.to(loss.device, loss.dtype)

    with _kernels_run(backend) as ran:
        loss, grads = loss_and_grads(to(kwargs, device), backend, grad_output, ref_grad, reduction=reduction,
                                     **options)
    if backend == "triton":  # (a forward kernel, and a backward's: the fused or the chunked one)
        assert "finish_kernel" in ran and ran & {"grad_kernel", "weights_kernel"}, sorted(ran)
    elif backend in ("cpu", "cuda"):
        forward, backward = ops_run or (ops.forward_op, ops.backward_op)
        # (a backward on CUDA tensors runs on autograd's device thread, whose ops this may not see)
        expected = {forward.name()} | ({backward.name()} if torch.device(device).type == "cpu" else set())
        assert expected <= ran, (expected, sorted(ran))
    ref_loss, ref_grads = loss_and_grads(to(kwargs, "cpu", torch.float64), "reference", grad_output, ref_grad,
                                         reduction=reduction, **options)
    assert loss.dtype == dtype  # the embeddings' dtype, as torch's losses
    for g, t in zip(grads, [kwargs["embeddings"], kwargs.get("ref_embeddings")]):
        assert g.dtype == t.dtype and g.shape == t.shape and g.device.type == torch.device(device).type
    rtol = TOLERANCE[dtype] if rtol is None else rtol
    assert_close(loss, ref_loss, rtol, LOSS_FLOOR)
    for g, ref_g in zip(grads, ref_grads):
        assert_close(g, ref_g, rtol)
    return ref_loss, ref_grads


def launch_recorder(launches):
    """A stand-in for launcher.Launch.__call__ that appends each Launch to `launches` and runs it (what
    targets.recorded_launches and `_kernels_run` put in its place)."""
    from ms_loss_cuda.triton_kernels import launcher

    run = launcher.Launch.__call__

    def record(launch, *args):
        launches.append(launch)
        return run(launch, *args)

    return record


@contextlib.contextmanager
def _kernels_run(backend):
    """The names of what ran inside the block, filled in as it ends: the Triton kernels launched (backend
    "triton"), or the ops that went through torch's dispatcher."""
    ran = set()
    if backend != "triton":
        with _OpNames(ran):
            yield ran
        return
    from ms_loss_cuda.triton_kernels import launcher

    launches = []
    with mock.patch.object(launcher.Launch, "__call__", launch_recorder(launches)):
        yield ran
    ran.update(launch.kernel.fn.__name__ for launch in launches)


class _OpNames(TorchDispatchMode):
    """Adds the name of every op dispatched inside it to `names`."""

    def __init__(self, names):
        super().__init__()
        self.names = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    """No backend forced from the environment, and no CUDA-graph replay (a test that calls one shape
    twice would check the second call's kernels only if it launched them; tests/test_graph_replay.py
    checks replay itself)."""
    monkeypatch.delenv("MS_LOSS_BACKEND", raising=False)
    monkeypatch.setenv("MS_LOSS_CUDA_GRAPHS", "0")
