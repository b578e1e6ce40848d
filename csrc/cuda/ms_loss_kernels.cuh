// Kernels and host logic of the CUDA backend (the function of ms_loss_cuda/reference.py), no B x R
// buffer ever allocated.
//
// One block of 128 threads owns 64 anchor rows and walks over the reference rows 64 at a time:
// - forward_kernel (forward_kernel.cuh): similarity tile -> minpos/maxneg over all tiles, then the
//   tiles again -> mined sets -> both log(1 + sum exp) sums -> loss and the [4, B] statistics;
// - backward_kernel (backward_kernel.cuh): block (I, d) recomputes S_IJ for every J, turns it into
//   pair weights H_IJ and accumulates H_IJ @ b_J[:, d-block] in registers.
// Both build their similarity tiles alike (tiles.cuh); host_ops.cuh prepares the operands, launches
// the kernels and is the ops' implementation. What happens to one pair (mining tests, log-sum-exp,
// pair weights) is csrc/ms_math.h, which the CPU kernel uses too; these files only map pairs to
// threads. float16/bfloat16 tiles go through tensor cores (WMMA 16x16x16, float32 accumulation);
// float32 tiles use IEEE FMA; every exponent and sum is float32.
//
// Two files include this header: ms_loss_cuda.cu (nvcc: real launches, the CUDA dispatch key) and
// tests/cuda_emulation/emulated_ms_loss.cpp (a host compiler: every block's 128 threads run as fibers
// of one CPU thread, to test the thread mapping without a GPU). Each includes the CUDA types first
// (cuda_fp16.h, cuda_bf16.h, mma.h, or the emulation's stand-ins) and defines `launch` (declared in
// host_ops.cuh).
#pragma once

#include "tiles.cuh"
#include "forward_kernel.cuh"
#include "backward_kernel.cuh"
#include "host_ops.cuh"
