"""The backends and the choice among them.

Each backend implements common.Backend: `reference` (dense PyTorch, any device: the spec and the
fallback), `cpu` and `cuda` (the fused C++ ops of the extension ms_loss_cuda._C, one op pair with a
kernel per dispatch key), and `triton` (ms_loss_cuda.triton_kernels, imported when first asked for:
it needs Triton). `"auto"` ($MS_LOSS_BACKEND when set) takes the first backend of REGISTRY whose
`auto_devices` has the tensors' device type and that can run there, else the reference, with a
warning once a process (the dense backend holds B x R matrices). On CUDA the order is the one
measured faster on an H100 (docs/benchmarks.md): triton for every dtype, then cuda.
"""
import glob
import importlib
import os
import warnings

import torch

from . import ops, reference
from .common import FLOAT_DTYPES, GPU_DTYPES, Backend, hyper_parameters_of, loss_dtype, unit_rows_in_compute_dtype

NAMES = ("auto", "reference", "cpu", "triton", "cuda")
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


class ReferenceBackend(Backend):
    name = "reference"

    def loss_rows(self, t):  # (it computes in the compute dtype: the normalisation's gradient stays there)
        return unit_rows_in_compute_dtype(t)

    def anchor_losses(self, x, labels, ids, ref, ref_labels, ref_ids, options):
        return reference.multi_similarity_loss(x, labels, ref, ref_labels, ids, ref_ids, reduction="none", **options)


class GivenPairs(ReferenceBackend):
    """The dense reference on exactly the pairs another miner chose (boolean [B, R] masks of positives
    and negatives): pytorch-metric-learning's indices_tuple."""

    def __init__(self, masks):
        self.masks = masks

    def anchor_losses(self, x, labels, ids, ref, ref_labels, ref_ids, options):
        return reference.multi_similarity_loss(x, labels, ref, reduction="none", masks=self.masks, **options)


class ExtensionBackend(Backend):
    """The fused C++ ops (ms_loss_cuda._C): the CPU kernel, or the CUDA kernels where they were built."""

    def __init__(self, name, device_type):
        self.name, self.device_type, self.auto_devices = name, device_type, (device_type,)
        self.dtypes = GPU_DTYPES if device_type == "cuda" else FLOAT_DTYPES

    def unavailable_reason(self, device, dtype=None):
        reason = super().unavailable_reason(device, dtype)
        if reason is not None:
            return reason
        if ops.LOAD_ERROR is not None:
            if not glob.glob(os.path.join(_PACKAGE, "_C.*")):  # (one built for another Python: failed to load)
                return "the C++ extension ms_loss_cuda._C is not built" + _source_tree_note()
            return f"the C++ extension ms_loss_cuda._C failed to load ({ops.LOAD_ERROR})"
        if self.device_type == "cpu":
            return None if device.type == "cpu" else f"it takes CPU tensors, got {device}"
        if not torch._C._dispatch_has_kernel_for_dispatch_key("ms_loss_cuda::ms_loss_forward", "CUDA"):
            return "the CUDA kernels were not built (install with a CUDA build of torch and nvcc)"
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"it takes CUDA tensors on a visible GPU, got {device}"
        if torch.cuda.get_device_capability(device) < (8, 0):  # bfloat16 tensor cores, the built targets
            return f"it needs a GPU of compute capability 8.0 or newer, got {torch.cuda.get_device_capability(device)}"
        return None

    def anchor_losses(self, x, labels, ids, ref, ref_labels, ref_ids, options):
        hyper_parameters = hyper_parameters_of(options)
        return ops.fused_forward(x, labels, ids, ref, ref_labels, ref_ids, *hyper_parameters)[0]

    def loss(self, embeddings, labels, ids, ref, ref_labels, ref_ids, options, normalize, reduction):
        if ops.traced():  # (torch.compile and export see the ops, their fakes and their autograd)
            return super().loss(embeddings, labels, ids, ref, ref_labels, ref_ids, options, normalize, reduction)
        return ops.eager_loss(embeddings, labels, ids, ref, ref_labels, ref_ids, hyper_parameters_of(options),
                              normalize, reduction, loss_dtype(embeddings))


class LazyBackend(Backend):
    """A backend in a module of its own that needs more than torch (`module`.BACKEND, imported when
    first asked for); until then, or when the import fails, it says why it cannot run."""

    def __init__(self, name, module, auto_devices, dtypes, missing):
        self.name, self.module, self.missing = name, module, missing
        self.auto_devices, self.dtypes = auto_devices, dtypes

    def load(self):
        """The backend itself, or self where its module cannot be imported (then `error` says why)."""
        try:
            return importlib.import_module(self.module).BACKEND
        except ImportError as error:  # (not kept: an install that adds the package later finds it)
            self.error = error
            return self

    def unavailable_reason(self, device, dtype=None):
        missing = getattr(self.error, "name", None) or ""
        if missing == self.module or missing.startswith(self.module + "."):  # (the package's own, not a dependency)
            return f"{missing} is missing" + _source_tree_note()
        return f"{self.missing} could not be imported ({self.error}); install {self.missing}"


def _source_tree_note():
    """Why a part of the package may be missing: it was imported from a clone's source folder (setup.py
    beside it), which holds neither the built extension nor the Triton kernels until an editable install
    puts them in place."""
    if not os.path.isfile(os.path.join(os.path.dirname(_PACKAGE), "setup.py")):
        return ""
    return (f" (ms_loss_cuda was imported from the source folder {_PACKAGE}: build it there with pip install "
            f"--no-build-isolation -e ., or run from outside the clone after pip install .)")


# The backends, in the order "auto" tries them on each device type.
REGISTRY = {"cpu": ExtensionBackend("cpu", "cpu"),
            "triton": LazyBackend("triton", "ms_loss_cuda.triton_kernels", ("cuda",), GPU_DTYPES, "triton"),
            "cuda": ExtensionBackend("cuda", "cuda"),
            "reference": ReferenceBackend()}


def get(name):
    """The backend called `name` (one of NAMES but "auto")."""
    backend = REGISTRY[name]
    if isinstance(backend, LazyBackend):
        backend = backend.load()
        if not isinstance(backend, LazyBackend):
            REGISTRY[name] = backend
    return backend


def check_name(backend):
    if backend not in NAMES:
        raise ValueError(f"backend must be one of {NAMES}, got {backend!r}")


def available(device="cpu"):
    """The backends this install can run on tensors of `device` (default CPU)."""
    device = torch.device(device)
    return [name for name in NAMES[1:] if get(name).unavailable_reason(device) is None]


def resolve(backend, device, dtype):
    """The backend that runs a call with `backend=` on `device` and `dtype`, as an object."""
    check_name(backend)  # here, so that a bad name raises ValueError under torch.compile too
    return get(_choose(backend, device, dtype))


_warned_fallback = False


# Decided outside any torch.compile graph: Dynamo calls this at trace time and keeps the name it returns
# (the checks query the dispatcher and import modules, which it cannot trace). So a compiled function
# keeps the backend, and the $MS_LOSS_BACKEND, of the time it was traced.
@torch.compiler.assume_constant_result
def _choose(backend, device, dtype):
    if backend == "auto":
        backend = os.environ.get("MS_LOSS_BACKEND", "auto") or "auto"
        if backend not in NAMES:
            raise ValueError(f"MS_LOSS_BACKEND must be one of {NAMES}, got {backend!r}")
    if torch._C._are_functorch_transforms_active():  # (torch.func.grad, vmap, jacrev, ...)
        if backend not in ("auto", "reference"):
            raise RuntimeError(f"backend {backend!r} cannot run under torch.func's transforms (grad, vmap, jacrev, "
                               f"...): its gradient is a fused kernel's, which they cannot transform; use "
                               f"backend='reference' (which 'auto' takes there)")
        return "reference"
    if backend != "auto":
        reason = get(backend).unavailable_reason(device, dtype)
        if reason is not None:
            raise RuntimeError(f"backend {backend!r} cannot run: {reason}")
        return backend
    reasons = []
    for name in REGISTRY:
        candidate = get(name)
        if device.type not in candidate.auto_devices or dtype not in candidate.dtypes:
            continue
        reason = candidate.unavailable_reason(device, dtype)
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    global _warned_fallback
    if reasons and not _warned_fallback:
        _warned_fallback = True
        warnings.warn("ms_loss_cuda: using the dense reference backend (" + "; ".join(reasons) + ")")
    return "reference"
