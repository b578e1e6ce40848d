// The host side of the CUDA backend: the operands (one dtype, rows padded and aligned for the
// kernels' vector loads, int64 keys), the launch grids, the forward and backward ops, and the
// per-anchor lift that keeps 16-bit pair weights in full precision.
// Included through ms_loss_kernels.cuh, after the CUDA types; the includer defines `launch`.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "../ms_inputs.h"
#include "../ms_math.h"
#include "backward_kernel.cuh"
#include "forward_kernel.cuh"
#include "tiles.cuh"

namespace ms_loss_cuda_kernels {

using ms_loss::Params;

// Runs kernel<<<grid, kThreads>>>(args...) and checks the launch; defined by the includer.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, Args... args);

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
  // the backward's grid takes the columns in blocks of 64 or more on its y axis, of at most 65535
  TORCH_CHECK(x.size(1) <= int64_t(65535) * 64, "ms_loss (CUDA): embeddings of at most 4194240 columns, got ",
              x.size(1));
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
// (The same rule as scales_kernel in triton_kernels/backward_kernels.py.)
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
  // Each anchor row's lift; a reference set's rows hold every anchor's weights: the smallest one, which
  // lifts the largest of them to at most 1.
  const at::Tensor lift = row_scales(st, scale, p);
  const at::Tensor ref_lift = !want_ref ? lift
                              : B > 0   ? lift.amin().expand({in.b.size(0)}).contiguous()
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
