// add_rms_norm's backward as a typed op (C++). From C and Python it is the declared op
// "add_rms_norm_backward" (kiln_op_call, kiln.add_rms_norm_backward), and kiln.torch.add_rms_norm's
// autograd calls it (torch.ops.kiln.add_rms_norm_backward).
#pragma once

#include "kiln/ops.h"

namespace kiln {

// The backward of add_rms_norm (h = x + residual, residual_out = h, y = rms_norm(h) * weight) in
// one pass over the rows: with s = rsqrt(mean(h^2) + eps) recomputed per row from h,
//   dx = s * dy * weight - h * s^3 * mean(dy * weight * h) + dh,   dw = sum over rows of dy * h * s
// (fp32 accumulation; dw deterministic, as in rms_norm_backward). dx is the gradient of both x and
// residual; dh, the gradient of residual_out, may be null (zero). dy, dh, h and dx: [..., hidden]
// with the last dimension contiguous (rows may be strided; dh's must not overlap), same shape and
// dtype (f32, f16 or bf16); dx may be dy or dh (in place). weight and dw: [hidden], contiguous,
// that dtype. The workspace and host tensors as in rms_norm_backward (kiln/ops.h), the workspace
// of at least rms_norm_backward_workspace_elements(h) elements. Errors before any compile or
// launch: device_error, shape_mismatch, unsupported_dtype, invalid_argument (null pointers, eps
// not finite or negative, a workspace that is too small).
Status add_rms_norm_backward(const TensorView& dy, const TensorView* dh, const TensorView& h,
                             const TensorView& weight, const TensorView& dx, const TensorView& dw, double eps = 1e-6,
                             Stream stream = nullptr, Runtime* runtime = nullptr,
                             const TensorView* workspace = nullptr);

}  // namespace kiln
