// Fused CPU kernel of the Multi-Similarity loss (forward and backward ops, CPU dispatch key).
//
// The B x R similarity matrix is never held: rows of anchors are processed in chunks whose
// similarity block fits kChunkBytes. Per chunk, one GEMM (at::mm, multi-threaded) gives the block,
// then each anchor row is reduced by vectorised loops (at::parallel_for over rows). The forward
// saves only the per-anchor statistics (minpos, maxneg, LP, LN); the backward recomputes the block.
// Self case: H = G + G^T is built row by row from the statistics of both ends of a pair, so
// dx = H x is one more GEMM per chunk (3 GEMM-equivalents in all, as for X @ X.T forward+backward).
// Chunks run one after another, every reduction has a fixed order: results are bitwise repeatable.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

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
  for (int64_t j = 0; j < full; j += kLanes)
    for (int64_t lane = 0; lane < kLanes; ++lane) step(j + lane, lane);
  for (int64_t j = full; j < n; ++j) step(j, j - full);
}

template <typename T, typename Combine>
MS_INLINE inline T combine_lanes(const T* lanes, Combine combine) {
  T total = lanes[0];
  for (int64_t lane = 1; lane < kLanes; ++lane) total = combine(total, lanes[lane]);
  return total;
}

// Forward for one anchor row s[0..R): mining, then both log(1 + sum exp) terms.
template <typename T, bool kMining>
MS_CPU_CLONES void forward_row(const T* s, int64_t label, int64_t id, RefKeys ref, Params<T> p,
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
    const T v = s[j];
    const T e = ms_loss::ms_exp(positive != T(0) ? ms_loss::positive_exponent(v, p) - shift_p
                                                 : ms_loss::negative_exponent(v, p) - shift_n);
    const T mined_p = ms_loss::mined_positive(v, maxneg, p) ? positive * kept : T(0);
    const T mined_n = ms_loss::mined_negative(v, minpos, p) ? (T(1) - positive) * kept : T(0);
    lane_a[lane] += mined_p != T(0) ? e : T(0);
    lane_b[lane] += mined_n != T(0) ? e : T(0);
  });
  const auto add = [](T a, T b) { return a + b; };
  const T lp = ms_loss::log1p_sum_exp(shift_p, combine_lanes(lane_a, add));
  const T ln = ms_loss::log1p_sum_exp(shift_n, combine_lanes(lane_b, add));
  stats[0] = minpos;
  stats[stride] = maxneg;
  stats[2 * stride] = lp;
  stats[3 * stride] = ln;
  *loss = ms_loss::anchor_loss(lp, ln, minpos, maxneg, p);
}

// Backward for one anchor row, in place: s[j] = S_ij on entry, dL/dS_ij on exit, scaled by
// scale_i = grad_i (0 for an anchor that does not count). With kSymmetric (self case), the pair
// seen from anchor j is added too, S_ji = S_ij: the row becomes (G + G^T)_i.
template <typename T, bool kMining, bool kSymmetric>
MS_CPU_CLONES void backward_row(T* s, int64_t label, int64_t id, RefKeys ref, AnchorStats<T> a,
                                T scale_i, const T* stats /* [4, R] */, const T* scale, Params<T> p) {
  p.mining = kMining;
  const int64_t R = ref.size;
#pragma omp simd
  for (int64_t j = 0; j < R; ++j) {  // no reduction: each j is independent
    const T positive = ref.labels[j] == label ? T(1) : T(0), kept = ref.ids[j] != id ? T(1) : T(0);
    const T v = s[j];
    T h = scale_i * ms_loss::pair_weight(v, positive, kept, a, p);
    if constexpr (kSymmetric) {
      const AnchorStats<T> b{stats[j], stats[R + j], stats[2 * R + j], stats[3 * R + j]};
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

template <typename T>
void sparse_rows_times_dense(const T* h, int64_t rows, int64_t cols, const T* dense, int64_t dim, T* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) sparse_row_times_dense(h + r * cols, cols, dense, dim, out + r * dim);
  });
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

std::tuple<at::Tensor, at::Tensor> ms_loss_forward_cpu(
    const at::Tensor& x, const at::Tensor& labels, const std::optional<at::Tensor>& ids,
    const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& ref_labels,
    const std::optional<at::Tensor>& ref_ids, double alpha, double beta, double base,
    double epsilon, bool mining, bool skip_incomplete_anchors) {
  const Inputs in = prepare(x, labels, ids, ref, ref_labels, ref_ids);
  const int64_t B = in.x.size(0);
  at::Tensor loss = at::empty({B}, in.x.options());
  at::Tensor stats = at::empty({4, B}, in.x.options());
  AT_DISPATCH_FLOATING_TYPES(in.x.scalar_type(), "ms_loss_forward_cpu", [&] {
    const auto p = make_params<scalar_t>(alpha, beta, base, epsilon, mining, skip_incomplete_anchors);
    const RefKeys keys{in.ref_labels.data_ptr<int64_t>(), in.ref_ids.data_ptr<int64_t>(), in.ref.size(0)};
    const int64_t* labels_ptr = in.labels.data_ptr<int64_t>();
    const int64_t* ids_ptr = in.ids.data_ptr<int64_t>();
    scalar_t* stats_ptr = stats.data_ptr<scalar_t>();
    scalar_t* loss_ptr = loss.data_ptr<scalar_t>();
    for_each_chunk(in, [&](int64_t i0, int64_t rows, const at::Tensor& s) {
      const scalar_t* s_ptr = s.data_ptr<scalar_t>();
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t i = i0 + r;
          (mining ? forward_row<scalar_t, true> : forward_row<scalar_t, false>)(
              s_ptr + r * keys.size, labels_ptr[i], ids_ptr[i], keys, p, stats_ptr + i, B, loss_ptr + i);
        }
      });
    });
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
  const int64_t B = in.x.size(0);
  const bool want_ref = !in.self_case && ref_grad;
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == B && stats.dim() == 2 &&
                  stats.size(0) == 4 && stats.size(1) == B,
              "ms_loss_backward: expected grad_loss [B] and stats [4, B] with B = ", B);
  const at::Tensor st = stats.to(in.x.scalar_type()).contiguous();
  at::Tensor grad_x = at::empty_like(in.x);
  at::Tensor grad_ref = want_ref ? at::zeros_like(in.ref) : at::empty({0}, x.options());
  AT_DISPATCH_FLOATING_TYPES(in.x.scalar_type(), "ms_loss_backward_cpu", [&] {
    const auto p = make_params<scalar_t>(alpha, beta, base, epsilon, mining, skip_incomplete_anchors);
    const RefKeys keys{in.ref_labels.data_ptr<int64_t>(), in.ref_ids.data_ptr<int64_t>(), in.ref.size(0)};
    const int64_t* labels_ptr = in.labels.data_ptr<int64_t>();
    const int64_t* ids_ptr = in.ids.data_ptr<int64_t>();
    const scalar_t* st_ptr = st.data_ptr<scalar_t>();
    // Per-anchor scale of the pair weights: grad_output of the anchor, 0 if it does not count.
    at::Tensor scale = grad_loss.to(in.x.scalar_type()).contiguous().clone();
    scalar_t* scale_ptr = scale.data_ptr<scalar_t>();
    for (int64_t i = 0; i < B; ++i) {
      if (!ms_loss::anchor_counts(st_ptr[i], st_ptr[B + i], p)) scale_ptr[i] = 0;
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
          row(s_ptr + r * keys.size, labels_ptr[i], ids_ptr[i], keys, a, scale_ptr[i], st_ptr,
              scale_ptr, p);
        }
      });
      // s now holds dL/dS for the chunk's rows (G_I, or (G + G^T)_I in the self case). Mining
      // keeps few pairs: a sparse block costs nnz * D instead of a GEMM.
      at::Tensor grad_x_rows = grad_x.narrow(0, i0, rows);
      if (at::count_nonzero(s).item<int64_t>() * kSparseDensityInverse < s.numel()) {
        sparse_rows_times_dense(s_ptr, rows, keys.size, in.ref.data_ptr<scalar_t>(), in.x.size(1),
                                grad_x_rows.data_ptr<scalar_t>());
      } else {
        at::mm_out(grad_x_rows, s, in.ref);
      }
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
