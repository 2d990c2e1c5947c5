// LayerNorm forward (the example plugin, docs/plugins.md):
//   y = (x - mean(x)) * rsqrt(var(x) + eps) * gamma + beta over each row, fp32 accumulation.
//
// One block per row (grid-stride over rows). The row is read twice: once for the mean and once
// for the centred sum of squares (two passes: exact where a one-pass sum of squares cancels for
// rows with a large mean), then a third time to write y. Columns past the last whole pack are
// handled one element at a time, so any row length works.
// Requires: x, y, gamma, beta aligned to VEC * sizeof(T) bytes; rows contiguous.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"

namespace kiln_layernorm {

template <typename T, int BLOCK, int VEC>
__global__ void __launch_bounds__(BLOCK)
layernorm_fwd(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta, T* __restrict__ y,
              long long rows, long long cols, float eps) {
  using P = kiln::Pack<T, VEC>;
  __shared__ float scratch[33];
  const long long packs = cols / VEC;
  const float inv_cols = 1.f / float(cols);
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    T* yr = y + row * cols;

    float sum = 0.f;
    for (long long p = threadIdx.x; p < packs; p += BLOCK) {
      const P v = kiln::load_pack<T, VEC>(xr + p * VEC);
#pragma unroll
      for (int i = 0; i < VEC; ++i) sum += kiln::to_float(v.v[i]);
    }
    for (long long c = packs * VEC + threadIdx.x; c < cols; c += BLOCK) sum += kiln::to_float(xr[c]);
    const float mean = kiln::block_sum<BLOCK>(sum, scratch) * inv_cols;

    float sq = 0.f;
    for (long long p = threadIdx.x; p < packs; p += BLOCK) {
      const P v = kiln::load_pack<T, VEC>(xr + p * VEC);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d = kiln::to_float(v.v[i]) - mean;
        sq += d * d;
      }
    }
    for (long long c = packs * VEC + threadIdx.x; c < cols; c += BLOCK) {
      const float d = kiln::to_float(xr[c]) - mean;
      sq += d * d;
    }
    const float rstd = rsqrtf(kiln::block_sum<BLOCK>(sq, scratch) * inv_cols + eps);

    for (long long p = threadIdx.x; p < packs; p += BLOCK) {
      const P v = kiln::load_pack<T, VEC>(xr + p * VEC);
      const P g = kiln::load_pack<T, VEC>(gamma + p * VEC);
      const P b = kiln::load_pack<T, VEC>(beta + p * VEC);
      P out;
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        out.v[i] = kiln::from_float<T>((kiln::to_float(v.v[i]) - mean) * rstd * kiln::to_float(g.v[i]) +
                                       kiln::to_float(b.v[i]));
      kiln::store_pack<T, VEC>(yr + p * VEC, out);
    }
    for (long long c = packs * VEC + threadIdx.x; c < cols; c += BLOCK)
      yr[c] = kiln::from_float<T>((kiln::to_float(xr[c]) - mean) * rstd * kiln::to_float(gamma[c]) +
                                  kiln::to_float(beta[c]));
  }
}

}  // namespace kiln_layernorm
