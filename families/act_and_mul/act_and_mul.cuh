// Activation-and-mul (SwiGLU / GeGLU gating): out[r, c] = act(x[r, c]) * x[r, d + c], in fp32.
//
// A pure streaming kernel: a flat grid over every (row, pack) of the output, one pack of VEC
// elements per thread per step (grid-stride for grids past the launch limit). The row and the pack
// within it come from a multiply-shift division by the packs per row (magic numbers from the
// host) while the flat index stays below 2^31, and from a 64-bit division beyond.
//
// Aliasing: out may be x itself (out = x[..., :d], same base and row stride): each thread reads
// both halves of its pack before writing it, so no __restrict__ on x and out.
// Requires: x and out aligned to VEC*sizeof(T) bytes; d, both row strides multiples of VEC.
#pragma once

#include "act_and_mul/activations.cuh"
#include "common/dtype.cuh"

namespace kiln {

template <typename T, int ACT, int BLOCK, int VEC>
__global__ void __launch_bounds__(BLOCK)
act_and_mul(const T* x, T* out, long long total_packs, long long packs_per_row, unsigned div_magic,
            unsigned div_shift, long long d, long long x_stride, long long out_stride) {
  using P = Pack<T, VEC>;
  const long long step = (long long)gridDim.x * BLOCK;
  for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < total_packs; i += step) {
    long long row;
    if (i < (1ll << 31)) {
      // floor(i / packs_per_row) for i < 2^31 (Granlund-Montgomery round-up method).
      const unsigned u = unsigned(i);
      row = (__umulhi(u, div_magic) + u) >> div_shift;
    } else {
      row = i / packs_per_row;
    }
    const long long c = (i - row * packs_per_row) * VEC;
    const T* xr = x + row * x_stride + c;
    const P a = load_pack<T, VEC>(xr);
    const P b = load_pack<T, VEC>(xr + d);
    P o;
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      o.v[k] = from_float<T>(activate<ACT, sizeof(T) == 4>(to_float(a.v[k])) * to_float(b.v[k]));
    store_pack<T, VEC>(out + row * out_stride + c, o);
  }
}

}  // namespace kiln
