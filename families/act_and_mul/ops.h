// act_and_mul's backward as a typed op (C++). From C and Python it is the declared op
// "act_and_mul_backward" (kiln_op_call, kiln.act_and_mul_backward), and kiln.torch.act_and_mul's
// autograd calls it.
#pragma once

#include "kiln/ops.h"

namespace kiln {

// The gradient of out = act(x[..., :d]) * x[..., d:] with respect to x, given dy = dL/dout:
// dx[..., :d] = dy * x[..., d:] * act'(x[..., :d]) and dx[..., d:] = dy * act(x[..., :d]), in
// fp32, recomputing act from x. x and dx: [..., 2d]; dy: [..., d]; same leading shape and dtype
// (f32, f16 or bf16); rows may be strided (unit stride in the last dimension). dx may be x itself
// (same pointer and row stride: the gradient overwrites the saved input); any other overlap of dx
// with x or dy is invalid_argument. Host tensors run the CPU fallback. Errors before any compile or
// launch: device_error, shape_mismatch, unsupported_dtype, invalid_argument.
Status act_and_mul_backward(const TensorView& x, const TensorView& dy, const TensorView& dx, Activation act,
                            Stream stream = nullptr, Runtime* runtime = nullptr);

}  // namespace kiln
