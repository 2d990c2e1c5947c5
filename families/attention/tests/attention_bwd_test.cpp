// The attention backward on the CPU: the typed ops (the fp64 reference) against central finite
// differences of the forward's CPU reference at tiny shapes, for every feature (causal, windows,
// softcap, scale, GQA 1/2/4, head_dim_v != head_dim, lq != lk, packed sequences of uneven and empty
// lengths, rows with no visible key); the family's three stages composed on host buffers against
// the op; typed errors before anything runs; the GPU path's limits; the declarations.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/half.h"
#include "families/attention/attention_bwd.h"
#include "families/attention/ops.h"
#include "kiln/family.h"
#include "kiln/op.h"

namespace kiln {
namespace {

struct Case {
  std::string name;
  std::vector<std::int64_t> lq, lk;  // per sequence
  std::int64_t heads = 2, kv_heads = 2, d = 4, dv = 4;
  AttentionOptions opt;
  bool varlen = false;
};

struct Tensors {
  std::int64_t batch = 0, sq = 0, sk = 0, tq = 0, tk = 0;
  std::vector<std::int32_t> cq{0}, ck{0};
  std::vector<float> q, k, v, dout;
};

Tensors make(const Case& c, unsigned seed) {
  Tensors t;
  t.batch = std::int64_t(c.lq.size());
  for (std::int64_t b = 0; b < t.batch; ++b) {
    t.sq = std::max(t.sq, c.lq[std::size_t(b)]);
    t.sk = std::max(t.sk, c.lk[std::size_t(b)]);
    t.cq.push_back(t.cq.back() + std::int32_t(c.lq[std::size_t(b)]));
    t.ck.push_back(t.ck.back() + std::int32_t(c.lk[std::size_t(b)]));
  }
  t.tq = c.varlen ? t.cq.back() : t.batch * t.sq;
  t.tk = c.varlen ? t.ck.back() : t.batch * t.sk;
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& x, std::int64_t count) {
    x.resize(std::size_t(count));
    for (auto& e : x) e = n(rng);
  };
  fill(t.q, t.tq * c.heads * c.d);
  fill(t.k, t.tk * c.kv_heads * c.d);
  fill(t.v, t.tk * c.kv_heads * c.dv);
  fill(t.dout, t.tq * c.heads * c.dv);
  return t;
}

TensorView view(void* p, DType dt, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(p, dt, shape, Device::cpu());
}

// The forward on the host (f32): out and lse.
Status forward(const Case& c, Tensors& t, std::vector<float>& out, std::vector<float>& lse) {
  out.assign(std::size_t(t.tq * c.heads * c.dv), 0.0f);
  lse.assign(std::size_t(t.tq * c.heads), 0.0f);
  if (c.varlen) {
    auto cq = view(t.cq.data(), DType::i32, {t.batch + 1}), ck = view(t.ck.data(), DType::i32, {t.batch + 1});
    auto l = view(lse.data(), DType::f32, {c.heads, t.tq});
    return attention_varlen(view(t.q.data(), DType::f32, {t.tq, c.heads, c.d}),
                            view(t.k.data(), DType::f32, {t.tk, c.kv_heads, c.d}),
                            view(t.v.data(), DType::f32, {t.tk, c.kv_heads, c.dv}), cq, ck,
                            view(out.data(), DType::f32, {t.tq, c.heads, c.dv}), &l, t.sq, t.sk, c.opt);
  }
  auto l = view(lse.data(), DType::f32, {t.batch, c.heads, t.sq});
  return attention(view(t.q.data(), DType::f32, {t.batch, t.sq, c.heads, c.d}),
                   view(t.k.data(), DType::f32, {t.batch, t.sk, c.kv_heads, c.d}),
                   view(t.v.data(), DType::f32, {t.batch, t.sk, c.kv_heads, c.dv}),
                   view(out.data(), DType::f32, {t.batch, t.sq, c.heads, c.dv}), &l, c.opt);
}

Status backward(const Case& c, Tensors& t, std::vector<float>& out, std::vector<float>& lse, std::vector<float>& dq,
                std::vector<float>& dk, std::vector<float>& dv, bool deterministic = false) {
  const float poison = std::numeric_limits<float>::quiet_NaN();
  dq.assign(t.q.size(), poison);
  dk.assign(t.k.size(), poison);
  dv.assign(t.v.size(), poison);
  if (c.varlen) {
    auto cq = view(t.cq.data(), DType::i32, {t.batch + 1}), ck = view(t.ck.data(), DType::i32, {t.batch + 1});
    return attention_varlen_backward(
        view(t.dout.data(), DType::f32, {t.tq, c.heads, c.dv}), view(t.q.data(), DType::f32, {t.tq, c.heads, c.d}),
        view(t.k.data(), DType::f32, {t.tk, c.kv_heads, c.d}), view(t.v.data(), DType::f32, {t.tk, c.kv_heads, c.dv}),
        cq, ck, view(out.data(), DType::f32, {t.tq, c.heads, c.dv}), view(lse.data(), DType::f32, {c.heads, t.tq}),
        view(dq.data(), DType::f32, {t.tq, c.heads, c.d}), view(dk.data(), DType::f32, {t.tk, c.kv_heads, c.d}),
        view(dv.data(), DType::f32, {t.tk, c.kv_heads, c.dv}), t.sq, t.sk, c.opt, deterministic);
  }
  return attention_backward(
      view(t.dout.data(), DType::f32, {t.batch, t.sq, c.heads, c.dv}),
      view(t.q.data(), DType::f32, {t.batch, t.sq, c.heads, c.d}),
      view(t.k.data(), DType::f32, {t.batch, t.sk, c.kv_heads, c.d}),
      view(t.v.data(), DType::f32, {t.batch, t.sk, c.kv_heads, c.dv}),
      view(out.data(), DType::f32, {t.batch, t.sq, c.heads, c.dv}),
      view(lse.data(), DType::f32, {t.batch, c.heads, t.sq}), view(dq.data(), DType::f32, {t.batch, t.sq, c.heads, c.d}),
      view(dk.data(), DType::f32, {t.batch, t.sk, c.kv_heads, c.d}),
      view(dv.data(), DType::f32, {t.batch, t.sk, c.kv_heads, c.dv}), c.opt, deterministic);
}

// L = sum(out * dout) through the forward; its gradient with respect to x is the op's dx.
double loss(const Case& c, Tensors& t) {
  std::vector<float> out, lse;
  EXPECT_TRUE(forward(c, t, out, lse).ok());
  double s = 0;
  for (std::size_t i = 0; i < out.size(); ++i) s += double(out[i]) * double(t.dout[i]);
  return s;
}

// Central differences, each element of q, k and v in turn.
void check_against_finite_differences(const Case& c) {
  SCOPED_TRACE(c.name);
  Tensors t = make(c, 42);
  std::vector<float> out, lse, dq, dk, dv;
  ASSERT_TRUE(forward(c, t, out, lse).ok());
  const Status s = backward(c, t, out, lse, dq, dk, dv);
  ASSERT_TRUE(s.ok()) << s.to_string();
  int bad = 0;
  double worst = 0;
  for (auto [x, g, name] : {std::tuple{&t.q, &dq, "dq"}, std::tuple{&t.k, &dk, "dk"}, std::tuple{&t.v, &dv, "dv"}}) {
    for (std::size_t i = 0; i < x->size() && bad < 5; ++i) {
      const float x0 = (*x)[i];
      const float eps = 1e-2f;
      (*x)[i] = x0 + eps;
      const double hi = double((*x)[i]);
      const double lp = loss(c, t);
      (*x)[i] = x0 - eps;
      const double lo = double((*x)[i]);
      const double lm = loss(c, t);
      (*x)[i] = x0;
      const double want = (lp - lm) / (hi - lo), got = (*g)[i];
      worst = std::max(worst, std::abs(got - want));
      if (!(std::abs(got - want) <= 2e-3 + 2e-3 * std::abs(want))) {
        ++bad;
        ADD_FAILURE() << name << "[" << i << "] = " << got << ", finite differences give " << want;
      }
    }
  }
  std::printf("%s: %zu gradients, worst difference %.2e\n", c.name.c_str(), dq.size() + dk.size() + dv.size(), worst);
}

AttentionOptions opts(bool causal, std::int64_t wl = -1, std::int64_t wr = -1, double softcap = 0, double scale = 0) {
  AttentionOptions o;
  o.causal = causal;
  o.window_left = wl;
  o.window_right = wr;
  o.softcap = softcap;
  o.scale = scale;
  return o;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  auto add = [&](std::string name, std::vector<std::int64_t> lq, std::vector<std::int64_t> lk, std::int64_t h,
                 std::int64_t hk, std::int64_t d, std::int64_t dv, AttentionOptions o, bool varlen = false) {
    out.push_back(Case{name, lq, lk, h, hk, d, dv, o, varlen});
  };
  add("full", {5, 5}, {5, 5}, 2, 2, 4, 4, opts(false));
  add("causal", {6}, {6}, 2, 2, 4, 4, opts(true));
  add("causal lq < lk", {3, 3}, {7, 7}, 2, 2, 4, 4, opts(true));
  add("causal lq > lk (rows see nothing)", {7}, {4}, 2, 2, 4, 4, opts(true));
  add("window 2/1", {7}, {7}, 2, 2, 4, 4, opts(false, 2, 1));
  add("window left only, lq != lk", {5}, {8}, 2, 2, 4, 4, opts(false, 1, -1));
  add("window right only", {6}, {6}, 2, 2, 4, 4, opts(false, -1, 2));
  add("softcap", {5}, {6}, 2, 2, 4, 4, opts(false, -1, -1, 1.5));
  add("softcap causal scale", {6}, {6}, 2, 2, 4, 4, opts(true, -1, -1, 2.0, 0.7));
  add("gqa 2", {5}, {6}, 4, 2, 4, 4, opts(true));
  add("gqa 4 (mqa)", {4}, {5}, 4, 1, 4, 4, opts(false));
  add("dv != d", {5}, {6}, 2, 1, 6, 3, opts(false, 2, 0));
  add("varlen uneven", {3, 1, 5}, {4, 6, 2}, 2, 2, 4, 4, opts(false), true);
  add("varlen causal with empty sequences", {3, 0, 4, 2}, {5, 3, 0, 2}, 4, 2, 4, 3, opts(true), true);
  add("varlen window softcap gqa", {4, 6}, {6, 3}, 4, 1, 4, 4, opts(false, 1, 1, 1.0), true);
  return out;
}

TEST(AttentionBwdCpu, EveryFeatureMatchesFiniteDifferencesOfTheForward) {
  for (const Case& c : cases()) check_against_finite_differences(c);
}

TEST(AttentionBwdCpu, RowsThatSeeNoKeyGiveZerosNotNaN) {
  // Causal with more queries than keys: the first rows see nothing (lse -inf); a window that
  // misses every key; a sequence without keys.
  for (const Case& c : {Case{"causal", {6}, {2}, 2, 1, 4, 4, opts(true)},
                        Case{"window", {4}, {4}, 2, 2, 4, 4, opts(false, 0, -1)},
                        Case{"no keys", {3, 2}, {0, 3}, 2, 2, 4, 4, opts(false), true}}) {
    SCOPED_TRACE(c.name);
    Tensors t = make(c, 5);
    std::vector<float> out, lse, dq, dk, dv;
    ASSERT_TRUE(forward(c, t, out, lse).ok());
    ASSERT_TRUE(backward(c, t, out, lse, dq, dk, dv).ok());
    for (const auto* g : {&dq, &dk, &dv})
      for (float x : *g) ASSERT_TRUE(std::isfinite(x));
    if (c.name == "causal")  // rows 0..3 of each head see no key
      for (std::int64_t i = 0; i < 4; ++i)
        for (std::int64_t e = 0; e < c.heads * c.d; ++e) EXPECT_EQ(dq[std::size_t(i * c.heads * c.d + e)], 0.0f);
  }
}

TEST(AttentionBwdCpu, DeterministicChangesNothingOnTheHost) {
  const Case c{"gqa", {5}, {7}, 4, 2, 4, 4, opts(true)};
  Tensors t = make(c, 9);
  std::vector<float> out, lse, dq0, dk0, dv0, dq1, dk1, dv1;
  ASSERT_TRUE(forward(c, t, out, lse).ok());
  ASSERT_TRUE(backward(c, t, out, lse, dq0, dk0, dv0, false).ok());
  ASSERT_TRUE(backward(c, t, out, lse, dq1, dk1, dv1, true).ok());
  EXPECT_EQ(std::memcmp(dq0.data(), dq1.data(), dq0.size() * 4), 0);
  EXPECT_EQ(std::memcmp(dk0.data(), dk1.data(), dk0.size() * 4), 0);
  EXPECT_EQ(std::memcmp(dv0.data(), dv1.data(), dv0.size() * 4), 0);
}

// The GPU family's stages run on host buffers (their CPU emulation: prep, main, finish through the
// shared workspace) give what the op's reference gives, for the layouts the kernels must agree on.
TEST(AttentionBwdCpu, TheThreeStagesComposeToTheReference) {
  const Family* f = Registry::global().find("attention_bwd");
  ASSERT_NE(f, nullptr);
  for (const Case& c : {Case{"padded gqa causal", {70, 70}, {90, 90}, 4, 2, 64, 64, opts(true)},
                        Case{"varlen window", {65, 0, 130}, {20, 64, 129}, 2, 2, 64, 64, opts(false, 40, 3, 5.0), true},
                        Case{"varlen mqa", {17, 3}, {80, 1}, 4, 1, 64, 64, opts(false), true}}) {
    SCOPED_TRACE(c.name);
    Tensors t = make(c, 3);
    std::vector<float> out, lse, dq, dk, dv;
    ASSERT_TRUE(forward(c, t, out, lse).ok());
    ASSERT_TRUE(backward(c, t, out, lse, dq, dk, dv).ok());
    families::AttentionBwdProblem a;
    a.batch = t.batch;
    a.seqlen_q = t.sq;
    a.seqlen_k = t.sk;
    a.total_q = t.tq;
    a.total_k = t.tk;
    a.heads = c.heads;
    a.kv_heads = c.kv_heads;
    a.head_dim = c.d;
    a.head_dim_v = c.dv;
    a.varlen = c.varlen;
    a.window_left = c.opt.window_left;
    a.window_right = c.opt.causal ? 0 : c.opt.window_right;
    a.scale = c.opt.scale != 0 ? c.opt.scale : 1.0 / std::sqrt(double(c.d));
    a.softcap = c.opt.softcap;
    std::vector<float> ws(std::size_t(families::attention_bwd_workspace_elements(a)), 7.0f);
    std::vector<float> gq(dq.size(), -1.0f), gk(dk.size(), -1.0f), gv(dv.size(), -1.0f);
    // The padded lse layout is [batch, heads, seqlen_q], as the family reads it.
    void* b[12] = {t.q.data(), t.k.data(), t.v.data(), out.data(), t.dout.data(), lse.data(), t.cq.data(),
                   t.ck.data(), ws.data(), gq.data(), gk.data(), gv.data()};
    for (std::int64_t stage = 0; stage < 3; ++stage) {
      a.stage = stage;
      const Problem p = Problem::of(DType::f32, 16, a);
      const Params v = f->heuristic(p);
      const char* const names[] = {"prep", "main", "finish"};
      ASSERT_EQ(*v.get_str("stage"), names[stage]);
      const Status s = f->cpu_reference(v, p, b);
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    double worst = 0;
    for (auto [got, want] : {std::pair{&gq, &dq}, std::pair{&gk, &dk}, std::pair{&gv, &dv}})
      for (std::size_t i = 0; i < got->size(); ++i) {
        worst = std::max(worst, std::abs(double((*got)[i]) - (*want)[i]));
        ASSERT_NEAR((*got)[i], (*want)[i], 1e-4 + 1e-4 * std::abs((*want)[i])) << i;
      }
    std::printf("%s: stages against the reference, worst difference %.2e\n", c.name.c_str(), worst);
  }
}

TEST(AttentionBwdCpu, BadInputIsATypedErrorBeforeAnythingRuns) {
  const Case c{"errors", {4}, {5}, 2, 1, 4, 4, opts(false)};
  Tensors t = make(c, 1);
  std::vector<float> out, lse, dq(t.q.size()), dk(t.k.size()), dv(t.v.size());
  ASSERT_TRUE(forward(c, t, out, lse).ok());
  auto g = view(t.dout.data(), DType::f32, {1, 4, 2, 4});
  auto q = view(t.q.data(), DType::f32, {1, 4, 2, 4}), k = view(t.k.data(), DType::f32, {1, 5, 1, 4}),
       v = view(t.v.data(), DType::f32, {1, 5, 1, 4}), o = view(out.data(), DType::f32, {1, 4, 2, 4});
  auto l = view(lse.data(), DType::f32, {1, 2, 4});
  auto gq = view(dq.data(), DType::f32, {1, 4, 2, 4}), gk = view(dk.data(), DType::f32, {1, 5, 1, 4}),
       gv = view(dv.data(), DType::f32, {1, 5, 1, 4});
  EXPECT_TRUE(attention_backward(g, q, k, v, o, l, gq, gk, gv).ok());
  // dk shaped as q, dout shaped as q's head dim, lse of another shape or dtype.
  EXPECT_EQ(attention_backward(g, q, k, v, o, l, gq, gq, gv).code(), Code::shape_mismatch);
  auto g_bad = view(t.dout.data(), DType::f32, {1, 4, 2, 3});
  EXPECT_EQ(attention_backward(g_bad, q, k, v, o, l, gq, gk, gv).code(), Code::shape_mismatch);
  auto l_bad = view(lse.data(), DType::f32, {1, 4, 2});
  EXPECT_EQ(attention_backward(g, q, k, v, o, l_bad, gq, gk, gv).code(), Code::shape_mismatch);
  auto l_half = view(lse.data(), DType::f16, {1, 2, 4});
  EXPECT_EQ(attention_backward(g, q, k, v, o, l_half, gq, gk, gv).code(), Code::unsupported_dtype);
  auto gq_half = view(dq.data(), DType::f16, {1, 4, 2, 4});
  EXPECT_EQ(attention_backward(g, q, k, v, o, l, gq_half, gk, gv).code(), Code::unsupported_dtype);
  EXPECT_EQ(attention_backward(g, q, k, v, o, l, gq, gk, gv, opts(true, -1, 2)).code(), Code::invalid_argument);
  EXPECT_EQ(attention_backward(g, q, k, v, o, l, gq, gk, gv, opts(false, -2)).code(), Code::invalid_argument);
  EXPECT_EQ(attention_backward(g, q, k, v, o, l, gq, gk, gv, opts(false, -1, -1, -1.0)).code(),
            Code::invalid_argument);
  // A gradient on another device.
  auto gk_gpu = gk;
  gk_gpu.device = Device::cuda(0);
  EXPECT_NE(attention_backward(g, q, k, v, o, l, gq, gk_gpu, gv).code(), Code::ok);
  // Packed: offsets past the tokens.
  std::vector<std::int32_t> cq{0, 9}, ck{0, 5};
  auto cqv = view(cq.data(), DType::i32, {2}), ckv = view(ck.data(), DType::i32, {2});
  auto q3 = view(t.q.data(), DType::f32, {4, 2, 4}), k3 = view(t.k.data(), DType::f32, {5, 1, 4}),
       v3 = view(t.v.data(), DType::f32, {5, 1, 4}), o3 = view(out.data(), DType::f32, {4, 2, 4}),
       g3 = view(t.dout.data(), DType::f32, {4, 2, 4}), l2 = view(lse.data(), DType::f32, {2, 4});
  auto gq3 = view(dq.data(), DType::f32, {4, 2, 4}), gk3 = view(dk.data(), DType::f32, {5, 1, 4}),
       gv3 = view(dv.data(), DType::f32, {5, 1, 4});
  EXPECT_EQ(attention_varlen_backward(g3, q3, k3, v3, cqv, ckv, o3, l2, gq3, gk3, gv3, 9, 5).code(),
            Code::shape_mismatch);
  cq[1] = 4;
  EXPECT_TRUE(attention_varlen_backward(g3, q3, k3, v3, cqv, ckv, o3, l2, gq3, gk3, gv3, 4, 5).ok());
}

TEST(AttentionBwdCpu, TheGpuPathRejectsWhatItCannotRunBeforeAnyLaunch) {
  const Family* f = Registry::global().find("attention_bwd");
  ASSERT_NE(f, nullptr);
  families::AttentionBwdProblem a;
  a.batch = 2;
  a.seqlen_q = a.seqlen_k = 128;
  a.total_q = a.total_k = 256;
  a.heads = 4;
  a.kv_heads = 2;
  a.head_dim = a.head_dim_v = 128;
  a.scale = 0.1;
  Problem p = Problem::of(DType::bf16, 16, a);
  for (std::int64_t stage = 0; stage < 3; ++stage) {
    a.stage = stage;
    p.set(a);
    EXPECT_TRUE(f->check_problem(f->heuristic(p), p).ok()) << stage;
  }
  for (auto [d, dv] : std::vector<std::pair<std::int64_t, std::int64_t>>{{32, 32}, {128, 64}, {192, 128}, {256, 256}}) {
    a.head_dim = d;
    a.head_dim_v = dv;
    p.set(a);
    EXPECT_EQ(f->check_problem(f->heuristic(p), p).code(), Code::invalid_argument) << d << "/" << dv;
    EXPECT_FALSE(families::attention_bwd_head_dims_supported(d, dv));
  }
  a.head_dim = a.head_dim_v = 64;
  p.set(a);
  p.alignment = 8;
  EXPECT_EQ(f->check_problem(f->heuristic(p), p).code(), Code::invalid_argument);
  p.alignment = 16;
  p.cc = 75;
  EXPECT_EQ(f->check_problem(f->heuristic(p), p).code(), Code::invalid_argument);
  p.cc = 0;
  // A stage's kernel does not run another stage's problem.
  Params main = f->heuristic(p);
  a.stage = 0;
  p.set(a);
  EXPECT_EQ(f->check_problem(main, p).code(), Code::invalid_argument);
  // Every catalog variant is a stage of a supported head-dim pair (three stages for each), or the
  // sm_90a main kernel of one of its pairs.
  const auto cat = f->catalog();
  EXPECT_EQ(cat.size(), 2 * families::k_attention_bwd_head_dims.size() * 3 +
                            2 * families::k_attention_bwd_sm90_head_dims.size());
  for (const Params& v : cat) EXPECT_TRUE(f->validate(v).ok()) << v.canonical();
  // On compute capability 9.0 the main stage takes the wgmma kernel at its head dims in every mode
  // and with softcap, the mma.sync kernel otherwise; the wgmma kernel refuses what it cannot run.
  a.stage = 1;
  a.head_dim = a.head_dim_v = 128;
  p.set(a);
  p.cc = 90;
  const Params wgmma = f->heuristic(p);
  EXPECT_EQ(wgmma.get_str("path").value_or(""), "wgmma");
  EXPECT_TRUE(f->check_problem(wgmma, p).ok());
  EXPECT_LE(families::attention_bwd_sm90_smem_bytes(128, 128), 227u * 1024);
  for (auto change : {+[](families::AttentionBwdProblem& x) { x.deterministic = 1; },
                      +[](families::AttentionBwdProblem& x) { x.softcap = 30; },
                      +[](families::AttentionBwdProblem& x) {
                        x.deterministic = 1;
                        x.softcap = 30;
                        x.window_left = 7;
                      }}) {
    families::AttentionBwdProblem b = a;
    change(b);
    Problem q = p;
    q.set(b);
    EXPECT_EQ(f->heuristic(q).get_str("path").value_or(""), "wgmma");
    EXPECT_TRUE(f->check_problem(wgmma, q).ok());
  }
  {
    families::AttentionBwdProblem b = a;
    b.head_dim = b.head_dim_v = 96;
    Problem q = p;
    q.set(b);
    EXPECT_EQ(f->heuristic(q).get_str("path").value_or(""), "mma");
    EXPECT_EQ(f->check_problem(wgmma, q).code(), Code::invalid_argument);
  }
  p.cc = 80;
  EXPECT_EQ(f->heuristic(p).get_str("path").value_or(""), "mma");
  EXPECT_EQ(f->check_problem(wgmma, p).code(), Code::invalid_argument);
  p.cc = 0;
  // Shared memory of the main kernel fits sm_80 at every head dim.
  for (const auto& [d, dv] : families::k_attention_bwd_head_dims)
    EXPECT_LE(families::attention_bwd_smem_bytes(d, dv, families::attention_bwd_warps(d, dv),
                                                 families::attention_bwd_block_m(d, dv)),
              163u * 1024);
}

TEST(AttentionBwdCpu, DeclaresBackwardOpsWithGradientMarks) {
  for (const char* name : {"attention_backward", "attention_varlen_backward"}) {
    const OpDecl* op = Registry::global().find_op(name);
    ASSERT_NE(op, nullptr) << name;
    EXPECT_TRUE(op->check().ok());
    const auto j = nlohmann::json::parse(op->describe());
    std::map<std::string, std::string> grads;
    for (const auto& t : j["tensors"])
      if (!t["grad_of"].get<std::string>().empty()) grads[t["name"]] = t["grad_of"];
    EXPECT_EQ(grads, (std::map<std::string, std::string>{{"dout", "out"}, {"dq", "q"}, {"dk", "k"}, {"dv", "v"}}));
    EXPECT_EQ(j["scalars"].back()["name"], "deterministic");
  }
  // The declaration runs the typed op: deterministic is the last scalar.
  const OpDecl* op = Registry::global().find_op("attention_backward");
  const Case c{"decl", {3}, {4}, 2, 1, 4, 4, opts(true)};
  Tensors t = make(c, 2);
  std::vector<float> out, lse, dq(t.q.size()), dk(t.k.size()), dv(t.v.size());
  ASSERT_TRUE(forward(c, t, out, lse).ok());
  auto g = view(t.dout.data(), DType::f32, {1, 3, 2, 4}), q = view(t.q.data(), DType::f32, {1, 3, 2, 4}),
       k = view(t.k.data(), DType::f32, {1, 4, 1, 4}), v = view(t.v.data(), DType::f32, {1, 4, 1, 4}),
       o = view(out.data(), DType::f32, {1, 3, 2, 4}), l = view(lse.data(), DType::f32, {1, 2, 3}),
       gq = view(dq.data(), DType::f32, {1, 3, 2, 4}), gk = view(dk.data(), DType::f32, {1, 4, 1, 4}),
       gv = view(dv.data(), DType::f32, {1, 4, 1, 4});
  const TensorView* ts[9] = {&g, &q, &k, &v, &o, &l, &gq, &gk, &gv};
  OpValue sc[6];
  sc[1].i64 = 1;
  sc[2].i64 = -1;
  sc[3].i64 = -1;
  sc[5].i64 = 1;
  OpCall call{ts, sc};
  ASSERT_TRUE(check_op_call(*op, call).ok());
  ASSERT_TRUE(op->run(call).ok());
  OutputShape shapes[3];
  ASSERT_TRUE(op->infer(call, shapes).ok());
  EXPECT_EQ(shapes[1].rank, 4);
  EXPECT_EQ(shapes[1].shape[1], 4);
  EXPECT_EQ(shapes[1].shape[2], 1);
  std::vector<float> out2, lse2, dq2, dk2, dv2;
  ASSERT_TRUE(backward(c, t, out, lse, dq2, dk2, dv2).ok());
  EXPECT_EQ(std::memcmp(dk.data(), dk2.data(), dk.size() * 4), 0);
}

}  // namespace
}  // namespace kiln
