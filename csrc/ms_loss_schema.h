// The operator schemas, for every library that defines them: ms_loss_cuda (csrc/ms_loss.cpp) and the
// CPU emulation of the CUDA kernels used by the tests (tests/cuda_emulation).
#pragma once

namespace ms_loss {

// Per-anchor losses [B] and statistics [4, B] (minpos, maxneg, LP, LN), both in the compute dtype
// (float32, or float64 for float64 inputs). Without `ref` the reference set is x itself.
constexpr const char* kForwardSchema =
    "ms_loss_forward(Tensor x, Tensor labels, Tensor? ids, Tensor? ref, Tensor? ref_labels, "
    "Tensor? ref_ids, float alpha, float beta, float base, float epsilon, bool mining, "
    "bool skip_incomplete_anchors) -> (Tensor, Tensor)";

// Gradients of sum_i grad_loss[i] * L_i for x and ref (an empty tensor without `ref`, or with
// ref_grad=False: a memory bank takes no gradient, and its product is then never computed).
constexpr const char* kBackwardSchema =
    "ms_loss_backward(Tensor grad_loss, Tensor stats, Tensor x, Tensor labels, Tensor? ids, "
    "Tensor? ref, Tensor? ref_labels, Tensor? ref_ids, float alpha, float beta, float base, "
    "float epsilon, bool mining, bool skip_incomplete_anchors, bool ref_grad=True) -> (Tensor, Tensor)";

}  // namespace ms_loss
