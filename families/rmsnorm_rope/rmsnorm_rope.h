// Fused RMSNorm + RoPE family (rms_norm_rope): per token, normalize the whole hidden row, scale by
// the weight, then rotate every head in the neox layout, writing only the rotated values.
//
// x and y [rows = batch * seq, hidden] contiguous, weight [hidden], cos and sin [seq, head_dim]
// (full head_dim, as HF's rotate_half form: y = n * cos + rotate_half(n) * sin per head), row r
// using cos/sin row r % seq.
//
// Params: dtype {f32, f16, bf16} (x, weight, y), cos_dtype {f32, f16, bf16} (f32 or dtype),
// head_dim {64, 80, 96, 128, 256}, block {64 .. 1024} threads, vec {1, 2, 4, 8} rotation pairs per
// work item (vec * sizeof(dtype) <= 16 bytes).
// Problem: RmsNormRopeProblem below.
// Buffers: x, weight, cos, sin (inputs), y (output; may be x).
//
// Heuristic: vec is the widest rotation-pair count whose x/y access (vec * sizeof(dtype)) and
// cos/sin access (min(vec * sizeof(cos_dtype), 16) bytes) the buffers' common alignment allows:
// 16-byte accesses for aligned tensors. A work item is two packs (a pack in each half of a head),
// and block is the power of two from 64 to 1024 that gives each thread about two items
// (hidden / (2 * vec) items per row; 128 threads at hidden 4096 in bf16), so the row is read once
// and held in registers through the reduction. Two items per thread (128 threads at 32768 x 4096
// bf16) are well ahead of one (256 threads) on Hopper; docs/benchmarks.md has the figures.
#pragma once

#include "kiln/family.h"

namespace kiln::families {

// The problem (kiln/problem.h). Keys: rows (bucketed), hidden, head_dim, seq, num_heads,
// cos_dtype; value: eps.
struct RmsNormRopeProblem {
  std::int64_t rows = 0;       // tokens: batch * seq rows of x
  std::int64_t hidden = 0;     // elements per row (num_heads * head_dim)
  std::int64_t head_dim = 0;   // elements per head, and per row of cos and sin
  std::int64_t seq = 0;        // positions per sequence (rows of cos and sin); row r uses r % seq
  std::int64_t num_heads = 0;  // heads per row
  std::int64_t cos_dtype = 0;  // element type of cos and sin, as a DType code
  double eps = 0;              // added to the mean square
};

// Dynamic shared memory for the weight, which the kernel stages before its first reduction: the
// row's bytes when the row fits the register cache and packs are 4 bytes or more (cp.async), else 0
// (the weight is then read after each reduction).
std::int64_t rmsnorm_rope_weight_smem(const Params& params, const Problem& p);

struct RmsNormRopeChoice {
  int block;
  int vec;
};
RmsNormRopeChoice rmsnorm_rope_heuristic(const Problem& p);

}  // namespace kiln::families
