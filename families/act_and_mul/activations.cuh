// Gating activations in fp32, accurate to a few ulp (expf, erff/erfcf, tanhf): the f32 variants
// are compared against an fp64 reference.
#pragma once

namespace kiln {

enum ActKind { k_act_silu = 0, k_act_gelu = 1, k_act_gelu_tanh = 2 };

// Phi(v), the standard normal CDF, in the forms GELU below uses: erfcf for PRECISE, else the
// fitted 2^(a P(a)) form of erfc, with no cancellation for negative v either way.
template <bool PRECISE>
__device__ __forceinline__ float normal_cdf(float v) {
  if constexpr (PRECISE) {
    return 0.5f * erfcf(v * -0.70710678118654752f);
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
    return v >= 0.f ? 1.f - half_e : half_e;
  }
}

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
    if constexpr (PRECISE) return 0.5f * v * erfcf(v * -0.70710678118654752f);
    else return v * normal_cdf<false>(v);
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

// The activation and its derivative at v, for the backward: act(v) into *f, act'(v) into *df.
// Each is written from pieces that do not cancel for negative v (sigmoids as 1 / (1 + exp(-t)),
// Phi as above); the sums left (Phi + v phi for GELU, whose derivative crosses zero near -0.75)
// lose digits only next to their zero.
//   silu:      s = sigmoid(v);            f = v s;    df = s (1 + v (1 - s))
//   gelu:      Phi, phi = N(0,1) cdf, pdf; f = v Phi;  df = Phi + v phi
//   gelu_tanh: s = sigmoid(2u), u = sqrt(2/pi) (v + 0.044715 v^3)  (so 0.5 (1 + tanh u) = s);
//              f = v s;  df = s + v 2 s (1 - s) u',  u' = sqrt(2/pi) (1 + 3 0.044715 v^2)
template <int ACT, bool PRECISE>
__device__ __forceinline__ void activate_and_grad(float v, float* f, float* df) {
  if constexpr (ACT == k_act_silu) {
    const float s = __fdividef(1.f, 1.f + expf(-v));
    *f = v * s;
    *df = s * fmaf(v, 1.f - s, 1.f);
  } else if constexpr (ACT == k_act_gelu) {
    const float cdf = normal_cdf<PRECISE>(v);
    const float pdf = 0.39894228040143268f * expf(-0.5f * v * v);
    *f = v * cdf;
    *df = fmaf(v, pdf, cdf);
  } else {
    const float inner = 0.79788456080286536f * fmaf(0.044715f * v, v * v, v);
    const float s = __fdividef(1.f, 1.f + expf(-2.f * inner));
    const float du = 0.79788456080286536f * fmaf(3.f * 0.044715f * v, v, 1.f);
    *f = v * s;
    *df = fmaf(v * 2.f * s * (1.f - s), du, s);
  }
}

}  // namespace kiln
