// Products of the fused CPU backward with pair weights that are mostly zero: below 1 non-zero in
// kSparseDensityInverse, gathers over the non-zeros (nnz * D work) replace the GEMMs. The weights
// come as CSR (offsets, columns, values), compacted from dense rows or saved so by the forward; the
// transpose that the second product needs is a counting sort. Rows run in parallel, each row's
// entries in order: the results are deterministic.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ms_cpu_inputs.h"
#include "ms_cpu_rows.h"
#include "ms_cpu_saved.h"

namespace ms_loss::cpu {

// out = h @ dense, h [rows, cols] contiguous: the sparse loop when h has few non-zeros, else a GEMM.
template <typename T>
void times_dense(const at::Tensor& h, const at::Tensor& dense, at::Tensor out) {
  if (at::count_nonzero(h).item<int64_t>() * kSparseDensityInverse < h.numel()) {
    const int64_t cols = h.size(1), dim = dense.size(1);
    const T* h_ptr = h.data_ptr<T>();
    at::parallel_for(0, h.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        sparse_row_times_dense(h_ptr + r * cols, cols, dense.data_ptr<T>(), dim, out.data_ptr<T>() + r * dim);
    });
  } else {
    at::mm_out(out, h, dense);
  }
}

// CSR from rows' non-zero counts: offsets [rows + 1], columns, values. Row r's entries are
// row(r)[j] for j in [first(r), cols).
template <typename T, typename Row, typename First>
void dense_to_csr(Row row, First first, int64_t rows, int64_t cols, const std::vector<int64_t>& counts,
                  std::vector<int64_t>& offsets, std::vector<int64_t>& columns, std::vector<T>& values) {
  offsets.assign(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) offsets[r + 1] = offsets[r] + counts[r];
  columns.resize(offsets[rows]);
  values.resize(offsets[rows]);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t at = offsets[r];
      const T* h = row(r);
      for (int64_t j = first(r); j < cols && at < offsets[r + 1]; ++j)  // (stops after the row's last)
        if (h[j] != T(0)) columns[at] = j, values[at++] = h[j];
    }
  });
}

// CSR of rows_count rows -> CSR of its transpose (cols_count rows), entries of each new row in the
// order of the old rows: a counting sort, deterministic.
template <typename I, typename T>
void transpose_csr(const I* offsets, const I* columns, const T* weights, int64_t rows_count, int64_t cols_count,
                   std::vector<int64_t>& t_offsets, std::vector<int64_t>& t_rows, std::vector<T>& t_weights) {
  const int64_t nnz = int64_t(offsets[rows_count]);
  t_offsets.assign(cols_count + 1, 0);
  for (int64_t k = 0; k < nnz; ++k) ++t_offsets[int64_t(columns[k]) + 1];
  for (int64_t c = 0; c < cols_count; ++c) t_offsets[c + 1] += t_offsets[c];
  std::vector<int64_t> next(t_offsets.begin(), t_offsets.end() - 1);
  t_rows.resize(nnz);
  t_weights.resize(nnz);
  for (int64_t r = 0; r < rows_count; ++r)
    for (int64_t k = int64_t(offsets[r]); k < int64_t(offsets[r + 1]); ++k) {
      const int64_t at = next[int64_t(columns[k])]++;
      t_rows[at] = r;
      t_weights[at] = weights[k];
    }
}

// out[r] (+)= factor[r] * sum_k w[k] * row_scale[idx[k]] * dense[idx[k]] over row r's entries.
template <typename O, typename I, typename T>
void csr_times_dense(const O* offsets, const I* idx, const T* w, int64_t rows, const T* row_scale,
                     const T* factor, const T* dense, int64_t dim, T* out, bool accumulate) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> acc(dim);
    for (int64_t r = begin; r < end; ++r) {
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t k = int64_t(offsets[r]); k < int64_t(offsets[r + 1]); ++k) {
        const int64_t j = int64_t(idx[k]);
        const T c = w[k] * (row_scale != nullptr ? row_scale[j] : T(1));
        const T* d = dense + j * dim;
        T* a = acc.data();
#pragma omp simd
        for (int64_t q = 0; q < dim; ++q) a[q] += c * d[q];
      }
      const T f = factor != nullptr ? factor[r] : T(1);
      T* o = out + r * dim;
      for (int64_t q = 0; q < dim; ++q) o[q] = (accumulate ? o[q] : T(0)) + f * acc[q];
    }
  });
}

// The backward from the pair weights G in CSR (rows: anchors): dx_i = g_i sum_j G_ij r_j, plus
// sum_k g_k G_ki x_k in the self case; dref_j = sum_i g_i G_ij x_i. Gathers only (the transpose is
// a counting sort): nnz * D work, deterministic.
template <typename T, typename O, typename I>
void csr_backward(const O* offsets, const I* columns, const T* weights, int64_t B, int64_t R, const T* g,
                  const Inputs& in, bool want_ref, at::Tensor& grad_x, at::Tensor& grad_ref) {
  const int64_t D = in.x.size(1);
  csr_times_dense(offsets, columns, weights, B, static_cast<const T*>(nullptr), g, in.ref.data_ptr<T>(), D,
                  grad_x.data_ptr<T>(), false);
  if (!in.self_case && !want_ref) return;
  std::vector<int64_t> t_offsets, t_rows;
  std::vector<T> t_weights;
  transpose_csr(offsets, columns, weights, B, R, t_offsets, t_rows, t_weights);
  at::Tensor target = in.self_case ? grad_x : grad_ref;
  csr_times_dense(t_offsets.data(), t_rows.data(), t_weights.data(), R, g, static_cast<const T*>(nullptr),
                  in.x.data_ptr<T>(), D, target.data_ptr<T>(), in.self_case);
}

}  // namespace ms_loss::cpu
