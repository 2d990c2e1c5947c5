// f32/f16/bf16 -> e4m3 with scales (common/fp8.h is the host twin; both must agree bit for bit).
//
// For a group of values with largest magnitude amax: scale = max(amax / 448, FLT_MIN) (fp32,
// rounded to nearest), code = e4m3(x / scale) with an IEEE fp32 division, rounded to nearest even
// and saturated to +-448. Groups (MODE): the whole tensor (MODE_AMAX first reduces it into
// scale[0], which the caller zeroed, then MODE_TENSOR quantizes with it), 1 x 128 pieces of a row
// (MODE_ROW: scale [rows, ceil(cols / 128)]), 128 x 128 blocks (MODE_TILE: scale
// [ceil(rows / 128), ceil(cols / 128)], or its transpose when TRANSPOSE).
//
// One CTA of 256 threads per 128 x 128 block of x: warp w holds rows 16 w .. 16 w + 15 of it,
// lane l columns 4 l .. 4 l + 3, all in registers, so amax and quantization read x once.
// TRANSPOSE writes q as [cols, rows] (a [K, N] weight becomes the K-major [N, K] operand the GEMM
// takes) through a shared-memory tile.
#pragma once

#include "common/dtype.cuh"

namespace kiln {
namespace quant {

enum Mode { MODE_AMAX = 0, MODE_TENSOR = 1, MODE_ROW = 2, MODE_TILE = 3 };

__device__ __forceinline__ unsigned char f32_to_e4m3(float f) {
  const unsigned u = __float_as_uint(f);
  const unsigned sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (unsigned char)(sign | 0x7Fu);
  const float af = __uint_as_float(a);
  if (af < 0.015625f) return (unsigned char)(sign | unsigned(__float2int_rn(af * 512.0f)));
  const unsigned code = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  return (unsigned char)(sign | min(code, 0x7Eu));
}

__device__ __forceinline__ float clamp_scale(float s) { return fmaxf(s, 1.17549435e-38f); }
__device__ __forceinline__ float scale_for(float amax) { return clamp_scale(amax / 448.0f); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

template <typename T, int MODE, int TRANSPOSE>
__global__ void __launch_bounds__(256)
quantize_fp8(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scale, long long rows,
             long long cols) {
  __shared__ float red[8];
  __shared__ unsigned char tile[TRANSPOSE ? 128 : 1][132];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long r0 = (long long)blockIdx.y * 128 + warp * 16, c0 = (long long)blockIdx.x * 128 + lane * 4;
  const long long blocks_c = gridDim.x, blocks_r = gridDim.y;
  const bool vec = (cols & 3) == 0;

  float v[16][4];
  float tmax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const long long r = r0 + i;
    if (vec && r < rows && c0 + 3 < cols) {
      const Pack<T, 4> p = load_pack<T, 4>(x + r * cols + c0);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[i][j] = to_float(p.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[i][j] = (r < rows && c0 + j < cols) ? to_float(x[r * cols + c0 + j]) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) tmax = fmaxf(tmax, fabsf(v[i][j]));
  }

  float s[16];
  if (MODE == MODE_ROW) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float m = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) m = fmaxf(m, fabsf(v[i][j]));
      s[i] = scale_for(warp_max(m));
      if (lane == 0 && r0 + i < rows) scale[(r0 + i) * blocks_c + blockIdx.x] = s[i];
    }
  } else if (MODE == MODE_TENSOR) {
    const float t = clamp_scale(scale[0]);  // the amax pass left amax / 448
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = t;
    // Every block reads scale[0] and clamps it the same way, so rewriting it clamped is harmless.
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) scale[0] = t;
  } else {
    tmax = warp_max(tmax);
    if (lane == 0) red[warp] = tmax;
    __syncthreads();
    float b = red[0];
#pragma unroll
    for (int w = 1; w < 8; ++w) b = fmaxf(b, red[w]);
    if (MODE == MODE_AMAX) {
      // Division by 448 is monotonic: the largest rounded quotient is the quotient of the max.
      if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned*>(scale), __float_as_uint(b / 448.0f));
      return;
    }
    const float t = scale_for(b);
    if (threadIdx.x == 0)
      scale[TRANSPOSE ? blockIdx.x * blocks_r + blockIdx.y : blockIdx.y * blocks_c + blockIdx.x] = t;
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = t;
  }

  if (!TRANSPOSE) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const long long r = r0 + i;
      if (r >= rows) break;
      unsigned char c[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j] = f32_to_e4m3(v[i][j] / s[i]);
      if (vec && c0 + 3 < cols) {
        *reinterpret_cast<unsigned*>(q + r * cols + c0) =
            unsigned(c[0]) | (unsigned(c[1]) << 8) | (unsigned(c[2]) << 16) | (unsigned(c[3]) << 24);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (c0 + j < cols) q[r * cols + c0 + j] = c[j];
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) tile[lane * 4 + j][warp * 16 + i] = f32_to_e4m3(v[i][j] / s[i]);
    __syncthreads();
    // Row c of q (a column of x) gets this block's 128 rows of x: lane l writes 4 of them.
    const long long qr0 = (long long)blockIdx.x * 128 + warp * 16, qc0 = (long long)blockIdx.y * 128 + lane * 4;
    const bool qvec = (rows & 3) == 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const long long qr = qr0 + i;
      if (qr >= cols) break;
      const unsigned char* t = &tile[warp * 16 + i][lane * 4];
      if (qvec && qc0 + 3 < rows) {
        *reinterpret_cast<unsigned*>(q + qr * rows + qc0) =
            unsigned(t[0]) | (unsigned(t[1]) << 8) | (unsigned(t[2]) << 16) | (unsigned(t[3]) << 24);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (qc0 + j < rows) q[qr * rows + qc0 + j] = t[j];
      }
    }
  }
}

}  // namespace quant
}  // namespace kiln
