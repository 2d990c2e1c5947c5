// FP8 GEMM family: out[m, n] = sum over k of a[m, k] * b[n, k] * scales, e4m3 operands (stored as
// uint8), fp32 accumulation, f16 or bf16 output. Both operands are K-major: b is the [N, K]
// (transposed) weight, as torch._scaled_mm's second operand and DeepGEMM take it.
//
// Scaling (problem field `mode`): 0 per tensor (a_scale, b_scale: one f32 each, multiplied into the
// fp32 result); 1 block-wise as DeepSeek-V3: a_scale [m, ceil(k/128)] (1x128 blocks of a row),
// b_scale [ceil(n/128), ceil(k/128)] (128x128 blocks), both f32 row-major, and the tensor-core
// partial sums promoted to fp32 with both scales every 128 of K.
//
// Params: path {mma, wgmma}, out {f16, bf16}, scaling {tensor, block}, bm, bn, stages, group,
// cluster (A multicast), split (split-K) (families/common/gemm/gemm_util.h). Problem: gemm::GemmProblem
// {m (bucketed), n, k, mode (the scaling)}, all keys; dtype = out's; the device's SM count and
// compute capability from the Problem. k must be a multiple of 16; m and n are free (ragged tiles
// are zero-filled and stores guarded).
// Buffers: a [m, k] u8, b [n, k] u8, a_scale f32, b_scale f32, out [m, n].
#pragma once

#include "kiln/family.h"

namespace kiln::families {

enum Fp8Scaling { k_fp8_per_tensor = 0, k_fp8_blockwise = 1 };

}  // namespace kiln::families
