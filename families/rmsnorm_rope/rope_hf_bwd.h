// The HF-style RoPE backward (rope_hf_bwd): dn = R^T(dout), the transpose of the per-head rotation
// that rmsnorm_rope applies after the norm, with the forward's full-width cos/sin tables.
//
// dout and dn [rows = batch * seq, hidden] contiguous, cos and sin [seq, head_dim], row r using
// cos/sin row r % seq. Per head, for j < head_dim / 2 (h = head_dim / 2):
//   dn[j] = dout[j] cos[j] + dout[j + h] sin[j + h],   dn[j + h] = dout[j + h] cos[j + h] - dout[j] sin[j]
//
// Params: dtype {f32, f16, bf16} (dout, dn), cos_dtype {f32, f16, bf16} (f32 or dtype),
// head_dim {64, 80, 96, 128, 256}, block {128, 256, 512} threads, vec {1, 2, 4, 8} rotation
// pairs per work item (vec * sizeof(dtype) <= 16 bytes).
// Problem: RopeHfBwdProblem below.
// Buffers: dout, cos, sin (inputs), dn (output; may be dout).
//
// Heuristic: vec is the widest rotation-pair count whose dout/dn access (vec * sizeof(dtype)) and
// cos/sin access (min(vec * sizeof(cos_dtype), 16) bytes) the buffers' common alignment allows;
// block 256, and a grid that covers every item once (grid-stride beyond 2^31 - 1 blocks).
#pragma once

#include "kiln/family.h"

namespace kiln::families {

// The problem (kiln/problem.h). Keys: rows (bucketed), hidden, head_dim, seq, num_heads, cos_dtype.
struct RopeHfBwdProblem {
  std::int64_t rows = 0;       // tokens: batch * seq rows of dout
  std::int64_t hidden = 0;     // elements per row (num_heads * head_dim)
  std::int64_t head_dim = 0;   // elements per head, and per row of cos and sin
  std::int64_t seq = 0;        // positions per sequence (rows of cos and sin); row r uses r % seq
  std::int64_t num_heads = 0;  // heads per row
  std::int64_t cos_dtype = 0;  // element type of cos and sin, as a DType code
};

struct RopeHfBwdChoice {
  int block;
  int vec;
};
RopeHfBwdChoice rope_hf_bwd_heuristic(const Problem& p);

}  // namespace kiln::families
