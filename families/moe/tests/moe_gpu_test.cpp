// The MoE families on the GPU against their CPU references (the same typed ops on host copies,
// fp64 accumulation): fresh random data every run, outputs poisoned (NaN bytes) before each
// launch, so a row the kernel should write and does not fails, and a row it must leave alone
// (past the last expert, past a masked count) must still hold the poison. Routing patterns:
// balanced, Zipf-skewed, one expert taking every token, experts with no tokens; top-k 1, 2, 8;
// token counts that are not multiples of any tile; both arch paths where the device has them
// (mma.sync also runs on sm_90), and a persistent wgmma grid of 3 CTAs walking many units.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "common/fp8.h"
#include "common/half.h"
#include "families/moe/moe.h"
#include "families/moe/ops.h"
#include "jit/device_info.h"
#include "jit/tune_launch.h"
#include "kiln/ops.h"
#include "tests/gpu_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;
namespace m = families::moe;

const jit::Driver* drv() { return jit::Driver::get().value(); }

enum class Routing { balanced, zipf, one_expert, sparse };
const char* routing_name(Routing r) {
  return r == Routing::balanced ? "balanced" : r == Routing::zipf ? "zipf" : r == Routing::one_expert ? "one" : "sparse";
}

class MoeGpu : public testing::GpuFixture {
 protected:
  void SetUp() override {
    GpuFixture::SetUp();
    if (IsSkipped()) return;
    cc_ = jit::device_info(0).value()->compute_capability;
    sms_ = jit::device_info(0).value()->sm_count;
  }
  // A device copy of host bytes; out buffers are poisoned.
  struct Dev {
    std::unique_ptr<DeviceBuffer> buf;
    std::size_t bytes;
  };
  Dev up(const void* data, std::size_t bytes) {
    Dev d{std::make_unique<DeviceBuffer>(bytes), bytes};
    if (bytes) d.buf->upload(data);
    return d;
  }
  Dev poisoned(std::size_t bytes) {
    Dev d{std::make_unique<DeviceBuffer>(bytes), bytes};
    if (bytes) d.buf->poison();
    return d;
  }
  std::vector<unsigned char> down(const Dev& d) {
    EXPECT_EQ(drv()->ctx_synchronize(), CUDA_SUCCESS);
    std::vector<unsigned char> out(d.bytes);
    if (d.bytes) d.buf->download(out.data());
    return out;
  }
  static TensorView gpu(const Dev& d, DType t, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(d.buf->get(), t, shape, Device::cuda(0));
  }
  static TensorView host(void* p, DType t, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(p, t, shape, Device::cpu());
  }
  // top_k distinct experts per token drawn by the pattern.
  std::vector<std::int32_t> route(Routing r, std::int64_t tokens, std::int64_t k, std::int64_t experts) {
    std::vector<double> weight(std::size_t(experts), 1.0);
    for (std::int64_t e = 0; e < experts; ++e) {
      if (r == Routing::zipf) weight[e] = 1.0 / double(e + 1);
      if (r == Routing::sparse && e % 3 != 0) weight[e] = 0.0;  // two experts in three get nothing
    }
    if (r == Routing::sparse && experts / 3 + 1 < k) std::fill(weight.begin(), weight.end(), 1.0);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens * k));
    for (std::int64_t t = 0; t < tokens; ++t) {
      std::vector<double> w = weight;
      for (std::int64_t j = 0; j < k; ++j) {
        std::int32_t e;
        if (r == Routing::one_expert) {
          e = std::int32_t(j);  // expert 0 takes every token's first slot
        } else {
          std::discrete_distribution<int> pick(w.begin(), w.end());
          e = pick(rng_);
        }
        w[e] = 0.0;
        ids[t * k + j] = e;
      }
    }
    return ids;
  }
  std::vector<std::uint16_t> halfs(DType t, std::int64_t n, float sd) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<std::uint16_t> v(static_cast<std::size_t>(n));
    for (auto& e : v) e = t == DType::bf16 ? float_to_bf16(d(rng_)) : float_to_f16(d(rng_));
    return v;
  }
  // Launches grouped_gemm `params` on device buffers (a, b, offs, out); sms > 0 bounds the
  // persistent grid.
  void launch_grouped(const Params& params, Problem p, const std::vector<void*>& ptrs, int sms = 0) {
    p.cc = std::uint8_t(cc_);
    p.sm_count = std::uint16_t(sms > 0 ? sms : sms_);
    const Family& f = *Registry::global().find("grouped_gemm");
    ASSERT_TRUE(f.check_problem(params, p).ok()) << params.canonical() << ": " << f.check_problem(params, p).to_string();
    auto k = rt_->kernel(KernelSpec{"grouped_gemm", params});
    ASSERT_TRUE(k.ok()) << k.status().to_string();
    const Status s = sms > 0 ? jit::launch_candidate(f, params, p, static_cast<CUfunction>((*k)->function), ptrs)
                             : rt_->launch(**k, p, ptrs, nullptr);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(drv()->ctx_synchronize(), CUDA_SUCCESS);
  }
  int cc_ = 0, sms_ = 0;
};

// Relative L2 error over the elements of `rows` (0xFFFF poison compared as NaN), and the rows the
// reference left unwritten (NaN there) must be NaN in got as well.
void compare_rows(const std::vector<std::uint16_t>& got, const std::vector<std::uint16_t>& want, DType t,
                  std::int64_t cols, const std::string& what) {
  double num = 0, den = 0;
  std::int64_t stray = 0, missing = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = load_as_double(got.data(), t, std::int64_t(i)), w = load_as_double(want.data(), t, std::int64_t(i));
    if (std::isnan(w)) {
      stray += !std::isnan(g);
      continue;
    }
    if (std::isnan(g)) {
      ++missing;
      continue;
    }
    num += (g - w) * (g - w);
    den += w * w;
  }
  EXPECT_EQ(missing, 0) << what << ": elements the kernel never wrote (" << cols << " per row)";
  EXPECT_EQ(stray, 0) << what << ": elements written outside every expert's rows";
  EXPECT_LE(den == 0 ? std::sqrt(num) : std::sqrt(num / den), testing::tolerance(t)) << what;
}

TEST_F(MoeGpu, SoftmaxTopkMatchesTheReference) {
  for (std::int64_t experts : {8, 128, 256})
    for (std::int64_t k : {1, 2, 8})
      for (DType t : {DType::f32, DType::bf16}) {
        if (k > experts) continue;
        const std::int64_t tokens = 1001;
        // Distinct logits per token, exact in bf16 (multiples of 1/8 below 16): the selection
        // is unambiguous, so ids must match exactly.
        std::vector<float> logits(static_cast<std::size_t>(tokens * experts));
        std::vector<int> perm(static_cast<std::size_t>(experts));
        std::iota(perm.begin(), perm.end(), 0);
        for (std::int64_t i = 0; i < tokens; ++i) {
          std::shuffle(perm.begin(), perm.end(), rng_);
          for (std::int64_t e = 0; e < experts; ++e) logits[i * experts + e] = float(perm[e] - experts / 2) / 8.0f;
        }
        std::vector<std::uint16_t> l16(logits.size());
        for (std::size_t i = 0; i < l16.size(); ++i) l16[i] = float_to_bf16(logits[i]);
        const void* src = t == DType::f32 ? static_cast<const void*>(logits.data()) : l16.data();
        const std::size_t lbytes = logits.size() * dtype_size(t);
        std::vector<float> w_ref(tokens * k);
        std::vector<std::int32_t> id_ref(tokens * k);
        std::vector<unsigned char> hl(static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + lbytes);
        ASSERT_TRUE(moe_topk(host(hl.data(), t, {tokens, experts}), nullptr, host(w_ref.data(), DType::f32, {tokens, k}),
                             host(id_ref.data(), DType::i32, {tokens, k}), MoeScoring::softmax, true, 1, 1, 1.0, nullptr,
                             rt_.get())
                        .ok());
        Dev dl = up(src, lbytes), dw = poisoned(w_ref.size() * 4), di = poisoned(id_ref.size() * 4);
        ASSERT_TRUE(moe_topk(gpu(dl, t, {tokens, experts}), nullptr, gpu(dw, DType::f32, {tokens, k}),
                             gpu(di, DType::i32, {tokens, k}), MoeScoring::softmax, true, 1, 1, 1.0, nullptr, rt_.get())
                        .ok());
        const auto gw = down(dw), gi = down(di);
        for (std::int64_t i = 0; i < tokens * k; ++i) {
          std::int32_t id;
          float w;
          std::memcpy(&id, gi.data() + 4 * i, 4);
          std::memcpy(&w, gw.data() + 4 * i, 4);
          ASSERT_EQ(id, id_ref[i]) << "experts " << experts << " k " << k << " entry " << i << " seed " << seed_;
          ASSERT_NEAR(w, w_ref[i], 1e-5 * std::max(1.0f, std::fabs(w_ref[i]))) << i;
        }
      }
}

TEST_F(MoeGpu, SigmoidGroupTopkMatchesTheReference) {
  const std::int64_t tokens = 777, experts = 256, n_group = 8, topk_group = 4, k = 8;
  std::vector<float> logits(static_cast<std::size_t>(tokens * experts)), bias(static_cast<std::size_t>(experts));
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (auto& v : logits) v = d(rng_);
  for (auto& v : bias) v = d(rng_) * 0.05f;
  std::vector<float> w_ref(tokens * k);
  std::vector<std::int32_t> id_ref(tokens * k);
  const TensorView hb = host(bias.data(), DType::f32, {experts});
  ASSERT_TRUE(moe_topk(host(logits.data(), DType::f32, {tokens, experts}), &hb, host(w_ref.data(), DType::f32, {tokens, k}),
                       host(id_ref.data(), DType::i32, {tokens, k}), MoeScoring::sigmoid_group, true, n_group,
                       topk_group, 2.5, nullptr, rt_.get())
                  .ok());
  Dev dl = up(logits.data(), logits.size() * 4), db = up(bias.data(), bias.size() * 4);
  Dev dw = poisoned(w_ref.size() * 4), di = poisoned(id_ref.size() * 4);
  const TensorView gb = gpu(db, DType::f32, {experts});
  ASSERT_TRUE(moe_topk(gpu(dl, DType::f32, {tokens, experts}), &gb, gpu(dw, DType::f32, {tokens, k}),
                       gpu(di, DType::i32, {tokens, k}), MoeScoring::sigmoid_group, true, n_group, topk_group, 2.5,
                       nullptr, rt_.get())
                  .ok());
  const auto gw = down(dw), gi = down(di);
  // fp32 sigmoid against fp64 may order two choices within a few ulps apart differently: such a
  // token is skipped (and counted); any other difference fails.
  int near_ties = 0;
  for (std::int64_t t = 0; t < tokens; ++t) {
    bool same = true;
    for (std::int64_t j = 0; j < k; ++j) {
      std::int32_t id;
      std::memcpy(&id, gi.data() + 4 * (t * k + j), 4);
      same = same && id == id_ref[t * k + j];
    }
    if (!same) {
      ++near_ties;
      continue;
    }
    for (std::int64_t j = 0; j < k; ++j) {
      float w;
      std::memcpy(&w, gw.data() + 4 * (t * k + j), 4);
      EXPECT_NEAR(w, w_ref[t * k + j], 1e-5) << t << " " << j;
    }
  }
  EXPECT_LE(near_ties, 2) << "seed " << seed_ << ": tokens whose picks differ from the fp64 reference";
}

TEST_F(MoeGpu, PermuteGatherAndCombineMatchTheReference) {
  const std::int64_t tokens = 1001, hidden = 200;
  for (std::int64_t experts : {8, 256})
    for (std::int64_t k : {1, 2, 8})
      for (Routing r : {Routing::balanced, Routing::zipf, Routing::one_expert, Routing::sparse}) {
        const std::string what = std::string(routing_name(r)) + " experts " + std::to_string(experts) + " k " +
                                 std::to_string(k) + " seed " + std::to_string(seed_);
        const std::int64_t n = tokens * k;
        auto ids = route(r, tokens, k, experts);
        auto x = halfs(DType::bf16, tokens * hidden, 1.0f);
        std::vector<std::uint16_t> xs_ref(n * hidden);
        std::vector<std::int32_t> off_ref(experts + 1), row_ref(n), src_ref(n);
        ASSERT_TRUE(moe_permute(host(x.data(), DType::bf16, {tokens, hidden}), host(ids.data(), DType::i32, {tokens, k}),
                                host(xs_ref.data(), DType::bf16, {n, hidden}),
                                host(off_ref.data(), DType::i32, {experts + 1}),
                                host(row_ref.data(), DType::i32, {tokens, k}), host(src_ref.data(), DType::i32, {n}),
                                nullptr, rt_.get())
                        .ok());
        Dev dx = up(x.data(), x.size() * 2), dids = up(ids.data(), ids.size() * 4);
        Dev dxs = poisoned(xs_ref.size() * 2), doff = poisoned(off_ref.size() * 4), drow = poisoned(row_ref.size() * 4),
            dsrc = poisoned(src_ref.size() * 4);
        ASSERT_TRUE(moe_permute(gpu(dx, DType::bf16, {tokens, hidden}), gpu(dids, DType::i32, {tokens, k}),
                                gpu(dxs, DType::bf16, {n, hidden}), gpu(doff, DType::i32, {experts + 1}),
                                gpu(drow, DType::i32, {tokens, k}), gpu(dsrc, DType::i32, {n}), nullptr, rt_.get())
                        .ok());
        auto eq = [&](const Dev& d, const void* want, const char* name) {
          const auto got = down(d);
          EXPECT_EQ(std::memcmp(got.data(), want, got.size()), 0) << name << ": " << what;
        };
        eq(doff, off_ref.data(), "offsets");
        eq(drow, row_ref.data(), "row_of");
        eq(dsrc, src_ref.data(), "src_of");
        eq(dxs, xs_ref.data(), "x_sorted");
        // Combine with random weights, and gather weighted (the combine's gradient).
        std::vector<float> w(n);
        std::uniform_real_distribution<float> u(0.0f, 1.0f);
        for (auto& v : w) v = u(rng_);
        const TensorView hw = host(w.data(), DType::f32, {tokens, k});
        std::vector<std::uint16_t> y_ref(tokens * hidden), g_ref(n * hidden);
        ASSERT_TRUE(moe_combine(host(xs_ref.data(), DType::bf16, {n, hidden}), host(row_ref.data(), DType::i32, {tokens, k}),
                                &hw, host(y_ref.data(), DType::bf16, {tokens, hidden}), nullptr, rt_.get())
                        .ok());
        ASSERT_TRUE(moe_gather(host(x.data(), DType::bf16, {tokens, hidden}), host(src_ref.data(), DType::i32, {n}), &hw,
                               host(g_ref.data(), DType::bf16, {n, hidden}), k, nullptr, rt_.get())
                        .ok());
        Dev dwt = up(w.data(), w.size() * 4), dy = poisoned(y_ref.size() * 2), dg = poisoned(g_ref.size() * 2);
        const TensorView gw = gpu(dwt, DType::f32, {tokens, k});
        ASSERT_TRUE(moe_combine(gpu(dxs, DType::bf16, {n, hidden}), gpu(drow, DType::i32, {tokens, k}), &gw,
                                gpu(dy, DType::bf16, {tokens, hidden}), nullptr, rt_.get())
                        .ok());
        ASSERT_TRUE(moe_gather(gpu(dx, DType::bf16, {tokens, hidden}), gpu(dsrc, DType::i32, {n}), &gw,
                               gpu(dg, DType::bf16, {n, hidden}), k, nullptr, rt_.get())
                        .ok());
        const auto gy = down(dy);
        std::vector<std::uint16_t> y16(y_ref.size());
        std::memcpy(y16.data(), gy.data(), gy.size());
        compare_rows(y16, y_ref, DType::bf16, hidden, "combine " + what);
        eq(dg, g_ref.data(), "gather weighted");
      }
}

TEST_F(MoeGpu, SortDropsIdsOutOfRangeAsTheReference) {
  const std::int64_t n = 3000, experts = 64;
  std::vector<std::int32_t> ids(n);
  std::uniform_int_distribution<int> pick(-3, int(experts) + 2);
  for (auto& v : ids) v = pick(rng_);
  const Family& f = *Registry::global().find("moe_sort");
  const Problem p = Problem::of(DType::f32, 16, m::MoeSortProblem{.n = n, .experts = experts});
  std::vector<std::int32_t> off(experts + 1), row(n), src(n);
  void* hb[4] = {ids.data(), off.data(), row.data(), src.data()};
  ASSERT_TRUE(f.cpu_reference(f.heuristic(p), p, hb).ok());
  Dev di = up(ids.data(), n * 4), doff = poisoned(off.size() * 4), drow = poisoned(n * 4), dsrc = poisoned(n * 4);
  auto k = rt_->kernel(KernelSpec{"moe_sort", f.heuristic(p)});
  ASSERT_TRUE(k.ok()) << k.status().to_string();
  std::vector<void*> ptrs = {di.buf->get(), doff.buf->get(), drow.buf->get(), dsrc.buf->get()};
  ASSERT_TRUE(rt_->launch(**k, p, ptrs, nullptr).ok());
  EXPECT_EQ(std::memcmp(down(doff).data(), off.data(), off.size() * 4), 0);
  EXPECT_EQ(std::memcmp(down(drow).data(), row.data(), row.size() * 4), 0);
  EXPECT_EQ(std::memcmp(down(dsrc).data(), src.data(), src.size() * 4), 0);
}

struct GroupedCase {
  std::int64_t tokens, n, k, experts, top_k;
  int sms;  // 0: the device's
};

// Rows per expert from a routing pattern: counts and their running sums.
struct Grouping {
  std::vector<std::int32_t> counts, offs;
  std::int64_t rows = 0, max_t = 0;
};

// The catalog variants of `family` for a layout (and output type) that run on this device: the
// kernels gpu_run.sh's prewarmed cache holds, every path and tile the heuristic can pick.
std::vector<Params> device_variants(const Family& f, const char* type_key, const std::string& type, int layout, int cc,
                                    const char* scaling = nullptr) {
  std::vector<Params> out;
  const GpuArch arch{cc, cc == 90 ? 'a' : '\0'};
  for (const Params& v : f.catalog())
    if (*v.get_str(type_key) == type && *v.get_str("layout") == (layout == m::k_contiguous ? "contiguous"
                                                                   : layout == m::k_masked  ? "masked"
                                                                   : layout == m::k_dgrad   ? "dgrad"
                                                                                           : "kgrouped") &&
        (!scaling || *v.get_str("scaling") == scaling) && f.runs_on(v, arch))
      out.push_back(v);
  return out;
}

TEST_F(MoeGpu, GroupedGemmMatchesTheReferenceOnEveryLayoutAndPath) {
  const Family& f = *Registry::global().find("grouped_gemm");
  // Sizes that are not multiples of any tile; the last runs a persistent grid of 3 blocks.
  const GroupedCase cases[] = {{333, 136, 264, 8, 2, 0}, {97, 136, 520, 16, 8, 0}, {61, 264, 128, 6, 1, 3}};
  for (const GroupedCase& c : cases)
    for (Routing r : {Routing::balanced, Routing::zipf, Routing::one_expert, Routing::sparse})
      for (DType t : {DType::bf16, DType::f16}) {
        if (t == DType::f16 && (&c != &cases[0] || r != Routing::balanced)) continue;  // f16: one case
        Grouping g;
        g.counts.assign(std::size_t(c.experts), 0);
        for (auto e : route(r, c.tokens, c.top_k, c.experts)) ++g.counts[e];
        g.offs.resize(g.counts.size());
        std::partial_sum(g.counts.begin(), g.counts.end(), g.offs.begin());
        g.rows = c.tokens * c.top_k;
        g.max_t = *std::max_element(g.counts.begin(), g.counts.end()) + 5;
        for (int layout : {m::k_contiguous, m::k_masked, m::k_kgrouped, m::k_dgrad}) {
          const std::int64_t mm = layout == m::k_masked ? g.max_t : g.rows + 7;  // 7 rows no expert owns
          const std::int64_t a_rows = layout == m::k_masked ? c.experts * g.max_t : mm;
          const std::int64_t a_cols = layout == m::k_kgrouped ? c.n : c.k;
          auto a = halfs(t, a_rows * a_cols, 1.0f);
          auto b = halfs(t, layout == m::k_kgrouped ? mm * c.k : c.experts * c.n * c.k, 0.25f);
          const std::vector<std::int32_t>& o = layout == m::k_masked ? g.counts : g.offs;
          const std::int64_t out_n = layout == m::k_kgrouped ? c.experts * c.n * c.k : a_rows * c.n;
          std::vector<std::uint16_t> want(static_cast<std::size_t>(out_n), 0xFFFF);
          const Problem p = Problem::of(
              t, 16, m::GroupedGemmProblem{.m = mm, .n = c.n, .k = c.k, .experts = c.experts, .layout = layout});
          std::vector<void*> hb = {a.data(), b.data(), const_cast<std::int32_t*>(o.data()), want.data()};
          {
            const Status rs = f.cpu_reference(f.heuristic(p), p, hb);
            ASSERT_TRUE(rs.ok()) << rs.to_string();
          }
          Dev da = up(a.data(), a.size() * 2), db = up(b.data(), b.size() * 2), doffs = up(o.data(), o.size() * 4);
          for (const Params& params : device_variants(f, "dtype", dtype_name(t), layout, cc_)) {
            Problem pp = p;
            pp.cc = std::uint8_t(cc_);
            pp.sm_count = std::uint16_t(sms_);
            if (!f.check_problem(params, pp).ok()) continue;  // sm_86's depths on an sm_80, say
            Dev dout = poisoned(std::size_t(out_n) * 2);
            launch_grouped(params, p, {da.buf->get(), db.buf->get(), doffs.buf->get(), dout.buf->get()}, c.sms);
            const auto got = down(dout);
            std::vector<std::uint16_t> g16(want.size());
            std::memcpy(g16.data(), got.data(), got.size());
            compare_rows(g16, want, t, c.n,
                         params.canonical() + " " + routing_name(r) + " tokens " + std::to_string(c.tokens) + " top_k " +
                             std::to_string(c.top_k) + " seed " + std::to_string(seed_));
          }
        }
      }
}

TEST_F(MoeGpu, GroupedGemmFp8MatchesTheReference) {
  const Family& f = *Registry::global().find("grouped_gemm_fp8");
  const GroupedCase cases[] = {{333, 392, 272, 8, 2, 0}, {61, 264, 128, 6, 1, 3}};
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::uniform_real_distribution<float> u(0.25f, 2.0f);
  for (const GroupedCase& c : cases)
    for (Routing r : {Routing::balanced, Routing::zipf, Routing::one_expert, Routing::sparse})
      for (DType t : {DType::bf16, DType::f16}) {
        if (t == DType::f16 && (&c != &cases[0] || r != Routing::balanced)) continue;
        std::vector<std::int32_t> counts(static_cast<std::size_t>(c.experts), 0), offs(counts.size());
        for (auto e : route(r, c.tokens, c.top_k, c.experts)) ++counts[e];
        std::partial_sum(counts.begin(), counts.end(), offs.begin());
        const std::int64_t rows = c.tokens * c.top_k;
        const std::int64_t max_t = *std::max_element(counts.begin(), counts.end()) + 5;
        for (int layout : {m::k_contiguous, m::k_masked})
        for (bool block : {false, true}) {
          const std::int64_t mm = layout == m::k_masked ? max_t : rows + 7;
          const std::int64_t a_rows = layout == m::k_masked ? c.experts * max_t : mm;
          const std::int64_t kb = (c.k + 127) / 128, nb = (c.n + 127) / 128;
          std::vector<std::uint8_t> a(static_cast<std::size_t>(a_rows * c.k)), b(static_cast<std::size_t>(c.experts * c.n * c.k));
          for (auto& v : a) v = float_to_e4m3(d(rng_));
          for (auto& v : b) v = float_to_e4m3(d(rng_) / 4);
          std::vector<float> sa(static_cast<std::size_t>(block ? a_rows * kb : a_rows)),
              sb(static_cast<std::size_t>(block ? c.experts * nb * kb : c.experts * c.n));
          for (auto& v : sa) v = u(rng_);
          for (auto& v : sb) v = u(rng_) / 16;
          const std::vector<std::int32_t>& o = layout == m::k_masked ? counts : offs;
          std::vector<std::uint16_t> want(static_cast<std::size_t>(a_rows * c.n), 0xFFFF);
          const Problem p = Problem::of(t, 16,
                                        m::GroupedGemmFp8Problem{.m = mm, .n = c.n, .k = c.k, .experts = c.experts,
                                                                 .layout = layout,
                                                                 .scaling = block ? m::k_fp8_block : m::k_fp8_rowwise});
          std::vector<void*> hb = {a.data(), b.data(), const_cast<std::int32_t*>(o.data()), sa.data(), sb.data(),
                                   want.data()};
          {
            const Status rs = f.cpu_reference(f.heuristic(p), p, hb);
            ASSERT_TRUE(rs.ok()) << rs.to_string();
          }
          Dev da = up(a.data(), a.size()), db = up(b.data(), b.size()), doffs = up(o.data(), o.size() * 4),
              dsa = up(sa.data(), sa.size() * 4), dsb = up(sb.data(), sb.size() * 4);
          for (const Params& params : device_variants(f, "out", dtype_name(t), layout, cc_, block ? "block" : "rowwise")) {
            Problem pp = p;
            pp.cc = std::uint8_t(cc_);
            pp.sm_count = std::uint16_t(c.sms > 0 ? c.sms : sms_);
            if (!f.check_problem(params, pp).ok()) continue;
            Dev dout = poisoned(want.size() * 2);
            auto k = rt_->kernel(KernelSpec{"grouped_gemm_fp8", params});
            ASSERT_TRUE(k.ok()) << k.status().to_string();
            std::vector<void*> ptrs = {da.buf->get(), db.buf->get(), doffs.buf->get(),
                                       dsa.buf->get(), dsb.buf->get(), dout.buf->get()};
            const Status st = c.sms > 0 ? jit::launch_candidate(f, params, pp, static_cast<CUfunction>((*k)->function), ptrs)
                                        : rt_->launch(**k, pp, ptrs, nullptr);
            ASSERT_TRUE(st.ok()) << st.to_string();
            const auto got = down(dout);
            std::vector<std::uint16_t> g16(want.size());
            std::memcpy(g16.data(), got.data(), got.size());
            compare_rows(g16, want, t, c.n, params.canonical() + " " + routing_name(r) + " seed " + std::to_string(seed_));
          }
        }
      }
}

// The layer's forward as kiln.torch.fused_moe runs it (route, permute, grouped gate_up,
// act_and_mul, grouped down, combine) on the GPU, against the same chain of CPU references.
TEST_F(MoeGpu, MoeForwardChainMatchesTheReference) {
  const std::int64_t tokens = 157, hidden = 256, inter = 136, experts = 8;
  for (std::int64_t k : {1, 2, 8}) {
    auto x = halfs(DType::bf16, tokens * hidden, 1.0f);
    auto wgu = halfs(DType::bf16, experts * 2 * inter * hidden, 0.06f);
    auto wd = halfs(DType::bf16, experts * hidden * inter, 0.08f);
    std::vector<float> logits(tokens * experts);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto& v : logits) v = d(rng_);
    const std::int64_t n = tokens * k;
    // CPU chain.
    std::vector<float> w(n);
    std::vector<std::int32_t> ids(n), off(experts + 1), row(n), src(n);
    std::vector<std::uint16_t> xs(n * hidden), h(n * 2 * inter), act(n * inter), ys(n * hidden), out(tokens * hidden);
    ASSERT_TRUE(moe_topk(host(logits.data(), DType::f32, {tokens, experts}), nullptr, host(w.data(), DType::f32, {tokens, k}),
                         host(ids.data(), DType::i32, {tokens, k}), MoeScoring::softmax, true, 1, 1, 1.0, nullptr, rt_.get())
                    .ok());
    ASSERT_TRUE(moe_permute(host(x.data(), DType::bf16, {tokens, hidden}), host(ids.data(), DType::i32, {tokens, k}),
                            host(xs.data(), DType::bf16, {n, hidden}), host(off.data(), DType::i32, {experts + 1}),
                            host(row.data(), DType::i32, {tokens, k}), host(src.data(), DType::i32, {n}), nullptr, rt_.get())
                    .ok());
    ASSERT_TRUE(grouped_gemm(host(xs.data(), DType::bf16, {n, hidden}), host(wgu.data(), DType::bf16, {experts, 2 * inter, hidden}),
                             host(off.data() + 1, DType::i32, {experts}), host(h.data(), DType::bf16, {n, 2 * inter}),
                             nullptr, rt_.get())
                    .ok());
    ASSERT_TRUE(act_and_mul(host(h.data(), DType::bf16, {n, 2 * inter}), host(act.data(), DType::bf16, {n, inter}),
                            Activation::silu, nullptr, rt_.get())
                    .ok());
    ASSERT_TRUE(grouped_gemm(host(act.data(), DType::bf16, {n, inter}), host(wd.data(), DType::bf16, {experts, hidden, inter}),
                             host(off.data() + 1, DType::i32, {experts}), host(ys.data(), DType::bf16, {n, hidden}),
                             nullptr, rt_.get())
                    .ok());
    const TensorView hw = host(w.data(), DType::f32, {tokens, k});
    ASSERT_TRUE(moe_combine(host(ys.data(), DType::bf16, {n, hidden}), host(row.data(), DType::i32, {tokens, k}), &hw,
                            host(out.data(), DType::bf16, {tokens, hidden}), nullptr, rt_.get())
                    .ok());
    // GPU chain.
    Dev dl = up(logits.data(), logits.size() * 4), dx = up(x.data(), x.size() * 2), dgu = up(wgu.data(), wgu.size() * 2),
        ddn = up(wd.data(), wd.size() * 2);
    Dev dw = poisoned(n * 4), di = poisoned(n * 4), doff = poisoned((experts + 1) * 4), drow = poisoned(n * 4),
        dsrc = poisoned(n * 4), dxs = poisoned(n * hidden * 2), dh = poisoned(n * 2 * inter * 2),
        dact = poisoned(n * inter * 2), dys = poisoned(n * hidden * 2), dout = poisoned(tokens * hidden * 2);
    ASSERT_TRUE(moe_topk(gpu(dl, DType::f32, {tokens, experts}), nullptr, gpu(dw, DType::f32, {tokens, k}),
                         gpu(di, DType::i32, {tokens, k}), MoeScoring::softmax, true, 1, 1, 1.0, nullptr, rt_.get())
                    .ok());
    ASSERT_TRUE(moe_permute(gpu(dx, DType::bf16, {tokens, hidden}), gpu(di, DType::i32, {tokens, k}),
                            gpu(dxs, DType::bf16, {n, hidden}), gpu(doff, DType::i32, {experts + 1}),
                            gpu(drow, DType::i32, {tokens, k}), gpu(dsrc, DType::i32, {n}), nullptr, rt_.get())
                    .ok());
    const TensorView offs_dev = TensorView::contiguous(static_cast<std::int32_t*>(doff.buf->get()) + 1, DType::i32,
                                                       {experts}, Device::cuda(0));
    ASSERT_TRUE(grouped_gemm(gpu(dxs, DType::bf16, {n, hidden}), gpu(dgu, DType::bf16, {experts, 2 * inter, hidden}),
                             offs_dev, gpu(dh, DType::bf16, {n, 2 * inter}), nullptr, rt_.get())
                    .ok());
    ASSERT_TRUE(act_and_mul(gpu(dh, DType::bf16, {n, 2 * inter}), gpu(dact, DType::bf16, {n, inter}), Activation::silu,
                            nullptr, rt_.get())
                    .ok());
    ASSERT_TRUE(grouped_gemm(gpu(dact, DType::bf16, {n, inter}), gpu(ddn, DType::bf16, {experts, hidden, inter}), offs_dev,
                             gpu(dys, DType::bf16, {n, hidden}), nullptr, rt_.get())
                    .ok());
    const TensorView gw = gpu(dw, DType::f32, {tokens, k});
    ASSERT_TRUE(moe_combine(gpu(dys, DType::bf16, {n, hidden}), gpu(drow, DType::i32, {tokens, k}), &gw,
                            gpu(dout, DType::bf16, {tokens, hidden}), nullptr, rt_.get())
                    .ok());
    const auto got = down(dout);
    std::vector<std::uint16_t> g16(out.size());
    std::memcpy(g16.data(), got.data(), got.size());
    compare_rows(g16, out, DType::bf16, hidden, "moe forward, top_k " + std::to_string(k) + " seed " + std::to_string(seed_));
    // The fused_moe op runs the same kernels on its workspace: the same bits.
    Dev dfused = poisoned(tokens * hidden * 2);
    ASSERT_TRUE(fused_moe(gpu(dx, DType::bf16, {tokens, hidden}), gpu(dl, DType::f32, {tokens, experts}),
                          gpu(dgu, DType::bf16, {experts, 2 * inter, hidden}), gpu(ddn, DType::bf16, {experts, hidden, inter}),
                          gpu(dfused, DType::bf16, {tokens, hidden}), k, Activation::silu, true, nullptr, rt_.get())
                    .ok());
    EXPECT_EQ(down(dfused), got) << "fused_moe differs from the chain of ops, top_k " << k;
  }
}

}  // namespace
}  // namespace kiln
