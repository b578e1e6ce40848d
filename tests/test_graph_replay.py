"""The triton backend's eager steps replayed as CUDA graphs (triton_kernels/replay.py).

Without a GPU the capture is played by a stand-in whose replay runs the captured step again on the
graph's own inputs and writes its results into the captured outputs, as a replay does: this checks
what replay.call decides (when to capture, what it copies, what it keeps in place, what it returns)
through the real eager path under the interpreter. With a GPU the same tests run on CUDA graphs.
"""
import functools
import warnings

import pytest
import torch

import ms_loss_cuda
from conftest import assert_close, loss_and_grads, make_batch, to

triton_kernels = pytest.importorskip("ms_loss_cuda.triton_kernels")
from ms_loss_cuda.triton_kernels import replay  # noqa: E402

GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU and not triton_kernels.INTERPRETED,
                                reason="no GPU, and TRITON_INTERPRET=1 not set before the kernels were imported")
DEVICE = "cuda" if GPU else "cpu"
GRAD_OUTPUT = lambda loss: torch.full_like(loss, 0.7)  # noqa: E731


class StandInGraph:
    """A capture without a GPU: the step runs once at capture, and again at each replay."""

    def __init__(self, step, inputs):
        self.step, self.inputs, self.replays = step, inputs, 0
        self.outputs = step(*inputs)

    def replay(self):
        self.replays += 1
        for mine, new in zip(self.outputs, self.step(*self.inputs)):
            if mine is not None:
                mine.copy_(new)


@pytest.fixture
def captures(monkeypatch):
    """The graphs captured during the test (StandInGraph without a GPU, CUDA graphs with one)."""
    made = []
    capture = replay.capture

    def recorded(step, inputs):
        graph, outputs = (capture(step, inputs) if GPU else
                          (lambda g: (g, g.outputs))(StandInGraph(step, inputs)))
        made.append(graph)
        return graph, outputs

    if not GPU:
        monkeypatch.setattr(replay, "capturable", lambda device: True)
    monkeypatch.setattr(replay, "capture", recorded)
    monkeypatch.delenv("MS_LOSS_CUDA_GRAPHS", raising=False)
    replay.clear()
    yield made
    replay.clear()


def check(x, labels, ref=None, ref_labels=None, ref_grad=True, **options):
    """The triton backend's loss and gradients (grad_output 0.7) against the float64 reference's;
    returns the backend's. The reference set takes a gradient where ref_grad (else it is passed as
    it is: a memory bank, read in place)."""
    kwargs = dict(embeddings=x.to(DEVICE), labels=labels.to(DEVICE))
    if ref is not None:
        kwargs.update(ref_embeddings=ref.to(DEVICE), ref_labels=ref_labels.to(DEVICE))
    loss, grads = loss_and_grads(kwargs, "triton", GRAD_OUTPUT, ref_grad, **options)
    ref_loss, ref_grads = loss_and_grads(to(kwargs, "cpu", torch.float64), "reference", GRAD_OUTPUT, ref_grad,
                                         **options)
    assert_close(loss, ref_loss, 1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r, 1e-5)
    return loss.detach(), grads


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_shape_seen_again_is_captured_once_and_replayed_on_new_data(captures, reduction):
    for seed in range(4):  # first call as it is, the second captures and replays, then replays
        x, labels = make_batch(37, 16, 6, dtype=torch.float32, seed=seed)
        check(x, labels, reduction=reduction)
    assert len(captures) == 1
    if not GPU:  # (the stand-in counts its replays)
        assert captures[0].replays == 3


def test_a_bank_is_read_in_place_and_one_at_another_address_is_not_captured(captures):
    x, labels = make_batch(29, 16, 5, dtype=torch.float32, seed=1)
    bank, bank_labels = make_batch(41, 16, 5, dtype=torch.float32, seed=2)
    bank = bank.to(DEVICE)
    for step in range(3):
        bank[step] = -bank[step]  # (a memory bank's enqueue: the same tensor, new rows)
        check(x + step, labels, bank, bank_labels, ref_grad=False)
    assert len(captures) == 1
    banks = [bank.flip(0) * (k + 1) for k in range(2)]  # (all alive: each at its own address)
    for other in banks:
        check(x, labels, other, bank_labels, ref_grad=False)
    assert len(captures) == 1
    for k in range(3):  # new banks freed in turn: the allocator may give one the address of the last
        check(x, labels, bank.roll(k + 1, 0), bank_labels, ref_grad=False)


@pytest.fixture
def copies(monkeypatch):
    """The gradients a replay copied out of its graph before overwriting them (replay.Lent.keep)."""
    made, keep = [], replay.Lent.keep
    monkeypatch.setattr(replay.Lent, "keep", lambda lease: (made.append(lease), keep(lease))[1])
    return made


def test_results_are_copies_that_later_replays_leave_alone(captures, copies):
    x, labels = make_batch(33, 16, 6, dtype=torch.float32, seed=3)
    check(x, labels)
    loss, grads = check(x, labels)  # captured and replayed
    kept = loss.clone(), grads[0].clone()
    check(2 * x.flip(0), labels)  # replayed on other data
    assert torch.equal(loss, kept[0]) and torch.equal(grads[0], kept[1])
    assert copies == []  # (each step's backward ran before the next: its gradient was lent, never copied)
    # two forwards before one backward: the second replay copies the first's gradient out, once
    first, second = (x.clone().to(DEVICE).requires_grad_() for _ in range(2))
    losses = [ms_loss_cuda.multi_similarity_loss(t * s, labels.to(DEVICE), backend="triton")
              for t, s in ((first, 1.0), (second, -1.0))]
    sum(losses).backward()
    for t, s in ((first, 1.0), (second, -1.0)):
        xd = (x.double() * s).detach().requires_grad_()  # (a leaf: d/dt L(s t) = s L'(s t))
        ms_loss_cuda.multi_similarity_loss(xd, labels, backend="reference").backward()
        assert_close(t.grad, xd.grad * s, 1e-5)
    assert len(copies) == 1


@pytest.mark.parametrize("copying", [True, False])
def test_under_saved_tensor_hooks_each_step_saves_a_copy_of_its_gradient(captures, copies, copying):
    """A pack hook may save another tensor in the token's place (a copy of it, say) or move what is saved
    off the GPU: under hooks a replayed step saves a copy of its gradient, for the hooks to pack (here
    a copy of that, or it as it is), and lends nothing."""
    x, labels = make_batch(29, 16, 5, dtype=torch.float32, seed=12)
    x, labels = x.to(DEVICE), labels.to(DEVICE)
    packed = []
    pack = lambda t: packed.append(t.numel()) or (t.clone() if copying else t)  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(3):  # (seen, then captured)
            ms_loss_cuda.multi_similarity_loss(x.clone().requires_grad_(), labels, backend="triton").backward()
        t, u = x.clone().requires_grad_(), x.flip(0).clone().requires_grad_()
        losses = [ms_loss_cuda.multi_similarity_loss(v, labels, backend="triton") for v in (t, u)]
        sum(losses).backward()
    for v in (t, u):
        xd = v.detach().double().requires_grad_()
        ms_loss_cuda.multi_similarity_loss(xd, labels, backend="reference").backward()
        assert_close(v.grad, xd.grad, 1e-5)
    assert len(captures) == 1 and copies == [] and x.numel() in packed


def test_a_lease_holds_no_memory_once_its_backward_ran_and_raises_if_its_token_goes_early(captures):
    x, labels = make_batch(28, 16, 5, dtype=torch.float32, seed=13)
    x, labels = x.to(DEVICE), labels.to(DEVICE)
    for step in range(3):  # (seen, captured, replayed)
        loss = ms_loss_cuda.multi_similarity_loss(x.clone().requires_grad_(), labels, backend="triton")
        leases = [lease for lease in loss.grad_fn.leases if lease is not None]
        assert len(leases) == (step > 0) and all(lease.tensor is not None for lease in leases)
        loss.backward()
        assert all(lease.tensor is None for lease in leases)  # (the loss lives on: its lease holds no memory)
    # a hook registered on the node after the forward packs another tensor in the token's place
    loss = ms_loss_cuda.multi_similarity_loss(x.clone().requires_grad_(), labels, backend="triton")
    loss.grad_fn._raw_saved_tensors[2].register_hooks(lambda t: t.clone(), lambda t: t)  # (x, ref, the token)
    with pytest.raises(RuntimeError, match="MS_LOSS_CUDA_GRAPHS=0"):
        loss.backward()


def test_a_checkpointed_loss_takes_its_gradient(captures):
    """torch.utils.checkpoint (non-reentrant) recomputes the forward during the backward and reads the
    node's saved tensors once."""
    from torch.utils.checkpoint import checkpoint

    x, labels = make_batch(27, 16, 5, dtype=torch.float32, seed=14)
    x, labels = x.to(DEVICE), labels.to(DEVICE)
    weight = torch.eye(16, device=DEVICE)
    for _ in range(3):
        t = x.clone().requires_grad_()
        loss = checkpoint(lambda v: ms_loss_cuda.multi_similarity_loss(v @ weight, labels, backend="triton"), t,
                          use_reentrant=False)
        loss.backward()
        xd = x.detach().double().requires_grad_()
        ms_loss_cuda.multi_similarity_loss(xd, labels, backend="reference").backward()
        assert_close(t.grad, xd.grad, 1e-5)


@pytest.mark.parametrize("memory", [False, True])
def test_a_gradient_kept_for_a_second_backward_survives_the_next_replay(captures, copies, memory):
    x, labels = make_batch(30, 16, 5, dtype=torch.float32, seed=11)
    x, labels, ids = x.to(DEVICE), labels.to(DEVICE), torch.arange(30, device=DEVICE)
    if memory:  # (CrossBatchMemory's one-call step, full after its first batch)
        loss_of = ms_loss_cuda.CrossBatchMemory(30, 16, backend="triton")
        loss_of = functools.partial(loss_of, labels=labels, ids=ids)
    else:
        loss_of = functools.partial(ms_loss_cuda.multi_similarity_loss, labels=labels, backend="triton")
    for _ in range(3):  # (seen, then captured)
        loss_of(x.clone().requires_grad_()).backward()
    assert len(captures) == 1
    t = x.clone().requires_grad_()
    loss = loss_of(t)
    loss.backward(retain_graph=True)
    first = t.grad.clone()
    loss_of((2 * x.flip(0)).requires_grad_()).backward()  # the graph replayed on other data
    loss.backward()  # reads the gradient the replay copied out of the graph's memory
    assert len(copies) == 1 and first.abs().max() > 0
    assert torch.equal(t.grad, 2 * first)


def test_options_and_shapes_make_their_own_graphs_and_few_are_kept(captures, monkeypatch):
    x, labels = make_batch(31, 16, 5, dtype=torch.float32, seed=4)
    for batch in (31, 30, 29, 28):
        for _ in range(2):
            check(x[:batch], labels[:batch])
    for _ in range(2):
        check(x, labels, alpha=3.0)
    assert len(captures) == replay.CAPACITY + 1
    assert [len(store.graphs) for store in replay._stores.values()] == [replay.CAPACITY]
    monkeypatch.setattr(replay, "_EVICTIONS", 1)  # past the evictions allowed: new shapes run as they are
    for _ in range(3):
        check(x[:27], labels[:27])
    assert len(captures) == replay.CAPACITY + 1


def test_each_device_keeps_its_own_graphs(monkeypatch):
    """Steps on two devices of one process: each keeps CAPACITY graphs, and shapes cycling on one
    neither evict the other's graphs nor count against its evictions (devices named on the CPU: the
    bookkeeping alone is checked, with the stand-in capture)."""
    made = []
    monkeypatch.setattr(replay, "capturable", lambda device: True)
    monkeypatch.setattr(replay, "capture", lambda step, inputs: (lambda g: (made.append(g), (g, g.outputs))[1])(
        StandInGraph(step, inputs)))
    monkeypatch.setattr(replay, "_EVICTIONS", 2)
    monkeypatch.delenv("MS_LOSS_CUDA_GRAPHS", raising=False)
    replay.clear()
    first, second = torch.device("cpu", 0), torch.device("cpu", 1)

    def step_on(device, rows, times=2):
        for _ in range(times):
            t = torch.arange(rows, dtype=torch.float32)
            (out,) = replay.call(lambda a: (2 * a,), (t,), (), (), "options", device, rows)
            assert torch.equal(out, 2 * t)

    try:
        for rows in range(1, replay.CAPACITY + 1):
            step_on(first, rows)
        assert len(made) == replay.CAPACITY
        for rows in range(1, replay.CAPACITY + 4):  # two evictions allowed: the last shape runs as it is
            step_on(second, rows)
        assert len(made) == 2 * replay.CAPACITY + 2
        assert [len(replay._stores[d].graphs) for d in (first, second)] == [replay.CAPACITY] * 2
        replays = [g.replays for g in made[:replay.CAPACITY]]
        for rows in range(1, replay.CAPACITY + 1):  # the first device's graphs are all still there
            step_on(first, rows, times=1)
        assert len(made) == 2 * replay.CAPACITY + 2
        assert [g.replays for g in made[:replay.CAPACITY]] == [r + 1 for r in replays]
        step_on(first, replay.CAPACITY + 1)  # and its evictions are its own: room for a new shape
        assert len(made) == 2 * replay.CAPACITY + 3
    finally:
        replay.clear()


def test_no_capture_when_turned_off_too_large_or_when_inputs_share_memory(captures, monkeypatch):
    x, labels = make_batch(27, 16, 5, dtype=torch.float32, seed=5)
    both = x.to(DEVICE)
    for _ in range(3):  # the bank a view of the batch's rows: a copy of the batch would separate them
        loss = ms_loss_cuda.multi_similarity_loss(both.requires_grad_(), labels.to(DEVICE),
                                                  ref_embeddings=both[1:].detach(), ref_labels=labels[1:].to(DEVICE),
                                                  backend="triton")
        loss.backward()
    with monkeypatch.context() as patch:
        patch.setattr(replay, "MOST_PAIRS", 27 * 27 - 1)  # a step of more pairs than replay takes
        for _ in range(3):
            check(x, labels)
    monkeypatch.setenv("MS_LOSS_CUDA_GRAPHS", "0")
    for _ in range(3):
        check(x, labels)
    assert captures == []


def test_inputs_passed_as_one_tensor_get_their_own_graph(captures):
    x, labels = make_batch(30, 16, 5, dtype=torch.float32, seed=6)
    bank = make_batch(30, 16, 5, dtype=torch.float32, seed=7)[0].to(DEVICE)
    shared = labels.to(DEVICE)
    for _ in range(3):  # the bank's labels are the batch's tensor: the graph holds one copy of both
        check(x, shared, bank, shared, ref_grad=False)
    others = shared.roll(5)
    for _ in range(3):  # then two tensors: another graph, or one copy would take both
        check(x, shared, bank, others, ref_grad=False)
    assert len(captures) == 2


def test_a_step_that_cannot_be_captured_warns_once_and_runs_as_it_is(captures, monkeypatch):
    """Its signature is not tried again, and after replay._FAILURES failed captures the device tries no
    more (what is kept of the failures stays that small, whatever shapes come)."""
    def failing(step, inputs):
        raise RuntimeError("out of memory in the graph's pool")

    monkeypatch.setattr(replay, "capture", failing)
    x, labels = make_batch(26, 16, 5, dtype=torch.float32, seed=8)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        for _ in range(2):
            check(x, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (the interpreter of Triton 3.4 warns of NumPy deprecations)
        for _ in range(2):  # (no second try, no second warning)
            check(x, labels)
    tries = []
    monkeypatch.setattr(replay, "capture", lambda step, inputs: (tries.append(1), failing(step, inputs))[1])
    with pytest.warns(RuntimeWarning, match="captures no more"):
        for batch in range(27, 27 + 2 * replay._FAILURES):  # (other shapes, each twice: the second call tries)
            x, labels = make_batch(batch, 16, 5, dtype=torch.float32, seed=batch)
            for _ in range(2):
                check(x, labels)
    assert len(tries) == replay._FAILURES - 1  # a device whose captures keep failing stops trying


@pytest.mark.skipif(not GPU, reason="cuBLAS's workspaces: CUDA only")
def test_a_kept_graph_owns_its_cublas_workspace(captures, monkeypatch):
    monkeypatch.delenv("MS_LOSS_TRITON_CHUNK_MB", raising=False)  # (the chunked backward: cuBLAS's products)
    x, labels = make_batch(700, 64, 60, dtype=torch.float32, seed=9)
    for _ in range(2):  # captured and replayed
        check(x, labels)
    # torch.compile's CUDA graphs clear torch's cached workspaces: none of them may be the graph's (its
    # own lies in its pool, and the cache holds nothing since its capture: no eager product ran since)
    allocated = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == allocated
    for _ in range(2):
        check(x, labels)
    assert len(captures) == 1


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_memory_step_is_captured_once_the_memory_is_full_and_stores_each_batch(captures, monkeypatch,
                                                                                   deterministic):
    """CrossBatchMemory's step in one call (the store and both terms): a new step while the memory fills
    (its size grows), then one graph that reads and writes the memory in place; in deterministic mode
    too, without a warning (nothing in the step reads back to the host)."""
    if deterministic:  # (what torch asks of cuBLAS in deterministic mode, where it still checks)
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            memory_steps_match_the_reference(captures)
    finally:
        torch.use_deterministic_algorithms(previous)


def memory_steps_match_the_reference(captures):
    """Nine steps of a CrossBatchMemory of 30 rows, batches of 10: loss and gradient (grad_output 0.7)
    against the float64 reference of a memory kept by hand; one graph, and the memory's entries."""
    from test_memory import batches, expected_loss

    size, weight = 30, 0.5
    memory = ms_loss_cuda.CrossBatchMemory(size, 8, weight=weight, backend="triton")
    kept = []
    for x, labels, ids in batches(9, 10, 8, samples=60, classes=5, seed=10):
        x_ref = x.clone().requires_grad_()
        x = x.to(DEVICE, torch.float32).requires_grad_()
        loss = memory(x, labels.to(DEVICE), ids.to(DEVICE))
        (grad,) = torch.autograd.grad(loss, x, torch.tensor(0.7, device=DEVICE))
        rows = torch.nn.functional.normalize(x_ref, dim=1)
        kept = (kept + list(zip(rows.detach(), labels, ids)))[-size:]
        expected = expected_loss(rows, labels, ids, tuple(map(torch.stack, zip(*kept))), weight, {})
        (expected_grad,) = torch.autograd.grad(expected, x_ref, torch.tensor(0.7, dtype=torch.float64))
        assert_close(loss, expected, 1e-5)
        assert_close(grad, expected_grad, 1e-5)
    assert len(captures) == 1 and memory.filled == size
    if not GPU:  # steps 1 and 2 fill it; step 3 (full) is seen, step 4 captured and replayed, 5 to 9 replayed
        assert captures[0].replays == 6
    stored = sorted(zip(memory.ids.tolist(), memory.labels.tolist()))
    assert stored == sorted((int(i), int(label)) for _, label, i in kept)
