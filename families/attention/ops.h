// Attention's typed ops (C++). From C and Python they are the declared ops "attention" and
// "attention_varlen" (kiln_op_call, kiln.attention, kiln.attention_varlen, torch.ops.kiln.*; the
// FlashAttention- and SDPA-style wrappers are in kiln.torch).
#pragma once

#include <cstdint>

#include "kiln/runtime.h"

namespace kiln {

struct AttentionOptions {
  double scale = 0;               // multiplies Q K^T; 0: 1 / sqrt(head_dim)
  bool causal = false;            // the same as window_right 0 (window_right must be -1 or 0)
  std::int64_t window_left = -1;  // keys left of the diagonal a query sees; -1 unbounded
  std::int64_t window_right = -1; // keys right of the diagonal a query sees; -1 unbounded
  double softcap = 0;             // > 0: scores (after scale) become softcap * tanh(score / softcap)
  // CUDA only, for tests and benchmarks: 0 lets the heuristic choose between the one-pass kernel
  // and the decode path (split-KV, README.md); -1 forces the one-pass kernel; n >= 1 forces the
  // decode path with n key splits (at most 1024). Declared ops always pass 0.
  std::int64_t decode_splits = 0;
};

// out = softmax(mask(softcap(scale * q k^T))) v per (sequence, query head), with the log-sum-exp
// of each row's masked scores (natural log, f32) written to lse when given. Query head h reads
// key/value head h / (heads / kv_heads) (GQA, MQA). With seqlen_q queries and seqlen_k keys, query
// i sees key j iff i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q +
// window_right (a bound of -1 drops that side): causal and windows are aligned to the end of the
// keys, as FlashAttention 2. A row that sees no key gets zeros and lse -inf.
// q [batch, seqlen_q, heads, head_dim], k [batch, seqlen_k, kv_heads, head_dim], v [batch,
// seqlen_k, kv_heads, head_dim_v], out [batch, seqlen_q, heads, head_dim_v], lse (optional)
// [batch, heads, seqlen_q] f32; all contiguous, q, k, v and out of one dtype.
// Host tensors run the CPU fallback (f32, f16, bf16; fp64 accumulation, threads over (batch,
// head)). On CUDA, 1-16 queries against long keys take the decode path (split-KV with GQA
// packing, two launches over the per-stream workspace; families/attention/README.md), the rest
// the one-pass kernel. On CUDA (compute capability 8.0 or later): f16 or bf16, (head_dim, head_dim_v) one of
// 64/64, 80/80, 96/96, 128/128, 192/192, 256/256, 192/128, q, k, v and out 16-byte aligned.
// Errors before any compile or launch: device_error, shape_mismatch, unsupported_dtype,
// invalid_argument (windows below -1, causal with window_right > 0, softcap negative, scale or
// softcap not finite, head dims or sizes the GPU kernel does not take).
Status attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                 const TensorView* lse, const AttentionOptions& options = {}, Stream stream = nullptr,
                 Runtime* runtime = nullptr);

// The same over packed sequences: q [total_q, heads, head_dim], k [total_k, kv_heads, head_dim],
// v [total_k, kv_heads, head_dim_v], out [total_q, heads, head_dim_v], lse (optional) [heads,
// total_q]; sequence b holds query tokens cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 and key tokens
// likewise (int32 [batch + 1], contiguous, on q's device). max_seqlen_q and max_seqlen_k bound
// every sequence's length (the grid is sized from max_seqlen_q). Host tensors: cu_seqlens are
// checked (start at 0, non-decreasing, within the tokens and the max lengths: shape_mismatch); on
// CUDA their contents are read by the kernel only, and must satisfy the same.
Status attention_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, const TensorView& out,
                        const TensorView* lse, std::int64_t max_seqlen_q, std::int64_t max_seqlen_k,
                        const AttentionOptions& options = {}, Stream stream = nullptr, Runtime* runtime = nullptr);

// dq, dk, dv of attention: dout [batch, seqlen_q, heads, head_dim_v] is the gradient of out; q, k,
// v, out and lse (f32 [batch, heads, seqlen_q], natural log) as attention wrote them; dq, dk, dv
// shaped as q, k, v, all of q's dtype, contiguous. D = rowsum(dout * out); P is recomputed from q,
// k and lse (no seqlen_q x seqlen_k buffer); with GQA, dk and dv are summed over each KV head's
// query heads. A query row whose lse is -inf (it saw no key) contributes nothing, and its dq is 0.
// deterministic: dq is summed over key tiles in a fixed order (bitwise identical run to run);
// otherwise by f32 atomic adds (dk and dv are always deterministic). Host tensors run the fp64
// reference (f32, f16, bf16; any head dims). On CUDA: f16 or bf16, (head_dim, head_dim_v) one of
// 64/64, 80/80, 96/96, 128/128, 16-byte aligned; the scratch is the stream's workspace
// (client/workspace.h). Errors before any compile or launch as attention's, plus shape_mismatch for
// gradients not shaped as their tensors and invalid_argument for head dims the GPU backward lacks.
Status attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv, const AttentionOptions& options = {}, bool deterministic = false,
                          Stream stream = nullptr, Runtime* runtime = nullptr);

// The same over packed sequences (layouts as attention_varlen's; dq, dk, dv shaped as q, k, v).
Status attention_varlen_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                 const TensorView& out, const TensorView& lse, const TensorView& dq,
                                 const TensorView& dk, const TensorView& dv, std::int64_t max_seqlen_q,
                                 std::int64_t max_seqlen_k, const AttentionOptions& options = {},
                                 bool deterministic = false, Stream stream = nullptr, Runtime* runtime = nullptr);

}  // namespace kiln
