// The LoRA typed ops (C++). From C and Python they are the declared ops of the same names
// (kiln_op_call, kiln.lora_linear, torch.ops.kiln.lora_linear, ...); kiln.torch adds autograd and
// the LoRA_MLP / LoRA_QKV modules on top.
//
// Both ops run two kernels: lora_shrink (x A^T, in the stream's workspace: client/workspace.h, so
// not during CUDA-graph capture) and lora_gemm (the base GEMM whose K loop runs on into the
// low-rank tail, bias in its epilogue). On sm_90a with one adapter and more than 64 rows
// (lora_linear; families/lora/lora.h: core_path), the shrink writes the tail's operand t =
// scale x A^T itself and the GEMM core's kernel loads it by TMA; otherwise the shrink writes fp32
// partial sums that the GEMM's tail sums, scales and rounds. Every op validates before anything is
// compiled or launched: device_error, unsupported_dtype, shape_mismatch, invalid_argument. Host
// tensors run the CPU references. On the GPU, adapter indices outside [0, adapters) (-1 included)
// mean no adapter, and ranks are clamped to [0, r]; the host checks neither, since reading them
// would wait for the device.
#pragma once

#include "kiln/ops.h"

namespace kiln {

// out [..., n] = x [..., k] W^T + scale (x A^T) B^T (+ bias): weight [n, k], lora_a [r, k], lora_b
// [n, r], bias [n] or null. f16/bf16 (all one dtype), contiguous, 16-byte aligned; k a multiple of
// 8, r in [1, 128]. The low-rank product goes through the operand type (t = scale x A^T rounded to
// it, as PEFT's eager path rounds x A^T). Merged projections (gate_up: 2 slices, QKV: 3): lora_a
// [slices r, k] stacks each slice's A rows, and out's columns split at slice_end0 and slice_end1
// (0: equal parts of n); slice s is x A_s^T B_s^T over its own columns, B_s its rows of lora_b.
Status lora_linear(const TensorView& x, const TensorView& weight, const TensorView& lora_a, const TensorView& lora_b,
                   const TensorView* bias, const TensorView& out, double scale = 1.0, std::int64_t slice_end0 = 0,
                   std::int64_t slice_end1 = 0, Stream stream = nullptr, Runtime* runtime = nullptr);

// Multi-adapter serving (Punica / S-LoRA): row i of x uses adapter indices[i] (i32 [rows]; outside
// [0, adapters), -1 included: no adapter, the base GEMM alone) with rank ranks[a] (i32 [adapters],
// at most r) and scale scales[a] (f32 [adapters]). lora_a [adapters, slices r, k] holds each
// slice's A rows after the previous slice's; lora_b [adapters, n, r]. Slices (merged QKV: 3,
// gate_up: 2; slices = lora_a.shape[1] / r) split out's columns at slice_end0 and slice_end1
// (0: equal parts of n); slice s uses A rows [s r, s r + rank). Rows need not be sorted: each
// output tile runs one low-rank pass per adapter among its rows.
Status lora_linear_multi(const TensorView& x, const TensorView& weight, const TensorView& lora_a,
                         const TensorView& lora_b, const TensorView& indices, const TensorView& ranks,
                         const TensorView& scales, const TensorView* bias, const TensorView& out,
                         std::int64_t slice_end0 = 0, std::int64_t slice_end1 = 0, Stream stream = nullptr,
                         Runtime* runtime = nullptr);

}  // namespace kiln
