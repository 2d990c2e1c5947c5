// Warp and block reductions.
#pragma once

namespace kiln {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over a block of BLOCK threads (a multiple of 32), returned to every thread. `scratch` holds
// at least 33 floats of shared memory; calling again with the same scratch is safe without an
// extra barrier (see the two-barrier scheme below).
template <int BLOCK>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  constexpr int k_warps = BLOCK / 32;
  v = warp_sum(v);
  if constexpr (k_warps == 1) {
    return v;
  } else {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
      float t = lane < k_warps ? scratch[lane] : 0.f;
      t = warp_sum(t);
      if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    // scratch[32] is rewritten only after the next call's first barrier, which every thread
    // reaches after this read.
    return scratch[32];
  }
}

// Sum over a block with one barrier instead of two, for a loop that reduces once per iteration:
// each warp's sum goes to scratch[parity], and every thread adds the BLOCK / 32 warp sums itself
// (in the same order, so every thread gets the same value). The caller alternates parity between
// calls: scratch[parity] is rewritten two calls later, after the next call's barrier, which every
// thread passes only after its reads here. scratch: 2 x 32 floats of shared memory, 16-byte
// aligned.
template <int BLOCK>
__device__ __forceinline__ float block_sum_alternating(float v, float (*scratch)[32], int parity) {
  constexpr int k_warps = BLOCK / 32;
  v = warp_sum(v);
  if constexpr (k_warps == 1) {
    return v;
  } else {
    float* s = scratch[parity];
    if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
    __syncthreads();
    if constexpr (k_warps % 4 == 0) {
      float4 acc = reinterpret_cast<const float4*>(s)[0];
#pragma unroll
      for (int i = 1; i < k_warps / 4; ++i) {
        const float4 q = reinterpret_cast<const float4*>(s)[i];
        acc.x += q.x;
        acc.y += q.y;
        acc.z += q.z;
        acc.w += q.w;
      }
      return (acc.x + acc.y) + (acc.z + acc.w);
    } else {
      float t = s[0];
#pragma unroll
      for (int i = 1; i < k_warps; ++i) t += s[i];
      return t;
    }
  }
}

// Bytes of dynamic shared memory this launch was given (the %dynamic_smem_size register), so a
// kernel sizes its shared-memory cache from the launch itself and takes no argument for it.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
}

}  // namespace kiln
