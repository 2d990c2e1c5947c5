// LayerNorm kernel families (README.md in this folder): "layernorm" (forward) and "layernorm_bwd"
// (the backward's row pass; the slab sums of dweight and dbias are reduced by rmsnorm_bwd_reduce).
//
// layernorm params: dtype {f32, f16, bf16}; block {128, 256, 512, 1024} threads, one block per
// row; vec {1, 2, 4, 8} elements per access (at most 16 bytes); packs {1, 2, 4, 8} packs per
// thread held in registers (packs * vec <= 32). A variant runs rows of up to block * packs * vec
// elements, cols and the row strides multiples of vec.
// Problem: LayerNormProblem below. Buffers: x, weight, bias (may be null), y, mean and rstd (f32
// [rows], may be null).
//
// layernorm_bwd params: dtype, block {128, 256, 512}, vec, packs {1, 2, 4} (packs * vec <= 16 at
// 512 threads, 32 below). Problem: LayerNormBwdProblem below. Buffers: dy, x, weight, mean, rstd,
// dx, partial (f32 [2 * slabs, cols]: dweight's slab sums, then dbias's).
//
// Heuristic: 8-byte accesses where the alignment and row length allow (the tuner found them ahead
// of 16-byte ones on Hopper). Forward: up to 8 packs a thread, as few threads as the row then
// needs. Backward, which waits on two block reductions a row: up to 512 threads, as many as the
// row has packs, then more packs a thread. docs/benchmarks.md has the measurements.
#pragma once

#include <cstdint>

#include "kiln/family.h"

namespace kiln::families {

// layernorm's problem (kiln/problem.h). Keys: rows (bucketed), cols, x_row_stride, y_row_stride;
// value: eps.
struct LayerNormProblem {
  std::int64_t rows = 0;          // rows to normalize
  std::int64_t cols = 0;          // elements per row (the weight's and bias's length)
  std::int64_t x_row_stride = 0;  // elements between the starts of two rows of x
  std::int64_t y_row_stride = 0;  // elements between the starts of two rows of y
  double eps = 0;                 // added to the variance
};

// layernorm_bwd's problem. Keys: rows (bucketed), cols, the three row strides, slabs.
struct LayerNormBwdProblem {
  std::int64_t rows = 0;           // rows of dy, x and dx
  std::int64_t cols = 0;           // elements per row
  std::int64_t dy_row_stride = 0;  // elements between two rows of dy
  std::int64_t x_row_stride = 0;   // elements between two rows of x
  std::int64_t dx_row_stride = 0;  // elements between two rows of dx
  std::int64_t slabs = 0;          // blocks, each taking consecutive rows; rows of partial per gradient
};

// The heuristic's variant of either kernel for p; invalid_argument when no variant holds a row of
// p's length (longer than the family's register budget).
Result<Params> layernorm_choice(const Problem& p, bool backward);
// The backward's slab count for `rows` rows on a GPU of `sms` SMs.
std::int64_t layernorm_bwd_slabs(std::int64_t rows, int sms);

}  // namespace kiln::families
