// The MoE typed ops (C++). From C and Python they are the declared ops of the same names
// (kiln_op_call, kiln.moe_topk, torch.ops.kiln.moe_topk, ...); kiln.torch.fused_moe composes them.
//
// Every op validates before anything is compiled or launched: device_error (tensors on different
// devices or GPUs), unsupported_dtype, shape_mismatch, invalid_argument. Host tensors run the CPU
// references, after checking what only the host can read (expert ids within range, offsets
// non-decreasing and within the rows); on the GPU the kernels read such values defensively
// instead (families/moe/README.md: ids out of range are dropped, offsets taken as their running
// maximum clamped to the rows), because checking them would wait for the device.
#pragma once

#include "kiln/ops.h"

namespace kiln {

enum class MoeScoring { softmax, sigmoid_group };

// Top-k routing of logits [tokens, experts] (f32/f16/bf16) into weights [tokens, top_k] f32 and
// ids [tokens, top_k] i32, ties to the lower expert. softmax: the top_k of softmax(logits),
// renormalized over the picked when asked. sigmoid_group (DeepSeek-V3): s = sigmoid(logits),
// choice = s + bias (f32 [experts], required); groups of experts / n_group scored by their two
// best choices, the topk_group best groups kept, the top_k best choices among them picked;
// weights s, renormalized when asked, times `scale`. experts <= 1024, top_k <= 32.
Status moe_topk(const TensorView& logits, const TensorView* bias, const TensorView& weights, const TensorView& ids,
                MoeScoring scoring, bool renormalize, std::int64_t n_group, std::int64_t topk_group, double scale,
                Stream stream = nullptr, Runtime* runtime = nullptr);

// Sorts the (token, slot) entries of ids [tokens, top_k] by expert (stable: token order within an
// expert) and gathers x [tokens, hidden] rows into x_sorted [tokens x top_k, hidden]: offsets
// [experts + 1] i32 (expert e's rows [offsets[e], offsets[e + 1])), row_of [tokens, top_k] i32 (the
// row of each entry), src_of [tokens x top_k] i32 (the entry of each row, -1 past the last).
Status moe_permute(const TensorView& x, const TensorView& ids, const TensorView& x_sorted, const TensorView& offsets,
                   const TensorView& row_of, const TensorView& src_of, Stream stream = nullptr,
                   Runtime* runtime = nullptr);

// out [rows, hidden] = x[src_of[r] / top_k] times weights[src_of[r]] (f32 [tokens, top_k]; null: 1),
// zero rows where src_of < 0. The gradient of the combine with respect to the sorted rows.
Status moe_gather(const TensorView& x, const TensorView& src_of, const TensorView* weights, const TensorView& out,
                  std::int64_t top_k, Stream stream = nullptr, Runtime* runtime = nullptr);

// out [tokens, hidden] = sum over j of weights[t, j] (null: 1) * y[row_of[t, j]], fp32, in j order.
Status moe_combine(const TensorView& y, const TensorView& row_of, const TensorView* weights, const TensorView& out,
                   Stream stream = nullptr, Runtime* runtime = nullptr);

// out [m, n] = a [m, k] x weight[e] [n, k]^T for the rows of expert e: rows [offs[e - 1], offs[e])
// (offs [experts] i32, cumulative ends: torch._grouped_mm(a, weight.transpose(-2, -1), offs)).
// f16/bf16, fp32 accumulation, contiguous tensors, k a multiple of 8. Rows past offs[experts - 1]
// are not written.
Status grouped_gemm(const TensorView& a, const TensorView& weight, const TensorView& offs, const TensorView& out,
                    Stream stream = nullptr, Runtime* runtime = nullptr);

// The masked layout: out [experts, max_tokens, n] = a [experts, max_tokens, k] x weight[e]^T for
// the first counts[e] rows of each expert (counts [experts] i32); the other rows are not written.
// A fixed shape for CUDA-graph decode.
Status grouped_gemm_masked(const TensorView& a, const TensorView& weight, const TensorView& counts,
                           const TensorView& out, Stream stream = nullptr, Runtime* runtime = nullptr);

// FP8: out [m, n] = a [m, k] x weight[e] [n, k]^T with scales, for the rows of expert e as in
// grouped_gemm: a and weight e4m3 codes (u8), out f16 or bf16, fp32 accumulation, k a multiple of
// 16. Scales f32, rowwise (a_scale [m], b_scale [experts, n]: out = acc * a_scale[row] *
// b_scale[e, col], as torch._scaled_grouped_mm takes them) or DeepSeek-V3's blocks (a_scale [m,
// ceil(k/128)], b_scale [experts, ceil(n/128), ceil(k/128)], promoted every 128 of K), told apart
// by a_scale's rank. With `counts` instead of offsets (masked): a [experts, max_tokens, k],
// a_scale [experts, max_tokens(, k/128)], out [experts, max_tokens, n].
Status grouped_gemm_fp8(const TensorView& a, const TensorView& weight, const TensorView& offs,
                        const TensorView& a_scale, const TensorView& b_scale, const TensorView& out,
                        Stream stream = nullptr, Runtime* runtime = nullptr);
Status grouped_gemm_fp8_masked(const TensorView& a, const TensorView& weight, const TensorView& counts,
                               const TensorView& a_scale, const TensorView& b_scale, const TensorView& out,
                               Stream stream = nullptr, Runtime* runtime = nullptr);

// The input gradient of grouped_gemm with the same weight: out [m, n] = a [m, k] x weight[e] for
// weight [experts, k, n] as grouped_gemm stores it ([experts, n_fwd, k_fwd]; here k = n_fwd and
// n = k_fwd), read as it is, without a transposed copy; rows and offs as in grouped_gemm. n and k
// multiples of 8.
Status grouped_gemm_dgrad(const TensorView& a, const TensorView& weight, const TensorView& offs, const TensorView& out,
                          Stream stream = nullptr, Runtime* runtime = nullptr);

// The K-grouped form (weight gradients): out[e] [n, k] = a_e^T b_e, a [m, n] and b [m, k] with
// expert e's rows as in grouped_gemm; experts without rows get zeros. n and k multiples of 8.
Status grouped_gemm_wgrad(const TensorView& a, const TensorView& b, const TensorView& offs, const TensorView& out,
                          Stream stream = nullptr, Runtime* runtime = nullptr);

// The MoE layer's forward: out [tokens, hidden] = sum over the top_k experts e of each token of
// w * (act(x Wg_e^T) * (x Wu_e^T)) W_d,e^T, routed by softmax top-k (renormalized when asked):
// moe_topk, moe_permute, grouped_gemm (w_gate_up [experts, 2 inter, hidden], gate rows first),
// act_and_mul, grouped_gemm (w_down [experts, hidden, inter]) and moe_combine. x, the weights and
// out f16/bf16 of one dtype, router_logits [tokens, experts] (f32/f16/bf16); hidden and inter
// multiples of 8. The intermediates live in the stream's workspace (client/workspace.h: not
// during CUDA-graph capture) or, for host tensors, in host memory. kiln.torch.fused_moe adds the
// backward.
Status fused_moe(const TensorView& x, const TensorView& router_logits, const TensorView& w_gate_up,
                 const TensorView& w_down, const TensorView& out, std::int64_t top_k, Activation act,
                 bool renormalize = true, Stream stream = nullptr, Runtime* runtime = nullptr);

}  // namespace kiln
