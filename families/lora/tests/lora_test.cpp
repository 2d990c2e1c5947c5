// The LoRA families on the CPU: lora_linear and lora_linear_multi (host tensors run the families'
// CPU references through the same op code the GPU takes: shrink into partial sums, then the GEMM
// with its low-rank tail) against an fp64 reference written in tests/lora_reference.h, at ranks
// 1, 8, 64 and 128, k and n that are not multiples of any tile, scale 0, and a multi-adapter batch
// with mixed ranks, merged-QKV and gate_up slices and rows without an adapter; the shrink's split
// partial sums; the heuristic's picks being catalog variants; every typed error before anything
// resolves; the declarations. NVRTC compiles of every catalog variant for sm_80 and sm_90a run in
// tests/conformance (CatalogCompiles).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "common/half.h"
#include "families/lora/lora.h"
#include "families/lora/ops.h"
#include "families/lora/tests/lora_reference.h"
#include "kiln/op.h"
#include "kiln/runtime.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

namespace l = families::lora;
using testing::lora::Case;
using testing::lora::draw;
using testing::lora::rel_l2;

const Family& fam(const char* name) { return *Registry::global().find(name); }

TensorView host(void* p, DType t, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(p, t, shape, Device::cpu());
}

class LoraCpu : public ::testing::Test {
 protected:
  void SetUp() override {
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    o.cache_file = (dir_.path() / "k.sqlite").string();
    rt_ = Runtime::create(o).value();
    seed_ = testing::fresh_seed();
    rng_.seed(seed_);
  }
  void expect(const Status& s, Code c, const char* what) {
    EXPECT_EQ(s.code(), c) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
    RuntimeCounters k = rt_->counters();
    EXPECT_EQ(k.from_embedded + k.from_daemon + k.module_loads, 0) << what << " resolved a kernel";
  }
  // Draws a case's tensors (host bits in `bits`), with a low-rank term of the base's size.
  struct Bits {
    std::vector<std::uint16_t> x, w, a, b, bias;
  };
  Bits fill(Case& c, DType t, double scale) {
    Bits h;
    h.x = draw(c.x, std::size_t(c.m * c.k), t, 1.0, rng_);
    h.w = draw(c.w, std::size_t(c.n * c.k), t, 1.0 / std::sqrt(double(c.k)), rng_);
    h.a = draw(c.a, std::size_t(c.adapters * c.slices * c.r * c.k), t, 1.0 / std::sqrt(double(c.k)), rng_);
    h.b = draw(c.b, std::size_t(c.adapters * c.n * c.r), t, 1.0 / std::sqrt(double(c.r)), rng_);
    if (c.bias) h.bias = draw(c.bias_v, std::size_t(c.n), t, 1.0, rng_);
    if (c.scales.empty()) c.scales.assign(std::size_t(c.adapters), float(scale));
    return h;
  }
  testing::TempDir dir_;
  std::shared_ptr<Runtime> rt_;
  unsigned seed_ = 0;
  std::mt19937 rng_;
};

TEST_F(LoraCpu, LinearMatchesFp64AtEveryRank) {
  for (DType t : {DType::bf16, DType::f16})
    for (std::int64_t r : {1, 8, 64, 128})
      for (bool bias : {false, true}) {
        Case c{.m = 37, .n = 200, .k = 264, .r = r, .bias = bias};
        Bits h = fill(c, t, 2.0);
        std::vector<std::uint16_t> out(std::size_t(c.m * c.n) + 8, 0xFFFF);
        const TensorView bv = host(h.bias.data(), t, {c.n});
        const Status s = lora_linear(host(h.x.data(), t, {c.m, c.k}), host(h.w.data(), t, {c.n, c.k}),
                                     host(h.a.data(), t, {r, c.k}), host(h.b.data(), t, {c.n, r}), bias ? &bv : nullptr,
                                     host(out.data(), t, {c.m, c.n}), 2.0, 0, 0, nullptr, rt_.get());
        ASSERT_TRUE(s.ok()) << s.to_string();
        out.resize(std::size_t(c.m * c.n));
        const auto want = c.reference();
        const double tol = t == DType::bf16 ? 8e-3 : 2e-3;
        const std::string what = std::string(dtype_name(t)) + " r " + std::to_string(r) + (bias ? " bias" : "") +
                                 " seed " + std::to_string(seed_);
        EXPECT_LT(rel_l2(out, want, t), tol) << what;
        // The low-rank term is a visible part of the result: the base GEMM alone is far off.
        Case base = c;
        base.scales.assign(1, 0.0f);
        EXPECT_GT(rel_l2(out, base.reference(), t), 20 * tol) << what;
      }
}

// Merged projections through lora_linear: gate_up (2 slices, equal halves) and QKV (3, unequal).
TEST_F(LoraCpu, SlicedLinearMatchesFp64) {
  const DType t = DType::bf16;
  for (std::int64_t slices : {2, 3}) {
    Case c{.m = 41, .n = 192, .k = 136, .r = 16, .slices = slices, .bias = true};
    c.end0 = slices == 2 ? 96 : 128;
    c.end1 = slices == 3 ? 160 : 0;
    Bits h = fill(c, t, 1.5);
    std::vector<std::uint16_t> out(std::size_t(c.m * c.n) + 8, 0xFFFF);
    const TensorView bv = host(h.bias.data(), t, {c.n});
    const Status s = lora_linear(host(h.x.data(), t, {c.m, c.k}), host(h.w.data(), t, {c.n, c.k}),
                                 host(h.a.data(), t, {slices * c.r, c.k}), host(h.b.data(), t, {c.n, c.r}), &bv,
                                 host(out.data(), t, {c.m, c.n}), 1.5, slices == 3 ? c.end0 : 0, c.end1, nullptr,
                                 rt_.get());
    ASSERT_TRUE(s.ok()) << s.to_string();
    out.resize(std::size_t(c.m * c.n));
    EXPECT_LT(rel_l2(out, c.reference(), t), 8e-3) << "slices " << slices << " seed " << seed_;
  }
}

TEST_F(LoraCpu, ScaleZeroIsTheBaseGemm) {
  const DType t = DType::bf16;
  Case c{.m = 19, .n = 72, .k = 136, .r = 16, .bias = true};
  Bits h = fill(c, t, 0.0);
  std::vector<std::uint16_t> out(std::size_t(c.m * c.n) + 8), zero_b(h.b.size(), 0), out_zero_b(out.size());
  const TensorView bv = host(h.bias.data(), t, {c.n});
  auto run = [&](std::vector<std::uint16_t>& b, std::vector<std::uint16_t>& o, double scale) {
    const Status s = lora_linear(host(h.x.data(), t, {c.m, c.k}), host(h.w.data(), t, {c.n, c.k}),
                                 host(h.a.data(), t, {c.r, c.k}), host(b.data(), t, {c.n, c.r}), &bv,
                                 host(o.data(), t, {c.m, c.n}), scale, 0, 0, nullptr, rt_.get());
    ASSERT_TRUE(s.ok()) << s.to_string();
  };
  run(h.b, out, 0.0);
  run(zero_b, out_zero_b, 3.0);
  EXPECT_EQ(out, out_zero_b);
  out.resize(std::size_t(c.m * c.n));
  EXPECT_LT(rel_l2(out, c.reference(), t), 6e-3);
}

// A batch over 4 adapters of ranks 1, 8, 64 and 128 (the stack's r is 128), rows in random
// order, some with index -1 and some past the stack (no adapter), for 1, 2 (gate_up, equal
// halves) and 3 (merged QKV, unequal) slices.
TEST_F(LoraCpu, MultiAdapterMatchesFp64) {
  const DType t = DType::bf16;
  for (std::int64_t slices : {1, 2, 3}) {
    Case c{.m = 70, .n = 200, .k = 136, .r = 128, .adapters = 4, .slices = slices, .bias = slices == 3};
    if (slices == 2) c.end0 = 100;
    if (slices == 3) {
      c.end0 = 136;
      c.end1 = 168;
    }
    c.ranks = {1, 8, 64, 128};
    c.scales = {0.5f, 2.0f, 1.5f, 0.25f};
    std::uniform_int_distribution<int> pick(-1, 4);
    c.idx.resize(std::size_t(c.m));
    for (auto& v : c.idx) v = pick(rng_);
    c.idx[0] = -1;
    c.idx[1] = 4;
    Bits h = fill(c, t, 1.0);
    std::vector<std::uint16_t> out(std::size_t(c.m * c.n) + 8, 0xFFFF);
    const TensorView bv = host(h.bias.data(), t, {c.n});
    const Status s = lora_linear_multi(
        host(h.x.data(), t, {c.m, c.k}), host(h.w.data(), t, {c.n, c.k}),
        host(h.a.data(), t, {c.adapters, slices * c.r, c.k}), host(h.b.data(), t, {c.adapters, c.n, c.r}),
        host(c.idx.data(), DType::i32, {c.m}), host(c.ranks.data(), DType::i32, {c.adapters}),
        host(c.scales.data(), DType::f32, {c.adapters}), c.bias ? &bv : nullptr, host(out.data(), t, {c.m, c.n}),
        slices == 3 ? c.end0 : 0, slices == 3 ? c.end1 : 0, nullptr, rt_.get());
    ASSERT_TRUE(s.ok()) << s.to_string();
    out.resize(std::size_t(c.m * c.n));
    EXPECT_LT(rel_l2(out, c.reference(), t), 8e-3) << "slices " << slices << " seed " << seed_;
    // Rows without an adapter are the base GEMM's, whatever the stack holds.
    Case base = c;
    base.idx.assign(std::size_t(c.m), -1);
    const auto want_base = base.reference();
    for (std::int64_t i : {0, 1}) {
      double num = 0, den = 0;
      for (std::int64_t j = 0; j < c.n; ++j) {
        const double g = load_as_double(out.data(), t, i * c.n + j), w = want_base[i * c.n + j];
        num += (g - w) * (g - w);
        den += w * w;
      }
      EXPECT_LT(std::sqrt(num / den), 6e-3) << "row " << i;
    }
  }
}

// The shrink's partial sums over K ranges add up to the whole product, split by 64-column steps
// as the kernel splits them.
TEST_F(LoraCpu, ShrinkSplitsPartitionK) {
  const Family& f = fam("lora_shrink");
  const DType t = DType::bf16;
  Case c{.m = 9, .k = 328, .r = 12, .slices = 2};
  Bits h = fill(c, t, 1.0);
  std::int32_t dummy = 0;
  const std::int64_t ucols = 2 * l::rank_pitch(12);
  std::vector<std::vector<float>> u;
  for (std::int64_t splits : {1, 3, 6}) {
    const Problem p =
        Problem::of(t, 16, l::LoraShrinkProblem{.m = c.m, .k = c.k, .r = c.r, .slices = 2, .splits = splits});
    ASSERT_TRUE(f.check_problem(f.heuristic(p), p).ok());
    std::vector<float> part(std::size_t(splits * c.m * ucols), NAN);
    void* b[5] = {h.x.data(), h.a.data(), &dummy, &dummy, part.data()};
    ASSERT_TRUE(f.cpu_reference(f.heuristic(p), p, b).ok());
    std::vector<float> sum(std::size_t(c.m * ucols), 0.0f);
    for (std::int64_t z = 0; z < splits; ++z)
      for (std::int64_t i = 0; i < c.m * ucols; ++i) sum[i] += part[z * c.m * ucols + i];
    u.push_back(sum);
  }
  for (std::int64_t i = 0; i < c.m; ++i)
    for (std::int64_t col = 0; col < ucols; ++col) {
      const std::int64_t s = col / l::rank_pitch(12), q = col % l::rank_pitch(12);
      double want = 0;
      for (std::int64_t x = 0; q < c.r && x < c.k; ++x) want += c.x[i * c.k + x] * c.a[(s * c.r + q) * c.k + x];
      for (const auto& v : u) EXPECT_NEAR(v[i * ucols + col], want, 1e-4 * (1 + std::fabs(want)));
    }
  // Too many splits for k is an error, not a silent empty range.
  const Problem bad = Problem::of(t, 16, l::LoraShrinkProblem{.m = 9, .k = 64, .r = 8, .splits = 2});
  EXPECT_EQ(f.check_problem(f.heuristic(bad), bad).code(), Code::invalid_argument);
}

TEST(LoraSplits, CoverTheSmsWithinLimits) {
  EXPECT_EQ(l::shrink_splits(16384, 4096, 16, 1, 132), 1);  // 256 row tiles cover 132 SMs
  EXPECT_EQ(l::shrink_splits(8192, 4096, 16, 1, 132), 2);   // 128 do not
  EXPECT_EQ(l::shrink_splits(16, 4096, 16, 1, 132), 16);
  EXPECT_EQ(l::shrink_splits(16, 128, 16, 1, 132), 2);  // one per 64-column step of K
  EXPECT_EQ(l::shrink_splits(1, 8, 1, 1, 132), 1);
  for (std::int64_t m : {1, 16, 100, 4096})
    for (std::int64_t k : {8, 264, 4096})
      for (std::int64_t r : {1, 64, 128}) {
        const auto s = l::shrink_splits(m, k, r, 3, 132);
        EXPECT_GE(s, 1);
        EXPECT_LE(s, std::min<std::int64_t>(16, (k + 63) / 64));
      }
}

TEST(LoraHeuristic, PicksCatalogVariants) {
  for (const char* name : {"lora_shrink", "lora_gemm"}) {
    const Family& f = fam(name);
    const auto cat = f.catalog();
    for (std::uint8_t cc : {80, 86, 90})
      for (DType t : {DType::f16, DType::bf16})
        for (Problem p : f.benchmark_problems(t)) {
          // t (the core path's operand) is for sm_90a only: ops ask for it there (core_path).
          const bool with_t = std::string(name) == "lora_gemm" ? p.as<l::LoraGemmProblem>().t == 1
                                                                : p.as<l::LoraShrinkProblem>().t == 1;
          if (with_t && cc != 90) continue;
          p.cc = cc;
          p.sm_count = cc == 90 ? 132 : cc == 80 ? 108 : 84;
          const Params v = f.heuristic(p);
          EXPECT_TRUE(std::find(cat.begin(), cat.end(), v) != cat.end()) << name << " " << v.canonical();
          EXPECT_TRUE(f.check_problem(v, p).ok()) << name << " " << v.canonical() << ": " << f.check_problem(v, p).to_string();
          EXPECT_FALSE(f.tuning_space(p).empty());
          if (std::string(name) == "lora_gemm") {
            const bool decode = cc == 90 && !with_t && p.as<l::LoraGemmProblem>().m <= 64;
            EXPECT_EQ(*v.get_str("path"), with_t ? "core" : decode ? "decode" : cc == 90 ? "wgmma" : "mma");
          } else {
            EXPECT_EQ(*v.get_str("output"), with_t ? "t" : "partials");
          }
        }
  }
  // The core path and t go together: a variant of the other kind is refused.
  const Family& gemm = fam("lora_gemm");
  Problem pt = Problem::of(DType::bf16, 16, l::LoraGemmProblem{.m = 8192, .n = 4096, .k = 4096, .r = 16, .t = 1});
  pt.cc = 90;
  Problem pu = pt;
  pu.set(l::LoraGemmProblem{.m = 8192, .n = 4096, .k = 4096, .r = 16, .splits = 2});
  EXPECT_EQ(gemm.check_problem(gemm.heuristic(pu), pt).code(), Code::invalid_argument);
  EXPECT_EQ(gemm.check_problem(gemm.heuristic(pt), pu).code(), Code::invalid_argument);
  // Its tile divides the slice ends: 128 x 256 at gate_up 11008 + 11008, not at 11008 + 11072.
  Problem ps = Problem::of(DType::bf16, 16, l::LoraGemmProblem{.m = 4096, .n = 22016, .k = 4096, .r = 16, .slices = 2,
                                                               .t = 1, .n1 = 11008});
  ps.cc = 90;
  EXPECT_EQ(*gemm.heuristic(ps).get_int("bn"), 256);
  ps.set(l::LoraGemmProblem{.m = 4096, .n = 22080, .k = 4096, .r = 16, .slices = 2, .t = 1, .n1 = 11072});
  EXPECT_EQ(11072 % *gemm.heuristic(ps).get_int("bn"), 0);
  EXPECT_TRUE(gemm.check_problem(gemm.heuristic(ps), ps).ok());
  Params wide = gemm.heuristic(ps);
  wide.set("bn", std::int64_t(256));
  wide.set("stages", std::int64_t(4));
  EXPECT_EQ(gemm.check_problem(wide, ps).code(), Code::invalid_argument);
  // Which calls take it.
  EXPECT_TRUE(l::core_path(90, 8192, 16, 0, 1, 0, 0));
  EXPECT_FALSE(l::core_path(80, 8192, 16, 0, 1, 0, 0));    // not sm_90a
  EXPECT_FALSE(l::core_path(90, 16, 16, 0, 1, 0, 0));      // decode: split shrink
  EXPECT_FALSE(l::core_path(90, 8192, 12, 0, 1, 0, 0));    // B rows of 24 bytes
  EXPECT_FALSE(l::core_path(90, 8192, 16, 1, 1, 0, 0));    // several adapters
  EXPECT_FALSE(l::core_path(90, 8192, 16, 0, 3, 64, 100)); // a slice end off the 64-column grid
  // Decode-sized rows take the decode path on sm_90: the smallest tile height holding them, and the
  // widest split whose CTAs fit the SMs with at least 4 k-steps each; sm_80 keeps mma.
  const Family& g = fam("lora_gemm");
  auto decode_pick = [&](std::int64_t m, std::int64_t n, std::int64_t k, std::uint8_t cc = 90) {
    Problem p = Problem::of(DType::bf16, 16, l::LoraGemmProblem{.m = m, .n = n, .k = k, .r = 16});
    p.cc = cc;
    p.sm_count = 132;
    return g.heuristic(p);
  };
  const Params small = decode_pick(16, 4096, 4096);
  EXPECT_EQ(*small.get_str("path"), "decode");
  EXPECT_EQ(*small.get_int("bm"), 16);
  EXPECT_EQ(*small.get_int("split"), 8);  // 32 tiles x 8 = 256 CTAs, two per SM
  EXPECT_EQ(*decode_pick(20, 4096, 4096).get_int("bm"), 32);
  EXPECT_EQ(*decode_pick(64, 4096, 4096).get_int("bm"), 64);
  EXPECT_EQ(*decode_pick(16, 14336, 4096).get_int("split"), 2);  // 112 tiles
  EXPECT_EQ(*decode_pick(16, 28672, 4096).get_int("split"), 1);  // 224 tiles
  EXPECT_EQ(*decode_pick(16, 1024, 4096).get_int("split"), 8);
  EXPECT_EQ(*decode_pick(16, 1024, 512).get_int("split"), 2);    // 8 k-steps: 4 a CTA
  EXPECT_EQ(*decode_pick(65, 4096, 4096).get_str("path"), "wgmma");
  // The shrink's decode pick: a split's 4 k-steps in one stage of a 32-row tile.
  const Params shrink16 = fam("lora_shrink").heuristic(
      Problem::of(DType::bf16, 16, l::LoraShrinkProblem{.m = 16, .k = 4096, .r = 16, .splits = 16}));
  EXPECT_EQ(*shrink16.get_int("bm"), 32);
  EXPECT_EQ(*shrink16.get_int("ksub"), 4);
  // Its adapter passes spread over z at decode sizes (16 rows in 16 splits over 16 adapters: one pass
  // per block, 256 blocks on 132 SMs), not for one adapter nor at prefill sizes.
  auto shrink_z = [&](l::LoraShrinkProblem q) {
    Problem p = Problem::of(DType::bf16, 16, q);
    p.cc = 90;
    p.sm_count = 132;
    const Family& f = fam("lora_shrink");
    return f.geometry(f.heuristic(p), p).grid.z;
  };
  EXPECT_EQ(shrink_z({.m = 16, .k = 4096, .r = 64, .adapters = 16, .splits = 16, .multi = 1}), 16u);
  EXPECT_EQ(shrink_z({.m = 16, .k = 4096, .r = 64, .adapters = 4, .splits = 16, .multi = 1}), 4u);
  EXPECT_EQ(shrink_z({.m = 16, .k = 4096, .r = 64, .splits = 16}), 1u);
  EXPECT_EQ(shrink_z({.m = 8192, .k = 4096, .r = 64, .adapters = 16, .splits = 2, .multi = 1}), 1u);
  // lora_gemm starts while the shrink runs (its kernels wait for it first).
  EXPECT_TRUE(g.programmatic_launch());
  EXPECT_FALSE(fam("lora_shrink").programmatic_launch());
  EXPECT_EQ(*decode_pick(16, 4096, 4096, 80).get_str("path"), "mma");
  const Params big = g.heuristic(Problem::of(DType::bf16, 16, l::LoraGemmProblem{.m = 8192, .n = 4096, .k = 4096, .r = 16}));
  EXPECT_EQ(*big.get_int("bn"), 256);
}

TEST_F(LoraCpu, TypedErrorsBeforeAnythingResolves) {
  std::vector<std::uint16_t> x(64 * 64 + 16), w(64 * 64 + 16), a(2 * 32 * 64 + 16), b(2 * 32 * 16 + 16),
      o(64 * 64 + 16);
  std::vector<float> xf(64 * 64), sc(2, 1.0f);
  std::vector<std::int32_t> idx(8, 0), rk(2, 16);
  const DType t = DType::bf16;
  auto lin = [&](TensorView xv, TensorView wv, TensorView av, TensorView bv, TensorView ov, double s = 1.0) {
    return lora_linear(xv, wv, av, bv, nullptr, ov, s, 0, 0, nullptr, rt_.get());
  };
  const TensorView X = host(x.data(), t, {8, 64}), W = host(w.data(), t, {32, 64}), A = host(a.data(), t, {16, 64}),
                   B = host(b.data(), t, {32, 16}), O = host(o.data(), t, {8, 32});
  ASSERT_TRUE(lin(X, W, A, B, O).ok());
  const std::uint64_t resolved_after_ok = rt_->counters().module_loads;
  EXPECT_EQ(resolved_after_ok, 0u);
  expect(lin(host(xf.data(), DType::f32, {8, 64}), W, A, B, O), Code::unsupported_dtype, "f32 x");
  expect(lin(X, host(w.data(), DType::f16, {32, 64}), A, B, O), Code::unsupported_dtype, "f16 weight");
  expect(lin(X, host(w.data(), t, {32, 56}), A, B, O), Code::shape_mismatch, "weight k");
  expect(lin(X, W, host(a.data(), t, {16, 56}), B, O), Code::shape_mismatch, "lora_a k");
  expect(lin(X, W, A, host(b.data(), t, {32, 5}), O), Code::shape_mismatch, "lora_a rows not slices x r");
  expect(lin(X, W, A, host(b.data(), t, {32, 4}), O), Code::shape_mismatch, "4 slices");
  ASSERT_TRUE(lin(X, W, A, host(b.data(), t, {32, 8}), O).ok());  // 2 slices of rank 8
  expect(lora_linear(X, W, A, B, nullptr, O, 1.0, 8, 0, nullptr, rt_.get()), Code::invalid_argument,
         "slice ends with one slice");
  expect(lora_linear(X, W, A, host(b.data(), t, {32, 8}), nullptr, O, 1.0, 40, 0, nullptr, rt_.get()),
         Code::invalid_argument, "slice end past n");
  expect(lin(X, W, A, B, host(o.data(), t, {8, 31})), Code::shape_mismatch, "out columns");
  expect(lin(host(x.data(), t, {8, 60}), host(w.data(), t, {32, 60}), host(a.data(), t, {16, 60}), B, O),
         Code::shape_mismatch, "k not a multiple of 8");
  expect(lin(X, W, host(a.data(), t, {129, 64}), host(b.data(), t, {32, 129}), O), Code::shape_mismatch, "rank 129");
  expect(lin(TensorView::contiguous(reinterpret_cast<char*>(x.data()) + 2, t, {8, 64}, Device::cpu()), W, A, B, O),
         Code::invalid_argument, "misaligned x");
  TensorView strided = X;
  strided.strides[0] = 128;
  expect(lin(strided, W, A, B, O), Code::shape_mismatch, "strided x");
  const TensorView bad_bias = host(w.data(), t, {31});
  expect(lora_linear(X, W, A, B, &bad_bias, O, 1.0, 0, 0, nullptr, rt_.get()), Code::shape_mismatch, "bias length");
  expect(lin(X, W, A, B, O, NAN), Code::invalid_argument, "NaN scale");

  const TensorView A3 = host(a.data(), t, {2, 16, 64}), B3 = host(b.data(), t, {2, 32, 8});
  const TensorView I = host(idx.data(), DType::i32, {8}), R = host(rk.data(), DType::i32, {2}),
                   S = host(sc.data(), DType::f32, {2});
  auto multi = [&](TensorView av, TensorView bv, TensorView iv, TensorView rv, TensorView sv, std::int64_t e0 = 0,
                   std::int64_t e1 = 0) {
    return lora_linear_multi(X, W, av, bv, iv, rv, sv, nullptr, O, e0, e1, nullptr, rt_.get());
  };
  ASSERT_TRUE(multi(A3, B3, I, R, S).ok());  // 2 slices of rank 8
  expect(multi(A3, B3, host(idx.data(), DType::i32, {7}), R, S), Code::shape_mismatch, "indices length");
  expect(multi(A3, B3, host(sc.data(), DType::f32, {8}), R, S), Code::unsupported_dtype, "f32 indices");
  expect(multi(A3, B3, I, host(rk.data(), DType::i32, {1}), S), Code::shape_mismatch, "ranks length");
  expect(multi(A3, B3, I, R, host(rk.data(), DType::i32, {2})), Code::unsupported_dtype, "i32 scales");
  expect(multi(host(a.data(), t, {2, 12, 64}), B3, I, R, S), Code::shape_mismatch, "A rows not slices x r");
  expect(multi(host(a.data(), t, {2, 32, 64}), host(b.data(), t, {2, 32, 8}), I, R, S), Code::shape_mismatch,
         "4 slices");
  expect(multi(A3, B3, I, R, S, 40, 0), Code::invalid_argument, "slice end past n");
  expect(multi(host(a.data(), t, {2, 24, 64}), B3, I, R, S, 20, 10), Code::invalid_argument, "decreasing ends");
  expect(multi(host(a.data(), t, {1, 16, 64}), B3, I, R, S), Code::shape_mismatch, "adapters of A and B differ");
}

TEST(LoraDecl, OpsAreDeclaredWithShapes) {
  for (const char* name : {"lora_linear", "lora_linear_multi"}) {
    const OpDecl* op = Registry::global().find_op(name);
    ASSERT_NE(op, nullptr) << name;
    EXPECT_TRUE(op->check().ok()) << name;
  }
  const OpDecl& op = *Registry::global().find_op("lora_linear");
  const TensorView x = TensorView::contiguous(nullptr, DType::bf16, {2, 5, 64}, Device::cpu());
  const TensorView w = TensorView::contiguous(nullptr, DType::bf16, {96, 64}, Device::cpu());
  const TensorView a = TensorView::contiguous(nullptr, DType::bf16, {8, 64}, Device::cpu());
  const TensorView b = TensorView::contiguous(nullptr, DType::bf16, {96, 8}, Device::cpu());
  const TensorView* ts[6] = {&x, &w, &a, &b, nullptr, nullptr};
  const OpValue sc[1] = {{.f64 = 1.0}};
  OpCall c{.tensors = ts, .scalars = sc};
  OutputShape out[1];
  ASSERT_TRUE(op.infer(c, out).ok());
  EXPECT_EQ(out[0].rank, 3);
  EXPECT_EQ(out[0].shape[2], 96);
  EXPECT_EQ(out[0].dtype, DType::bf16);
}

}  // namespace
}  // namespace kiln
