// rms_norm_rope's backward as a typed op (C++). From C and Python it is the declared op
// "rms_norm_rope_backward" (kiln_op_call, kiln.rms_norm_rope_backward), and
// kiln.torch.fused_rmsnorm_rope's autograd calls it (torch.ops.kiln.rms_norm_rope_backward).
#pragma once

#include "kiln/ops.h"

namespace kiln {

// The backward of rms_norm_rope (out = rope(n), n = rms_norm(x) * weight) in two passes: the
// rotation's transpose takes dout to dn (rope_hf_bwd, written into dx in x's dtype), then the
// RMSNorm backward takes dn to (dx, dw) with inv_rms recomputed from x (add_rms_norm_backward,
// in place on dx). dout, x and dx: [batch, seq, hidden] contiguous, one dtype (f32, f16 or bf16);
// weight and dw [hidden] contiguous, that dtype; cos and sin as rms_norm_rope takes them ([seq,
// head_dim] or [1, seq, 1, head_dim], f32 or x's dtype), head_dim one of 64, 80, 96, 128, 256;
// num_heads 0 infers hidden / head_dim. dx may be dout (in place); no other overlap with an input
// or dw. Host tensors run the CPU fallback; CUDA tensors take a workspace as rms_norm_backward
// does (at least rms_norm_backward_workspace_elements(x) elements; absent: the per-stream one).
// Errors before any compile or launch: device_error, shape_mismatch, unsupported_dtype,
// invalid_argument (null pointers, misaligned elements, overlaps, eps not finite or negative, a
// workspace that is too small).
Status rms_norm_rope_backward(const TensorView& dout, const TensorView& x, const TensorView& weight,
                              const TensorView& cos, const TensorView& sin, double eps, std::int64_t num_heads,
                              const TensorView& dx, const TensorView& dw, Stream stream = nullptr,
                              Runtime* runtime = nullptr, const TensorView* workspace = nullptr);

}  // namespace kiln
