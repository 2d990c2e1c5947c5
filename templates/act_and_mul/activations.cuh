// Gating activations in fp32, accurate to a few ulp (expf, erff/erfcf, tanhf): the f32 variants
// are compared against an fp64 reference.
#pragma once

namespace kiln {

enum ActKind { k_act_silu = 0, k_act_gelu = 1, k_act_gelu_tanh = 2 };

// PRECISE (f32 outputs): a formulation whose relative error stays at a few ulp for every input.
// Otherwise (f16/bf16 outputs, which keep 11 or 8 bits) the cheaper one, whose extra error near
// zero outputs is far below the output's rounding.
template <int ACT, bool PRECISE>
struct Activation;

// x * sigmoid(x). __fdividef (2 ulp) instead of IEEE division, whose slow-path subroutine made
// ptxas spill. Its only divergence, 0 for denominators in (2^126, 2^128), is at x in (-88.7, -87.3)
// where |silu(x)| < 1e-35; an infinite denominator gives -0 as the division would.
template <bool PRECISE>
struct Activation<k_act_silu, PRECISE> {
  static __device__ __forceinline__ float apply(float v) { return __fdividef(v, 1.f + expf(-v)); }
};

// 0.5 x (1 + erf(x / sqrt(2))). For negative x, 1 + erf cancels (erf near -1): 2e-5 relative
// error against the fp64 reference at f32 (seen on an H100), so f32 outputs use the equal
// 0.5 x erfc(-x / sqrt(2)); erfcf costs 15-20% of the bandwidth at bf16 (78.9% against 95.0% of
// the copy at 4096 x 14336), where the cancellation is far below the output's rounding.
template <bool PRECISE>
struct Activation<k_act_gelu, PRECISE> {
  static __device__ __forceinline__ float apply(float v) {
    if constexpr (PRECISE) return 0.5f * v * erfcf(v * -0.70710678118654752f);
    else return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
  }
};

// 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). For negative x, 1 + tanh cancels as
// 1 + erf does above (1.7e-5 relative error at f32 on an H100), so f32 outputs use the equal
// x / (1 + exp(-2u)), which has no cancellation (0 once exp overflows, at x < -10, where
// |result| < 1e-37); f16/bf16 keep the tanh form the bandwidth figures were measured with.
template <bool PRECISE>
struct Activation<k_act_gelu_tanh, PRECISE> {
  static __device__ __forceinline__ float apply(float v) {
    const float inner = 0.79788456080286536f * fmaf(0.044715f * v, v * v, v);
    if constexpr (PRECISE) return __fdividef(v, 1.f + expf(-2.f * inner));
    else return 0.5f * v * (1.f + tanhf(inner));
  }
};

template <int ACT, bool PRECISE>
__device__ __forceinline__ float activate(float v) {
  return Activation<ACT, PRECISE>::apply(v);
}

}  // namespace kiln
