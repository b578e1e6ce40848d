// The row loops of the fused CPU kernel (declared in ms_cpu_rows.h), vectorised by GCC without
// fast-math and built for AVX-512, AVX2 and plain x86-64 (the loader picks one per machine).
//
// The loops compare labels and identities into 0/1 values of T and select on float compares only,
// and take `mining` as a compile-time constant: GCC then vectorises them fully (a bool select on a
// run-time flag, or && between masks, keeps them scalar). Row reductions keep kLanes partial
// results, combined in a fixed order: they vectorise without fast-math (omp simd min/max reductions
// miscompile in GCC 12 target clones) and give the same bits on every ISA.
//
// Every loop with target clones is defined and instantiated in this file alone; the other files
// reach them through ms_cpu_rows.h (the exported symbol is the clones' dispatcher).
#include "ms_cpu_rows.h"

#include <algorithm>
#include <cstdint>

namespace ms_loss::cpu {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MS_NO_CLONES)
#define MS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MS_CPU_CLONES
#endif

// Forced inlining: a call left inside a row loop (helpers, the lambdas below) keeps it scalar.
#if defined(__GNUC__)
#define MS_INLINE __attribute__((always_inline))
#else
#define MS_INLINE
#endif

namespace {

constexpr int64_t kLanes = 16;

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

// The exponential that the self case's passes 2 and 3 share (see kSharedExponentLimit). Every mined
// pair's exponent is at most the limit; the clamp keeps the pairs of equal identity, which are never
// weighted, finite too (0 * inf would be NaN).
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

// ForwardRow (ms_cpu_rows.h). The stored weights come from the sums' own exponentials:
// w = exp(a - shift) * exp(shift - l).
template <typename T, bool kMining, bool kStore>
MS_CPU_CLONES void forward_row(T* s, int64_t label, int64_t id, RefKeys ref, Params<T> p, T* stats, int64_t stride,
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
  stats[2 * stride] = ms_loss::saved_lp(lp, minpos, maxneg, p);  // (+inf for an empty set: ms_math.h)
  stats[3 * stride] = ms_loss::saved_ln(ln, minpos, maxneg, p);
  *loss = ms_loss::anchor_loss(lp, ln, minpos, maxneg, p);
}

// MinedSumsRow (ms_cpu_rows.h): kLanes partial results along the row, elementwise down the columns.
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

// SharedWeightsRow (ms_cpu_rows.h).
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

// BackwardRow (ms_cpu_rows.h).
template <typename T, bool kMining, bool kSymmetric>
MS_CPU_CLONES void backward_row(T* s, int64_t label, int64_t id, RefKeys ref, AnchorStats<T> a, T scale_i,
                                const T* stats, int64_t stride, const T* scale, Params<T> p) {
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

}  // namespace

template <typename T>
ForwardRow<T> forward_row_for(bool mining, bool store) {
  return store ? (mining ? forward_row<T, true, true> : forward_row<T, false, true>)
               : (mining ? forward_row<T, true, false> : forward_row<T, false, false>);
}

template <typename T>
BackwardRow<T> backward_row_for(bool mining, bool symmetric) {
  return symmetric ? (mining ? backward_row<T, true, true> : backward_row<T, false, true>)
                   : (mining ? backward_row<T, true, false> : backward_row<T, false, false>);
}

template <typename T>
MinedSumsRow<T> mined_sums_row_for(bool mining, bool shared) {
  return shared ? (mining ? mined_sums_row<T, true, true> : mined_sums_row<T, false, true>)
                : (mining ? mined_sums_row<T, true, false> : mined_sums_row<T, false, false>);
}

template <typename T>
SharedWeightsRow<T> shared_weights_row_for(bool mining) {
  return mining ? shared_weights_row<T, true> : shared_weights_row<T, false>;
}

// Pass 1 of the self case (ms_cpu_rows.h): kLanes partial results along the row, elementwise down
// the columns.
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

template <typename T>
MS_CPU_CLONES int64_t row_nonzeros(const T* row, int64_t cols) {
  int64_t count = 0;
#pragma omp simd reduction(+ : count)
  for (int64_t j = 0; j < cols; ++j) count += row[j] != T(0) ? 1 : 0;
  return count;
}

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

#define MS_CPU_ROWS(T)                                                                                      \
  template ForwardRow<T> forward_row_for<T>(bool, bool);                                                    \
  template BackwardRow<T> backward_row_for<T>(bool, bool);                                                  \
  template MinedSumsRow<T> mined_sums_row_for<T>(bool, bool);                                               \
  template SharedWeightsRow<T> shared_weights_row_for<T>(bool);                                             \
  template void extremes_row<T>(const T*, int64_t, int64_t, int64_t, const int64_t*, const int64_t*, T*, T*, \
                                T*, T*);                                                                    \
  template int64_t row_nonzeros<T>(const T*, int64_t);                                                      \
  template void sparse_row_times_dense<T>(const T*, int64_t, const T*, int64_t, T*);
MS_CPU_ROWS(float)
MS_CPU_ROWS(double)
#undef MS_CPU_ROWS

}  // namespace ms_loss::cpu
