// The self case of the fused CPU kernel with its weights kept: K = G + G^T, each pair once.
//
// S and K (with G's rows of non-counting anchors zeroed) are symmetric, so only the strictly upper
// triangle of S is computed (strips of rows, each from its diagonal block on: half the products)
// and reduced: each S_ij, i < j, once for both anchors, along the row for anchor i (a horizontal
// reduction) and down the column for anchor j (elementwise, into per-strip column partials that are
// combined in strip order: the passes give the same bits for any number of threads; the BLAS
// products, for a given number). Three passes: extremes (minpos, maxneg), mined sums (LP, LN), then
// K_ij in place of S_ij (the diagonal blocks' lower halves are zero). With one grad_output g for
// every counting anchor (the "mean" and "sum" reductions) the backward is dx = g K x, one product
// over the triangle; otherwise it recomputes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "ms_cpu_inputs.h"
#include "ms_math.h"

namespace ms_loss::cpu {

// The forward of the self case: fills stats [4, B] and loss [B], and leaves K in s (a Triangle of
// B). Returns the non-zeros of K's triangle.
template <typename T>
int64_t symmetric_forward(const Inputs& in, Params<T> p, T* s, T* stats, T* loss);

// out = g K x from K's triangle (flat).
void symmetric_times(const at::Tensor& K, double g, const at::Tensor& x, at::Tensor& out);

}  // namespace ms_loss::cpu
