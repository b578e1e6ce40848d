// Fused CPU kernel of the Multi-Similarity loss (forward and backward ops, CPU dispatch key).
//
// The B x R similarity matrix is never held beyond a memory budget (MS_LOSS_CPU_SAVED_MB, default
// 256 MiB). The forward keeps the pair weights G_ij = dL_i/dS_ij (before grad_output g) for the
// backward, after the per-anchor statistics (minpos, maxneg, LP, LN), in one self-describing
// buffer: the op's `stats` output [4 + extra, B].
// - dense, with a reference set, when B * R weights fit the budget: S is computed whole; each row
//   is mined and reduced and its weights overwrite S in place. The backward never recomputes S:
//   dx = diag(g) G r, dref = G^T diag(g) x, as BLAS products, or as gathers over the non-zeros
//   when mining kept fewer than 1 pair in 16.
// - dense, in the self case, when S's strictly upper triangle fits: it holds K = G + G^T, and the
//   backward is g K x (see symmetric_forward).
// - sparse, when they do not fit but at least 1 pair in 16 does (CSR: offsets, columns, weights),
//   and mining keeps fewer than that (else the gathers would cost more than recomputing):
//   S goes in row chunks of 64 MiB as below, each chunk's mined pairs are compacted; the backward
//   is gathers (nnz * D).
// - recompute (beyond that, or when a sparse forward overflows its capacity): rows in chunks of
//   64 MiB, one GEMM per chunk; the backward recomputes each chunk, builds (G + G^T) row by row from
//   the statistics of both ends, and does the product.
// Rows are reduced by vectorised loops (at::parallel_for over rows), every reduction has a fixed
// order, chunks run one after another: results are bitwise repeatable.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ms_inputs.h"
#include "ms_math.h"

namespace {

using ms_loss::AnchorStats;
using ms_loss::Params;

// Memory budget for one chunk of the similarity matrix (at least one row is always processed).
constexpr int64_t kChunkBytes = int64_t(64) << 20;

// Build the hot row loops for AVX-512, AVX2 and plain x86-64; the loader picks one per machine.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MS_NO_CLONES)
#define MS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MS_CPU_CLONES
#endif

// The reference set of one call: its labels and identities (the self case uses row indices as
// identities, a reference set without identities gets identities that match nothing in x).
struct RefKeys {
  const int64_t* labels;
  const int64_t* ids;
  int64_t size;
};

// The row loops below compare labels and identities into 0/1 values of T and select on float
// compares only, and take `mining` as a compile-time constant: GCC then vectorises them fully
// (a bool select on a run-time flag, or && between masks, keeps them scalar). Row reductions keep
// kLanes partial results, combined in a fixed order: they vectorise without fast-math (omp simd
// min/max reductions miscompile in GCC 12 target clones) and give the same bits on every ISA.
constexpr int64_t kLanes = 16;

// Forced inlining: a call left inside a row loop (helpers, the lambdas below) keeps it scalar.
#if defined(__GNUC__)
#define MS_INLINE __attribute__((always_inline))
#else
#define MS_INLINE
#endif

// Calls step(j, lane) for j in [0, n), lane = j % kLanes, as a vectorisable inner loop over lanes.
template <typename Step>
MS_INLINE inline void for_each_lane(int64_t n, Step&& step) {
  const int64_t full = n - n % kLanes;
  for (int64_t j = 0; j < full; j += kLanes) {
#pragma omp simd  // the lanes are independent: step(j, lane) touches element j and lane `lane` only
    for (int64_t lane = 0; lane < kLanes; ++lane) step(j + lane, lane);
  }
  for (int64_t j = full; j < n; ++j) step(j, j - full);
}

template <typename T, typename Combine>
MS_INLINE inline T combine_lanes(const T* lanes, Combine combine) {
  T total = lanes[0];
  for (int64_t lane = 1; lane < kLanes; ++lane) total = combine(total, lanes[lane]);
  return total;
}

// 1 when the pair (S_ij = v) is in the anchor's mined set (P_i for a positive, N_i for a negative),
// else 0; and its exponent, less the anchor's shift. Both arms of every selection are computed
// before it: branch-free, so the loops around them vectorise (a ternary with a product or an
// exponential in an arm is a branch to GCC, and keeps the whole loop scalar).
template <typename T>
MS_INLINE inline T in_mined_set(T v, T positive, T kept, T minpos, T maxneg, const Params<T>& p) {
  const T in_p = ms_loss::mined_positive(v, maxneg, p) ? kept : T(0);
  const T in_n = ms_loss::mined_negative(v, minpos, p) ? kept : T(0);
  return positive != T(0) ? in_p : in_n;
}
template <typename T>
MS_INLINE inline T shifted_exponent(T v, T positive, T shift_p, T shift_n, const Params<T>& p) {
  const T a_p = ms_loss::positive_exponent(v, p) - shift_p, a_n = ms_loss::negative_exponent(v, p) - shift_n;
  return positive != T(0) ? a_p : a_n;
}
// Largest pair exponent for which the self case's passes 2 and 3 share one unshifted exponential
// (see symmetric_forward): exp(60) * B stays finite in float32 for any B below 10^12, and exp(-L)
// normal for L up to 87.
constexpr double kSharedExponentLimit = 60;

// That exponential. Every mined pair's exponent is at most the limit; the clamp keeps the pairs of
// equal identity, which are never weighted, finite too (0 * inf would be NaN).
template <typename T>
MS_INLINE inline T shared_exp(T v, T positive, const Params<T>& p) {
  return ms_loss::ms_exp(std::min(shifted_exponent(v, positive, T(0), T(0), p), T(kSharedExponentLimit)));
}

// exp(exponent - shift) of a pair in the anchor's mined set, else 0.
template <typename T>
MS_INLINE inline T mined_exp(T v, T positive, T kept, T minpos, T maxneg, T shift_p, T shift_n,
                             const Params<T>& p) {
  const T e = ms_loss::ms_exp(shifted_exponent(v, positive, shift_p, shift_n, p));
  return in_mined_set(v, positive, kept, minpos, maxneg, p) != T(0) ? e : T(0);
}

// Forward for one anchor row s[0..R): mining, then both log(1 + sum exp) terms. With kStore the row
// is overwritten with its pair weights dL_i/dS_ij (0 outside the mined sets), from the same
// exponentials: w = exp(a - shift) * exp(shift - l).
template <typename T, bool kMining, bool kStore>
MS_CPU_CLONES void forward_row(T* s, int64_t label, int64_t id, RefKeys ref, Params<T> p,
                               T* stats /* [4, B] column: minpos, maxneg, lp, ln */, int64_t stride,
                               T* loss) {
  p.mining = kMining;
  const T inf = ms_loss::infinity<T>();
  T lane_a[kLanes], lane_b[kLanes];
  for (int64_t lane = 0; lane < kLanes; ++lane) lane_a[lane] = inf, lane_b[lane] = -inf;
  for_each_lane(ref.size, [&](int64_t j, int64_t lane) MS_INLINE {
    const T positive = ref.labels[j] == label ? T(1) : T(0), kept = ref.ids[j] != id ? T(1) : T(0);
    const T v = s[j];
    lane_a[lane] = positive * kept != T(0) && v < lane_a[lane] ? v : lane_a[lane];
    lane_b[lane] = (T(1) - positive) * kept != T(0) && v > lane_b[lane] ? v : lane_b[lane];
  });
  const T minpos = combine_lanes(lane_a, [](T a, T b) { return std::min(a, b); });
  const T maxneg = combine_lanes(lane_b, [](T a, T b) { return std::max(a, b); });

  const T shift_p = ms_loss::positive_shift(minpos, maxneg, p);
  const T shift_n = ms_loss::negative_shift(minpos, maxneg, p);
  for (int64_t lane = 0; lane < kLanes; ++lane) lane_a[lane] = 0, lane_b[lane] = 0;
  for_each_lane(ref.size, [&](int64_t j, int64_t lane) MS_INLINE {
    const T positive = ref.labels[j] == label ? T(1) : T(0), kept = ref.ids[j] != id ? T(1) : T(0);
    const T e = mined_exp(s[j], positive, kept, minpos, maxneg, shift_p, shift_n, p);
    lane_a[lane] += positive != T(0) ? e : T(0);
    lane_b[lane] += positive != T(0) ? T(0) : e;
    if constexpr (kStore) s[j] = positive != T(0) ? -e : e;
  });
  const auto add = [](T a, T b) { return a + b; };
  const T lp = ms_loss::log1p_sum_exp(shift_p, combine_lanes(lane_a, add));
  const T ln = ms_loss::log1p_sum_exp(shift_n, combine_lanes(lane_b, add));
  if constexpr (kStore) {
    const T to_p = ms_loss::ms_exp(shift_p - lp), to_n = ms_loss::ms_exp(shift_n - ln);
#pragma omp simd
    for (int64_t j = 0; j < ref.size; ++j) s[j] *= s[j] < T(0) ? to_p : to_n;
  }
  stats[0] = minpos;
  stats[stride] = maxneg;
  stats[2 * stride] = lp;
  stats[3 * stride] = ln;
  *loss = ms_loss::anchor_loss(lp, ln, minpos, maxneg, p);
}

// The two reduction passes of the symmetric forward (see symmetric_forward) over one row of the
// strictly upper triangle: s[j] = S_i,c for the columns c = i + 1 + j, j < n; labels, ids and the
// column arrays start at column i + 1. Each pair updates anchor i along the row (kLanes partial
// results) and anchor c down its column (elementwise, in this strip's column partials).
template <typename T>
MS_CPU_CLONES void extremes_row(const T* s, int64_t n, int64_t label, int64_t id, const int64_t* labels,
                                const int64_t* ids, T* minpos, T* maxneg, T* col_minpos, T* col_maxneg) {
  const T inf = ms_loss::infinity<T>();
  T lane_a[kLanes], lane_b[kLanes];
  for (int64_t lane = 0; lane < kLanes; ++lane) lane_a[lane] = inf, lane_b[lane] = -inf;
  for_each_lane(n, [&](int64_t j, int64_t lane) MS_INLINE {
    const T positive = labels[j] == label ? T(1) : T(0), kept = ids[j] != id ? T(1) : T(0);
    const T v = s[j];
    lane_a[lane] = positive * kept != T(0) && v < lane_a[lane] ? v : lane_a[lane];
    lane_b[lane] = (T(1) - positive) * kept != T(0) && v > lane_b[lane] ? v : lane_b[lane];
    col_minpos[j] = positive * kept != T(0) && v < col_minpos[j] ? v : col_minpos[j];
    col_maxneg[j] = (T(1) - positive) * kept != T(0) && v > col_maxneg[j] ? v : col_maxneg[j];
  });
  *minpos = combine_lanes(lane_a, [](T a, T b) { return std::min(a, b); });
  *maxneg = combine_lanes(lane_b, [](T a, T b) { return std::max(a, b); });
}

// Mined sums of exp(exponent - shift): anchor i's into sums[0] (P) and sums[1] (N); each column
// anchor's added to col_sum_p / col_sum_n. a: anchor i's minpos, maxneg, shift_p, shift_n; col: the
// same four for the columns, arrays `stride` apart. kShared: every shift is 0 (see
// symmetric_forward), and one exponential serves both anchors of the pair.
template <typename T, bool kMining, bool kShared>
MS_CPU_CLONES void mined_sums_row(const T* s, int64_t n, int64_t label, int64_t id, const int64_t* labels,
                                  const int64_t* ids, const T* a, const T* col, int64_t stride, Params<T> p,
                                  T* sums, T* col_sum_p, T* col_sum_n) {
  p.mining = kMining;
  T lane_a[kLanes], lane_b[kLanes];
  for (int64_t lane = 0; lane < kLanes; ++lane) lane_a[lane] = 0, lane_b[lane] = 0;
  for_each_lane(n, [&](int64_t j, int64_t lane) MS_INLINE {
    const T positive = labels[j] == label ? T(1) : T(0), kept = ids[j] != id ? T(1) : T(0);
    const T v = s[j];
    T e, f;
    if constexpr (kShared) {
      const T shared = shared_exp(v, positive, p);
      e = in_mined_set(v, positive, kept, a[0], a[1], p) != T(0) ? shared : T(0);
      f = in_mined_set(v, positive, kept, col[j], col[stride + j], p) != T(0) ? shared : T(0);
    } else {
      e = mined_exp(v, positive, kept, a[0], a[1], a[2], a[3], p);
      f = mined_exp(v, positive, kept, col[j], col[stride + j], col[2 * stride + j], col[3 * stride + j], p);
    }
    lane_a[lane] += positive != T(0) ? e : T(0);
    lane_b[lane] += positive != T(0) ? T(0) : e;
    col_sum_p[j] += positive != T(0) ? f : T(0);
    col_sum_n[j] += positive != T(0) ? T(0) : f;
  });
  const auto add = [](T x, T y) { return x + y; };
  sums[0] = combine_lanes(lane_a, add);
  sums[1] = combine_lanes(lane_b, add);
}

// Pass 3 with one shared exponential: K_ij = -/+ exp(a_ij) (in_i F_i + in_j F_j), with the per-anchor
// factors F = count * exp(-LP) for a positive pair, count * exp(-LN) for a negative one. a: anchor
// i's minpos, maxneg, F_p, F_n; col: the same four for the columns, `stride` apart. Returns the row's
// non-zeros.
template <typename T, bool kMining>
MS_CPU_CLONES int64_t shared_weights_row(T* s, int64_t n, int64_t label, int64_t id, const int64_t* labels,
                                         const int64_t* ids, const T* a, const T* col, int64_t stride, Params<T> p) {
  p.mining = kMining;
  const T minpos = a[0], maxneg = a[1], f_p = a[2], f_n = a[3];
  int64_t nonzeros = 0;
#pragma omp simd reduction(+ : nonzeros)
  for (int64_t j = 0; j < n; ++j) {
    const T positive = labels[j] == label ? T(1) : T(0), kept = ids[j] != id ? T(1) : T(0);
    const T v = s[j], col_f_p = col[2 * stride + j], col_f_n = col[3 * stride + j];
    const T e = shared_exp(v, positive, p);
    const T f_i = positive != T(0) ? f_p : f_n, f_j = positive != T(0) ? col_f_p : col_f_n;
    const T in_i = in_mined_set(v, positive, kept, minpos, maxneg, p);
    const T in_j = in_mined_set(v, positive, kept, col[j], col[stride + j], p);
    const T w = e * (in_i * f_i + in_j * f_j);
    s[j] = positive != T(0) ? -w : w;
    nonzeros += w != T(0) ? 1 : 0;
  }
  return nonzeros;
}

// Backward for one anchor row, in place: s[j] = S_ij on entry, dL/dS_ij on exit, scaled by
// scale_i = grad_i (0 for an anchor that does not count). With kSymmetric (self case), the pair
// seen from anchor j is added too, S_ji = S_ij: the row becomes (G + G^T)_i; stats and scale then
// hold the column anchors' statistics ([4] rows `stride` apart) and scales.
template <typename T, bool kMining, bool kSymmetric>
MS_CPU_CLONES void backward_row(T* s, int64_t label, int64_t id, RefKeys ref, AnchorStats<T> a,
                                T scale_i, const T* stats, int64_t stride, const T* scale, Params<T> p) {
  p.mining = kMining;
  const int64_t R = ref.size;
#pragma omp simd
  for (int64_t j = 0; j < R; ++j) {  // no reduction: each j is independent
    const T positive = ref.labels[j] == label ? T(1) : T(0), kept = ref.ids[j] != id ? T(1) : T(0);
    const T v = s[j];
    T h = scale_i * ms_loss::pair_weight(v, positive, kept, a, p);
    if constexpr (kSymmetric) {
      const AnchorStats<T> b{stats[j], stats[stride + j], stats[2 * stride + j], stats[3 * stride + j]};
      h += scale[j] * ms_loss::pair_weight(v, positive, kept, b, p);
    }
    s[j] = h;
  }
}

// out[r] = sum_j h[r, j] * dense[j] over the non-zeros of each row: rows in parallel, j in order
// (deterministic). Used below kSparseDensityInverse: a block with fewer than 1 in 16 non-zeros.
constexpr int64_t kSparseDensityInverse = 16;

template <typename T>
MS_CPU_CLONES void sparse_row_times_dense(const T* h, int64_t cols, const T* dense, int64_t dim, T* out) {
  for (int64_t k = 0; k < dim; ++k) out[k] = 0;
  for (int64_t j = 0; j < cols; ++j) {
    if (h[j] == T(0)) continue;
    const T w = h[j];
    const T* d = dense + j * dim;
#pragma omp simd
    for (int64_t k = 0; k < dim; ++k) out[k] += w * d[k];
  }
}

// out = h @ dense, h [rows, cols] contiguous: the sparse loop when h has few non-zeros, else a GEMM.
template <typename T>
void times_dense(const at::Tensor& h, const at::Tensor& dense, at::Tensor out) {
  if (at::count_nonzero(h).item<int64_t>() * kSparseDensityInverse < h.numel()) {
    const int64_t cols = h.size(1), dim = dense.size(1);
    const T* h_ptr = h.data_ptr<T>();
    at::parallel_for(0, h.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        sparse_row_times_dense(h_ptr + r * cols, cols, dense.data_ptr<T>(), dim, out.data_ptr<T>() + r * dim);
    });
  } else {
    at::mm_out(out, h, dense);
  }
}

// The buffer of the saved weights. It is large (34 MiB at B = 4096), and a fresh one costs page
// faults and the kernel's zeroing. Two remedies:
// - transparent huge pages where the kernel gives them on request (THP "madvise" mode): first
//   touching 64 MiB in 4 KiB pages took about 12 ms on the benchmark machine, in 2 MiB pages about
//   3 ms. The pages are touched here, on every thread: faulted inside a BLAS call instead, huge pages
//   stalled its threads (a 4096^2 product took 56 ms instead of 29).
// - one spare: the last buffer freed is kept for the next forward that fits it (a training loop's
//   steps have one size), which then needs neither. At most one buffer is held between steps.
constexpr size_t kHugePage = size_t(2) << 20;

struct Spare {
  std::mutex mutex;
  void* block = nullptr;
  size_t bytes = 0;
};
Spare& spare() {
  static Spare* the_spare = new Spare();  // (never destroyed: a buffer may come back at exit)
  return *the_spare;
}

void keep_as_spare(void* block, size_t bytes) {
  Spare& s = spare();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::free(s.block);
  s.block = block;
  s.bytes = bytes;
}

at::Tensor large_empty(at::IntArrayRef shape, const at::TensorOptions& options) {
  const size_t needed = size_t(c10::multiply_integers(shape)) * options.dtype().itemsize();
  if (needed < kHugePage) return at::empty(shape, options);
  void* block = nullptr;
  size_t bytes = (needed + kHugePage - 1) / kHugePage * kHugePage;
  {
    Spare& s = spare();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.block != nullptr && s.bytes >= bytes && s.bytes - bytes <= bytes / 4) {
      std::swap(block, s.block);
      bytes = s.bytes;
    }
  }
  if (block == nullptr) {
    block = std::aligned_alloc(kHugePage, bytes);
    TORCH_CHECK(block != nullptr, "ms_loss: out of memory allocating ", bytes, " bytes for the saved pair weights");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(block, bytes, MADV_HUGEPAGE);  // advice only
#endif
    char* first = static_cast<char*>(block);
    at::parallel_for(0, int64_t(bytes / 4096), 512, [&](int64_t begin, int64_t end) {
      for (int64_t page = begin; page < end; ++page) first[page * 4096] = 0;
    });
  }
  return at::from_blob(block, shape, [bytes](void* data) { keep_as_spare(data, bytes); }, options);
}

struct Inputs {
  at::Tensor x, labels, ids, ref, ref_labels, ref_ids;  // compute dtype, contiguous, int64 keys
  bool self_case;
};

at::ScalarType compute_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

Inputs prepare(const at::Tensor& x, const at::Tensor& labels, const std::optional<at::Tensor>& ids,
               const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& ref_labels,
               const std::optional<at::Tensor>& ref_ids) {
  const ms_loss::Keys keys = ms_loss::checked_keys("ms_loss", x, labels, ids, ref, ref_labels, ref_ids);
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "ms_loss: x must be floating, got ", x.scalar_type());
  Inputs in;
  in.self_case = !ref.has_value();
  in.x = x.to(compute_dtype(x)).contiguous();
  in.ref = in.self_case ? in.x : ref->to(in.x.scalar_type()).contiguous();
  in.labels = keys.labels;
  in.ids = keys.ids;
  in.ref_labels = keys.ref_labels;
  in.ref_ids = keys.ref_ids;
  return in;
}

template <typename T>
Params<T> make_params(double alpha, double beta, double base, double epsilon, bool mining,
                      bool skip_incomplete_anchors) {
  return {T(alpha), T(beta), T(base), T(epsilon), mining, skip_incomplete_anchors};
}

int64_t rows_per_chunk(int64_t R, size_t elem_size) {
  return std::max<int64_t>(1, kChunkBytes / (std::max<int64_t>(R, 1) * int64_t(elem_size)));
}

// Calls body(i0, rows, S_chunk) for consecutive row chunks, S_chunk = x[i0:i0+rows] @ ref^T.
template <typename Body>
void for_each_chunk(const Inputs& in, Body body) {
  const int64_t B = in.x.size(0), R = in.ref.size(0);
  const int64_t chunk = std::min(B, rows_per_chunk(R, in.x.element_size()));
  at::Tensor buffer = at::empty({chunk, R}, in.x.options());
  for (int64_t i0 = 0; i0 < B; i0 += chunk) {
    const int64_t rows = std::min(chunk, B - i0);
    at::Tensor s = buffer.narrow(0, 0, rows);
    at::mm_out(s, in.x.narrow(0, i0, rows), in.ref.t());
    body(i0, rows, s);
  }
}

// ---- saved pair weights -----------------------------------------------------------------------
// stats = [4 + extra, B]: the statistics, then (flattened) a header element and the payload:
// dense: G [B, R]; sparse: offsets [B + 1], columns [capacity], weights [capacity] (indices stored
// as same-width integers). The header says which, and whether a sparse forward overflowed.
// kSymmetric: the self case's K = G + G^T, strictly upper triangle, [B, B] (symmetric_forward);
// kSymmetricGathers: the same, with under 1 pair in 16 non-zero (the backward gathers).
enum class SavedMode : int64_t { kRecompute = 0, kDense = 1, kSparse = 2, kOverflow = 3, kSymmetric = 4, kSymmetricGathers = 5 };
constexpr int64_t kBlock = 256;  // rows in a strip of the self case's triangle (half up to B = 2048)

struct SavedLayout {  // (a sparse payload's capacity follows from its size: sparse_capacity)
  SavedMode mode;
  int64_t extra_rows;
};

// Entries of a sparse payload of `numel` elements: offsets [B + 1], then columns and weights.
int64_t sparse_capacity(int64_t numel, int64_t B, int64_t elem_size) {
  const int64_t capacity = (numel - 1 - (B + 1)) / 2;
  return elem_size == 4 ? std::min<int64_t>(capacity, std::numeric_limits<int32_t>::max()) : capacity;
}

int64_t saved_budget_bytes() {
  const char* text = std::getenv("MS_LOSS_CPU_SAVED_MB");
  const double mb = text != nullptr ? std::atof(text) : 256.0;
  return mb > 0 ? int64_t(mb * double(1 << 20)) : 0;
}

// The self case's strictly upper triangle (K, and S before it), stored strip by strip: strip t,
// rows [i0, i0 + h) with i0 = t h, is a row-major [rows, B - i0] block of the columns from i0 on
// (its diagonal block's lower half and diagonal held as zeros). Element (i, c), c >= i0, is at
// row_start(i) + c. About half of B x B. The strip height h is 128 up to B = 2048 (the products of
// a smaller batch ran 5-10% faster in thinner strips), else 256.
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

// Must match ms_loss_cuda/ops.py's cpu_saved_rows (the fake kernel's shape).
SavedLayout saved_layout(int64_t B, int64_t R, int64_t elem_size, bool self_case) {
  const int64_t budget = saved_budget_bytes() / elem_size;  // elements
  if (B == 0 || R == 0 || budget <= 0) return {SavedMode::kRecompute, 0};
  if (self_case && Triangle{B}.size() <= budget - 1) return {SavedMode::kDense, (1 + Triangle{B}.size() + B - 1) / B};
  if (!self_case && B <= (budget - 1) / R) return {SavedMode::kDense, (1 + B * R + B - 1) / B};
  const int64_t capacity = sparse_capacity(budget, B, elem_size);
  if (capacity < B || capacity < B * R / kSparseDensityInverse) return {SavedMode::kRecompute, 0};
  return {SavedMode::kSparse, (1 + B + 1 + 2 * capacity + B - 1) / B};
}

at::ScalarType index_dtype(const at::Tensor& t) { return t.element_size() == 4 ? at::kInt : at::kLong; }

struct Saved {  // views of the payload
  SavedMode mode;
  at::Tensor dense;                      // [B, R]; the self case: its Triangle, flat
  at::Tensor offsets, columns, weights;  // CSR
};

Saved saved_views(const at::Tensor& stats, int64_t B, int64_t R) {
  Saved saved{SavedMode::kRecompute, {}, {}, {}, {}};
  if (stats.size(0) == 4 || B == 0) return saved;
  const at::Tensor flat = stats.view(-1).narrow(0, 4 * B, stats.numel() - 4 * B);
  saved.mode = SavedMode(int64_t(flat[0].item<double>()));
  if (saved.mode == SavedMode::kDense) {
    saved.dense = flat.narrow(0, 1, B * R).view({B, R});
  } else if (saved.mode == SavedMode::kSymmetric || saved.mode == SavedMode::kSymmetricGathers) {
    saved.dense = flat.narrow(0, 1, Triangle{B}.size());
  } else if (saved.mode == SavedMode::kSparse) {
    const int64_t capacity = sparse_capacity(flat.numel(), B, flat.element_size());
    saved.offsets = flat.narrow(0, 1, B + 1).view(index_dtype(flat));
    saved.columns = flat.narrow(0, B + 2, capacity).view(index_dtype(flat));
    saved.weights = flat.narrow(0, B + 2 + capacity, capacity);
  }
  return saved;
}

// The non-zeros of a row.
template <typename T>
MS_CPU_CLONES int64_t row_nonzeros(const T* row, int64_t cols) {
  int64_t count = 0;
#pragma omp simd reduction(+ : count)
  for (int64_t j = 0; j < cols; ++j) count += row[j] != T(0) ? 1 : 0;
  return count;
}

// ---- the self case with its weights kept: K = G + G^T, once per pair -------------------------
// S and K (with G's rows of non-counting anchors zeroed) are symmetric, so only the strictly upper
// triangle of S is computed (strips of rows, each from its diagonal block on: half the products)
// and reduced: each S_ij, i < j, once for both anchors, along the row for anchor i (a horizontal
// reduction) and down the column for anchor j (elementwise, into per-strip column partials that are
// combined in strip order: the passes give the same bits for any number of threads; the BLAS
// products, for a given number). Three passes: extremes (minpos, maxneg), mined sums (LP, LN), then
// K_ij in place of S_ij (the diagonal blocks' lower halves are zero). With one grad_output g for
// every counting anchor (the "mean" and "sum" reductions) the backward is dx = g K x, one product
// over the triangle; otherwise it recomputes.

// Rows per strip of the reduction passes: 32 strips up to B = 8192 (their column partials stay
// small), more beyond, where a strip stops at 256 rows. A number that depends on B alone: so does
// the combination order, hence the passes' bits.
int64_t reduction_strip_rows(int64_t B) { return std::clamp<int64_t>((B + 31) / 32, 16, kBlock); }

// body(t, i) for every row i of every strip t (rows [t height, (t + 1) height) of B), strips in
// parallel; strips t and strips - 1 - t go to the same task (the triangle's rows shorten down the
// strips, a pair's work is about constant).
template <typename Body>
void for_each_strip_row(int64_t B, int64_t height, Body body) {
  const int64_t strips = (B + height - 1) / height;
  const auto strip = [&](int64_t t) {
    for (int64_t i = t * height; i < std::min(B, (t + 1) * height); ++i) body(t, i);
  };
  at::parallel_for(0, (strips + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      strip(t);
      if (strips - 1 - t != t) strip(strips - 1 - t);
    }
  });
}

// Returns the non-zeros of K's triangle.
template <typename T>
int64_t symmetric_forward(const Inputs& in, Params<T> p, T* s /* Triangle */, T* stats /* [4, B] */, T* loss) {
  const int64_t B = in.x.size(0);
  const Triangle triangle{B};
  for (int64_t t = 0; t < triangle.strips(); ++t) {  // S[i0:i0+rows, i0:]
    const int64_t i0 = triangle.strip_first(t), rows = triangle.strip_rows(t);
    at::Tensor out = at::from_blob(s + triangle.strip_start(t), {rows, B - i0}, in.x.options());
    at::mm_out(out, in.x.narrow(0, i0, rows), in.x.narrow(0, i0, B - i0).t());
  }
  const int64_t* labels = in.labels.data_ptr<int64_t>();
  const int64_t* ids = in.ids.data_ptr<int64_t>();
  const int64_t height = reduction_strip_rows(B), strips = (B + height - 1) / height;
  const auto row_of = [&](int64_t i) { return s + triangle.row_start(i) + i + 1; };  // row i from column i + 1 on
  const auto zero_below = [&](int64_t i) {  // columns [i0, i] of row i: the diagonal block's lower half
    std::fill(s + triangle.row_start(i) + i / triangle.h * triangle.h, row_of(i), T(0));
  };
  std::vector<T> col_a(strips * B), col_b(strips * B);  // per-strip column partials
  // for each anchor i, its own row's result then the strips' column results in order, by `combine`
  const auto combine_strips = [&](T* row_result, const std::vector<T>& col, auto combine) {
    for (int64_t i = 0; i < B; ++i)
      for (int64_t t = 0; t <= i / height; ++t) row_result[i] = combine(row_result[i], col[t * B + i]);
  };
  T* minpos = stats;
  T* maxneg = stats + B;
  std::fill(col_a.begin(), col_a.end(), ms_loss::infinity<T>());
  std::fill(col_b.begin(), col_b.end(), -ms_loss::infinity<T>());
  for_each_strip_row(B, height, [&](int64_t t, int64_t i) {
    extremes_row(row_of(i), B - i - 1, labels[i], ids[i], labels + i + 1, ids + i + 1, minpos + i, maxneg + i,
                 col_a.data() + t * B + i + 1, col_b.data() + t * B + i + 1);
  });
  combine_strips(minpos, col_a, [](T a, T b) { return std::min(a, b); });
  combine_strips(maxneg, col_b, [](T a, T b) { return std::max(a, b); });

  // Every pair's exponent is at most its anchors' hardest pair's (alpha, beta > 0). While that stays
  // moderate, exp(a) needs no shift (no sum can overflow) and one exponential serves both anchors
  // of a pair in passes 2 and 3 (the weights as exp(a) * exp(-L)); beyond it, shifts and two.
  T largest = -ms_loss::infinity<T>();
  for (int64_t i = 0; i < B; ++i) {
    if (minpos[i] < ms_loss::infinity<T>()) largest = std::max(largest, ms_loss::positive_exponent(minpos[i], p));
    if (maxneg[i] > -ms_loss::infinity<T>()) largest = std::max(largest, ms_loss::negative_exponent(maxneg[i], p));
  }
  const bool shared = p.alpha > 0 && p.beta > 0 && largest <= T(kSharedExponentLimit);
  std::vector<T> shifted(4 * B);  // minpos, maxneg, shift_p, shift_n: rows B apart
  for (int64_t i = 0; i < B; ++i) {
    shifted[i] = minpos[i];
    shifted[B + i] = maxneg[i];
    shifted[2 * B + i] = shared ? T(0) : ms_loss::positive_shift(minpos[i], maxneg[i], p);
    shifted[3 * B + i] = shared ? T(0) : ms_loss::negative_shift(minpos[i], maxneg[i], p);
  }
  std::vector<T> sums(2 * B);  // P, N of each anchor's own row, interleaved
  std::fill(col_a.begin(), col_a.end(), T(0));
  std::fill(col_b.begin(), col_b.end(), T(0));
  const auto sums_row = shared ? (p.mining ? mined_sums_row<T, true, true> : mined_sums_row<T, false, true>)
                               : (p.mining ? mined_sums_row<T, true, false> : mined_sums_row<T, false, false>);
  for_each_strip_row(B, height, [&](int64_t t, int64_t i) {
    const T a[4] = {shifted[i], shifted[B + i], shifted[2 * B + i], shifted[3 * B + i]};
    sums_row(row_of(i), B - i - 1, labels[i], ids[i], labels + i + 1, ids + i + 1, a, shifted.data() + i + 1, B,
             p, sums.data() + 2 * i, col_a.data() + t * B + i + 1, col_b.data() + t * B + i + 1);
  });
  T* lp = stats + 2 * B;
  T* ln = stats + 3 * B;
  for (int64_t i = 0; i < B; ++i) lp[i] = sums[2 * i], ln[i] = sums[2 * i + 1];
  const auto add = [](T a, T b) { return a + b; };
  combine_strips(lp, col_a, add);
  combine_strips(ln, col_b, add);
  std::vector<T> counts(B);  // 1 for an anchor that counts, else 0 (its weights are dropped)
  for (int64_t i = 0; i < B; ++i) {
    lp[i] = ms_loss::log1p_sum_exp(shifted[2 * B + i], lp[i]);
    ln[i] = ms_loss::log1p_sum_exp(shifted[3 * B + i], ln[i]);
    loss[i] = ms_loss::anchor_loss(lp[i], ln[i], minpos[i], maxneg[i], p);
    counts[i] = ms_loss::anchor_counts(minpos[i], maxneg[i], p) ? T(1) : T(0);
  }

  std::vector<int64_t> nonzeros(strips, 0);
  if (shared) {
    for (int64_t i = 0; i < B; ++i) {  // shifted becomes minpos, maxneg, F_p, F_n
      shifted[2 * B + i] = counts[i] * ms_loss::ms_exp(-lp[i]);
      shifted[3 * B + i] = counts[i] * ms_loss::ms_exp(-ln[i]);
    }
    const auto weights_row = p.mining ? shared_weights_row<T, true> : shared_weights_row<T, false>;
    for_each_strip_row(B, height, [&](int64_t t, int64_t i) {
      zero_below(i);
      const T a[4] = {shifted[i], shifted[B + i], shifted[2 * B + i], shifted[3 * B + i]};
      nonzeros[t] += weights_row(row_of(i), B - i - 1, labels[i], ids[i], labels + i + 1, ids + i + 1, a,
                                 shifted.data() + i + 1, B, p);
    });
  } else {
    const auto weights_row = p.mining ? backward_row<T, true, true> : backward_row<T, false, true>;
    for_each_strip_row(B, height, [&](int64_t t, int64_t i) {
      zero_below(i);
      const AnchorStats<T> a{minpos[i], maxneg[i], lp[i], ln[i]};
      const RefKeys rest{labels + i + 1, ids + i + 1, B - i - 1};
      weights_row(row_of(i), labels[i], ids[i], rest, a, counts[i], stats + i + 1, B, counts.data() + i + 1, p);
      nonzeros[t] += row_nonzeros(row_of(i), B - i - 1);
    });
  }
  int64_t total = 0;
  for (int64_t n : nonzeros) total += n;
  return total;
}

// dx = g K x from K's strictly upper triangle: per strip, K[I, i0:] x[i0:] into dx[I] and its
// transpose K[I, i0:]^T x[I] into dx[i0:] (one product of work in all).
void symmetric_times(const at::Tensor& K /* Triangle, flat */, double g, const at::Tensor& x, at::Tensor& out) {
  const int64_t B = x.size(0);
  const Triangle triangle{B};
  out.zero_();
  for (int64_t t = 0; t < triangle.strips(); ++t) {
    const int64_t i0 = triangle.strip_first(t), rows = triangle.strip_rows(t);
    const at::Tensor strip = K.narrow(0, triangle.strip_start(t), rows * (B - i0)).view({rows, B - i0});
    out.narrow(0, i0, rows).addmm_(strip, x.narrow(0, i0, B - i0), 1.0, g);
    out.narrow(0, i0, B - i0).addmm_(strip.t(), x.narrow(0, i0, rows), 1.0, g);
  }
}

// CSR from rows' non-zero counts: offsets [rows + 1], columns, values. Row r's entries are
// row(r)[j] for j in [first(r), cols).
template <typename T, typename Row, typename First>
void dense_to_csr(Row row, First first, int64_t rows, int64_t cols, const std::vector<int64_t>& counts,
                  std::vector<int64_t>& offsets, std::vector<int64_t>& columns, std::vector<T>& values) {
  offsets.assign(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) offsets[r + 1] = offsets[r] + counts[r];
  columns.resize(offsets[rows]);
  values.resize(offsets[rows]);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t at = offsets[r];
      const T* h = row(r);
      for (int64_t j = first(r); j < cols && at < offsets[r + 1]; ++j)  // (stops after the row's last)
        if (h[j] != T(0)) columns[at] = j, values[at++] = h[j];
    }
  });
}

// CSR of rows_count rows -> CSR of its transpose (cols_count rows), entries of each new row in the
// order of the old rows: a counting sort, deterministic.
template <typename I, typename T>
void transpose_csr(const I* offsets, const I* columns, const T* weights, int64_t rows_count, int64_t cols_count,
                   std::vector<int64_t>& t_offsets, std::vector<int64_t>& t_rows, std::vector<T>& t_weights) {
  const int64_t nnz = int64_t(offsets[rows_count]);
  t_offsets.assign(cols_count + 1, 0);
  for (int64_t k = 0; k < nnz; ++k) ++t_offsets[int64_t(columns[k]) + 1];
  for (int64_t c = 0; c < cols_count; ++c) t_offsets[c + 1] += t_offsets[c];
  std::vector<int64_t> next(t_offsets.begin(), t_offsets.end() - 1);
  t_rows.resize(nnz);
  t_weights.resize(nnz);
  for (int64_t r = 0; r < rows_count; ++r)
    for (int64_t k = int64_t(offsets[r]); k < int64_t(offsets[r + 1]); ++k) {
      const int64_t at = next[int64_t(columns[k])]++;
      t_rows[at] = r;
      t_weights[at] = weights[k];
    }
}

// out[r] (+)= factor[r] * sum_k w[k] * row_scale[idx[k]] * dense[idx[k]] over row r's entries.
template <typename O, typename I, typename T>
void csr_times_dense(const O* offsets, const I* idx, const T* w, int64_t rows, const T* row_scale,
                     const T* factor, const T* dense, int64_t dim, T* out, bool accumulate) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> acc(dim);
    for (int64_t r = begin; r < end; ++r) {
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t k = int64_t(offsets[r]); k < int64_t(offsets[r + 1]); ++k) {
        const int64_t j = int64_t(idx[k]);
        const T c = w[k] * (row_scale != nullptr ? row_scale[j] : T(1));
        const T* d = dense + j * dim;
        T* a = acc.data();
#pragma omp simd
        for (int64_t q = 0; q < dim; ++q) a[q] += c * d[q];
      }
      const T f = factor != nullptr ? factor[r] : T(1);
      T* o = out + r * dim;
      for (int64_t q = 0; q < dim; ++q) o[q] = (accumulate ? o[q] : T(0)) + f * acc[q];
    }
  });
}

// The backward from the pair weights G in CSR (rows: anchors): dx_i = g_i sum_j G_ij r_j, plus
// sum_k g_k G_ki x_k in the self case; dref_j = sum_i g_i G_ij x_i. Gathers only (the transpose is
// a counting sort): nnz * D work, deterministic.
template <typename T, typename O, typename I>
void csr_backward(const O* offsets, const I* columns, const T* weights, int64_t B, int64_t R, const T* g,
                  const Inputs& in, bool want_ref, at::Tensor& grad_x, at::Tensor& grad_ref) {
  const int64_t D = in.x.size(1);
  csr_times_dense(offsets, columns, weights, B, static_cast<const T*>(nullptr), g, in.ref.data_ptr<T>(), D,
                  grad_x.data_ptr<T>(), false);
  if (!in.self_case && !want_ref) return;
  std::vector<int64_t> t_offsets, t_rows;
  std::vector<T> t_weights;
  transpose_csr(offsets, columns, weights, B, R, t_offsets, t_rows, t_weights);
  at::Tensor target = in.self_case ? grad_x : grad_ref;
  csr_times_dense(t_offsets.data(), t_rows.data(), t_weights.data(), R, g, static_cast<const T*>(nullptr),
                  in.x.data_ptr<T>(), D, target.data_ptr<T>(), in.self_case);
}

// ---- the ops ------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> ms_loss_forward_cpu(
    const at::Tensor& x, const at::Tensor& labels, const std::optional<at::Tensor>& ids,
    const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& ref_labels,
    const std::optional<at::Tensor>& ref_ids, double alpha, double beta, double base,
    double epsilon, bool mining, bool skip_incomplete_anchors) {
  const Inputs in = prepare(x, labels, ids, ref, ref_labels, ref_ids);
  const int64_t B = in.x.size(0), R = in.ref.size(0);
  const SavedLayout layout = saved_layout(B, R, in.x.element_size(), in.self_case);
  at::Tensor loss = at::empty({B}, in.x.options());
  at::Tensor stats = large_empty({4 + layout.extra_rows, B}, in.x.options());
  if (B == 0) return {loss, stats};
  AT_DISPATCH_FLOATING_TYPES(in.x.scalar_type(), "ms_loss_forward_cpu", [&] {
    const auto p = make_params<scalar_t>(alpha, beta, base, epsilon, mining, skip_incomplete_anchors);
    const RefKeys keys{in.ref_labels.data_ptr<int64_t>(), in.ref_ids.data_ptr<int64_t>(), R};
    const int64_t* labels_ptr = in.labels.data_ptr<int64_t>();
    const int64_t* ids_ptr = in.ids.data_ptr<int64_t>();
    scalar_t* stats_ptr = stats.data_ptr<scalar_t>();
    scalar_t* loss_ptr = loss.data_ptr<scalar_t>();
    const bool store = layout.mode != SavedMode::kRecompute;
    const auto reduce_rows = [&](int64_t i0, int64_t rows, scalar_t* s_ptr) {
      const auto row = store ? (mining ? forward_row<scalar_t, true, true> : forward_row<scalar_t, false, true>)
                             : (mining ? forward_row<scalar_t, true, false> : forward_row<scalar_t, false, false>);
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          row(s_ptr + r * R, labels_ptr[i0 + r], ids_ptr[i0 + r], keys, p, stats_ptr + i0 + r, B, loss_ptr + i0 + r);
      });
    };
    if (!store) {
      for_each_chunk(in, [&](int64_t i0, int64_t rows, const at::Tensor& s) { reduce_rows(i0, rows, s.data_ptr<scalar_t>()); });
      return;
    }
    // (every element of stats is written, padding included: the same inputs give the same bits)
    at::Tensor flat = stats.view(-1).narrow(0, 4 * B, stats.numel() - 4 * B);
    if (layout.mode == SavedMode::kDense) {
      const int64_t payload = in.self_case ? Triangle{B}.size() : B * R;
      flat.narrow(0, 1 + payload, flat.numel() - 1 - payload).zero_();
      if (in.self_case) {
        const int64_t nonzeros = symmetric_forward(in, p, flat.data_ptr<scalar_t>() + 1, stats_ptr, loss_ptr);
        const bool few = 2 * nonzeros * kSparseDensityInverse < B * B;  // (K's triangle holds half the pairs)
        flat[0] = double(few ? SavedMode::kSymmetricGathers : SavedMode::kSymmetric);
      } else {
        flat[0] = double(SavedMode::kDense);
        at::Tensor s = flat.narrow(0, 1, B * R).view({B, R});
        at::mm_out(s, in.x, in.ref.t());
        reduce_rows(0, B, s.data_ptr<scalar_t>());
      }
      return;
    }
    // sparse: each chunk's weights compacted into the CSR; an overflow falls back to recomputing
    using index_t = std::conditional_t<sizeof(scalar_t) == 4, int32_t, int64_t>;
    const int64_t capacity = sparse_capacity(flat.numel(), B, flat.element_size());
    index_t* offsets = reinterpret_cast<index_t*>(flat.data_ptr<scalar_t>() + 1);
    index_t* columns = offsets + B + 1;
    scalar_t* weights = reinterpret_cast<scalar_t*>(columns + capacity);
    offsets[0] = 0;
    bool overflow = false;
    std::vector<int64_t> counts;
    for_each_chunk(in, [&](int64_t i0, int64_t rows, const at::Tensor& s) {
      scalar_t* s_ptr = s.data_ptr<scalar_t>();
      reduce_rows(i0, rows, s_ptr);
      if (overflow) return;
      counts.assign(rows, 0);
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) counts[r] = row_nonzeros(s_ptr + r * R, R);
      });
      int64_t total = int64_t(offsets[i0]);
      for (int64_t r = 0; r < rows; ++r) total += counts[r];
      if (total > capacity || total * kSparseDensityInverse >= B * R) {  // (beyond 1 in 16, GEMMs beat gathers)
        overflow = true;
        return;
      }
      for (int64_t r = 0; r < rows; ++r) offsets[i0 + r + 1] = index_t(int64_t(offsets[i0 + r]) + counts[r]);
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          int64_t at = int64_t(offsets[i0 + r]);
          for (int64_t j = 0; j < R; ++j)
            if (s_ptr[r * R + j] != scalar_t(0)) columns[at] = index_t(j), weights[at++] = s_ptr[r * R + j];
        }
      });
    });
    if (overflow) {
      flat.zero_();
      flat[0] = double(SavedMode::kOverflow);
    } else {
      const int64_t nnz = int64_t(offsets[B]);
      std::fill(columns + nnz, columns + capacity, index_t(0));
      std::fill(weights + nnz, weights + capacity, scalar_t(0));
      const int64_t used = 1 + (B + 1) + 2 * capacity;
      flat.narrow(0, used, flat.numel() - used).zero_();
      flat[0] = double(SavedMode::kSparse);
    }
  });
  return {loss, stats};
}

std::tuple<at::Tensor, at::Tensor> ms_loss_backward_cpu(
    const at::Tensor& grad_loss, const at::Tensor& stats, const at::Tensor& x,
    const at::Tensor& labels, const std::optional<at::Tensor>& ids,
    const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& ref_labels,
    const std::optional<at::Tensor>& ref_ids, double alpha, double beta, double base,
    double epsilon, bool mining, bool skip_incomplete_anchors, bool ref_grad) {
  const Inputs in = prepare(x, labels, ids, ref, ref_labels, ref_ids);
  const int64_t B = in.x.size(0), R = in.ref.size(0), D = in.x.size(1);
  const bool want_ref = !in.self_case && ref_grad;
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == B && stats.dim() == 2 && stats.size(0) >= 4 &&
                  stats.size(1) == B,
              "ms_loss_backward: expected grad_loss [B] and stats [4 (+ saved weights), B] with B = ", B);
  const at::Tensor st_all = stats.to(in.x.scalar_type()).contiguous();
  const at::Tensor st = st_all.narrow(0, 0, 4).contiguous();
  const Saved saved = saved_views(st_all, B, R);
  at::Tensor grad_x = at::empty_like(in.x);
  at::Tensor grad_ref = want_ref ? at::zeros_like(in.ref) : at::empty({0}, x.options());
  AT_DISPATCH_FLOATING_TYPES(in.x.scalar_type(), "ms_loss_backward_cpu", [&] {
    const auto p = make_params<scalar_t>(alpha, beta, base, epsilon, mining, skip_incomplete_anchors);
    const RefKeys keys{in.ref_labels.data_ptr<int64_t>(), in.ref_ids.data_ptr<int64_t>(), R};
    const int64_t* labels_ptr = in.labels.data_ptr<int64_t>();
    const int64_t* ids_ptr = in.ids.data_ptr<int64_t>();
    const scalar_t* st_ptr = st.data_ptr<scalar_t>();
    // Per-anchor scale of the pair weights: grad_output of the anchor, 0 if it does not count; and
    // whether every counting anchor has the same finite one, g.
    at::Tensor scale = grad_loss.to(in.x.scalar_type()).contiguous().clone();
    scalar_t* scale_ptr = scale.data_ptr<scalar_t>();
    bool uniform = true, seen = false;
    scalar_t g = 0;
    for (int64_t i = 0; i < B; ++i) {
      if (!ms_loss::anchor_counts(st_ptr[i], st_ptr[B + i], p)) {
        scale_ptr[i] = 0;
        continue;
      }
      if (!seen) g = scale_ptr[i], seen = true;
      uniform = uniform && scale_ptr[i] == g && std::isfinite(g);
    }
    if (saved.mode == SavedMode::kSymmetric || saved.mode == SavedMode::kSymmetricGathers) {
      if (uniform) {  // K holds the counting anchors' weights unscaled: dx = g K x
        if (saved.mode == SavedMode::kSymmetricGathers) {  // over the triangle and its transpose
          const scalar_t* K = saved.dense.data_ptr<scalar_t>();
          const Triangle triangle{B};
          const auto row = [&](int64_t i) { return K + triangle.row_start(i); };
          const auto first = [](int64_t i) { return i + 1; };
          std::vector<int64_t> counts(B);
          at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) counts[i] = row_nonzeros(row(i) + i + 1, B - i - 1);
          });
          std::vector<int64_t> offsets, columns;
          std::vector<scalar_t> weights, same_g(B, g);
          dense_to_csr(row, first, B, B, counts, offsets, columns, weights);
          csr_backward(offsets.data(), columns.data(), weights.data(), B, B, same_g.data(), in, false, grad_x, grad_ref);
        } else {
          symmetric_times(saved.dense, double(g), in.x, grad_x);
        }
        return;
      }  // else the grad_outputs differ: recompute below
    }
    if (saved.mode == SavedMode::kDense) {  // (a reference set: the self case keeps K)
      const scalar_t* G = saved.dense.data_ptr<scalar_t>();
      std::vector<int64_t> counts(B);
      at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) counts[i] = row_nonzeros(G + i * R, R);
      });
      int64_t nonzeros = 0;
      for (int64_t c : counts) nonzeros += c;
      if (nonzeros * kSparseDensityInverse < B * R) {  // mining kept few pairs: gathers, nnz * D
        std::vector<int64_t> offsets, columns;
        std::vector<scalar_t> weights;
        dense_to_csr([&](int64_t i) { return G + i * R; }, [](int64_t) { return int64_t(0); }, B, R, counts,
                     offsets, columns, weights);
        csr_backward(offsets.data(), columns.data(), weights.data(), B, R, scale_ptr, in, want_ref, grad_x, grad_ref);
      } else {  // dx = diag(g) G r, dref = G^T diag(g) x: BLAS products
        at::mm_out(grad_x, saved.dense, in.ref);
        grad_x.mul_(scale.unsqueeze(1));
        if (want_ref) at::mm_out(grad_ref, saved.dense.t(), in.x * scale.unsqueeze(1));
      }
      return;
    }
    if (saved.mode == SavedMode::kSparse) {
      using index_t = std::conditional_t<sizeof(scalar_t) == 4, int32_t, int64_t>;
      csr_backward(saved.offsets.data_ptr<index_t>(), saved.columns.data_ptr<index_t>(),
                   saved.weights.data_ptr<scalar_t>(), B, R, scale_ptr, in, want_ref, grad_x, grad_ref);
      return;
    }
    const auto row = in.self_case ? (mining ? backward_row<scalar_t, true, true>
                                            : backward_row<scalar_t, false, true>)
                                  : (mining ? backward_row<scalar_t, true, false>
                                            : backward_row<scalar_t, false, false>);
    for_each_chunk(in, [&](int64_t i0, int64_t rows, const at::Tensor& s) {
      scalar_t* s_ptr = s.data_ptr<scalar_t>();
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t i = i0 + r;
          const AnchorStats<scalar_t> a{st_ptr[i], st_ptr[B + i], st_ptr[2 * B + i], st_ptr[3 * B + i]};
          row(s_ptr + r * keys.size, labels_ptr[i], ids_ptr[i], keys, a, scale_ptr[i], st_ptr, B, scale_ptr, p);
        }
      });
      // s now holds dL/dS for the chunk's rows (G_I, or (G + G^T)_I in the self case).
      times_dense<scalar_t>(s, in.ref, grad_x.narrow(0, i0, rows));
      if (want_ref) grad_ref.addmm_(s.t(), in.x.narrow(0, i0, rows));
    });
  });
  return {grad_x.to(x.scalar_type()), want_ref ? grad_ref.to(ref->scalar_type()) : grad_ref};
}

}  // namespace

TORCH_LIBRARY_IMPL(ms_loss_cuda, CPU, m) {
  m.impl("ms_loss_forward", &ms_loss_forward_cpu);
  m.impl("ms_loss_backward", &ms_loss_backward_cpu);
}
