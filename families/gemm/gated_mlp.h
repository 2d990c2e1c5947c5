// Fused gated MLP family: out[m, n] = act(sum_k x[m, k] wg[n, k]) * (sum_k x[m, k] wu[n, k]), both
// projections of one input tile computed in one kernel (two accumulators), the activation applied
// in the epilogue, the intermediate never written. act: SiLU or GELU (erf). f16 or bf16 operands
// and output, fp32 accumulation. wg and wu are [intermediate, hidden] (nn.Linear weights, K-major).
//
// Params: path {mma, wgmma}, dtype {f16, bf16}, act {silu, gelu}, bm, bn, stages, group, cluster (A
// multicast; tuning space only), split (always 1: split-K is fp8 only)
// (families/common/gemm/gemm_util.h). Problem: gemm::GemmProblem {m (bucketed), n, k, mode (0 silu,
// 1 gelu)}, all keys; dtype = the tensors'; the device's SM count and compute capability from the
// Problem. k must be a multiple of 8 (16-byte rows pieces); m and n are free.
// Buffers: x [m, k], wg [n, k], wu [n, k], out [m, n].
#pragma once

#include "kiln/family.h"

namespace kiln::families {

enum GatedAct { k_gated_silu = 0, k_gated_gelu = 1 };

}  // namespace kiln::families
