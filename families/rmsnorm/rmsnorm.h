// RMSNorm forward family: y = x * rsqrt(mean(x^2) + eps) * w, row by row.
//
// Params: dtype {f32, f16, bf16}, block {64 .. 1024} threads, vec {1, 2, 4, 8} elements per
// access (vec * sizeof(dtype) <= 16 bytes), bulk {0, 2, 4, 6, 8}: 0 for the register kernel, else
// the bulk-copy kernel (sm_90 and later) with that many 16-byte packs per thread (vec must make 16
// bytes, block at least 256); row {0, 1, 2, 4}: 0, else the one-row kernel with that many packs
// per thread (one block per row, rows of whole packs, at most block * row of them; bulk 0).
// Problem: RmsNormProblem below. The device's SM count (Problem::sm_count; 0: one block per row)
// sizes the grid, and its compute capability (Problem::cc; 0 when unknown, which rules out the
// sm_90 kernel) picks the kernel.
// Buffers: x (input), w (input, [cols]), y (output), inv_rms (output, f32 [rows]; may be null:
// then it is not written). Register kernel: rows longer than the register cache keep the rest in
// dynamic shared memory (rmsnorm_smem_packs), up to 96 KiB; rows that fit it may stage the weight
// there. Bulk-copy kernel: persistent blocks (as many as the SMs hold), each row copied into
// shared memory in two parts, the first held in registers so that the next row's copy overlaps
// this row's stores.
// Heuristic (chosen with bench section `variants` and the tuner on Hopper; rmsnorm.cpp says why): from
// 2048 rows, rows of 64-128 KiB on sm_90 with 16-byte aligned rows take the bulk-copy kernel (512
// or 1024 threads); otherwise 8-byte accesses and the smallest block of 64..512 threads giving at most
// eight packs per thread (longer rows keep the rest in shared memory), except f16/bf16 rows of
// 10-32 KiB under 16384 rows: 16-byte accesses, at most four per thread; and rows of 64-128 KiB:
// 1024 threads with 4-byte accesses (24 of each thread's 32 packs in shared memory); under 2048
// rows 4-byte accesses and 16 packs per thread; up to 64 rows 16-byte accesses and two packs per
// thread where 1024 threads cover the row that way, else 1024 threads with accesses widened only
// while each thread keeps eight. Before all of these: up to 1024 rows of whole 16-byte packs (at
// most 2048, 16-byte aligned buffers and row strides), the one-row kernel with two packs per
// thread. Accesses narrow until the buffers'
// alignment and row strides allow them. With the SM count in the problem, register-kernel variants
// whose rows fit half their register cache pipeline on a capped grid.
#pragma once

#include "kiln/family.h"

namespace kiln::families {

// The problem (kiln/problem.h). Keys: rows (bucketed), cols, x_row_stride, y_row_stride; value:
// eps.
struct RmsNormProblem {
  std::int64_t rows = 0;          // rows to normalize
  std::int64_t cols = 0;          // elements per row (the weight's length)
  std::int64_t x_row_stride = 0;  // elements between the starts of two rows of x
  std::int64_t y_row_stride = 0;  // elements between the starts of two rows of y
  double eps = 0;                 // added to the mean square
};

// The parameters the heuristic picks for a problem (also used by the typed op's fast path).
struct RmsNormChoice {
  int block;
  int vec;
  int bulk = 0;  // 16-byte packs per thread of the bulk-copy kernel; 0: the register kernel
  int row = 0;   // packs per thread of the one-row kernel (rmsnorm_fwd_row); 0: another kernel
};
RmsNormChoice rmsnorm_heuristic(const Problem& p);
// The most rows the heuristic gives the one-row kernel.
constexpr std::int64_t k_rmsnorm_row_kernel_rows = 1024;

// Packs of dynamic shared memory the kernel gets. Rows longer than the register cache: the packs
// past it that the kernel keeps there (the rest, if any, it reads twice), at most
// k_rmsnorm_max_smem bytes, which lets a 64K-element bf16 row be read once by a 1024-thread block
// and leaves room for two such blocks per H100 SM. Rows that fit it: room for the weight in blocks
// under 1024 threads with packs of 8 bytes and more, which the kernel stages there once, before its
// first reduction (1024-thread blocks keep the weight in registers; other rows read it after the
// reduction).
constexpr std::int64_t k_rmsnorm_max_smem = 96 * 1024;
std::int64_t rmsnorm_smem_packs(const Params& params, const Problem& p);

// Blocks to launch: one per row, or (SM count known, rows short enough to pipeline) about 1024 threads
// per SM, each block taking several rows.
std::int64_t rmsnorm_grid(const Params& params, const Problem& p);

}  // namespace kiln::families
