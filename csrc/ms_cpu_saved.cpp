// The saved pair weights of the fused CPU kernel (layout in ms_cpu_saved.h): the budget and the
// layout it picks, views of a saved payload, and the buffer that holds it.
//
// The buffer is large (34 MiB at B = 4096 in the self case), and a fresh one costs page faults and
// the kernel's zeroing. Two remedies:
// - transparent huge pages where the kernel gives them on request (THP "madvise" mode): touching
//   fresh memory in 2 MiB pages costs a fraction of 4 KiB pages. The pages are touched here, on
//   every thread: faulted inside a BLAS call instead, huge pages stall its threads.
// - one spare: the last buffer freed is kept for the next forward that fits it (a training loop's
//   steps have one size), which then needs neither. At most one buffer is held between steps.
#include "ms_cpu_saved.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace ms_loss::cpu {
namespace {

// $MS_LOSS_CPU_SAVED_MB in bytes (MiB, a fraction allowed; unset or empty: 256); anything but a
// number from 0 to 2^40 is refused, as the Triton backend refuses a bad MS_LOSS_TRITON_CHUNK_MB.
int64_t saved_budget_bytes() {
  const char* text = std::getenv("MS_LOSS_CPU_SAVED_MB");
  if (text == nullptr || *text == '\0') return int64_t(256) << 20;
  char* end = nullptr;
  const double mb = std::strtod(text, &end);
  while (end != nullptr && std::isspace(static_cast<unsigned char>(*end))) ++end;
  TORCH_CHECK(end != text && *end == '\0' && mb >= 0 && mb < std::ldexp(1.0, 40),
              "MS_LOSS_CPU_SAVED_MB must be a number of MiB >= 0 (0: always recompute), got '", text, "'");
  return int64_t(mb * double(1 << 20));
}

// Rows of stats [_, B] that hold a payload of `elements` (its header included).
int64_t rows_for(int64_t elements, int64_t B) { return (elements + B - 1) / B; }

at::ScalarType index_dtype(const at::Tensor& t) { return t.element_size() == 4 ? at::kInt : at::kLong; }

constexpr size_t kHugePage = size_t(2) << 20;

struct Spare {
  std::mutex mutex;
  void* block = nullptr;
  size_t bytes = 0;
};
Spare& spare() {
  static Spare* the_spare = new Spare();  // (never destroyed: a buffer may come back at exit)
  return *the_spare;
}

void keep_as_spare(void* block, size_t bytes) {
  Spare& s = spare();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::free(s.block);
  s.block = block;
  s.bytes = bytes;
}

}  // namespace

int64_t sparse_capacity(int64_t numel, int64_t B, int64_t elem_size) {
  const int64_t capacity = (numel - 1 - (B + 1)) / 2;
  return elem_size == 4 ? std::min<int64_t>(capacity, std::numeric_limits<int32_t>::max()) : capacity;
}

SavedLayout saved_layout(int64_t B, int64_t R, int64_t elem_size, bool self_case) {
  const int64_t budget = saved_budget_bytes() / elem_size;  // elements
  if (B == 0 || R == 0 || budget <= 0) return {SavedMode::kRecompute, 0};
  if (self_case && Triangle{B}.size() <= budget - 1) return {SavedMode::kDense, rows_for(1 + Triangle{B}.size(), B)};
  if (!self_case && B <= (budget - 1) / R) return {SavedMode::kDense, rows_for(1 + B * R, B)};
  const int64_t capacity = sparse_capacity(budget, B, elem_size);
  if (capacity < B || capacity < B * R / kSparseDensityInverse) return {SavedMode::kRecompute, 0};
  return {SavedMode::kSparse, rows_for(1 + B + 1 + 2 * capacity, B)};
}

at::Tensor saved_payload(const at::Tensor& stats, int64_t B) {
  return stats.view(-1).narrow(0, 4 * B, stats.numel() - 4 * B);
}

Saved payload_views(const at::Tensor& payload, SavedMode mode, int64_t B, int64_t R) {
  Saved saved{mode, {}, {}, {}, {}};
  if (mode == SavedMode::kDense) {
    saved.dense = payload.narrow(0, 1, B * R).view({B, R});
  } else if (mode == SavedMode::kSymmetric || mode == SavedMode::kSymmetricGathers) {
    saved.dense = payload.narrow(0, 1, Triangle{B}.size());
  } else if (mode == SavedMode::kSparse) {
    const int64_t capacity = sparse_capacity(payload.numel(), B, payload.element_size());
    saved.offsets = payload.narrow(0, 1, B + 1).view(index_dtype(payload));
    saved.columns = payload.narrow(0, B + 2, capacity).view(index_dtype(payload));
    saved.weights = payload.narrow(0, B + 2 + capacity, capacity);
  }
  return saved;
}

Saved saved_views(const at::Tensor& stats, int64_t B, int64_t R) {
  if (stats.size(0) == 4 || B == 0) return {SavedMode::kRecompute, {}, {}, {}, {}};
  const at::Tensor payload = saved_payload(stats, B);
  return payload_views(payload, SavedMode(int64_t(payload[0].item<double>())), B, R);
}

at::Tensor large_empty(at::IntArrayRef shape, const at::TensorOptions& options) {
  const size_t needed = size_t(c10::multiply_integers(shape)) * options.dtype().itemsize();
  if (needed < kHugePage) return at::empty(shape, options);
  void* block = nullptr;
  size_t bytes = (needed + kHugePage - 1) / kHugePage * kHugePage;
  {
    Spare& s = spare();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.block != nullptr && s.bytes >= bytes && s.bytes - bytes <= bytes / 4) {
      std::swap(block, s.block);
      bytes = s.bytes;
    }
  }
  if (block == nullptr) {
    block = std::aligned_alloc(kHugePage, bytes);
    TORCH_CHECK(block != nullptr, "ms_loss: out of memory allocating ", bytes, " bytes for the saved pair weights");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(block, bytes, MADV_HUGEPAGE);  // advice only
#endif
    char* first = static_cast<char*>(block);
    at::parallel_for(0, int64_t(bytes / 4096), 512, [&](int64_t begin, int64_t end) {
      for (int64_t page = begin; page < end; ++page) first[page * 4096] = 0;
    });
  }
  return at::from_blob(block, shape, [bytes](void* data) { keep_as_spare(data, bytes); }, options);
}

}  // namespace ms_loss::cpu
