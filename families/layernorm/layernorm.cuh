// LayerNorm forward and backward (families/layernorm/README.md).
//
// Forward, one block per row (grid-stride over rows, at any row stride), fp32 statistics:
//   mean = sum(x) / cols, rstd = rsqrt(sum((x - mean)^2) / cols + eps)   (two passes: exact where a
//   one-pass sum of squares cancels for rows with a large mean),
//   y = (x - mean) * rstd * weight + bias.
// The row is held in registers between the passes (PACKS packs of VEC elements per thread), so x
// is read from memory once. mean and rstd (f32, one per row) are written when non-null, bias is
// read when non-null.
//
// Backward, one block per slab of consecutive rows (at any row strides), with
// xhat = (x - mean) * rstd, g = dy * weight:
//   dx = rstd * (g - (sum(g) + xhat * sum(g * xhat)) / cols)
//   partial[slab, c] = sum over the slab's rows of dy * xhat,  partial[slabs + slab, c] = of dy
// Each thread keeps its columns' two partial sums in registers over the slab and writes them once;
// a second kernel (rmsnorm_bwd_reduce) sums the slabs into dweight and dbias in a fixed order, so
// the result is deterministic.
//
// Requires: the last dimension contiguous, cols a multiple of VEC and at most PACKS * BLOCK * VEC,
// every buffer and row stride aligned to VEC elements.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"

namespace kiln::layernorm {

// Two sums over a block of BLOCK threads (a multiple of 32) with one pair of barriers, returned
// to every thread; scratch: 33 float2 of shared memory, safe to reuse without an extra barrier
// as kiln::block_sum's.
template <int BLOCK>
__device__ __forceinline__ float2 block_sum2(float a, float b, float2* scratch) {
  constexpr int k_warps = BLOCK / 32;
  a = kiln::warp_sum(a);
  b = kiln::warp_sum(b);
  if constexpr (k_warps == 1) {
    return make_float2(a, b);
  } else {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) scratch[warp] = make_float2(a, b);
    __syncthreads();
    if (warp == 0) {
      float2 t = lane < k_warps ? scratch[lane] : make_float2(0.f, 0.f);
      t.x = kiln::warp_sum(t.x);
      t.y = kiln::warp_sum(t.y);
      if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    return scratch[32];
  }
}

template <typename T, int BLOCK, int VEC, int PACKS>
__global__ void __launch_bounds__(BLOCK)
layernorm_fwd(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ y,
              float* __restrict__ mean_out, float* __restrict__ rstd_out, long long rows, long long cols,
              long long x_stride, long long y_stride, float eps) {
  using P = kiln::Pack<T, VEC>;
  __shared__ float scratch[33];
  const long long packs = cols / VEC;
  const float inv_cols = 1.f / float(cols);
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * x_stride;
    float v[PACKS][VEC];
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const long long p = threadIdx.x + (long long)k * BLOCK;
      if (p < packs) {
        const P in = kiln::load_pack<T, VEC>(xr + p * VEC);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          v[k][i] = kiln::to_float(in.v[i]);
          sum += v[k][i];
        }
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[k][i] = 0.f;
      }
    }
    const float mean = kiln::block_sum<BLOCK>(sum, scratch) * inv_cols;
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < PACKS; ++k)
      if (threadIdx.x + (long long)k * BLOCK < packs) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = v[k][i] - mean;
          sq += d * d;
        }
      }
    const float rstd = rsqrtf(kiln::block_sum<BLOCK>(sq, scratch) * inv_cols + eps);
    if (threadIdx.x == 0) {
      if (mean_out) mean_out[row] = mean;
      if (rstd_out) rstd_out[row] = rstd;
    }
    T* yr = y + row * y_stride;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const long long p = threadIdx.x + (long long)k * BLOCK;
      if (p < packs) {
        const P g = kiln::load_pack<T, VEC>(weight + p * VEC);
        float add[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) add[i] = 0.f;
        if (bias) {
          const P b = kiln::load_pack<T, VEC>(bias + p * VEC);
#pragma unroll
          for (int i = 0; i < VEC; ++i) add[i] = kiln::to_float(b.v[i]);
        }
        P out;
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          out.v[i] = kiln::from_float<T>((v[k][i] - mean) * rstd * kiln::to_float(g.v[i]) + add[i]);
        kiln::store_pack<T, VEC>(yr + p * VEC, out);
      }
    }
  }
}

template <typename T, int BLOCK, int VEC, int PACKS>
__global__ void __launch_bounds__(BLOCK)
layernorm_bwd(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ weight,
              const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
              float* __restrict__ partial, long long rows, long long cols, long long dy_stride, long long x_stride,
              long long dx_stride, long long rows_per_slab) {
  using P = kiln::Pack<T, VEC>;
  __shared__ float2 scratch[33];
  const int packs = int(cols / VEC);  // cols < 2^31: the op checks
  const float inv_cols = 1.f / float(cols);
  const long long r0 = (long long)blockIdx.x * rows_per_slab;
  const long long r1 = r0 + rows_per_slab < rows ? r0 + rows_per_slab : rows;
  float acc_w[PACKS][VEC], acc_b[PACKS][VEC], w[PACKS][VEC];
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = threadIdx.x + k * BLOCK;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc_w[k][i] = acc_b[k][i] = w[k][i] = 0.f;
    if (p < packs) {
      const P wp = kiln::load_pack<T, VEC>(weight + p * VEC);
#pragma unroll
      for (int i = 0; i < VEC; ++i) w[k][i] = kiln::to_float(wp.v[i]);
    }
  }
  const T* xr = x + r0 * x_stride;
  const T* dyr = dy + r0 * dy_stride;
  T* dxr = dx + r0 * dx_stride;
  for (long long row = r0; row < r1; ++row, xr += x_stride, dyr += dy_stride, dxr += dx_stride) {
    const float m = mean[row], s = rstd[row];
    float xh[PACKS][VEC], g[PACKS][VEC];
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const int p = threadIdx.x + k * BLOCK;
#pragma unroll
      for (int i = 0; i < VEC; ++i) xh[k][i] = g[k][i] = 0.f;
      if (p < packs) {
        const P xp = kiln::load_pack<T, VEC>(xr + p * VEC);
        const P dp = kiln::load_pack<T, VEC>(dyr + p * VEC);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = kiln::to_float(dp.v[i]);
          xh[k][i] = (kiln::to_float(xp.v[i]) - m) * s;
          g[k][i] = d * w[k][i];
          sum_g += g[k][i];
          sum_gx += g[k][i] * xh[k][i];
          acc_w[k][i] += d * xh[k][i];
          acc_b[k][i] += d;
        }
      }
    }
    const float2 sums = block_sum2<BLOCK>(sum_g, sum_gx, scratch);
    const float mg = sums.x * inv_cols, mgx = sums.y * inv_cols;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const int p = threadIdx.x + k * BLOCK;
      if (p < packs) {
        P out;
#pragma unroll
        for (int i = 0; i < VEC; ++i) out.v[i] = kiln::from_float<T>(s * (g[k][i] - mg - xh[k][i] * mgx));
        kiln::store_pack<T, VEC>(dxr + p * VEC, out);
      }
    }
  }
  float* const pw = partial + (long long)blockIdx.x * cols;
  float* const pb = partial + ((long long)gridDim.x + blockIdx.x) * cols;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = threadIdx.x + k * BLOCK;
    if (p < packs) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) pw[p * VEC + i] = acc_w[k][i];
#pragma unroll
      for (int i = 0; i < VEC; ++i) pb[p * VEC + i] = acc_b[k][i];
    }
  }
}

}  // namespace kiln::layernorm
