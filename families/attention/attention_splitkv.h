// The attention forward's decode path (README.md in this folder, "Decode: split-KV"): kernel
// families "attention_splitkv" and "attention_combine" (attention_splitkv.cuh), and the heuristic
// that sends a problem there or to the one-pass "attention" kernel.
//
// attention_splitkv. Params: dtype {f16, bf16}; head_dim, head_dim_v as k_attention_head_dims;
// warps {1, 2, 4, 8} (16 packed rows each); block_n {32, 64, 128}. Problem:
// AttentionSplitKvProblem. Buffers: q, k, v, cu_seqlens_q, cu_seqlens_k, o_part (f32 [splits,
// total_q, heads, head_dim_v]), lse_part (f32 [splits, total_q, heads]). Grid: (row blocks of
// seqlen_q * heads / kv_heads packed rows) * splits, kv_heads, batch.
// Heuristic: the fewest warps whose rows hold one KV head's packed rows (at most 8); block_n as
// the one-pass kernel's (64 keys up to head dim 128, 32 above).
//
// attention_combine. Params: dtype {f16, bf16}; head_dim_v {64, 80, 96, 128, 192, 256}. Problem:
// AttentionCombineProblem. Buffers: o_part, lse_part (as above), cu_seqlens_q, out, lse (f32;
// may be null), out and lse laid out as the attention family's (lse [total_q, heads] with
// lse_token_major, as the paged decode writes it). On sm_90 it launches as a programmatic
// dependent: its blocks wait (griddepcontrol.wait) for the split kernel before they read.
//
// The paged decode (families/paged_attention) runs the same split kernel with PAGED set, over a
// block table instead of contiguous keys, and this combine.
#pragma once

#include <cstdint>

#include "families/attention/attention.h"
#include "kiln/status.h"

namespace kiln::families {

// The decode path takes at most this many queries per sequence (the longest, for varlen).
inline constexpr std::int64_t k_attention_decode_max_q = 16;
// Keys of fewer than 2 * k_attention_min_split_tiles tiles run the one-pass kernel; a decode has at
// most k_attention_max_splits splits.
inline constexpr std::int64_t k_attention_min_split_tiles = 4;
inline constexpr std::int64_t k_attention_max_splits = 128;

// The fields as AttentionProblem's (without causal, which only orders the one-pass kernel's
// blocks), plus splits (key): the key ranges each row block's visible keys are divided into.
struct AttentionSplitKvProblem {
  std::int64_t batch = 0;
  std::int64_t seqlen_q = 0;  // the longest when varlen
  std::int64_t seqlen_k = 0;
  std::int64_t total_q = 0;
  std::int64_t total_k = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t head_dim_v = 0;
  std::int64_t varlen = 0;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  std::int64_t splits = 1;
  double scale = 0;
  double softcap = 0;
};

struct AttentionCombineProblem {
  std::int64_t batch = 0;
  std::int64_t seqlen_q = 0;  // padded: queries per sequence (lse's last dimension)
  std::int64_t total_q = 0;   // query tokens
  std::int64_t heads = 0;
  std::int64_t head_dim_v = 0;
  std::int64_t varlen = 0;
  std::int64_t splits = 1;
  std::int64_t lse_token_major = 0;  // 1: lse [total_q, heads] (the paged ops'), else as attention's
};

// Blocks of attention_splitkv (paged or not) one SM of compute capability `cc` (0: 9.0) holds at
// once: its shared memory less 1 KiB a block, its threads, and its registers at 255 a thread.
std::int64_t attention_splitkv_blocks_per_sm(std::int64_t head_dim, std::int64_t head_dim_v, int warps, int block_n,
                                             std::int64_t cc, int key_warps = 1);

// How many key ranges to divide `tiles` key tiles into when `row_blocks` blocks share them and
// `slots` blocks run at once (SMs times blocks per SM). A block's time is taken as its tile count
// plus one tile of fixed cost, and blocks run in waves of `slots`: the count minimizes waves times
// a block's time, plus one tile for the combine pass when there are splits; the smallest of equal
// counts wins. At most k_attention_max_splits and `tiles`; 1 when there is nothing to split.
std::int64_t attention_split_count(std::int64_t row_blocks, std::int64_t tiles, std::int64_t slots);

// The split count of the decode path for `a` on a device of `sm_count` multiprocessors (0: the
// reference device, an H100's 132) of compute capability `cc` (0: 9.0), or 0 for the one-pass
// kernel. The decode path takes problems with at most k_attention_decode_max_q queries and at
// least 2 * k_attention_min_split_tiles key tiles (long keys) on head dims the kernels take. Its
// blocks are (row block, KV head, sequence); attention_split_count picks the splits for them.
std::int64_t attention_decode_splits(const AttentionProblem& a, std::int64_t sm_count, std::int64_t cc = 0);

// The decode path's problems for `a` with `splits` key ranges.
AttentionSplitKvProblem attention_splitkv_problem(const AttentionProblem& a, std::int64_t splits);
AttentionCombineProblem attention_combine_problem(const AttentionProblem& a, std::int64_t splits);

// f32 elements of the decode path's workspace: o_part then lse_part, splits * total_q * heads *
// (head_dim_v + 1).
std::int64_t attention_splitkv_workspace_elements(const AttentionProblem& a, std::int64_t splits);

// The splitkv heuristic's warps for `rows` packed rows (queries x the heads of a KV group).
int attention_splitkv_warps(std::int64_t rows);

// The heuristic's key warps for a block of `warps` row warps and `block_n`-key tiles: 2 up to two
// row warps (each K/V tile's keys halved between two warps with their own softmax, so an SM keeps
// twice the warps busy on the same tiles), else 1.
int attention_splitkv_key_warps(int warps, int block_n);

// invalid_argument unless `block_n` divides into `key_warps` whole 16-key steps and the block has
// at most 8 warps; `family` names the error.
Status attention_splitkv_check_warps(const char* family, int warps, int key_warps, int block_n);

}  // namespace kiln::families
