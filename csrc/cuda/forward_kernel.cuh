// The forward kernel of the CUDA backend: one block of 128 threads owns 64 anchor rows and walks
// over the reference rows a similarity tile at a time, twice: first minpos/maxneg over all tiles,
// then the mined sets -> both log(1 + sum exp) sums (shifted by the hardest pair's exponent) ->
// the loss and the [4, B] statistics (minpos, maxneg, LP, LN), the same as the CPU op saves. Two
// threads share an anchor row and combine their halves by a shuffle.
// Included through ms_loss_kernels.cuh, after the CUDA types.
#pragma once

#include <cstdint>

#include "../ms_math.h"
#include "tiles.cuh"

namespace ms_loss_cuda_kernels {

using ms_loss::Params;

// The two threads of an anchor row (neighbouring lanes, see pair_row) combine their halves.
__device__ __forceinline__ float combine_min(float v) { return fminf(v, __shfl_xor_sync(0xffffffffu, v, 1)); }
__device__ __forceinline__ float combine_max(float v) { return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1)); }
__device__ __forceinline__ float combine_sum(float v) { return v + __shfl_xor_sync(0xffffffffu, v, 1); }

// Calls body(S_ij, positive) for each pair of this thread's row i whose identities differ, tile
// after tile over all rows j of b (the pair's columns of every tile, see pair_col).
template <typename T, typename Body>
__device__ __forceinline__ void for_each_pair(unsigned char* smem, int64_t* col_label, int64_t* col_id, const T* a,
                                              int64_t num_a, int64_t row0, const T* b, const int64_t* b_labels,
                                              const int64_t* b_ids, int64_t num_b, int64_t dim, int64_t label_i,
                                              int64_t id_i, Body body) {
  const float* s = reinterpret_cast<const float*>(smem + Plan<T>::kS);
  for (int64_t col0 = 0; col0 < num_b; col0 += kCols) {
    __syncthreads();
    load_keys(col_label, col_id, b_labels, b_ids, col0, num_b);
    similarity_tile<T>(smem, a, num_a, row0, b, num_b, col0, dim);
#pragma unroll 4
    for (int m = 0; m < kPairsPerThread; ++m) {
      const int c = pair_col(m);
      if (col0 + c < num_b && col_id[c] != id_i) body(s[pair_row() * Plan<T>::kSPitch + c], col_label[c] == label_i);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
forward_kernel(const T* __restrict__ x, const int64_t* __restrict__ labels, const int64_t* __restrict__ ids,
               int64_t num_x, const T* __restrict__ ref, const int64_t* __restrict__ ref_labels,
               const int64_t* __restrict__ ref_ids, int64_t num_ref, int64_t dim, Params<float> p,
               float* __restrict__ loss, float* __restrict__ stats) {
  alignas(128) __shared__ unsigned char smem[Plan<T>::kForwardBytes];
  __shared__ int64_t col_label[kCols], col_id[kCols];
  const int64_t row0 = int64_t(blockIdx.x) * kRows, row = row0 + pair_row();
  const bool row_ok = row < num_x;
  const int64_t label_i = row_ok ? labels[row] : 0, id_i = row_ok ? ids[row] : 0;

  // Similarity-P: the hardest positive and negative of each anchor.
  float minpos = ms_loss::infinity<float>(), maxneg = -ms_loss::infinity<float>();
  for_each_pair<T>(smem, col_label, col_id, x, num_x, row0, ref, ref_labels, ref_ids, num_ref, dim, label_i, id_i,
                   [&](float v, bool positive) {
                     if (positive) minpos = fminf(minpos, v);
                     else maxneg = fmaxf(maxneg, v);
                   });
  minpos = combine_min(minpos);
  maxneg = combine_max(maxneg);

  // Similarity-S and -N over the mined sets; the shifts are known from minpos/maxneg.
  const float shift_p = ms_loss::positive_shift(minpos, maxneg, p);
  const float shift_n = ms_loss::negative_shift(minpos, maxneg, p);
  float sum_p = 0.f, sum_n = 0.f;
  for_each_pair<T>(smem, col_label, col_id, x, num_x, row0, ref, ref_labels, ref_ids, num_ref, dim, label_i, id_i,
                   [&](float v, bool positive) {
                     if (positive) {
                       if (ms_loss::mined_positive(v, maxneg, p))
                         sum_p += ms_loss::ms_exp(ms_loss::positive_exponent(v, p) - shift_p);
                     } else if (ms_loss::mined_negative(v, minpos, p)) {
                       sum_n += ms_loss::ms_exp(ms_loss::negative_exponent(v, p) - shift_n);
                     }
                   });
  sum_p = combine_sum(sum_p);
  sum_n = combine_sum(sum_n);
  if (row_ok && (threadIdx.x & 1) == 0) {
    const float lp = ms_loss::log1p_sum_exp(shift_p, sum_p), ln = ms_loss::log1p_sum_exp(shift_n, sum_n);
    loss[row] = ms_loss::anchor_loss(lp, ln, minpos, maxneg, p);
    stats[row] = minpos;
    stats[num_x + row] = maxneg;
    // +inf for an empty mined set (ms_math.h): a pair whose recomputed S crosses a threshold in the
    // backward would otherwise get exp(beta (S - base)) times its row's largest lift
    stats[2 * num_x + row] = ms_loss::saved_lp(lp, minpos, maxneg, p);
    stats[3 * num_x + row] = ms_loss::saved_ln(ln, minpos, maxneg, p);
  }
}

}  // namespace ms_loss_cuda_kernels
