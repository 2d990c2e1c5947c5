// RMSNorm backward, second stage: dw[c] = sum over slabs of partial[slab, c], in fp32, in a fixed
// order (deterministic), converted to the weight's dtype.
//
// A block of 32 x (BLOCK / 32) threads owns 32 adjacent columns: each warp reads 128 contiguous
// bytes of a partial row, the warps stride over the slabs, and shared memory adds the warps'
// sums. With no slabs (no rows) dw is zero.
#pragma once

#include "common/dtype.cuh"

namespace kiln {

template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
rmsnorm_bwd_reduce(const float* __restrict__ partial, T* __restrict__ dw, long long slabs, long long cols) {
  constexpr int k_warps = BLOCK / 32;
  constexpr int k_unroll = 4;
  __shared__ float sums[k_warps][33];
  const int lane = int(threadIdx.x), warp = int(threadIdx.y);
  const long long col = (long long)blockIdx.x * 32 + lane;

  float acc = 0.f;
  if (col < cols) {
    long long s = warp;
    // Independent loads in flight: k_unroll slabs per step.
    for (; s + (k_unroll - 1) * k_warps < slabs; s += k_unroll * k_warps) {
      float v[k_unroll];
#pragma unroll
      for (int u = 0; u < k_unroll; ++u) v[u] = partial[(s + u * k_warps) * cols + col];
#pragma unroll
      for (int u = 0; u < k_unroll; ++u) acc += v[u];
    }
    for (; s < slabs; s += k_warps) acc += partial[s * cols + col];
  }
  sums[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && col < cols) {
#pragma unroll
    for (int q = 1; q < k_warps; ++q) acc += sums[q][lane];
    dw[col] = from_float<T>(acc);
  }
}

}  // namespace kiln
