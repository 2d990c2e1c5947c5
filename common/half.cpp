#include "common/half.h"

#include <cmath>

namespace kiln {

float f16_to_float(std::uint16_t h) {
  std::uint32_t sign = std::uint32_t(h & 0x8000) << 16;
  int exp = (h >> 10) & 0x1f;
  std::uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    float v = std::ldexp(float(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | std::uint32_t(exp - 15 + 127) << 23 | (mant << 13));
}

std::uint16_t float_to_f16(float f) {
  std::uint32_t u = float_to_bits(f);
  std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000);
  std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00;          // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00;         // overflow (>= 65520 rounds to inf)
  if (abs < 0x38800000u) {                              // subnormal or zero in f16
    float a = bits_to_float(abs);
    float scaled = a * 16777216.0f;                     // 2^24: units of the smallest subnormal
    std::uint32_t q = std::uint32_t(std::nearbyint(scaled));  // ties to even in the default mode
    return sign | std::uint16_t(q);
  }
  std::uint32_t mant = abs & 0x7fffff;
  int exp = int(abs >> 23) - 127 + 15;
  std::uint32_t h = std::uint32_t(exp) << 10 | (mant >> 13);
  std::uint32_t rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return sign | std::uint16_t(h);
}

double load_as_double(const void* base, DType t, std::int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f16: return f16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::u8: return static_cast<const std::uint8_t*>(base)[i];
    case DType::i32: return static_cast<const std::int32_t*>(base)[i];
    case DType::i64: return double(static_cast<const std::int64_t*>(base)[i]);
  }
  return 0;
}

void store_from_double(void* base, DType t, std::int64_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(base)[i] = float(v); break;
    case DType::f16: static_cast<std::uint16_t*>(base)[i] = float_to_f16(float(v)); break;
    case DType::bf16: static_cast<std::uint16_t*>(base)[i] = float_to_bf16(float(v)); break;
    case DType::u8: static_cast<std::uint8_t*>(base)[i] = std::uint8_t(v); break;
    case DType::i32: static_cast<std::int32_t*>(base)[i] = std::int32_t(v); break;
    case DType::i64: static_cast<std::int64_t*>(base)[i] = std::int64_t(v); break;
  }
}

}  // namespace kiln
