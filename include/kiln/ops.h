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

}  // namespace kiln
