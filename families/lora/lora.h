// The LoRA kernel families (families/lora/lora.cuh): lora_shrink (x A^T as fp32 partial sums over
// ranges of K, or the scaled operand t) and lora_gemm (x W^T + s (x A^T) B^T + bias in one GEMM
// whose K loop runs on into the low-rank tail). Their problems, and the host rules the ops,
// references and tests share.
//
// lora_shrink: params dtype {f16, bf16}, bm {32, 64}, stages, output {partials, t}, ksub (k-steps
//   per stage). Problem LoraShrinkProblem. Buffers: x [m, k], a [adapters, slices r, k], idx [m]
//   i32 (multi), ranks [adapters] i32 (multi), u out: [splits, m, slices rp] f32 (rp = r rounded
//   up to 8), or with `t` the fused GEMM's operand t = scale (x A^T) in the element type,
//   [m, slices tp] (tp = r rounded up to 64, zeros past r).
// lora_gemm: params path {mma, wgmma, core}, dtype, bm, bn, stages. Problem LoraGemmProblem.
//   Buffers: x [m, k], w [n, k], b [adapters, n, r], u (lora_shrink's: f32 partials, or t with
//   `t`, which the core path takes and the others do not), idx, ranks, scales [adapters] f32
//   (multi), bias [n] (bias), out [m, n].
// Without `multi` every row uses adapter 0 with rank r and scale `scale`, and idx, ranks and scales
// are not read (the kernels get null pointers).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kiln/family.h"

namespace kiln::families::lora {

// The largest rank (per slice) and slice count the kernels take: a tail stage is 64 rank columns,
// so a rank up to 128 is at most two per slice; slices cover merged QKV (3) and gate_up (2).
inline constexpr std::int64_t k_max_rank = 128, k_max_slices = 3;

inline std::int64_t rank_pitch(std::int64_t r) { return (r + 7) / 8 * 8; }
// t's columns per slice: the rank in whole 64-column chunks (one k-step of the GEMM each).
inline std::int64_t t_pitch(std::int64_t r) { return (r + 63) / 64 * 64; }

struct LoraShrinkProblem {
  std::int64_t m = 0;         // bucketed key: rows of x
  std::int64_t k = 0;         // key: columns of x and of A
  std::int64_t r = 0;         // key: rank per slice (rows of A per slice)
  std::int64_t adapters = 1;  // key: adapters in A's stack
  std::int64_t slices = 1;    // key
  std::int64_t splits = 1;    // key: partial sums over K ranges (shrink_splits)
  std::int64_t multi = 0;     // key: 1 with per-row adapter indices and per-adapter ranks
  std::int64_t t = 0;         // key: 1 writes the fused GEMM's operand t (one split, no multi)
  double scale = 1.0;         // value: t's scale
};

struct LoraGemmProblem {
  std::int64_t m = 0;         // bucketed key
  std::int64_t n = 0;         // key: columns of out (rows of W and of each adapter's B)
  std::int64_t k = 0;         // key
  std::int64_t r = 0;         // key
  std::int64_t adapters = 1;  // key
  std::int64_t slices = 1;    // key
  std::int64_t splits = 1;    // key: u's partial sums
  std::int64_t multi = 0;     // key
  std::int64_t bias = 0;      // key: 1 with a bias
  std::int64_t t = 0;         // key: 1 when u holds t (the core path), 0 for f32 partials
  std::int64_t n1 = 0;        // value: end of slice 0 (slices >= 2)
  std::int64_t n2 = 0;        // value: end of slice 1 (slices == 3)
  double scale = 1.0;         // value: the adapter's scale without `multi`
};

// How many partial sums over K the shrink writes: enough blocks to cover the SMs when the rows are
// few (decode), at most 16 and at most one per 64-column K step.
inline std::int64_t shrink_splits(std::int64_t m, std::int64_t k, std::int64_t r, std::int64_t slices,
                                  std::int64_t sms) {
  const std::int64_t tiles = (m + 63) / 64 * ((slices * rank_pitch(r) + 63) / 64);
  const std::int64_t ktiles = std::max<std::int64_t>(1, (k + 63) / 64);
  return std::clamp<std::int64_t>((sms + tiles - 1) / tiles, 1, std::min<std::int64_t>(16, ktiles));
}

// Whether a call takes the core path (lora_gemm_core, its rank tail loaded by TMA from the shrink's
// t): sm_90a, one adapter, a rank whose B rows are whole 16-byte pieces, slice ends on 64-column
// tile boundaries, and more than 64 rows (decode-sized calls keep the split shrink and the wgmma
// path's tail, which reads the partial sums).
inline bool core_path(std::int64_t cc, std::int64_t m, std::int64_t r, std::int64_t multi, std::int64_t slices,
                      std::int64_t n1, std::int64_t n2) {
  return cc == 90 && m > 64 && !multi && r % 8 == 0 && (slices < 2 || n1 % 64 == 0) && (slices < 3 || n2 % 64 == 0);
}

// Slice s's output columns [slice_lo, slice_hi) for the slice ends n1, n2 (kernel's rule).
inline std::int64_t slice_lo(const LoraGemmProblem& q, std::int64_t s) { return s == 0 ? 0 : s == 1 ? q.n1 : q.n2; }
inline std::int64_t slice_hi(const LoraGemmProblem& q, std::int64_t s) {
  return s + 1 >= q.slices ? q.n : s == 0 ? q.n1 : q.n2;
}

}  // namespace kiln::families::lora
