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

// x Phi(x), Phi(x) = 0.5 (1 + erf(x / sqrt(2))) = 0.5 erfc(-x / sqrt(2)).
// f32 outputs: 0.5 x erfcf(-x / sqrt(2)), a few ulp everywhere (1 + erff cancels for negative x:
// 2e-5 relative error against the fp64 reference, seen on an H100).
// f16/bf16 outputs: from e = erfc(a), a = |x| / sqrt(2), as 2^(a P(a)) with P of degree 6 fitted
// (least squares reweighted toward the largest error) to the relative error of e on [0, 4]:
// at most 6.4e-6 in f32 arithmetic, far below the outputs' rounding (2^-11, 2^-8); then
// Phi = 1 - e/2 for x >= 0 and e/2 for x < 0, so negative x do not cancel either. Past a = 4
// (x < -5.66, Phi < 7.8e-9) Phi is 0. About half the instructions of erff, whose two polynomials
// and branch keep GELU below SiLU's bandwidth at large bf16 shapes on Hopper, where this form
// does not (docs/benchmarks.md has the figures).
template <bool PRECISE>
struct Activation<k_act_gelu, PRECISE> {
  static __device__ __forceinline__ float apply(float v) {
    if constexpr (PRECISE) {
      return 0.5f * v * erfcf(v * -0.70710678118654752f);
    } else {
      const float a = fabsf(v) * 0.70710678118654752f;
      float p = -1.9975821487605572e-05f;
      p = fmaf(p, a, 4.8200355377048254e-04f);
      p = fmaf(p, a, -5.204866174608469e-03f);
      p = fmaf(p, a, 3.3868830651044846e-02f);
      p = fmaf(p, a, -1.523846685886383e-01f);
      p = fmaf(p, a, -9.171034693717957e-01f);
      p = fmaf(p, a, -1.6280598640441895f);
      const float half_e = a < 4.f ? 0.5f * exp2f(a * p) : 0.f;
      return v * (v >= 0.f ? 1.f - half_e : half_e);
    }
  }
};

// 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). For negative x, 1 + tanh cancels as
// 1 + erf does above (1.7e-5 relative error at f32 on an H100), so f32 outputs use the equal
// x / (1 + exp(-2u)), which has no cancellation (0 once exp overflows, at x < -10, where
// |result| < 1e-37); f16/bf16 keep the cheaper tanh form (see PRECISE above).
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
