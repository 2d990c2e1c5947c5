// Host-side e4m3 (OCP FP8 E4M3, "e4m3fn": no infinities, 0x7F/0xFF NaN, max 448) conversions and
// the quantization rule kiln's quantize_fp8 kernels follow bit for bit
// (families/gemm/quantize_fp8.cuh has the device twin).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kiln {

constexpr float k_e4m3_max = 448.0f;

inline float e4m3_to_float(std::uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xF, man = v & 7;
  if (exp == 0xF && man == 7) return NAN;
  const float mag = exp == 0 ? std::ldexp(float(man), -9) : std::ldexp(1.0f + float(man) / 8.0f, exp - 7);
  return sign ? -mag : mag;
}

// Round to nearest even, saturating to +-448 (the largest finite e4m3); NaN -> 0x7F (sign kept).
inline std::uint8_t float_to_e4m3(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint8_t sign = std::uint8_t((u >> 24) & 0x80);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7F;
  float af;
  std::memcpy(&af, &a, 4);
  if (af < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (8 steps reach the first normal)
    return sign | std::uint8_t(std::nearbyint(af * 512.0f));
  }
  // Round the fp32 mantissa to 3 bits (ties to even); a carry moves into the exponent.
  const std::uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  const std::uint32_t code = r - (120u << 3);  // rebias 127 -> 7
  return sign | std::uint8_t(code > 0x7Eu ? 0x7Eu : code);
}

// The scale quantize_fp8 stores for a group whose largest magnitude is amax: the value an e4m3
// code is multiplied by to dequantize (amax / 448, at least FLT_MIN so that x / scale is finite).
// The per-tensor amax pass keeps the unclamped amax / 448 (division by 448 is monotonic, so the
// largest rounded quotient is the quotient of the largest magnitude); this clamps it.
inline float fp8_clamp_scale(float s) { return s < 1.17549435e-38f ? 1.17549435e-38f : s; }
inline float fp8_scale_for(float amax) { return fp8_clamp_scale(amax / k_e4m3_max); }

}  // namespace kiln
