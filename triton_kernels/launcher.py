"""Launching the Triton kernels: direct launches, the tile table, and what a plan needs of the device.

A launch plan (forward_plan, backward_plan, row_kernels' plans) is a list of steps: `Launch`es of a
Triton kernel and, in the chunked backward, cuBLAS products. `run` makes a plan and issues its steps
on the current CUDA stream of the tensors' device, with grad mode and autocast off. A `Launch` whose
arguments specialise as an earlier one's calls that compiled kernel's launcher directly, skipping
Triton's per-call argument binding: on a GPU the host's time to issue an eager step is a large part
of the step (see docs/triton.md).

`tile_config` is the tile table every plan reads (by attribute, so that a test or a tuning sweep can
stand another table in for it); `chunk_budget` the chunked backward's buffer budget;
`float32_precision` how float32 tiles multiply.
"""
import contextlib
import functools
import os
import threading
from typing import NamedTuple, Optional

import torch
import triton

from . import interpreter_bfloat16

# jit functions are interpreted (numpy on CPU tensors) when this is set before they are defined
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# whether the interpreter computes bfloat16 as a GPU does (interpreter_bfloat16; False on a GPU)
BFLOAT16_INTERPRETED = INTERPRETED and bool(interpreter_bfloat16.install())


def version_needs(triton_module, torch_version, mm_overloads):
    """(why this Triton cannot run the launches, why this torch cannot on a GPU), each None where it can:
    the direct launches read Triton's settings (triton.knobs, from Triton 3.4); on a GPU the chunked
    backward multiplies 16-bit matrices into float32 results (torch.mm's out_dtype, the overload
    "dtype", from torch 2.8)."""
    old_triton = f"it needs Triton 3.4 or newer, found {triton_module.__version__}"
    old_torch = f"on a GPU it needs torch 2.8 or newer (torch.mm's out_dtype), found {torch_version}"
    return None if hasattr(triton_module, "knobs") else old_triton, None if "dtype" in mm_overloads else old_torch


TRITON_TOO_OLD, TORCH_TOO_OLD = version_needs(triton, torch.__version__, torch.ops.aten.mm.overloads())

# The interpreter patches triton.language and keeps the program's grid index for the whole process
# while it runs a launch: two threads' launches at once raise, or compute wrong numbers. They take turns.
_interpreter_lock = threading.Lock()


class Launch(NamedTuple):
    """One kernel launch: tensors and scalars in `args`, specialisations in `constexprs`; `max_registers`
    (PTX's .maxnreg) where a kernel must stay within what lets two of its programs share a
    multiprocessor."""
    kernel: object
    grid: tuple
    args: dict
    constexprs: dict
    num_warps: int
    num_stages: int
    max_registers: Optional[int] = None

    @property
    def options(self):
        """The compile options of Triton's launch: warps, stages and, where set, the register cap."""
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options

    def __call__(self):
        if INTERPRETED:
            with _interpreter_lock:
                self.kernel[self.grid](**self.args, **self.constexprs, **self.options)
            return
        key = self._key()
        known = _compiled_kernels.get(key)
        if known is None or _launch_hooks_set() or self.kernel.pre_run_hooks:
            compiled = self.kernel[self.grid](**self.args, **self.constexprs, **self.options)
            if key is not None:
                _compiled_kernels[key] = compiled, tuple(param.name for param in self.kernel.params)
            return
        compiled, names = known
        values = self.args | self.constexprs
        grid = self.grid + (1,) * (3 - len(self.grid))
        compiled.run(*grid, triton.runtime.driver.active.get_current_stream(key[1]), compiled.function,
                     compiled.packed_metadata, None, None, None, *[values[name] for name in names])

    def _key(self):
        """What selects the compiled kernel that Triton's own launch would pick (how it specialises each
        argument: a tensor's dtype and 16-byte alignment, an integer's width, whether it is 1 and a
        multiple of 16), with the device and the compile options; None for an argument of another
        kind (then every launch takes Triton's path)."""
        spec, aligned = [], 0
        for value in self.args.values():
            if isinstance(value, torch.Tensor):
                spec.append(value.dtype)
                aligned = aligned << 1 | (value.data_ptr() % 16 == 0)
            elif type(value) is int:
                spec.append((value % 16 == 0) + 2 * (value == 1) + 4 * (-0x80000000 <= value <= 0x7fffffff)
                            + 8 * (value >= 0) + 16 * (value >= 2 ** 63))
            elif type(value) is float or type(value) is bool:
                spec.append(type(value))
            else:
                return None
        return (id(self.kernel), triton.runtime.driver.active.get_current_device(), self.num_warps, self.num_stages,
                self.max_registers, tuple(self.args), tuple(spec), aligned, tuple(self.constexprs.items()),
                _compile_options(self.kernel))


def _compile_options(kernel):
    """The options besides the arguments that Triton's launch compiles for: debug, and where this Triton
    has them, the instrumentation mode (3.6 on) and the float sanitizer's casts (3.9)."""
    compilation = triton.knobs.compilation
    return (kernel.debug or triton.knobs.runtime.debug, getattr(compilation, "instrumentation_mode", None),
            getattr(compilation, "fpsan_homomorphic_casts", None))


def _launch_hooks_set():
    """Whether a launch hook is set (Triton 3.6-3.9 keep them as HookChains, older ones as None)."""
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook))


# Direct launches (`Launch`): Triton's launch path binds and specialises every argument and looks up
# its cache on each call, host time that an eager step from an idle GPU waits for before its heavy
# kernels start; a launch whose arguments specialise as an earlier one's
# calls that compiled kernel's launcher directly (the arguments as Triton passes them, every
# parameter in order). Launch hooks (a profiler such as Proton) take Triton's path.
_compiled_kernels = {}


def cdiv(a, b):
    """ceil(a / b) for the launch plans (triton.cdiv does the same behind a constexpr-function
    wrapper that costs host time on every call)."""
    return -(-a // b)


def pow2_at_least_16(n):
    """The smallest power of 2 that is at least n and 16 (a block width)."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


# ---- the tile table -------------------------------------------------------------------------------
def tile_config(kind, dtype, dim, interpret=INTERPRETED, capability=(9, 0)):
    """Tile sizes, warps and pipeline stages per kernel kind ("forward", "backward", "weights": the
    chunked backward's weights_kernel), dtype, D and the GPU's compute capability.

    The 16-bit entries are the winners of bench/tune_triton.py's sweeps on an H100 at B = 16384,
    D = 512 (bench/results/gpu/tune-*.json), less those that spill registers on sm_80 or sm_90:
    - forward: 128 x 128 tiles, 8 warps (two Hopper warpgroups), 3 stages;
    - backward (the fused grad_kernel): 64 rows against 32 columns at a time and a float32
      accumulator of up to 512 columns of D, so that S is computed once per pair tile for D <= 512;
      3 stages (2 for D <= 256, where 3 spill on sm_80); on sm_90 the column anchors' statistics are
      loaded before S (EARLY_COLUMN_TERMS), which spills on sm_80;
    - weights (the chunked backward): the forward's tiles, narrowed to 128 x 64 with K steps of 32
      and 4 stages (128 x 128 holds 248-254 registers, and the triangle's spills on sm_100; it is a
      candidate of bench/tune_triton.py, not yet timed: docs/triton.md). TRIANGLE_TILES: the self
      case's triangle, whose weights also read the columns' lifts, on 64 x 64 tiles of 4 warps
      (bench/results/gpu/tune-weights-float16.json, swept on an H200). RANGE_TILES: the small single-stage tiles of
      the launch that rewrites each row block's positive range with classified weights.
      MIRROR: the self case's chunks compute the tiles of their own square right of the diagonal
      once for both places (weights_kernel). TRIANGLE_ROWS: the chunk height from which the self
      case takes the triangle. A chunk of c rows reads and writes all later rows of dx (float32, 16
      bytes a value) for 2 c flops a value, c / 8 flops a byte: 128 at c = 1024, under half of
      what an H100's tensor cores need, so that product runs at about 1.4x its flops' time, still
      less than the S it saves; shorter chunks take whole rows.
    float32 tiles run on TF32 tensor cores, three products a tile at torch's default float32 matmul
    precision (`float32_precision`); those tiles are not tuned yet. There, on sm_90, the self case's
    negatives pass takes half of them (NEGATIVES_TILES' SYMMETRIC: forward_kernels'
    symmetric_negatives_kernel, each tile of S summed for its rows and its columns): a 128 x 128 tile's
    three TF32 products take about 24,600 cycles of an H100 multiprocessor's tensor cores at their
    peak, and its instructions for both ends issue in about a third of that, so halving the products
    about halves the pass (bench/providers.py's triton-unsymmetric times the shipped pass's full
    walk). Triton 3.6 and 3.9 both spill that kernel on sm_100, which keeps the full walk.
    The backward entry's CHUNK_BYTES picks the backward's form: 0, the fused grad_kernel; else the
    chunked form at that budget of pair weights (`chunk_budget`).
    Rows are padded to a multiple of 16 elements first (operands.plan_operands): unaligned rows
    spill. The interpreter gets few, larger tiles (its cost is per tile op), and takes the triangle
    from one block on, so that the tests run it. Every configuration this returns for a GPU is
    compiled for sm_80 and sm_90 by tests/test_triton_compile.py.
    """
    precision = float32_precision() if dtype == torch.float32 else "tf32"  # (unused for 16-bit)
    if kind == "weights":  # (the shipped forward entry, also where a tuned table stands in for this one)
        config = _SHIPPED_TILE_CONFIG("forward", dtype, dim, interpret, capability)
        if dtype != torch.float32 and not interpret:
            config.update(BLOCK_N=64, BLOCK_K=min(config["BLOCK_K"], 32), num_stages=4)
        config.pop("NEGATIVES_TILES", None)  # (the forward's alone)
        config["TRIANGLE_ROWS"] = config["BLOCK_M"] if interpret else 1024
        config["MIRROR"] = True
        config["TRIANGLE_TILES"] = (dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4)
                                    if dtype != torch.float32 and not interpret else {})
        config["RANGE_TILES"] = (dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=config["BLOCK_K"], num_warps=4, num_stages=1)
                                 if interpret else
                                 dict(BLOCK_M=64, BLOCK_N=64 if dtype != torch.float32 else 32,
                                      BLOCK_K=min(config["BLOCK_K"], 32), num_warps=8, num_stages=1))
        return config
    if interpret:
        config = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, BLOCK_D=128, num_warps=4, num_stages=1)
    elif dtype == torch.float32:  # (TF32 tensor cores; not tuned yet: 16-bit shapes, half the K depth)
        # the three products of "tf32x3" hold more operands: narrower column blocks with mma.sync; the fused
        # backward takes 16 columns beside its 512-wide accumulator, where 32 spill (three products, or
        # one at D = 130 on sm_90)
        wide = (9, 0) <= capability < (12, 0)  # (wgmma and tcgen05; sm_80 and sm_120 take mma.sync)
        config = (dict(BLOCK_M=128, BLOCK_N=64 if wide else 32, BLOCK_K=32, num_warps=8, num_stages=3)
                  if kind == "forward" else
                  dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, BLOCK_D=512, num_warps=8, num_stages=2))
    elif kind == "forward":  # (sm_120's mma.sync tiles spill at K steps of 64, sm_80's do not)
        config = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32 if capability >= (12, 0) else 64, num_warps=8,
                      num_stages=3)
    else:
        config = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, BLOCK_D=512, num_warps=8, num_stages=3 if dim > 256 else 2)
    padded = dim + (-dim % 16)  # (the padded rows) K steps that divide it: no step over zero padding
    config["BLOCK_K"] = min(config["BLOCK_K"], padded & -padded)
    if kind == "forward":
        config.pop("BLOCK_D", None)
        if precision == "tf32x3" and capability[0] == 9 and not interpret:
            config["NEGATIVES_TILES"] = {"SYMMETRIC": True}
    else:
        config["BLOCK_D"] = min(config["BLOCK_D"], pow2_at_least_16(dim))
        config["EARLY_COLUMN_TERMS"] = dtype != torch.float32 and capability >= (9, 0)
        config["CHUNK_BYTES"] = chunk_budget(interpret)
    config["PRECISION"] = precision
    return config


_SHIPPED_TILE_CONFIG = tile_config


def with_triangle_rows(rows, table=tile_config):
    """`table` (the shipped tile_config unless given) with TRIANGLE_ROWS = rows: the chunk height from
    which the self case takes the triangle (1: at any height; 10 ** 9: never, chunks of whole rows),
    for the tests and benches that pick the chunked backward's form."""
    def config(kind, *args, **kwargs):
        entry = table(kind, *args, **kwargs)
        return dict(entry, TRIANGLE_ROWS=rows) if kind == "weights" else entry

    return config


DEFAULT_CHUNK_MIB = 256  # the chunked backward's budget where $MS_LOSS_TRITON_CHUNK_MB is unset, on a GPU


def chunk_budget(interpret=INTERPRETED):
    """The chunked backward's budget of pair weights in bytes: $MS_LOSS_TRITON_CHUNK_MB (MiB, a
    fraction allowed; 0: the fused backward). Unset: DEFAULT_CHUNK_MIB on a GPU, where the sweep times
    the chunked form 2.4-3.2x faster than the fused one (bench/results/gpu/tune-float16.json), and 0
    under the interpreter, whose tests name the form they run. float16 keeps the fused backward under
    torch.backends.cuda.matmul.allow_fp16_accumulation, where cuBLAS refuses float32 results."""
    text = os.environ.get("MS_LOSS_TRITON_CHUNK_MB", "")
    if not text:
        return 0 if interpret else DEFAULT_CHUNK_MIB << 20
    try:
        mib = float(text)
    except ValueError:
        mib = float("nan")
    if not 0 <= mib < 2 ** 40:
        raise ValueError(f"MS_LOSS_TRITON_CHUNK_MB must be a number of MiB >= 0 (0: the fused backward), got {text!r}")
    return int(mib * (1 << 20))


def float32_precision():
    """How float32 tiles multiply, on tensor cores either way, with the accuracy torch.matmul's float32
    products have: under torch.get_float32_matmul_precision() "highest" (the default) three TF32
    products a tile, each operand split into a TF32 high part and the TF32 rest, hi hi + hi lo + lo hi
    ("tf32x3": the error of a float32 product); under "high" or "medium" one TF32 product ("tf32": a
    10-bit mantissa, about 1e-3 relative)."""
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def split_config(config):
    """(the entry without its launch options, num_warps, num_stages)."""
    config = dict(config)
    return config, config.pop("num_warps"), config.pop("num_stages")


def device_multiprocessors(device, interpret):
    """What the column splits are sized for: the GPU's multiprocessors; under the interpreter a few
    (so that the tests run split launches); for plans made on CPU tensors without it, an H100's 132."""
    if device.type == "cuda":
        return _device_facts(_indexed(device))[1]
    return 4 if interpret else 132


def device_capability(device):
    """What the tile table is chosen for: the GPU's compute capability; for plans made on CPU tensors, an H100's."""
    return _device_facts(_indexed(device))[0] if device.type == "cuda" else (9, 0)


def _indexed(device):
    """A CUDA device with its index: "cuda" alone names the current one, which can change."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


@functools.cache
def _device_facts(device):
    """(compute capability, multiprocessors) of a GPU, asked once: every step's plans need them, and
    each query costs the host a few microseconds."""
    properties = torch.cuda.get_device_properties(device)
    return (properties.major, properties.minor), properties.multi_processor_count


# ---- running a plan ------------------------------------------------------------------------------
def run(plan, device, *args, **kwargs):
    """Runs the plan's launches under `device` (Triton launches on the current CUDA device and stream),
    the cuBLAS products (`Product`) with grad mode off (a backward under create_graph=True runs with
    it on, and its tensors may require a gradient) and autocast too (it would turn their float32
    products into 16-bit ones)."""
    *outputs, launches = plan(*args, **kwargs)
    with _on(device):
        if torch.is_grad_enabled() or torch.is_autocast_enabled(device.type):  # (entered only then: host time)
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                issue(launches)
        else:
            issue(launches)
    return tuple(outputs)


def _on(device):
    """A context that makes `device` the current CUDA device, where it is not already."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()  # (entering torch.cuda.device costs the host two device switches)
    return torch.cuda.device(device)


def issue(launches):
    """Issues a plan's steps in order (a launch of an empty grid has nothing to write: skipped)."""
    for launch in launches:
        if not isinstance(launch, Launch) or all(launch.grid):
            launch()

