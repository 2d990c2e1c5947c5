// RMSNorm backward, second stage: dw[c] = sum over slabs of partial[slab, c], in fp32, in a fixed
// order (deterministic), converted to the weight's dtype.
//
// A block of BLOCK threads owns COLUMNS adjacent columns and BLOCK / COLUMNS slab lanes: lane l
// adds slabs l, l + lanes, ... of its column (four loads in flight per step), then the lanes of a
// warp that share a column add by shuffles and the warps through shared memory. With COLUMNS = 8
// each slab row is read as one 32-byte sector per block, and a row of 2048 columns still spreads
// over 256 blocks (with 32 columns, 64 blocks leave half the GPU idle). With no slabs (no rows) dw
// is zero.
//
// On sm_90 and later the host launches it as a programmatic dependent of rmsnorm_bwd, so the
// launch is prepared while the first stage runs and the blocks start as its last ones leave
// (the first stage triggers nothing itself; its blocks' exits do). That shortens the pair at 4096
// rows. Letting the first stage trigger as it starts, so that these blocks sit resident beside
// it, is slower, and so is one cooperative kernel summing dw after a grid barrier (experiments
// kept under the tag bench-exp-archive; docs/benchmarks.md has the figures).
#pragma once

#include "common/dtype.cuh"
#include "common/ptx.cuh"

namespace kiln {

template <typename T, int BLOCK, int COLUMNS>
__global__ void __launch_bounds__(BLOCK)
rmsnorm_bwd_reduce(const float* __restrict__ partial, T* __restrict__ dw, long long slabs, long long cols) {
  static_assert(COLUMNS == 8 || COLUMNS == 16 || COLUMNS == 32, "COLUMNS divides a warp");
  // Launched as a programmatic dependent of the first stage (the family's programmatic_launch):
  // the blocks may start while that kernel runs, and wait here until its partial rows are
  // written and visible.
  ptx::grid_dependency_wait();
  constexpr int k_lanes = BLOCK / COLUMNS, k_warps = BLOCK / 32, k_unroll = 4;
  __shared__ float sums[k_warps][COLUMNS];
  const int c = int(threadIdx.x) % COLUMNS, lane = int(threadIdx.x) / COLUMNS;
  const long long col = (long long)blockIdx.x * COLUMNS + c;

  float acc = 0.f;
  if (col < cols) {
    long long s = lane;
    for (; s + (k_unroll - 1) * k_lanes < slabs; s += k_unroll * k_lanes) {
      float v[k_unroll];
#pragma unroll
      for (int u = 0; u < k_unroll; ++u) v[u] = partial[(s + u * k_lanes) * cols + col];
#pragma unroll
      for (int u = 0; u < k_unroll; ++u) acc += v[u];
    }
    for (; s < slabs; s += k_lanes) acc += partial[s * cols + col];
  }
  // Lanes COLUMNS apart in a warp hold the same column.
#pragma unroll
  for (int off = COLUMNS; off < 32; off *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  const int warp = int(threadIdx.x) / 32;
  if (int(threadIdx.x) % 32 < COLUMNS) sums[warp][c] = acc;
  __syncthreads();
  if (int(threadIdx.x) < COLUMNS && col < cols) {
    float total = 0.f;
#pragma unroll
    for (int q = 0; q < k_warps; ++q) total += sums[q][c];
    dw[col] = from_float<T>(total);
  }
}

}  // namespace kiln
