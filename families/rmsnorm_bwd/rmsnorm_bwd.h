// RMSNorm backward, first stage (rmsnorm_bwd): dx row by row, and dw as one fp32 partial row per
// row slab, summed by the rmsnorm_bwd_reduce family (no per-element atomics). With s = inv_rms[r]
// saved by the forward and n = cols:
//   dx = s * dy * w - x * s^3 * mean(dy * w * x) [+ dh],   dw = sum over rows of dy * x * s.
// Two options, in every kernel: `recompute` computes s = rsqrt(mean(x^2) + eps) from the x the
// kernel reads (its sum of squares reduced with the row's other sum, so no extra pass; inv_rms is
// not read), and `dh` adds a gradient dh (dy's dtype, its own row stride) to dx where dx is
// stored: the backward of add + RMSNorm, whose h = x + residual is an output too.
//
// Three kernels: the register kernel (stages = 0) reads each row into registers; the bulk-copy
// kernel (stages > 0, cluster 1, sm_90 and later) brings rows into a ring of `stages` shared-memory
// row buffers with cp.async.bulk, one block per row; the clustered bulk kernel (stages > 0,
// cluster > 1) splits each row over a cluster, each block with its own ring
// (families/rmsnorm_bwd/rmsnorm_bwd.cuh).
//
// Params: dtype {f32, f16, bf16}; group {32 .. 512} threads per row (powers of two for the register
// kernel, multiples of 32 for the bulk one); rows {1, 2, 4, 8} rows in
// flight per block (block = group * rows <= 512 threads; kernels get 64 registers per thread and
// keep dw in shared memory);
// vec {1, 2, 4, 8} elements per access (vec * sizeof(dtype) <= 16 bytes); packs {1, 2, 4} vec-packs
// of dy and x kept in registers per thread (4: bulk only); cluster {1, 2, 4, 8} blocks sharing a
// row (a thread-block cluster, sm_90 and later); sm_threads {512, 1024} resident threads per SM the
// kernel is built for (a register cap of 128 or 64 per thread); stages {0, 2, 3, 4, 6}; recompute
// {0, 1} and dh {0, 1}, which must match the problem's (below). Bulk kernels
// take rows = 1, sm_threads = 512, 16-byte packs, and problems with 16-byte aligned buffers and row
// strides, rows of whole packs, at most cluster * group * packs of them, on a device with clusters
// (max_cluster > 1: sm_90 and later, where bulk copies exist); without a cluster at most 2048
// packs, with one at least 3 stages. The bulk-copy kernel without a cluster takes dh = 1 only up
// to 16 elements per thread (packs * vec <= 16): past that its dh loads spill.
// Problem (RmsNormBwdProblem): keys rows (bucketed), cols, dy_row_stride, x_row_stride,
// dx_row_stride (strides in elements), slabs (how many row slabs, hence partial dw rows, the
// caller chose, see rmsnorm_bwd_slabs), max_cluster (the largest cluster the device launches, 1
// before sm_90), dh_row_stride (0: no dh), recompute; value eps. Buffers: dy, x, w ([cols]),
// inv_rms (f32 [rows]; none with recompute) in; dx, partial (f32 [slabs, cols]) out; dh in (the
// seventh buffer, which callers of a problem without dh may leave out). Slab i holds rows i,
// i + slabs, i + 2 * slabs, ... (dealt in turn, so the rows in flight across the GPU are
// neighbours in memory).
//
// The heuristic (rmsnorm_bwd_heuristic):
// - The clustered bulk kernel wherever bulk copies can run and a row has 2049 to 8192 16-byte packs
//   (hidden 16385 to 65536 in bf16): clusters of 2 up to 4096 packs, else 4; four packs per
//   thread; group = the block's packs / 4 rounded up to whole warps (512 at hidden 32768 and
//   65536 bf16); 3 row buffers. With dh, also rows of 1025 to 2048 packs in f16 and bf16 (the
//   one-block kernel would need 4 packs per thread), in clusters of 2 at two packs per thread.
// - Bulk copies wherever they can run and a row has 256 to 2048 16-byte packs (hidden 2048 to
//   16384 in bf16): two packs per thread up to 1024 packs, else four; group = packs / packs per
//   thread rounded up to whole warps; 4 row buffers while the SM's buffers (512 / group blocks,
//   at least 1) stay within 128 KiB, else 2 (hidden 16384 bf16). With dh, f16 and bf16 rows of
//   at most 1024 packs.
// Otherwise the register kernel, for packs = cols / vec:
// - vec: the widest access (16 bytes) that the buffers' alignment, the row strides (dh's
//   included) and the row length allow.
// - cluster: the smallest power of two up to 8 (and up to max_cluster) that leaves each block at
//   most 1024 packs, so that a block of 512 threads holds its part of the row in registers at two
//   packs per thread (hidden 16384 bf16: 2 blocks per row; 65536: 8).
// - group: the smallest power of two >= half the block's packs, 32 to 512; packs per thread: 1 if
//   the group covers the block's packs, else 2 (without clusters, what does not fit in 512 x 2
//   packs, hidden > 8192 bf16 / 4096 f32, is re-read from memory).
// - rows: enough groups for 256 threads per block (small rows get several rows per block, one
//   per warp at 32 threads), never more than the problem's rows.
// - sm_threads: 1024 (the 64-register cap) for blocks of 256 threads or more, else 512.
// - slabs (rmsnorm_bwd_slabs): for the clustered bulk kernel, as many as clusters the GPU holds at
//   once (the caller asks the driver); otherwise as many as blocks the GPU holds at once (SMs x sm_threads / block
//   threads, divided by the cluster size; times cluster / 2 for clusters of 4 and 8, whose GPC
//   packing is uncertain, so that waves stay even), never more than there are batches of `rows`
//   rows.
#pragma once

#include <span>
#include <vector>

#include "kiln/family.h"

namespace kiln::families {

// The first stage's problem; every field but eps is a key (part of the tuning signature).
struct RmsNormBwdProblem {
  std::int64_t rows = 0;           // key, bucketed: rows of dy, x and dx
  std::int64_t cols = 0;           // key: elements per row (the hidden size)
  std::int64_t dy_row_stride = 0;  // key: elements between two rows of dy
  std::int64_t x_row_stride = 0;   // key: elements between two rows of x
  std::int64_t dx_row_stride = 0;  // key: elements between two rows of dx
  std::int64_t slabs = 0;          // key: row slabs, hence partial dw rows (rmsnorm_bwd_slabs)
  std::int64_t max_cluster = 0;    // key: the largest cluster the device launches, 1 before sm_90
  std::int64_t dh_row_stride = 0;  // key: elements between two rows of dh, added to dx; 0: no dh
  std::int64_t recompute = 0;      // key: 1 computes inv_rms from x (the inv_rms buffer is not read)
  double eps = 0;                  // value: added to mean(x^2) with recompute
};

struct RmsNormBwdChoice {
  int group;
  int rows;
  int vec;
  int packs;
  int cluster;
  int sm_threads;  // resident threads per SM the kernel's register cap allows: 512 or 1024
  int stages = 0;  // bulk-copy row buffers (rmsnorm_bwd_bulk); 0: the register kernel
  // The options, which follow the problem (RmsNormBwdProblem::recompute and dh_row_stride).
  bool recompute = false;
  bool dh = false;
};
// Dynamic shared memory of a bulk-copy choice (stages > 0) for elements of `esize` bytes: the row
// buffers of dy and x, and dw when a thread holds more than 16 elements.
std::int64_t rmsnorm_bwd_bulk_smem(const RmsNormBwdChoice& c, std::int64_t esize);
// The choice that validated params hold.
RmsNormBwdChoice rmsnorm_bwd_choice(const Params& params);
// Ignores the problem's slabs: the slab count follows from the choice.
RmsNormBwdChoice rmsnorm_bwd_heuristic(const Problem& p);
// The slab count for a choice on a GPU with `sms` multiprocessors (>= 1 when rows > 0). The
// clustered bulk kernel (stages > 0, cluster > 1) takes one slab per cluster the GPU holds at once:
// `resident_clusters` when the caller asked the driver (cuOccupancyMaxActiveClusters), else sms
// times the blocks an SM's shared memory and threads allow, over cluster: an upper bound, which
// may be more than fit (30 clusters of 4 on a 132-SM H100, not 33).
std::int64_t rmsnorm_bwd_slabs(const RmsNormBwdChoice& c, const Problem& p, int sms, int resident_clusters = 0);

// One row of the backward in fp64, for the CPU references of rmsnorm_bwd and rmsnorm_bwd_rows:
// writes row r of dx (element type t) and adds the row's dy * x * s to dw. s is inv_rms[r], or
// with `recompute` rsqrt(mean(x^2) + eps); dh (row stride dh_stride; null: none) is added to dx.
struct RmsNormBwdRowRef {
  DType t;
  std::int64_t cols, dy_stride, x_stride, dx_stride, dh_stride;
  bool recompute;
  double eps;
  const void *dy, *x, *w, *dh;
  const float* inv_rms;
  void* dx;
};
void rmsnorm_bwd_reference_row(const RmsNormBwdRowRef& a, std::int64_t r, std::vector<double>& dw);
// The row reference's arguments from a problem with the fields of RmsNormBwdProblem (rmsnorm_bwd's
// or rmsnorm_bwd_rows') and its buffers in the families' order: dy, x, w, inv_rms, dx, (partial or
// dw), dh.
template <class Q>
RmsNormBwdRowRef rmsnorm_bwd_row_ref(DType t, const Q& q, std::span<void* const> b) {
  return {.t = t,
          .cols = q.cols,
          .dy_stride = q.dy_row_stride,
          .x_stride = q.x_row_stride,
          .dx_stride = q.dx_row_stride,
          .dh_stride = q.dh_row_stride,
          .recompute = q.recompute != 0,
          .eps = q.eps,
          .dy = b[0],
          .x = b[1],
          .w = b[2],
          .dh = q.dh_row_stride ? b[6] : nullptr,
          .inv_rms = static_cast<const float*>(b[3]),
          .dx = b[4]};
}

}  // namespace kiln::families
