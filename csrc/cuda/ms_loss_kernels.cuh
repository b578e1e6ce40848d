// Kernels and host logic of the CUDA backend (the function of ms_loss_cuda/reference.py), no B x R
// buffer ever allocated.
//
// One block of 128 threads owns 64 anchor rows and walks over the reference rows 64 at a time:
// - forward_kernel: similarity tile -> minpos/maxneg over all tiles, then the tiles again ->
//   mined sets -> both log(1 + sum exp) sums (shifted by the hardest pair's exponent) -> loss and
//   the [4, B] statistics (minpos, maxneg, LP, LN), the same as the CPU op saves;
// - backward_kernel: block (I, d) recomputes S_IJ for every J, turns it into pair weights H_IJ and
//   accumulates H_IJ @ b_J[:, d-block] in registers. Self case: H_IJ = G_IJ + G_JI^T from the
//   statistics at both ends (no atomics, the same bits on every run); reference set: one launch for
//   dx (anchors on the rows), one for dref (anchors on the columns).
// What happens to one pair (mining tests, log-sum-exp, pair weights) is csrc/ms_math.h, which the
// CPU kernel uses too; this file only maps pairs to threads. float16/bfloat16 tiles go through
// tensor cores (WMMA 16x16x16, float32 accumulation); float32 tiles use IEEE FMA; every exponent
// and sum is float32.
//
// Two files include this header: ms_loss_cuda.cu (nvcc: real launches, the CUDA dispatch key) and
// tests/cuda_emulation/emulated_ms_loss.cpp (a host compiler: every block's 128 threads run as CPU
// threads, to test the thread mapping without a GPU). Each includes the CUDA types first
// (cuda_fp16.h, cuda_bf16.h, mma.h, or the emulation's stand-ins) and defines `launch` (see below).
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#include "../ms_inputs.h"
#include "../ms_math.h"

namespace ms_loss_cuda_kernels {

using ms_loss::AnchorStats;
using ms_loss::Params;
namespace wmma = nvcuda::wmma;

constexpr int kRows = 64;       // anchor rows per block
constexpr int kCols = 64;       // reference rows per tile
constexpr int kThreads = 128;   // 4 warps
constexpr int kRowAlign = 32;   // rows are zero-padded to a multiple of this many elements

// Shared-memory plan per input type (WMMA needs 32-byte aligned tile pointers: every offset and
// 16-row step below is a multiple of 32 bytes). Tensor cores (16-bit): a/b tiles [64][K + pad]
// row-major, which the 16-bit pair weights [64][64 + pad] reuse once a similarity tile is done;
// float32 FMA: a/b tiles transposed, [K][64 + pad], and the weights overwrite the similarities.
// Then the float similarity tile, the tile of b's rows for the gradient product, and (16-bit) a
// float staging area for the output that reuses everything after the last tile.
template <typename T>
struct Plan {
  static constexpr bool kTensorCores = !std::is_same<T, float>::value;
  static constexpr int K = kTensorCores ? 32 : 16;    // depth of one similarity step
  static constexpr int D = kTensorCores ? 128 : 64;   // columns of one tile of b's rows (the gradient product)
  // Such tiles per block, whose D columns split over grid y (S is recomputed per split): two for
  // float16 (128 accumulator registers a thread); bfloat16 keeps one, as two spill a few bytes.
  static constexpr int kSlices = std::is_same<T, __half>::value ? 2 : 1;
  static constexpr int kBlockD = kSlices * D;
  static constexpr int kPad = 16 / int(sizeof(T));    // 16 bytes: aligned rows, fewer bank conflicts
  static constexpr int kTileElems = kTensorCores ? kRows * (K + kPad) : K * (kRows + kPad);
  static constexpr int kSPitch = kCols + 4;           // floats
  static constexpr int kHPitch = kCols + kPad;        // 16-bit weights (tensor cores only), over a and b
  static constexpr int kXPitch = D + kPad;
  static constexpr int kStagePitch = D + 4;
  static constexpr int kA = 0;
  static constexpr int kB = kA + kTileElems * int(sizeof(T));
  static constexpr int kS = kB + kTileElems * int(sizeof(T));
  static constexpr int kX = kS + kRows * kSPitch * 4;
  static constexpr int kForwardBytes = kX;
  static constexpr int kEnd = kX + kCols * kXPitch * int(sizeof(T));
  static constexpr int kStageBytes = kTensorCores ? kRows * kStagePitch * 4 : 0;
  static constexpr int kBackwardBytes = kEnd > kStageBytes ? kEnd : kStageBytes;
  static_assert(kB % 32 == 0 && kS % 32 == 0 && kX % 32 == 0, "tiles must start 32-byte aligned");
  static_assert(!kTensorCores || kRows * kHPitch * int(sizeof(T)) <= kS, "the weights must fit over a and b");
  static_assert(kBackwardBytes + kCols * 40 <= 48 * 1024, "static shared memory is limited to 48 KiB");
};

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// rows [row0, row0 + R) x columns [col0, col0 + W) of a row-major [rows, ld] matrix into shared
// memory, 16-byte vectors, zeros outside the matrix. ld is a multiple of kRowAlign.
template <typename T, int R, int W>
__device__ __forceinline__ void load_tile(T* dst, int pitch, const T* src, int64_t ld, int64_t row0,
                                          int64_t rows, int64_t col0) {
  constexpr int V = 16 / int(sizeof(T));
  constexpr int kPerRow = W / V;
  for (int v = threadIdx.x; v < R * kPerRow; v += kThreads) {
    const int r = v / kPerRow, c = (v % kPerRow) * V;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (row0 + r < rows && col0 + c < ld) value = *reinterpret_cast<const uint4*>(src + (row0 + r) * ld + col0 + c);
    *reinterpret_cast<uint4*>(dst + r * pitch + c) = value;
  }
}

// The same for float32, stored transposed ([W][R + pad]) so the FMA loop reads both operands as
// contiguous vectors.
template <int R, int W>
__device__ __forceinline__ void load_tile_transposed(float* dst, const float* src, int64_t ld, int64_t row0,
                                                     int64_t rows, int64_t col0) {
  constexpr int kPerRow = W / 4;
  for (int v = threadIdx.x; v < R * kPerRow; v += kThreads) {
    const int r = v / kPerRow, c = (v % kPerRow) * 4;
    float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row0 + r < rows && col0 + c < ld) value = *reinterpret_cast<const float4*>(src + (row0 + r) * ld + col0 + c);
    dst[(c + 0) * (R + 4) + r] = value.x;
    dst[(c + 1) * (R + 4) + r] = value.y;
    dst[(c + 2) * (R + 4) + r] = value.z;
    dst[(c + 3) * (R + 4) + r] = value.w;
  }
}

// S[r][c] = <a[row0 + r], b[col0 + c]> in float, into the shared tile at Plan::kS. The caller has
// synchronised (nobody still reads the previous tile); returns synchronised.
template <typename T>
__device__ __forceinline__ void similarity_tile(unsigned char* smem, const T* a, int64_t num_a, int64_t row0,
                                                const T* b, int64_t num_b, int64_t col0, int64_t dim) {
  using P = Plan<T>;
  T* ta = reinterpret_cast<T*>(smem + P::kA);
  T* tb = reinterpret_cast<T*>(smem + P::kB);
  float* s = reinterpret_cast<float*>(smem + P::kS);
  if constexpr (P::kTensorCores) {
    const int warp = threadIdx.x / 32, wr = (warp / 2) * 32, wc = (warp % 2) * 32;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    for (int64_t k0 = 0; k0 < dim; k0 += P::K) {
      load_tile<T, kRows, P::K>(ta, P::K + P::kPad, a, dim, row0, num_a, k0);
      load_tile<T, kCols, P::K>(tb, P::K + P::kPad, b, dim, col0, num_b, k0);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < P::K; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[2];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb[2];  // b rows = columns of b^T
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          wmma::load_matrix_sync(fa[i], ta + (wr + 16 * i) * (P::K + P::kPad) + kk, P::K + P::kPad);
          wmma::load_matrix_sync(fb[i], tb + (wc + 16 * i) * (P::K + P::kPad) + kk, P::K + P::kPad);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(s + (wr + 16 * i) * P::kSPitch + wc + 16 * j, acc[i][j], P::kSPitch,
                                wmma::mem_row_major);
  } else {
    const int tr = threadIdx.x / 16, tc = threadIdx.x % 16;  // rows 8 tr .. 8 tr + 7, columns 4 tc .. 4 tc + 3
    float acc[8][4] = {};
    for (int64_t k0 = 0; k0 < dim; k0 += P::K) {
      load_tile_transposed<kRows, P::K>(ta, a, dim, row0, num_a, k0);
      load_tile_transposed<kCols, P::K>(tb, b, dim, col0, num_b, k0);
      __syncthreads();
#pragma unroll
      for (int k = 0; k < P::K; ++k) {
        const float4 a0 = *reinterpret_cast<const float4*>(ta + k * (kRows + 4) + 8 * tr);
        const float4 a1 = *reinterpret_cast<const float4*>(ta + k * (kRows + 4) + 8 * tr + 4);
        const float4 bv = *reinterpret_cast<const float4*>(tb + k * (kCols + 4) + 4 * tc);
        const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        const float bw[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bw[j], acc[i][j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
      *reinterpret_cast<float4*>(s + (8 * tr + i) * P::kSPitch + 4 * tc) =
          make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
  }
  __syncthreads();
}

// Thread layout of the per-pair work on a tile: thread t takes row t / 2 and every other column.
__device__ __forceinline__ int pair_row() { return threadIdx.x >> 1; }
__device__ __forceinline__ int pair_col(int m) { return 2 * m + (threadIdx.x & 1); }
constexpr int kPairsPerThread = kCols / 2;

__device__ __forceinline__ float combine_min(float v) { return fminf(v, __shfl_xor_sync(0xffffffffu, v, 1)); }
__device__ __forceinline__ float combine_max(float v) { return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1)); }
__device__ __forceinline__ float combine_sum(float v) { return v + __shfl_xor_sync(0xffffffffu, v, 1); }

__device__ __forceinline__ void load_keys(int64_t* col_label, int64_t* col_id, const int64_t* labels,
                                          const int64_t* ids, int64_t col0, int64_t num) {
  const int c = threadIdx.x;
  if (c < kCols) {
    col_label[c] = col0 + c < num ? labels[col0 + c] : 0;
    col_id[c] = col0 + c < num ? ids[col0 + c] : 0;
  }
}

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
    stats[2 * num_x + row] = lp;
    stats[3 * num_x + row] = ln;
  }
}

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

// Runs kernel<<<grid, kThreads>>>(args...) and checks the launch; defined by the includer.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, Args... args);

// ---- host side ------------------------------------------------------------------------------
struct Operands {
  at::Tensor a, a_labels, a_ids, b, b_labels, b_ids;  // aligned rows of one dtype, int64 keys
  bool self_case;
};

// `t` in `dtype`, contiguous, rows zero-padded to a multiple of kRowAlign elements, and starting on
// a 16-byte boundary (a view into a larger tensor may not): what the vector loads need.
at::Tensor aligned_rows(const at::Tensor& t, at::ScalarType dtype) {
  const at::Tensor converted = t.to(dtype);
  const int64_t pad = (kRowAlign - t.size(1) % kRowAlign) % kRowAlign;
  if (pad) return at::constant_pad_nd(converted, {0, pad});
  const at::Tensor rows = converted.contiguous();
  return reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0 ? rows : rows.clone();
}

Operands prepare(const at::Tensor& x, const at::Tensor& labels, const std::optional<at::Tensor>& ids,
                 const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& ref_labels,
                 const std::optional<at::Tensor>& ref_ids) {
  const ms_loss::Keys keys = ms_loss::checked_keys("ms_loss (CUDA)", x, labels, ids, ref, ref_labels, ref_ids);
  const at::ScalarType dtype = ref.has_value() ? at::promote_types(x.scalar_type(), ref->scalar_type()) : x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "ms_loss (CUDA): embeddings must be float32, float16 or bfloat16, got ", dtype,
              " (use the cpu backend for float64)");
  Operands in;
  in.self_case = !ref.has_value();
  in.a = aligned_rows(x, dtype);
  in.b = in.self_case ? in.a : aligned_rows(*ref, dtype);
  in.a_labels = keys.labels;
  in.a_ids = keys.ids;
  in.b_labels = keys.ref_labels;
  in.b_ids = keys.ref_ids;
  return in;
}

Params<float> make_params(double alpha, double beta, double base, double epsilon, bool mining, bool skip) {
  return {float(alpha), float(beta), float(base), float(epsilon), mining, skip};
}

// Calls f(T{}) with T the CUDA type of `dtype` (float, __half or __nv_bfloat16).
template <typename F>
void dispatch_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, "ms_loss (CUDA): unsupported dtype ", dtype);
  }
}

template <typename T>
const T* rows_ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }

std::tuple<at::Tensor, at::Tensor> forward(
    const at::Tensor& x, const at::Tensor& labels, const std::optional<at::Tensor>& ids,
    const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& ref_labels,
    const std::optional<at::Tensor>& ref_ids, double alpha, double beta, double base, double epsilon, bool mining,
    bool skip_incomplete_anchors) {
  const Operands in = prepare(x, labels, ids, ref, ref_labels, ref_ids);
  const int64_t B = in.a.size(0), R = in.b.size(0), dim = in.a.size(1);
  at::Tensor loss = at::zeros({B}, in.a.options().dtype(at::kFloat));
  at::Tensor stats = at::empty({4, B}, loss.options());
  if (B == 0) return {loss, stats};
  const Params<float> p = make_params(alpha, beta, base, epsilon, mining, skip_incomplete_anchors);
  dispatch_dtype(in.a.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    launch(forward_kernel<T>, dim3(unsigned((B + kRows - 1) / kRows)),
        rows_ptr<T>(in.a), in.a_labels.data_ptr<int64_t>(), in.a_ids.data_ptr<int64_t>(), B, rows_ptr<T>(in.b),
        in.b_labels.data_ptr<int64_t>(), in.b_ids.data_ptr<int64_t>(), R, dim, p, loss.data_ptr<float>(),
        stats.data_ptr<float>());
  });
  return {loss, stats};
}

template <typename T, bool kRowAnchors, bool kColAnchors>
void launch_backward(const at::Tensor& a, const at::Tensor& a_labels, const at::Tensor& a_ids, const at::Tensor& b,
                     const at::Tensor& b_labels, const at::Tensor& b_ids, const at::Tensor& stats,
                     const at::Tensor& scale, const at::Tensor& norm, const at::Tensor& row_scale,
                     const Params<float>& p, at::Tensor& out) {
  const int64_t rows = a.size(0), dim = a.size(1);
  const dim3 grid(unsigned((rows + kRows - 1) / kRows), unsigned((dim + Plan<T>::kBlockD - 1) / Plan<T>::kBlockD));
  if (grid.x == 0 || grid.y == 0) return;
  launch(backward_kernel<T, kRowAnchors, kColAnchors>, grid,
      rows_ptr<T>(a), a_labels.data_ptr<int64_t>(), a_ids.data_ptr<int64_t>(), rows, rows_ptr<T>(b),
      b_labels.data_ptr<int64_t>(), b_ids.data_ptr<int64_t>(), b.size(0), dim, stats.data_ptr<float>(),
      scale.data_ptr<float>(), norm.data_ptr<float>(), row_scale.data_ptr<float>(), stats.size(1), p,
      reinterpret_cast<T*>(out.data_ptr()));
}

// [B] powers of 2 >= 1 per anchor: scale_i * (the largest pair weight anchor i has, bounded from its
// stats for each non-empty mined set) times the factor lies in (1/2, 1]. A large reference set
// without mining has pair weights of about 1/R, subnormal in float16 beyond R = 16k, and a small
// grad_output shrinks them further: the factor lifts each row back into full precision. In the log
// domain (no overflow, no NaN); an anchor without weights gets 2^64. A row that also holds the
// weights of column anchors (each <= 1) is lifted at most kLiftWithColumnAnchors, far below 65504.
// (The same rule as _scales_kernel in triton_kernels/ms_loss.py.)
constexpr double kLiftWithColumnAnchors = 16384.0;
inline at::Tensor row_scales(const at::Tensor& stats, const at::Tensor& scale, const Params<float>& p) {
  const at::Tensor minpos = stats[0], maxneg = stats[1];
  at::Tensor has_positive = minpos < std::numeric_limits<float>::infinity();
  at::Tensor has_negative = maxneg > -std::numeric_limits<float>::infinity();
  if (p.mining) {
    const at::Tensor mined_p = has_positive & (minpos - p.epsilon < maxneg);
    has_negative = has_negative & (maxneg + p.epsilon > minpos);
    has_positive = mined_p;
  }
  const double none = -std::numeric_limits<double>::infinity();
  const at::Tensor largest = at::maximum(at::where(has_positive, -p.alpha * (minpos - p.base) - stats[2], none),
                                         at::where(has_negative, p.beta * (maxneg - p.base) - stats[3], none));
  const at::Tensor counts = p.skip_incomplete_anchors ? has_positive & has_negative : at::ones_like(has_positive);
  const at::Tensor log2_bound = at::log2(at::where(counts, scale.abs(), 0.0)) + largest / std::log(2.0);
  return at::exp2(at::nan_to_num(at::floor(-log2_bound), 64.0, 64.0, 0.0).clamp(0, 64)).contiguous();
}

std::tuple<at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_loss, const at::Tensor& stats, const at::Tensor& x, const at::Tensor& labels,
    const std::optional<at::Tensor>& ids, const std::optional<at::Tensor>& ref,
    const std::optional<at::Tensor>& ref_labels, const std::optional<at::Tensor>& ref_ids, double alpha, double beta,
    double base, double epsilon, bool mining, bool skip_incomplete_anchors, bool ref_grad) {
  const Operands in = prepare(x, labels, ids, ref, ref_labels, ref_ids);
  const int64_t B = in.a.size(0);
  const bool want_ref = !in.self_case && ref_grad;  // a memory bank takes no gradient: no dref launch
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == B && stats.dim() == 2 && stats.size(0) == 4 &&
                  stats.size(1) == B,
              "ms_loss_backward (CUDA): expected grad_loss [B] and stats [4, B] with B = ", B);
  const at::Tensor st = stats.to(at::kFloat).contiguous();
  // The pair weights enter the second product in the input dtype: scale them to |.| <= 1 so that
  // float16 keeps its precision (grad / B under "mean" would be subnormal); the kernel scales back.
  const at::Tensor grad = grad_loss.to(at::kFloat).contiguous();
  const at::Tensor norm = B > 0 ? grad.abs().amax().clamp_min(1e-30).reshape({1}) : at::ones({1}, grad.options());
  const at::Tensor scale = grad / norm;
  const Params<float> p = make_params(alpha, beta, base, epsilon, mining, skip_incomplete_anchors);
  // Each anchor row's lift; a reference set's rows hold every anchor's weights: the smallest one.
  const at::Tensor lift = row_scales(st, scale, p);
  const at::Tensor ref_lift = !want_ref ? lift
                              : B > 0   ? lift.amin().clamp_max(kLiftWithColumnAnchors).expand({in.b.size(0)}).contiguous()
                                        : at::ones({in.b.size(0)}, lift.options());
  at::Tensor grad_a = at::empty_like(in.a);
  at::Tensor grad_b = want_ref ? at::empty_like(in.b) : at::empty({0}, x.options());
  dispatch_dtype(in.a.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if (in.self_case) {  // row block I builds G_IJ + G_JI^T itself
      launch_backward<T, true, true>(in.a, in.a_labels, in.a_ids, in.a, in.a_labels, in.a_ids, st, scale, norm,
                                     lift.clamp_max(kLiftWithColumnAnchors), p, grad_a);
    } else {
      launch_backward<T, true, false>(in.a, in.a_labels, in.a_ids, in.b, in.b_labels, in.b_ids, st, scale, norm,
                                      lift, p, grad_a);
      if (want_ref)
        launch_backward<T, false, true>(in.b, in.b_labels, in.b_ids, in.a, in.a_labels, in.a_ids, st, scale, norm,
                                        ref_lift, p, grad_b);
    }
  });
  // back to the inputs' widths and dtypes (mixed dtypes ran promoted)
  at::Tensor grad_x = grad_a.narrow(1, 0, x.size(1)).to(x.scalar_type()).contiguous();
  if (!want_ref) return {grad_x, grad_b};
  return {grad_x, grad_b.narrow(1, 0, ref->size(1)).to(ref->scalar_type()).contiguous()};
}

}  // namespace ms_loss_cuda_kernels
