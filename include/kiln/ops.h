// Typed ops: one function per kernel family, over TensorViews.
//
// Each op validates its tensors (device, dtype, shape, strides, alignment) and returns
// device_error, shape_mismatch, unsupported_dtype or invalid_argument before anything is compiled
// or launched. On CUDA memory the kernel runs on `stream` through `runtime` (nullptr: the
// process-wide Runtime::shared()); where an op has a CPU fallback, host tensors run it.
#pragma once

#include "kiln/runtime.h"

namespace kiln {

// y = x * rsqrt(mean(x^2, last dim) + eps) * weight.
// x and y: [..., hidden] with the last dimension contiguous (rows may be strided), same shape and
// dtype (f32, f16 or bf16); weight: [hidden], contiguous, same dtype. On CUDA memory the kernel is
// launched on `stream`; on host memory (all three tensors on the CPU) the CPU fallback runs.
// Errors before any compile or launch: device_error, shape_mismatch, unsupported_dtype,
// invalid_argument (eps not finite or negative, null pointers).
Status rms_norm(const TensorView& x, const TensorView& weight, const TensorView& y, double eps = 1e-6,
                Stream stream = nullptr, Runtime* runtime = nullptr);
// The same, also writing inv_rms (f32, [rows] contiguous, rows = x.numel() / hidden):
// rsqrt(mean(x^2) + eps) per row, what rms_norm_backward takes.
Status rms_norm(const TensorView& x, const TensorView& weight, const TensorView& y, const TensorView& inv_rms,
                double eps = 1e-6, Stream stream = nullptr, Runtime* runtime = nullptr);

// Fused residual add + RMSNorm: h = x + residual; residual_out = h;
// y = h * rsqrt(mean(h^2, last dim) + eps) * weight.
// h is summed in fp32 and rounded to the dtype, and that rounded h is what residual_out holds and
// what is normalized (vLLM's convention); y is computed in fp32 and rounded once.
// x, residual, y, residual_out: [..., hidden], same shape and dtype (f32, f16 or bf16), last
// dimension contiguous (rows may be strided); weight: [hidden], contiguous, same dtype.
// residual_out may be residual and y may be x (same data pointer and strides: in place); any other
// overlap between the tensors, and y overlapping residual_out, is invalid_argument.
// On host memory (all five tensors on the CPU) the CPU fallback runs.
// Errors before any compile or launch: device_error, shape_mismatch, unsupported_dtype,
// invalid_argument (eps not finite or negative, null pointers, overlaps).
Status add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight, const TensorView& y,
                    const TensorView& residual_out, double eps = 1e-6, Stream stream = nullptr,
                    Runtime* runtime = nullptr);

// The gate activation of act_and_mul: SiLU, GELU with erf, GELU with the tanh approximation.
enum class Activation { silu, gelu, gelu_tanh };

// out = act(x[..., :d]) * x[..., d:], in fp32.
// x: [..., 2d], out: [..., d] with the same leading shape and dtype (f32, f16 or bf16), last
// dimension contiguous (rows may be strided). out may be x[..., :d] (the same data pointer and
// row stride as x: in place); any other overlap is invalid_argument. On host memory (both tensors
// on the CPU) the CPU fallback runs.
// Errors before any compile or launch: device_error, shape_mismatch (odd last dim of x, shapes),
// unsupported_dtype, invalid_argument (null pointers, unknown activation, overlaps).
Status act_and_mul(const TensorView& x, const TensorView& out, Activation act, Stream stream = nullptr,
                   Runtime* runtime = nullptr);

// Which elements of a head rotate together: neox pairs (i, i + head_dim/2) (GPT-NeoX, LLaMA in
// HF), gptj pairs (2i, 2i + 1) (GPT-J, interleaved).
enum class RopeLayout { neox, gptj };

// Rotary position embedding of q and k: for each token t at p = position_ids[t] and each pair
// (a, b) of a head with pair index i, a' = a cos[p, i] - b sin[p, i], b' = b cos[p, i] + a sin[p, i],
// in fp32.
// q: [tokens, num_q_heads, head_dim], k: [tokens, num_kv_heads, head_dim] (any head counts: GQA,
// MQA), same dtype (f32, f16 or bf16), head_dim 64, 80, 96, 128 or 256; heads contiguous within a
// token, tokens may be strided (views into a fused qkv tensor work). cos, sin: [max_pos,
// head_dim / 2], f32, contiguous (one angle per pair; convert a half-precision table once).
// position_ids: [tokens], i64, contiguous. q_out and k_out: the shapes and dtype of q and k, with
// their own token strides; each may be its input itself (same data and strides: in place); any
// other overlap with an input or between the outputs is invalid_argument.
// Position ids must lie in [0, max_pos). On host memory (every tensor on the CPU) the CPU fallback
// runs and checks them first (invalid_argument). On CUDA memory they are not read on the host; a
// token whose id is out of range gets NaN in its outputs (the cache is never read out of bounds).
// Errors before any compile or launch: device_error, shape_mismatch (ranks, shapes, strides, odd
// head_dim), unsupported_dtype (cos/sin not f32, position_ids not i64), invalid_argument (null
// pointers, unsupported head_dim, misaligned position_ids, overlaps).
Status apply_rope_qk(const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
                     const TensorView& position_ids, const TensorView& q_out, const TensorView& k_out,
                     RopeLayout layout, Stream stream = nullptr, Runtime* runtime = nullptr);

// Fused RMSNorm + RoPE: per token, n = x * rsqrt(mean(x^2 over hidden) + eps) * weight in fp32,
// then per head (neox layout over the full head_dim): out = n * cos + rotate_half(n) * sin, where
// rotate_half(n) = [-n[d/2:], n[:d/2]]. n is never written; only out is.
// x: [batch, seq, hidden], contiguous, f32, f16 or bf16; weight: [hidden], contiguous, dtype of x;
// cos, sin: [seq, head_dim] or [1, seq, 1, head_dim], contiguous, the same shape, f32 or the dtype
// of x; token (b, s) uses row s. head_dim must be even (else shape_mismatch) and one of 64, 80,
// 96, 128, 256 (else invalid_argument). num_heads = 0 infers hidden / head_dim; otherwise
// num_heads * head_dim must equal hidden (shape_mismatch). out: the shape, dtype and contiguity of
// x; it may be x (in place), any other overlap is invalid_argument.
// CUDA only, as the seed contract: host tensors are a device_error.
// Errors before any compile or launch: device_error, shape_mismatch, unsupported_dtype,
// invalid_argument (eps not finite or negative, num_heads negative, null pointers, overlaps).
Status rms_norm_rope(const TensorView& x, const TensorView& weight, const TensorView& cos, const TensorView& sin,
                     const TensorView& out, double eps = 1e-6, std::int64_t num_heads = 0, Stream stream = nullptr,
                     Runtime* runtime = nullptr);

// RMSNorm backward, from the forward's inverse RMS per row: with s = inv_rms[r], n = hidden,
//   dx = s * dy * weight - x * s^3 * mean(dy * weight * x),   dw = sum over rows of dy * x * s
// (fp32 accumulation; dw is reduced over rows without atomics, deterministically).
// dy, x and dx: [..., hidden] with the last dimension contiguous (rows may be strided), same shape
// and dtype (f32, f16 or bf16); dx may be dy (in place). weight and dw: [hidden], contiguous, that
// dtype. inv_rms: f32, one value per row (any shape with that many elements), contiguous.
// The kernel writes per-slab partial dw rows to an f32 workspace: pass one (f32, contiguous, CUDA,
// at least rms_norm_backward_workspace_elements(x) elements, not used by other streams meanwhile)
// or leave it null to use a workspace cached per (CUDA context, stream), grown on demand and never
// freed; calls on one stream share it safely since the stream orders them. Host tensors (all of
// them) run the CPU fallback. Errors before any compile or launch: device_error, shape_mismatch,
// unsupported_dtype, invalid_argument (null pointers, a workspace that is too small).
Status rms_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
                         const TensorView& inv_rms, const TensorView& dx, const TensorView& dw, Stream stream = nullptr,
                         Runtime* runtime = nullptr, const TensorView* workspace = nullptr);
// The f32 elements rms_norm_backward needs as workspace for tensors shaped and placed like x on
// the current CUDA context's device (0 for host tensors or no rows).
Result<std::int64_t> rms_norm_backward_workspace_elements(const TensorView& x);

// ---- tensor-core GEMMs (docs/kernels.md: fp8_gemm, gated_mlp, quantize_fp8) ----

// How quantize_fp8 groups values under one scale.
enum class Fp8Granularity {
  tensor,     // one scale for the whole tensor (two passes over x)
  row_1x128,  // one per 128 consecutive values of a row (activations, DeepSeek-V3)
  tile_128,   // one per 128 x 128 block (weights)
};

// x (f32, f16 or bf16, contiguous, viewed as [rows, cols] with cols its last dimension) -> q (e4m3
// codes as u8) and scale (f32, contiguous): for each group with largest magnitude amax,
// scale = max(amax / 448, FLT_MIN), q = e4m3(x / scale) rounded to nearest even and saturated to
// +-448 (common/fp8.h; a NaN gives 0x7F). Dequantize as e4m3_value(q) * scale.
// q: x's shape, or with transpose (rank-2 x, tensor and tile_128 only) [cols, rows]: a [K, N]
// weight becomes the K-major [N, K] operand fp8_gemm takes. scale: one element (tensor),
// [rows, ceil(cols / 128)] (row_1x128), [ceil(rows / 128), ceil(cols / 128)] (tile_128; with
// transpose [ceil(cols / 128), ceil(rows / 128)]). x, q and scale need 16-byte aligned addresses.
// Host tensors (all three) run the CPU reference.
// Errors before any launch: device_error, shape_mismatch, unsupported_dtype, invalid_argument.
Status quantize_fp8(const TensorView& x, const TensorView& q, const TensorView& scale, Fp8Granularity granularity,
                    bool transpose = false, Stream stream = nullptr, Runtime* runtime = nullptr);

// out[m, n] = sum_k a[m, k] b[k, n] * scales, e4m3 operands (u8 codes), fp32 accumulation, f16 or
// bf16 out ([M, N], contiguous).
// a: [M, K] u8, contiguous. b: [K, N] u8 K-major, i.e. strides {1, K}: the transposed view of a
// contiguous [N, K] tensor (torch: w.t() of w [N, K], as torch._scaled_mm takes it); quantize_fp8
// with transpose makes one from a row-major [K, N] weight. A row-major [K, N] b is an
// invalid_argument (the tensor cores read fp8 operands K-major only).
// Scales, f32 contiguous, required (a null data pointer is invalid_argument): per tensor, a_scale
// and b_scale have one element each; block-wise (DeepSeek-V3), a_scale is [M, ceil(K/128)] (1x128
// blocks) and b_scale [ceil(N/128), ceil(K/128)] (128x128 blocks of the [N, K] weight); any other
// pair of shapes is shape_mismatch. K must be a multiple of 16 (shape_mismatch); M and N are free.
// a, b and out need 16-byte aligned addresses. Host tensors (all five) run the CPU reference.
// Errors before any launch: device_error, shape_mismatch, unsupported_dtype, invalid_argument.
Status fp8_gemm(const TensorView& a, const TensorView& b, const TensorView& a_scale, const TensorView& b_scale,
                const TensorView& out, Stream stream = nullptr, Runtime* runtime = nullptr);

// The gate activation of fused_gated_mlp.
enum class GatedActivation { silu, gelu };

// out = act(x gate_weight^T) * (x up_weight^T), both projections of an input tile in one kernel
// (fp32 accumulation), the activation in its epilogue; the intermediate is never written.
// x: [..., hidden] contiguous, f16 or bf16; gate_weight, up_weight: [intermediate, hidden]
// contiguous, x's dtype; out: [..., intermediate] contiguous, x's leading shape and dtype. hidden
// must be a multiple of 8 (shape_mismatch); x, the weights and out need 16-byte aligned
// addresses. Host tensors (all four) run the CPU reference.
// Errors before any launch: device_error, shape_mismatch, unsupported_dtype, invalid_argument.
Status fused_gated_mlp(const TensorView& x, const TensorView& gate_weight, const TensorView& up_weight,
                       const TensorView& out, GatedActivation act = GatedActivation::silu, Stream stream = nullptr,
                       Runtime* runtime = nullptr);

}  // namespace kiln
