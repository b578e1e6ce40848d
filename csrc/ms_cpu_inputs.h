// The operands of the fused CPU kernel and the chunks of the similarity matrix it computes.
//
// The kernel computes in float32, or float64 for float64 inputs, on contiguous rows with int64
// keys. Where nothing of S is kept, S = x ref^T goes in row chunks of kChunkBytes, one GEMM a chunk,
// chunks one after another (a fixed order: the same bits on every run).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "ms_inputs.h"
#include "ms_math.h"

namespace ms_loss::cpu {

// Memory budget for one chunk of the similarity matrix (at least one row is always processed).
constexpr int64_t kChunkBytes = int64_t(64) << 20;

struct Inputs {
  at::Tensor x, labels, ids, ref, ref_labels, ref_ids;  // compute dtype, contiguous, int64 keys
  bool self_case;
};

inline at::ScalarType compute_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline Inputs prepare(const at::Tensor& x, const at::Tensor& labels, const std::optional<at::Tensor>& ids,
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

inline int64_t rows_per_chunk(int64_t R, size_t elem_size) {
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

}  // namespace ms_loss::cpu
