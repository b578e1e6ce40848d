"""CrossBatchMemory against a memory kept by hand and the dense float64 reference."""
import pytest
import torch
import torch.nn.functional as F

from ms_loss_cuda import CrossBatchMemory, available_backends, multi_similarity_loss, reference

from conftest import TOLERANCE, assert_close

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (on CPU tensors under the interpreter)
BACKENDS = [b for b in ("cpu", "reference") if b in available_backends("cpu")] + \
    (["triton"] if "triton" in available_backends(TRITON_DEVICE) else [])
DTYPES = {"triton": torch.float32}  # (else float64; the triton backend takes 16- and 32-bit rows)


def batches(steps, batch, dim, samples, classes, seed=0):
    """(embeddings, labels, ids) per step: samples drawn from a fixed pool, so ids come back across steps."""
    gen = torch.Generator().manual_seed(seed)
    pool_labels = torch.randint(0, classes, (samples,), generator=gen)
    centres = torch.randn(classes, dim, generator=gen, dtype=torch.float64)
    for _ in range(steps):
        ids = torch.randperm(samples, generator=gen)[:batch]
        x = centres[pool_labels[ids]] + torch.randn(batch, dim, generator=gen, dtype=torch.float64)
        yield x, pool_labels[ids], ids


def expected_loss(x, labels, ids, stored, weight, options):
    """MS(batch vs batch) + weight * MS(batch vs stored rows), densely, pairs of equal id skipped; x
    normalised already where the memory normalises."""
    loss = reference.multi_similarity_loss(x, labels, ids=ids, **options)
    if stored is None:
        return loss
    ref, ref_labels, ref_ids = stored
    return loss + weight * reference.multi_similarity_loss(x, labels, ref, ref_labels, ids, ref_ids, **options)


def one_calls(monkeypatch):
    """The steps the triton backend takes in one call (Backend.memory_loss), counted from now."""
    from ms_loss_cuda.triton_kernels import op

    taken, call = [], op.eager_memory_loss

    def counted(*args):
        loss = call(*args)
        taken.append(loss is not None)
        return loss

    monkeypatch.setattr(op, "eager_memory_loss", counted)
    return taken


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("normalize", [True, False])
def test_matches_a_memory_kept_by_hand(monkeypatch, backend, reduction, normalize):
    size, weight, warmup, steps = 23, 0.7, 2, 7
    dtype = DTYPES.get(backend, torch.float64)
    memory = CrossBatchMemory(size, 9, weight=weight, warmup=warmup, reduction=reduction, backend=backend,
                              epsilon=0.2, normalize=normalize)
    taken = one_calls(monkeypatch) if backend == "triton" else []
    kept = []  # (row, label, id), oldest first
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    for step, (x, labels, ids) in enumerate(batches(steps, 10, 9, samples=40, classes=6)):
        x = x.to(device, dtype).requires_grad_()
        loss = memory(x, labels.to(device), ids.to(device))
        (grad,) = torch.autograd.grad(loss, x, torch.tensor(0.6, dtype=dtype, device=device))
        x_ref = x.detach().cpu().double().requires_grad_()
        rows = F.normalize(x_ref, dim=1) if normalize else x_ref
        stored = None
        if step >= warmup:
            kept = (kept + list(zip(rows.detach(), labels, ids)))[-size:]
            stored = tuple(torch.stack(column) for column in zip(*kept))
        expected = expected_loss(rows, labels, ids, stored, weight, dict(reduction=reduction, epsilon=0.2))
        (expected_grad,) = torch.autograd.grad(expected, x_ref, torch.tensor(0.6, dtype=torch.float64))
        assert memory.filled == len(kept)
        assert_close(loss, expected, TOLERANCE[dtype])
        assert_close(grad, expected_grad, TOLERANCE[dtype])
    # the triton backend: every step after the warm-up in one call
    assert taken == ([True] * (steps - warmup) if backend == "triton" else [])
    # the memory holds the kept entries (ring order aside; ids may repeat)
    def entries(rows, row_labels, row_ids):
        return sorted(zip(row_ids.tolist(), row_labels.tolist(), rows.cpu().double().unbind()),
                      key=lambda entry: (entry[0], entry[1], entry[2].round(decimals=3).tolist()))

    for (i, label, row), (kept_i, kept_label, kept_row) in zip(entries(memory.embeddings, memory.labels, memory.ids),
                                                               entries(*map(torch.stack, zip(*kept))), strict=True):
        assert (i, label) == (kept_i, kept_label)
        assert_close(row, kept_row, TOLERANCE[dtype])


@pytest.mark.skipif("triton" not in BACKENDS, reason="the triton backend")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,dim,keys", [(1, 3, torch.int32), (37, 130, torch.int64)])
@pytest.mark.usefixtures("overflow_checked")
def test_the_triton_store_is_index_copy(dtype, batch, dim, keys):
    """The one-call step's store (stored_rows_kernel): the rows, labels and ids at their slots of the
    memory, bit for bit as index_copy_ puts them (the keys widened to the memory's int64)."""
    from ms_loss_cuda.triton_kernels import launcher, row_kernels

    gen = torch.Generator().manual_seed(batch)
    size = 50
    rows = torch.randn(batch, dim, generator=gen).to(TRITON_DEVICE, dtype)
    labels, ids = (torch.randint(-2**31, 2**31 - 1, (batch,), generator=gen, dtype=keys).to(TRITON_DEVICE)
                   for _ in range(2))
    slots = ((torch.arange(batch) + 45) % size).to(TRITON_DEVICE)  # (round the ring's end)
    memory = [torch.randn(size, dim, generator=gen).to(TRITON_DEVICE, dtype),
              *(torch.randint(0, 9, (size,), generator=gen).to(TRITON_DEVICE) for _ in range(2))]
    expected = [buffer.clone().index_copy_(0, slots, new.to(buffer.dtype)) for buffer, new in
                zip(memory, (rows, labels, ids))]
    launcher.run(row_kernels.stored_rows_plan, rows.device, rows, labels, ids, slots, *memory)
    for buffer, wanted in zip(memory, expected, strict=True):
        assert torch.equal(buffer, wanted)


def test_a_sample_never_meets_its_stored_copies():
    # one sample seen twice: with its id, the second step's memory term skips its older copy,
    # which would otherwise be the easiest positive (similarity ~1)
    memory = CrossBatchMemory(8, 4, mining=False, backend="reference")
    x = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]], dtype=torch.float64)
    labels, ids = torch.tensor([0, 1]), torch.tensor([5, 6])
    memory(x, labels, ids)
    second = memory(x + 0.01, labels, ids)
    batch_only = reference.multi_similarity_loss(F.normalize(x + 0.01, dim=1), labels, ids=ids, mining=False)
    stored = (F.normalize(torch.cat([x, x + 0.01]), dim=1), labels.repeat(2), ids.repeat(2))
    with_ids = batch_only + reference.multi_similarity_loss(F.normalize(x + 0.01, dim=1), labels, *stored[:2], ids,
                                                            stored[2], mining=False)
    torch.testing.assert_close(second, with_ids)
    assert memory.filled == 4


def test_state_dict_resumes_with_the_memory():
    data = list(batches(5, 6, 5, samples=30, classes=4, seed=2))
    memory = CrossBatchMemory(16, 5, warmup=1, backend="reference")
    for x, labels, ids in data[:3]:
        memory(x, labels, ids)
    resumed = CrossBatchMemory(16, 5, warmup=1, backend="reference")
    resumed.load_state_dict(memory.state_dict())
    assert (resumed.position, resumed.filled, resumed.calls) == (memory.position, memory.filled, memory.calls)
    for x, labels, ids in data[3:]:
        torch.testing.assert_close(resumed(x, labels, ids), memory(x, labels, ids))


def test_a_float64_memory_resumes_without_rounding():
    """A new module's buffer is float32 until its first step: loading a float64 memory takes the saved
    dtype rather than rounding the rows into that buffer."""
    data = list(batches(5, 6, 5, samples=30, classes=4, seed=3))  # (float64 rows)
    memory = CrossBatchMemory(16, 5, backend="reference")
    for x, labels, ids in data[:2]:
        memory(x, labels, ids)
    resumed = CrossBatchMemory(16, 5, backend="reference")
    resumed.load_state_dict(memory.state_dict())
    assert resumed.embeddings.dtype == torch.float64 and torch.equal(resumed.embeddings, memory.embeddings)
    x, labels, ids = data[2]
    assert torch.equal(resumed(x, labels, ids), memory(x, labels, ids))


def test_a_normalising_memory_refuses_rows_longer_than_unit():
    """A memory saved by a module that does not normalise holds raw rows: a normalising one would compare
    them as unit rows (and a fused backend split them into float16 pieces), so loading rows longer than
    unit is refused. Normalised rows rounded to bfloat16, and shorter rows, load."""
    data = list(batches(2, 6, 5, samples=30, classes=4, seed=4))
    plain, unit = (CrossBatchMemory(16, 5, normalize=flag, backend="reference") for flag in (False, True))
    for x, labels, ids in data:
        plain(x * 3, labels, ids)
        unit(x, labels, ids)
    refusing = CrossBatchMemory(16, 5, backend="reference")
    with pytest.raises(RuntimeError, match="12 rows longer than unit length"):
        refusing.load_state_dict(plain.state_dict())
    assert refusing.filled == refusing.calls == 0 and not refusing.embeddings.any()  # (nothing of it loaded)
    CrossBatchMemory(16, 5, normalize=False, backend="reference").load_state_dict(plain.state_dict())
    rounded = dict(unit.state_dict(), embeddings=unit.embeddings.bfloat16())
    resumed = CrossBatchMemory(16, 5, backend="reference")
    resumed.load_state_dict(rounded)
    assert resumed.embeddings.dtype == torch.bfloat16 and resumed.filled == 12
    tiny = dict(unit.state_dict(), embeddings=unit.embeddings * 1e-3)  # (shorter rows, as a row of norm below 1e-12 normalises)
    CrossBatchMemory(16, 5, backend="reference").load_state_dict(tiny)
    # a state dict without some of the memory's parts (strict=False) would keep a fill over rows it never had
    for left_out in ("embeddings", "_extra_state"):
        partial = {key: value for key, value in unit.state_dict().items() if key != left_out}
        missing = CrossBatchMemory(16, 5, backend="reference")
        with pytest.raises(RuntimeError, match=f"without {left_out}: a memory's rows, keys and ring state load"):
            missing.load_state_dict(partial, strict=False)
        assert missing.filled == 0
    with pytest.raises(RuntimeError, match="ring state is not a CrossBatchMemory's"):
        CrossBatchMemory(16, 5, backend="reference").load_state_dict(dict(unit.state_dict(), _extra_state=None))
    with torch.device("meta"):  # (a module built on the meta device loads without reading the rows:
        with pytest.warns(UserWarning, match="meta parameter"):  # torch's no-op copy, as for any module)
            CrossBatchMemory(16, 5, backend="reference").load_state_dict(plain.state_dict())


def test_a_memory_first_placed_under_inference_mode_trains_after():
    """A first call under torch.inference_mode (an evaluation before training) that moves the buffers to
    the batch's dtype leaves them normal tensors, which the training steps after it update in place."""
    data = list(batches(3, 6, 5, samples=30, classes=4, seed=5))
    memory, by_hand = (CrossBatchMemory(16, 5, backend="reference") for _ in range(2))
    x, labels, ids = data[0]
    with torch.inference_mode():
        memory(x.double(), labels, ids)
    by_hand(x.double(), labels, ids)
    for x, labels, ids in data[1:]:
        x = x.double().requires_grad_()
        loss = memory(x, labels, ids)
        loss.backward()
        assert torch.equal(loss.detach(), by_hand(x.detach(), labels, ids))


def test_a_state_of_another_dtype_loaded_under_inference_mode_trains_after():
    """Loading a float64 memory into a new module's float32 buffer within torch.inference_mode (a
    checkpoint loaded for an evaluation, say) leaves a normal buffer, which training updates in place."""
    data = list(batches(3, 6, 5, samples=30, classes=4, seed=8))
    saved = CrossBatchMemory(16, 5, backend="reference")
    saved(*data[0])
    loaded = CrossBatchMemory(16, 5, backend="reference")
    with torch.inference_mode():
        loaded.load_state_dict(saved.state_dict())
    assert loaded.embeddings.dtype == torch.float64
    for x, labels, ids in data[1:]:
        loss = loaded(x.requires_grad_(), labels, ids)
        loss.backward()
        assert torch.equal(loss.detach(), saved(x.detach(), labels, ids))


def test_weight_and_warmup_are_checked_when_set_and_the_buffers_shape_is_fixed():
    """`weight` and `warmup` set after construction are checked as the constructor checks them and
    used from the next call; `size`, `dim` and `normalize`, which the buffers were made for, are
    refused."""
    data = list(batches(3, 6, 5, samples=30, classes=4, seed=9))
    memory, built = CrossBatchMemory(16, 5, backend="reference"), CrossBatchMemory(16, 5, weight=0.25, warmup=1,
                                                                                    backend="reference")
    memory.weight, memory.warmup = torch.tensor(0.25), 1
    assert (memory.weight, memory.warmup) == (0.25, 1) and type(memory.weight) is float
    for name, bad in (("weight", -1.0), ("weight", float("nan")), ("weight", "1"), ("warmup", -1), ("warmup", 1.5)):
        with pytest.raises(ValueError, match=f"{name} must be"):
            setattr(memory, name, bad)
    for name, value in (("size", 32), ("dim", 6), ("normalize", False)):
        with pytest.raises(AttributeError, match=f"CrossBatchMemory's {name} is fixed when it is built"):
            setattr(memory, name, value)
    assert (memory.size, memory.dim, memory.normalize) == (16, 5, True)
    for x, labels, ids in data:
        assert torch.equal(memory(x, labels, ids), built(x, labels, ids))


def test_a_compiled_step_with_a_memory_compiles_once():
    """The ring's host integers change at every step: torch.compile of a step that calls the memory
    compiles the rest of the step once (the memory runs eagerly, a graph break) and gives the eager
    step's losses and gradients, warm-up calls included."""
    torch._dynamo.reset()
    data = list(batches(6, 6, 5, samples=30, classes=4, seed=6))
    compiled_memory, eager_memory = (CrossBatchMemory(16, 5, warmup=2, backend="reference") for _ in range(2))
    weight = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(lambda x, labels, ids: compiled_memory(torch.tanh(x @ weight), labels, ids), backend="eager")
    frames = torch._dynamo.utils.counters["frames"]["total"]
    for x, labels, ids in data:
        got = compiled(x, labels, ids)
        (got_grad,) = torch.autograd.grad(got, weight)
        expected = eager_memory(torch.tanh(x @ weight), labels, ids)
        (expected_grad,) = torch.autograd.grad(expected, weight)
        assert torch.equal(got, expected) and torch.equal(got_grad, expected_grad)
    assert torch._dynamo.utils.counters["frames"]["total"] - frames <= 2  # (the graph before the break, and after)


def test_batch_larger_than_the_memory_keeps_its_last_rows():
    memory = CrossBatchMemory(4, 3, backend="reference")
    x, labels, ids = next(batches(1, 10, 3, samples=10, classes=3))
    memory(x, labels, ids)
    assert memory.filled == 4 and sorted(memory.ids.tolist()) == sorted(ids[-4:].tolist())


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs the fused CPU kernel")
def test_a_large_memory_runs_fused():
    memory = CrossBatchMemory(65536, 16, backend="cpu")
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        x = torch.randn(4096 if step < 2 else 64, 16, generator=gen).requires_grad_()
        labels = torch.randint(0, 500, (x.shape[0],), generator=gen)
        ids = torch.randint(0, 10**6, (x.shape[0],), generator=gen)
        loss = memory(x, labels, ids)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert memory.filled == 2 * 4096 + 64


@pytest.mark.parametrize("backend", [b for b in ("cpu", "triton") if b in available_backends("cpu")])
def test_the_memory_normalises_as_the_loss_does(backend):
    """The memory normalises the batch once, as the loss would for its backend (the triton backend with
    its own kernels), then calls the loss with normalize=False: during the warm-up its value and
    gradient are those of the loss itself, bit for bit."""
    x, labels, ids = next(batches(1, 40, 16, samples=100, classes=8))
    x = x.float().requires_grad_()
    memory = CrossBatchMemory(64, 16, warmup=1, backend=backend)
    loss, expected = memory(x, labels, ids), multi_similarity_loss(x, labels, ids=ids, backend=backend)
    assert torch.equal(loss, expected)
    assert torch.equal(torch.autograd.grad(loss, x)[0], torch.autograd.grad(expected, x)[0])


def test_bad_input():
    with pytest.raises(ValueError, match="size"):
        CrossBatchMemory(0, 4)
    with pytest.raises(ValueError, match="weight"):
        CrossBatchMemory(4, 4, weight=-1)
    for weight in (float("inf"), float("nan"), "1", True, None):
        with pytest.raises(ValueError, match="weight must be a finite number >= 0"):
            CrossBatchMemory(4, 4, weight=weight)
    assert CrossBatchMemory(4, 4, weight=torch.tensor(0.5)).weight == 0.5
    for size in (True, 2.0, "4"):
        with pytest.raises(ValueError, match="size must be an integer"):
            CrossBatchMemory(size, 4)
    assert CrossBatchMemory(torch.tensor(4).numpy()[()], 4).size == 4  # (a numpy integer)
    with pytest.raises(TypeError, match="unknown loss options"):
        CrossBatchMemory(4, 4, alhpa=2)
    memory = CrossBatchMemory(4, 4)
    x, labels = torch.randn(3, 4), torch.tensor([0, 1, 0])
    with pytest.raises(ValueError, match="ids"):
        memory(x, labels, None)
    with pytest.raises(ValueError, match=r"\[B, 4\]"):
        memory(torch.randn(3, 5), labels, torch.arange(3))
    with pytest.raises(TypeError, match="stores labels as int64"):
        memory(x, labels.to(torch.uint64), torch.arange(3))
    with pytest.raises(TypeError, match="weight must be a number or a tensor that does not require grad"):
        CrossBatchMemory(4, 4, weight=torch.tensor(0.5, requires_grad=True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalize", [True, False])
def test_stored_rows_keep_their_dtype_and_survive_a_refused_batch(backend, normalize):
    """A batch of another dtype than the rows stored, or on the meta device, is refused before anything
    is stored or counted: storing it would round the memory into its dtype (float32 rows of 7e4 become
    inf in float16, and NaN the losses of the steps after) or leave it without data."""
    memory = CrossBatchMemory(8, 4, backend=backend, normalize=normalize)
    labels, ids = torch.tensor([0, 1, 0]), torch.arange(3)
    memory(torch.randn(3, 4) * 7e4, labels, ids)
    stored = memory.embeddings.clone()
    for bad in (torch.randn(3, 4).half(), torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, device="meta")):
        with pytest.raises((TypeError, ValueError), match="this memory holds torch.float32 rows|a meta tensor"):
            memory(bad, labels.to(bad.device), ids.to(bad.device))
    assert memory.calls == 1 and torch.equal(memory.embeddings, stored)
    assert torch.isfinite(memory(torch.randn(3, 4), labels, ids + 3))


def test_memory_term_checks_the_keys_it_stores_as_forward_does():
    """memory_term (the distributed loss's way in) checks the keys of the rows it stores before it
    counts the call: their length, their dtype, and ids at all."""
    memory = CrossBatchMemory(8, 4, backend="reference")
    x, labels, ids = torch.randn(3, 4), torch.tensor([0, 1, 0]), torch.arange(3)
    for row_labels, row_ids, error in ((labels[:2], ids, ValueError), (labels.float(), ids, TypeError),
                                       (labels, ids.to(torch.uint64), TypeError), (labels, None, ValueError)):
        with pytest.raises(error):
            memory.memory_term(x, labels, ids, x, row_labels, row_ids)
    assert memory.calls == 0 and memory.filled == 0


def test_a_saved_state_that_does_not_fit_the_memory_is_refused():
    """A checkpoint's ring position and fill must fit the memory (the ring fills from slot 0), or the
    next step would store rows out of place."""
    saved = CrossBatchMemory(5, 4, backend="reference")
    saved(torch.randn(3, 4), torch.tensor([0, 1, 0]), torch.arange(3))
    state = saved.state_dict()
    for position, filled in ((7, 5), (2, 9), (1, 3), (-1, 3)):
        memory = CrossBatchMemory(5, 4, backend="reference")
        with pytest.raises(RuntimeError, match="do not fit a memory of 5 rows|must be an integer >= 0, got -1"):
            memory.load_state_dict(dict(state, _extra_state=dict(position=position, filled=filled, calls=1)))
        # (refused as a whole: nothing of it is loaded)
        assert (memory.position, memory.filled) == (0, 0) and not memory.embeddings.any()
    with pytest.raises(RuntimeError, match="size mismatch for embeddings"):  # (torch's, for another size)
        CrossBatchMemory(4, 4, backend="reference").load_state_dict(state)
    saved(torch.randn(4, 4), torch.tensor([1, 0, 1, 1]), torch.arange(3, 7))  # (full, wrapped to slot 2)
    memory = CrossBatchMemory(5, 4, backend="reference")
    memory.load_state_dict(saved.state_dict())
    assert (memory.position, memory.filled, memory.calls) == (2, 5, 2)
    torch.testing.assert_close(memory.embeddings, saved.embeddings)


def test_rows_of_another_width_are_refused_before_the_memory_counts_a_call():
    """memory_term (the distributed loss's way in) checks the rows' D as forward does, before it
    counts the call towards the warm-up."""
    memory = CrossBatchMemory(8, 4, warmup=1, backend="reference")
    x, labels, ids = torch.randn(3, 5), torch.tensor([0, 1, 0]), torch.arange(3)
    for rows, anchors in ((x, x[:, :4]), (x[:, :4], x)):
        with pytest.raises(ValueError, match=r"must be \[B, 4\] for this memory"):
            memory.memory_term(anchors, labels, ids, rows, labels, ids)
    with pytest.raises(TypeError, match="embeddings must be a tensor, got list"):
        memory(x[:, :4].tolist(), labels, ids)
    with pytest.raises(TypeError, match="embeddings must be a dense .* got torch.sparse_coo"):
        memory(x[:, :4].to_sparse(), labels, ids)
    assert memory.calls == 0
