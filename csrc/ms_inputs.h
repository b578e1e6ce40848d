// The ops' input rules and int64 keys, shared by the CPU and the CUDA kernels: one place for the
// shape checks and for the default identities (as ms_loss_cuda/reference.py defines them).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace ms_loss {

// Labels and identities of both ends, int64 and contiguous. In the self case the reference set is
// x itself and its keys are x's.
struct Keys {
  at::Tensor labels, ids, ref_labels, ref_ids;
};

inline at::Tensor int64_keys(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }

// Checks the shapes and pairings of the op's arguments (`op` names it in errors) and returns the
// keys. Default identities: the row index in the self case (so the diagonal is skipped); with a
// reference set, 0 .. B-1 for x and B .. B+R-1 for the set, which never match.
inline Keys checked_keys(const char* op, const at::Tensor& x, const at::Tensor& labels,
                         const std::optional<at::Tensor>& ids, const std::optional<at::Tensor>& ref,
                         const std::optional<at::Tensor>& ref_labels, const std::optional<at::Tensor>& ref_ids) {
  TORCH_CHECK(x.dim() == 2 && labels.dim() == 1 && labels.size(0) == x.size(0), op,
              ": expected x [B, D] and labels [B], got ", x.sizes(), " and ", labels.sizes());
  TORCH_CHECK(ref.has_value() == ref_labels.has_value(), op, ": ref and ref_labels go together");
  const int64_t B = x.size(0);
  Keys keys;
  keys.labels = int64_keys(labels);
  keys.ids = ids.has_value() ? int64_keys(*ids) : at::arange(B, keys.labels.options());
  if (!ref.has_value()) {
    TORCH_CHECK(!ref_ids.has_value(), op, ": ref_ids needs a reference set");
    keys.ref_labels = keys.labels;
    keys.ref_ids = keys.ids;
  } else {
    TORCH_CHECK(ref->dim() == 2 && ref->size(1) == x.size(1) && ref_labels->dim() == 1 &&
                    ref_labels->size(0) == ref->size(0),
                op, ": expected ref [R, ", x.size(1), "] and ref_labels [R], got ", ref->sizes(), " and ",
                ref_labels->sizes());
    TORCH_CHECK(ids.has_value() == ref_ids.has_value(), op, ": ids and ref_ids go together");
    const int64_t R = ref->size(0);
    keys.ref_labels = int64_keys(*ref_labels);
    keys.ref_ids = ref_ids.has_value() ? int64_keys(*ref_ids) : at::arange(B, B + R, keys.labels.options());
  }
  const int64_t R = ref.has_value() ? ref->size(0) : B;
  TORCH_CHECK(keys.ids.dim() == 1 && keys.ids.size(0) == B && keys.ref_ids.dim() == 1 && keys.ref_ids.size(0) == R,
              op, ": identities must have one entry per row");
  return keys;
}

}  // namespace ms_loss
