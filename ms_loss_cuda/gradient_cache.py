"""Batches larger than the device's activation memory: embedding-gradient caching (GradCache, Gao et
al. 2021). The loss needs every embedding of the batch at once, but the encoder's activations only
chunk by chunk: encode the batch in chunks without a graph, take the loss and its gradient with
respect to all embeddings, then encode each chunk again with a graph and back-propagate its slice of
that gradient. Memory: one chunk's activations plus the [B, D] embeddings, for a second forward pass.

The parameter gradients equal those of the plain step whenever encoding a chunk does not depend on
the rest of the batch: batch-norm in eval mode (frozen, as the MS authors train) or no batch-norm.
With batch-norm in training mode each chunk is normalised by its own statistics (in both passes, so
the gradient is still the exact one of that chunked forward), and its running statistics are updated
once a chunk, as that chunked forward updates them: the model's buffers are put back after the first
pass. Random operations inside the encoder (dropout) replay the same random numbers in both passes,
on the CPU and on the GPUs of the inputs and of the model (the current GPU where neither is on one).
"""
import contextlib
import numbers

import torch

__all__ = ["cached_step"]


def _cuda_devices(inputs, model):
    """The GPUs whose random numbers the encoder may draw: the inputs' and the model's (an encoder moves
    CPU inputs, or inputs that are not a tensor, to its model's GPU, which need not be the current one),
    else the current GPU once CUDA is in use; none without CUDA."""
    tensors = ([inputs] if isinstance(inputs, torch.Tensor) else []) + (
        [] if model is None else [*model.parameters(), *model.buffers()])
    devices = sorted({t.device.index for t in tensors if t.device.type == "cuda"})
    if not devices and torch.cuda.is_initialized():
        devices = [torch.cuda.current_device()]
    return devices


def _rng_states(devices):
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


@contextlib.contextmanager
def _replay(states, devices):
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(states[0])
        for device, state in zip(devices, states[1]):
            torch.cuda.set_rng_state(state, device)
        yield


def _rows(part, start, count):
    """`part`, encode's output for inputs[start:start + count], if it is a tensor of `count` rows."""
    if not isinstance(part, torch.Tensor) or not part.is_floating_point() or part.dim() < 1 or part.shape[0] != count:
        got = f"{part.dtype} {tuple(part.shape)}" if isinstance(part, torch.Tensor) else type(part).__name__
        raise ValueError(f"encode must return a floating-point tensor of one embedding a sample: inputs[{start}:"
                         f"{start + count}] gave {got} (inputs are sliced along their first level, so a tuple of "
                         f"batch tensors is sliced into tensors, not samples)")
    return part


def cached_step(encode, inputs, loss_fn, chunk_size, *, no_sync=None, model=None):
    """One step's forward and backward with embedding-gradient caching; returns (loss detached,
    embeddings detached [B, D]). Parameter gradients accumulate into `.grad` as `loss.backward()`
    would; call the optimizer afterwards.

    encode: inputs[i:j] -> embeddings [j - i, D] (the model, under autocast if wanted).
    inputs: a tensor (or anything sliceable with a length) of the whole batch.
    loss_fn: embeddings [B, D] -> scalar loss (labels, memory and distributed gathering are its business).
    no_sync: for DistributedDataParallel, `model.no_sync`: the gradient all-reduce then runs once, in
    the last chunk's backward, instead of once per chunk. Every process needs at least one input: an
    empty batch is refused, and the other processes would then wait in their collectives.
    model: the module `encode` runs, where `encode` is not that module itself: its buffers (batch-norm
    running statistics) are put back as they were after the first pass, which then leaves no trace.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    if isinstance(inputs, (dict, str, bytes)) or not hasattr(inputs, "__getitem__"):
        raise TypeError(f"inputs must be a tensor [B, ...] or a sequence of B samples, sliced along its first "
                        f"level, got {type(inputs).__name__}")
    if len(inputs) == 0:
        raise ValueError("cached_step needs a batch of at least one input")
    starts = range(0, len(inputs), chunk_size)
    model = encode if model is None and isinstance(encode, torch.nn.Module) else model
    devices = _cuda_devices(inputs, model)
    states, parts = [], []
    with torch.no_grad():
        buffers = [] if model is None else [(b, b.clone()) for b in model.buffers()]
        for start in starts:
            states.append(_rng_states(devices))
            parts.append(_rows(encode(inputs[start:start + chunk_size]), start, min(chunk_size, len(inputs) - start)))
        for buffer, before in buffers:
            buffer.copy_(before)
    embeddings = torch.cat(parts).detach().requires_grad_()
    loss = loss_fn(embeddings)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar loss (reduction 'mean' or 'sum'), got "
                         f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
    if not loss.requires_grad:
        raise ValueError("loss_fn's loss takes no gradient from the embeddings it was given: it must be computed "
                         "from them, in floating point, with grad mode on (cached_step under torch.no_grad?)")
    loss.backward()  # (the embeddings' gradient, and that of any parameter loss_fn itself uses)
    grad = embeddings.grad
    if grad is None:
        raise ValueError("loss_fn's loss does not depend on the embeddings it was given")
    for number, (start, state) in enumerate(zip(starts, states)):
        last = number == len(starts) - 1
        with (contextlib.nullcontext() if last or no_sync is None else no_sync()):
            with _replay(state, devices):
                again = encode(inputs[start:start + chunk_size])
            again.backward(grad[start:start + chunk_size].to(again.dtype))
    return loss.detach(), embeddings.detach()
