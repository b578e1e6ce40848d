// The operator schemas of ms_loss_cuda (defined once; each dispatch key registers its kernels in
// its own file: ms_loss_cpu.cpp for CPU, cuda/ for CUDA). Autograd and fake kernels are registered
// from Python (ms_loss_cuda/ops.py).
#include <Python.h>
#include <torch/library.h>

// Importing ms_loss_cuda._C loads this library, which runs the registrations below.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(ms_loss_cuda, m) {
  // Per-anchor losses [B] and statistics [4, B] (minpos, maxneg, LP, LN), both in the compute
  // dtype (float32, or float64 for float64 inputs). Without `ref` the reference set is x itself.
  m.def(
      "ms_loss_forward(Tensor x, Tensor labels, Tensor? ids, Tensor? ref, Tensor? ref_labels, "
      "Tensor? ref_ids, float alpha, float beta, float base, float epsilon, bool mining, "
      "bool skip_incomplete_anchors) -> (Tensor, Tensor)");
  // Gradients of sum_i grad_loss[i] * L_i for x and ref (an empty tensor without `ref`).
  m.def(
      "ms_loss_backward(Tensor grad_loss, Tensor stats, Tensor x, Tensor labels, Tensor? ids, "
      "Tensor? ref, Tensor? ref_labels, Tensor? ref_ids, float alpha, float beta, float base, "
      "float epsilon, bool mining, bool skip_incomplete_anchors) -> (Tensor, Tensor)");
}
