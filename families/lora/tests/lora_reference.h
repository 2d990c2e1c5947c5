// An fp64 LoRA reference written apart from the families' CPU references, shared by the cpu and
// gpu tests: out = x W^T + per row, for its adapter a, scale_a (x A_a,s^T) B_a^T over the first
// rank_a rank columns of the slice s its column falls in, + bias. No rounding of the low-rank
// product (the kernels round t = s x A^T to the operand type; the tests' tolerances cover it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/half.h"

namespace kiln::testing::lora {

struct Case {
  std::int64_t m = 0, n = 0, k = 0, r = 0, adapters = 1, slices = 1;
  std::int64_t end0 = 0, end1 = 0;  // slice ends (slices >= 2)
  bool bias = false;
  std::vector<double> x, w, a, b, bias_v;  // a [adapters, slices r, k], b [adapters, n, r]
  std::vector<std::int32_t> idx;           // empty: every row adapter 0
  std::vector<std::int32_t> ranks;         // empty: r
  std::vector<float> scales;

  std::int64_t slice_of(std::int64_t col) const {
    if (slices == 1) return 0;
    if (col < end0) return 0;
    if (slices == 2 || col < end1) return 1;
    return 2;
  }
  std::vector<double> reference() const {
    std::vector<double> out(std::size_t(m * n));
    for (std::int64_t i = 0; i < m; ++i) {
      const std::int64_t ad = idx.empty() ? 0 : (idx[i] >= 0 && idx[i] < adapters ? idx[i] : -1);
      const std::int64_t rank = ad < 0 ? 0 : ranks.empty() ? r : std::clamp<std::int64_t>(ranks[ad], 0, r);
      std::vector<double> t(std::size_t(slices * r), 0.0);
      for (std::int64_t s = 0; s < slices; ++s)
        for (std::int64_t q = 0; q < rank; ++q) {
          double v = 0;
          for (std::int64_t c = 0; c < k; ++c) v += x[i * k + c] * a[((ad * slices + s) * r + q) * k + c];
          t[s * r + q] = v * scales[ad < 0 ? 0 : ad];
        }
      for (std::int64_t j = 0; j < n; ++j) {
        double v = 0;
        for (std::int64_t c = 0; c < k; ++c) v += x[i * k + c] * w[j * k + c];
        const std::int64_t s = slice_of(j);
        for (std::int64_t q = 0; q < rank; ++q) v += t[s * r + q] * b[(ad * n + j) * r + q];
        if (bias) v += bias_v[j];
        out[i * n + j] = v;
      }
    }
    return out;
  }
};

// Values drawn normal with standard deviation sd and rounded to dtype t: the doubles the test
// compares with, and the bytes the op reads.
inline std::vector<std::uint16_t> draw(std::vector<double>& v, std::size_t count, DType t, double sd,
                                       std::mt19937& rng) {
  std::normal_distribution<double> d(0.0, sd);
  std::vector<std::uint16_t> bits(count + 8);
  v.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    store_from_double(bits.data(), t, std::int64_t(i), d(rng));
    v[i] = load_as_double(bits.data(), t, std::int64_t(i));
  }
  return bits;
}

// Relative L2 error of got (dtype t) against want.
inline double rel_l2(const std::vector<std::uint16_t>& got, const std::vector<double>& want, DType t) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = load_as_double(got.data(), t, std::int64_t(i));
    if (std::isnan(g)) return INFINITY;
    num += (g - want[i]) * (g - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace kiln::testing::lora
