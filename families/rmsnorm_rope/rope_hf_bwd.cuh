// The transpose of the HF-style rotation that rmsnorm_rope_fwd applies per head: with full-width
// cos/sin rows c, s of HEAD_DIM d at the token's position and, for j < d/2, g1 = dout[j] and
// g2 = dout[j + d/2],
//   dn[j] = g1 c[j] + g2 s[j + d/2],   dn[j + d/2] = g2 c[j + d/2] - g1 s[j]
// (fp32 math, one rounding to T). One read of dout and of the tables, one write of dn.
//
// Elementwise, grid-stride over work items: an item is VEC rotation pairs of one head (a pack in
// each half), so both partners of a pair are read and written by one thread and dn may be dout.
// Requires: dout and dn aligned to VEC elements, cos and sin to min(VEC * sizeof(C), 16) bytes;
// hidden a multiple of HEAD_DIM, HEAD_DIM / 2 a multiple of VEC.
#pragma once

#include "common/dtype.cuh"
#include "rope/rope_util.cuh"

namespace kiln {

template <typename T, typename C, int HEAD_DIM, int BLOCK, int VEC>
__global__ void __launch_bounds__(BLOCK)
rope_hf_bwd(const T* dout, const C* __restrict__ cos, const C* __restrict__ sin, T* dn, long long rows, int hidden,
            long long seq) {
  static_assert(HEAD_DIM % (2 * VEC) == 0, "a head must hold a whole number of items");
  constexpr int k_half = HEAD_DIM / 2;
  constexpr int k_chunks = k_half / VEC;
  const long long row_items = hidden / (2 * VEC);
  const long long items = rows * row_items;
  for (long long it = blockIdx.x * (long long)BLOCK + threadIdx.x; it < items; it += (long long)gridDim.x * BLOCK) {
    const long long row = it / row_items;
    const int in_row = int(it - row * row_items);
    const int pair = (in_row % k_chunks) * VEC;
    const long long off = row * hidden + (in_row / k_chunks) * HEAD_DIM + pair;
    const long long table = (row % seq) * HEAD_DIM + pair;
    const Pack<T, VEC> g1 = load_pack<T, VEC>(dout + off), g2 = load_pack<T, VEC>(dout + off + k_half);
    float c_lo[VEC], c_hi[VEC], s_lo[VEC], s_hi[VEC];
    load_floats<C, VEC>(cos + table, c_lo);
    load_floats<C, VEC>(cos + table + k_half, c_hi);
    load_floats<C, VEC>(sin + table, s_lo);
    load_floats<C, VEC>(sin + table + k_half, s_hi);
    Pack<T, VEC> o_lo, o_hi;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float a = to_float(g1.v[j]), b = to_float(g2.v[j]);
      o_lo.v[j] = from_float<T>(fmaf(a, c_lo[j], b * s_hi[j]));
      o_hi.v[j] = from_float<T>(fmaf(b, c_hi[j], -a * s_lo[j]));
    }
    store_pack<T, VEC>(dn + off, o_lo);
    store_pack<T, VEC>(dn + off + k_half, o_hi);
  }
}

}  // namespace kiln
