// The self case's passes over its triangle and the backward's product with K (ms_cpu_triangle.h):
// the strips of S as BLAS products, the three reduction passes row by row (the row loops of
// ms_cpu_rows.h), strips in parallel, and the strips' column partials combined in a fixed order.
#include "ms_cpu_triangle.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "ms_cpu_rows.h"
#include "ms_cpu_saved.h"

namespace ms_loss::cpu {
namespace {

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

}  // namespace

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
  const auto sums_row = mined_sums_row_for<T>(p.mining, shared);
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
    // (+inf for an empty set, as every forward saves it: ms_math.h; its weights below are then 0, as
    // they are without it, no pair of this S being in the set)
    lp[i] = ms_loss::saved_lp(lp[i], minpos[i], maxneg[i], p);
    ln[i] = ms_loss::saved_ln(ln[i], minpos[i], maxneg[i], p);
  }

  std::vector<int64_t> nonzeros(strips, 0);
  if (shared) {
    for (int64_t i = 0; i < B; ++i) {  // shifted becomes minpos, maxneg, F_p, F_n
      shifted[2 * B + i] = counts[i] * ms_loss::ms_exp(-lp[i]);
      shifted[3 * B + i] = counts[i] * ms_loss::ms_exp(-ln[i]);
    }
    const auto weights_row = shared_weights_row_for<T>(p.mining);
    for_each_strip_row(B, height, [&](int64_t t, int64_t i) {
      zero_below(i);
      const T a[4] = {shifted[i], shifted[B + i], shifted[2 * B + i], shifted[3 * B + i]};
      nonzeros[t] += weights_row(row_of(i), B - i - 1, labels[i], ids[i], labels + i + 1, ids + i + 1, a,
                                 shifted.data() + i + 1, B, p);
    });
  } else {
    const auto weights_row = backward_row_for<T>(p.mining, true);
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

template int64_t symmetric_forward<float>(const Inputs&, Params<float>, float*, float*, float*);
template int64_t symmetric_forward<double>(const Inputs&, Params<double>, double*, double*, double*);

}  // namespace ms_loss::cpu
