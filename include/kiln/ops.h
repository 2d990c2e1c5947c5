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

}  // namespace kiln
