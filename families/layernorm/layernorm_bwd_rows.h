// LayerNorm backward for calls of a few rows (layernorm_bwd_rows): dx, dweight and dbias in one
// launch, one thread-block cluster with a block per row, the column sums taken through distributed
// shared memory (families/layernorm/layernorm_bwd_rows.cuh). layer_norm_backward takes it for 1 to
// 8 rows of whole 16-byte packs, at most 2048 of them, where the two-stage backward (layernorm_bwd,
// then a reduction for each of dweight and dbias) costs three launches.
//
// Params: dtype {f32, f16, bf16}; block {32 .. 1024} threads; vec {4, 8} (16 bytes); packs {1, 2}
// packs per thread; cluster {1, 2, 4, 8} blocks (at least the row count; above 1, sm_90 and later).
// Problem (LayerNormBwdRowsProblem): keys rows (bucketed), cols and the row strides of dy, x and dx.
// Buffers: dy, x, weight ([cols]), mean and rstd (f32 [rows]) in; dx, dweight, dbias ([cols]; may be
// null) out.
// Heuristic: 16-byte accesses; one pack per thread up to 1024 packs, else two; the smallest block
// from 32 threads that holds the row; the smallest cluster that holds the rows.
#pragma once

#include "kiln/family.h"

namespace kiln::families {

struct LayerNormBwdRowsProblem {
  std::int64_t rows = 0;           // key, bucketed: rows of dy, x and dx (at most the cluster)
  std::int64_t cols = 0;           // key: elements per row
  std::int64_t dy_row_stride = 0;  // key: elements between two rows of dy
  std::int64_t x_row_stride = 0;   // key: of x
  std::int64_t dx_row_stride = 0;  // key: of dx
};

// Whether the heuristic's variant holds p (16-byte aligned buffers and row strides, whole packs, at
// most 2048 of them, 1 to 8 rows) on a device whose largest cluster is `max_cluster`.
bool layernorm_bwd_rows_fits(const Problem& p, int max_cluster);

}  // namespace kiln::families
