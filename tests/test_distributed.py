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


def _worker(rank, port, options, memory_size, steps, dtype, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    _train(rank, options, memory_size, steps, dtype, out)  # its DistributedDataParallel is gone before the group
    dist.barrier()
    dist.destroy_process_group()


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


@pytest.mark.parametrize("memory_size,options,dtype", [
    (0, dict(backend="reference"), torch.float64),
    (0, dict(backend="cpu", reduction="sum", epsilon=0.3), torch.float64),
    (9, dict(backend="cpu", warmup=1), torch.float64),
    (9, dict(backend="triton", warmup=1), torch.float32),  # (under the interpreter without a GPU)
])
def test_two_processes_equal_one(memory_size, options, dtype, tmp_path):
    if options["backend"] not in ms_loss_cuda.available_backends("cpu"):
        pytest.skip(f"backend {options['backend']} cannot run here")
    steps = 3
    loss_options = {k: v for k, v in options.items() if k != "warmup"}
    memory_options = dict(loss_options, warmup=options.get("warmup", 0)) if memory_size else loss_options
    context = mp.get_context("spawn")
    port = _free_port()
    outputs = [str(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    processes = [context.Process(target=_worker,
                                 args=(rank, port, memory_options, memory_size, steps, dtype, outputs[rank]))
                 for rank in range(WORLD)]
    for p in processes:
        p.start()
    for p in processes:  # never leave a worker behind (one stuck in a collective would block the next test)
        p.join(timeout=180)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in processes] == [0] * WORLD
    results = [torch.load(path) for path in outputs]
    expected = _single_process(memory_options, memory_size, steps, dtype)
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
