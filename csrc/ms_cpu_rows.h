// The row loops of the fused CPU kernel: the per-pair work along one row of a similarity block
// (mining, the mined sums, the pair weights), vectorised, and built for each x86-64 ISA level
// (ms_cpu_rows.cpp). Each loop takes its compile-time flags (mining, storing the weights, the
// self case's symmetry) from a selector, which returns the instantiation for the run-time values;
// the callers decide which rows go where.
#pragma once

#include <cstdint>

#include "ms_math.h"

namespace ms_loss::cpu {

// The reference set of one call: its labels and identities (the self case uses row indices as
// identities, a reference set without identities gets identities that match nothing in x).
struct RefKeys {
  const int64_t* labels;
  const int64_t* ids;
  int64_t size;
};

// Largest pair exponent for which the self case's passes 2 and 3 share one unshifted exponential
// (see symmetric_forward): exp(60) * B stays finite in float32 for any B below 10^12, and exp(-L)
// normal for L up to 87.
constexpr double kSharedExponentLimit = 60;

// Forward for one anchor row s[0..R): mining, then both log(1 + sum exp) terms, into the anchor's
// column of stats [4, B] (minpos, maxneg, LP, LN; rows `stride` apart) and its loss. With `store`
// the row is overwritten with its pair weights dL_i/dS_ij (0 outside the mined sets).
template <typename T>
using ForwardRow = void (*)(T* s, int64_t label, int64_t id, RefKeys ref, Params<T> p, T* stats, int64_t stride,
                            T* loss);
template <typename T>
ForwardRow<T> forward_row_for(bool mining, bool store);

// Backward for one anchor row, in place: s[j] = S_ij on entry, dL/dS_ij on exit, scaled by
// scale_i = grad_i (0 for an anchor that does not count). With `symmetric` (self case), the pair
// seen from anchor j is added too, S_ji = S_ij: the row becomes (G + G^T)_i; stats and scale then
// hold the column anchors' statistics ([4] rows `stride` apart) and scales.
template <typename T>
using BackwardRow = void (*)(T* s, int64_t label, int64_t id, RefKeys ref, AnchorStats<T> a, T scale_i,
                             const T* stats, int64_t stride, const T* scale, Params<T> p);
template <typename T>
BackwardRow<T> backward_row_for(bool mining, bool symmetric);

// The self case's triangle passes over one row of its strictly upper triangle (symmetric_forward):
// s[j] = S_i,c for the columns c = i + 1 + j, j < n; labels, ids and the column arrays start at
// column i + 1. Each pair updates anchor i along the row and anchor c down its column.
//
// Pass 1: anchor i's minpos and maxneg; each column anchor's folded into col_minpos / col_maxneg.
template <typename T>
void extremes_row(const T* s, int64_t n, int64_t label, int64_t id, const int64_t* labels, const int64_t* ids,
                  T* minpos, T* maxneg, T* col_minpos, T* col_maxneg);

// Pass 2: mined sums of exp(exponent - shift): anchor i's into sums[0] (P) and sums[1] (N); each
// column anchor's added to col_sum_p / col_sum_n. a: anchor i's minpos, maxneg, shift_p, shift_n;
// col: the same four for the columns, arrays `stride` apart. `shared`: every shift is 0, and one
// exponential serves both anchors of the pair.
template <typename T>
using MinedSumsRow = void (*)(const T* s, int64_t n, int64_t label, int64_t id, const int64_t* labels,
                              const int64_t* ids, const T* a, const T* col, int64_t stride, Params<T> p, T* sums,
                              T* col_sum_p, T* col_sum_n);
template <typename T>
MinedSumsRow<T> mined_sums_row_for(bool mining, bool shared);

// Pass 3 with one shared exponential: s[j] becomes K_ij = -/+ exp(a_ij) (in_i F_i + in_j F_j), with
// the per-anchor factors F = count * exp(-LP) for a positive pair, count * exp(-LN) for a negative
// one. a: anchor i's minpos, maxneg, F_p, F_n; col: the same four for the columns, `stride` apart.
// Returns the row's non-zeros.
template <typename T>
using SharedWeightsRow = int64_t (*)(T* s, int64_t n, int64_t label, int64_t id, const int64_t* labels,
                                     const int64_t* ids, const T* a, const T* col, int64_t stride, Params<T> p);
template <typename T>
SharedWeightsRow<T> shared_weights_row_for(bool mining);

// The non-zeros of a row.
template <typename T>
int64_t row_nonzeros(const T* row, int64_t cols);

// out[0..dim) = sum_j h[j] * dense[j, 0..dim) over the non-zeros of h, j in order (deterministic).
template <typename T>
void sparse_row_times_dense(const T* h, int64_t cols, const T* dense, int64_t dim, T* out);

}  // namespace ms_loss::cpu
