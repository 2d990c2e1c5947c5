// Host-side conversions for f16 and bf16 bit patterns (round to nearest even), for CPU references
// and fallbacks. Part of the family SDK: a plugin's cpu_reference reads and writes its buffers
// with load_as_double and store_from_double.
#pragma once

#include <cstdint>
#include <cstring>

#include "kiln/types.h"

namespace kiln {

inline float bits_to_float(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline std::uint32_t float_to_bits(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_float(std::uint16_t b) { return bits_to_float(std::uint32_t(b) << 16); }
inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return std::uint16_t(u >> 16);
}

float f16_to_float(std::uint16_t h);
std::uint16_t float_to_f16(float f);

// Element i of a buffer of dtype t (f32, f16, bf16) as double, and the reverse.
double load_as_double(const void* base, DType t, std::int64_t i);
void store_from_double(void* base, DType t, std::int64_t i, double v);

}  // namespace kiln
