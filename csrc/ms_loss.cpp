// The operator schemas of ms_loss_cuda (defined once; each dispatch key registers its kernels in
// its own file: ms_loss_cpu.cpp for CPU, cuda/ for CUDA), and the Python module ms_loss_cuda._C.
// Autograd and fake kernels are registered from Python (ms_loss_cuda/ops.py); the module gives the
// CPU fake kernel the layout rule of the saved pair weights (ms_cpu_saved.h) as a plain function,
// which is safe to call while torch.compile or opcheck trace the op.
#include <Python.h>
#include <torch/library.h>

#include "ms_cpu_saved.h"
#include "ms_loss_schema.h"

namespace {

// cpu_saved_rows(batch, ref_rows, elem_size, self_case) -> int: the rows that the CPU forward adds
// to stats [4, batch] for the pair weights it keeps, under MS_LOSS_CPU_SAVED_MB as set now.
PyObject* cpu_saved_rows(PyObject* /*module*/, PyObject* args) {
  long long batch = 0, ref_rows = 0, elem_size = 0;
  int self_case = 0;
  if (!PyArg_ParseTuple(args, "LLLp:cpu_saved_rows", &batch, &ref_rows, &elem_size, &self_case)) return nullptr;
  if (batch < 0 || ref_rows < 0 || (elem_size != 4 && elem_size != 8)) {
    PyErr_SetString(PyExc_ValueError, "cpu_saved_rows: expected batch, ref_rows >= 0 and elem_size 4 or 8");
    return nullptr;
  }
  return PyLong_FromLongLong(ms_loss::cpu::saved_layout(batch, ref_rows, elem_size, self_case != 0).extra_rows);
}

PyMethodDef methods[] = {
    {"cpu_saved_rows", cpu_saved_rows, METH_VARARGS,
     "cpu_saved_rows(batch, ref_rows, elem_size, self_case) -> int: rows the CPU forward adds to stats [4, B] "
     "for the pair weights it keeps (MS_LOSS_CPU_SAVED_MB as set now)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

// Importing ms_loss_cuda._C loads this library, which runs the registrations below.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(ms_loss_cuda, m) {
  m.def(ms_loss::kForwardSchema);
  m.def(ms_loss::kBackwardSchema);
}
