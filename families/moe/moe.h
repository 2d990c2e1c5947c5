// The MoE kernel families (families/moe/): routing (moe_topk), the counting sort by expert
// (moe_sort), the gather into expert-sorted rows (moe_gather), the weighted combine back to token
// order (moe_combine), and the grouped GEMM over experts (grouped_gemm, grouped_gemm_fp8). Their
// problems, and the host forms of the rules their kernels and CPU references share.
//
// moe_topk: params dtype {f32, f16, bf16} (logits), scoring {softmax, sigmoid_group}. Problem
//   MoeTopkProblem. Buffers: logits [tokens, experts], bias [experts] f32 (sigmoid_group; a
//   one-element dummy for softmax), weights [tokens, top_k] f32 out, ids [tokens, top_k] i32 out.
// moe_sort: no params. Problem MoeSortProblem. Buffers: ids [n] i32 (values outside [0, experts)
//   are dropped), offsets [experts + 1] i32 out, row_of [n] i32 out, src_of [n] i32 out.
// moe_gather: params dtype, vec {1, 2, 4, 8}, weighted {0, 1}. Problem MoeGatherProblem. Buffers:
//   x [tokens, hidden], src_of [rows] i32, weights [tokens x top_k] f32 (weighted; else one
//   element), out [rows, hidden].
// moe_combine: params dtype, vec, weighted. Problem MoeCombineProblem. Buffers: y [rows, hidden],
//   row_of [tokens x top_k] i32, weights [tokens x top_k] f32 (weighted; else one element), out
//   [tokens, hidden].
// grouped_gemm: params path {mma, wgmma}, dtype {f16, bf16}, layout {contiguous, masked,
//   kgrouped, dgrad}, bm, bn, stages. Problem GroupedGemmProblem. Buffers: a, b, offs [experts] i32, out
//   (families/moe/grouped_gemm.cuh has the layouts).
// grouped_gemm_fp8: params path, out {f16, bf16}, layout {contiguous, masked}, scaling {rowwise,
//   block}, bm, bn, stages. Problem GroupedGemmFp8Problem (dtype: out's). Buffers: a u8, weight
//   [experts, n, k] u8, offs, a_scale f32 (rowwise: [rows of a]; block: [rows, ceil(k/128)]),
//   b_scale f32 (rowwise: [experts, n]; block: [experts, ceil(n/128), ceil(k/128)]), out.
#pragma once

#include <cstdint>
#include <vector>

#include "kiln/family.h"

namespace kiln::families::moe {

enum Scoring { k_softmax = 0, k_sigmoid_group = 1 };
enum Layout { k_contiguous = 0, k_masked = 1, k_kgrouped = 2, k_dgrad = 3 };

// The most experts the routing and grouped GEMM kernels take (their shared-memory tables), and
// the largest top_k (one lane of a warp per pick).
inline constexpr std::int64_t k_max_experts = 1024, k_max_top_k = 32;

struct MoeTopkProblem {
  std::int64_t tokens = 0;      // bucketed key
  std::int64_t experts = 0;     // key
  std::int64_t top_k = 0;       // key
  std::int64_t scoring = 0;     // key: Scoring
  std::int64_t n_group = 1;     // key: expert groups (sigmoid_group), experts a multiple of it
  std::int64_t topk_group = 1;  // key: groups kept (sigmoid_group)
  std::int64_t renormalize = 0; // value: weights divided by their sum over the picked experts
  double scale = 1.0;           // value: weights times this (sigmoid_group; DeepSeek-V3's routed scaling)
};

struct MoeSortProblem {
  std::int64_t n = 0;        // bucketed key: entries (tokens x top_k)
  std::int64_t experts = 0;  // key
};

struct MoeGatherProblem {
  std::int64_t rows = 0;    // bucketed key: rows of out
  std::int64_t hidden = 0;  // key
  std::int64_t tokens = 0;  // value: rows of x
  std::int64_t top_k = 0;   // value: entries per token (src_of / top_k is the token)
  std::int64_t weighted = 0;// key: rows scaled by weights[src_of]
};

struct MoeCombineProblem {
  std::int64_t tokens = 0;  // bucketed key
  std::int64_t hidden = 0;  // key
  std::int64_t rows = 0;    // value: rows of y
  std::int64_t top_k = 0;   // key
  std::int64_t weighted = 0;// key
};

struct GroupedGemmProblem {
  std::int64_t m = 0;        // bucketed key: rows of a (contiguous, kgrouped), or rows per expert (masked)
  std::int64_t n = 0;        // key: columns of out (contiguous, masked: rows of each b); kgrouped: columns of a
  std::int64_t k = 0;        // key: the reduction (contiguous, masked, dgrad); kgrouped: columns of b
  std::int64_t experts = 0;  // key
  std::int64_t layout = 0;   // key: Layout
};

// grouped_gemm_fp8's problem: GroupedGemmProblem's fields and the scaling.
enum Fp8Scaling { k_fp8_rowwise = 1, k_fp8_block = 2 };
struct GroupedGemmFp8Problem {
  std::int64_t m = 0;        // bucketed key: rows of a (masked: rows per expert)
  std::int64_t n = 0;        // key
  std::int64_t k = 0;        // key
  std::int64_t experts = 0;  // key
  std::int64_t layout = 0;   // key: contiguous or masked
  std::int64_t scaling = k_fp8_rowwise;  // key: Fp8Scaling
};

// Expert e's rows [lo[e], hi[e]) as the kernels read offs (grouped_gemm.cuh): for contiguous and
// kgrouped the running maximum of offs clamped to [0, m], for masked e m + clamp(offs[e], 0, m).
void expert_rows(const std::int32_t* offs, std::int64_t experts, std::int64_t m, Layout layout,
                 std::vector<std::int64_t>& lo, std::vector<std::int64_t>& hi);

// The routing the moe_topk kernels compute, in fp64 (the CPU reference): weights and ids of one
// token's `experts` logits.
void topk_route(const double* logits, const float* bias, const MoeTopkProblem& p, float* weights, std::int32_t* ids);

}  // namespace kiln::families::moe
