// RMSNorm backward, second stage: dw[c] = sum over slabs of partial[slab, c], in fp32, in a fixed
// order (deterministic), converted to the weight's dtype.
//
// A block of BLOCK threads owns COLUMNS adjacent columns and BLOCK / COLUMNS slab lanes: lane l
// adds slabs l, l + lanes, ... of its column (four loads in flight per step), then the lanes of a
// warp that share a column add by shuffles and the warps through shared memory. With COLUMNS = 8
// each slab row is read as one 32-byte sector per block, and a row of 2048 columns still spreads
// over 256 blocks (with 32 columns, 64 blocks left half the GPU idle: 528 x 2048 partials 9.1 ->
// 7.2 µs, 264 x 2048 6.9 -> 6.0 on an H100, bench/exp/bulk_exp.cu). With no slabs (no rows) dw is
// zero.
#pragma once

#include "common/dtype.cuh"

namespace kiln {

template <typename T, int BLOCK, int COLUMNS>
__global__ void __launch_bounds__(BLOCK)
rmsnorm_bwd_reduce(const float* __restrict__ partial, T* __restrict__ dw, long long slabs, long long cols) {
  static_assert(COLUMNS == 8 || COLUMNS == 16 || COLUMNS == 32, "COLUMNS divides a warp");
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
