// The operator schemas of ms_loss_cuda (defined once; each dispatch key registers its kernels in
// its own file: ms_loss_cpu.cpp for CPU, cuda/ for CUDA). Autograd and fake kernels are registered
// from Python (ms_loss_cuda/ops.py).
#include <Python.h>
#include <torch/library.h>

#include "ms_loss_schema.h"

// Importing ms_loss_cuda._C loads this library, which runs the registrations below.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(ms_loss_cuda, m) {
  m.def(ms_loss::kForwardSchema);
  m.def(ms_loss::kBackwardSchema);
}
