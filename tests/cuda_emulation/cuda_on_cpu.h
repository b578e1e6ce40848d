// Just enough of CUDA, on the host, to run csrc/cuda/ms_loss_kernels.cuh on the CPU: a block's 128
// threads are fibers of the launching thread (ucontext; blocks run one after another), each run up
// to its next __syncthreads in turn, and a round of them ends the barrier; __shared__ arrays are
// function statics of the launching thread (one per kernel instantiation and thread: the running
// block's, so that threads of the process may launch at once, as streams do), and WMMA fragments
// hold the whole 16 x 16 tile in every lane, following the documented semantics of load_matrix_sync
// (row_major / col_major with ldm), mma_sync and store_matrix_sync.
// The rounds take the threads in ascending order, then descending, and so on, and the blocks of odd
// x + y start descending: a read of shared memory that misses the barrier after another thread's write
// runs before that write in some of the blocks.
// Fibers rather than threads: a barrier of 128 threads on two cores costs thousands of context
// switches, and the same order on every run gives the same bits.
// What a GPU requires and would not report clearly raises here: a __syncthreads that some threads of
// the block reach and others do not (they would hang, or pass a barrier that is not theirs), a shuffle
// with a lane outside the warp, a WMMA pointer not 256-bit aligned or a leading dimension not a
// multiple of 16 bytes; and what the emulation cannot run: a shuffle of less than a whole warp (a GPU
// allows one where every calling lane is in the mask), or one that not every thread of the block calls.
// It checks what the kernels compute and how threads map to pairs; not timing, not warp-level
// hazards (a shuffle here is a barrier of the whole block), not the hardware's fragment layouts, and
// not shared memory read before any thread of the block wrote it (it holds the previous block's).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

using __half = c10::Half;
using __nv_bfloat16 = c10::BFloat16;
inline __half __float2half_rn(float v) { return c10::Half(v); }                // round to nearest even
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return c10::BFloat16(v); }  // round to nearest even

inline thread_local dim3 threadIdx, blockIdx;

namespace cuda_emulation {
constexpr int kMaxThreads = 1024;
constexpr size_t kStackBytes = 256 * 1024;
inline thread_local float shuffle_slots[kMaxThreads];

// The running block: its fibers, the launching thread's context they return to, the body they run.
struct Block {
  ucontext_t launcher;
  std::vector<ucontext_t> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<bool> done;
  std::function<void()> body;
  std::exception_ptr error;
  int current = 0;
};
inline thread_local Block block;

inline void fiber_entry() {
  try {
    block.body();
  } catch (...) {
    if (!block.error) block.error = std::current_exception();
  }
  block.done[block.current] = true;  // (returns to uc_link: the launcher)
}

// Runs body as `threads` threads of block `index`, each to its end.
inline void run_block(unsigned threads, dim3 index, std::function<void()> body) {
  block.body = std::move(body);
  block.error = nullptr;
  block.fibers.resize(threads);
  block.done.assign(threads, false);
  while (block.stacks.size() < threads) block.stacks.push_back(std::make_unique<char[]>(kStackBytes));
  for (unsigned t = 0; t < threads; ++t) {
    ucontext_t& fiber = block.fibers[t];
    getcontext(&fiber);
    fiber.uc_stack.ss_sp = block.stacks[t].get();
    fiber.uc_stack.ss_size = kStackBytes;
    fiber.uc_link = &block.launcher;
    makecontext(&fiber, fiber_entry, 0);
  }
  blockIdx = index;
  // A round runs every thread to its next barrier or its end: the same number of barriers in every
  // thread means that the threads end in the same round.
  for (bool ascending = (index.x + index.y) % 2 == 0, running = true; running; ascending = !ascending) {
    running = false;
    unsigned ended = 0;
    for (unsigned i = 0; i < threads; ++i) {
      const unsigned t = ascending ? i : threads - 1 - i;
      if (block.done[t]) continue;
      block.current = int(t);
      threadIdx = dim3(t);
      swapcontext(&block.launcher, &block.fibers[t]);
      running = running || !block.done[t];
      ended += block.done[t];
    }
    if (block.error) std::rethrow_exception(block.error);  // (the other threads are left where they are)
    if (running && ended)
      throw std::runtime_error("emulated block (" + std::to_string(index.x) + ", " + std::to_string(index.y) +
                               "): " + std::to_string(ended) + " of its threads ended while the others wait at a "
                               "__syncthreads (a barrier that only some threads reach)");
  }
}

inline void check(bool condition, const char* what) {
  if (!condition) throw std::runtime_error(std::string("emulated CUDA: ") + what);
}
}  // namespace cuda_emulation

// Every thread of the block must call it at the same points (as on a GPU): this thread's turn ends.
inline void __syncthreads() {
  using cuda_emulation::block;
  swapcontext(&block.fibers[block.current], &block.launcher);
}

// Every thread of the block must call it at the same point (true of the kernels' uses).
inline float __shfl_xor_sync(unsigned mask, float value, int lane_mask) {
  cuda_emulation::check(mask == 0xffffffffu, "__shfl_xor_sync's mask must name the whole warp");
  cuda_emulation::check(lane_mask >= 0 && lane_mask < 32, "__shfl_xor_sync's lane mask leaves the warp");
  cuda_emulation::shuffle_slots[threadIdx.x] = value;
  __syncthreads();
  const float other = cuda_emulation::shuffle_slots[threadIdx.x ^ unsigned(lane_mask)];
  __syncthreads();
  return other;
}

namespace nvcuda::wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "only the 16x16x16 shape is emulated");
  static constexpr int num_elements = 256;
  float x[256];  // element (r, c) of the 16 x 16 tile at x[16 r + c], in every lane
};

template <typename Use, typename T, typename Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, float value) {
  for (float& v : f.x) v = value;
}

// The documented requirements of load_matrix_sync and store_matrix_sync.
template <typename T>
void check_operand(const T* p, unsigned ldm) {
  cuda_emulation::check(reinterpret_cast<uintptr_t>(p) % 32 == 0, "a WMMA pointer must be 256-bit aligned");
  cuda_emulation::check(ldm * sizeof(T) % 16 == 0, "a WMMA leading dimension must be a multiple of 16 bytes");
}

template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  check_operand(p, ldm);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.x[16 * r + c] = float(std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r]);
}

template <typename T, typename LayoutA, typename LayoutB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  float out[256];
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 16; ++n) {
      float sum = c.x[16 * r + n];
      for (int k = 0; k < 16; ++k) sum += a.x[16 * r + k] * b.x[16 * k + n];
      out[16 * r + n] = sum;
    }
  for (int e = 0; e < 256; ++e) d.x[e] = out[e];
}

// One lane writes (every lane holds the same tile); readers synchronise first, as on the GPU.
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
  check_operand(p, ldm);
  if (threadIdx.x % 32 != 0) return;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[16 * r + c];
}
}  // namespace nvcuda::wmma
