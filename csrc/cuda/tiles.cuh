// The tiles that both CUDA kernels share: the block's shape, the shared-memory plan per input type,
// the loads of embedding tiles into shared memory, one similarity tile S_IJ = a_I b_J^T (tensor
// cores for float16/bfloat16, IEEE FMA for float32), and how a block's threads split a tile's pairs.
// Included through ms_loss_kernels.cuh, after the CUDA types.
#pragma once

#include <cstdint>
#include <type_traits>

namespace ms_loss_cuda_kernels {

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

// The labels and identities of the tile's columns [col0, col0 + kCols) into shared memory (0 past
// the end).
__device__ __forceinline__ void load_keys(int64_t* col_label, int64_t* col_id, const int64_t* labels,
                                          const int64_t* ids, int64_t col0, int64_t num) {
  const int c = threadIdx.x;
  if (c < kCols) {
    col_label[c] = col0 + c < num ? labels[col0 + c] : 0;
    col_id[c] = col0 + c < num ? ids[col0 + c] : 0;
  }
}

}  // namespace ms_loss_cuda_kernels
