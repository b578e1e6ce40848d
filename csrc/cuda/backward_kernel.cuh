// The backward kernel of the CUDA backend: block (I, d) recomputes S_IJ for every J, turns it into
// pair weights H_IJ and accumulates H_IJ @ b_J[:, d-block] in registers (WMMA fragments for
// float16/bfloat16, FMA for float32). Self case: H_IJ = G_IJ + G_JI^T from the statistics at both
// ends (no atomics, the same bits on every run); reference set: one launch for dx (anchors on the
// rows), one for dref (anchors on the columns).
// Included through ms_loss_kernels.cuh, after the CUDA types.
#pragma once

#include <cstdint>

#include "../ms_math.h"
#include "tiles.cuh"

namespace ms_loss_cuda_kernels {

using ms_loss::AnchorStats;
using ms_loss::Params;

// An anchor's saved statistics and gradient scale (0 when skip_incomplete_anchors drops it).
__device__ __forceinline__ void anchor_terms(const float* stats, const float* scale, int64_t num_anchors,
                                             int64_t i, const Params<float>& p, AnchorStats<float>& a,
                                             float& c) {
  a = {stats[i], stats[num_anchors + i], stats[2 * num_anchors + i], stats[3 * num_anchors + i]};
  c = ms_loss::anchor_counts(a.minpos, a.maxneg, p) ? scale[i] : 0.f;
}

// out[rows of a, d-block] = sum_J H_IJ @ b_J[:, d-block] * norm, with H_IJ = scale_i dL_i/dS_ij
// (kRowAnchors: the rows of a are anchors) + scale_j dL_j/dS_ji (kColAnchors: the rows of b are).
// Row r of H enters the product times row_scale[r] (a power of 2, see row_scales) and leaves it
// divided by it.
template <typename T, bool kRowAnchors, bool kColAnchors>
__global__ void __launch_bounds__(kThreads, 1)
backward_kernel(const T* __restrict__ a, const int64_t* __restrict__ a_labels, const int64_t* __restrict__ a_ids,
                int64_t num_a, const T* __restrict__ b, const int64_t* __restrict__ b_labels,
                const int64_t* __restrict__ b_ids, int64_t num_b, int64_t dim, const float* __restrict__ stats,
                const float* __restrict__ scale, const float* __restrict__ norm,
                const float* __restrict__ row_scale, int64_t num_anchors, Params<float> p, T* __restrict__ out) {
  using P = Plan<T>;
  alignas(128) __shared__ unsigned char smem[P::kBackwardBytes];
  __shared__ int64_t col_label[kCols], col_id[kCols];
  __shared__ AnchorStats<float> col_stats[kColAnchors ? kCols : 1];
  __shared__ float col_scale[kColAnchors ? kCols : 1];
  float* s = reinterpret_cast<float*>(smem + P::kS);
  T* tx = reinterpret_cast<T*>(smem + P::kX);
  const int64_t row0 = int64_t(blockIdx.x) * kRows, d0 = int64_t(blockIdx.y) * P::kBlockD;
  const int r = pair_row();
  const int64_t row = row0 + r;
  const bool row_ok = row < num_a;
  const int64_t label_i = row_ok ? a_labels[row] : 0, id_i = row_ok ? a_ids[row] : 0;
  AnchorStats<float> anchor{ms_loss::infinity<float>(), -ms_loss::infinity<float>(), 0.f, 0.f};
  float c_i = 0.f;
  if (kRowAnchors && row_ok) anchor_terms(stats, scale, num_anchors, row, p, anchor, c_i);
  const float lift = row_ok ? row_scale[row] : 1.f;

  const int warp = threadIdx.x / 32, wr = (warp / 2) * 32, wc = (warp % 2) * (P::D / 2);
  constexpr int kFragCols = P::D / 32;  // 16-wide accumulator fragments per warp, row band and slice
  constexpr int kAccSlices = P::kTensorCores ? P::kSlices : 1, kAccRows = P::kTensorCores ? 2 : 1;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kAccSlices][kAccRows][P::kTensorCores ? kFragCols : 1];
  float fma_acc[P::kTensorCores ? 1 : 8][P::kTensorCores ? 1 : 4] = {};
  if constexpr (P::kTensorCores) {
#pragma unroll
    for (int slice = 0; slice < P::kSlices; ++slice)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < kFragCols; ++j) wmma::fill_fragment(acc[slice][i][j], 0.0f);
  }

  for (int64_t col0 = 0; col0 < num_b; col0 += kCols) {
    __syncthreads();
    load_keys(col_label, col_id, b_labels, b_ids, col0, num_b);
    if (kColAnchors && threadIdx.x < kCols) {
      AnchorStats<float> st{ms_loss::infinity<float>(), -ms_loss::infinity<float>(), 0.f, 0.f};
      float c_j = 0.f;
      if (col0 + threadIdx.x < num_b) anchor_terms(stats, scale, num_anchors, col0 + threadIdx.x, p, st, c_j);
      col_stats[threadIdx.x] = st;
      col_scale[threadIdx.x] = c_j;
    }
    similarity_tile<T>(smem, a, num_a, row0, b, num_b, col0, dim);

    // Pair weights of this thread's pairs, from the anchor at either end: 16-bit into their own
    // tile over the a/b tiles (free once the similarity tile is done), float32 in place of S.
    T* th = reinterpret_cast<T*>(smem + P::kA);
#pragma unroll 4
    for (int m = 0; m < kPairsPerThread; ++m) {
      const int c = pair_col(m);
      const float v = s[r * P::kSPitch + c];
      const float positive = col_label[c] == label_i ? 1.f : 0.f;
      const float kept = col0 + c < num_b && col_id[c] != id_i ? 1.f : 0.f;
      float w = 0.f;
      if (kRowAnchors) w += c_i * ms_loss::pair_weight(v, positive, kept, anchor, p);
      if (kColAnchors) w += col_scale[c] * ms_loss::pair_weight(v, positive, kept, col_stats[c], p);
      w *= lift;
      if constexpr (P::kTensorCores) th[r * P::kHPitch + c] = from_float<T>(w);
      else s[r * P::kSPitch + c] = w;
    }
    if constexpr (P::kTensorCores) {
#pragma unroll
      for (int slice = 0; slice < P::kSlices; ++slice) {  // one tile of b's rows at a time
        if (slice > 0) __syncthreads();                    // everyone is done with the previous one
        load_tile<T, kCols, P::D>(tx, P::kXPitch, b, dim, col0, num_b, d0 + slice * P::D);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kCols; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fh[2];
#pragma unroll
          for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fh[i], th + (wr + 16 * i) * P::kHPitch + kk, P::kHPitch);
#pragma unroll
          for (int j = 0; j < kFragCols; ++j) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fx;
            wmma::load_matrix_sync(fx, tx + kk * P::kXPitch + wc + 16 * j, P::kXPitch);
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[slice][i][j], fh[i], fx, acc[slice][i][j]);
          }
        }
      }
    } else {
      load_tile<T, kCols, P::D>(tx, P::kXPitch, b, dim, col0, num_b, d0);
      __syncthreads();
      const int tr = threadIdx.x / 16, tc = threadIdx.x % 16;
#pragma unroll 4
      for (int n = 0; n < kCols; ++n) {
        const float4 xv = *reinterpret_cast<const float4*>(tx + n * P::kXPitch + 4 * tc);
        const float xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float hv = s[(8 * tr + i) * P::kSPitch + n];
#pragma unroll
          for (int j = 0; j < 4; ++j) fma_acc[i][j] = fmaf(hv, xw[j], fma_acc[i][j]);
        }
      }
    }
  }

  // Epilogue: undo the weights' scaling (norm, and each row's lift), convert, store the rows and
  // columns that exist.
  const float scale_back = *norm;
  if constexpr (P::kTensorCores) {
    float* stage = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int slice = 0; slice < P::kSlices; ++slice) {
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < kFragCols; ++j) {
          wmma::store_matrix_sync(stage + (wr + 16 * i) * P::kStagePitch + wc + 16 * j, acc[slice][i][j],
                                  P::kStagePitch, wmma::mem_row_major);
        }
      __syncthreads();
      const int64_t c0 = d0 + slice * P::D;
      for (int e = threadIdx.x; e < kRows * P::D; e += kThreads) {
        const int rr = e / P::D, cc = e % P::D;
        if (row0 + rr < num_a && c0 + cc < dim)
          out[(row0 + rr) * dim + c0 + cc] =
              from_float<T>(stage[rr * P::kStagePitch + cc] * (scale_back / row_scale[row0 + rr]));
      }
    }
  } else {
    const int tr = threadIdx.x / 16, tc = threadIdx.x % 16;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t orow = row0 + 8 * tr + i, ocol = d0 + 4 * tc;
      if (orow < num_a && ocol < dim) {  // dim is a multiple of 4: the vector is all in or all out
        const float back = scale_back / row_scale[orow];
        *reinterpret_cast<float4*>(out + orow * dim + ocol) =
            make_float4(fma_acc[i][0] * back, fma_acc[i][1] * back, fma_acc[i][2] * back, fma_acc[i][3] * back);
      }
    }
  }
}

}  // namespace ms_loss_cuda_kernels
