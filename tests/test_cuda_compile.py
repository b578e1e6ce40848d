"""Static checks of the CUDA kernels without a GPU: every csrc/cuda/*.cu compiles with nvcc against
the torch headers for sm_80 and sm_90 with torch's own nvcc flags; ptxas reports no spills and no
stack frame for any kernel; the SASS of the 16-bit kernels has tensor-core (HMMA) instructions."""
import glob
import os
import re
import shutil
import subprocess
from collections import defaultdict

import pytest
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
ARCHS = ("sm_80", "sm_90")
# (one pytest-xdist worker runs the module: its compile is a module fixture)
pytestmark = [pytest.mark.skipif(NVCC is None, reason="nvcc not found"), pytest.mark.xdist_group("cuda_compile")]


def nvcc_command(source, output):
    includes = cpp_extension.include_paths() + [os.path.join(ROOT, "csrc")]
    flags = cpp_extension.COMMON_NVCC_FLAGS + ["-std=c++20", "-O3", "-Xptxas", "-v", "-Xcompiler", "-fPIC"]
    # The CPU build of torch lacks this generated header (it only sets export macros).
    if not os.path.exists(os.path.join(includes[0], "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    arch_flags = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS]
    # --threads 0: the targets compile in parallel, one thread a core; nvcc still prints each target's
    # ptxas report in one piece
    return [NVCC, "-c", source, "-o", output, *flags, *arch_flags, "--threads", "0"] + [f"-I{path}" for path in includes]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{source: (object file, {(kernel, arch): ptxas facts})}"""
    results = {}
    for source in SOURCES:
        output = str(tmp_path_factory.mktemp("cuda") / (os.path.basename(source) + ".o"))
        done = subprocess.run(nvcc_command(source, output), capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stderr[-6000:]
        facts, current = {}, None
        for line in done.stderr.splitlines():
            entry = re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line)
            if entry:
                current = (entry.group(1), entry.group(2))
            elif current and "spill" in line:
                facts[current] = dict(stack=int(re.search(r"(\d+) bytes stack frame", line).group(1)),
                                      spill_stores=int(re.search(r"(\d+) bytes spill stores", line).group(1)),
                                      spill_loads=int(re.search(r"(\d+) bytes spill loads", line).group(1)))
            elif current and "Used" in line:
                facts[current]["registers"] = int(re.search(r"Used (\d+) registers", line).group(1))
        results[source] = (output, facts)
    return results


def kernel_kind(mangled):
    """(name, input type) of a mangled kernel name, e.g. ("backward_kernel", "__half")."""
    name = re.search(r"(forward_kernel|backward_kernel)", mangled).group(1)
    dtype = next(t for t in ("__nv_bfloat16", "__half", "f") if re.search(name + r"I\d*" + re.escape(t), mangled))
    return name, {"f": "float"}.get(dtype, dtype)


def test_sources_exist():
    assert [os.path.basename(s) for s in SOURCES] == ["ms_loss_cuda.cu"]  # it includes ms_loss_kernels.cuh


def test_every_kernel_for_both_targets(compiled):
    for _, facts in compiled.values():
        per_arch = defaultdict(list)
        for kernel, arch in facts:
            per_arch[arch].append(kernel_kind(kernel))
        for arch in ARCHS:  # forward per dtype; backward per dtype and case (self, dx, dref)
            kinds = per_arch[arch]
            for dtype in ("float", "__half", "__nv_bfloat16"):
                assert kinds.count(("forward_kernel", dtype)) == 1, (arch, dtype)
                assert kinds.count(("backward_kernel", dtype)) == 3, (arch, dtype)


def test_no_spills_and_no_stack_frame(compiled):
    spilling = [f"{kernel} {arch}: {f}" for _, facts in compiled.values() for (kernel, arch), f in facts.items()
                if f["stack"] or f["spill_stores"] or f["spill_loads"]]
    assert not spilling, "ptxas reports spills or a stack frame:\n" + "\n".join(spilling)


def cuobjdump():
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(cuobjdump() is None, reason="no cuobjdump (it ships in the Triton wheel)")
def test_16_bit_kernels_use_tensor_cores(compiled):
    for output, facts in compiled.values():
        sass = subprocess.run([cuobjdump(), "-sass", output], capture_output=True, text=True, check=True).stdout
        hmma = defaultdict(int)  # (kernel, arch) -> HMMA instructions
        arch = kernel = None
        for line in sass.splitlines():
            if "arch = " in line:
                arch = re.search(r"arch = (sm_\d+)", line).group(1)
            elif "Function : " in line:
                kernel = line.split("Function : ")[1].strip()
            elif kernel and "HMMA" in line:
                hmma[(kernel, arch)] += 1
        for kernel, arch in facts:
            name, dtype = kernel_kind(kernel)
            if dtype == "float":
                assert hmma[(kernel, arch)] == 0, f"{name} float32 should use IEEE FMA, not tensor cores"
            else:
                assert hmma[(kernel, arch)] > 0, f"no HMMA in {name} {dtype} {arch}"
