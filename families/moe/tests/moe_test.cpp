// The MoE families on the CPU: routing against implementations written here (softmax top-k by a
// full sort, DeepSeek-V3's group-limited sigmoid top-k by explicit group ranking), the stable
// counting sort, gather and combine, the grouped GEMM in its three layouts against per-expert
// loops (experts without tokens, one expert with every token, ragged sizes, offsets that are not
// well formed read as the kernels read them), the heuristic's picks being catalog variants, and
// every typed error before anything resolves. NVRTC compiles of every catalog variant for sm_80
// and sm_90a run in tests/conformance (CatalogCompiles).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "common/fp8.h"
#include "common/half.h"
#include "families/moe/moe.h"
#include "families/moe/ops.h"
#include "kiln/op.h"
#include "kiln/runtime.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

namespace m = families::moe;

const Family& fam(const char* name) { return *Registry::global().find(name); }

class MoeOps : public ::testing::Test {
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
  std::vector<std::uint16_t> bf16s(std::size_t n, float sd = 1.0f) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<std::uint16_t> v(n + 8);
    for (auto& e : v) e = float_to_bf16(d(rng_));
    return v;
  }
  static TensorView host(void* p, DType t, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(p, t, shape, Device::cpu());
  }
  testing::TempDir dir_;
  std::shared_ptr<Runtime> rt_;
  unsigned seed_ = 0;
  std::mt19937 rng_;
};

TEST_F(MoeOps, SoftmaxTopkMatchesAFullSort) {
  const std::int64_t tokens = 23, experts = 16;
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> logits(tokens * experts);
  for (auto& v : logits) v = d(rng_);
  // A tie in every token: expert 3 repeats expert 11's logit (the lower index wins).
  for (std::int64_t t = 0; t < tokens; ++t) logits[t * experts + 3] = logits[t * experts + 11];
  for (std::int64_t k : {1, 2, 8})
    for (bool renorm : {false, true}) {
      std::vector<float> w(tokens * k);
      std::vector<std::int32_t> ids(tokens * k);
      ASSERT_TRUE(moe_topk(host(logits.data(), DType::f32, {tokens, experts}), nullptr,
                           host(w.data(), DType::f32, {tokens, k}), host(ids.data(), DType::i32, {tokens, k}),
                           MoeScoring::softmax, renorm, 1, 1, 1.0, nullptr, rt_.get())
                      .ok());
      for (std::int64_t t = 0; t < tokens; ++t) {
        const float* row = &logits[t * experts];
        std::vector<int> order(experts);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
        double mx = *std::max_element(row, row + experts), z = 0, picked = 0;
        for (std::int64_t e = 0; e < experts; ++e) z += std::exp(row[e] - mx);
        for (std::int64_t j = 0; j < k; ++j) picked += std::exp(row[order[j]] - mx) / z;
        for (std::int64_t j = 0; j < k; ++j) {
          EXPECT_EQ(ids[t * k + j], order[j]) << "seed " << seed_ << " token " << t << " slot " << j;
          const double p = std::exp(row[order[j]] - mx) / z;
          EXPECT_NEAR(w[t * k + j], renorm ? p / picked : p, 1e-6);
        }
      }
    }
}

TEST_F(MoeOps, SigmoidGroupTopkKeepsTheBestGroups) {
  // 8 experts in 4 groups of 2; keep 2 groups, pick 2. Expert 0 has the single best choice, but
  // its group (0, 1) sums lower than groups (4, 5) and (6, 7): it must not be picked.
  const std::int64_t experts = 8;
  std::vector<float> logits = {3.0f, -6.0f, -1.0f, -1.0f, 1.0f, 1.5f, 0.5f, 0.2f};
  std::vector<float> bias = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  std::vector<float> w(2);
  std::vector<std::int32_t> ids(2);
  const TensorView bv = host(bias.data(), DType::f32, {experts});
  ASSERT_TRUE(moe_topk(host(logits.data(), DType::f32, {1, experts}), &bv, host(w.data(), DType::f32, {1, 2}),
                       host(ids.data(), DType::i32, {1, 2}), MoeScoring::sigmoid_group, true, 4, 2, 2.5, nullptr,
                       rt_.get())
                  .ok());
  auto sig = [](double x) { return 1 / (1 + std::exp(-x)); };
  EXPECT_EQ(ids[0], 5);
  EXPECT_EQ(ids[1], 4);
  const double s5 = sig(1.5), s4 = sig(1.0);
  EXPECT_NEAR(w[0], s5 / (s5 + s4) * 2.5, 1e-6);
  EXPECT_NEAR(w[1], s4 / (s5 + s4) * 2.5, 1e-6);
  // The bias moves the ranking but not the weights: expert 6 overtakes 4, its weight is sigmoid(0.5).
  bias[6] = 0.5f;
  ASSERT_TRUE(moe_topk(host(logits.data(), DType::f32, {1, experts}), &bv, host(w.data(), DType::f32, {1, 2}),
                       host(ids.data(), DType::i32, {1, 2}), MoeScoring::sigmoid_group, false, 4, 2, 1.0, nullptr,
                       rt_.get())
                  .ok());
  EXPECT_EQ(ids[0], 6);
  EXPECT_EQ(ids[1], 5);
  EXPECT_NEAR(w[0], sig(0.5), 1e-6);
  EXPECT_NEAR(w[1], sig(1.5), 1e-6);
}

TEST_F(MoeOps, SigmoidGroupTopkMatchesAnExplicitGroupRanking) {
  const std::int64_t tokens = 17, experts = 64, n_group = 8, topk_group = 3, k = 6, gsize = experts / n_group;
  std::normal_distribution<float> d(0.0f, 1.5f);
  std::vector<float> logits(tokens * experts), bias(experts);
  for (auto& v : logits) v = d(rng_);
  for (auto& v : bias) v = d(rng_) * 0.1f;
  std::vector<float> w(tokens * k);
  std::vector<std::int32_t> ids(tokens * k);
  const TensorView bv = host(bias.data(), DType::f32, {experts});
  ASSERT_TRUE(moe_topk(host(logits.data(), DType::f32, {tokens, experts}), &bv, host(w.data(), DType::f32, {tokens, k}),
                       host(ids.data(), DType::i32, {tokens, k}), MoeScoring::sigmoid_group, true, n_group, topk_group,
                       2.5, nullptr, rt_.get())
                  .ok());
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<double> s(experts), c(experts);
    for (std::int64_t e = 0; e < experts; ++e) {
      s[e] = 1 / (1 + std::exp(-double(logits[t * experts + e])));
      c[e] = s[e] + bias[e];
    }
    std::vector<std::pair<double, std::int64_t>> groups;
    for (std::int64_t g = 0; g < n_group; ++g) {
      std::vector<double> v(c.begin() + g * gsize, c.begin() + (g + 1) * gsize);
      std::sort(v.rbegin(), v.rend());
      groups.push_back({-(v[0] + v[1]), g});
    }
    std::sort(groups.begin(), groups.end());
    std::vector<std::pair<double, std::int64_t>> cand;
    for (std::int64_t j = 0; j < topk_group; ++j)
      for (std::int64_t e = groups[j].second * gsize; e < (groups[j].second + 1) * gsize; ++e) cand.push_back({-c[e], e});
    std::sort(cand.begin(), cand.end());
    double sum = 0;
    for (std::int64_t j = 0; j < k; ++j) sum += s[cand[j].second];
    for (std::int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(ids[t * k + j], cand[j].second) << "seed " << seed_ << " token " << t;
      EXPECT_NEAR(w[t * k + j], s[cand[j].second] / sum * 2.5, 1e-5);
    }
  }
}

TEST_F(MoeOps, PermuteIsAStableSortAndCombineUndoesIt) {
  const std::int64_t tokens = 37, hidden = 24, experts = 5;
  auto x = bf16s(std::size_t(tokens * hidden));
  for (std::int64_t k : {1, 2, 8}) {
    // Expert 2 gets nothing; with k = 1 expert 4 takes every token (the skewed extreme).
    std::vector<std::int32_t> ids(tokens * k);
    std::uniform_int_distribution<int> pick(0, int(experts) - 1);
    for (auto& v : ids) {
      do v = pick(rng_);
      while (v == 2);
    }
    if (k == 1) std::fill(ids.begin(), ids.end(), 4);
    const std::int64_t n = tokens * k;
    std::vector<std::uint16_t> xs(n * hidden + 8);
    std::vector<std::int32_t> offsets(experts + 1), row_of(n), src_of(n);
    ASSERT_TRUE(moe_permute(host(x.data(), DType::bf16, {tokens, hidden}), host(ids.data(), DType::i32, {tokens, k}),
                            host(xs.data(), DType::bf16, {n, hidden}), host(offsets.data(), DType::i32, {experts + 1}),
                            host(row_of.data(), DType::i32, {tokens, k}), host(src_of.data(), DType::i32, {n}),
                            nullptr, rt_.get())
                    .ok());
    EXPECT_EQ(offsets[0], 0);
    EXPECT_EQ(offsets[experts], n);
    EXPECT_EQ(offsets[3], offsets[2]) << "expert 2 has no tokens";
    std::int64_t r = 0;
    for (std::int64_t e = 0; e < experts; ++e)
      for (std::int64_t i = 0; i < n; ++i)
        if (ids[i] == e) {
          // Expert order, entry order within an expert.
          EXPECT_EQ(row_of[i], r);
          EXPECT_EQ(src_of[r], i);
          for (std::int64_t c = 0; c < hidden; ++c) EXPECT_EQ(xs[r * hidden + c], x[(i / k) * hidden + c]);
          ++r;
        }
    // combine with weights 1 / k gives x back (k copies of each row, summed in fp32).
    std::vector<float> w(n, 1.0f / float(k));
    std::vector<std::uint16_t> back(tokens * hidden + 8);
    const TensorView wv = host(w.data(), DType::f32, {tokens, k});
    ASSERT_TRUE(moe_combine(host(xs.data(), DType::bf16, {n, hidden}), host(row_of.data(), DType::i32, {tokens, k}), &wv,
                            host(back.data(), DType::bf16, {tokens, hidden}), nullptr, rt_.get())
                    .ok());
    for (std::int64_t i = 0; i < tokens * hidden; ++i)
      EXPECT_NEAR(bf16_to_float(back[i]), bf16_to_float(x[i]), std::fabs(bf16_to_float(x[i])) / 128 + 1e-6);
  }
}

TEST_F(MoeOps, GatherAndCombineMatchTheirDefinitions) {
  const std::int64_t tokens = 9, k = 3, hidden = 16, rows = tokens * k;
  auto y = bf16s(std::size_t(rows * hidden));
  std::vector<std::int32_t> row_of(rows), src_of(rows);
  std::iota(row_of.begin(), row_of.end(), 0);
  std::shuffle(row_of.begin(), row_of.end(), rng_);
  for (std::int64_t i = 0; i < rows; ++i) src_of[row_of[i]] = std::int32_t(i);
  src_of[rows - 1] = -1;  // a row past the last entry: zeros
  std::vector<float> w(rows);
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  for (auto& v : w) v = u(rng_);
  const TensorView wv = host(w.data(), DType::f32, {tokens, k});
  std::vector<std::uint16_t> out(tokens * hidden + 8), g(rows * hidden + 8);
  ASSERT_TRUE(moe_combine(host(y.data(), DType::bf16, {rows, hidden}), host(row_of.data(), DType::i32, {tokens, k}), &wv,
                          host(out.data(), DType::bf16, {tokens, hidden}), nullptr, rt_.get())
                  .ok());
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t c = 0; c < hidden; ++c) {
      double want = 0;
      for (std::int64_t j = 0; j < k; ++j) want += w[t * k + j] * double(bf16_to_float(y[row_of[t * k + j] * hidden + c]));
      EXPECT_NEAR(bf16_to_float(out[t * hidden + c]), want, std::fabs(want) / 128 + 1e-6);
    }
  // gather: row r is token src_of[r] / k's row of y (read as x [tokens, hidden]) times w[src_of[r]].
  ASSERT_TRUE(moe_gather(host(y.data(), DType::bf16, {tokens, hidden}), host(src_of.data(), DType::i32, {rows}), &wv,
                         host(g.data(), DType::bf16, {rows, hidden}), k, nullptr, rt_.get())
                  .ok());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < hidden; ++c) {
      const std::int64_t s = src_of[r];
      const float want = s < 0 ? 0.0f : bf16_to_float(y[(s / k) * hidden + c]) * w[s];
      EXPECT_EQ(g[r * hidden + c], float_to_bf16(want)) << r << "," << c;
    }
}

// Per-expert loops in fp64 over the rows [lo, hi) of each expert.
void naive_grouped(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& w, std::int64_t n,
                   std::int64_t k, const std::vector<std::int64_t>& lo, const std::vector<std::int64_t>& hi,
                   std::vector<double>& out) {
  for (std::size_t e = 0; e < lo.size(); ++e)
    for (std::int64_t r = lo[e]; r < hi[e]; ++r)
      for (std::int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (std::int64_t x = 0; x < k; ++x)
          s += double(bf16_to_float(a[r * k + x])) * bf16_to_float(w[(std::int64_t(e) * n + j) * k + x]);
        out[r * n + j] = s;
      }
}

TEST_F(MoeOps, GroupedGemmContiguousAndMaskedMatchPerExpertLoops) {
  const std::int64_t experts = 6, n = 20, k = 24;
  // Ragged counts: an empty expert, one larger than a tile's worth would suggest, one of a row.
  const std::vector<std::int32_t> counts = {5, 0, 13, 1, 0, 7};
  std::vector<std::int32_t> offs(experts);
  std::partial_sum(counts.begin(), counts.end(), offs.begin());
  const std::int64_t mm = offs.back() + 3;  // three trailing rows no expert owns
  auto a = bf16s(std::size_t(mm * k)), w = bf16s(std::size_t(experts * n * k), 0.5f);
  std::vector<std::uint16_t> out(mm * n + 8, 0x7FC0);
  ASSERT_TRUE(grouped_gemm(host(a.data(), DType::bf16, {mm, k}), host(w.data(), DType::bf16, {experts, n, k}),
                           host(offs.data(), DType::i32, {experts}), host(out.data(), DType::bf16, {mm, n}), nullptr,
                           rt_.get())
                  .ok());
  std::vector<std::int64_t> lo(experts), hi(experts);
  for (std::int64_t e = 0; e < experts; ++e) {
    lo[e] = e ? offs[e - 1] : 0;
    hi[e] = offs[e];
  }
  std::vector<double> want(mm * n, NAN);
  naive_grouped(a, w, n, k, lo, hi, want);
  for (std::int64_t i = 0; i < mm * n; ++i) {
    if (i >= offs.back() * n) {
      EXPECT_EQ(out[i], 0x7FC0) << "row " << i / n << " belongs to no expert and must stay unwritten";
      continue;
    }
    EXPECT_EQ(out[i], float_to_bf16(float(want[i]))) << i;
  }
  // Masked: the same experts, each in its own max_tokens rows.
  const std::int64_t max_t = 16;
  auto am = bf16s(std::size_t(experts * max_t * k));
  std::vector<std::uint16_t> outm(experts * max_t * n + 8, 0x7FC0);
  ASSERT_TRUE(grouped_gemm_masked(host(am.data(), DType::bf16, {experts, max_t, k}),
                                  host(w.data(), DType::bf16, {experts, n, k}), host((void*)counts.data(), DType::i32, {experts}),
                                  host(outm.data(), DType::bf16, {experts, max_t, n}), nullptr, rt_.get())
                  .ok());
  for (std::int64_t e = 0; e < experts; ++e) {
    lo[e] = e * max_t;
    hi[e] = e * max_t + counts[e];
  }
  std::vector<double> wantm(experts * max_t * n, NAN);
  naive_grouped(am, w, n, k, lo, hi, wantm);
  for (std::int64_t i = 0; i < experts * max_t * n; ++i) {
    const std::int64_t e = i / (max_t * n), r = (i / n) % max_t;
    if (r >= counts[e])
      EXPECT_EQ(outm[i], 0x7FC0) << "expert " << e << " row " << r;
    else
      EXPECT_EQ(outm[i], float_to_bf16(float(wantm[i]))) << i;
  }
}

TEST_F(MoeOps, GroupedGemmDgradReadsTheWeightAsStored) {
  const std::int64_t experts = 4, n = 16, k = 24;  // weight [experts, k, n]
  const std::vector<std::int32_t> offs = {3, 3, 10, 11};
  const std::int64_t mm = 12;  // row 11 belongs to no expert: not written
  auto a = bf16s(std::size_t(mm * k)), w = bf16s(std::size_t(experts * k * n));
  std::vector<std::uint16_t> out(mm * n, 0x7FC0);
  ASSERT_TRUE(grouped_gemm_dgrad(host(a.data(), DType::bf16, {mm, k}), host(w.data(), DType::bf16, {experts, k, n}),
                                 host((void*)offs.data(), DType::i32, {experts}), host(out.data(), DType::bf16, {mm, n}),
                                 nullptr, rt_.get())
                  .ok());
  for (std::int64_t e = 0; e < experts; ++e)
    for (std::int64_t r = e ? offs[e - 1] : 0; r < offs[e]; ++r)
      for (std::int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (std::int64_t x = 0; x < k; ++x)
          s += double(bf16_to_float(a[r * k + x])) * bf16_to_float(w[(e * k + x) * n + j]);
        EXPECT_EQ(out[r * n + j], float_to_bf16(float(s))) << e << " " << r << " " << j;
      }
  for (std::int64_t j = 0; j < n; ++j) EXPECT_EQ(out[11 * n + j], 0x7FC0) << "row past offs[-1] written";
  // The weight's middle dimension is a's k; n a multiple of 8.
  expect(grouped_gemm_dgrad(host(a.data(), DType::bf16, {mm, k}), host(w.data(), DType::bf16, {experts, n, k}),
                            host((void*)offs.data(), DType::i32, {experts}), host(out.data(), DType::bf16, {mm, k}),
                            nullptr, rt_.get()),
         Code::shape_mismatch, "k mismatch");
  expect(grouped_gemm_dgrad(host(a.data(), DType::bf16, {mm, 16}), host(w.data(), DType::bf16, {experts, 16, 12}),
                            host((void*)offs.data(), DType::i32, {experts}), host(out.data(), DType::bf16, {mm, 12}),
                            nullptr, rt_.get()),
         Code::shape_mismatch, "n not a multiple of 8");
}

TEST_F(MoeOps, GroupedGemmWgradIsPerExpertTransposedProducts) {
  const std::int64_t experts = 4, n = 16, k = 8;
  const std::vector<std::int32_t> offs = {3, 3, 10, 11};  // expert 1 empty: zeros
  const std::int64_t mm = 12;
  auto a = bf16s(std::size_t(mm * n)), b = bf16s(std::size_t(mm * k));
  std::vector<std::uint16_t> out(experts * n * k + 8, 0x7FC0);
  ASSERT_TRUE(grouped_gemm_wgrad(host(a.data(), DType::bf16, {mm, n}), host(b.data(), DType::bf16, {mm, k}),
                                 host((void*)offs.data(), DType::i32, {experts}),
                                 host(out.data(), DType::bf16, {experts, n, k}), nullptr, rt_.get())
                  .ok());
  for (std::int64_t e = 0; e < experts; ++e)
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < k; ++j) {
        double s = 0;
        for (std::int64_t r = e ? offs[e - 1] : 0; r < offs[e]; ++r)
          s += double(bf16_to_float(a[r * n + i])) * bf16_to_float(b[r * k + j]);
        EXPECT_EQ(out[(e * n + i) * k + j], float_to_bf16(float(s))) << e << " " << i << " " << j;
      }
}

TEST_F(MoeOps, GroupedGemmFp8AppliesRowwiseScalesPerExpert) {
  const std::int64_t experts = 3, n = 10, k = 32;
  const std::vector<std::int32_t> offs = {4, 4, 9};
  const std::int64_t mm = 11;
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<std::uint8_t> a(mm * k), w(experts * n * k);
  for (auto& v : a) v = float_to_e4m3(d(rng_));
  for (auto& v : w) v = float_to_e4m3(d(rng_));
  std::vector<float> sa(mm), sb(experts * n);
  std::uniform_real_distribution<float> u(0.25f, 2.0f);
  for (auto& v : sa) v = u(rng_);
  for (auto& v : sb) v = u(rng_);
  alignas(16) std::uint16_t out[mm * n];
  std::fill(out, out + mm * n, std::uint16_t(0x7FC0));
  ASSERT_TRUE(grouped_gemm_fp8(host(a.data(), DType::u8, {mm, k}), host(w.data(), DType::u8, {experts, n, k}),
                               host((void*)offs.data(), DType::i32, {experts}), host(sa.data(), DType::f32, {mm}),
                               host(sb.data(), DType::f32, {experts, n}), host(out, DType::bf16, {mm, n}), nullptr,
                               rt_.get())
                  .ok());
  for (std::int64_t r = 0; r < mm; ++r) {
    const std::int64_t e = r < 4 ? 0 : r < 9 ? 2 : -1;
    for (std::int64_t j = 0; j < n; ++j) {
      if (e < 0) {
        EXPECT_EQ(out[r * n + j], 0x7FC0) << "row " << r << " belongs to no expert";
        continue;
      }
      double s = 0;
      for (std::int64_t x = 0; x < k; ++x) s += double(e4m3_to_float(a[r * k + x])) * e4m3_to_float(w[(e * n + j) * k + x]);
      EXPECT_EQ(out[r * n + j], float_to_bf16(float(s * sa[r] * sb[e * n + j]))) << r << " " << j;
    }
  }
  // Block scales: a_scale [m, k/128], b_scale [experts, n/128, k/128]; k = 160 spans two k-blocks,
  // the second partial.
  {
    const std::int64_t kk = 160, kb = 2;
    std::vector<std::uint8_t> a2(mm * kk), w2(experts * n * kk);
    for (auto& v : a2) v = float_to_e4m3(d(rng_));
    for (auto& v : w2) v = float_to_e4m3(d(rng_));
    std::vector<float> sa2(mm * kb), sb2(experts * 1 * kb);
    for (auto& v : sa2) v = u(rng_);
    for (auto& v : sb2) v = u(rng_);
    std::fill(out, out + mm * n, std::uint16_t(0x7FC0));
    ASSERT_TRUE(grouped_gemm_fp8(host(a2.data(), DType::u8, {mm, kk}), host(w2.data(), DType::u8, {experts, n, kk}),
                                 host((void*)offs.data(), DType::i32, {experts}), host(sa2.data(), DType::f32, {mm, kb}),
                                 host(sb2.data(), DType::f32, {experts, 1, kb}), host(out, DType::bf16, {mm, n}),
                                 nullptr, rt_.get())
                    .ok());
    for (std::int64_t r = 0; r < 9; ++r) {
      const std::int64_t e = r < 4 ? 0 : 2;
      for (std::int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (std::int64_t blk = 0; blk < kb; ++blk) {
          double part = 0;
          for (std::int64_t x = blk * 128; x < std::min(kk, (blk + 1) * 128); ++x)
            part += double(e4m3_to_float(a2[r * kk + x])) * e4m3_to_float(w2[(e * n + j) * kk + x]);
          s += part * sa2[r * kb + blk] * sb2[e * kb + blk];
        }
        EXPECT_EQ(out[r * n + j], float_to_bf16(float(s))) << r << " " << j;
      }
    }
    EXPECT_EQ(out[9 * n], 0x7FC0) << "rows past the last expert stay unwritten";
    expect(grouped_gemm_fp8(host(a2.data(), DType::u8, {mm, kk}), host(w2.data(), DType::u8, {experts, n, kk}),
                            host((void*)offs.data(), DType::i32, {experts}), host(sa2.data(), DType::f32, {mm, kb}),
                            host(sb2.data(), DType::f32, {experts, kb}), host(out, DType::bf16, {mm, n}), nullptr,
                            rt_.get()),
           Code::shape_mismatch, "block b_scale without its n blocks");
  }
  // k must be a multiple of 16; a must be u8; the masked a_scale is per expert and row.
  expect(grouped_gemm_fp8(host(a.data(), DType::u8, {mm, 8}), host(w.data(), DType::u8, {experts, n, 8}),
                          host((void*)offs.data(), DType::i32, {experts}), host(sa.data(), DType::f32, {mm}),
                          host(sb.data(), DType::f32, {experts, n}), host(out, DType::bf16, {mm, n}), nullptr, rt_.get()),
         Code::shape_mismatch, "k not a multiple of 16");
  expect(grouped_gemm_fp8(host(out, DType::bf16, {mm, k}), host(w.data(), DType::u8, {experts, n, k}),
                          host((void*)offs.data(), DType::i32, {experts}), host(sa.data(), DType::f32, {mm}),
                          host(sb.data(), DType::f32, {experts, n}), host(out, DType::bf16, {mm, n}), nullptr, rt_.get()),
         Code::unsupported_dtype, "bf16 a");
  expect(grouped_gemm_fp8_masked(host(a.data(), DType::u8, {experts, 2, k}), host(w.data(), DType::u8, {experts, n, k}),
                                 host((void*)offs.data(), DType::i32, {experts}), host(sa.data(), DType::f32, {experts * 2}),
                                 host(sb.data(), DType::f32, {experts, n}), host(out, DType::bf16, {experts, 2, n}),
                                 nullptr, rt_.get()),
         Code::shape_mismatch, "masked a_scale shape");
}

TEST_F(MoeOps, FusedMoeForwardMatchesAnFp64Layer) {
  const std::int64_t tokens = 9, hidden = 16, inter = 8, experts = 4;
  for (std::int64_t k : {1, 2, 4}) {
    auto x = bf16s(std::size_t(tokens * hidden)), wgu = bf16s(std::size_t(experts * 2 * inter * hidden), 0.3f),
         wd = bf16s(std::size_t(experts * hidden * inter), 0.3f);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> logits(tokens * experts);
    for (auto& v : logits) v = d(rng_);
    std::vector<std::uint16_t> out(tokens * hidden + 8);
    ASSERT_TRUE(fused_moe(host(x.data(), DType::bf16, {tokens, hidden}), host(logits.data(), DType::f32, {tokens, experts}),
                          host(wgu.data(), DType::bf16, {experts, 2 * inter, hidden}),
                          host(wd.data(), DType::bf16, {experts, hidden, inter}), host(out.data(), DType::bf16, {tokens, hidden}),
                          k, Activation::silu, true, nullptr, rt_.get())
                    .ok());
    double num = 0, den = 0;
    for (std::int64_t t = 0; t < tokens; ++t) {
      const float* l = &logits[t * experts];
      std::vector<int> order(experts);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
      double picked = 0;
      for (std::int64_t j = 0; j < k; ++j) picked += std::exp(double(l[order[j]]));
      for (std::int64_t c = 0; c < hidden; ++c) {
        double want = 0;
        for (std::int64_t j = 0; j < k; ++j) {
          const std::int64_t e = order[j];
          double y = 0;
          for (std::int64_t i = 0; i < inter; ++i) {
            double g = 0, u = 0;
            for (std::int64_t q = 0; q < hidden; ++q) {
              const double xv = bf16_to_float(x[t * hidden + q]);
              g += xv * bf16_to_float(wgu[(e * 2 * inter + i) * hidden + q]);
              u += xv * bf16_to_float(wgu[(e * 2 * inter + inter + i) * hidden + q]);
            }
            y += g / (1 + std::exp(-g)) * u * bf16_to_float(wd[(e * hidden + c) * inter + i]);
          }
          want += std::exp(double(l[e])) / picked * y;
        }
        const double got = bf16_to_float(out[t * hidden + c]);
        num += (got - want) * (got - want);
        den += want * want;
      }
    }
    EXPECT_LT(std::sqrt(num / den), 2e-2) << "top_k " << k << " seed " << seed_;
  }
  std::vector<std::uint16_t> x(64), w(1024), out(64);
  std::vector<float> l(16);
  expect(fused_moe(host(x.data(), DType::bf16, {4, 16}), host(l.data(), DType::f32, {4, 4}),
                   host(w.data(), DType::bf16, {4, 16, 16}), host(w.data(), DType::bf16, {4, 16, 4}),
                   host(out.data(), DType::bf16, {4, 16}), 2, Activation::silu, true, nullptr, rt_.get()),
         Code::shape_mismatch, "w_gate_up rows are not 2 inter");
  expect(fused_moe(host(x.data(), DType::bf16, {4, 16}), host(l.data(), DType::f32, {4, 4}),
                   host(w.data(), DType::bf16, {4, 16, 16}), host(w.data(), DType::bf16, {4, 16, 8}),
                   host(out.data(), DType::bf16, {4, 16}), 5, Activation::silu, true, nullptr, rt_.get()),
         Code::invalid_argument, "top_k > experts");
}

TEST(MoeFamilies, ExpertRowsReadAnyOffsetsAsTheKernelsDo) {
  std::vector<std::int64_t> lo, hi;
  // Decreasing and out-of-range offsets: the running maximum clamped to [0, m].
  const std::vector<std::int32_t> offs = {4, 2, -1, 9, 30, 7};
  m::expert_rows(offs.data(), 6, 20, m::k_contiguous, lo, hi);
  EXPECT_EQ(lo, (std::vector<std::int64_t>{0, 4, 4, 4, 9, 20}));
  EXPECT_EQ(hi, (std::vector<std::int64_t>{4, 4, 4, 9, 20, 20}));
  m::expert_rows(offs.data(), 6, 8, m::k_masked, lo, hi);
  EXPECT_EQ(lo, (std::vector<std::int64_t>{0, 8, 16, 24, 32, 40}));
  EXPECT_EQ(hi, (std::vector<std::int64_t>{4, 10, 16, 32, 40, 47}));
}

Problem grouped_problem(std::int64_t mm, std::int64_t n, std::int64_t k, std::int64_t e, m::Layout l, int cc,
                        DType t = DType::bf16) {
  Problem p = Problem::of(t, 16, m::GroupedGemmProblem{.m = mm, .n = n, .k = k, .experts = e, .layout = l});
  p.cc = std::uint8_t(cc);
  p.sm_count = cc == 90 ? 132 : 108;
  return p;
}

TEST(MoeFamilies, HeuristicPicksCatalogVariantsForStandardShapes) {
  const Family& g = fam("grouped_gemm");
  const auto catalog = g.catalog();
  for (int cc : {80, 86, 90})
    for (DType t : {DType::f16, DType::bf16})
      for (const Problem& base : g.benchmark_problems(t)) {
        Problem p = base;
        p.cc = std::uint8_t(cc);
        p.sm_count = cc == 90 ? 132 : 108;
        const Params h = g.heuristic(p);
        EXPECT_NE(std::find(catalog.begin(), catalog.end(), h), catalog.end()) << h.canonical() << " cc " << cc;
        EXPECT_TRUE(g.check_problem(h, p).ok()) << h.canonical() << ": " << g.check_problem(h, p).to_string();
        const bool wgmma = *h.get_str("path") == "wgmma";
        EXPECT_EQ(wgmma, cc == 90) << h.canonical();
      }
  // Decode (16 rows per expert) takes 64-row tiles; prefill (Mixtral gate_up with k 4096, Mixtral
  // down with k 14336, the input gradient) the cooperative schedule on 128 x 256 tiles.
  EXPECT_EQ(*g.heuristic(grouped_problem(16, 4096, 7168, 256, m::k_masked, 90)).get_int("bm"), 64);
  const Params gate_up = g.heuristic(grouped_problem(8 * 4096, 28672, 4096, 8, m::k_contiguous, 90));
  EXPECT_EQ(*gate_up.get_str("schedule"), "cooperative");
  EXPECT_EQ(*gate_up.get_int("bm"), 128);
  EXPECT_EQ(*gate_up.get_int("bn"), 256);
  const Params down = g.heuristic(grouped_problem(8 * 4096, 4096, 14336, 8, m::k_contiguous, 90));
  EXPECT_EQ(*down.get_str("schedule"), "cooperative");
  EXPECT_EQ(*down.get_int("bn"), 256);
  EXPECT_EQ(*g.heuristic(grouped_problem(8 * 4096, 14336, 4096, 8, m::k_dgrad, 90)).get_str("schedule"),
            "cooperative");
  EXPECT_EQ(*g.heuristic(grouped_problem(8 * 4096, 28672, 4096, 8, m::k_masked, 90)).get_str("schedule"),
            "cooperative");
  // Every other family's heuristic is in its catalog (grouped_gemm_fp8: on sm_90a, its only arch).
  for (const char* name : {"moe_topk", "moe_sort", "moe_gather", "moe_combine", "grouped_gemm_fp8"}) {
    const Family& f = fam(name);
    const auto cat = f.catalog();
    for (DType t : {DType::f32, DType::f16, DType::bf16})
      for (const Problem& p : f.benchmark_problems(t)) {
        const Params h = f.heuristic(p);
        EXPECT_NE(std::find(cat.begin(), cat.end(), h), cat.end()) << name << " " << h.canonical();
        EXPECT_TRUE(f.check_problem(h, p).ok()) << name << ": " << f.check_problem(h, p).to_string();
      }
  }
}

TEST(MoeFamilies, GroupedGemmRulesAndGeometry) {
  const Family& g = fam("grouped_gemm");
  const Params wg = g.heuristic(grouped_problem(4096, 4096, 7168, 8, m::k_contiguous, 90));
  EXPECT_FALSE(g.check_problem(wg, grouped_problem(4096, 4096, 7168, 8, m::k_contiguous, 80)).ok())
      << "wgmma needs sm_90a";
  EXPECT_FALSE(g.check_problem(wg, grouped_problem(4096, 4096, 7168, 8, m::k_masked, 90)).ok()) << "layout mismatch";
  EXPECT_EQ(g.check_problem(wg, grouped_problem(4096, 4096, 7164, 8, m::k_contiguous, 90)).code(), Code::shape_mismatch);
  EXPECT_EQ(g.check_problem(wg, grouped_problem(4096, 4096, 7168, 2000, m::k_contiguous, 90)).code(),
            Code::shape_mismatch);
  // The weight gradient runs on wgmma too: 128 x 256 tiles of out[e] where they cover the SMs.
  const Params wgrad = g.heuristic(grouped_problem(8 * 4096, 4096, 14336, 8, m::k_kgrouped, 90));
  EXPECT_EQ(*wgrad.get_str("path"), "wgmma");
  EXPECT_EQ(*wgrad.get_int("bn"), 256);
  EXPECT_EQ(*g.heuristic(grouped_problem(1000, 392, 264, 8, m::k_kgrouped, 90)).get_int("bn"), 128);
  EXPECT_EQ(g.check_problem(wgrad, grouped_problem(8 * 4096, 4092, 14336, 8, m::k_kgrouped, 90)).code(),
            Code::shape_mismatch)
      << "kgrouped rows of a must be 16-byte multiples";
  Params bad = g.heuristic(grouped_problem(4096, 4096, 7168, 8, m::k_contiguous, 80));
  bad.set("bn", std::int64_t(256));
  EXPECT_FALSE(g.validate(bad).ok()) << "mma takes bn <= 128";
  // The persistent wgmma grid never exceeds the SMs; mma covers every unit the layout may have.
  const Problem p = grouped_problem(8 * 4096, 28672, 4096, 8, m::k_contiguous, 90);
  EXPECT_EQ(g.geometry(g.heuristic(p), p).grid.x, 132u);
  const Problem q = grouped_problem(1000, 392, 264, 8, m::k_contiguous, 80);
  const Params hq = g.heuristic(q);
  const auto bm = *hq.get_int("bm"), bn = *hq.get_int("bn");
  EXPECT_EQ(g.geometry(hq, q).grid.x, std::uint32_t(((1000 + bm - 1) / bm + 8) * ((392 + bn - 1) / bn)));
  // The wgmma variant packs three tensor maps: a's rows, every expert's weight rows and the
  // output's rows (boxes of 16 rows, for the staged epilogue).
  ArgPack args;
  std::vector<void*> ptrs = {reinterpret_cast<void*>(4096), reinterpret_cast<void*>(8192),
                             reinterpret_cast<void*>(12288), reinterpret_cast<void*>(16384)};
  g.pack_args(wg, p, ptrs, args);
  ASSERT_EQ(args.tensor_maps(), 3u);
  EXPECT_EQ(args.tensor_map_request(0).rows, 8u * 4096);
  EXPECT_EQ(args.tensor_map_request(1).rows, 8u * 28672);
  EXPECT_EQ(args.tensor_map_request(1).row_bytes, 4096u * 2);
  EXPECT_EQ(args.tensor_map_request(2).base, ptrs[3]);
  EXPECT_EQ(args.tensor_map_request(2).rows, 8u * 4096);
  EXPECT_EQ(args.tensor_map_request(2).row_bytes, 28672u * 2);
  EXPECT_EQ(args.tensor_map_request(2).box_rows, 16u);
  {
    // n not a multiple of 8: the kernel stores directly; a's map stands in for the output's.
    const Problem odd = grouped_problem(8 * 4096, 28668, 4096, 8, m::k_contiguous, 90);
    ArgPack oargs;
    g.pack_args(g.heuristic(odd), odd, ptrs, oargs);
    ASSERT_EQ(oargs.tensor_maps(), 3u);
    EXPECT_EQ(oargs.tensor_map_request(2).base, ptrs[0]);
  }
  // The dgrad layout views every expert's [k, n] weight as experts x k rows of n.
  const Problem dq = grouped_problem(8 * 4096, 14336, 4096, 8, m::k_dgrad, 90);
  ArgPack dargs;
  g.pack_args(g.heuristic(dq), dq, ptrs, dargs);
  ASSERT_EQ(dargs.tensor_maps(), 3u);
  EXPECT_EQ(dargs.tensor_map_request(1).rows, 8u * 4096);
  EXPECT_EQ(dargs.tensor_map_request(1).row_bytes, 14336u * 2);
  EXPECT_EQ(dargs.tensor_map_request(1).box_rows, 64u);
  // kgrouped: out [experts, n, k] as experts x n rows of k for the staged epilogue.
  const Problem kq = grouped_problem(8 * 4096, 4096, 14336, 8, m::k_kgrouped, 90);
  ArgPack kargs;
  g.pack_args(g.heuristic(kq), kq, ptrs, kargs);
  ASSERT_EQ(kargs.tensor_maps(), 3u);
  EXPECT_EQ(kargs.tensor_map_request(2).base, ptrs[3]);
  EXPECT_EQ(kargs.tensor_map_request(2).rows, 8u * 4096);
  EXPECT_EQ(kargs.tensor_map_request(2).row_bytes, 14336u * 2);
}

TEST(MoeFamilies, PingpongScheduleRules) {
  const Family& g = fam("grouped_gemm");
  const Problem p = grouped_problem(8 * 4096, 28672, 4096, 8, m::k_contiguous, 90);
  // bf16 prefill takes the cooperative 128 x 256 tile at every k.
  const Params coop = g.heuristic(p);
  EXPECT_EQ(*coop.get_str("schedule"), "cooperative");
  EXPECT_EQ(*coop.get_int("bn"), 256);
  EXPECT_EQ(*g.heuristic(grouped_problem(8 * 4096, 14336, 4096, 8, m::k_dgrad, 90)).get_str("schedule"), "cooperative");
  Params pp = coop;
  pp.set("schedule", "pingpong").set("bn", std::int64_t(128));
  EXPECT_TRUE(g.validate(pp).ok());
  EXPECT_EQ(g.geometry(pp, p).block.x, 384u) << "a producer and two consumer warpgroups";
  Params bad = pp;
  bad.set("bn", std::int64_t(256));
  EXPECT_EQ(g.validate(bad).code(), Code::invalid_argument) << "128 x 256 is two warpgroups' accumulators";
  bad = pp;
  bad.set("path", "mma");
  EXPECT_EQ(g.validate(bad).code(), Code::invalid_argument) << "mma has no pingpong schedule";
  bad = pp;
  bad.set("layout", "kgrouped");
  EXPECT_EQ(g.validate(bad).code(), Code::invalid_argument) << "kgrouped has no pingpong schedule";
  // FP8: rowwise prefill takes pingpong up to k 4096, block scales, longer k and decode the
  // cooperative schedule.
  const Family& f8 = fam("grouped_gemm_fp8");
  auto fp8 = [](std::int64_t mm, std::int64_t k, std::int64_t e, std::int64_t scaling) {
    Problem q = Problem::of(DType::bf16, 16,
                            m::GroupedGemmFp8Problem{.m = mm, .n = 4096, .k = k, .experts = e,
                                                     .layout = m::k_contiguous, .scaling = scaling});
    q.cc = 90;
    q.sm_count = 132;
    return q;
  };
  EXPECT_EQ(*f8.heuristic(fp8(8 * 4096, 4096, 8, m::k_fp8_rowwise)).get_str("schedule"), "pingpong");
  EXPECT_EQ(*f8.heuristic(fp8(8 * 4096, 14336, 8, m::k_fp8_rowwise)).get_str("schedule"), "cooperative");
  EXPECT_EQ(*f8.heuristic(fp8(8 * 4096, 14336, 8, m::k_fp8_block)).get_str("schedule"), "cooperative");
  EXPECT_EQ(*f8.heuristic(fp8(256 * 16, 7168, 256, m::k_fp8_rowwise)).get_str("schedule"), "cooperative");
  Params blockpp = f8.heuristic(fp8(8 * 4096, 14336, 8, m::k_fp8_block));
  blockpp.set("schedule", "pingpong");
  EXPECT_EQ(f8.validate(blockpp).code(), Code::invalid_argument) << "block scales keep two accumulator sets";
  // Every pingpong variant instantiates the pingpong kernel (its launch has 384 threads).
  for (const Family* f : {&g, &f8})
    for (const Params& v : f->catalog()) {
      const auto r = f->render(v);
      ASSERT_TRUE(r.ok()) << v.canonical();
      const std::string& name = r->name_expression;
      const bool pp = *v.get_str("schedule") == "pingpong";
      EXPECT_EQ(name.size() > 7 && name.compare(name.size() - 7, 7, ", true>") == 0, pp) << v.canonical() << ": " << name;
    }
}

TEST(MoeFamilies, OpsAreDeclared) {
  for (const char* name : {"moe_topk", "moe_permute", "moe_gather", "moe_combine", "grouped_gemm", "grouped_gemm_masked",
                           "grouped_gemm_dgrad", "grouped_gemm_wgrad", "grouped_gemm_fp8", "grouped_gemm_fp8_masked",
                           "fused_moe"}) {
    const OpDecl* op = Registry::global().find_op(name);
    ASSERT_NE(op, nullptr) << name;
    EXPECT_TRUE(op->check().ok()) << name << ": " << op->check().to_string();
  }
}

TEST_F(MoeOps, EveryErrorBeforeAnythingResolves) {
  const std::int64_t tokens = 4, experts = 8, hidden = 16, k = 2;
  std::vector<float> logits(tokens * experts, 0.5f), w(tokens * k), bias(experts);
  std::vector<std::int32_t> ids(tokens * k, 1), row_of(tokens * k), src_of(tokens * k), offsets(experts + 1);
  auto x = bf16s(std::size_t(tokens * hidden));
  std::vector<std::uint16_t> xs(tokens * k * hidden + 8);
  const TensorView lv = host(logits.data(), DType::f32, {tokens, experts});
  const TensorView wv = host(w.data(), DType::f32, {tokens, k}), iv = host(ids.data(), DType::i32, {tokens, k});
  auto topk = [&](const TensorView& l, const TensorView* b, MoeScoring s, std::int64_t ng, std::int64_t tg,
                  const TensorView& ww, const TensorView& ii) {
    return moe_topk(l, b, ww, ii, s, true, ng, tg, 1.0, nullptr, rt_.get());
  };
  const TensorView bv = host(bias.data(), DType::f32, {experts});
  expect(topk(lv, nullptr, MoeScoring::sigmoid_group, 2, 1, wv, iv), Code::invalid_argument, "sigmoid without bias");
  expect(topk(lv, &bv, MoeScoring::sigmoid_group, 3, 1, wv, iv), Code::invalid_argument, "n_group not dividing");
  expect(topk(lv, &bv, MoeScoring::sigmoid_group, 4, 5, wv, iv), Code::invalid_argument, "topk_group > n_group");
  expect(topk(lv, nullptr, static_cast<MoeScoring>(7), 1, 1, wv, iv), Code::invalid_argument, "scoring");
  std::vector<float> w9(tokens * 9);
  std::vector<std::int32_t> i9(tokens * 9);
  expect(topk(lv, nullptr, MoeScoring::softmax, 1, 1, host(w9.data(), DType::f32, {tokens, 9}),
              host(i9.data(), DType::i32, {tokens, 9})),
         Code::invalid_argument, "top_k > experts");
  expect(topk(lv, nullptr, MoeScoring::softmax, 1, 1, host(w.data(), DType::f32, {tokens, k}),
              host(ids.data(), DType::i32, {tokens + 1, k - 1})),
         Code::shape_mismatch, "ids shape");
  auto iv16 = iv;
  iv16.dtype = DType::f32;
  expect(topk(lv, nullptr, MoeScoring::softmax, 1, 1, wv, iv16), Code::unsupported_dtype, "ids not i32");
  auto lg = lv;
  lg.device = Device::cuda(0);
  expect(topk(lg, nullptr, MoeScoring::softmax, 1, 1, wv, iv), Code::device_error, "mixed devices");

  auto permute = [&](const TensorView& idv, std::int64_t e) {
    std::vector<std::int32_t> off(e + 1);
    return moe_permute(host(x.data(), DType::bf16, {tokens, hidden}), idv, host(xs.data(), DType::bf16, {tokens * k, hidden}),
                       host(off.data(), DType::i32, {e + 1}), host(row_of.data(), DType::i32, {tokens, k}),
                       host(src_of.data(), DType::i32, {tokens * k}), nullptr, rt_.get());
  };
  ids[3] = int(experts);
  expect(permute(iv, experts), Code::invalid_argument, "expert id out of range");
  ids[3] = -1;
  expect(permute(iv, experts), Code::invalid_argument, "negative expert id");
  ids[3] = 1;
  expect(permute(host(ids.data(), DType::i32, {tokens, k, 1}), experts), Code::shape_mismatch, "ids rank");
  expect(permute(iv, 2000), Code::shape_mismatch, "too many experts");

  const std::int64_t mm = 10, n = 16, kk = 8;
  auto a = bf16s(mm * kk), wt = bf16s(experts * n * kk);
  std::vector<std::uint16_t> out(mm * n + 8);
  std::vector<std::int32_t> offs = {1, 2, 3, 4, 5, 6, 7, 10};
  auto gg = [&](const TensorView& av, const TensorView& wtv, const TensorView& ov) {
    return grouped_gemm(av, wtv, host(offs.data(), DType::i32, {experts}), ov, nullptr, rt_.get());
  };
  const TensorView av = host(a.data(), DType::bf16, {mm, kk}), wtv = host(wt.data(), DType::bf16, {experts, n, kk});
  const TensorView ov = host(out.data(), DType::bf16, {mm, n});
  offs[3] = 1;
  expect(gg(av, wtv, ov), Code::invalid_argument, "decreasing offsets");
  offs[3] = 4;
  offs[7] = 11;
  expect(gg(av, wtv, ov), Code::invalid_argument, "offsets past the rows");
  offs[7] = 10;
  expect(gg(av, host(wt.data(), DType::bf16, {experts, n, kk + 8}), ov), Code::shape_mismatch, "k mismatch");
  expect(gg(av, wtv, host(out.data(), DType::bf16, {mm, n - 1})), Code::shape_mismatch, "out shape");
  expect(gg(host(a.data(), DType::bf16, {mm / 2, 2 * kk - 4}), host(wt.data(), DType::bf16, {experts, n, 2 * kk - 4}),
            host(out.data(), DType::bf16, {mm / 2, n})),
         Code::shape_mismatch, "k not a multiple of 8");
  auto af = av;
  af.dtype = DType::f16;
  expect(gg(af, wtv, ov), Code::unsupported_dtype, "mixed dtypes");
  auto a32 = av, w32 = wtv, o32 = ov;
  a32.dtype = w32.dtype = o32.dtype = DType::f32;
  expect(gg(a32, w32, o32), Code::unsupported_dtype, "f32");
  expect(gg(host(a.data() + 1, DType::bf16, {mm, kk}), wtv, ov), Code::invalid_argument, "misaligned a");
  auto og = ov;
  og.device = Device::cuda(0);
  expect(gg(av, wtv, og), Code::device_error, "mixed devices");
  std::vector<std::int32_t> counts(experts, 3);
  counts[2] = 6;
  std::vector<std::uint16_t> am(experts * 5 * kk), outm(experts * 5 * n);
  expect(grouped_gemm_masked(host(am.data(), DType::bf16, {experts, 5, kk}), wtv, host(counts.data(), DType::i32, {experts}),
                             host(outm.data(), DType::bf16, {experts, 5, n}), nullptr, rt_.get()),
         Code::invalid_argument, "count past max_tokens");
  std::vector<std::uint16_t> bw(mm * 12), ow(experts * n * 12);
  expect(grouped_gemm_wgrad(av, host(bw.data(), DType::bf16, {mm, 12}), host(offs.data(), DType::i32, {experts}),
                            host(ow.data(), DType::bf16, {experts, kk, 12}), nullptr, rt_.get()),
         Code::shape_mismatch, "wgrad k not a multiple of 8");
}

}  // namespace
}  // namespace kiln
