// LayerNorm's typed ops (C++). From C and Python they are the declared ops "layer_norm" and
// "layer_norm_backward" (kiln_op_call, kiln.layer_norm, kiln.torch.layer_norm with autograd).
#pragma once

#include "kiln/runtime.h"

namespace kiln {

// y = (x - mean) * rstd * weight + bias over the last dimension, with mean and
// rstd = rsqrt(var + eps) (biased variance) in fp32; mean and rstd are written when given (f32,
// one value per row, contiguous), for layer_norm_backward.
// x and y: [..., cols], same shape and dtype (f32, f16 or bf16), the last dimension contiguous and
// the rows at any row stride (at least cols; the leading dimensions one evenly strided row
// index); weight and bias (optional: null) [cols], contiguous, that dtype. Host tensors run the
// CPU fallback; on CUDA rows may hold up to 32768 elements (16384 when the row length or a row
// stride is odd).
// Errors before any compile or launch: device_error, shape_mismatch, unsupported_dtype,
// invalid_argument (eps not finite or negative, null pointers, rows longer than the kernels hold).
Status layer_norm(const TensorView& x, const TensorView& weight, const TensorView* bias, const TensorView& y,
                  const TensorView* mean, const TensorView* rstd, double eps = 1e-5, Stream stream = nullptr,
                  Runtime* runtime = nullptr);

// The gradients of layer_norm from its saved mean and rstd: dx ([..., cols], x's dtype), dweight
// and dbias ([cols], weight's dtype; dbias optional), reduced over rows in fp32 in a fixed order
// (deterministic). dy, x and dx take any row stride, as layer_norm's x and y. On CUDA the row pass
// keeps partial sums in a per-stream workspace (client/workspace.h) and rows may hold up to 8192
// elements (2048 when the row length or a row stride is odd).
Status layer_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
                           const TensorView& mean, const TensorView& rstd, const TensorView& dx,
                           const TensorView& dweight, const TensorView* dbias, Stream stream = nullptr,
                           Runtime* runtime = nullptr);

}  // namespace kiln
