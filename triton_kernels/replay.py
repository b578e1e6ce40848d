"""Eager steps replayed as CUDA graphs: the host issues a step's launches once per shape, then one replay.

An eager forward + backward of the triton backend is a fixed sequence of launches for given shapes,
dtypes and options, with no host synchronisation, so the host's time to issue it (Python, the launch
plans, Triton's launch path, torch's small ops: about 2 ms on an H100's host, more than the GPU's
work up to B = 4096) can be spent once. `call` runs a step and
- the first time it sees a signature (options, device, precision settings, each input's shape,
  strides and dtype, the reference set's address), runs it as it is and remembers the signature;
- the second time, captures it in a CUDA graph on inputs of its own (a warm-up on the capture's
  stream first, so that Triton's compiles and cuBLAS's handle happen outside the capture), then
  replays it;
- after that, copies the inputs into the graph's, replays, and returns copies of its outputs (a later
  replay overwrites the graph's own), but for the outputs the caller reads only in its backward (the
  gradients), which it gets as `Lent`: the graph's own buffer, copied out by the next replay of the
  graph only if the backward that reads it has not run by then. A training step's backward runs
  before the next step, so its gradient is never copied: one op and its memory fewer a step.
A signature seen once and never again (a reference set that is a new tensor every step, say) costs
nothing beyond this bookkeeping. The reference set (a memory bank, often large) is not copied: the
graph reads it where it was captured, so its address is in the signature, and a replay reads
whatever tensor of that layout lies there, the one the call passed. At most CAPACITY graphs are
kept a device, each with its memory (the step's temporaries, the inputs' copies); the least recently
used goes first. Steps of more than MOST_PAIRS pairs run as they are, and so does a step inside another
capture (torch.compile's "reduce-overhead", make_graphed_callables). MS_LOSS_CUDA_GRAPHS=0 turns
replay off.
"""
import collections
import os
import threading
import warnings
import weakref
from typing import NamedTuple

import torch

from . import launcher

CAPACITY = 4  # graphs kept a device
# Steps of more pairs are not captured: their GPU work hides the host's (on an H100, B = 65536 and a
# 1024 x 1,048,576 bank gain 3-7% from replay from an idle GPU and nothing back to back:
# bench/results/gpu/h100/bench-float16.log, triton against triton-graph), and their graphs would keep
# the most memory.
MOST_PAIRS = 2**29
_SEEN = 16  # signatures remembered from their first call, a device
# Once this many graphs of a device were dropped for others, its signatures not kept run as they
# are: a workload that cycles through more shapes than CAPACITY would otherwise capture at every call.
_EVICTIONS = 4 * CAPACITY
# Once this many captures of a device failed, it captures no more: capture is then not possible there
# (no memory for graphs, a torch that cannot clear cuBLAS's workspaces), and each try costs a step.
_FAILURES = 4
_lock = threading.RLock()


class _Store:
    """One device's graphs (signature: Graph, least recently used first), the signatures seen once, how
    many of its graphs were dropped for others, and the signatures whose capture failed (the last
    _FAILURES: after that many it captures no more). Each device has its own: a process that steps on
    two GPUs keeps CAPACITY graphs for each, and the shapes cycling on one do not evict the other's."""
    __slots__ = ("graphs", "seen", "evictions", "refused")

    def __init__(self):
        self.graphs, self.seen = collections.OrderedDict(), collections.OrderedDict()
        self.evictions, self.refused = 0, []


_stores = collections.defaultdict(_Store)  # device: _Store


class Lent:
    """An output of a replayed graph that `call`'s caller reads in its backward alone (the `lent`
    outputs): `tensor`, the graph's own buffer until the graph replays again while the output may still
    be read; that replay copies it out first (`Graph.__call__`). It may be read until `token()`'s
    tensor, which the caller saves for its backward (`for_backward`), is freed: autograd frees it after
    a backward without retain_graph, or with the autograd graph; then `tensor` is dropped (None), so
    that a lease kept beside a loss holds no memory. The caller reads it through `use`."""
    __slots__ = ("tensor", "_token", "__weakref__")

    def __init__(self, tensor):
        self.tensor, self._token = tensor, None

    def token(self):
        """A tensor of no elements that says, for as long as it lives, that `tensor` may still be read."""
        token, lease = torch.empty(0), weakref.ref(self)
        self._token = weakref.ref(token, lambda _: _drop(lease))
        return token

    def held(self):
        """`tensor` may still be read: it is there, and `token()`'s tensor lives (or no token was taken)."""
        return self.tensor is not None and (self._token is None or self._token() is not None)

    def keep(self):
        """`tensor` copied out of the graph's memory, which the next replay overwrites."""
        tensor = self.tensor  # (once: the token's death, on autograd's thread, may drop it meanwhile)
        if tensor is not None:
            self.tensor = tensor.clone()


def _drop(lease):
    """The token of the Lent `lease` (a weak reference) is freed: its tensor will not be read again."""
    lease = lease()
    if lease is not None:
        lease.tensor = None


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _saved_tensor_hooks():
    """Saved-tensor hooks are on (torch.autograd.graph.saved_tensors_hooks, save_on_cpu), or this torch
    cannot tell: their packing may save another tensor in a token's place, or move a saved gradient
    off the GPU."""
    return _top_hooks is None or _top_hooks(False) is not None


def for_backward(outputs):
    """(what the caller saves for its backward, ctx.save_for_backward; the leases it keeps beside) for
    `lent` outputs of `call`: a tensor (of a step that was not replayed) is saved as it is, with no
    lease; a `Lent` saves its token, and is the lease. Under saved-tensor hooks a Lent's tensor is
    copied and saved instead, and the lease let go (the hooks pack the copy, as they would any
    gradient saved for a backward)."""
    saved, leases, hooked = [], [], None
    with _lock:  # (a replay on another thread must not overwrite a buffer between its read and its copy)
        for out in outputs:
            if isinstance(out, Lent):
                hooked = _saved_tensor_hooks() if hooked is None else hooked
                if hooked:
                    out.tensor, out = None, out.tensor.clone()
            saved.append(out.token() if isinstance(out, Lent) else out)
            leases.append(out if isinstance(out, Lent) else None)
    return saved, leases


def use(lease, saved, function):
    """In the caller's backward, function(the value of a `lent` output of `call`), None for None: the
    lease's buffer, or what was saved (`for_backward`, from ctx.saved_tensors) where there is no
    lease. A lease's buffer is read where no replay runs at the same time: a replay copies a held
    output out first, which must not fall between this read of the buffer and the work issued on it
    (on the graph's stream, as the backward's). A lease whose token was freed before its backward (a
    saved-tensor hook registered on the node after the forward packs another tensor) raises."""
    if lease is None:
        return None if saved is None else function(saved)
    with _lock:
        if lease.tensor is None:
            raise RuntimeError("ms_loss_cuda: this loss's gradient, kept in a CUDA graph's memory, was given up when "
                               "its saved tensors were replaced (a saved-tensor hook?); set MS_LOSS_CUDA_GRAPHS=0")
        return function(lease.tensor)


class Graph(NamedTuple):
    """A captured step: its graph, the outputs it writes, the copies of the inputs it reads (None for
    those it reads in place), the indices of the outputs it lends (`Lent`) and the leases still out."""
    graph: object  # torch.cuda.CUDAGraph (or what `capture` gives)
    outputs: tuple
    inputs: tuple
    lent: tuple
    leases: list

    def __call__(self, inputs):
        for lease in self.leases:  # (an output the next replay would overwrite while a backward may read it)
            if lease.held():
                lease.keep()
        self.leases.clear()
        for mine, given in zip(self.inputs, inputs):
            if mine is not None and mine is not given:
                mine.copy_(given)
        self.graph.replay()
        outputs = []
        for i, out in enumerate(self.outputs):
            if out is not None and i in self.lent:
                out = Lent(out)
                self.leases.append(out)
            elif out is not None:
                out = out.clone()
            outputs.append(out)
        return outputs


def enabled(device):
    """Replay is on: MS_LOSS_CUDA_GRAPHS is not "0" and `capturable(device)`."""
    return os.environ.get("MS_LOSS_CUDA_GRAPHS", "1") != "0" and capturable(device)


def capturable(device):
    """A CUDA device whose current stream is not inside another capture."""
    if device.type != "cuda":
        return False
    if device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return not torch.cuda.is_current_stream_capturing()
    return not torch.cuda.is_current_stream_capturing()


def signature(inputs, kept, options, device):
    """What a graph depends on: `options` (hashable), the device and its current stream (a graph's
    buffers serve one stream), what chooses the plans (torch's matmul settings, deterministic mode,
    the chunked backward's budget, the tile table), each input's layout, which inputs are one tensor
    (they share one copy), and the addresses of the inputs in `kept` (read in place)."""
    settings = (torch.get_float32_matmul_precision(), os.environ.get("MS_LOSS_TRITON_CHUNK_MB"),
                torch.are_deterministic_algorithms_enabled(), launcher.tile_config)
    if device.type == "cuda":
        matmul = torch.backends.cuda.matmul
        # (the stream's raw handle, as Triton's launches take it, where torch.cuda.current_stream would
        # build a Stream object at every call)
        settings += (torch._C._cuda_getCurrentRawStream(device.index), matmul.allow_tf32,
                     matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction,
                     getattr(matmul, "allow_fp16_accumulation", False))
    # (loops rather than generators: this runs at every step, and each generator costs the host a call)
    layouts, first = [], {}
    for i, t in enumerate(inputs):
        layouts.append(None if t is None else (t.shape, t.stride(), t.dtype, first.setdefault(id(t), i)))
    for i in kept:
        layouts.append(None if inputs[i] is None else inputs[i].data_ptr())
    return options, device, settings, tuple(layouts)


def _copies(inputs, kept):
    """The graph's own inputs: a copy of each (one for inputs that are the same tensor), the ones in
    `kept` as they are."""
    made = {}
    for i, t in enumerate(inputs):
        if t is not None and id(t) not in made:
            made[id(t)] = t if i in kept else t.clone()
    return tuple(None if t is None else made[id(t)] for t in inputs)


def _unkept(inputs, kept):
    """`inputs` without the ones in `kept`: the graph reads those at their address, which the signature
    holds, whatever tensor is there when it replays (so it need not keep the captured one alive)."""
    return tuple(None if i in kept else t for i, t in enumerate(inputs))


def capture(step, inputs):
    """(graph, outputs): `step(*inputs)` captured in a CUDA graph, after a warm-up on the capture's stream
    (a new one from torch's pool). As torch's own CUDA-graph trees do, cuBLAS's cached workspaces are
    cleared before and after the capture, so that the graph's products allocate their workspace
    inside the graph's private pool: the graph owns it. Without that, a graph would use the
    workspace torch caches for its stream, which torch frees when the cache is cleared (torch.compile's
    CUDA graphs clear it, and dropping a graph clears its stream's: pytorch#193402), under the graph.
    The clearing is process-wide, as torch.compile's: the next eager product of each stream makes its
    workspace again. A torch without it (a private function) gets no graphs."""
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is None:
        raise RuntimeError("this torch cannot clear cuBLAS's cached workspaces, which a kept graph needs")
    device = next(t.device for t in inputs if t is not None)
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(*inputs)
        graph = torch.cuda.CUDAGraph()
        clear_workspaces()
        try:
            # ("thread_local": other threads' CUDA work, on other devices say, does not break the capture)
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                outputs = step(*inputs)
        finally:
            clear_workspaces()
        torch.cuda.current_stream().wait_stream(stream)
    return graph, outputs


def call(step, inputs, kept, lent, options, device, pairs):
    """`step(*inputs)`: run, captured or replayed as the module's docstring says. `kept`: the indices
    of the inputs read in place (their addresses belong to the signature); `lent`: the indices of the
    outputs read only in the caller's backward, which a replay hands out as `Lent`s (see
    `for_backward` and `use`); `options`: what else `step` depends on, hashable; `pairs`: the step's
    size (over MOST_PAIRS: run as it is). Inputs that share memory without being one tensor (x and a
    view of it as the reference set) are never captured: a copy would separate them. A capture that
    fails (out of memory, say) warns once and leaves its signature to run as it is."""
    if pairs > MOST_PAIRS or not enabled(device) or _unfit(inputs):
        return step(*inputs)
    key = signature(inputs, kept, options, device)
    with _lock:  # (one thread at a time: the bookkeeping, and a graph's buffers, are shared)
        store = _stores[device]
        graph = store.graphs.get(key)
        if graph is None:
            graph = _captured(step, inputs, kept, lent, key, store)
        else:
            store.graphs.move_to_end(key)
        if graph is not None:
            return graph(inputs)
    return step(*inputs)


def _captured(step, inputs, kept, lent, key, store):
    """A new Graph of `step` for signature `key`, kept in `store` (its device's _Store), or None where
    the step runs as it is: the first time the signature is seen, when there is no room, or when it
    cannot be captured."""
    if len(store.refused) >= _FAILURES or key in store.refused:
        return None
    if store.seen.pop(key, None) is None or (len(store.graphs) >= CAPACITY and store.evictions >= _EVICTIONS):
        store.seen[key] = True
        if len(store.seen) > _SEEN:
            store.seen.popitem(last=False)
        return None
    mine = _copies(inputs, kept)
    try:
        graph = store.graphs[key] = Graph(*capture(step, mine), _unkept(mine, kept), tuple(lent), [])
    except RuntimeError as error:
        if not store.refused:
            warnings.warn(f"ms_loss_cuda: an eager step could not be captured as a CUDA graph and runs as it is "
                          f"({error})", RuntimeWarning, stacklevel=4)
        store.refused.append(key)
        if len(store.refused) == _FAILURES:
            warnings.warn(f"ms_loss_cuda: {_FAILURES} steps on this device could not be captured as CUDA graphs; it "
                          f"captures no more (replay.clear() lets it try again; last: {error})", RuntimeWarning,
                          stacklevel=4)
        return None
    while len(store.graphs) > CAPACITY:
        store.graphs.popitem(last=False)
        store.evictions += 1
    return graph


def _unfit(inputs):
    """An input is empty, or two of them are different tensors on one storage."""
    first = {}
    for t in inputs:
        if t is not None and (t.numel() == 0 or first.setdefault(t.untyped_storage().data_ptr(), t) is not t):
            return True
    return False


def clear():
    """Drops every kept graph and remembered signature (and with them the graphs' memory)."""
    with _lock:
        _stores.clear()
