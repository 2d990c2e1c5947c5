// RMSNorm backward for calls of a few rows (rmsnorm_bwd_rows): dx and dw in one launch, one
// thread-block cluster with a block per row, dw summed over the cluster through distributed shared
// memory (families/rmsnorm_bwd/rmsnorm_bwd_rows.cuh). The typed ops take it for 1 to 8 rows of
// whole 16-byte packs, at most 1024 of them, where the two-stage backward (rmsnorm_bwd, then
// rmsnorm_bwd_reduce) costs two launches.
//
// Params: dtype {f32, f16, bf16}; block {32 .. 1024} threads; vec {4, 8} elements per access (16
// bytes); packs {1, 2} packs per thread (at most block * packs packs a row); cluster {1, 2, 4, 8}
// blocks (at least the row count; above 1, sm_90 and later); recompute {0, 1} and dh {0, 1}, which
// follow the problem, as in rmsnorm_bwd.
// Problem (RmsNormBwdRowsProblem): keys rows (bucketed), cols, the row strides of dy, x, dx and dh
// (0: no dh), recompute; value eps. Buffers: dy, x, w ([cols]), inv_rms (f32 [rows]; none with
// recompute) in; dx, dw ([cols]) out; dh in (may be left out without dh).
// Heuristic: 16-byte accesses; one pack per thread up to 1024 packs, else two; the smallest block
// from 32 threads that holds the row; the smallest cluster that holds the rows.
#pragma once

#include "kiln/family.h"

namespace kiln::families {

struct RmsNormBwdRowsProblem {
  std::int64_t rows = 0;           // key, bucketed: rows of dy, x and dx (at most the cluster)
  std::int64_t cols = 0;           // key: elements per row
  std::int64_t dy_row_stride = 0;  // key: elements between two rows of dy
  std::int64_t x_row_stride = 0;   // key: of x
  std::int64_t dx_row_stride = 0;  // key: of dx
  std::int64_t dh_row_stride = 0;  // key: of dh, added to dx; 0: no dh
  std::int64_t recompute = 0;      // key: 1 computes inv_rms from x (the inv_rms buffer is not read)
  double eps = 0;                  // value: added to mean(x^2) with recompute
};

// Whether the heuristic's variant holds p (16-byte aligned buffers and row strides, whole packs,
// at most 2048 of them, 1 to 8 rows: few_rows_shape) on a device whose largest cluster is
// `max_cluster` (1 without clusters).
bool rmsnorm_bwd_rows_fits(const Problem& p, int max_cluster);

}  // namespace kiln::families
