// Fused residual add + RMSNorm family: h = x + residual; residual_out = h;
// y = h * rsqrt(mean(h^2) + eps) * w, row by row, in one pass.
//
// Rounding convention (vLLM's): h is summed in fp32 and rounded to the storage dtype; that rounded
// value is what residual_out holds and what is normalized. y = h * scale * w is computed in fp32
// and rounded once. The CPU reference does the same in fp64 (x + residual is exact in fp64, so its
// rounding to the dtype gives the same h bits as the kernel).
//
// Params: dtype {f32, f16, bf16}, block {64 .. 1024} threads, vec {1, 2, 4, 8} elements per
// access (vec * sizeof(dtype) <= 16 bytes), row {0, 1, 2}: 0 for the general kernel, else the
// one-row kernel with that many packs per thread (rows of whole packs, at most block * row).
// Problem: AddRmsNormProblem below.
// Buffers: x (input), residual (input), w (input, [cols]), y (output), residual_out (output).
// residual_out may alias residual and y may alias x (same base, same row stride).
//
// Heuristic: up to 1024 rows of whole 16-byte packs, at most 2048 of them, the one-row kernel with
// two packs per thread (the smallest block of 64..1024 that holds the row).
// Otherwise vec is the widest access (up to 16 bytes; 8 for rows past the register cache) that
// the common alignment of the five buffers and four row strides allows, and no wider than the row.
// block is the smallest power of two in 64..1024 giving each thread at most two packs (one to two;
// from 2048 rows at most 2.5, the half pack through shared memory, which is faster than a twice
// larger block at 5120 bf16 columns): the kernel caches two 16-byte packs of h per thread in
// registers, so rows up to 2048 packs (16384 bf16, 8192 f32 elements) are read from memory once;
// longer rows use 1024 threads (512 from 2048 rows, slightly faster at 4096 x 65536) and keep the
// rest of h in up to 96 KiB of shared memory, re-reading any remainder from residual_out (just
// written, still in L2). The small cache keeps every variant within 64 registers, so at least
// 1024 threads stay resident per SM.
#pragma once

#include "kiln/family.h"

namespace kiln::families {

// The problem (kiln/problem.h). Keys: rows (bucketed), cols and the four row strides (in
// elements); value: eps.
struct AddRmsNormProblem {
  std::int64_t rows = 0;                     // rows to normalize
  std::int64_t cols = 0;                     // elements per row (the weight's length)
  std::int64_t x_row_stride = 0;             // elements between the starts of two rows of x
  std::int64_t residual_row_stride = 0;      // the same for residual
  std::int64_t y_row_stride = 0;             // for y
  std::int64_t residual_out_row_stride = 0;  // for residual_out
  double eps = 0;                            // added to the mean square
};

struct AddRmsNormChoice {
  int block;
  int vec;
  int row = 0;  // packs per thread of the one-row kernel (add_rmsnorm_fwd_row); 0: the general kernel
};
AddRmsNormChoice add_rmsnorm_heuristic(const Problem& p);
// The most rows the heuristic gives the one-row kernel.
constexpr std::int64_t k_add_rmsnorm_row_kernel_rows = 1024;

// Packs of h past the register cache that the kernel keeps in dynamic shared memory (at most
// 96 KiB: a 64K-element bf16 row then needs no re-read); the rest it re-reads from residual_out.
constexpr std::int64_t k_add_rmsnorm_max_smem = 96 * 1024;
std::int64_t add_rmsnorm_smem_packs(const Params& params, const Problem& p);

}  // namespace kiln::families
