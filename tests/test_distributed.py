"""ms_loss_cuda.distributed on 2 processes (gloo, CPU tensors; triton under the interpreter) against
the single-process loss of the concatenated batch: the value on every rank, and
DistributedDataParallel's parameter gradients."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ms_loss_cuda
from ms_loss_cuda import distributed

WORLD = 2
pytestmark = pytest.mark.xdist_group("distributed")  # (one pytest-xdist worker: its processes are a module fixture)
SIZES = (7, 4)  # unequal per-process batches


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(step, dtype):
    gen = torch.Generator().manual_seed(step)
    inputs = torch.randn(sum(SIZES), 6, generator=gen, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, 3, (sum(SIZES),), generator=gen)
    ids = torch.randperm(40, generator=gen)[:sum(SIZES)]  # samples come back across steps
    return inputs, labels, ids


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Linear(6, 5).to(dtype)


def _single_process(options, memory_size, steps, dtype):
    """[(loss, parameter gradients)] per step of one process on the whole batch."""
    model = _model(dtype)
    memory = ms_loss_cuda.CrossBatchMemory(memory_size, 5, weight=0.5, **options) if memory_size else None
    results = []
    for step in range(steps):
        inputs, labels, ids = _data(step, dtype)
        model.zero_grad()
        embeddings = model(inputs)
        if memory is None:
            loss = ms_loss_cuda.multi_similarity_loss(embeddings, labels, **options)
        else:
            loss = memory(embeddings, labels, ids)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    return results


def _worker(rank, port, configs, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    for config in configs:  # (each DistributedDataParallel is gone before the group)
        memory_size, options, dtype = CONFIGS[config]
        _train(rank, _memory_options(config), memory_size, steps, dtype, os.path.join(out, f"{config}-rank{rank}.pt"))
    torch.save(_edges(rank), os.path.join(out, f"edges-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _mixed_keys():
    """Rows and labels of the global batch; rank 0's labels are int8, rank 1's int64 beyond int8's range."""
    x = torch.randn(sum(SIZES), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 0, 256, 256, 257, 257])
    return x, labels


def _edges(rank):
    """(loss and gradient with another dtype of labels on each rank, what a rank is told when the
    ranks' rows differ in D)."""
    x, labels = _mixed_keys()
    start = sum(SIZES[:rank])
    mine = slice(start, start + SIZES[rank])
    rows, keys = x[mine].clone().requires_grad_(), labels[mine].to(torch.int8 if rank == 0 else torch.int64)
    loss = distributed.multi_similarity_loss(rows, keys, backend="reference")
    loss.backward()
    try:
        distributed.multi_similarity_loss(torch.randn(2, 3 + rank), torch.arange(2))
        told = None
    except ValueError as error:
        told = str(error)
    return loss.detach(), rows.grad, told


def _train(rank, options, memory_size, steps, dtype, out):
    model = torch.nn.parallel.DistributedDataParallel(_model(dtype))
    memory = ms_loss_cuda.CrossBatchMemory(memory_size, 5, weight=0.5, **options) if memory_size else None
    start = sum(SIZES[:rank])
    mine = slice(start, start + SIZES[rank])
    results = []
    for step in range(steps):
        inputs, labels, ids = _data(step, dtype)
        model.zero_grad()
        embeddings = model(inputs[mine])
        if memory is None:
            loss = distributed.multi_similarity_loss(embeddings, labels[mine], **options)
        else:
            loss = distributed.multi_similarity_loss(embeddings, labels[mine], ids[mine], memory=memory)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.save(results, out)


CONFIGS = [  # (memory size, options, dtype); the triton backend runs under the interpreter without a GPU
    (0, dict(backend="reference"), torch.float64),
    (0, dict(backend="cpu", reduction="sum", epsilon=0.3), torch.float64),
    (9, dict(backend="cpu", warmup=1), torch.float64),
    (9, dict(backend="triton", warmup=1), torch.float32),
]
STEPS = 3


def _memory_options(config):
    """The loss's options, and the memory's warmup when the configuration has a memory."""
    memory_size, options, _ = CONFIGS[config]
    loss_options = {k: v for k, v in options.items() if k != "warmup"}
    return dict(loss_options, warmup=options.get("warmup", 0)) if memory_size else loss_options


def _runnable(config):
    return CONFIGS[config][1]["backend"] in ms_loss_cuda.available_backends("cpu")


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    """{configuration: [each rank's (loss, parameter gradients) per step]} from one pair of processes
    that runs every configuration this machine can (a pair of processes is slow to start)."""
    configs = [config for config in range(len(CONFIGS)) if _runnable(config)]
    out = str(tmp_path_factory.mktemp("distributed"))
    context, port = mp.get_context("spawn"), _free_port()
    processes = [context.Process(target=_worker, args=(rank, port, configs, STEPS, out)) for rank in range(WORLD)]
    for p in processes:
        p.start()
    for p in processes:  # never leave a worker behind (one stuck in a collective would block the tests)
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in processes] == [0] * WORLD
    results = {config: [torch.load(os.path.join(out, f"{config}-rank{rank}.pt")) for rank in range(WORLD)]
               for config in configs}
    results["edges"] = [torch.load(os.path.join(out, f"edges-rank{rank}.pt")) for rank in range(WORLD)]
    return results


def test_keys_of_two_dtypes_and_rows_of_two_widths_across_processes(two_process_results):
    """int8 labels on one rank beside int64 labels that int8 cannot hold on the other: the
    single-process loss and gradient (world size times each rank's share). Ranks whose rows differ
    in D are each told so, rather than left in a collective of mismatched sizes."""
    x, labels = _mixed_keys()
    rows = x.clone().requires_grad_()
    loss = ms_loss_cuda.multi_similarity_loss(rows, labels, backend="reference")
    loss.backward()
    for rank, (got_loss, got_grad, told) in enumerate(two_process_results["edges"]):
        start = sum(SIZES[:rank])
        torch.testing.assert_close(got_loss, loss.detach())
        torch.testing.assert_close(got_grad, WORLD * rows.grad[start:start + SIZES[rank]])
        assert told == ("every process must give embeddings of one D and one dtype; they gave D = 3 of "
                        "torch.float32, D = 4 of torch.float32")


@pytest.mark.parametrize("config", range(len(CONFIGS)), ids=["reference", "cpu-sum", "cpu-memory", "triton-memory"])
def test_two_processes_equal_one(config, two_process_results):
    memory_size, options, dtype = CONFIGS[config]
    if not _runnable(config):
        pytest.skip(f"backend {options['backend']} cannot run here")
    results = two_process_results[config]
    expected = _single_process(_memory_options(config), memory_size, STEPS, dtype)
    close = dict(rtol=1e-6, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)  # (sums' order)
    for step, (loss, grads) in enumerate(expected):
        for rank in range(WORLD):
            got_loss, got_grads = results[rank][step]
            torch.testing.assert_close(got_loss, loss, **close)
            for got, want in zip(got_grads, grads):
                torch.testing.assert_close(got, want, **close)


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.multi_similarity_loss(torch.randn(4, 3), torch.arange(4))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_an_empty_global_batch_gives_zero(tmp_path, reduction):
    """One process (a group of one, in this process) with no anchors: 0 and a zero gradient, as the
    single-process loss of an empty batch, not the 0 / 0 of a mean over no anchors."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        x = torch.randn(0, 4, requires_grad=True)
        loss = distributed.multi_similarity_loss(x, torch.zeros(0, dtype=torch.long), reduction=reduction)
        loss.backward()
    finally:
        dist.destroy_process_group()
    assert loss.item() == 0 and x.grad.shape == (0, 4)


def test_bad_input_is_named_before_the_gather(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        cases = ((None, None, TypeError, "labels"),
                 (torch.arange(3), None, ValueError, r"labels must have shape \[4\]"),
                 (torch.arange(4), torch.arange(2), ValueError, r"ids must have shape \[4\]"))
        for labels, ids, error, match in cases:
            with pytest.raises(error, match=match):
                distributed.multi_similarity_loss(torch.randn(4, 3), labels, ids)
    finally:
        dist.destroy_process_group()


def test_keys_of_every_integer_dtype_are_gathered(tmp_path):
    """int16 labels and uint64 ids of 2^63 and more (neither of them a gloo type): the single-process
    loss and gradient, and with int16 ids the single-process memory's (which keeps int64 keys)."""
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int16)
    order = [5, 1, 4, 0, 3, 2]
    cases = [(torch.tensor([2 ** 63 + i for i in order], dtype=torch.uint64), None),
             (torch.tensor(order, dtype=torch.int16), 8)]
    wide_ids = torch.tensor([256 + i for i in order])  # (int8 labels beside int64 keys that int8 cannot hold)
    narrow = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int8)
    results = {}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for case, (ids, memory_size) in enumerate(cases):
            for way in ("single", "gathered"):
                memory = ms_loss_cuda.CrossBatchMemory(memory_size, 3, backend="reference") if memory_size else None
                for step, rows in enumerate((x, x.flip(0))):
                    rows = rows.clone().requires_grad_()
                    if way == "gathered":
                        loss = distributed.multi_similarity_loss(rows, labels, ids, memory=memory,
                                                                 **({} if memory else dict(backend="reference")))
                    else:
                        loss = memory(rows, labels, ids) if memory else \
                            ms_loss_cuda.multi_similarity_loss(rows, labels, ids=ids, backend="reference")
                    loss.backward()
                    results[case, way, step] = (loss.detach(), rows.grad)
        # the gathered keys keep int64's range, which this rank's int8 labels would wrap
        _, gathered_labels, gathered_ids, _ = distributed.gather(x, narrow, wide_ids)
        assert gathered_labels.dtype == gathered_ids.dtype == torch.int64 and torch.equal(gathered_ids, wide_ids)
    finally:
        dist.destroy_process_group()
    for case in range(len(cases)):
        for step in range(2):
            for got, want in zip(results[case, "gathered", step], results[case, "single", step]):
                torch.testing.assert_close(got, want)
