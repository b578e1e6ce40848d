"""The CUDA emulation's own checks (tests/cuda_emulation/cuda_on_cpu.h): kernels that break a rule a GPU
imposes (a barrier only some threads reach, a shuffle of part of a warp or across warps, unaligned
WMMA operands) are refused with a message naming the rule; a kernel that keeps them runs."""
import os
import shutil
import subprocess

import pytest
from torch.utils import cpp_extension

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emulation")
COMPILER = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def faulty_kernels(tmp_path_factory):
    program = str(tmp_path_factory.mktemp("emulation") / "faulty_kernels")
    includes = [f"-I{path}" for path in cpp_extension.include_paths() + [HERE]]
    subprocess.run([COMPILER, "-std=c++17", "-O1", *includes, os.path.join(HERE, "faulty_kernels.cpp"), "-o", program],
                   check=True, capture_output=True, timeout=300)
    return program


def run(program, case):
    return subprocess.run([program, case], capture_output=True, text=True, timeout=60)


def test_a_kernel_that_keeps_the_rules_runs(faulty_kernels):
    done = run(faulty_kernels, "sound")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("case, message", [
    ("divergent_barrier", "32 of its threads ended while the others wait at a __syncthreads"),
    ("partial_shuffle", "mask must name the whole warp"),
    ("shuffle_across_warps", "lane mask leaves the warp"),
    ("misaligned_operand", "WMMA pointer must be 256-bit aligned"),
    ("odd_leading_dimension", "leading dimension must be a multiple of 16 bytes"),
])
def test_a_kernel_that_breaks_a_rule_is_refused(faulty_kernels, case, message):
    done = run(faulty_kernels, case)
    assert done.returncode == 1 and message in done.stderr, (done.returncode, done.stderr)
