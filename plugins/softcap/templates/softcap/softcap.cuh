// Soft capping (the example plugin, docs/plugins.md): y = cap * tanh(x / cap), elementwise, in fp32.
// Models that bound their logits smoothly (attention scores, final logits) apply it.
//
// A grid-stride loop over packs of VEC elements, then the n % VEC elements past the last whole
// pack one per thread, so any n works.
// Requires: x and y aligned to VEC * sizeof(T) bytes; cap finite and positive.
#pragma once

#include "common/dtype.cuh"

namespace kiln_softcap {

__device__ __forceinline__ float softcap_one(float v, float cap, float inv_cap) { return cap * tanhf(v * inv_cap); }

template <typename T, int BLOCK, int VEC>
__global__ void __launch_bounds__(BLOCK)
softcap(const T* __restrict__ x, T* __restrict__ y, long long n, float cap) {
  using P = kiln::Pack<T, VEC>;
  const float inv_cap = 1.f / cap;
  const long long packs = n / VEC;
  const long long stride = static_cast<long long>(gridDim.x) * BLOCK;
  const long long first = static_cast<long long>(blockIdx.x) * BLOCK + threadIdx.x;
  for (long long p = first; p < packs; p += stride) {
    const P v = kiln::load_pack<T, VEC>(x + p * VEC);
    P out;
#pragma unroll
    for (int i = 0; i < VEC; ++i) out.v[i] = kiln::from_float<T>(softcap_one(kiln::to_float(v.v[i]), cap, inv_cap));
    kiln::store_pack<T, VEC>(y + p * VEC, out);
  }
  for (long long i = packs * VEC + first; i < n; i += stride)
    y[i] = kiln::from_float<T>(softcap_one(kiln::to_float(x[i]), cap, inv_cap));
}

}  // namespace kiln_softcap
