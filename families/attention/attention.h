// Attention forward kernel family "attention" (README.md in this folder): softmax(scale * Q K^T
// [softcapped, masked]) V per (sequence, query head): FlashAttention-2 style on mma.sync (sm_80
// and later), FlashAttention-3 style on wgmma and TMA (sm_90a).
//
// Params: path {mma: the sm_80 kernel (attention_fwd.cuh), wgmma: the sm_90a one
// (attention_fwd_sm90.cuh)}; dtype {f16, bf16}; head_dim (Q and K) and head_dim_v (V and the
// output), as the pairs k_attention_head_dims (k_attention_sm90_head_dims for wgmma) lists;
// warps {4, 8, 12}: each warp owns 16 query rows, so a block holds 16 * warps rows (mma: 4 or 8;
// wgmma: 8 or 12, two or three consumer warpgroups); block_n {32, 64, 128}: keys per K/V tile
// (mma: two tiles in flight, cp.async; wgmma: a ring of attention_sm90_stages tiles, TMA);
// overlap, pingpong {0, 1}: the wgmma kernel's schedule (attention_fwd_sm90.cuh), 0 for mma;
// persistent {0, 1}: wgmma blocks that walk many tiles, one per SM, 0 for mma.
// Problem: AttentionProblem below. Buffers: q, k, v, cu_seqlens_q, cu_seqlens_k (i32 [batch + 1],
// read only when varlen), out, lse (f32; may be null).
//
// Heuristic: 8 warps (128 query rows a block) amortize each K/V tile over as many rows as the
// registers allow; 64-key tiles up to head dim 128, 32-key tiles above (the output accumulator
// grows with head_dim_v and the K/V tiles with both head dims: 32 keys keep the 256-dim variant
// within its registers and two tiles within 164 KiB of shared memory, sm_80's limit). On compute
// capability 9.0, for the head-dim pairs it has, the wgmma kernel instead (README.md: three
// consumers on persistent blocks at 64/64, the serial schedule on persistent blocks at 256/256,
// overlap 1 with attention_sm90_block_n's tile at the others); other head dims, other devices and
// an unknown one (cc 0) keep the sm_80 kernel.
#pragma once

#include <array>
#include <cstdint>
#include <utility>

#include "kiln/family.h"

namespace kiln::families {

// The (head_dim, head_dim_v) pairs the GPU kernels are built for.
inline constexpr std::array<std::pair<std::int64_t, std::int64_t>, 7> k_attention_head_dims = {
    {{64, 64}, {80, 80}, {96, 96}, {128, 128}, {192, 192}, {256, 256}, {192, 128}}};

// The problem (kiln/problem.h). Keys: seqlen_q (bucketed), seqlen_k, batch, heads, kv_heads,
// head_dim, head_dim_v, causal, varlen; values: total_q, total_k, window_left, window_right, scale,
// softcap. Padded layout (varlen 0): q [batch, seqlen_q, heads, head_dim], k [batch, seqlen_k,
// kv_heads, head_dim], v [batch, seqlen_k, kv_heads, head_dim_v], out [batch, seqlen_q, heads,
// head_dim_v], lse [batch, heads, seqlen_q]. Varlen (1): q [total_q, heads, head_dim], k and v
// [total_k, kv_heads, ...], out [total_q, heads, head_dim_v], lse [heads, total_q]; sequence b
// holds tokens cu_seqlens[b] .. cu_seqlens[b + 1] - 1, and seqlen_q / seqlen_k are the longest.
// Query i of a sequence of lq queries and lk keys sees key j iff j < lk and
// i + lk - lq - window_left <= j (window_left >= 0) and j <= i + lk - lq + window_right
// (window_right >= 0): causal is window_right 0, both aligned to the end of the keys.
struct AttentionProblem {
  std::int64_t batch = 0;         // sequences
  std::int64_t seqlen_q = 0;      // queries per sequence (varlen: the longest)
  std::int64_t seqlen_k = 0;      // keys per sequence (varlen: the longest)
  std::int64_t total_q = 0;       // query tokens (rows of q): batch * seqlen_q when padded
  std::int64_t total_k = 0;       // key tokens (rows of k and v)
  std::int64_t heads = 0;         // query heads
  std::int64_t kv_heads = 0;      // key/value heads; heads is a multiple of it (GQA, MQA)
  std::int64_t head_dim = 0;      // elements per head of q and k
  std::int64_t head_dim_v = 0;    // elements per head of v and out
  std::int64_t causal = 0;        // 1: the caller asked for causal (window_right is then 0)
  std::int64_t varlen = 0;        // 1: packed sequences through cu_seqlens_q / cu_seqlens_k
  std::int64_t window_left = -1;  // keys before the diagonal a query sees; -1 unbounded
  std::int64_t window_right = -1; // keys after the diagonal a query sees; -1 unbounded, 0 causal
  double scale = 0;               // multiplies Q K^T (the op's default: 1 / sqrt(head_dim))
  double softcap = 0;             // > 0: scores become softcap * tanh(score / softcap)
};

struct AttentionTile {
  int warps;    // 16 query rows each
  int block_n;  // keys per K/V tile
};
// The heuristic's tile for a head-dim pair.
AttentionTile attention_tile(std::int64_t head_dim, std::int64_t head_dim_v);
// Dynamic shared memory of a variant: the Q tile and two K/V tiles, rows padded by 16 bytes.
std::uint32_t attention_smem_bytes(std::int64_t head_dim, std::int64_t head_dim_v, int warps, int block_n);
// Whether the GPU kernels take (head_dim, head_dim_v).
bool attention_head_dims_supported(std::int64_t head_dim, std::int64_t head_dim_v);

// The sm_90a kernel (path "wgmma", attention_fwd_sm90.cuh): 16 * warps query rows a block (warps 8:
// two consumer warpgroups, 12: three; plus a producer warpgroup), K/V tiles of block_n keys in a
// ring of stages.
// The head-dim pairs it is built for (whole 64-element panels); the others run the sm_80 kernel.
inline constexpr std::array<std::pair<std::int64_t, std::int64_t>, 5> k_attention_sm90_head_dims = {
    {{64, 64}, {128, 128}, {192, 128}, {192, 192}, {256, 256}}};
bool attention_sm90_head_dims_supported(std::int64_t head_dim, std::int64_t head_dim_v);
// Its key tile with two consumers: 128 keys while two stages fit, 64 above (192/192 and 256/256).
int attention_sm90_block_n(std::int64_t head_dim, std::int64_t head_dim_v);
// Its stages: as many as fit 227 KiB, 2 to 4.
int attention_sm90_stages(std::int64_t head_dim, std::int64_t head_dim_v, int warps, int block_n);
// Its dynamic shared memory: 1024 bytes of alignment slack, the Q tile, the stages, the barriers.
std::uint32_t attention_sm90_smem_bytes(std::int64_t head_dim, std::int64_t head_dim_v, int warps, int block_n,
                                        int stages);
// Whether three consumer warpgroups (warps 12) keep a thread's accumulators within the 160
// registers each of them gets, with room for the rest of the loop: the output's head_dim_v / 2,
// the scores' block_n / 2 and, when overlapped (the probabilities of one tile live beside the
// scores of the next), block_n / 4 more: at most 96.
bool attention_sm90_three_consumers_fit(std::int64_t head_dim_v, int block_n, bool overlap);

}  // namespace kiln::families
