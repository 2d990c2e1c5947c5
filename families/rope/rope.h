// RoPE family: rotary position embedding of q and k in one launch (apply_rope_qk).
//
// q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim] (heads contiguous within a
// token, tokens strided), cos and sin [max_pos, head_dim / 2] in f32, position ids i64 [tokens].
// Pair (a, b) of a head rotates by the angle of its pair index i at the token's position:
// a' = a cos - b sin, b' = b cos + a sin; neox pairs (i, i + head_dim/2), gptj pairs (2i, 2i+1).
//
// Params: dtype {f32, f16, bf16} (q, k and the outputs), head_dim {64, 80, 96, 128, 256},
// layout {neox, gptj}, vec {1, 2, 4, 8} rotation pairs per work item (vec * sizeof(dtype) <= 16
// bytes), block {64, 128, 256, 512} threads.
// Problem (RopeProblem): keys tokens (bucketed), q_heads, kv_heads, head_dim, layout, max_pos;
// values q_stride, k_stride, q_out_stride, k_out_stride, the token strides in elements. The
// strides are per-call values the kernel reads; what they imply for the variant (their alignment)
// is in Problem::alignment, so they never pick a different kernel and stay out of the fast path's
// shape key.
// Buffers: q, k, cos, sin, position_ids (inputs), q_out, k_out (outputs); q_out and k_out may be q
// and k themselves (in place).
//
// Heuristic: vec is the widest rotation-pair count, up to 16-byte q/k packs, whose q/k access
// (vec * sizeof(dtype)) and cos/sin access (min(vec * 4, 16) bytes) the buffers' common alignment
// allows. gptj items take their two packs at the same offsets as neox rather than adjacent (where
// each warp-wide access would touch every other 16 bytes and 8-byte packs would do best), so both
// layouts run best with 16-byte packs; docs/benchmarks.md has the figures.
// block is 256 threads when the problem has at least 256 * 264 work items (two blocks per SM on a
// 132-SM H100 with every thread busy), else 128, so that small problems (decode) spread over more
// SMs; block size makes no measurable difference at 4096 and 32768 tokens. One work item per
// thread: each moves two vec-wide loads and two stores, which keeps enough bytes in flight at full
// occupancy.
#pragma once

#include "kiln/family.h"

namespace kiln::families {

// The rope problem. Keys: they pick the variant and make up the tuning signature.
// Values: per-call token strides, which only the checks, the arguments and the buffer sizes read.
struct RopeProblem {
  std::int64_t tokens = 0;        // key, bucketed: tokens to rotate
  std::int64_t q_heads = 0;       // key: query heads per token
  std::int64_t kv_heads = 0;      // key: key heads per token
  std::int64_t head_dim = 0;      // key: elements per head
  std::int64_t layout = 0;        // key: RopeLayoutCode (0 neox, 1 gptj)
  std::int64_t max_pos = 0;       // key: rows of cos and sin; position ids lie in [0, max_pos)
  std::int64_t q_stride = 0;      // value: elements between two tokens of q
  std::int64_t k_stride = 0;      // value: elements between two tokens of k
  std::int64_t q_out_stride = 0;  // value: elements between two tokens of q_out
  std::int64_t k_out_stride = 0;  // value: elements between two tokens of k_out
};
enum RopeLayoutCode : std::int64_t { k_rope_neox = 0, k_rope_gptj = 1 };

struct RopeChoice {
  int vec;
  int block;
};
RopeChoice rope_heuristic(const Problem& p);

}  // namespace kiln::families
