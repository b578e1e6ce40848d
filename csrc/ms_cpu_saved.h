// The pair weights the fused CPU forward keeps for its backward: their layout in the op's `stats`
// output, the memory budget that picks the layout, and the buffer that holds them.
//
// stats = [4 + extra, B]: the per-anchor statistics (minpos, maxneg, LP, LN), then, flattened, the
// payload: one header element (the SavedMode) and the weights G_ij = dL_i/dS_ij (before
// grad_output), within MS_LOSS_CPU_SAVED_MB (default 256 MiB, read at every call):
// - dense, when they fit: G [B, R] with a reference set; in the self case K = G + G^T, its strictly
//   upper triangle (Triangle: about half of B x B);
// - sparse, when they do not but the budget holds at least 1 pair in kSparseDensityInverse:
//   offsets [B + 1], columns [capacity], weights [capacity] (CSR, indices stored as integers of the
//   element's width); a forward whose mined pairs do not fit marks it kOverflow;
// - none (kRecompute, extra = 0): the backward recomputes the similarities.
// saved_layout states this rule once: the op sizes stats by it, and the fake kernel's shape comes
// from it too (ms_loss_cuda/ops.py's cpu_saved_rows calls it through ms_loss_cuda._C).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace ms_loss::cpu {

// The payload's header: which layout, and whether a sparse forward overflowed. kSymmetric: the self
// case's K; kSymmetricGathers: the same with under 1 pair in kSparseDensityInverse non-zero (the
// backward gathers).
enum class SavedMode : int64_t { kRecompute = 0, kDense = 1, kSparse = 2, kOverflow = 3, kSymmetric = 4, kSymmetricGathers = 5 };

// Below 1 non-zero in kSparseDensityInverse, products that gather over the non-zeros (nnz * D) beat
// dense GEMMs; above it, a sparse payload would cost more than recomputing.
constexpr int64_t kSparseDensityInverse = 16;

constexpr int64_t kBlock = 256;  // rows in a strip of the self case's triangle (half up to B = 2048)

// The self case's strictly upper triangle (K, and S before it), stored strip by strip: strip t,
// rows [i0, i0 + h) with i0 = t h, is a row-major [rows, B - i0] block of the columns from i0 on
// (its diagonal block's lower half and diagonal held as zeros). Element (i, c), c >= i0, is at
// row_start(i) + c. About half of B x B. The strip height h is 128 up to B = 2048 (the products of
// a smaller batch run faster in thinner strips), else 256.
struct Triangle {
  int64_t B;
  int64_t h = B <= 2048 ? kBlock / 2 : kBlock;
  int64_t strips() const { return (B + h - 1) / h; }
  int64_t strip_start(int64_t t) const { return t * h * B - h * h * t * (t - 1) / 2; }
  int64_t strip_first(int64_t t) const { return t * h; }
  int64_t strip_rows(int64_t t) const { return std::min(h, B - t * h); }
  int64_t size() const { return B == 0 ? 0 : strip_start(strips() - 1) + strip_rows(strips() - 1) * (B - strip_first(strips() - 1)); }
  int64_t row_start(int64_t i) const {
    const int64_t t = i / h, i0 = t * h;
    return strip_start(t) + (i - i0) * (B - i0) - i0;
  }
};

struct SavedLayout {  // (a sparse payload's capacity follows from its size: sparse_capacity)
  SavedMode mode;     // kRecompute, kDense (the self case: its triangle) or kSparse
  int64_t extra_rows;
};

// The layout of a forward over B anchors and R reference rows of elem_size bytes, under the budget
// that MS_LOSS_CPU_SAVED_MB sets now.
SavedLayout saved_layout(int64_t B, int64_t R, int64_t elem_size, bool self_case);

// Entries of a sparse payload of `numel` elements: offsets [B + 1], then columns and weights.
int64_t sparse_capacity(int64_t numel, int64_t B, int64_t elem_size);

struct Saved {  // views of the payload
  SavedMode mode;
  at::Tensor dense;                      // [B, R]; the self case: its Triangle, flat
  at::Tensor offsets, columns, weights;  // CSR
};

// The payload of stats [4 + extra, B] (extra > 0), flat: its header element, then the weights.
at::Tensor saved_payload(const at::Tensor& stats, int64_t B);

// Views of a payload laid out as `mode` (kDense here means G [B, R], kSymmetric its triangle).
Saved payload_views(const at::Tensor& payload, SavedMode mode, int64_t B, int64_t R);

// Views of what a forward saved in stats, by the payload's header.
Saved saved_views(const at::Tensor& stats, int64_t B, int64_t R);

// An uninitialised tensor for stats and its payload: in transparent huge pages, or the last such
// buffer freed when it fits (ms_cpu_saved.cpp).
at::Tensor large_empty(at::IntArrayRef shape, const at::TensorOptions& options);

}  // namespace ms_loss::cpu
