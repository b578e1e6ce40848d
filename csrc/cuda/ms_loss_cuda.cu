// The CUDA dispatch key of torch.ops.ms_loss_cuda.ms_loss_forward/backward (schemas in
// csrc/ms_loss.cpp): kernels and host logic are in ms_loss_kernels.cuh; this file launches them on
// the current CUDA stream, checks every launch, and registers the ops.
//
// Checks: on a GPU, bench/gpu_check.sh runs the parity suite on CUDA tensors and compute-sanitizer
// memcheck/racecheck/synccheck. Without one, tests/test_cuda_compile.py compiles this file with nvcc
// for sm_80 and sm_90 (ptxas: no spills, no stack frame; HMMA in the 16-bit kernels' SASS), and the
// parity suite's cuda_emulated target (tests/targets.py) runs kernels plus host logic on the CPU
// through an emulation of the CUDA features they use (each block's threads as fibers of one thread).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <torch/library.h>

#include "ms_loss_kernels.cuh"

namespace ms_loss_cuda_kernels {

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, Args... args) {
  kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ms_loss_cuda_kernels

namespace {

// Every tensor the kernels read or write must live on x's GPU: a host or foreign pointer in a kernel
// is an illegal address that breaks the CUDA context.
void check_device(const at::Tensor& x, std::initializer_list<std::pair<const char*, const at::Tensor*>> others) {
  TORCH_CHECK(x.is_cuda(), "ms_loss (CUDA): expected CUDA tensors, got x on ", x.device());
  for (const auto& [name, t] : others)
    if (t != nullptr)
      TORCH_CHECK(t->device() == x.device(), "ms_loss (CUDA): ", name, " is on ", t->device(), ", x on ", x.device());
}

const at::Tensor* opt(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

std::tuple<at::Tensor, at::Tensor> ms_loss_forward_cuda(
    const at::Tensor& x, const at::Tensor& labels, const std::optional<at::Tensor>& ids,
    const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& ref_labels,
    const std::optional<at::Tensor>& ref_ids, double alpha, double beta, double base, double epsilon, bool mining,
    bool skip_incomplete_anchors) {
  check_device(x, {{"labels", &labels}, {"ids", opt(ids)}, {"ref", opt(ref)}, {"ref_labels", opt(ref_labels)},
                   {"ref_ids", opt(ref_ids)}});
  const c10::cuda::CUDAGuard guard(x.device());
  return ms_loss_cuda_kernels::forward(x, labels, ids, ref, ref_labels, ref_ids, alpha, beta, base, epsilon, mining,
                                       skip_incomplete_anchors);
}

std::tuple<at::Tensor, at::Tensor> ms_loss_backward_cuda(
    const at::Tensor& grad_loss, const at::Tensor& stats, const at::Tensor& x, const at::Tensor& labels,
    const std::optional<at::Tensor>& ids, const std::optional<at::Tensor>& ref,
    const std::optional<at::Tensor>& ref_labels, const std::optional<at::Tensor>& ref_ids, double alpha, double beta,
    double base, double epsilon, bool mining, bool skip_incomplete_anchors, bool ref_grad) {
  check_device(x, {{"grad_loss", &grad_loss}, {"stats", &stats}, {"labels", &labels}, {"ids", opt(ids)},
                   {"ref", opt(ref)}, {"ref_labels", opt(ref_labels)}, {"ref_ids", opt(ref_ids)}});
  const c10::cuda::CUDAGuard guard(x.device());
  return ms_loss_cuda_kernels::backward(grad_loss, stats, x, labels, ids, ref, ref_labels, ref_ids, alpha, beta,
                                        base, epsilon, mining, skip_incomplete_anchors, ref_grad);
}

}  // namespace

TORCH_LIBRARY_IMPL(ms_loss_cuda, CUDA, m) {
  m.impl("ms_loss_forward", &ms_loss_forward_cuda);
  m.impl("ms_loss_backward", &ms_loss_backward_cuda);
}
