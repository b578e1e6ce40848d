// Fused CPU kernel of the Multi-Similarity loss: the forward and backward ops for the CPU dispatch
// key, which pick how the pair weights travel from the forward to the backward.
//
// The B x R similarity matrix is never held beyond a memory budget (MS_LOSS_CPU_SAVED_MB, default
// 256 MiB). The forward keeps the pair weights G_ij = dL_i/dS_ij (before grad_output g) for the
// backward, after the per-anchor statistics (minpos, maxneg, LP, LN), in one self-describing
// buffer: the op's `stats` output [4 + extra, B] (layout: ms_cpu_saved.h).
// - dense, with a reference set, when B * R weights fit the budget: S is computed whole; each row
//   is mined and reduced and its weights overwrite S in place. The backward never recomputes S:
//   dx = diag(g) G r, dref = G^T diag(g) x, as BLAS products, or as gathers over the non-zeros
//   when mining kept fewer than 1 pair in 16 (ms_cpu_sparse.h).
// - dense, in the self case, when S's strictly upper triangle fits: it holds K = G + G^T, and the
//   backward is g K x (ms_cpu_triangle.h).
// - sparse, when they do not fit but at least 1 pair in 16 does (CSR: offsets, columns, weights),
//   and mining keeps fewer than that (else the gathers would cost more than recomputing):
//   S goes in row chunks as below, each chunk's mined pairs are compacted; the backward is
//   gathers (nnz * D).
// - recompute (beyond that, or when a sparse forward overflows its capacity): rows in chunks of
//   kChunkBytes, one GEMM per chunk (ms_cpu_inputs.h); the backward recomputes each chunk, builds
//   (G + G^T) row by row from the statistics of both ends, and does the product.
// Rows are reduced by vectorised loops (ms_cpu_rows.h; at::parallel_for over rows), every
// reduction has a fixed order, chunks run one after another: results are bitwise repeatable.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ms_cpu_inputs.h"
#include "ms_cpu_rows.h"
#include "ms_cpu_saved.h"
#include "ms_cpu_sparse.h"
#include "ms_cpu_triangle.h"
#include "ms_math.h"

namespace {

using namespace ms_loss::cpu;
using ms_loss::AnchorStats;
using ms_loss::Params;

std::tuple<at::Tensor, at::Tensor> ms_loss_forward_cpu(
    const at::Tensor& x, const at::Tensor& labels, const std::optional<at::Tensor>& ids,
    const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& ref_labels,
    const std::optional<at::Tensor>& ref_ids, double alpha, double beta, double base,
    double epsilon, bool mining, bool skip_incomplete_anchors) {
  const Inputs in = prepare(x, labels, ids, ref, ref_labels, ref_ids);
  const int64_t B = in.x.size(0), R = in.ref.size(0);
  const SavedLayout layout = saved_layout(B, R, in.x.element_size(), in.self_case);
  at::Tensor loss = at::empty({B}, in.x.options());
  at::Tensor stats = large_empty({4 + layout.extra_rows, B}, in.x.options());
  if (B == 0) return {loss, stats};
  AT_DISPATCH_FLOATING_TYPES(in.x.scalar_type(), "ms_loss_forward_cpu", [&] {
    const auto p = make_params<scalar_t>(alpha, beta, base, epsilon, mining, skip_incomplete_anchors);
    const RefKeys keys{in.ref_labels.data_ptr<int64_t>(), in.ref_ids.data_ptr<int64_t>(), R};
    const int64_t* labels_ptr = in.labels.data_ptr<int64_t>();
    const int64_t* ids_ptr = in.ids.data_ptr<int64_t>();
    scalar_t* stats_ptr = stats.data_ptr<scalar_t>();
    scalar_t* loss_ptr = loss.data_ptr<scalar_t>();
    const bool store = layout.mode != SavedMode::kRecompute;
    const auto reduce_rows = [&](int64_t i0, int64_t rows, scalar_t* s_ptr) {
      const auto row = forward_row_for<scalar_t>(mining, store);
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          row(s_ptr + r * R, labels_ptr[i0 + r], ids_ptr[i0 + r], keys, p, stats_ptr + i0 + r, B, loss_ptr + i0 + r);
      });
    };
    if (!store) {
      for_each_chunk(in, [&](int64_t i0, int64_t rows, const at::Tensor& s) { reduce_rows(i0, rows, s.data_ptr<scalar_t>()); });
      return;
    }
    // (every element of stats is written, padding included: the same inputs give the same bits)
    at::Tensor flat = saved_payload(stats, B);
    if (layout.mode == SavedMode::kDense) {
      Saved out = payload_views(flat, in.self_case ? SavedMode::kSymmetric : SavedMode::kDense, B, R);
      const int64_t used = 1 + out.dense.numel();
      flat.narrow(0, used, flat.numel() - used).zero_();
      if (in.self_case) {
        const int64_t nonzeros = symmetric_forward(in, p, out.dense.data_ptr<scalar_t>(), stats_ptr, loss_ptr);
        const bool few = 2 * nonzeros * kSparseDensityInverse < B * B;  // (K's triangle holds half the pairs)
        flat[0] = double(few ? SavedMode::kSymmetricGathers : SavedMode::kSymmetric);
      } else {
        flat[0] = double(SavedMode::kDense);
        at::mm_out(out.dense, in.x, in.ref.t());
        reduce_rows(0, B, out.dense.data_ptr<scalar_t>());
      }
      return;
    }
    // sparse: each chunk's weights compacted into the CSR; an overflow falls back to recomputing
    using index_t = std::conditional_t<sizeof(scalar_t) == 4, int32_t, int64_t>;
    const Saved out = payload_views(flat, SavedMode::kSparse, B, R);
    const int64_t capacity = out.weights.numel();
    index_t* offsets = out.offsets.data_ptr<index_t>();
    index_t* columns = out.columns.data_ptr<index_t>();
    scalar_t* weights = out.weights.data_ptr<scalar_t>();
    offsets[0] = 0;
    bool overflow = false;
    std::vector<int64_t> counts;
    for_each_chunk(in, [&](int64_t i0, int64_t rows, const at::Tensor& s) {
      scalar_t* s_ptr = s.data_ptr<scalar_t>();
      reduce_rows(i0, rows, s_ptr);
      if (overflow) return;
      counts.assign(rows, 0);
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) counts[r] = row_nonzeros(s_ptr + r * R, R);
      });
      int64_t total = int64_t(offsets[i0]);
      for (int64_t r = 0; r < rows; ++r) total += counts[r];
      if (total > capacity || total * kSparseDensityInverse >= B * R) {  // (beyond 1 in 16, GEMMs beat gathers)
        overflow = true;
        return;
      }
      for (int64_t r = 0; r < rows; ++r) offsets[i0 + r + 1] = index_t(int64_t(offsets[i0 + r]) + counts[r]);
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          int64_t at = int64_t(offsets[i0 + r]);
          for (int64_t j = 0; j < R; ++j)
            if (s_ptr[r * R + j] != scalar_t(0)) columns[at] = index_t(j), weights[at++] = s_ptr[r * R + j];
        }
      });
    });
    if (overflow) {
      flat.zero_();
      flat[0] = double(SavedMode::kOverflow);
    } else {
      const int64_t nnz = int64_t(offsets[B]);
      std::fill(columns + nnz, columns + capacity, index_t(0));
      std::fill(weights + nnz, weights + capacity, scalar_t(0));
      const int64_t used = 1 + (B + 1) + 2 * capacity;
      flat.narrow(0, used, flat.numel() - used).zero_();
      flat[0] = double(SavedMode::kSparse);
    }
  });
  return {loss, stats};
}

std::tuple<at::Tensor, at::Tensor> ms_loss_backward_cpu(
    const at::Tensor& grad_loss, const at::Tensor& stats, const at::Tensor& x,
    const at::Tensor& labels, const std::optional<at::Tensor>& ids,
    const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& ref_labels,
    const std::optional<at::Tensor>& ref_ids, double alpha, double beta, double base,
    double epsilon, bool mining, bool skip_incomplete_anchors, bool ref_grad) {
  const Inputs in = prepare(x, labels, ids, ref, ref_labels, ref_ids);
  const int64_t B = in.x.size(0), R = in.ref.size(0);
  const bool want_ref = !in.self_case && ref_grad;
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == B && stats.dim() == 2 && stats.size(0) >= 4 &&
                  stats.size(1) == B,
              "ms_loss_backward: expected grad_loss [B] and stats [4 (+ saved weights), B] with B = ", B);
  const at::Tensor st_all = stats.to(in.x.scalar_type()).contiguous();
  const at::Tensor st = st_all.narrow(0, 0, 4).contiguous();
  const Saved saved = saved_views(st_all, B, R);
  at::Tensor grad_x = at::empty_like(in.x);
  at::Tensor grad_ref = want_ref ? at::zeros_like(in.ref) : at::empty({0}, x.options());
  AT_DISPATCH_FLOATING_TYPES(in.x.scalar_type(), "ms_loss_backward_cpu", [&] {
    const auto p = make_params<scalar_t>(alpha, beta, base, epsilon, mining, skip_incomplete_anchors);
    const RefKeys keys{in.ref_labels.data_ptr<int64_t>(), in.ref_ids.data_ptr<int64_t>(), R};
    const int64_t* labels_ptr = in.labels.data_ptr<int64_t>();
    const int64_t* ids_ptr = in.ids.data_ptr<int64_t>();
    const scalar_t* st_ptr = st.data_ptr<scalar_t>();
    // Per-anchor scale of the pair weights: grad_output of the anchor, 0 if it does not count; and
    // whether every counting anchor has the same finite one, g.
    at::Tensor scale = grad_loss.to(in.x.scalar_type()).contiguous().clone();
    scalar_t* scale_ptr = scale.data_ptr<scalar_t>();
    bool uniform = true, seen = false;
    scalar_t g = 0;
    for (int64_t i = 0; i < B; ++i) {
      if (!ms_loss::anchor_counts(st_ptr[i], st_ptr[B + i], p)) {
        scale_ptr[i] = 0;
        continue;
      }
      if (!seen) g = scale_ptr[i], seen = true;
      uniform = uniform && scale_ptr[i] == g && std::isfinite(g);
    }
    if (saved.mode == SavedMode::kSymmetric || saved.mode == SavedMode::kSymmetricGathers) {
      if (uniform) {  // K holds the counting anchors' weights unscaled: dx = g K x
        if (saved.mode == SavedMode::kSymmetricGathers) {  // over the triangle and its transpose
          const scalar_t* K = saved.dense.data_ptr<scalar_t>();
          const Triangle triangle{B};
          const auto row = [&](int64_t i) { return K + triangle.row_start(i); };
          const auto first = [](int64_t i) { return i + 1; };
          std::vector<int64_t> counts(B);
          at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) counts[i] = row_nonzeros(row(i) + i + 1, B - i - 1);
          });
          std::vector<int64_t> offsets, columns;
          std::vector<scalar_t> weights, same_g(B, g);
          dense_to_csr(row, first, B, B, counts, offsets, columns, weights);
          csr_backward(offsets.data(), columns.data(), weights.data(), B, B, same_g.data(), in, false, grad_x, grad_ref);
        } else {
          symmetric_times(saved.dense, double(g), in.x, grad_x);
        }
        return;
      }  // else the grad_outputs differ: recompute below
    }
    if (saved.mode == SavedMode::kDense) {  // (a reference set: the self case keeps K)
      const scalar_t* G = saved.dense.data_ptr<scalar_t>();
      std::vector<int64_t> counts(B);
      at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) counts[i] = row_nonzeros(G + i * R, R);
      });
      int64_t nonzeros = 0;
      for (int64_t c : counts) nonzeros += c;
      if (nonzeros * kSparseDensityInverse < B * R) {  // mining kept few pairs: gathers, nnz * D
        std::vector<int64_t> offsets, columns;
        std::vector<scalar_t> weights;
        dense_to_csr([&](int64_t i) { return G + i * R; }, [](int64_t) { return int64_t(0); }, B, R, counts,
                     offsets, columns, weights);
        csr_backward(offsets.data(), columns.data(), weights.data(), B, R, scale_ptr, in, want_ref, grad_x, grad_ref);
      } else {  // dx = diag(g) G r, dref = G^T diag(g) x: BLAS products
        at::mm_out(grad_x, saved.dense, in.ref);
        grad_x.mul_(scale.unsqueeze(1));
        if (want_ref) at::mm_out(grad_ref, saved.dense.t(), in.x * scale.unsqueeze(1));
      }
      return;
    }
    if (saved.mode == SavedMode::kSparse) {
      using index_t = std::conditional_t<sizeof(scalar_t) == 4, int32_t, int64_t>;
      csr_backward(saved.offsets.data_ptr<index_t>(), saved.columns.data_ptr<index_t>(),
                   saved.weights.data_ptr<scalar_t>(), B, R, scale_ptr, in, want_ref, grad_x, grad_ref);
      return;
    }
    const auto row = backward_row_for<scalar_t>(mining, in.self_case);
    for_each_chunk(in, [&](int64_t i0, int64_t rows, const at::Tensor& s) {
      scalar_t* s_ptr = s.data_ptr<scalar_t>();
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t i = i0 + r;
          const AnchorStats<scalar_t> a{st_ptr[i], st_ptr[B + i], st_ptr[2 * B + i], st_ptr[3 * B + i]};
          row(s_ptr + r * keys.size, labels_ptr[i], ids_ptr[i], keys, a, scale_ptr[i], st_ptr, B, scale_ptr, p);
        }
      });
      // s now holds dL/dS for the chunk's rows (G_I, or (G + G^T)_I in the self case).
      times_dense<scalar_t>(s, in.ref, grad_x.narrow(0, i0, rows));
      if (want_ref) grad_ref.addmm_(s.t(), in.x.narrow(0, i0, rows));
    });
  });
  return {grad_x.to(x.scalar_type()), want_ref ? grad_ref.to(ref->scalar_type()) : grad_ref};
}

}  // namespace

TORCH_LIBRARY_IMPL(ms_loss_cuda, CPU, m) {
  m.impl("ms_loss_forward", &ms_loss_forward_cpu);
  m.impl("ms_loss_backward", &ms_loss_backward_cpu);
}
