// Kernels that break a rule a GPU imposes, each run on the emulation of cuda_on_cpu.h (named by the
// first argument), and one that keeps every rule: the emulation must refuse each faulty one, with its
// message on stderr and exit status 1 (tests/test_cuda_emulation.py).
#include "cuda_on_cpu.h"

#include <cstdio>
#include <cstring>

namespace {
constexpr unsigned kThreads = 64;
alignas(128) __shared__ float tile[16 * 24];
__shared__ float sums[kThreads];

void sound() {  // a barrier in every thread, a whole-warp shuffle, aligned WMMA operands
  sums[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  const float pair = sums[threadIdx.x] + __shfl_xor_sync(0xffffffffu, sums[threadIdx.x], 1);
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> f;
  nvcuda::wmma::fill_fragment(f, pair);
  nvcuda::wmma::store_matrix_sync(tile, f, 24, nvcuda::wmma::mem_row_major);
}

void divergent_barrier() {  // half of the threads wait at a barrier the others never reach
  if (threadIdx.x < kThreads / 2) __syncthreads();
}

void partial_shuffle() { __shfl_xor_sync(0x0000ffffu, 1.0f, 1); }

void shuffle_across_warps() { __shfl_xor_sync(0xffffffffu, 1.0f, 32); }

void misaligned_operand() {
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> f;
  nvcuda::wmma::fill_fragment(f, 0.0f);
  nvcuda::wmma::store_matrix_sync(tile + 4, f, 24, nvcuda::wmma::mem_row_major);
}

void odd_leading_dimension() {
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> f;
  nvcuda::wmma::fill_fragment(f, 0.0f);
  nvcuda::wmma::store_matrix_sync(tile, f, 18, nvcuda::wmma::mem_row_major);
}

struct Case {
  const char* name;
  void (*kernel)();
};
constexpr Case kCases[] = {{"sound", sound},
                           {"divergent_barrier", divergent_barrier},
                           {"partial_shuffle", partial_shuffle},
                           {"shuffle_across_warps", shuffle_across_warps},
                           {"misaligned_operand", misaligned_operand},
                           {"odd_leading_dimension", odd_leading_dimension}};
}  // namespace

int main(int argc, char** argv) {
  for (const Case& c : kCases) {
    if (argc < 2 || std::strcmp(argv[1], c.name) != 0) continue;
    try {
      for (unsigned x = 0; x < 2; ++x) cuda_emulation::run_block(kThreads, dim3(x, 0), c.kernel);
    } catch (const std::exception& error) {
      std::fprintf(stderr, "%s\n", error.what());
      return 1;
    }
    return 0;
  }
  std::fprintf(stderr, "no case %s\n", argc < 2 ? "given" : argv[1]);
  return 2;
}
