// The tensor-core families on the CPU: the e4m3 rounding rule (every code, ties, saturation,
// subnormals, nearest-code property on random values), quantize_fp8's reference (round trip,
// scale grids, transpose), the GEMM references against hand-computed values, the heuristic and
// tuning space on the benchmark shapes for sm_80 and sm_90a devices, argument packing, and the
// typed ops' CPU fallbacks and error paths (which must resolve nothing). NVRTC compiles of every
// catalog variant for sm_80 and sm_90a run in tests/jit (CatalogCompiles).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "common/fp8.h"
#include "common/half.h"
#include "families/gemm/fp8_gemm.h"
#include "families/gemm/gated_mlp.h"
#include "families/common/gemm/gemm_util.h"
#include "families/gemm/quantize_fp8.h"
#include "kiln/ops.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

namespace g = families::gemm;

const Family& fam(const char* name) { return *Registry::global().find(name); }

TEST(E4m3, EveryCodeRoundTripsAndDecodesToItsValue) {
  for (int c = 0; c < 256; ++c) {
    const auto code = std::uint8_t(c);
    const float v = e4m3_to_float(code);
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v));
      continue;
    }
    EXPECT_EQ(float_to_e4m3(v), code) << c;
  }
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0xC0), -2.0f);
}

TEST(E4m3, TiesGoToEvenAndLargeValuesSaturate) {
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);                 // between 1.0 (0x38) and 1.125 (0x39)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);                 // between 1.125 and 1.25 (0x3A)
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);   // half the smallest subnormal
  EXPECT_EQ(float_to_e4m3(std::ldexp(3.0f, -10)), 0x02);   // between codes 1 and 2
  EXPECT_EQ(float_to_e4m3(std::ldexp(15.0f, -10)), 0x08);  // the last subnormal step reaches 2^-6
  EXPECT_EQ(float_to_e4m3(449.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(470.0f), 0x7E);  // would round to 480 (the NaN code): saturates
  EXPECT_EQ(float_to_e4m3(-1e30f), 0xFE);
  EXPECT_EQ(float_to_e4m3(INFINITY), 0x7E);
  EXPECT_EQ(float_to_e4m3(NAN), 0x7F);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
}

TEST(E4m3, RandomValuesGetTheNearestCode) {
  std::mt19937 rng(testing::fresh_seed());
  std::uniform_real_distribution<float> mag(-12.0f, 9.5f);
  std::vector<float> codes;
  for (int c = 0; c < 0x7F; ++c) codes.push_back(e4m3_to_float(std::uint8_t(c)));
  for (int i = 0; i < 200000; ++i) {
    const float x = std::exp2(mag(rng));
    const float got = e4m3_to_float(float_to_e4m3(x));
    const float clamped = std::min(x, 448.0f);
    float best = INFINITY;
    for (float c : codes) best = std::min(best, std::fabs(c - clamped));
    ASSERT_EQ(std::fabs(got - clamped), best) << x;
    ASSERT_EQ(float_to_e4m3(-x), float_to_e4m3(x) | 0x80) << x;
  }
}

// quantize_fp8's reference through the typed op on host tensors.
struct Quantized {
  std::vector<std::uint8_t> q;
  std::vector<float> scale;
};
Quantized quantize_host(std::vector<float>& x, std::int64_t rows, std::int64_t cols, Fp8Granularity gran, bool tr,
                        std::int64_t srows, std::int64_t scols) {
  Quantized r{std::vector<std::uint8_t>(std::size_t(rows * cols), 0xAA), std::vector<float>(std::size_t(srows * scols), NAN)};
  auto xv = TensorView::contiguous(x.data(), DType::f32, {rows, cols}, Device::cpu());
  auto qv = TensorView::contiguous(r.q.data(), DType::u8, {tr ? cols : rows, tr ? rows : cols}, Device::cpu());
  auto sv = gran == Fp8Granularity::tensor ? TensorView::contiguous(r.scale.data(), DType::f32, {1}, Device::cpu())
                                           : TensorView::contiguous(r.scale.data(), DType::f32, {srows, scols}, Device::cpu());
  Status s = quantize_fp8(xv, qv, sv, gran, tr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return r;
}

TEST(QuantizeFp8, RoundTripStaysWithinE4m3PrecisionForEveryGranularity) {
  std::mt19937 rng(testing::fresh_seed());
  const std::int64_t rows = 150, cols = 300;
  std::vector<float> x(rows * cols);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = n(rng) * (i % 7 == 0 ? 20.0f : 1.0f);
  struct G {
    Fp8Granularity gran;
    std::int64_t srows, scols;
  };
  for (const G& gr : {G{Fp8Granularity::tensor, 1, 1}, G{Fp8Granularity::row_1x128, rows, 3},
                      G{Fp8Granularity::tile_128, 2, 3}}) {
    const Quantized qz = quantize_host(x, rows, cols, gr.gran, false, gr.srows, gr.scols);
    double num = 0, den = 0;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) {
        const float s = gr.gran == Fp8Granularity::tensor      ? qz.scale[0]
                        : gr.gran == Fp8Granularity::row_1x128 ? qz.scale[r * 3 + c / 128]
                                                               : qz.scale[(r / 128) * 3 + c / 128];
        const double v = double(e4m3_to_float(qz.q[r * cols + c])) * s, want = x[r * cols + c];
        // Half a step of 3 mantissa bits, or of the subnormal grid (2^-10 scale) near zero.
        ASSERT_LE(std::fabs(v - want), std::max(std::fabs(want) / 16, std::ldexp(double(s), -10)) * 1.0001)
            << int(gr.gran) << " at " << r << ", " << c;
        num += (v - want) * (v - want);
        den += want * want;
      }
    EXPECT_LT(std::sqrt(num / den), 0.04);
    // Each group's largest magnitude maps to 448 (code 0x7E) exactly.
    float amax = 0;
    for (std::int64_t c = 0; c < 128; ++c) amax = std::max(amax, std::fabs(x[c]));
    if (gr.gran == Fp8Granularity::row_1x128) {
      EXPECT_EQ(qz.scale[0], fp8_scale_for(amax));
    }
  }
}

TEST(QuantizeFp8, TransposedOutputIsTheTransposeAndAllZeroInputIsFinite) {
  std::mt19937 rng(testing::fresh_seed());
  const std::int64_t rows = 260, cols = 140;
  std::vector<float> x(rows * cols);
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (auto& v : x) v = n(rng);
  for (auto gran : {Fp8Granularity::tensor, Fp8Granularity::tile_128}) {
    const bool tile = gran == Fp8Granularity::tile_128;
    const Quantized a = quantize_host(x, rows, cols, gran, false, tile ? 3 : 1, tile ? 2 : 1);
    const Quantized b = quantize_host(x, rows, cols, gran, true, tile ? 2 : 1, tile ? 3 : 1);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) ASSERT_EQ(a.q[r * cols + c], b.q[c * rows + r]);
    for (int i = 0; tile && i < 3; ++i)
      for (int j = 0; j < 2; ++j) EXPECT_EQ(a.scale[i * 2 + j], b.scale[j * 3 + i]);
  }
  std::vector<float> zeros(64 * 64, 0.0f);
  const Quantized z = quantize_host(zeros, 64, 64, Fp8Granularity::tensor, false, 1, 1);
  EXPECT_GT(z.scale[0], 0.0f);
  EXPECT_TRUE(std::all_of(z.q.begin(), z.q.end(), [](std::uint8_t v) { return v == 0; }));
}

// A GEMM problem on a device of `sms` SMs and compute capability `cc` (default: an H100).
Problem gemm_problem(DType t, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t mode, int sms = 132,
                     int cc = 90) {
  Problem p = Problem::of(t, 16, g::GemmProblem{.m = m, .n = n, .k = k, .mode = mode});
  p.sm_count = std::uint16_t(sms);
  p.cc = std::uint8_t(cc);
  return p;
}

TEST(Fp8Gemm, ReferenceMatchesHandComputedValues) {
  // a = [[1, 2, ...]], b rows = [[0.5, ...], [-1, ...]] over K = 16 (the rest zeros).
  const std::int64_t m = 1, n = 2, k = 16;
  std::vector<std::uint8_t> a(m * k, 0), b(n * k, 0);
  a[0] = float_to_e4m3(1.0f);
  a[1] = float_to_e4m3(2.0f);
  b[0] = float_to_e4m3(0.5f);
  b[1] = float_to_e4m3(0.25f);
  b[k] = float_to_e4m3(-1.0f);
  b[k + 1] = float_to_e4m3(8.0f);
  float sa = 0.5f, sb = 4.0f;
  std::vector<std::uint16_t> out(2, 0xFFFF);
  const Problem p = gemm_problem(DType::bf16, m, n, k, families::k_fp8_per_tensor);
  void* bufs[5] = {a.data(), b.data(), &sa, &sb, out.data()};
  ASSERT_TRUE(fam("fp8_gemm").cpu_reference(fam("fp8_gemm").heuristic(p), p, bufs).ok());
  EXPECT_EQ(bf16_to_float(out[0]), (1 * 0.5f + 2 * 0.25f) * 2.0f);
  EXPECT_EQ(bf16_to_float(out[1]), (-1 + 2 * 8.0f) * 2.0f);
}

TEST(Fp8Gemm, BlockScalesApplyPerKBlockAndRowAndColumnBlock) {
  // K = 256 (two k-blocks), N = 130 (two column blocks): out[i, j] = sum over kb of
  // dot_kb * sa[i, kb] * sb[j / 128, kb], with every operand 1 so dot_kb = 128.
  const std::int64_t m = 2, n = 130, k = 256;
  std::vector<std::uint8_t> a(m * k, 0x38), b(n * k, 0x38);
  std::vector<float> sa = {1, 2, 3, 4}, sb = {0.5f, 0.25f, 1, 8};
  std::vector<std::uint16_t> out(m * n);
  const Problem p = gemm_problem(DType::f16, m, n, k, families::k_fp8_blockwise);
  void* bufs[5] = {a.data(), b.data(), sa.data(), sb.data(), out.data()};
  ASSERT_TRUE(fam("fp8_gemm").cpu_reference(fam("fp8_gemm").heuristic(p), p, bufs).ok());
  EXPECT_EQ(f16_to_float(out[0]), 128 * (1 * 0.5f + 2 * 0.25f));
  EXPECT_EQ(f16_to_float(out[129]), 128 * (1 * 1.0f + 2 * 8.0f));
  EXPECT_EQ(f16_to_float(out[n + 5]), 128 * (3 * 0.5f + 4 * 0.25f));
}

TEST(GatedMlp, ReferenceMatchesHandComputedValues) {
  // x = [1, 2, 0...], wg row = [1, 1, 0...] -> gate 3; wu row = [0.5, 0, ...] -> up 0.5.
  const std::int64_t k = 8;
  std::vector<std::uint16_t> x(k, 0), wg(k, 0), wu(k, 0), out(1, 0xFFFF);
  x[0] = float_to_bf16(1);
  x[1] = float_to_bf16(2);
  wg[0] = wg[1] = float_to_bf16(1);
  wu[0] = float_to_bf16(0.5f);
  for (int act : {families::k_gated_silu, families::k_gated_gelu}) {
    const Problem p = gemm_problem(DType::bf16, 1, 1, k, act);
    void* bufs[4] = {x.data(), wg.data(), wu.data(), out.data()};
    ASSERT_TRUE(fam("gated_mlp").cpu_reference(fam("gated_mlp").heuristic(p), p, bufs).ok());
    const double gate = 3, want = act == families::k_gated_silu ? gate / (1 + std::exp(-gate)) * 0.5
                                                                : 0.5 * gate * (1 + std::erf(gate / std::sqrt(2.0))) * 0.5;
    EXPECT_NEAR(bf16_to_float(out[0]), want, 4e-3) << act;
  }
}

// The heuristic on the benchmark shapes and odd ones, for an H100 (sm_90a) and an A100: a valid
// catalog variant that accepts the problem, inside a tuning space whose every member does too.
TEST(GemmFamilies, HeuristicIsInTheCatalogAndTheTuningSpaceIsValid) {
  for (const char* name : {"fp8_gemm", "gated_mlp"}) {
    const Family& f = fam(name);
    const auto catalog = f.catalog();
    std::vector<Problem> problems = f.benchmark_problems(DType::bf16);
    for (std::int64_t mode : {0, 1})
      for (auto [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1, 77, 144}, {333, 4099, 528}, {16384, 128, 64}})
        problems.push_back(gemm_problem(DType::f16, m, n, k, mode));
    for (Problem p : problems)
      for (auto [sms, cc] : {std::pair<int, int>{132, 90}, {108, 80}, {84, 89}}) {
        p.sm_count = std::uint16_t(sms);
        p.cc = std::uint8_t(cc);
        const Params h = f.heuristic(p);
        SCOPED_TRACE(std::string(name) + " " + h.canonical() + " cc " + std::to_string(cc) + " m " +
                     std::to_string(p.as<g::GemmProblem>().m) + " n " + std::to_string(p.as<g::GemmProblem>().n));
        EXPECT_TRUE(f.validate(h).ok());
        EXPECT_TRUE(f.check_problem(h, p).ok()) << f.check_problem(h, p).to_string();
        EXPECT_EQ(*h.get_str("path"), cc == 90 ? "wgmma" : "mma");
        EXPECT_NE(std::find(catalog.begin(), catalog.end(), h), catalog.end()) << "heuristic not prewarmed";
        const auto space = f.tuning_space(p);
        EXPECT_GE(space.size(), 4u);
        EXPECT_NE(std::find(space.begin(), space.end(), h), space.end());
        for (const Params& c : space) EXPECT_TRUE(f.check_problem(c, p).ok()) << c.canonical();
        const LaunchGeometry geo = f.geometry(h, p);
        if (cc == 90) {
          EXPECT_LE(std::int64_t(geo.grid.x), sms);
        }
        EXPECT_LE(geo.shared_bytes, g::max_shared_bytes(cc));
      }
  }
}

TEST(GemmFamilies, CheckProblemRejectsWhatTheKernelsCannotRun) {
  const Family& f = fam("fp8_gemm");
  const Params wg = f.heuristic(gemm_problem(DType::bf16, 4096, 4096, 4096, 0));
  EXPECT_TRUE(f.check_problem(wg, gemm_problem(DType::bf16, 5, 7, 32, 0)).ok());
  EXPECT_EQ(f.check_problem(wg, gemm_problem(DType::bf16, 5, 7, 40, 0)).code(), Code::shape_mismatch);  // K % 16
  EXPECT_EQ(f.check_problem(wg, gemm_problem(DType::f16, 5, 7, 32, 0)).code(), Code::unsupported_dtype);
  EXPECT_EQ(f.check_problem(wg, gemm_problem(DType::bf16, 5, 7, 32, 1)).code(), Code::invalid_argument);  // scaling
  EXPECT_EQ(f.check_problem(wg, gemm_problem(DType::bf16, 5, 7, 32, 0, 108, 80)).code(), Code::invalid_argument);
  EXPECT_EQ(f.check_problem(wg, gemm_problem(DType::bf16, 0, 7, 32, 0)).code(), Code::shape_mismatch);
  Problem misaligned = gemm_problem(DType::bf16, 5, 7, 32, 0);
  misaligned.alignment = 8;
  EXPECT_EQ(f.check_problem(wg, misaligned).code(), Code::invalid_argument);
  // Too much shared memory for an sm_89 device.
  Params deep = f.heuristic(gemm_problem(DType::bf16, 4096, 4096, 4096, 0, 108, 80));
  deep.set("stages", std::int64_t(4));
  EXPECT_TRUE(f.check_problem(deep, gemm_problem(DType::bf16, 64, 64, 64, 0, 108, 80)).ok());
  EXPECT_EQ(f.check_problem(deep, gemm_problem(DType::bf16, 64, 64, 64, 0, 84, 89)).code(), Code::invalid_argument);
  // Tiles the accumulators cannot hold.
  Params wide = wg;
  wide.set("bn", std::int64_t(256));
  EXPECT_TRUE(f.validate(wide).ok());
  wide.set("scaling", "block");
  // Block scales take bn 256 as two 128-column halves (one partial-sum set of 64 registers), bn
  // 176 not (a tile over three scale blocks).
  EXPECT_TRUE(f.validate(wide).ok());
  wide.set("bn", std::int64_t(176));
  EXPECT_EQ(f.validate(wide).code(), Code::invalid_argument);
  // Block scales take bn 192 (a tile over two scale blocks) on the wgmma path only.
  wide.set("bn", std::int64_t(192));
  EXPECT_TRUE(f.validate(wide).ok());
  wide.set("path", "mma");
  EXPECT_EQ(f.validate(wide).code(), Code::invalid_argument);
  wide.set("path", "wgmma").set("bn", std::int64_t(256));
  wide.set("scaling", "tensor").set("path", "mma");
  EXPECT_EQ(f.validate(wide).code(), Code::invalid_argument);
}

// Clusters of 2 (A shared by TMA multicast): cluster grids are whole clusters over the padded
// column tiles, a's tensor map box is the CTA's share of the tile, and the mma path takes none.
TEST(GemmFamilies, ClusterGridsAndTensorMaps) {
  const Family& f = fam("fp8_gemm");
  for (std::int64_t mode : {0, 1})
    for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{7168, 16384}, {4096, 7168}}) {
      const Problem p = gemm_problem(DType::bf16, 128, n, k, mode);
      Params h = f.heuristic(p);
      h.set("cluster", std::int64_t(2)).set("split", std::int64_t(1));
      SCOPED_TRACE(h.canonical());
      ASSERT_TRUE(f.validate(h).ok());
      ASSERT_TRUE(f.check_problem(h, p).ok());
      const LaunchGeometry geo = f.geometry(h, p);
      EXPECT_EQ(geo.grid.x % 2, 0u);
      EXPECT_LE(geo.grid.x, 132u);
      int a, b, sa, sb, out;
      void* bufs[5] = {&a, &b, &sa, &sb, &out};
      ArgPack args;
      f.pack_args(h, p, bufs, args);
      ASSERT_EQ(args.tensor_maps(), 4u);
      EXPECT_EQ(args.tensor_map_request(0).box_rows, std::uint32_t(*h.get_int("bm") / 2));
      EXPECT_EQ(args.tensor_map_request(1).box_rows, std::uint32_t(*h.get_int("bn")));
      EXPECT_EQ(args.tensor_map_request(3).base, &out);
    }
  // 13 column tiles in clusters of 2: 7 units; 3 SMs hold one cluster.
  Params c = f.heuristic(gemm_problem(DType::bf16, 128, 7168, 16384, 0));
  c.set("bn", std::int64_t(64)).set("cluster", std::int64_t(2)).set("split", std::int64_t(1)).set("stages", std::int64_t(4));
  EXPECT_EQ(f.geometry(c, gemm_problem(DType::bf16, 64, 13 * 64, 256, 0)).grid.x, 14u);
  EXPECT_EQ(f.geometry(c, gemm_problem(DType::bf16, 64, 13 * 64, 256, 0, 3)).grid.x, 2u);
  c.set("path", "mma");
  EXPECT_EQ(f.validate(c).code(), Code::invalid_argument);
  c.set("cluster", std::int64_t(3));
  EXPECT_EQ(f.validate(c).code(), Code::invalid_argument);
}

// The tile widths that fill the SMs at LLM shapes (56: 7168 = 128 x 56; 176: 2112 = 12 x 176)
// are per-tensor fp8 on the wgmma path only, and the wave model takes them there.
TEST(GemmFamilies, WaveFillingTileWidths) {
  const Family& f = fam("fp8_gemm");
  EXPECT_EQ(*f.heuristic(gemm_problem(DType::bf16, 4096, 2112, 7168, 0)).get_int("bn"), 176);
  EXPECT_EQ(*f.heuristic(gemm_problem(DType::bf16, 8192, 8192, 8192, 0)).get_int("bn"), 256);
  // Block scales: 256 (two 128-column halves) where its waves fill the SMs, 192 at N = 2112
  // (2112 = 11 x 192; 256 would leave 2.2 waves); wider tiles amortize each k-block's promotion.
  for (auto [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{8192, 8192, 8192}, {4096, 7168, 16384},
                         {4096, 4096, 7168}})
    EXPECT_EQ(*f.heuristic(gemm_problem(DType::bf16, m, n, k, 1)).get_int("bn"), 256);
  EXPECT_EQ(*f.heuristic(gemm_problem(DType::bf16, 4096, 2112, 7168, 1)).get_int("bn"), 192);
  // Grouped order: block 128 x 256 over 64 or more rows of tiles walks groups of 16 rows (8192^3),
  // everything else groups of 8; the catalog holds both block 128 x 256 kernels.
  EXPECT_EQ(*f.heuristic(gemm_problem(DType::bf16, 8192, 8192, 8192, 1)).get_int("group"), 16);
  EXPECT_EQ(*f.heuristic(gemm_problem(DType::bf16, 8192, 8192, 8192, 0)).get_int("group"), 16);
  for (int mode : {0, 1})
    for (auto [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{4096, 7168, 16384}, {4096, 4096, 7168},
                           {4096, 2112, 7168}, {128, 2112, 7168}})
      EXPECT_EQ(*f.heuristic(gemm_problem(DType::bf16, m, n, k, mode)).get_int("group"), 8) << mode << " " << m;
  const auto cat = f.catalog();
  for (int mode : {0, 1}) {
    const Params wide = f.heuristic(gemm_problem(DType::bf16, 8192, 8192, 8192, mode));
    EXPECT_NE(std::find(cat.begin(), cat.end(), wide), cat.end()) << wide.canonical();
  }
  Params p = f.heuristic(gemm_problem(DType::bf16, 4096, 2112, 7168, 0));
  EXPECT_TRUE(f.validate(p).ok());
  p.set("scaling", "block");
  EXPECT_EQ(f.validate(p).code(), Code::invalid_argument);
  p.set("scaling", "tensor").set("bn", std::int64_t(56)).set("path", "mma");
  EXPECT_EQ(f.validate(p).code(), Code::invalid_argument);
  const Family& gated = fam("gated_mlp");
  Params gp = gated.heuristic(gemm_problem(DType::bf16, 4096, 2112, 4096, 0));
  gp.set("bn", std::int64_t(56));
  EXPECT_EQ(gated.validate(gp).code(), Code::invalid_argument);
}

// The heuristic at the M = 128 problems takes the fastest variant measured there on Hopper (with
// deep pipelines none splits K; block-scaled 128 x 7168 x 16384 takes staged 128 x 64 tiles, level
// with 64 x 128). Large problems never split (their waves are full). Grids are whole clusters, the
// partial tile fits beside the stages, and only fp8 on the wgmma path without A multicast splits.
TEST(GemmFamilies, SplitKForDecodeShapes) {
  const Family& f = fam("fp8_gemm");
  const auto catalog = f.catalog();
  struct Want {
    std::int64_t n, k, mode, bm, bn, split;
  };
  for (const Want& w : {Want{7168, 16384, 0, 128, 56, 1}, Want{4096, 7168, 0, 64, 64, 1}, Want{2112, 7168, 0, 64, 32, 1},
                        Want{7168, 16384, 1, 128, 64, 1}, Want{4096, 7168, 1, 64, 64, 1}, Want{2112, 7168, 1, 64, 32, 1}}) {
    const Problem p = gemm_problem(DType::bf16, 128, w.n, w.k, w.mode);
    const Params h = f.heuristic(p);
    SCOPED_TRACE(h.canonical());
    EXPECT_EQ(*h.get_int("bm"), w.bm);
    EXPECT_EQ(*h.get_int("bn"), w.bn);
    EXPECT_EQ(*h.get_int("split"), w.split);
    EXPECT_NE(std::find(catalog.begin(), catalog.end(), h), catalog.end());
    const LaunchGeometry geo = f.geometry(h, p);
    EXPECT_EQ(geo.grid.x % w.split, 0u);
    EXPECT_LE(geo.grid.x, 132u);
    EXPECT_LE(geo.shared_bytes, g::max_shared_bytes(90));
    // Small tiles fill shared memory with stages (bound by bytes in flight, not tensor cores).
    EXPECT_GE(*h.get_int("stages"), 8);
    EXPECT_GT(geo.shared_bytes, 190u * 1024);
  }
  // Every split of the tuning space fits and launches whole clusters.
  for (const Params& c : f.tuning_space(gemm_problem(DType::bf16, 128, 4096, 7168, 0))) {
    const auto split = *c.get_int("split");
    EXPECT_EQ(f.geometry(c, gemm_problem(DType::bf16, 128, 4096, 7168, 0)).grid.x % split, 0u) << c.canonical();
  }
  for (std::int64_t mode : {0, 1})
    for (auto [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{8192, 8192, 8192}, {4096, 2112, 7168}})
      EXPECT_EQ(*f.heuristic(gemm_problem(DType::bf16, m, n, k, mode)).get_int("split"), 1);
  Params s = f.heuristic(gemm_problem(DType::bf16, 128, 7168, 16384, 1));
  s.set("bm", std::int64_t(128)).set("split", std::int64_t(2)).set("stages", std::int64_t(4));
  EXPECT_TRUE(f.validate(s).ok());
  s.set("cluster", std::int64_t(2));
  EXPECT_EQ(f.validate(s).code(), Code::invalid_argument);
  s.set("cluster", std::int64_t(1)).set("path", "mma");
  EXPECT_EQ(f.validate(s).code(), Code::invalid_argument);
  const Family& gated = fam("gated_mlp");
  Params gp = gated.heuristic(gemm_problem(DType::bf16, 128, 4096, 4096, 0));
  gp.set("split", std::int64_t(2));
  EXPECT_EQ(gated.validate(gp).code(), Code::invalid_argument);
  EXPECT_EQ(*gated.heuristic(gemm_problem(DType::bf16, 128, 4096, 4096, 0)).get_int("split"), 1);
}

// Decode-sized M takes swapped tiles (bm 16 or 32: the tile's B rows are wgmma's A) where one
// tile holds every row, so B is read once; per tensor they never split K, block scales may.
// Larger M never swaps, and swapped tiles are fp8 or gated on the wgmma path with bn 64 or 128.
TEST(GemmFamilies, SwappedTilesForDecodeSizedM) {
  const Family& f = fam("fp8_gemm");
  const auto catalog = f.catalog();
  for (std::int64_t mode : {0, 1})
    for (auto [m, bm] : {std::pair<std::int64_t, std::int64_t>{1, 16}, {16, 16}, {17, 32}, {32, 32}})
      for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{2880, 2880}, {4096, 14336}, {14336, 4096}, {896, 4864}}) {
        const Problem p = gemm_problem(DType::bf16, m, n, k, mode);
        const Params h = f.heuristic(p);
        SCOPED_TRACE(h.canonical() + " m " + std::to_string(m));
        EXPECT_EQ(*h.get_int("bm"), bm);
        if (mode == 0) {
          EXPECT_EQ(*h.get_int("split"), 1);
        }
        EXPECT_NE(std::find(catalog.begin(), catalog.end(), h), catalog.end());
        const LaunchGeometry geo = f.geometry(h, p);
        EXPECT_EQ(geo.block.x, std::uint32_t((*h.get_int("bn") / 64 + 1) * 128));
        EXPECT_LE(geo.shared_bytes, g::max_shared_bytes(90));
      }
  // Block scales over a long K split swapped tiles in two (their k-steps wait for the promotion).
  EXPECT_EQ(*f.heuristic(gemm_problem(DType::bf16, 16, 3584, 18944, 1)).get_int("split"), 2);
  for (std::int64_t m : {33, 128, 1000})
    EXPECT_GE(*f.heuristic(gemm_problem(DType::bf16, m, 4096, 14336, 0)).get_int("bm"), 64) << m;
  Params s = f.heuristic(gemm_problem(DType::bf16, 16, 4096, 14336, 0));
  ASSERT_EQ(*s.get_int("bm"), 16);
  EXPECT_TRUE(f.validate(s).ok());
  for (std::int64_t bn : {32, 56, 176, 192, 256}) {
    Params w = s;
    w.set("bn", bn);
    EXPECT_EQ(f.validate(w).code(), Code::invalid_argument) << bn;
  }
  Params c = s;
  c.set("cluster", std::int64_t(2));
  EXPECT_EQ(f.validate(c).code(), Code::invalid_argument);
  c = s;
  c.set("path", "mma");
  EXPECT_EQ(f.validate(c).code(), Code::invalid_argument);
  // The gated MLP swaps too (both projections' rows as wgmma's A); the LoRA core (k_half) does not.
  const Family& gated = fam("gated_mlp");
  const Params gp = gated.heuristic(gemm_problem(DType::bf16, 16, 28672, 8192, 0));
  EXPECT_EQ(*gp.get_int("bm"), 16);
  const auto gated_catalog = gated.catalog();
  EXPECT_NE(std::find(gated_catalog.begin(), gated_catalog.end(), gp), gated_catalog.end());
  EXPECT_EQ(*gated.heuristic(gemm_problem(DType::bf16, 33, 28672, 8192, 0)).get_int("bm"), 64);
  EXPECT_EQ(g::validate_tile("lora_gemm", g::k_half, g::Tile{true, 16, 64, 4, 8}).code(), Code::invalid_argument);
}

// Each 128-row tile of the per-tensor candidates that stores its own fragments (bn 176 and 56,
// kept for the wave count) costs the model four k-steps more than a staged one: at 1000 tokens
// the heuristic takes the staged 192 / 64 widths, faster there on Hopper.
TEST(GemmFamilies, EpilogueTermPrefersStagedTiles) {
  const Family& f = fam("fp8_gemm");
  for (auto [n, k, bn] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{14336, 4096, 192}, {4864, 896, 192},
                          {896, 4864, 64}, {14336, 4032, 192}}) {
    const Params h = f.heuristic(gemm_problem(DType::bf16, 1000, n, k, 0));
    EXPECT_EQ(*h.get_int("bm"), 128) << h.canonical();
    EXPECT_EQ(*h.get_int("bn"), bn) << h.canonical();
  }
  g::Tile direct{true, 128, 176, 4, 8}, staged{true, 128, 192, 4, 8};
  const Problem p = gemm_problem(DType::bf16, 1000, 14336, 4096, 0);
  EXPECT_FALSE(g::staged_epilogue(g::k_fp8_tensor, direct));
  EXPECT_TRUE(g::staged_epilogue(g::k_fp8_tensor, staged));
  EXPECT_LT(g::wgmma_cost(g::k_fp8_tensor, staged, p), g::wgmma_cost(g::k_fp8_tensor, direct, p));
}

TEST(GemmFamilies, ArgumentsPackInKernelOrder) {
  const Family& f = fam("gated_mlp");
  const Problem p = gemm_problem(DType::bf16, 300, 1000, 512, families::k_gated_gelu);
  const Params h = f.heuristic(p);
  int x, wg, wu, out;
  void* bufs[4] = {&x, &wg, &wu, &out};
  ArgPack args;
  f.pack_args(h, p, bufs, args);
  ASSERT_FALSE(args.overflow());
  ASSERT_EQ(*h.get_str("path"), "wgmma");
  ASSERT_EQ(args.count(), 15u);  // 11 values, then the tensor maps of x, wg, wu and out
  EXPECT_EQ(*static_cast<void**>(args.pointers()[0]), &x);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[1]), &wg);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[2]), &wu);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[3]), nullptr);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[5]), &out);
  EXPECT_EQ(*static_cast<int*>(args.pointers()[6]), 300);
  EXPECT_EQ(*static_cast<int*>(args.pointers()[7]), 1000);
  EXPECT_EQ(*static_cast<int*>(args.pointers()[8]), 512);
  const auto bm = *h.get_int("bm"), bn = *h.get_int("bn");
  EXPECT_EQ(*static_cast<int*>(args.pointers()[9]), (300 + bm - 1) / bm);
  EXPECT_EQ(*static_cast<int*>(args.pointers()[10]), (1000 + bn - 1) / bn);
  ASSERT_EQ(args.tensor_maps(), 4u);
  // The output's map: 16-bit elements seen as bytes, boxes of 16 rows (the staged epilogue).
  const TensorMapRequest& o = args.tensor_map_request(3);
  EXPECT_EQ(o.base, &out);
  EXPECT_EQ(o.row_bytes, 1000u * 2);
  EXPECT_EQ(o.rows, 300u);
  EXPECT_EQ(o.box_rows, 16u);
  EXPECT_EQ(args.tensor_map_slot(3), args.pointers()[14]);
  // n not a multiple of 8: rows are not whole 16-byte pieces, the kernel stores directly and A's
  // map stands in for the output's.
  {
    const Problem odd = gemm_problem(DType::bf16, 300, 1001, 512, families::k_gated_gelu);
    ArgPack odd_args;
    f.pack_args(f.heuristic(odd), odd, bufs, odd_args);
    ASSERT_EQ(odd_args.tensor_maps(), 4u);
    EXPECT_EQ(odd_args.tensor_map_request(3).base, &x);
    EXPECT_EQ(odd_args.tensor_map_request(3).row_bytes, 512u * 2);
  }
  const void* bases[3] = {&x, &wg, &wu};
  for (std::size_t i = 0; i < 3; ++i) {
    const TensorMapRequest& r = args.tensor_map_request(i);
    EXPECT_EQ(r.base, bases[i]);
    EXPECT_EQ(r.row_bytes, 512u * 2);
    EXPECT_EQ(r.rows, i == 0 ? 300u : 1000u);
    EXPECT_EQ(r.box_rows, std::uint32_t(i == 0 ? bm : bn));
    EXPECT_EQ(args.tensor_map_slot(i), args.pointers()[11 + i]);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(args.tensor_map_slot(i)) % 64, 0u);
  }
  // The sm_80 path takes no maps.
  Problem a100 = p;
  a100.cc = 80;
  ArgPack plain;
  f.pack_args(f.heuristic(a100), a100, bufs, plain);
  EXPECT_EQ(plain.count(), 11u);
  EXPECT_EQ(plain.tensor_maps(), 0u);
}

// The problems' fields: m (rows for quantize_fp8) bucketed, the rest exact keys; the device is the
// Problem's, not a field, and problem_from_shape defaults the GEMMs' mode to 0. A problem with no
// device (sm_count and cc 0: a CPU test, `kiln tune` without a GPU) picks, checks, sizes its grid
// and spans its tuning space as on an H100.
TEST(GemmFamilies, FieldsSignaturesAndTheUnknownDevice) {
  auto field_names = [](const Family& f) {
    std::vector<std::string> out;
    for (const ProblemField& pf : f.problem_fields()) out.push_back(pf.name + (pf.bucketed ? "<=" : pf.key ? "" : "?"));
    return out;
  };
  for (const char* name : {"fp8_gemm", "gated_mlp"}) {
    const Family& f = fam(name);
    SCOPED_TRACE(name);
    EXPECT_EQ(field_names(f), (std::vector<std::string>{"m<=", "n", "k", "mode"}));
    const Problem p = f.problem_from_shape(DType::bf16, {{"m", 100}, {"n", 4096}, {"k", 7168}}).value();
    EXPECT_EQ(f.signature(p), "dtype=bf16,align=16,m<=128,n=4096,k=7168,mode=0");
    EXPECT_EQ(p.sm_count, 0);
    EXPECT_EQ(p.cc, 0);
    EXPECT_FALSE(f.problem_from_shape(DType::bf16, {{"m", 1}, {"n", 1}, {"k", 16}, {"sms", 132}}).ok());
    for (std::int64_t mode : {0, 1})
      for (auto [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{128, 2112, 7168}, {4096, 7168, 16384},
                             {333, 4099, 528}}) {
        const Problem unknown = gemm_problem(DType::bf16, m, n, k, mode, 0, 0);
        const Problem h100 = gemm_problem(DType::bf16, m, n, k, mode, 132, 90);
        const Params h = f.heuristic(unknown);
        EXPECT_EQ(h, f.heuristic(h100)) << h.canonical();
        EXPECT_EQ(*h.get_str("path"), "wgmma");
        EXPECT_TRUE(f.check_problem(h, unknown).ok()) << f.check_problem(h, unknown).to_string();
        EXPECT_EQ(f.geometry(h, unknown).grid.x, f.geometry(h, h100).grid.x);
        EXPECT_EQ(f.tuning_space(unknown), f.tuning_space(h100));
      }
  }
  const Family& q = fam("quantize_fp8");
  EXPECT_EQ(field_names(q), (std::vector<std::string>{"rows<=", "cols", "mode", "transpose"}));
  const Problem qp =
      q.problem_from_shape(DType::f32, {{"rows", 3000}, {"cols", 7168}, {"mode", families::k_q_tile}, {"transpose", 1}})
          .value();
  EXPECT_EQ(q.signature(qp), "dtype=f32,align=16,rows<=4096,cols=7168,mode=3,transpose=1");
  const Params qh = q.heuristic(qp);
  EXPECT_EQ(*qh.get_str("mode"), "tile");
  EXPECT_EQ(*qh.get_int("transpose"), 1);
  EXPECT_TRUE(q.check_problem(qh, qp).ok());
}

// The typed ops on host memory: CPU fallbacks, and every error before any resolve.
class GemmOps : public ::testing::Test {
 protected:
  void SetUp() override {
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    o.cache_file = (dir_.path() / "k.sqlite").string();
    rt_ = Runtime::create(o).value();
    std::mt19937 rng(testing::fresh_seed());
    std::normal_distribution<float> d(0.0f, 2.0f);
    for (auto& e : a_) e = float_to_e4m3(d(rng));
    for (auto& e : b_) e = float_to_e4m3(d(rng));
    for (auto& e : x_) e = float_to_bf16(d(rng));
    for (auto& e : w_) e = float_to_bf16(d(rng) / 8);
  }
  void expect(const Status& s, Code c, const char* what) {
    EXPECT_EQ(s.code(), c) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
    RuntimeCounters k = rt_->counters();
    EXPECT_EQ(k.from_embedded + k.from_daemon + k.module_loads, 0) << what << " resolved a kernel";
  }
  // b as the transposed view of the [N, K] buffer.
  TensorView bt(void* data, std::int64_t k, std::int64_t n) {
    TensorView v = TensorView::contiguous(data, DType::u8, {n, k}, Device::cpu());
    std::swap(v.shape[0], v.shape[1]);
    std::swap(v.strides[0], v.strides[1]);
    return v;
  }
  static constexpr std::int64_t m_ = 3, n_ = 5, k_ = 32;
  testing::TempDir dir_;
  std::shared_ptr<Runtime> rt_;
  alignas(16) std::uint8_t a_[m_ * k_ + 16], b_[n_ * k_];
  alignas(16) std::uint16_t x_[m_ * k_ + 8], w_[n_ * k_], out_[m_ * n_ + 8];
  alignas(16) float sa_[m_] = {0.5f, 1, 2}, sb_[1] = {0.25f};
};

TEST_F(GemmOps, Fp8GemmFallbackMatchesTheReference) {
  auto cpu = Device::cpu();
  auto a = TensorView::contiguous(a_, DType::u8, {m_, k_}, cpu);
  auto out = TensorView::contiguous(out_, DType::bf16, {m_, n_}, cpu);
  ASSERT_TRUE(fp8_gemm(a, bt(b_, k_, n_), TensorView::contiguous(sa_, DType::f32, {1}, cpu),
                       TensorView::contiguous(sb_, DType::f32, {1}, cpu), out, nullptr, rt_.get())
                  .ok());
  for (std::int64_t i = 0; i < m_; ++i)
    for (std::int64_t j = 0; j < n_; ++j) {
      double want = 0;
      for (std::int64_t q = 0; q < k_; ++q) want += double(e4m3_to_float(a_[i * k_ + q])) * e4m3_to_float(b_[j * k_ + q]);
      EXPECT_NEAR(bf16_to_float(out_[i * n_ + j]), want * 0.5 * 0.25, std::fabs(want) * 0.5 * 0.25 / 128 + 1e-6);
    }
  EXPECT_EQ(rt_->counters().module_loads, 0);
}

TEST_F(GemmOps, Fp8GemmErrors) {
  auto cpu = Device::cpu();
  auto a = TensorView::contiguous(a_, DType::u8, {m_, k_}, cpu);
  auto b = bt(b_, k_, n_);
  auto sa = TensorView::contiguous(sa_, DType::f32, {1}, cpu), sb = TensorView::contiguous(sb_, DType::f32, {1}, cpu);
  auto out = TensorView::contiguous(out_, DType::bf16, {m_, n_}, cpu);
  auto call = [&](const TensorView& av, const TensorView& bv, const TensorView& sav, const TensorView& sbv,
                  const TensorView& ov) { return fp8_gemm(av, bv, sav, sbv, ov, nullptr, rt_.get()); };
  expect(call(TensorView::contiguous(a_, DType::u8, {m_, k_ - 16}, cpu), b, sa, sb, out), Code::shape_mismatch, "K");
  expect(call(a, b, sa, sb, TensorView::contiguous(out_, DType::bf16, {m_, n_ + 1}, cpu)), Code::shape_mismatch, "out");
  expect(call(TensorView::contiguous(a_, DType::u8, {m_, 24}, cpu), bt(b_, 24, n_), sa, sb, out),
         Code::shape_mismatch, "K not a multiple of 16");
  auto no_scale = sa;
  no_scale.data = nullptr;
  expect(call(a, b, no_scale, sb, out), Code::invalid_argument, "a without a_scale");
  expect(call(a, b, sa, no_scale, out), Code::invalid_argument, "b without b_scale");
  expect(call(a, b, TensorView::contiguous(sa_, DType::f32, {m_}, cpu), sb, out), Code::shape_mismatch, "scale shape");
  expect(call(a, b, TensorView::contiguous(sa_, DType::f32, {m_, 1}, cpu), sb, out), Code::shape_mismatch,
         "block a_scale with a per-tensor b_scale");
  auto a16 = a;
  a16.dtype = DType::f16;
  expect(call(a16, b, sa, sb, out), Code::unsupported_dtype, "a not u8");
  auto o32 = out;
  o32.dtype = DType::f32;
  expect(call(a, b, sa, sb, o32), Code::unsupported_dtype, "f32 out");
  auto s16 = sa;
  s16.dtype = DType::f16;
  expect(call(a, b, s16, sb, out), Code::unsupported_dtype, "f16 scale");
  expect(call(a, TensorView::contiguous(b_, DType::u8, {k_, n_}, cpu), sa, sb, out), Code::invalid_argument,
         "row-major b");
  auto shifted = TensorView::contiguous(a_ + 1, DType::u8, {m_, k_}, cpu);
  expect(call(shifted, b, sa, sb, out), Code::invalid_argument, "misaligned a");
  auto ag = a;
  ag.device = Device::cuda(0);
  expect(call(ag, b, sa, sb, out), Code::device_error, "mixed devices");
  auto bg = b, sag = sa, sbg = sb, og = out;
  bg.device = sag.device = sbg.device = og.device = Device::cuda(0);
  expect(call(ag, bg, sag, sbg, og), Code::device_error, "host pointers labelled cuda");
}

TEST_F(GemmOps, GatedMlpFallbackAndErrors) {
  auto cpu = Device::cpu();
  const std::int64_t k = 16, n = 4, m = 6;
  auto x = TensorView::contiguous(x_, DType::bf16, {2, 3, k}, cpu);
  auto wg = TensorView::contiguous(w_, DType::bf16, {n, k}, cpu), wu = TensorView::contiguous(w_ + 64, DType::bf16, {n, k}, cpu);
  auto out = TensorView::contiguous(out_, DType::bf16, {2, 3, n}, cpu);
  ASSERT_TRUE(fused_gated_mlp(x, wg, wu, out, GatedActivation::silu, nullptr, rt_.get()).ok());
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double gate = 0, up = 0;
      for (std::int64_t q = 0; q < k; ++q) {
        gate += double(bf16_to_float(x_[i * k + q])) * bf16_to_float(w_[j * k + q]);
        up += double(bf16_to_float(x_[i * k + q])) * bf16_to_float(w_[64 + j * k + q]);
      }
      const double want = gate / (1 + std::exp(-gate)) * up;
      EXPECT_NEAR(bf16_to_float(out_[i * n + j]), want, std::fabs(want) / 128 + 1e-6);
    }
  auto call = [&](const TensorView& xv, const TensorView& gv, const TensorView& uv, const TensorView& ov,
                  GatedActivation a = GatedActivation::gelu) { return fused_gated_mlp(xv, gv, uv, ov, a, nullptr, rt_.get()); };
  expect(call(x, TensorView::contiguous(w_, DType::bf16, {n, k - 8}, cpu), wu, out), Code::shape_mismatch, "hidden");
  expect(call(x, wg, TensorView::contiguous(w_, DType::bf16, {n + 1, k}, cpu), out), Code::shape_mismatch, "up shape");
  expect(call(x, wg, wu, TensorView::contiguous(out_, DType::bf16, {6, n}, cpu)), Code::shape_mismatch, "out shape");
  expect(call(TensorView::contiguous(x_, DType::bf16, {4, 12}, cpu), TensorView::contiguous(w_, DType::bf16, {n, 12}, cpu),
              TensorView::contiguous(w_ + 64, DType::bf16, {n, 12}, cpu), TensorView::contiguous(out_, DType::bf16, {4, n}, cpu)),
         Code::shape_mismatch, "hidden not a multiple of 8");
  auto wf = wg;
  wf.dtype = DType::f16;
  expect(call(x, wf, wu, out), Code::unsupported_dtype, "mixed dtypes");
  auto x32 = x, g32 = wg, u32 = wu, o32 = out;
  x32.dtype = g32.dtype = u32.dtype = o32.dtype = DType::f32;
  expect(call(x32, g32, u32, o32), Code::unsupported_dtype, "f32");
  expect(call(x, wg, wu, out, static_cast<GatedActivation>(9)), Code::invalid_argument, "activation");
  auto shifted = TensorView::contiguous(x_ + 1, DType::bf16, {2, 3, k}, cpu);
  expect(call(shifted, wg, wu, out), Code::invalid_argument, "misaligned x");
  auto xs = x;
  xs.strides[1] = 2 * k;
  expect(call(xs, wg, wu, out), Code::shape_mismatch, "strided x");
  auto og = out;
  og.device = Device::cuda(0);
  expect(call(x, wg, wu, og), Code::device_error, "mixed devices");
}

TEST_F(GemmOps, QuantizeErrors) {
  auto cpu = Device::cpu();
  std::vector<float> x(256 * 4, 1.0f), s(16);
  std::vector<std::uint8_t> q(256 * 4);
  auto xv = TensorView::contiguous(x.data(), DType::f32, {4, 256}, cpu);
  auto qv = TensorView::contiguous(q.data(), DType::u8, {4, 256}, cpu);
  auto call = [&](const TensorView& xx, const TensorView& qq, const TensorView& ss, Fp8Granularity gr, bool tr = false) {
    return quantize_fp8(xx, qq, ss, gr, tr, nullptr, rt_.get());
  };
  expect(call(xv, qv, TensorView::contiguous(s.data(), DType::f32, {4, 3}, cpu), Fp8Granularity::row_1x128),
         Code::shape_mismatch, "row scale grid");
  expect(call(xv, qv, TensorView::contiguous(s.data(), DType::f32, {2, 1}, cpu), Fp8Granularity::tile_128),
         Code::shape_mismatch, "tile scale grid");
  expect(call(xv, qv, TensorView::contiguous(s.data(), DType::f32, {1, 2}, cpu), Fp8Granularity::tile_128, true),
         Code::shape_mismatch, "q not transposed");
  expect(call(xv, TensorView::contiguous(q.data(), DType::u8, {256, 4}, cpu),
              TensorView::contiguous(s.data(), DType::f32, {4, 2}, cpu), Fp8Granularity::row_1x128, true),
         Code::invalid_argument, "transposed row blocks");
  auto qf = qv;
  qf.dtype = DType::f16;
  expect(call(xv, qf, TensorView::contiguous(s.data(), DType::f32, {1}, cpu), Fp8Granularity::tensor),
         Code::unsupported_dtype, "q not u8");
  auto xi = xv;
  xi.dtype = DType::i32;
  expect(call(xi, qv, TensorView::contiguous(s.data(), DType::f32, {1}, cpu), Fp8Granularity::tensor),
         Code::unsupported_dtype, "integer x");
  expect(call(xv, qv, TensorView::contiguous(reinterpret_cast<char*>(s.data()) + 2, DType::f32, {1}, cpu),
              Fp8Granularity::tensor),
         Code::invalid_argument, "misaligned scale");
  expect(call(xv, qv, TensorView::contiguous(s.data(), DType::f32, {1}, cpu), static_cast<Fp8Granularity>(5)),
         Code::invalid_argument, "granularity");
}


// The staged epilogue's shared memory (2 KiB per consumer warp) goes to 128-row tiles whose width
// is whole 64-column boxes, without split-K (the GEMM families' kernels and the LoRA core, k_half);
// the decode-sized 64-row tiles and split-K keep storing directly and their stages.
TEST(GemmFamilies, StagedEpilogueSharedMemory) {
  const g::Tile big{true, 128, 256, 4, 8};
  EXPECT_TRUE(g::staged_epilogue(g::k_fp8_tensor, big));
  EXPECT_EQ(g::shared_bytes(g::k_fp8_tensor, big), 4u * 384 * 128 + 1024 + 8 * 2048 + 16 * 4);
  EXPECT_TRUE(g::staged_epilogue(g::k_half, big));
  EXPECT_EQ(g::shared_bytes(g::k_half, big), 4u * 384 * 128 + 1024 + 8 * 2048 + 16 * 4);
  // A 24 KiB stage takes as many stages as fit beside the staging: 8, not 9.
  EXPECT_EQ(g::default_stages(g::k_half, g::Tile{true, 128, 64, 4, 8}, 90), 8);
  EXPECT_TRUE(g::staged_epilogue(g::k_gated, g::Tile{true, 128, 128, 4, 8}));
  EXPECT_FALSE(g::staged_epilogue(g::k_fp8_tensor, g::Tile{true, 128, 176, 4, 8}));
  EXPECT_FALSE(g::staged_epilogue(g::k_fp8_tensor, g::Tile{true, 64, 128, 9, 8}));
  EXPECT_FALSE(g::staged_epilogue(g::k_fp8_tensor, g::Tile{true, 128, 128, 4, 8, 1, 2}));
  EXPECT_FALSE(g::staged_epilogue(g::k_fp8_tensor, g::Tile{false, 128, 128, 4, 8}));
  // Every staged tile of the heuristic still gets its stages within the limit.
  for (g::Kind kind : {g::k_fp8_tensor, g::k_fp8_block, g::k_gated, g::k_half})
    for (const g::Tile& t : g::default_tiles(kind)) {
      SCOPED_TRACE(std::to_string(t.bm) + "x" + std::to_string(t.bn) + " stages " + std::to_string(t.stages));
      EXPECT_LE(g::shared_bytes(kind, t), g::max_shared_bytes(t.wgmma ? 90 : 80));
      if (g::staged_epilogue(kind, t)) {
        EXPECT_GE(t.stages, 4);
      }
    }
}

}  // namespace
}  // namespace kiln
