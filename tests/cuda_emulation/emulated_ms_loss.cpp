// The CUDA backend's kernels and host logic (csrc/cuda/ms_loss_kernels.cuh), built by a host compiler
// on top of cuda_on_cpu.h, registered as torch.ops.ms_loss_cuda_emulated.ms_loss_forward/_backward
// for CPU tensors. Built and run by tests/targets.py (target cuda_emulated).
#include "cuda_on_cpu.h"

#include <torch/library.h>

#include "cuda/ms_loss_kernels.cuh"
#include "ms_loss_schema.h"

namespace ms_loss_cuda_kernels {

// Embedding rows are read as 16-byte vectors: on a GPU a misaligned row pointer is a fault.
template <typename Arg>
void check_alignment(const Arg& arg) {
  if constexpr (std::is_pointer_v<Arg>) {
    using T = std::remove_cv_t<std::remove_pointer_t<Arg>>;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>)
      TORCH_CHECK(reinterpret_cast<uintptr_t>(arg) % 16 == 0, "emulated launch: misaligned embedding rows");
  }
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, Args... args) {
  (check_alignment(args), ...);
  // (a GPU refuses an empty grid, and one of more than 65535 blocks along y)
  TORCH_CHECK(grid.x >= 1 && grid.y >= 1 && grid.y <= 65535 && grid.z == 1, "emulated launch: a grid of ",
              grid.x, " x ", grid.y, " x ", grid.z, " blocks");
  for (unsigned y = 0; y < grid.y; ++y)
    for (unsigned x = 0; x < grid.x; ++x) cuda_emulation::run_block(kThreads, dim3(x, y), [&] { kernel(args...); });
}

}  // namespace ms_loss_cuda_kernels

TORCH_LIBRARY(ms_loss_cuda_emulated, m) {
  m.def(ms_loss::kForwardSchema);
  m.def(ms_loss::kBackwardSchema);
}

TORCH_LIBRARY_IMPL(ms_loss_cuda_emulated, CPU, m) {
  m.impl("ms_loss_forward", &ms_loss_cuda_kernels::forward);
  m.impl("ms_loss_backward", &ms_loss_cuda_kernels::backward);
}
