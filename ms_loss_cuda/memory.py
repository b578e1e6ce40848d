"""Cross-batch memory (XBM, Wang et al., CVPR 2020) for the fused MS loss: a ring buffer of the last
`size` embeddings, never turned into a B x M matrix."""
import operator
import types

import torch

from . import backends
from .common import HYPER_PARAMETERS, check_embeddings, check_inputs, shown
from .loss import HyperParameters, checked_flag, checked_number, checked_options, multi_similarity_loss, normalized_rows

_LOSS_OPTIONS = HYPER_PARAMETERS + ("normalize", "reduction", "backend")
_DEFAULTS = {name: multi_similarity_loss.__kwdefaults__[name] for name in _LOSS_OPTIONS}
_UNIT_TOLERANCE = 1e-2  # norm - 1 of a stored normalised row (bfloat16 rounds each entry to within 2^-8 of it)


def _integer(name, value, least):
    """`value` as an int (a Python or numpy integer, not a bool), at least `least`."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return number


class CrossBatchMemory(HyperParameters, torch.nn.Module):
    """`forward(embeddings, labels, ids)` -> MS(batch vs batch) + weight * MS(batch vs memory).

    Each call first stores the detached batch in a ring buffer of the last `size` (embedding, label,
    id) entries, then takes the memory term against everything stored, this batch included. Every
    pair of equal id is skipped, in both terms: a sample's own copy, and its older copies from earlier
    steps (pytorch-metric-learning and the XBM code count those as positives). The first `warmup`
    calls neither store nor add the memory term (the XBM code's start iteration: early embeddings
    drift too fast to be worth keeping). Every call stores, in eval mode and under no_grad as well (as
    pytorch-metric-learning's does): take a validation loss with `multi_similarity_loss`, not the
    memory. `loss_options` are those of `multi_similarity_loss` (alpha, beta, base, epsilon, mining,
    normalize, reduction, skip_incomplete_anchors, backend). Each is an attribute, as `weight` and
    `warmup` are, checked when set and used from the next call; `size`, `dim` and `normalize` are
    fixed (the buffers have that shape, and hold their rows normalised or not). Keep it out of a module
    that DistributedDataParallel wraps: DDP broadcasts the wrapped module's buffers from rank 0 before
    every forward (broadcast_buffers), the whole memory at each step.

    The memory lives on the embeddings' device and dtype (moved on first use), holds the rows
    already L2-normalised when `normalize` is on (so no step copies it), and is part of `state_dict`
    (with the ring position and the call count), so a checkpoint resumes with it; a normalising memory
    refuses to load rows longer than unit length (those of one with normalize=False). Labels and ids
    are kept as int64 (uint64 ones are refused). The memory term
    needs no gradient for the memory: the fused backends then skip that half of the backward. On the
    triton backend an eager step whose gradient is taken is one call (`Backend.memory_loss`): the
    store and both terms, replayed as one CUDA graph once the memory is full. Inside a torch.compile'd
    function the memory runs eagerly, a graph break (`fullgraph=True` needs it called outside).

    Two things follow from storing in place. Each step's backward runs before the next call: a
    backward taken over two calls at once (accumulating two micro-batches' losses) reads a memory
    that the second call changed, and autograd refuses it ("modified by an inplace operation"; the
    triton backend's one-call step has its gradient already and is not affected). And a batch with a
    NaN or an infinity, whose own loss is NaN as every loss call's is, leaves its rows in the memory
    until the ring comes round: the next size / B - 1 steps' losses are NaN too. Where such batches can
    occur (float16 embeddings under a GradScaler, say), check the batch before the call, or start a
    new memory after one.
    """

    def __init__(self, size, dim, *, weight=1.0, warmup=0, **loss_options):
        super().__init__()
        unknown = sorted(set(loss_options) - set(_LOSS_OPTIONS))
        if unknown:
            raise TypeError(f"unknown loss options {unknown}; CrossBatchMemory takes {_LOSS_OPTIONS}")
        self._size, self._dim = (_integer(name, value, 1) for name, value in (("size", size), ("dim", dim)))
        self.weight, self.warmup = weight, warmup
        self._normalize = checked_flag("normalize", loss_options.pop("normalize", True))
        options = dict(_DEFAULTS, **loss_options)  # (checked here, so that a bad one fails at once)
        self.options = checked_options({name: options[name] for name in HYPER_PARAMETERS}, options["reduction"])
        self.reduction, self.backend = options["reduction"], options["backend"]
        self.register_buffer("embeddings", torch.zeros(size, dim))
        self.register_buffer("labels", torch.zeros(size, dtype=torch.int64))
        self.register_buffer("ids", torch.zeros(size, dtype=torch.int64))
        self.position = self.filled = self.calls = 0  # host integers, saved through get_extra_state

    def _fixed(self, name):
        raise AttributeError(f"a CrossBatchMemory's {name} is fixed when it is built (its buffers have {self._size} "
                             f"rows of {self._dim}, normalised or not): build a new memory")

    size = property(lambda self: self._size, lambda self, _: self._fixed("size"), doc="Rows the memory holds.")
    dim = property(lambda self: self._dim, lambda self, _: self._fixed("dim"), doc="The rows' width.")
    normalize = property(lambda self: self._normalize, lambda self, _: self._fixed("normalize"),
                         doc="The memory holds its rows L2-normalised, and the loss normalises the batch.")

    @property
    def weight(self):
        """The memory term's weight, a float >= 0."""
        return self._weight

    @weight.setter
    def weight(self, value):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise TypeError("weight must be a number or a tensor that does not require grad: it gets no gradient")
        try:
            number = checked_number("weight", value)
        except (TypeError, ValueError):
            number = None
        if number is None or not 0 <= number < float("inf"):
            raise ValueError(f"weight must be a finite number >= 0, got {shown(value)}")
        self._weight = number

    @property
    def warmup(self):
        """The calls that neither store nor add the memory term, at the start."""
        return self._warmup

    @warmup.setter
    def warmup(self, value):
        self._warmup = _integer("warmup", value, 0)

    @property
    def loss_options(self):
        """The options of `multi_similarity_loss` this memory calls it with, but `normalize` (read-only:
        set them as attributes)."""
        return types.MappingProxyType(dict(self.options, reduction=self.reduction, backend=self.backend))

    def extra_repr(self):
        options = "".join(f", {name}={value!r}" for name, value in self.loss_options.items())
        return (f"size={self.size}, dim={self.dim}, weight={self.weight}, warmup={self.warmup}, "
                f"normalize={self.normalize}{options}, filled={self.filled}")

    def get_extra_state(self):
        return {"position": self.position, "filled": self.filled, "calls": self.calls}

    def set_extra_state(self, state):
        self.position, self.filled, self.calls = (int(state[name]) for name in ("position", "filled", "calls"))

    def _unfit_ring(self, state):
        """Why a saved ring state (get_extra_state's) cannot be this memory's, or None: its position and
        fill must be integers that fit the memory, which fills from slot 0 (until it is full, the next
        slot is the fill)."""
        try:
            position, filled, calls = (_integer(name, state[name], 0) for name in ("position", "filled", "calls"))
        except (TypeError, KeyError, ValueError) as error:
            return f"the saved memory's ring state is not a CrossBatchMemory's ({error})"
        if filled > self.size or position >= self.size or (filled < self.size and position != filled):
            return f"the saved memory's position {position} and fill {filled} do not fit a memory of {self.size} rows"
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        saved = state_dict.get(prefix + "embeddings")
        # checked before anything is loaded, so that a refused memory leaves this one as it was (the rows
        # never stored are zeros, which pass; a module on the meta device reads no rows)
        problem = None
        parts = ("embeddings", "labels", "ids", "_extra_state")
        given = [name for name in parts if prefix + name in state_dict]
        if given and len(given) < len(parts):  # (strict=False would load a fill over rows it never had)
            problem = (f"the saved memory holds {', '.join(given)} without "
                       f"{', '.join(name for name in parts if name not in given)}: a memory's rows, keys and ring "
                       f"state load together or not at all")
        if problem is None and self.normalize and isinstance(saved, torch.Tensor) and \
                not (saved.is_meta or self.embeddings.is_meta):
            problem = self._longer_than_unit(saved)
        if problem is None and given and getattr(saved, "shape", (None,))[0] == self.size:
            problem = self._unfit_ring(state_dict[prefix + "_extra_state"])  # (another count: torch names it)
        if problem:
            error_msgs.append(problem)  # (load_state_dict raises them together)
            return
        # the memory takes the saved rows' dtype (as a step takes the batch's), so that loading never
        # rounds them: a float64 memory into the float32 buffer of a new module, say (a normal tensor
        # under torch.inference_mode too, as in _place)
        if isinstance(saved, torch.Tensor) and saved.dtype != self.embeddings.dtype:
            with torch.inference_mode(False):
                self.embeddings = self.embeddings.to(saved.dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @staticmethod
    def _longer_than_unit(rows):
        """Why `rows` cannot be a normalising memory's, or None: a row longer than unit length was not
        normalised (rows of tiny norm normalise to less than 1, as the norm is clamped at 1e-12). The loss
        compares them as normalised, and a fused backend splits them into float16 pieces that only rows
        of norm up to 1 fit. Non-finite rows are a diverged step's (see the class)."""
        norms = torch.linalg.vector_norm(rows.detach().float(), dim=1)
        wrong = torch.isfinite(norms) & (norms > 1 + _UNIT_TOLERANCE)
        if not wrong.any():
            return None
        return (f"the saved memory holds {int(wrong.sum())} rows longer than unit length (norms "
                f"{norms[wrong].min().item():.4g} to {norms[wrong].max().item():.4g}), but this CrossBatchMemory "
                f"normalises and compares them as normalised: a memory saved with normalize=False? Build this one "
                f"with normalize=False, or drop the memory's entries from the state dict to start a new one")

    def _check_rows(self, name, rows, labels=None, ids=None, stored=True):
        """Rows of this memory's D; `stored`: rows the memory stores, with their keys, checked as a loss
        call's (check_inputs), with ids, keys that int64 holds, and the dtype of the rows stored already."""
        check_embeddings(name, rows)
        if rows.shape[1] != self.dim:
            raise ValueError(f"{name} must be [B, {self.dim}] for this memory, got {tuple(rows.shape)}")
        if not stored:
            return
        if ids is None:
            raise ValueError("CrossBatchMemory needs ids (one per sample, stable across steps): pairs of equal id "
                             "are skipped, which is how a sample never meets its own stored copies")
        check_inputs(rows, labels, None, None, ids, None)
        for key_name, keys in (("labels", labels), ("ids", ids)):
            if keys.dtype == torch.uint64:  # (the memory keeps its keys as int64)
                raise TypeError(f"CrossBatchMemory stores {key_name} as int64, where uint64 values of 2^63 and more "
                                f"would wrap: pass {key_name} as int64")
        if rows.device.type == "meta":
            raise ValueError("CrossBatchMemory stores the rows it is given, which a meta tensor has none of")
        if self.filled and rows.dtype != self.embeddings.dtype:
            raise TypeError(f"this memory holds {self.embeddings.dtype} rows, which {name} of {rows.dtype} would "
                            f"store over and compare in their own dtype: keep one dtype from step to step (a loaded "
                            f"state brings its rows' dtype), or start a new memory")

    # The ring's position, fill and call count are host integers that change at every step: a compiled
    # graph would be specialised on them and recompiled at each step until torch.compile gives up. So the
    # memory runs eagerly inside a compiled function (a graph break; the loss it calls is fused anyway).
    @torch.compiler.disable
    def forward(self, embeddings, labels, ids):
        self._check_rows("embeddings", embeddings, labels, ids)
        loss = self._one_call(embeddings, labels, ids)
        if loss is not None:
            return loss
        # (the batch's own term normalises its rows itself: a fused backend then knows them for unit rows)
        loss = multi_similarity_loss(embeddings, labels, ids=ids, normalize=self.normalize, **self.loss_options)
        x = normalized_rows(embeddings, self.backend) if self.normalize else embeddings
        term = self._stored_term(x, labels, ids, x, labels, ids)  # (the batch checked above)
        return loss if term is None else loss + self.weight * term

    @torch.compiler.disable  # (as forward)
    def memory_term(self, x, labels, ids, rows, row_labels, row_ids, **loss_options):
        """Stores `rows` (detached; this batch, or the global batch of several processes), then returns
        the MS loss of the anchors `x` (normalised already when the memory normalises) against the
        memory, or None during the warm-up calls. `loss_options` override the memory's own."""
        self._check_rows("rows", rows, row_labels, row_ids)
        self._check_rows("anchors", x, stored=False)
        return self._stored_term(x, labels, ids, rows, row_labels, row_ids, **loss_options)

    def _stored_term(self, x, labels, ids, rows, row_labels, row_ids, **loss_options):
        """memory_term for rows that _check_rows accepted."""
        self.calls += 1
        if self.calls <= self.warmup:
            return None
        self._enqueue(rows.detach(), row_labels, row_ids)
        stored = slice(0, self.filled)
        return multi_similarity_loss(x, labels, ids=ids, ref_embeddings=self.embeddings[stored],
                                     ref_labels=self.labels[stored], ref_ids=self.ids[stored], normalize=False,
                                     **dict(self.loss_options, **loss_options))

    def _one_call(self, embeddings, labels, ids):
        """The step (after the warm-up calls, a batch no larger than the memory) as one call of the
        backend, where it has one; else None, with nothing stored (the buffers may have moved to the
        batch's device and dtype)."""
        if self.calls < self.warmup or embeddings.shape[0] > self.size:
            return None
        hyper_parameters = checked_options(self.options, self.reduction)  # (forward checked the inputs)
        backend = backends.resolve(self.backend, embeddings.device, embeddings.dtype)
        self._place(embeddings)
        batch = embeddings.shape[0]
        filled = min(self.filled + batch, self.size)
        buffers = (self.embeddings, self.labels, self.ids)
        loss = backend.memory_loss(embeddings, labels, ids, self._slots(batch), buffers, filled, self.weight,
                                   hyper_parameters, self.normalize, self.reduction)
        if loss is not None:
            self.calls += 1
            self.position, self.filled = (self.position + batch) % self.size, filled
        return loss

    def _slots(self, batch):
        """The ring's next `batch` slots, a view of a tensor made once per batch size and device."""
        ring = getattr(self, "_ring", None)
        if ring is None or ring.shape[0] != self.size + batch or ring.device != self.embeddings.device:
            with torch.inference_mode(False):  # (kept for later steps: see _place)
                ring = self._ring = torch.arange(self.size + batch, device=self.embeddings.device) % self.size
        return ring[self.position:self.position + batch]

    def _place(self, x):
        """The buffers on x's device, the embeddings in its dtype (moved on first use). Made as normal
        tensors even under torch.inference_mode (an evaluation's first call), whose tensors later steps
        could not update in place."""
        if self.embeddings.device != x.device or self.embeddings.dtype != x.dtype:
            with torch.inference_mode(False):
                self.embeddings = self.embeddings.to(x.device, x.dtype)
                self.labels, self.ids = self.labels.to(x.device), self.ids.to(x.device)

    @torch.no_grad()
    def _enqueue(self, x, labels, ids):
        self._place(x)
        x, labels, ids = x[-self.size:], labels[-self.size:], ids[-self.size:]  # a batch larger than the memory
        rows = self._slots(x.shape[0])
        self.embeddings.index_copy_(0, rows, x)
        self.labels.index_copy_(0, rows, labels.to(self.labels.dtype))
        self.ids.index_copy_(0, rows, ids.to(self.ids.dtype))
        self.position = (self.position + x.shape[0]) % self.size
        self.filled = min(self.filled + x.shape[0], self.size)
