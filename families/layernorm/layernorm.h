// LayerNorm kernel families (README.md in this folder): "layernorm" (forward) and "layernorm_bwd"
// (the backward's row pass; the slab sums of dweight and dbias are reduced by rmsnorm_bwd_reduce).
//
// Both kernels split a block into `rows` groups of `group` threads, one row per group; each thread
// holds `packs` packs of `vec` elements of its row in registers (a row of at most group * packs *
// vec elements, cols a multiple of vec), and rows may be strided.
//
// layernorm params: dtype {f32, f16, bf16}; group {32 .. 1024} threads per row; rows {1, 2, 4, 8}
// rows per block (group * rows <= 1024); vec {1, 2, 4, 8} elements per access (at most 16 bytes);
// packs {1, 2, 4, 8, 16} (packs * vec <= 32). Problem: LayerNormProblem below. Buffers: x, weight,
// bias (may be null), y, mean and rstd (f32 [rows], may be null). Dynamic shared memory
// (layernorm_fwd_smem): the weight and bias, staged once per block; none up to 1024 rows of up to
// 8 KiB (512 of longer ones, layernorm_lean_rows) for blocks of one row holding at most two packs
// (32 bytes) of a row per thread, which load them beside x instead.
//
// layernorm_bwd params: dtype, group {32 .. 512}, rows {1, 2, 4, 8} (group * rows <= 512), vec,
// packs {1, 2, 4} (packs * vec <= 16). Problem: LayerNormBwdProblem below. Buffers: dy, x, weight,
// mean, rstd, dx, partial (f32 [2 * slabs, cols]: dweight's slab sums, then dbias's). Dynamic
// shared memory (layernorm_bwd_smem): each thread's two column sums.
//
// Heuristic (layernorm_choice; the README's Heuristic section says why), after rmsnorm's and
// rmsnorm_bwd's register kernels:
// - Forward, the access width: 16 bytes up to layernorm_lean_rows (1024 rows of up to 8 KiB, else
//   512), and for f16/bf16 rows of 10-32 KiB from 2048 to 16383 rows; 8 bytes from 2048 rows; 4
//   bytes below. Narrowed until the alignment, the row strides and the row length allow it.
// - Forward, threads per row: the smallest power of two from 32 giving at most 2 packs a thread
//   (up to layernorm_lean_rows, up to 1024 threads), 4 of 16 or 8 of 8 bytes (from 2048 rows, up to 512), 16
//   (otherwise, up to 512); more packs, then more threads, when the row needs them. Groups under
//   128 threads share a block with others (up to 8 rows a block) while the grid still has two
//   blocks per SM.
// - Backward: 16-byte accesses where allowed; the smallest power of two from 32 threads holding
//   the row at two packs a thread (up to 512, then up to 4 packs); rows per block up to 512
//   threads; one slab per block the GPU holds at once (layernorm_bwd_slabs).
#pragma once

#include <cstdint>

#include "kiln/family.h"

namespace kiln::families {

// layernorm's problem (kiln/problem.h). Keys: rows (bucketed), cols, x_row_stride, y_row_stride;
// value: eps.
struct LayerNormProblem {
  std::int64_t rows = 0;          // rows to normalize
  std::int64_t cols = 0;          // elements per row (the weight's and bias's length)
  std::int64_t x_row_stride = 0;  // elements between the starts of two rows of x
  std::int64_t y_row_stride = 0;  // elements between the starts of two rows of y
  double eps = 0;                 // added to the variance
};

// layernorm_bwd's problem. Keys: rows (bucketed), cols, the three row strides, slabs.
struct LayerNormBwdProblem {
  std::int64_t rows = 0;           // rows of dy, x and dx
  std::int64_t cols = 0;           // elements per row
  std::int64_t dy_row_stride = 0;  // elements between two rows of dy
  std::int64_t x_row_stride = 0;   // elements between two rows of x
  std::int64_t dx_row_stride = 0;  // elements between two rows of dx
  std::int64_t slabs = 0;          // blocks; slab i takes rows i, i + slabs, ...; rows of partial per gradient
};

// The heuristic's variant of either kernel for p (the backward's ignores p's slabs);
// invalid_argument when no variant holds a row of p's length.
Result<Params> layernorm_choice(const Problem& p, bool backward);
// The backward's slab count for variant `params` on a GPU of `sms` SMs: one per block the GPU
// holds at once, at most one per `rows` rows of the problem.
std::int64_t layernorm_bwd_slabs(const Params& params, std::int64_t rows, int sms);
// Bytes of dynamic shared memory either kernel gets.
std::int64_t layernorm_fwd_smem(const Params& params, const Problem& p);
// Up to this many rows of `row_bytes` bytes the forward takes 16-byte accesses and two packs a
// thread, and blocks of one row load the weight and bias beside x instead of staging them: 1024
// rows of up to 8 KiB, 512 of longer ones.
inline std::int64_t layernorm_lean_rows(std::int64_t row_bytes) { return row_bytes <= 8192 ? 1024 : 512; }
std::int64_t layernorm_bwd_smem(const Params& params);

}  // namespace kiln::families
