// The paged KV cache's typed ops (C++). From C and Python they are the declared ops
// "reshape_and_cache", "copy_blocks", "swap_blocks", "merge_state", "merge_state_in_place" and "paged_decode"
// (kiln_op_call, kiln.<name>, torch.ops.kiln.<name>; kiln.torch adds BatchDecodeWithPagedKVCache
// and the cascade wrapper). README.md in this folder and docs/serving.md describe them.
//
// Cache layout (vLLM's flash layout): key_cache and value_cache [num_blocks, page_size, kv_heads,
// head_dim], page_size 1, 8, 16, 32, 64 or 128; token p of a request is row p % page_size of block
// table[p / page_size], its slot block * page_size + p % page_size (what KVCacheManager hands out).
//
// Host tensors run the fp64 references and check every index (slots, block ids, table entries,
// lengths); CUDA tensors are checked for everything the host knows (shapes, dtypes, devices,
// alignment, the bounds given as scalars) before anything is compiled or launched, and their index
// contents must satisfy the same (plan_paged_decode checks them once per batch on the host).
#pragma once

#include <cstdint>
#include <span>

#include "kiln/runtime.h"

namespace kiln {

// Writes token t's key and value rows ([tokens, kv_heads, head_dim]; rows at any stride, each row
// contiguous) into slot slot_mapping[t] (int32 or int64 [tokens]; negative: skipped) of key_cache
// and value_cache. The caches are of key's dtype, or u8 holding fp8 e4m3: then k_scale and v_scale
// (f32 [1], on the caches' device) are required and each element is stored as e4m3(x / scale)
// (round to nearest even, saturated to +-448: dequantize as code * scale). f16 and bf16 on CUDA
// (f32 on the host too); kv_heads * head_dim a multiple of 8, rows 16-byte aligned.
// Errors: shape_mismatch, unsupported_dtype, device_error, invalid_argument (a slot past the cache,
// on the host).
Status reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& slot_mapping,
                         const TensorView& key_cache, const TensorView& value_cache,
                         const TensorView* k_scale = nullptr, const TensorView* v_scale = nullptr,
                         Stream stream = nullptr, Runtime* runtime = nullptr);

// Copies block src to block dst of both caches for each row (src, dst) of pairs (int32 or int64
// [n, 2]; KVCacheManager's SlotPlan::copies). Pairs must not chain (a dst that is another pair's
// src) or repeat a dst: the copies run in parallel. Host tensors check that and every block id
// (invalid_argument). Caches of any dtype, [num_blocks, page_size, kv_heads, head_dim], a block a
// multiple of 16 bytes.
Status copy_blocks(const TensorView& key_cache, const TensorView& value_cache, const TensorView& pairs,
                   Stream stream = nullptr, Runtime* runtime = nullptr);

// Swapping: for each row (src, dst) of pairs, block dst of the destination pool (dst_key,
// dst_value) becomes a copy of block src of the source pool, in one launch on `stream`: a GPU pool
// to page-locked host memory (KVCacheManager::swap_out's pairs), host back to the GPU (swap_in's),
// or one GPU pool to another. The pools' blocks have one shape and dtype ([blocks, page_size,
// kv_heads, head_dim], their first dimensions may differ); each pool's K and V sit on one side.
// Host memory must be page-locked (the kernel reaches it over the bus), else invalid_argument; the
// copy is asynchronous: host memory is read or written when the stream gets there. Pairs on the
// host are checked (ids inside their pools, no destination twice; invalid_argument); pairs in
// device memory are the caller's to get right. Both pools on the host: a plain copy now.
Status swap_blocks(const TensorView& src_key, const TensorView& src_value, const TensorView& dst_key,
                   const TensorView& dst_value, const TensorView& pairs, Stream stream = nullptr,
                   Runtime* runtime = nullptr);

// Merges two attention states over disjoint key sets: v [tokens, heads, head_dim] (f16, bf16; f32
// on the host), s [tokens, heads] f32 (natural-log lse, -inf for none). s_out = log(exp(s_a) +
// exp(s_b)), v_out = (exp(s_a - s_out) v_a + exp(s_b - s_out) v_b); both empty: zeros and -inf.
Status merge_state(const TensorView& v_a, const TensorView& s_a, const TensorView& v_b, const TensorView& s_b,
                   const TensorView& v_out, const TensorView& s_out, Stream stream = nullptr,
                   Runtime* runtime = nullptr);
// The same into (v, s): v and s become the merge of themselves with (v_other, s_other).
Status merge_state_in_place(const TensorView& v, const TensorView& s, const TensorView& v_other,
                            const TensorView& s_other, Stream stream = nullptr, Runtime* runtime = nullptr);

struct PagedDecodeOptions {
  double scale = 0;               // multiplies q k^T; 0: 1 / sqrt(head_dim)
  bool causal = false;            // query i sees keys up to i + seq_len - queries (aligned to the end)
  std::int64_t window_left = -1;  // keys left of the diagonal a query sees; -1 unbounded
  double softcap = 0;             // > 0: scores become softcap * tanh(score / softcap)
  // With cu_seqlens_q: the most queries of one request (0: total_q). Ignored without it.
  std::int64_t max_seqlen_q = 0;
  // The longest request's keys, bounding seq_lens (0: the table's max_blocks * page_size). Sizes
  // the split count; a larger seq_lens entry on CUDA is the caller's error.
  std::int64_t max_seq_len = 0;
  // 0: paged_decode_splits for the device; n >= 1 forces n key ranges (at most 1024).
  std::int64_t splits = 0;
};

// Attention of short query runs over a paged cache: request b's queries (one without
// cu_seqlens_q: q [batch, heads, head_dim]; with it, rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]
// - 1 of q [total_q, heads, head_dim]) are the last tokens of its seq_lens[b] keys, held in
// blocks block_tables[b, 0 .. ceil(seq_lens[b] / page_size)) (int32 [batch, max_blocks]) of
// k_cache and v_cache. Query head h reads KV head h / (heads / kv_heads). out [total_q, heads,
// head_dim], lse (optional) f32 [total_q, heads]. A row that sees no key gets zeros and lse -inf.
// On CUDA the split kernel (GQA heads packed into one tile, keys in `splits` ranges) writes
// partials to `workspace` (f32, 16-byte aligned, at least paged_decode_workspace_elements; when
// null the stream's scratch buffer, which a CUDA graph must not capture: pass one there), then the
// combine kernel merges them. Nothing on the host is read: the call can be captured in a CUDA graph.
// Errors before any launch: shape_mismatch (shapes; max_seq_len past max_blocks * page_size; on
// the host a seq_lens entry past its table), invalid_argument (page size, options, a too-small or
// misaligned workspace, a table entry outside the pool on the host), unsupported_dtype, device_error.
Status paged_decode(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                    const TensorView& block_tables, const TensorView& seq_lens, const TensorView* cu_seqlens_q,
                    const TensorView& out, const TensorView* lse, const TensorView* workspace,
                    const PagedDecodeOptions& options = {}, Stream stream = nullptr, Runtime* runtime = nullptr);

// A batch's plan, from host copies of its index arrays: once per batch (every layer reuses it).
struct PagedDecodeShape {
  std::int64_t heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t page_size = 16, num_blocks = 0;
  std::int64_t max_blocks = 0;  // columns of block_tables
};
struct PagedDecodePlan {
  std::int64_t batch = 0;
  std::int64_t total_q = 0;
  std::int64_t max_seqlen_q = 0;
  std::int64_t max_seq_len = 0;
  std::int64_t splits = 1;
  std::int64_t workspace_elements = 0;  // f32
  PagedDecodeOptions options(const PagedDecodeOptions& base = {}) const;  // base with the plan's sizes
};
// seq_lens [batch]; cu_seqlens_q [batch + 1] or empty (one query each); block_tables [batch *
// max_blocks] or empty (not checked). Checks every request's table (KVCacheManager::
// validate_block_table: invalid_argument for an entry outside the pool, shape_mismatch for keys
// past the table) and the offsets (shape_mismatch), and picks the split count for `sm_count` SMs
// (0: an H100's 132) of a compute capability 9.0 device's shared memory (paged_decode_splits).
Result<PagedDecodePlan> plan_paged_decode(const PagedDecodeShape& shape, std::span<const std::int32_t> seq_lens,
                                          std::span<const std::int32_t> cu_seqlens_q,
                                          std::span<const std::int32_t> block_tables, std::int64_t sm_count = 0);

// ---- cascade: a prefix shared by the whole batch ----

struct PagedCascadeOptions {
  double scale = 0;    // multiplies q k^T; 0: 1 / sqrt(head_dim)
  double softcap = 0;  // > 0: scores become softcap * tanh(score / softcap)
  // The prefix's keys, bounding shared_seq_len (0: the shared table's blocks * page_size).
  std::int64_t max_shared_len = 0;
  // The longest request's own keys, bounding seq_lens (0: max_blocks * page_size).
  std::int64_t max_seq_len = 0;
  // Key ranges of the prefix pass and of the own pass; 0: paged_decode_splits for the device.
  std::int64_t shared_splits = 0;
  std::int64_t splits = 0;
};

// One decode step (one query per request) where every request's context is a shared prefix --
// shared_seq_len[0] keys (int32 [1]) in blocks shared_block_table (int32 [shared_blocks]) -- then
// its own seq_lens[b] keys in blocks block_tables[b] ([batch, max_blocks]): attention over prefix
// and own keys together, as if each request's table held both. On CUDA the prefix is read once for
// the batch: the split kernel runs it as one request whose `batch` queries are every request's
// query (GQA heads and requests packed into its row tiles), the own keys as a paged decode, both
// writing partials (their lse with them) into one workspace, and one combine merges each row's
// partials of both passes (on sm_90 the own pass runs beside the prefix pass and the combine
// launches while they run). Three launches, nothing read on the host: graph-capturable with a
// caller-given workspace (paged_cascade_workspace_elements floats). q, out [batch, heads,
// head_dim], lse (optional) f32 [batch, heads]; the caches as paged_decode's. Host tensors run the
// fp64 reference over the concatenated keys. Errors as paged_decode's, for both tables.
Status paged_cascade_decode(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                            const TensorView& shared_block_table, const TensorView& shared_seq_len,
                            const TensorView& block_tables, const TensorView& seq_lens, const TensorView& out,
                            const TensorView* lse, const TensorView* workspace, const PagedCascadeOptions& options = {},
                            Stream stream = nullptr, Runtime* runtime = nullptr);

struct PagedCascadePlan {
  std::int64_t batch = 0;
  std::int64_t shared_len = 0;
  std::int64_t max_seq_len = 0;
  std::int64_t shared_splits = 1;
  std::int64_t splits = 1;
  std::int64_t workspace_elements = 0;  // f32: (shared_splits + splits) * batch * heads * (head_dim + 1)
  PagedCascadeOptions options(const PagedCascadeOptions& base = {}) const;  // base with the plan's sizes
};
// shape.max_blocks: the columns of block_tables. shared_block_table holds the prefix's blocks (at
// least ceil(shared_len / page_size)); block_tables [batch * max_blocks] or empty (not checked).
// Checks both tables as plan_paged_decode does and picks each pass's split count.
Result<PagedCascadePlan> plan_paged_cascade_decode(const PagedDecodeShape& shape,
                                                   std::span<const std::int32_t> shared_block_table,
                                                   std::int64_t shared_len, std::span<const std::int32_t> seq_lens,
                                                   std::span<const std::int32_t> block_tables,
                                                   std::int64_t sm_count = 0);

}  // namespace kiln
