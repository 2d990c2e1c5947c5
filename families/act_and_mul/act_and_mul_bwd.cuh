// The backward of activation-and-mul: from x = [g | u] (rows of 2d) and dy (rows of d),
//   dx[r, c]     = dy[r, c] * u[r, c] * act'(g[r, c])     (the gradient of the activated half)
//   dx[r, d + c] = dy[r, c] * act(g[r, c])                 (the gradient of the gate's multiplier)
// in fp32, recomputing act from x (the forward saves only x).
//
// The same flat grid as the forward (act_and_mul.cuh): one pack of VEC elements of each half per
// thread per step, the row from a multiply-shift division while the flat index stays below 2^31.
//
// Aliasing: dx may be x itself (same base and row stride): each thread reads both halves of its
// pack and dy's before writing either half, so no __restrict__ on x and dx. dy must not overlap
// dx.
// Requires: x, dy and dx aligned to VEC*sizeof(T) bytes; d and the three row strides multiples of
// VEC.
#pragma once

#include "act_and_mul/activations.cuh"
#include "common/dtype.cuh"

namespace kiln {

template <typename T, int ACT, int BLOCK, int VEC>
__global__ void __launch_bounds__(BLOCK)
act_and_mul_bwd(const T* x, const T* dy, T* dx, long long total_packs, long long packs_per_row,
                unsigned div_magic, unsigned div_shift, long long d, long long x_stride, long long dy_stride,
                long long dx_stride) {
  using P = Pack<T, VEC>;
  const long long step = (long long)gridDim.x * BLOCK;
  for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < total_packs; i += step) {
    long long row;
    if (i < (1ll << 31)) {
      const unsigned n = unsigned(i);
      row = (__umulhi(n, div_magic) + n) >> div_shift;
    } else {
      row = i / packs_per_row;
    }
    const long long c = (i - row * packs_per_row) * VEC;
    const T* xr = x + row * x_stride + c;
    const P g = load_pack<T, VEC>(xr);
    const P u = load_pack<T, VEC>(xr + d);
    const P gy = load_pack<T, VEC>(dy + row * dy_stride + c);
    P dg, du;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float f, df;
      activate_and_grad<ACT, sizeof(T) == 4>(to_float(g.v[k]), &f, &df);
      const float grad = to_float(gy.v[k]);
      dg.v[k] = from_float<T>(grad * to_float(u.v[k]) * df);
      du.v[k] = from_float<T>(grad * f);
    }
    T* dxr = dx + row * dx_stride + c;
    store_pack<T, VEC>(dxr, dg);
    store_pack<T, VEC>(dxr + d, du);
  }
}

}  // namespace kiln
