// RMSNorm forward family: y = x * rsqrt(mean(x^2) + eps) * w, row by row.
//
// Params: dtype {f32, f16, bf16}, block {64 .. 1024} threads, vec {1, 2, 4, 8} elements per
// access (vec * sizeof(dtype) <= 16 bytes).
// Problem: dims = {rows, cols, x_row_stride, y_row_stride} (strides in elements), scalars = {eps}.
// Buffers: x (input), w (input, [cols]), y (output), inv_rms (output, f32 [rows]; may be null:
// then it is not written).
// Heuristic (measured on an H100 with bench section rmsnorm_variants): 8-byte accesses (4-byte
// ones for rows of 64 KiB or more), narrowed until the buffers' alignment and row strides allow
// them; the smallest block of 64..1024 threads giving at most 16 packs per thread.
#pragma once

#include "kiln/family.h"

namespace kiln::families {

enum RmsNormDim { k_rows = 0, k_cols = 1, k_x_stride = 2, k_y_stride = 3 };
enum RmsNormScalar { k_eps = 0 };

// The parameters the heuristic picks for a problem (also used by the typed op's fast path).
struct RmsNormChoice {
  int block;
  int vec;
};
RmsNormChoice rmsnorm_heuristic(const Problem& p);

}  // namespace kiln::families
