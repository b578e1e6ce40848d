"""The targets of the parity suite (tests/test_parity.py): every fused backend this machine can run.

- cpu: the fused CPU kernel (csrc/), the GPU backends' edge cases included (tests/test_cpu_kernel.py
  checks what only it has: float64, the pair weights it keeps);
- triton, triton_chunked: the Triton backend with its fused and with its chunked backward, on CUDA
  tensors when a GPU is present, else under TRITON_INTERPRET=1 on CPU tensors (conftest sets it
  before the kernels are imported);
- cuda: on CUDA tensors; needs a GPU and the CUDA kernels built (else skipped);
- cuda_emulated: the CUDA backend's kernels and host logic (csrc/cuda/) built by the host compiler on
  tests/cuda_emulation/cuda_on_cpu.h, every block's threads run as fibers of one CPU thread: the
  thread mapping, tiles, barriers and WMMA operand layouts of the CUDA kernels, checked without a
  GPU (tests/test_cuda_compile.py checks what nvcc makes of them).
A test module that asks for `target` imports the fixtures from here.
"""
import itertools
import os
import shutil
from typing import NamedTuple

import pytest
import torch
from torch.utils import cpp_extension

from ms_loss_cuda import backends, ops

from conftest import check_against_reference, launch_recorder

try:
    import ms_loss_cuda.triton_kernels as triton_kernels
except ImportError:
    triton_kernels = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HERE = os.path.dirname(os.path.abspath(__file__))


# 1e-5 relative in float32; float16 / bfloat16: the rounding of the weights that enter the second
# product
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class Target(NamedTuple):
    name: str  # the fixture's parameter
    backend: str  # the name multi_similarity_loss takes
    device: str
    forward: object  # the fused ops
    backward: object
    chunked: bool = False  # triton's chunked backward: cuBLAS sums dx in chunks that depend on ref_grad


TRITON_MISSING = dict(condition=triton_kernels is None or (DEVICE == "cpu" and not triton_kernels.INTERPRETED),
                      reason="Triton missing, or no GPU and TRITON_INTERPRET=1 not set before the kernels were "
                             "imported")


def check(target, kwargs, dtype, reduction="mean", rtol=None, **options):
    # (cuda_emulated runs as backend="cpu": its own ops are the proof that it ran, not the CPU kernel's)
    return check_against_reference(target.backend, kwargs, dtype, reduction, device=target.device,
                                   rtol=TOLERANCE[dtype] if rtol is None else rtol,
                                   ops_run=(target.forward, target.backward), **options)


def in_turn(values, *axes):
    """Every combination of `axes`, each with the next of `values` in turn: each value meets each
    target in several cases, for a fraction of the runs of every combination. (The fused ops never
    see the reduction, only the gradient it gives each anchor: one value for all of them from
    "mean" and "sum", a random vector from "none".)"""
    runs = []
    for i, combination in enumerate(itertools.product(*axes)):  # (a tuple on an axis: several parameters)
        flat = [v for value in combination for v in (value if isinstance(value, tuple) else (value,))]
        runs.append((*flat, values[i % len(values)]))
    return runs


REDUCTIONS = ["mean", "sum", "none"]


def recorded_launches(monkeypatch):
    """The Triton launches run after this, in order (each still runs): launcher.Launch objects, with their
    kernel, grid, args and constexprs."""
    from ms_loss_cuda.triton_kernels import launcher

    launches = []
    monkeypatch.setattr(launcher.Launch, "__call__", launch_recorder(launches))
    return launches


def gpu_tile_table(monkeypatch, capability):
    """The kernels on the tile table a GPU of `capability` gets (launcher.tile_config with interpret
    False), under the interpreter."""
    from ms_loss_cuda.triton_kernels import launcher

    shipped = launcher.tile_config
    monkeypatch.setattr(launcher, "tile_config",
                        lambda kind, tile_dtype, dim, *_: shipped(kind, tile_dtype, dim, False, capability))


def chunk_choices(monkeypatch, triangle_rows=None):
    """[(chunks, triangle)] of every chunked backward plan made after this (backward.chunk_rectangles);
    with triangle_rows, the tile table's TRIANGLE_ROWS replaced by it (10 ** 9: whole rows; 1: the
    triangle at any chunk height, where a GPU's table asks for 1024 rows)."""
    from ms_loss_cuda.triton_kernels import backward, launcher

    shipped_rectangles, chosen = backward.chunk_rectangles, []

    def rectangles(*args):
        chosen.append(shipped_rectangles(*args))
        return chosen[-1]

    if triangle_rows is not None:
        monkeypatch.setattr(launcher, "tile_config", launcher.with_triangle_rows(triangle_rows, launcher.tile_config))
    monkeypatch.setattr(backward, "chunk_rectangles", rectangles)
    return chosen



@pytest.fixture(scope="session")
def emulated_cuda_ops(tmp_path_factory):
    """Builds tests/cuda_emulation/emulated_ms_loss.cpp and gives its fused ops autograd. The build
    directory is shared by the run's pytest-xdist workers (each worker's base is a child of the
    run's): the first builds (about 25 s), the others wait for its lock and load the result."""
    run_base = tmp_path_factory.getbasetemp()
    build_directory = (run_base.parent if os.environ.get("PYTEST_XDIST_WORKER") else run_base) / "cuda_emulation"
    build_directory.mkdir(exist_ok=True)
    cpp_extension.load(
        name="ms_loss_cuda_emulated", sources=[os.path.join(HERE, "cuda_emulation", "emulated_ms_loss.cpp")],
        extra_include_paths=[os.path.join(os.path.dirname(HERE), "csrc"), os.path.join(HERE, "cuda_emulation")],
        extra_cflags=["-O2", "-std=c++20", "-pthread", "-fno-strict-aliasing", "-Wno-unknown-pragmas"],
        extra_ldflags=["-pthread"], build_directory=str(build_directory),
        is_python_module=False)
    emulated = torch.ops.ms_loss_cuda_emulated
    forward, backward = emulated.ms_loss_forward.default, emulated.ms_loss_backward.default
    fused = ops.register_fused_op("ms_loss_cuda_emulated::ms_loss_forward", "ms_loss_cuda_emulated::ms_loss_backward")
    return forward, backward, fused


@pytest.fixture(params=[
    pytest.param("cpu", marks=pytest.mark.skipif(ops.LOAD_ERROR is not None, reason="needs the built extension")),
    pytest.param("triton", marks=pytest.mark.skipif(**TRITON_MISSING)),
    pytest.param("triton_chunked", marks=pytest.mark.skipif(**TRITON_MISSING)),
    pytest.param("cuda", marks=pytest.mark.skipif(
        DEVICE == "cpu" or backends.get("cuda").unavailable_reason(torch.device(DEVICE)) is not None,
        reason="needs a GPU and the CUDA kernels built")),
    pytest.param("cuda_emulated", marks=pytest.mark.skipif(
        ops.LOAD_ERROR is not None or shutil.which("ninja") is None,
        reason="needs the built extension (its autograd path) and ninja to build the emulation")),
])
def target(request, monkeypatch):
    """triton: the triton backend with its fused backward; triton_chunked: with the chunked backward
    (weights to memory, cuBLAS for the second product; a GPU's default) at a budget of one tile row or
    column per chunk, so that every case runs several, and the triangle's transposed products in
    pieces of 48 rows."""
    if request.param.startswith("triton"):
        monkeypatch.setenv("MS_LOSS_TRITON_CHUNK_MB", "1e-6" if request.param == "triton_chunked" else "0")
        monkeypatch.setattr(triton_kernels.backward, "LEAST_PIECE_ROWS", 48)
        return Target(request.param, "triton", DEVICE, torch.ops.ms_loss_cuda.triton_forward.default,
                      torch.ops.ms_loss_cuda.triton_backward.default, request.param == "triton_chunked")
    if request.param == "cuda":
        return Target("cuda", "cuda", DEVICE, ops.forward_op, ops.backward_op)
    if request.param == "cpu":
        return Target("cpu", "cpu", "cpu", ops.forward_op, ops.backward_op)
    forward, backward, fused = request.getfixturevalue("emulated_cuda_ops")
    # backend="cpu" now calls the emulated CUDA ops: eager (ops.eager_loss) and traced (ops.fused_forward)
    for name, emulated in (("forward_op", forward), ("backward_op", backward), ("fused_forward", fused)):
        monkeypatch.setattr(ops, name, emulated)
    return Target("cuda_emulated", "cpu", "cpu", forward, backward)

