// RMSNorm forward: y = x * rsqrt(mean(x^2) + eps) * w over the last dimension, fp32 accumulation.
//
// One block per row (grid-stride over rows). Each thread keeps up to k_cached packs of its slice of
// the row in registers between the reduction and the write, so rows up to BLOCK*VEC*k_cached
// elements are read from memory once; longer rows re-read the rest. Columns past the last whole
// pack are handled one element at a time, so any row length works.
// inv_rms (optional, f32 [rows]) receives rsqrt(mean(x^2) + eps) per row, for the backward pass.
// Requires: x, y and w aligned to VEC*sizeof(T) bytes, row strides multiples of VEC.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"

namespace kiln {

template <typename T, int BLOCK, int VEC>
__global__ void __launch_bounds__(BLOCK)
rmsnorm_fwd(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, float* __restrict__ inv_rms,
            long long rows, long long cols, long long x_stride, long long y_stride, float eps) {
  using P = Pack<T, VEC>;
  // Registers of row cache per thread: 32 for blocks up to 256 threads, 16 at 512, 8 under the
  // 64-register cap of 1024-thread blocks (16 made ptxas spill there).
  constexpr int k_cache_regs = BLOCK >= 1024 ? 8 : BLOCK >= 512 ? 16 : 32;
  constexpr int k_regs_per_pack = sizeof(P) >= 4 ? int(sizeof(P)) / 4 : 1;
  constexpr int k_cached = k_cache_regs / k_regs_per_pack;
  __shared__ float scratch[33];

  // Row lengths are below 2^31 (checked on the host), so in-row indices are 32-bit.
  const int packs = int(cols / VEC);
  const int n = int(cols);
  const float inv_cols = 1.f / float(cols);

  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * x_stride;
    T* yr = y + row * y_stride;

    P cached[k_cached];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < k_cached; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs) {
        cached[i] = load_pack<T, VEC>(xr + p * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float f = to_float(cached[i].v[k]);
          acc = fmaf(f, f, acc);
        }
      }
    }
    for (int p = int(threadIdx.x) + k_cached * BLOCK; p < packs; p += BLOCK) {
      const P v = load_pack<T, VEC>(xr + p * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float f = to_float(v.v[k]);
        acc = fmaf(f, f, acc);
      }
    }
    for (int j = packs * VEC + int(threadIdx.x); j < n; j += BLOCK) {
      const float f = to_float(xr[j]);
      acc = fmaf(f, f, acc);
    }

    const float scale = rsqrtf(block_sum<BLOCK>(acc, scratch) * inv_cols + eps);
    if (inv_rms != nullptr && threadIdx.x == 0) inv_rms[row] = scale;

#pragma unroll
    for (int i = 0; i < k_cached; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs) {
        const P wv = load_pack<T, VEC>(w + p * VEC);
        P out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(cached[i].v[k]) * scale * to_float(wv.v[k]));
        store_pack<T, VEC>(yr + p * VEC, out);
      }
    }
    for (int p = int(threadIdx.x) + k_cached * BLOCK; p < packs; p += BLOCK) {
      const P v = load_pack<T, VEC>(xr + p * VEC);
      const P wv = load_pack<T, VEC>(w + p * VEC);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(v.v[k]) * scale * to_float(wv.v[k]));
      store_pack<T, VEC>(yr + p * VEC, out);
    }
    for (int j = packs * VEC + int(threadIdx.x); j < n; j += BLOCK)
      yr[j] = from_float<T>(to_float(xr[j]) * scale * to_float(w[j]));
  }
}

}  // namespace kiln
