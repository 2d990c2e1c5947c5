// Kernel families of the paged KV cache (README.md in this folder):
//
// reshape_and_cache (paged_cache.cuh). Params: dtype {f16, bf16} (key and value); cache {same,
// fp8_e4m3}. Problem: ReshapeAndCacheProblem. Buffers: key, value, slot_mapping (i32 or i64),
// key_cache, value_cache (the dtype, or u8 holding e4m3), k_scale, v_scale (f32 [1]; read only
// for fp8). Grid: 4 tokens a block of 128 threads. One variant per dtype and cache; the
// heuristic's cache is the problem's fp8 field.
//
// copy_blocks (paged_cache.cuh). Params: vec_bytes {16}. Problem: CopyBlocksProblem. Buffers:
// src_key, src_value (u8 bytes of the source pool, src_blocks blocks), dst_key, dst_value (the
// destination pool, num_blocks blocks; the same memory as the source for copy-on-write, another
// pool, pinned host memory included, for swapping), pairs (i32 or i64 [pairs, 2]). Grid: (pair,
// key or value, chunk of 256 x 16 bytes).
//
// merge_state (paged_cache.cuh). Params: dtype {f16, bf16}. Problem: MergeStateProblem. Buffers:
// v_a, s_a, v_b, s_b, v_out, s_out (v_out and s_out may be v_a and s_a). Grid: 4 rows a block.
//
// paged_decode: the attention decode path's split kernel (attention/attention_splitkv.cuh with
// PAGED) over a block table, then attention_combine. Params as attention_splitkv's: dtype; head_dim
// (head_dim_v equal to it); warps {1, 2, 4, 8}; block_n {32, 64, 128}. Problem:
// PagedDecodeProblem. Buffers: q, k_cache, v_cache, cu_seqlens_q (i32 [batch + 1], read when
// varlen), block_tables (i32 [batch, max_blocks]), seq_lens (i32 [batch]), o_part, lse_part (f32,
// as attention_splitkv's). Heuristic: as attention_splitkv's (the fewest warps whose rows hold a KV
// head's packed rows, at most 8; 64-key tiles up to head dim 128, 32 above); the split count is
// the caller's (paged_decode_splits).
#pragma once

#include <cstdint>

#include "kiln/family.h"

namespace kiln::families {

// Page sizes the cache and the kernels take (tokens per block).
bool paged_page_size_supported(std::int64_t page_size);

struct ReshapeAndCacheProblem {
  std::int64_t tokens = 0;        // rows of key and value
  std::int64_t row_elems = 0;     // kv_heads * head_dim
  std::int64_t slots = 0;         // num_blocks * page_size: rows of each cache
  std::int64_t key_stride = 0;    // elements between two tokens of key
  std::int64_t value_stride = 0;  // elements between two tokens of value
  std::int64_t slot_i64 = 0;      // 1: slot_mapping is int64, 0: int32
  std::int64_t fp8 = 0;           // 1: the caches hold e4m3 bytes (x / scale)
};

struct CopyBlocksProblem {
  std::int64_t pairs = 0;        // (src, dst) pairs
  std::int64_t block_bytes = 0;  // bytes of one block of one cache (K or V)
  std::int64_t num_blocks = 0;   // blocks of the destination pool
  std::int64_t pairs_i64 = 0;    // 1: pairs is int64, 0: int32
  std::int64_t src_blocks = 0;   // blocks of the source pool (num_blocks when it is the same pool)
};

struct MergeStateProblem {
  std::int64_t rows = 0;  // tokens * heads
  std::int64_t head_dim = 0;
};

// q [total_q, heads, head_dim] (varlen: request b's queries are rows cu_seqlens_q[b] ..
// cu_seqlens_q[b + 1] - 1; otherwise seqlen_q rows each), k_cache and v_cache [num_blocks,
// page_size, kv_heads, head_dim], block_tables [batch, max_blocks], seq_lens [batch] (keys of
// each request, at most max_seq_len <= max_blocks * page_size). Queries are the last tokens of
// their request's keys: with lq queries and lk keys, query i sees key j iff j < lk, and j <= i +
// lk - lq + window_right (window_right >= 0), j >= i + lk - lq - window_left (window_left >= 0).
struct PagedDecodeProblem {
  std::int64_t batch = 0;
  std::int64_t seqlen_q = 0;     // queries per request (varlen: the most)
  std::int64_t max_seq_len = 0;  // the longest request's keys
  std::int64_t total_q = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t varlen = 0;
  std::int64_t num_blocks = 0;
  std::int64_t page_size = 0;
  std::int64_t max_blocks = 0;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  std::int64_t splits = 1;
  double scale = 0;
  double softcap = 0;
  // 1: the kernel before this one in the stream writes nothing this one reads (the cascade's
  // prefix pass before its own pass): on sm_90 the blocks start beside it and wait for it only
  // before they end. 0: they wait for it before they read anything.
  std::int64_t overlap_previous = 0;
};

// The split count for a paged decode batch on `sm_count` SMs (0: an H100's 132) of compute
// capability `cc` (0: 9.0): blocks are (row block, KV head, request), the key tiles those of the
// longest request, and attention_split_count picks the splits (attention_decode_splits' rule
// without its one-pass fallback).
std::int64_t paged_decode_splits(std::int64_t batch, std::int64_t max_seqlen_q, std::int64_t heads,
                                 std::int64_t kv_heads, std::int64_t head_dim, std::int64_t max_seq_len,
                                 std::int64_t sm_count, std::int64_t cc = 0);

// f32 elements of the paged decode's workspace (o_part then lse_part): splits * total_q * heads *
// (head_dim + 1).
std::int64_t paged_decode_workspace_elements(std::int64_t splits, std::int64_t total_q, std::int64_t heads,
                                             std::int64_t head_dim);

}  // namespace kiln::families
