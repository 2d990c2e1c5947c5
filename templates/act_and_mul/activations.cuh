// Gating activations in fp32, accurate to a few ulp (expf, erff, tanhf): the f32 variants are
// compared against an fp64 reference.
#pragma once

namespace kiln {

enum ActKind { k_act_silu = 0, k_act_gelu = 1, k_act_gelu_tanh = 2 };

template <int ACT>
__device__ __forceinline__ float activate(float v);

// x * sigmoid(x). __fdividef (2 ulp) instead of IEEE division, whose slow-path subroutine made
// ptxas spill. Its only divergence, 0 for denominators in (2^126, 2^128), is at x in (-88.7, -87.3)
// where |silu(x)| < 1e-35; an infinite denominator gives -0 as the division would.
template <>
__device__ __forceinline__ float activate<k_act_silu>(float v) {
  return __fdividef(v, 1.f + expf(-v));
}

// 0.5 x (1 + erf(x / sqrt(2))).
template <>
__device__ __forceinline__ float activate<k_act_gelu>(float v) {
  return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
}

// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <>
__device__ __forceinline__ float activate<k_act_gelu_tanh>(float v) {
  const float inner = 0.79788456080286536f * fmaf(0.044715f * v, v * v, v);
  return 0.5f * v * (1.f + tanhf(inner));
}

}  // namespace kiln
