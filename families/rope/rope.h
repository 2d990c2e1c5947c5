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
// Problem: dims = {tokens, q_heads, kv_heads, head_dim, layout (0 neox, 1 gptj), max_pos};
// scalars = {q_stride, k_stride, q_out_stride, k_out_stride}: token strides in elements, integers
// held as doubles. The strides are per-call values the kernel reads; what they imply for the
// variant (their alignment) is in Problem::alignment, so they never pick a different kernel and
// stay out of the fast path's shape key.
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

enum RopeDim { k_rope_tokens = 0, k_rope_q_heads = 1, k_rope_kv_heads = 2, k_rope_head_dim = 3, k_rope_layout = 4,
               k_rope_max_pos = 5 };
enum RopeScalar { k_rope_q_stride = 0, k_rope_k_stride = 1, k_rope_q_out_stride = 2, k_rope_k_out_stride = 3 };
enum RopeLayoutCode : std::int64_t { k_rope_neox = 0, k_rope_gptj = 1 };

struct RopeChoice {
  int vec;
  int block;
};
RopeChoice rope_heuristic(const Problem& p);

}  // namespace kiln::families
