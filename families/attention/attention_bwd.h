// Attention backward kernel family "attention_bwd" (README.md in this folder): dQ, dK, dV of the
// attention forward from q, k, v, out, dout and the forward's lse, FlashAttention-2 style on
// mma.sync (sm_80 and later; attention_bwd.cuh).
//
// The backward is three launches of one family, told apart by the problem's `stage` (a key, so the
// heuristic picks the stage's kernel): 0 prep (Dsum = rowsum(dout * out), the dQ accumulator and
// the order counters reset), 1 main (a block per K/V tile of 16 * warps keys loops over the query
// tiles; dK, dV in registers; dQ added to an f32 accumulator, atomically or in key-tile order),
// 2 finish (dQ to the dtype; with GQA dK and dV summed over each KV head's query heads). On
// sm_90a the main stage runs attention_bwd_sm90.cuh (path wgmma: TMA, wgmma, 128 keys a block) at
// head dims 64 and 128, every mode and mask (the deterministic order as the mma.sync kernel's:
// each query tile's key blocks add in ascending order, by the same counters).
// Params: stage {prep, main, finish}; dtype {f16, bf16}; head_dim = head_dim_v in
// k_attention_bwd_head_dims; path {mma, wgmma} (main); warps 4 (64 keys a block); block_m, query
// rows a tile
// (attention_bwd_block_m; the workspace's layout depends on it, so it is fixed by the head dims).
// Buffers: q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, workspace (f32, its layout in
// attention_bwd.cuh; listed as an input: each stage reads what the one before it wrote), dq, dk, dv.
//
// Heuristic: 4 warps, 64 keys a block at every head dim; 64 query rows a tile up to head dim 96
// and 32 at 128: the dK and dV accumulators (head_dim / 2 and head_dim_v / 2 registers a thread
// for 16 keys a warp) and the tiles of S^T and dP^T (block_m / 2 each) must fit 255 registers
// without spills; 192 and 256 would not fit and are not built.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <utility>

#include "kiln/family.h"

namespace kiln::families {

// The (head_dim, head_dim_v) pairs the GPU backward is built for.
inline constexpr std::array<std::pair<std::int64_t, std::int64_t>, 4> k_attention_bwd_head_dims = {
    {{64, 64}, {80, 80}, {96, 96}, {128, 128}}};
bool attention_bwd_head_dims_supported(std::int64_t head_dim, std::int64_t head_dim_v);

// The pairs the sm_90a main kernel (path wgmma: attention_bwd_sm90.cuh) is built for.
inline constexpr std::array<std::pair<std::int64_t, std::int64_t>, 2> k_attention_bwd_sm90_head_dims = {
    {{64, 64}, {128, 128}}};
bool attention_bwd_sm90_head_dims_supported(std::int64_t head_dim, std::int64_t head_dim_v);
// Dynamic shared memory of the sm_90a main kernel, and its ring's stages.
inline constexpr int k_attention_bwd_sm90_stages = 2;
std::uint32_t attention_bwd_sm90_smem_bytes(std::int64_t head_dim, std::int64_t head_dim_v);

// Warps of the main kernel the heuristic picks: 16 keys each.
int attention_bwd_warps(std::int64_t head_dim, std::int64_t head_dim_v);
// Query rows of a tile (also the order counters' granularity): 64, or 32 at head dims above 96,
// whose dK and dV accumulators leave no room for 64-query tiles of S^T and dP^T.
int attention_bwd_block_m(std::int64_t head_dim, std::int64_t head_dim_v);

// The forward's problem (attention.h) without `causal` (window_right 0 says it), plus the mode and
// the stage. Keys: seqlen_q (bucketed), seqlen_k, batch, heads, kv_heads, head_dim, head_dim_v,
// varlen, deterministic, stage; values: total_q, total_k, window_left, window_right, scale, softcap.
struct AttentionBwdProblem {
  std::int64_t batch = 0;
  std::int64_t seqlen_q = 0;
  std::int64_t seqlen_k = 0;
  std::int64_t total_q = 0;
  std::int64_t total_k = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t head_dim_v = 0;
  std::int64_t varlen = 0;
  std::int64_t deterministic = 0;  // 1: dQ summed in key-tile order (bitwise reproducible)
  std::int64_t stage = 1;          // 0 prep, 1 main, 2 finish
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  double scale = 0;
  double softcap = 0;
};

// f32 words of the workspace the GPU stages share: Dsum, the dQ accumulator, the counters and, with
// GQA, dK and dV per query head. The first, Dsum's, rounded up to a multiple of 4 so that the
// accumulator after it is 16-byte aligned.
std::int64_t attention_bwd_dsum_words(const AttentionBwdProblem& a);
std::int64_t attention_bwd_workspace_elements(const AttentionBwdProblem& a);
// Dynamic shared memory of the main kernel.
std::uint32_t attention_bwd_smem_bytes(std::int64_t head_dim, std::int64_t head_dim_v, int warps, int block_m);

// The whole backward on host buffers, fp64 throughout: q, k, v, out, dout, lse, cu_seqlens_q,
// cu_seqlens_k (read when varlen), dq, dk, dv (written entirely: rows no sequence holds are 0).
// D = rowsum(dout * out) from the given out; P = exp(score - lse) from the given lse; a row whose
// lse is -inf (it sees no key) contributes nothing. GQA: dk, dv summed over each KV head's query
// heads. One task per (sequence, KV head) over the hardware threads.
Status attention_backward_reference(const AttentionBwdProblem& a, DType dtype, std::span<void* const> buffers);

// Adds the family to the registry (kiln_register_family_attention calls it).
void register_attention_bwd(Registry& r);

}  // namespace kiln::families
