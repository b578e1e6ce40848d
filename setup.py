"""Builds ms_loss_cuda._C: the operator schemas, the fused CPU kernel and, where torch has CUDA
and nvcc is found, the CUDA kernels (csrc/cuda/*.cu).

Environment: FORCE_CUDA=1 builds the CUDA kernels even without a visible GPU (nvcc needed),
FORCE_ONLY_CPU=1 never builds them, TORCH_CUDA_ARCH_LIST picks the GPU targets (default 8.0;9.0+PTX: machine code for
A100 and H100, and PTX that the driver compiles for any newer GPU).
"""
import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
# -ffp-contract=off: a pair's exponent, alpha or beta times (S - base), is rounded before the anchor's
# log-sum is subtracted from it, in the vectorised loops as in the scalar code that computes the
# shifts. Contracted into an FMA in some places only, the two disagree by up to half an ulp of the
# exponent, which scales every weight of an anchor: at |beta S| = 45,000 (unnormalised rows of norm 30)
# that is many times the reference's gradient error; uncontracted, the kernel's error is the
# reference's. It costs no measurable time.
# -g0: no debug information, which Python's own compile flags (-g) ask for; for the torch headers it
# takes twice the compile time of the code (a fresh build: about 50 s rather than 90 on 2 cores).
cxx_flags = ["-O3", "-g0", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]


def want_cuda():
    if os.environ.get("FORCE_ONLY_CPU") == "1":
        return False
    has_toolkit = cpp_extension.CUDA_HOME is not None and bool(cuda_sources)
    if os.environ.get("FORCE_CUDA") == "1":
        if not has_toolkit:  # an explicit request that cannot be met is an error, not a CPU-only build
            raise RuntimeError("FORCE_CUDA=1, but torch.utils.cpp_extension finds no CUDA toolkit (CUDA_HOME / nvcc; "
                               "a CPU build of torch never has one)")
        return True
    import torch

    return has_toolkit and torch.version.cuda is not None


if want_cuda():
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")  # +PTX: newer GPUs JIT-compile it
    print(f"ms_loss_cuda: building CPU + CUDA kernels for {os.environ['TORCH_CUDA_ARCH_LIST']}")
    extension = cpp_extension.CUDAExtension(
        "ms_loss_cuda._C",
        sources + cuda_sources,
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
    )
else:
    print("ms_loss_cuda: building the CPU kernels only (no CUDA torch/nvcc, or FORCE_ONLY_CPU=1)")
    extension = cpp_extension.CppExtension(
        "ms_loss_cuda._C",
        sources,
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args=cxx_flags,
    )

setup(
    name="ms-loss-cuda",
    version="0.1.0",
    description="Fused Multi-Similarity loss for PyTorch: reference, CPU, Triton and CUDA backends",
    packages=["ms_loss_cuda", "ms_loss_cuda.train", "ms_loss_cuda.triton_kernels"],
    package_dir={"ms_loss_cuda.triton_kernels": "triton_kernels"},
    ext_modules=[extension],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.10",
    # The loss, the memory, the distributed loss, gradient caching and evaluation's Recall@K and
    # MAP@R need torch alone (torchvision, for the training command's torchvision backbones, stays
    # the user's choice: it must match their torch).
    install_requires=["torch>=2.8"],
    extras_require={
        # evaluation: faiss's exact k-NN search (numpy arrays) when installed; NMI's k-means and score
        "eval": ["numpy", "scikit-learn", "faiss-cpu"],
        # ms_loss_cuda.train: numpy (data, kanji), pillow (images, kanji drawings), matplotlib (the
        # recall plot), tqdm (the progress bar) and kanjivg (the kanji strokes)
        "train": ["numpy", "pillow", "tqdm", "matplotlib", "kanjivg"],
        # the triton backend (ms_loss_cuda.triton_kernels): its launches read triton.knobs (3.4 on); CUDA
        # builds of torch bring a matching Triton
        "triton": ["triton>=3.4"],
    },
    entry_points={"console_scripts": ["ms-loss-train = ms_loss_cuda.train.__main__:cli"]},
)
