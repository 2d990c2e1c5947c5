// Helpers shared by the RoPE templates.
#pragma once

#include "common/dtype.cuh"

namespace kiln {

// N consecutive values of type C as floats, in accesses of at most 16 bytes.
// Requires: p aligned to min(N * sizeof(C), 16) bytes.
template <typename C, int N>
__device__ __forceinline__ void load_floats(const C* __restrict__ p, float (&out)[N]) {
  constexpr int k_per_access = int(16 / sizeof(C)) < N ? int(16 / sizeof(C)) : N;
#pragma unroll
  for (int i = 0; i < N; i += k_per_access) {
    const Pack<C, k_per_access> v = load_pack<C, k_per_access>(p + i);
#pragma unroll
    for (int j = 0; j < k_per_access; ++j) out[i + j] = to_float(v.v[j]);
  }
}

}  // namespace kiln
