// FP8 quantization family: x (f32, f16 or bf16, [rows, cols] contiguous) -> q (e4m3 as uint8) and
// f32 scales, bit for bit the rule of common/fp8.h (round to nearest even, saturating at 448,
// scale = max(amax / 448, FLT_MIN), code = e4m3(x / scale)).
//
// Problem: QuantizeFp8Problem {rows, cols, mode, transpose}; mode: 0 amax (per-tensor, first
// pass: atomically raises scale[0], which must hold 0, to amax / 448; q is not written), 1 tensor
// (second pass: quantizes with scale[0] and stores it clamped), 2 row blocks 1x128 (scale
// [rows, ceil(cols/128)]), 3 tile blocks 128x128 (scale [ceil(rows/128), ceil(cols/128)]).
// transpose 1 (modes 1 and 3) writes q as [cols, rows] and the tile scales as
// [ceil(cols/128), ceil(rows/128)].
// Params: dtype {f32, f16, bf16}, mode {amax, tensor, row, tile}, transpose {0, 1}.
// Buffers: x, q, scale.
#pragma once

#include "kiln/family.h"

namespace kiln::families {

// All four fields are keys; rows is the one tuning signatures bucket.
struct QuantizeFp8Problem {
  std::int64_t rows = 0;       // rows of x: its leading dimensions flattened (bucketed key)
  std::int64_t cols = 0;       // elements per row of x (key)
  std::int64_t mode = 0;       // a QuantMode (key)
  std::int64_t transpose = 0;  // 1: q (and tile scales) written transposed (key)
};

enum QuantMode { k_q_amax = 0, k_q_tensor = 1, k_q_row = 2, k_q_tile = 3 };

}  // namespace kiln::families
