// Activation-and-mul family (SwiGLU / GeGLU gating): out[r, c] = act(x[r, c]) * x[r, d + c] for
// c < d, computed in fp32, act in {silu, gelu (erf), gelu_tanh}.
//
// Params: act {silu, gelu, gelu_tanh}, dtype {f32, f16, bf16}, block {64 .. 1024} threads,
// vec {1, 2, 4, 8} elements per access (vec * sizeof(dtype) <= 16 bytes).
// Problem (ActAndMulProblem): keys rows (bucketed), d, x_row_stride, out_row_stride (strides in
// elements), activation (ActAndMulKind: 0 silu, 1 gelu, 2 gelu_tanh; a key so that the problem
// alone picks the variant); no value fields.
// Buffers: x (input, rows of 2d), out (output, rows of d). out may alias x (out = x[..., :d]:
// same base, same row stride).
//
// Heuristic: a flat grid, one pack per thread, 128-thread blocks. vec is the widest access up to
// 8 bytes that the common alignment of x, out, both row strides and the offset d of the second
// half allow. In the bench's `variants` section on Hopper, 8-byte accesses with 128 threads are at
// or near the best variant for SiLU and GELU at large shapes, while 16-byte ones are slower with
// GELU (erf) computed with erff; with the fitted form in families/act_and_mul/activations.cuh,
// 16- and 8-byte accesses tie. docs/benchmarks.md has the figures.
#pragma once

#include <cstdint>

#include "kiln/family.h"

namespace kiln::families {

// The act_and_mul problem; every field is a key (part of the tuning signature).
struct ActAndMulProblem {
  std::int64_t rows = 0;            // key, bucketed: rows of x and out
  std::int64_t d = 0;               // key: elements per row of out (x rows hold 2d)
  std::int64_t x_row_stride = 0;    // key: elements between two rows of x
  std::int64_t out_row_stride = 0;  // key: elements between two rows of out
  std::int64_t activation = 0;      // key: ActAndMulKind
};
enum ActAndMulKind { k_am_silu = 0, k_am_gelu = 1, k_am_gelu_tanh = 2 };

// The backward's problem (family act_and_mul_bwd): dx = d(act(g) * u)/d[g | u] times dy, from x
// (rows of 2d) and dy (rows of d) into dx (rows of 2d). Every field is a key.
struct ActAndMulBwdProblem {
  std::int64_t rows = 0;           // key, bucketed: rows of x, dy and dx
  std::int64_t d = 0;              // key: elements per row of dy; x and dx rows hold 2d
  std::int64_t x_row_stride = 0;   // key: elements between two rows of x
  std::int64_t dy_row_stride = 0;  // key: elements between two rows of dy
  std::int64_t dx_row_stride = 0;  // key: elements between two rows of dx
  std::int64_t activation = 0;     // key: ActAndMulKind
};

struct ActAndMulChoice {
  int block;
  int vec;
};
ActAndMulChoice act_and_mul_heuristic(const Problem& p);

// The activation and its derivative in double (the CPU references, and tests).
double act_and_mul_activate(int activation, double v);
double act_and_mul_derivative(int activation, double v);

// Division by a constant d in [1, 2^31) as (umulhi(n, magic) + n) >> shift, exact for every
// n < 2^31 (Granlund-Montgomery, the round-up variant). The kernel divides its flat pack index by
// the packs per row this way.
struct FastDiv {
  std::uint32_t magic;
  std::uint32_t shift;
};
FastDiv fast_div(std::uint32_t d);
inline std::uint32_t fast_div_apply(FastDiv f, std::uint32_t n) {
  const std::uint32_t hi = std::uint32_t((std::uint64_t(n) * f.magic) >> 32);
  return (hi + n) >> f.shift;
}

}  // namespace kiln::families
