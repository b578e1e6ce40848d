// Per-pair math of the Multi-Similarity loss, shared by every C++ kernel (CPU and CUDA).
//
// The function of ms_loss_cuda/reference.py: S_ij = <x_i, r_j>; a pair is skipped when the identities are equal, otherwise
// it is a positive (same label) or a negative. Everything here is computed in T = float or double.
// The kernels only decide which (i, j) a thread looks at; what happens to one pair lives here.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__CUDACC__)
#define MS_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define MS_HD inline __attribute__((always_inline))  // inlined into each vectorised CPU loop
#else
#define MS_HD inline
#endif

namespace ms_loss {

template <typename T>
struct Params {
  T alpha, beta, base, epsilon;
  bool mining, skip_incomplete_anchors;
};

template <typename T>
MS_HD T infinity() {
  return std::numeric_limits<T>::infinity();
}

// exp that vectorises on the host (GCC auto-vectorises this polynomial inside `omp simd` loops,
// where std::exp would stay a scalar call). Cephes expf: x = n ln2 + r, exp(r) by a degree-6
// polynomial, 2^n through the exponent bits; within 2 ulp. Exact 0 below the float range,
// 2^127.5 above it (never inf); NaN stays NaN.
MS_HD float ms_exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  const float hi = 88.3762626647949f, lo = -87.3365447504f, round = 12582912.0f;  // 1.5 * 2^23
  const bool underflow = x < lo;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const float n = (x * 1.44269504088896341f + round) - round;  // nearest integer
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * x + 1.3981999507e-3f;
  p = p * x + 8.3334519073e-3f;
  p = p * x + 4.1665795894e-2f;
  p = p * x + 1.6666665459e-1f;
  p = p * x + 5.0000001201e-1f;
  p = p * x * x + x + 1.0f;
  const float two_n = __builtin_bit_cast(float, (static_cast<std::int32_t>(n) + 127) << 23);
  return underflow ? 0.0f : p * two_n;
#endif
}
MS_HD double ms_exp(double x) { return exp(x); }

// ---- Similarity-P: mining -------------------------------------------------------------------
// P_i keeps a positive harder than the hardest negative (by epsilon); N_i keeps a negative harder
// than the hardest positive. Without mining both keep everything.
template <typename T>
MS_HD bool mined_positive(T s, T maxneg, const Params<T>& p) {
  return !p.mining || s - p.epsilon < maxneg;
}
template <typename T>
MS_HD bool mined_negative(T s, T minpos, const Params<T>& p) {
  return !p.mining || s + p.epsilon > minpos;
}

// Whether P_i / N_i are non-empty follows from the anchor's hardest pair alone: it is mined exactly
// when anything is (minpos = +inf means no positive at all, maxneg = -inf no negative).
template <typename T>
MS_HD bool has_positive_set(T minpos, T maxneg, const Params<T>& p) {
  return minpos < infinity<T>() && mined_positive(minpos, maxneg, p);
}
template <typename T>
MS_HD bool has_negative_set(T minpos, T maxneg, const Params<T>& p) {
  return maxneg > -infinity<T>() && mined_negative(maxneg, minpos, p);
}
// skip_incomplete_anchors (the authors' code): an anchor lacking either set contributes nothing.
template <typename T>
MS_HD bool anchor_counts(T minpos, T maxneg, const Params<T>& p) {
  return !p.skip_incomplete_anchors ||
         (has_positive_set(minpos, maxneg, p) && has_negative_set(minpos, maxneg, p));
}

// ---- Similarity-S / -N: the exponents and their log(1 + sum exp) ------------------------------
// An exponent is rounded before anything is subtracted from it, everywhere: the hardest pair's, the
// shift, must equal that pair's own exponent in the sums and the weights bit for bit, or every
// weight of the anchor is off by up to half an ulp of the exponent (relative), which for
// unnormalised rows (|beta S| in the thousands) is far above float32's precision. nvcc would
// contract `a * b - c` into an FMA in one place and not in another; __fmul_rn is never contracted.
// (The host code builds with -ffp-contract=off, setup.py.)
template <typename T>
MS_HD T rounded_product(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) return __fmul_rn(a, b);
  else return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

template <typename T>
MS_HD T positive_exponent(T s, const Params<T>& p) {
  return rounded_product(-p.alpha, s - p.base);
}
template <typename T>
MS_HD T negative_exponent(T s, const Params<T>& p) {
  return rounded_product(p.beta, s - p.base);
}

// log(1 + sum_k exp(a_k)) = m + log(exp(-m) + sum_k exp(a_k - m)) with m = max(0, max_k a_k).
// The largest exponent of a non-empty set belongs to its hardest pair (minpos for P, maxneg for N),
// so m is known once mining is done and the sum needs no online rescaling.
template <typename T>
MS_HD T positive_shift(T minpos, T maxneg, const Params<T>& p) {
  const T a = positive_exponent(minpos, p);
  return has_positive_set(minpos, maxneg, p) && a > T(0) ? a : T(0);
}
template <typename T>
MS_HD T negative_shift(T minpos, T maxneg, const Params<T>& p) {
  const T a = negative_exponent(maxneg, p);
  return has_negative_set(minpos, maxneg, p) && a > T(0) ? a : T(0);
}
// shifted_sum = sum_k exp(a_k - shift) over the set.
template <typename T>
MS_HD T log1p_sum_exp(T shift, T shifted_sum) {
  return shift + log(ms_exp(-shift) + shifted_sum);
}

template <typename T>
MS_HD T anchor_loss(T lp, T ln, T minpos, T maxneg, const Params<T>& p) {
  return anchor_counts(minpos, maxneg, p) ? lp / p.alpha + ln / p.beta : T(0);
}

// The LP and LN a forward saves for its backward: +inf for an empty mined set. A backward that
// recomputes S sums it in another order and may see a pair cross a threshold that it did not cross
// in the forward; exp(a - inf) = 0 then gives that pair no weight, as the forward gave it none.
template <typename T>
MS_HD T saved_lp(T lp, T minpos, T maxneg, const Params<T>& p) {
  return has_positive_set(minpos, maxneg, p) ? lp : infinity<T>();
}
template <typename T>
MS_HD T saved_ln(T ln, T minpos, T maxneg, const Params<T>& p) {
  return has_negative_set(minpos, maxneg, p) ? ln : infinity<T>();
}

// ---- Gradient: dL_i/dS_ij is the pair weight (General Pair Weighting) -------------------------
// Per-anchor statistics of one anchor, as saved by the forward.
template <typename T>
struct AnchorStats {
  T minpos, maxneg, lp, ln;
};

// dL_i/dS_ij for the pair (i, j) seen from anchor i, with S_ij = s; 0 for a pair outside P_i, N_i.
// positive: 1 for a pair of equal labels, else 0; kept: 0 for a pair of equal identities, else 1.
// (0/1 values rather than bools, so the CPU loops around it stay branch-free and vectorise.)
template <typename T>
MS_HD T pair_weight(T s, T positive, T kept, const AnchorStats<T>& a, const Params<T>& p) {
  // both arms are computed before the selection: branch-free (the CPU loops vectorise), one exp
  const T in_p = mined_positive(s, a.maxneg, p) ? kept : T(0);
  const T in_n = mined_negative(s, a.minpos, p) ? kept : T(0);
  const T arg_p = positive_exponent(s, p) - a.lp, arg_n = negative_exponent(s, p) - a.ln;
  const T e = ms_exp(positive != T(0) ? arg_p : arg_n);
  return (positive != T(0) ? in_p : in_n) != T(0) ? (positive != T(0) ? -e : e) : T(0);
}

}  // namespace ms_loss
