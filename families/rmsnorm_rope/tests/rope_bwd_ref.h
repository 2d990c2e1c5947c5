// An fp64 model of rms_norm_rope and of its backward, for the tests: the forward per head as the
// op defines it, and the backward from the chain rule (the rotation's transpose, then RMSNorm's).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace kiln::testing {

struct RopeShape {
  std::int64_t rows, seq, heads, d;
  double eps;
  std::int64_t hidden() const { return heads * d; }
};

// out = rope(rms_norm(x) * w), every tensor row-major as the op takes it.
inline std::vector<double> rms_norm_rope_fwd(const RopeShape& s, const std::vector<double>& x,
                                             const std::vector<double>& w, const std::vector<double>& cos,
                                             const std::vector<double>& sin) {
  const std::int64_t hidden = s.hidden(), half = s.d / 2;
  std::vector<double> out(x.size());
  for (std::int64_t r = 0; r < s.rows; ++r) {
    const double* xr = &x[std::size_t(r * hidden)];
    double ss = 0;
    for (std::int64_t c = 0; c < hidden; ++c) ss += xr[c] * xr[c];
    const double scale = 1 / std::sqrt(ss / double(hidden) + s.eps);
    const std::int64_t t = (r % s.seq) * s.d;
    for (std::int64_t h0 = 0; h0 < hidden; h0 += s.d)
      for (std::int64_t j = 0; j < half; ++j) {
        const double lo = xr[h0 + j] * scale * w[std::size_t(h0 + j)];
        const double hi = xr[h0 + j + half] * scale * w[std::size_t(h0 + j + half)];
        out[std::size_t(r * hidden + h0 + j)] = lo * cos[std::size_t(t + j)] - hi * sin[std::size_t(t + j)];
        out[std::size_t(r * hidden + h0 + j + half)] =
            hi * cos[std::size_t(t + j + half)] + lo * sin[std::size_t(t + j + half)];
      }
  }
  return out;
}

// (dx, dw) of rms_norm_rope_fwd for the upstream gradient dout.
inline void rms_norm_rope_bwd(const RopeShape& s, const std::vector<double>& dout, const std::vector<double>& x,
                              const std::vector<double>& w, const std::vector<double>& cos,
                              const std::vector<double>& sin, std::vector<double>& dx, std::vector<double>& dw) {
  const std::int64_t hidden = s.hidden(), half = s.d / 2;
  dx.assign(x.size(), 0.0);
  dw.assign(std::size_t(hidden), 0.0);
  std::vector<double> dn(static_cast<std::size_t>(hidden));
  for (std::int64_t r = 0; r < s.rows; ++r) {
    const double* xr = &x[std::size_t(r * hidden)];
    const double* g = &dout[std::size_t(r * hidden)];
    const std::int64_t t = (r % s.seq) * s.d;
    for (std::int64_t h0 = 0; h0 < hidden; h0 += s.d)
      for (std::int64_t j = 0; j < half; ++j) {
        const double g1 = g[h0 + j], g2 = g[h0 + j + half];
        dn[std::size_t(h0 + j)] = g1 * cos[std::size_t(t + j)] + g2 * sin[std::size_t(t + j + half)];
        dn[std::size_t(h0 + j + half)] = g2 * cos[std::size_t(t + j + half)] - g1 * sin[std::size_t(t + j)];
      }
    double ss = 0, dot = 0;
    for (std::int64_t c = 0; c < hidden; ++c) ss += xr[c] * xr[c];
    const double scale = 1 / std::sqrt(ss / double(hidden) + s.eps);
    for (std::int64_t c = 0; c < hidden; ++c) dot += dn[std::size_t(c)] * w[std::size_t(c)] * xr[c];
    for (std::int64_t c = 0; c < hidden; ++c) {
      dx[std::size_t(r * hidden + c)] =
          scale * dn[std::size_t(c)] * w[std::size_t(c)] - xr[c] * scale * scale * scale * dot / double(hidden);
      dw[std::size_t(c)] += dn[std::size_t(c)] * xr[c] * scale;
    }
  }
}

}  // namespace kiln::testing
