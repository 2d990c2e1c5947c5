// Attention on the CPU: the typed ops (the family's CPU fallback) against a plain two-pass fp64
// attention written here, over every feature at small shapes (causal, windows, softcap, scale,
// GQA and MQA, head_dim_v != head_dim, lq != lk, packed sequences, fully masked rows, lse); every
// error before a launch; the heuristic and catalog; the declarations the bindings come from.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/half.h"
#include "families/attention/attention.h"
#include "families/attention/ops.h"
#include "kiln/family.h"
#include "kiln/op.h"

namespace kiln {
namespace {

constexpr double k_inf = std::numeric_limits<double>::infinity();

struct Case {
  std::string name;
  std::vector<std::int64_t> lq, lk;  // per sequence
  std::int64_t heads = 4, kv_heads = 4, d = 16, dv = 16;
  AttentionOptions opt;
  bool varlen = false;
};

// Inputs of one case as doubles (already rounded to the tensor dtype) and the raw tensors.
struct Data {
  std::int64_t tq = 0, tk = 0, sq = 0, sk = 0, batch = 0;
  std::vector<std::int64_t> q0, k0;  // first token of each sequence
  std::vector<double> q, k, v;
  std::vector<unsigned char> qb, kb, vb;
};

Data make_data(const Case& c, DType t, unsigned seed) {
  Data d;
  d.batch = std::int64_t(c.lq.size());
  for (std::int64_t b = 0; b < d.batch; ++b) {
    d.sq = std::max(d.sq, c.lq[b]);
    d.sk = std::max(d.sk, c.lk[b]);
  }
  for (std::int64_t b = 0; b < d.batch; ++b) {
    d.q0.push_back(c.varlen ? d.tq : b * d.sq);
    d.k0.push_back(c.varlen ? d.tk : b * d.sk);
    d.tq += c.varlen ? c.lq[b] : d.sq;
    d.tk += c.varlen ? c.lk[b] : d.sk;
  }
  std::mt19937 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  auto fill = [&](std::vector<double>& x, std::vector<unsigned char>& raw, std::int64_t count, double s) {
    raw.resize(std::size_t(count) * dtype_size(t));
    x.resize(std::size_t(count));
    for (std::int64_t i = 0; i < count; ++i) {
      store_from_double(raw.data(), t, i, s * n(rng));
      x[std::size_t(i)] = load_as_double(raw.data(), t, i);
    }
  };
  fill(d.q, d.qb, d.tq * c.heads * c.d, 1.0);
  fill(d.k, d.kb, d.tk * c.kv_heads * c.d, 1.0);
  fill(d.v, d.vb, d.tk * c.kv_heads * c.dv, 1.0);
  return d;
}

// Two-pass softmax over an explicit visibility test per (query, key); out [tq, heads, dv], lse
// [heads, tq] indexed by token.
void naive(const Case& c, const Data& d, std::vector<double>& out, std::vector<double>& lse) {
  out.assign(std::size_t(d.tq * c.heads * c.dv), 0.0);
  lse.assign(std::size_t(c.heads * d.tq), -k_inf);
  const double scale = c.opt.scale != 0 ? c.opt.scale : 1.0 / std::sqrt(double(c.d));
  const std::int64_t wl = c.opt.window_left, wr = c.opt.causal ? 0 : c.opt.window_right;
  for (std::int64_t b = 0; b < d.batch; ++b)
    for (std::int64_t h = 0; h < c.heads; ++h) {
      const std::int64_t hk = h * c.kv_heads / c.heads, lq = c.lq[b], lk = c.lk[b];
      for (std::int64_t i = 0; i < lq; ++i) {
        std::vector<double> s(std::size_t(lk), -k_inf);
        double mx = -k_inf;
        for (std::int64_t j = 0; j < lk; ++j) {
          const std::int64_t diag = i + lk - lq;
          if (wr >= 0 && j > diag + wr) continue;
          if (wl >= 0 && j < diag - wl) continue;
          double dot = 0;
          for (std::int64_t e = 0; e < c.d; ++e)
            dot += d.q[std::size_t(((d.q0[b] + i) * c.heads + h) * c.d + e)] *
                   d.k[std::size_t(((d.k0[b] + j) * c.kv_heads + hk) * c.d + e)];
          double x = dot * scale;
          if (c.opt.softcap > 0) x = c.opt.softcap * std::tanh(x / c.opt.softcap);
          s[std::size_t(j)] = x;
          mx = std::max(mx, x);
        }
        if (mx == -k_inf) continue;  // no key visible: zeros, lse -inf
        double sum = 0;
        for (double x : s) sum += x == -k_inf ? 0.0 : std::exp(x - mx);
        for (std::int64_t j = 0; j < lk; ++j) {
          if (s[std::size_t(j)] == -k_inf) continue;
          const double p = std::exp(s[std::size_t(j)] - mx) / sum;
          for (std::int64_t e = 0; e < c.dv; ++e)
            out[std::size_t(((d.q0[b] + i) * c.heads + h) * c.dv + e)] +=
                p * d.v[std::size_t(((d.k0[b] + j) * c.kv_heads + hk) * c.dv + e)];
        }
        lse[std::size_t(h * d.tq + d.q0[b] + i)] = mx + std::log(sum);
      }
    }
}

TensorView host(std::vector<unsigned char>& b, DType t, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(b.data(), t, shape, Device::cpu());
}

// Runs the op on the host and checks out and lse against the naive fp64 attention. Padded cases
// use lq and lk of the first sequence for every sequence.
void check(const Case& c, DType t) {
  SCOPED_TRACE(c.name + " " + dtype_name(t));
  Data d = make_data(c, t, 1234);
  std::vector<double> want, want_lse;
  naive(c, d, want, want_lse);
  const std::size_t es = dtype_size(t);
  std::vector<unsigned char> out(std::size_t(d.tq * c.heads * c.dv) * es, 0xFF), lse(std::size_t(c.heads * d.tq) * 4, 0xFF);
  Status s;
  if (c.varlen) {
    std::vector<std::int32_t> cq{0}, ck{0};
    for (std::size_t b = 0; b < c.lq.size(); ++b) {
      cq.push_back(cq.back() + std::int32_t(c.lq[b]));
      ck.push_back(ck.back() + std::int32_t(c.lk[b]));
    }
    auto cqv = TensorView::contiguous(cq.data(), DType::i32, {d.batch + 1}, Device::cpu());
    auto ckv = TensorView::contiguous(ck.data(), DType::i32, {d.batch + 1}, Device::cpu());
    auto lv = host(lse, DType::f32, {c.heads, d.tq});
    s = attention_varlen(host(d.qb, t, {d.tq, c.heads, c.d}), host(d.kb, t, {d.tk, c.kv_heads, c.d}),
                         host(d.vb, t, {d.tk, c.kv_heads, c.dv}), cqv, ckv, host(out, t, {d.tq, c.heads, c.dv}), &lv,
                         d.sq, d.sk, c.opt);
  } else {
    // The op's lse is [batch, heads, seqlen_q]; written here into the [heads, tq] order below.
    std::vector<unsigned char> lse_b(lse.size());
    auto lv = host(lse_b, DType::f32, {d.batch, c.heads, d.sq});
    s = attention(host(d.qb, t, {d.batch, d.sq, c.heads, c.d}), host(d.kb, t, {d.batch, d.sk, c.kv_heads, c.d}),
                  host(d.vb, t, {d.batch, d.sk, c.kv_heads, c.dv}), host(out, t, {d.batch, d.sq, c.heads, c.dv}), &lv,
                  c.opt);
    const auto* src = reinterpret_cast<const float*>(lse_b.data());
    auto* dst = reinterpret_cast<float*>(lse.data());
    for (std::int64_t b = 0; b < d.batch; ++b)
      for (std::int64_t h = 0; h < c.heads; ++h)
        for (std::int64_t i = 0; i < d.sq; ++i) dst[h * d.tq + b * d.sq + i] = src[(b * c.heads + h) * d.sq + i];
  }
  ASSERT_TRUE(s.ok()) << s.to_string();
  // The op accumulates in fp64 and rounds once to the dtype.
  const double rel = t == DType::f32 ? 1e-6 : t == DType::f16 ? 1.0 / 1024 : 1.0 / 128;
  int bad = 0;
  for (std::size_t i = 0; i < want.size() && bad < 5; ++i) {
    const double got = load_as_double(out.data(), t, std::int64_t(i));
    if (!(std::abs(got - want[i]) <= rel * std::abs(want[i]) + 1e-6)) {
      ++bad;
      ADD_FAILURE() << "out[" << i << "] = " << got << ", want " << want[i];
    }
  }
  const auto* l = reinterpret_cast<const float*>(lse.data());
  int masked = 0;
  for (std::size_t i = 0; i < want_lse.size() && bad < 5; ++i) {
    if (want_lse[i] == -k_inf) {
      ++masked;
      if (!(l[i] == -std::numeric_limits<float>::infinity())) {
        ++bad;
        ADD_FAILURE() << "lse[" << i << "] = " << l[i] << ", want -inf (no key visible)";
      }
    } else if (!(std::abs(l[i] - want_lse[i]) <= 1e-5 * std::max(1.0, std::abs(want_lse[i])))) {
      ++bad;
      ADD_FAILURE() << "lse[" << i << "] = " << l[i] << ", want " << want_lse[i];
    }
  }
  std::printf("%s %s: %zu outputs, %d rows with no visible key\n", c.name.c_str(), dtype_name(t), want.size(), masked);
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
  for (bool varlen : {false, true}) {
    const std::string layout = varlen ? "varlen " : "padded ";
    // Padded cases take every sequence at the first sequence's lengths.
    auto lens = [&](std::vector<std::int64_t> v, std::int64_t all) {
      return varlen ? v : std::vector<std::int64_t>(v.size(), all);
    };
    auto add = [&](std::string name, std::vector<std::int64_t> lq, std::vector<std::int64_t> lk, std::int64_t h,
                   std::int64_t hk, std::int64_t d, std::int64_t dv, AttentionOptions o) {
      out.push_back(Case{layout + name, lens(lq, lq[0]), lens(lk, lk[0]), h, hk, d, dv, o, varlen});
    };
    add("full", {37, 5, 64}, {37, 9, 64}, 4, 4, 16, 16, opts(false));
    add("causal", {70, 3, 33}, {70, 40, 33}, 4, 4, 16, 16, opts(true));
    add("causal lq > lk (masked rows)", {50, 20}, {30, 3}, 2, 2, 16, 16, opts(true));
    add("causal lq < lk", {17, 1}, {130, 77}, 2, 1, 32, 32, opts(true));
    add("window", {90, 40}, {90, 60}, 2, 2, 16, 16, opts(false, 7, 3));
    add("causal + left window", {90, 40}, {100, 40}, 2, 2, 16, 16, opts(true, 16));
    add("left window only", {40}, {70}, 2, 2, 16, 16, opts(false, 5, -1));
    add("right window only", {40}, {30}, 2, 2, 16, 16, opts(false, -1, 2));
    add("window past the keys", {40}, {10}, 2, 2, 16, 16, opts(false, 0, 0));
    add("softcap", {33, 12}, {65, 12}, 2, 2, 16, 16, opts(false, -1, -1, 2.5, 0.9));
    add("softcap causal", {33}, {33}, 2, 2, 16, 16, opts(true, -1, -1, 30.0));
    add("scale", {20}, {31}, 2, 2, 16, 16, opts(false, -1, -1, 0, 0.05));
    add("gqa 4", {30, 8}, {30, 19}, 8, 2, 16, 16, opts(true));
    add("gqa 8 (mqa)", {30}, {45}, 8, 1, 16, 16, opts(false));
    add("gqa 3", {21}, {21}, 6, 2, 16, 16, opts(false, 4, 4));
    add("dv != d", {40, 11}, {40, 70}, 4, 2, 48, 32, opts(true));
    add("d 64 long keys", {3}, {300}, 2, 2, 64, 64, opts(false));
  }
  return out;
}

TEST(AttentionCpu, EveryFeatureMatchesANaiveFp64Attention) {
  for (const Case& c : cases()) check(c, DType::f32);
}

TEST(AttentionCpu, HalfTypesRoundOnceFromFp64) {
  for (const Case& c : cases())
    if (c.name.find("causal") != std::string::npos) {
      check(c, DType::bf16);
      check(c, DType::f16);
    }
}

// A typed error, and nothing written.
struct Bad {
  std::vector<unsigned char> q, k, v, out, lse;
  std::vector<std::int32_t> cq{0, 3, 8}, ck{0, 4, 8};
  Bad() : q(8 * 4 * 16 * 4), k(8 * 2 * 16 * 4), v(8 * 2 * 16 * 4), out(8 * 4 * 16 * 4, 0xAB), lse(4 * 8 * 4, 0xAB) {}
};

Status padded(Bad& b, DType t, std::initializer_list<std::int64_t> qs, std::initializer_list<std::int64_t> ks,
              std::initializer_list<std::int64_t> vs, std::initializer_list<std::int64_t> os,
              const AttentionOptions& o = {}, DType kt = DType::f32, DType lse_t = DType::f32,
              std::initializer_list<std::int64_t> ls = {2, 4, 4}) {
  auto l = TensorView::contiguous(b.lse.data(), lse_t, ls, Device::cpu());
  return attention(host(b.q, t, qs), host(b.k, kt, ks), host(b.v, t, vs), host(b.out, t, os), &l, o);
}

TEST(AttentionCpu, BadInputIsATypedErrorBeforeAnythingRuns) {
  const DType f = DType::f32;
  Bad b;
  auto code = [](Status s) { return s.code(); };
  // The good call first: the shapes below are all derived from it.
  EXPECT_TRUE(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 16}).ok());
  const std::vector<unsigned char> good_out = b.out;
  std::fill(b.out.begin(), b.out.end(), 0xAB);
  const std::vector<unsigned char> untouched = b.out;
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 16}, {}, DType::bf16)),
            Code::unsupported_dtype);  // k's dtype differs
  EXPECT_EQ(code(padded(b, DType::i32, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 16}, {}, DType::i32)),
            Code::unsupported_dtype);
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 16}, {}, f, DType::bf16)),
            Code::unsupported_dtype);  // lse not f32
  EXPECT_EQ(code(padded(b, f, {2, 4, 3, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 3, 16}, {}, f, f, {2, 3, 4})),
            Code::shape_mismatch);  // 3 heads, 2 kv heads
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 8}, {2, 4, 2, 16}, {2, 4, 4, 16})), Code::shape_mismatch);
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 3, 2, 16}, {2, 4, 4, 16})), Code::shape_mismatch);
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 8})), Code::shape_mismatch);
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 16}, {}, f, f, {2, 4, 3})),
            Code::shape_mismatch);  // lse
  EXPECT_EQ(code(padded(b, f, {8, 4, 16}, {8, 2, 16}, {8, 2, 16}, {8, 4, 16})), Code::shape_mismatch);  // rank 3
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 16}, opts(false, -2))),
            Code::invalid_argument);
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 16}, opts(false, -1, -3))),
            Code::invalid_argument);
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 16}, opts(true, -1, 4))),
            Code::invalid_argument);  // causal with a right window
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 16}, opts(false, -1, -1, -1.0))),
            Code::invalid_argument);  // softcap < 0
  EXPECT_EQ(code(padded(b, f, {2, 4, 4, 16}, {2, 4, 2, 16}, {2, 4, 2, 16}, {2, 4, 4, 16},
                        opts(false, -1, -1, 0, std::nan("")))),
            Code::invalid_argument);
  EXPECT_EQ(b.out, untouched);
  // A CUDA tensor among host ones.
  auto q = host(b.q, f, {2, 4, 4, 16});
  q.device = Device::cuda(0);
  EXPECT_EQ(attention(q, host(b.k, f, {2, 4, 2, 16}), host(b.v, f, {2, 4, 2, 16}), host(b.out, f, {2, 4, 4, 16}),
                      nullptr)
                .code(),
            Code::device_error);
  auto k = host(b.k, f, {2, 4, 2, 16});
  k.device = Device::cuda(0);
  EXPECT_EQ(attention(host(b.q, f, {2, 4, 4, 16}), k, host(b.v, f, {2, 4, 2, 16}), host(b.out, f, {2, 4, 4, 16}),
                      nullptr)
                .code(),
            Code::device_error);
  // Varlen: cu_seqlens dtype, shape and contents.
  auto vl = [&](std::vector<std::int32_t>& cq, std::vector<std::int32_t>& ck, std::int64_t mq, std::int64_t mk,
                DType cu_t = DType::i32) {
    auto cqv = TensorView::contiguous(cq.data(), cu_t, {std::int64_t(cq.size())}, Device::cpu());
    auto ckv = TensorView::contiguous(ck.data(), DType::i32, {std::int64_t(ck.size())}, Device::cpu());
    return attention_varlen(host(b.q, f, {8, 4, 16}), host(b.k, f, {8, 2, 16}), host(b.v, f, {8, 2, 16}), cqv, ckv,
                            host(b.out, f, {8, 4, 16}), nullptr, mq, mk)
        .code();
  };
  EXPECT_EQ(vl(b.cq, b.ck, 5, 4), Code::ok);
  std::fill(b.out.begin(), b.out.end(), 0xAB);
  EXPECT_EQ(vl(b.cq, b.ck, 5, 4, DType::f32), Code::unsupported_dtype);
  EXPECT_EQ(vl(b.cq, b.ck, 4, 4), Code::shape_mismatch);  // a sequence longer than max_seqlen_q
  EXPECT_EQ(vl(b.cq, b.ck, -1, 4), Code::invalid_argument);
  std::vector<std::int32_t> short_k{0, 4};
  EXPECT_EQ(vl(b.cq, short_k, 5, 4), Code::shape_mismatch);  // batch differs
  std::vector<std::int32_t> decreasing{0, 5, 3}, past_end{0, 3, 9}, nonzero{1, 3, 8};
  EXPECT_EQ(vl(decreasing, b.ck, 5, 4), Code::shape_mismatch);
  EXPECT_EQ(vl(past_end, b.ck, 6, 4), Code::shape_mismatch);
  EXPECT_EQ(vl(nonzero, b.ck, 5, 4), Code::shape_mismatch);
  EXPECT_EQ(b.out, untouched);
  EXPECT_NE(good_out, untouched);
}

TEST(AttentionCpu, TheGpuPathRejectsWhatItCannotRunBeforeAnyLaunch) {
  // CUDA-labelled host memory: the checks that fail here come before the driver is asked about
  // the pointers only when the tensors are consistent, so use the family's own checks instead.
  const Family* f = Registry::global().find("attention");
  ASSERT_NE(f, nullptr);
  families::AttentionProblem a;
  a.batch = 2;
  a.seqlen_q = a.seqlen_k = 128;
  a.total_q = a.total_k = 256;
  a.heads = a.kv_heads = 4;
  a.head_dim = a.head_dim_v = 128;
  a.scale = 0.1;
  Problem p = Problem::of(DType::bf16, 16, a);
  EXPECT_TRUE(f->check_problem(f->heuristic(p), p).ok());
  for (auto [d, dv] : std::vector<std::pair<std::int64_t, std::int64_t>>{{32, 32}, {128, 64}, {160, 160}, {512, 512}}) {
    a.head_dim = d;
    a.head_dim_v = dv;
    p.set(a);
    EXPECT_EQ(f->check_problem(f->heuristic(p), p).code(), Code::invalid_argument) << d << "/" << dv;
  }
  a.head_dim = a.head_dim_v = 128;
  p.set(a);
  p.alignment = 8;
  EXPECT_EQ(f->check_problem(f->heuristic(p), p).code(), Code::invalid_argument);
  p.alignment = 16;
  p.cc = 75;
  EXPECT_EQ(f->check_problem(f->heuristic(p), p).code(), Code::invalid_argument);
  p.cc = 0;
  p.dtype = DType::f16;
  EXPECT_EQ(f->check_problem(Params{{"path", std::string("mma")}, {"dtype", std::string("bf16")},
                                    {"head_dim", 128}, {"head_dim_v", 128}, {"warps", 8}, {"block_n", 64},
                                    {"overlap", 0}, {"pingpong", 0}, {"persistent", 0}},
                             p)
                .code(),
            Code::unsupported_dtype);
}

TEST(AttentionCpu, HeuristicAndCatalogCoverEveryHeadDimPair) {
  const Family* f = Registry::global().find("attention");
  ASSERT_NE(f, nullptr);
  const auto catalog = f->catalog();
  // Per dtype: every pair's tile, the sm_90a kernel's pairs, and two short-window choices.
  EXPECT_EQ(catalog.size(),
            2 * (families::k_attention_head_dims.size() + families::k_attention_sm90_head_dims.size() + 2));
  for (DType t : {DType::f16, DType::bf16})
    for (const auto& [d, dv] : families::k_attention_head_dims) {
      families::AttentionProblem a;
      a.batch = 1;
      a.seqlen_q = a.seqlen_k = 1000;
      a.total_q = a.total_k = 1000;
      a.heads = 8;
      a.kv_heads = 2;
      a.head_dim = d;
      a.head_dim_v = dv;
      a.scale = 1;
      const Problem p = Problem::of(t, 16, a);
      const Params v = f->heuristic(p);
      EXPECT_TRUE(f->check_problem(v, p).ok()) << v.canonical();
      EXPECT_NE(std::find(catalog.begin(), catalog.end(), v), catalog.end()) << v.canonical() << " not in the catalog";
      // Every variant fits sm_80's shared memory.
      EXPECT_TRUE(f->runs_on(v, GpuArch{80})) << v.canonical();
      const LaunchGeometry g = f->geometry(v, p);
      EXPECT_EQ(g.grid.y, 8u);
      EXPECT_EQ(g.grid.x * 16 * *v.get_int("warps") >= 1000, true);
    }
}

// Short windows on compute capability 9.0: the sm_80 kernel's small tiles at head dim 64 up to
// 256 keys a query and at 128 up to 128; the sm_90a kernel's serial schedule at 128 up to 512;
// the usual choice past that, for one-sided windows and without a window. Every choice is in the
// catalog and fits the problem.
TEST(AttentionCpu, HeuristicFitsShortWindowsOnSm90) {
  const Family* f = Registry::global().find("attention");
  ASSERT_NE(f, nullptr);
  const auto catalog = f->catalog();
  auto pick = [&](std::int64_t d, std::int64_t left, std::int64_t right) {
    families::AttentionProblem a;
    a.batch = 1;
    a.seqlen_q = a.seqlen_k = 8192;
    a.total_q = a.total_k = 8192;
    a.heads = 64;
    a.kv_heads = 8;
    a.head_dim = a.head_dim_v = d;
    a.causal = right == 0;
    a.window_left = left;
    a.window_right = right;
    a.scale = 1;
    Problem p = Problem::of(DType::bf16, 16, a);
    p.cc = 90;
    const Params v = f->heuristic(p);
    EXPECT_TRUE(f->check_problem(v, p).ok()) << v.canonical();
    EXPECT_NE(std::find(catalog.begin(), catalog.end(), v), catalog.end()) << v.canonical() << " not in the catalog";
    return v;
  };
  // Three consumers of 64-key tiles on the serial schedule and persistent blocks.
  auto is_short_window = [](const Params& v) {
    return *v.get_str("path") == "wgmma" && *v.get_int("warps") == 12 && *v.get_int("block_n") == 64 &&
           *v.get_int("overlap") == 0 && *v.get_int("pingpong") == 0 && *v.get_int("persistent") == 1;
  };
  EXPECT_TRUE(is_short_window(pick(64, 127, 0)));
  EXPECT_TRUE(is_short_window(pick(64, 255, 0)));
  EXPECT_TRUE(is_short_window(pick(64, 100, 20)));
  EXPECT_TRUE(is_short_window(pick(64, 511, 0)));
  EXPECT_FALSE(is_short_window(pick(64, 512, 0)));
  EXPECT_TRUE(is_short_window(pick(128, 127, 0)));
  EXPECT_TRUE(is_short_window(pick(128, 511, 0)));
  EXPECT_EQ(*pick(128, 512, 0).get_int("overlap"), 1);
  EXPECT_EQ(*pick(192, 127, 0).get_int("warps"), 8) << "only 64/64 and 128/128 have the short-window variant";
  // One-sided windows and none: the usual sm_90a choice.
  EXPECT_EQ(*pick(64, 127, -1).get_str("path"), "wgmma");
  EXPECT_EQ(*pick(128, -1, 0).get_int("overlap"), 1);
  EXPECT_EQ(*pick(128, -1, -1).get_int("overlap"), 1);
}

// The sm_90a kernel (path wgmma): the heuristic's choice on compute capability 9.0 for the
// head-dim pairs it has, in the catalog, compiled for sm_90a only; the sm_80 kernel everywhere
// else (other devices, an unknown one, other head dims).
TEST(AttentionCpu, HeuristicTakesTheWgmmaKernelOnSm90) {
  const Family* f = Registry::global().find("attention");
  ASSERT_NE(f, nullptr);
  const auto catalog = f->catalog();
  auto problem = [](DType t, std::int64_t d, std::int64_t dv, std::int64_t cc) {
    families::AttentionProblem a;
    a.batch = 2;
    a.seqlen_q = a.seqlen_k = 1000;
    a.total_q = a.total_k = 2000;
    a.heads = 8;
    a.kv_heads = 2;
    a.head_dim = d;
    a.head_dim_v = dv;
    a.scale = 1;
    Problem p = Problem::of(t, 16, a);
    p.cc = std::uint8_t(cc);
    return p;
  };
  for (DType t : {DType::f16, DType::bf16})
    for (const auto& [d, dv] : families::k_attention_head_dims) {
      const bool sm90 = families::attention_sm90_head_dims_supported(d, dv);
      const Problem p = problem(t, d, dv, 90);
      const Params v = f->heuristic(p);
      EXPECT_EQ(*v.get_str("path"), sm90 ? "wgmma" : "mma") << d << "/" << dv;
      EXPECT_TRUE(f->validate(v).ok()) << v.canonical();
      EXPECT_TRUE(f->check_problem(v, p).ok()) << v.canonical();
      EXPECT_NE(std::find(catalog.begin(), catalog.end(), v), catalog.end()) << v.canonical() << " not in the catalog";
      EXPECT_TRUE(f->runs_on(v, GpuArch{90, 'a'})) << v.canonical();
      EXPECT_EQ(f->runs_on(v, GpuArch{80}), !sm90) << v.canonical();
      EXPECT_EQ(f->runs_on(v, GpuArch{90}), !sm90) << v.canonical() << ": wgmma needs the 'a' features";
      const LaunchGeometry g = f->geometry(v, p);
      // 64/64: three consumer warpgroups (192 query rows) and the producer; the others two. Persistent
      // variants (64/64 and 256/256) launch every (query tile, head, sequence) as one row of blocks
      // when the SM count is unknown; the rest a block per 128 query rows, head and sequence.
      const bool three = sm90 && d == 64, persistent = sm90 && (d == 64 || d == 256);
      EXPECT_EQ(g.block.x, three ? 512u : sm90 ? 384u : 256u);
      const std::uint32_t query_tiles = three ? 6u : 8u;
      EXPECT_EQ(g.grid.x, persistent ? query_tiles * 8 * 2 : query_tiles) << d;
      EXPECT_EQ(g.grid.y, persistent ? 1u : 8u) << d;
      EXPECT_LE(g.shared_bytes, 227u * 1024);
      // Tensor maps of q, k and v for the wgmma kernel only.
      ArgPack args;
      std::vector<void*> bufs(7, reinterpret_cast<void*>(std::uintptr_t(256)));
      f->pack_args(v, p, bufs, args);
      EXPECT_FALSE(args.overflow()) << v.canonical();
      EXPECT_EQ(args.tensor_maps(), sm90 ? 3u : 0u) << v.canonical();
      if (sm90) {
        // The schedule: serial on persistent blocks at 64/64 (three consumers) and 256/256, overlap
        // alone at the others.
        EXPECT_EQ(*v.get_int("pingpong"), 0) << v.canonical();
        EXPECT_EQ(*v.get_int("overlap"), d == 256 || d == 64 ? 0 : 1) << v.canonical();
        EXPECT_EQ(*v.get_int("persistent"), d == 256 || d == 64 ? 1 : 0) << v.canonical();
        EXPECT_EQ(args.tensor_map_request(0).box_rows, std::uint32_t(16 * *v.get_int("warps")));
        EXPECT_EQ(args.tensor_map_request(1).row_bytes, std::uint64_t(2 * 2 * d));
        EXPECT_EQ(args.tensor_map_request(2).box_rows, std::uint32_t(*v.get_int("block_n")));
        // The sm_80 kernel's choice elsewhere: other devices, an unknown one.
        for (std::int64_t cc : {0, 80, 86, 89, 100}) {
          const Problem q = problem(t, d, dv, cc);
          EXPECT_EQ(*f->heuristic(q).get_str("path"), "mma") << cc;
          EXPECT_EQ(f->check_problem(v, q).ok(), cc == 0) << cc;
        }
        // The tuning space on sm_90 holds the wgmma tile and the sm_80 kernel's.
        bool wgmma = false, mma = false;
        for (const Params& c : f->tuning_space(p)) (*c.get_str("path") == "wgmma" ? wgmma : mma) = true;
        EXPECT_TRUE(wgmma && mma) << d << "/" << dv;
      }
    }
  // No key tokens: the choice does not depend on token counts (they are no key of the problem),
  // and the wgmma kernel refuses the problem, whose tensor maps would have no row; the ops write
  // such calls' outputs without a kernel (AttentionOps.NoKeyTokensNeedNoKernel).
  Problem p = problem(DType::bf16, 128, 128, 90);
  auto a = p.as<families::AttentionProblem>();
  a.total_k = a.seqlen_k = 0;
  p.set(a);
  EXPECT_EQ(*f->heuristic(p).get_str("path"), "wgmma");
  Params w{{"path", std::string("wgmma")}, {"dtype", std::string("bf16")}, {"head_dim", 128},
           {"head_dim_v", 128}, {"warps", 8}, {"block_n", 128}, {"overlap", 1}, {"pingpong", 0}, {"persistent", 0}};
  EXPECT_TRUE(f->validate(w).ok());
  EXPECT_EQ(f->check_problem(w, p).code(), Code::invalid_argument);
  // Variants the wgmma kernel does not have.
  EXPECT_FALSE(f->validate(Params(w).set("head_dim", std::int64_t(96)).set("head_dim_v", std::int64_t(96))).ok());
  EXPECT_FALSE(f->validate(Params(w).set("warps", std::int64_t(4))).ok());
  EXPECT_FALSE(f->validate(Params(w).set("block_n", std::int64_t(32))).ok());
  EXPECT_TRUE(f->validate(Params(w).set("overlap", std::int64_t(0))).ok()) << "the serial schedule";
  EXPECT_TRUE(f->validate(Params(w).set("pingpong", std::int64_t(1))).ok());
  EXPECT_FALSE(f->validate(Params(w).set("pingpong", std::int64_t(1)).set("overlap", std::int64_t(0))).ok())
      << "pingpong needs overlap";
  EXPECT_FALSE(f->validate(Params(w).set("path", "mma")).ok()) << "overlap is for wgmma";
  EXPECT_FALSE(f->validate(Params(w).set("head_dim", std::int64_t(256)).set("head_dim_v", std::int64_t(256))).ok())
      << "block_n 128 at 256/256: over 227 KiB";
  EXPECT_FALSE(f->validate(Params(w).set("path", "mma").set("overlap", std::int64_t(0)).set("persistent", std::int64_t(1)))
                   .ok())
      << "persistent is for wgmma";
  EXPECT_FALSE(f->validate(Params(w).set("path", "mma").set("overlap", std::int64_t(0)).set("warps", std::int64_t(12)))
                   .ok())
      << "the mma kernel has no third consumer";
  // Three consumers hold head_dim_v / 2 + block_n / 2 (+ block_n / 4 overlapped) <= 96 registers
  // of accumulators.
  EXPECT_FALSE(f->validate(Params(w).set("warps", std::int64_t(12)).set("block_n", std::int64_t(64))).ok())
      << "128/128 overlapped";
  EXPECT_TRUE(
      f->validate(Params(w).set("warps", std::int64_t(12)).set("block_n", std::int64_t(64)).set("overlap", std::int64_t(0)))
          .ok());
  Params three = Params(w)
                     .set("warps", std::int64_t(12))
                     .set("head_dim", std::int64_t(64))
                     .set("head_dim_v", std::int64_t(64))
                     .set("pingpong", std::int64_t(1));
  EXPECT_FALSE(f->validate(three).ok()) << "64/64 overlapped with 128-key tiles";
  EXPECT_TRUE(f->validate(Params(three).set("overlap", std::int64_t(0)).set("pingpong", std::int64_t(0))).ok());
  three.set("block_n", std::int64_t(64));
  ASSERT_TRUE(f->validate(three).ok());
  // 192 query rows a block and four warpgroups; the Q box follows the rows.
  const Problem p64 = problem(DType::bf16, 64, 64, 90);
  LaunchGeometry g = f->geometry(three, p64);
  EXPECT_EQ(g.block.x, 512u);
  EXPECT_EQ(g.grid.x, 6u);  // 1000 queries in blocks of 192
  ArgPack args;
  std::vector<void*> bufs(7, reinterpret_cast<void*>(std::uintptr_t(256)));
  f->pack_args(three, p64, bufs, args);
  EXPECT_EQ(args.tensor_map_request(0).box_rows, 192u);
  EXPECT_EQ(f->geometry(three, p64).shared_bytes, families::attention_sm90_smem_bytes(64, 64, 12, 64, 4));
  // Persistent: one block per SM over the 6 x 8 x 2 tiles; every tile its own block when the SM
  // count is unknown, and the grid never larger than the tiles.
  Problem with_sms = p64;
  with_sms.sm_count = 20;
  g = f->geometry(Params(three).set("persistent", std::int64_t(1)), with_sms);
  EXPECT_EQ(g.grid.x, 20u);
  EXPECT_EQ(g.grid.y * g.grid.z, 1u);
  with_sms.sm_count = 132;
  EXPECT_EQ(f->geometry(Params(three).set("persistent", std::int64_t(1)), with_sms).grid.x, 96u);
  EXPECT_EQ(f->geometry(Params(three).set("persistent", std::int64_t(1)), p64).grid.x, 96u);
}

// Tuning results are stored per signature: a window (and its size, by power-of-two bucket) is part
// of it, so a winner tuned without a window never serves a windowed call.
TEST(AttentionCpu, TheTuningSignatureCarriesTheWindow) {
  const Family* f = Registry::global().find("attention");
  ASSERT_NE(f, nullptr);
  auto problem = [](std::int64_t left, std::int64_t right) {
    families::AttentionProblem a;
    a.batch = 2;
    a.seqlen_q = a.seqlen_k = 4096;
    a.total_q = a.total_k = 8192;
    a.heads = a.kv_heads = 8;
    a.head_dim = a.head_dim_v = 128;
    a.causal = right == 0;
    a.window_left = left;
    a.window_right = right;
    a.scale = 0.1;
    return Problem::of(DType::bf16, 16, a);
  };
  const std::string none = f->signature(problem(-1, -1)), causal = f->signature(problem(-1, 0));
  EXPECT_NE(none, causal);
  EXPECT_NE(causal, f->signature(problem(128, 0)));
  EXPECT_NE(f->signature(problem(128, 0)), f->signature(problem(4096, 0)));
  EXPECT_NE(f->signature(problem(100, 0)), f->signature(problem(0, 100)));
  EXPECT_EQ(f->signature(problem(1000, 0)), f->signature(problem(1024, 0))) << "one bucket";
  EXPECT_NE(none.find("window_left=-1,window_right=-1"), std::string::npos) << none;
  EXPECT_NE(f->signature(problem(1000, 3)).find("window_left=1024,window_right=4"), std::string::npos);
  // The tuned instance takes the bucket's bound on each bounded side.
  const auto t = f->tuning_problem(problem(1000, 3)).as<families::AttentionProblem>();
  EXPECT_EQ(t.window_left, 1024);
  EXPECT_EQ(t.window_right, 4);
  const auto c = f->tuning_problem(problem(-1, 0)).as<families::AttentionProblem>();
  EXPECT_EQ(c.window_left, -1);
  EXPECT_EQ(c.window_right, 0);
}

TEST(AttentionCpu, DeclaresPaddedAndPackedOps) {
  for (const char* name : {"attention", "attention_varlen"}) {
    const OpDecl* op = Registry::global().find_op(name);
    ASSERT_NE(op, nullptr) << name;
    EXPECT_TRUE(op->check().ok());
    EXPECT_EQ(op->backward, std::string(name) + "_backward");
    const auto j = nlohmann::json::parse(op->describe());
    std::vector<std::string> names;
    for (const auto& t : j["tensors"]) names.push_back(t["name"].get<std::string>());
    EXPECT_EQ(names.back(), "lse");
    EXPECT_EQ(names[names.size() - 2], "out");
  }
  // The declaration runs the typed op: an op call on host tensors, lse skipped, defaults given.
  const OpDecl* op = Registry::global().find_op("attention");
  Case c{"decl", {9}, {12}, 2, 1, 16, 8, opts(true), false};
  Data d = make_data(c, DType::f32, 7);
  std::vector<unsigned char> out(std::size_t(9 * 2 * 8) * 4);
  auto q = host(d.qb, DType::f32, {1, 9, 2, 16}), k = host(d.kb, DType::f32, {1, 12, 1, 16}),
       v = host(d.vb, DType::f32, {1, 12, 1, 8}), o = host(out, DType::f32, {1, 9, 2, 8});
  const TensorView* ts[5] = {&q, &k, &v, &o, nullptr};
  OpValue sc[6];
  sc[0].f64 = 0;
  sc[1].i64 = 1;
  sc[2].i64 = -1;
  sc[3].i64 = -1;
  sc[4].f64 = 0;
  sc[5].i64 = 0;  // deterministic: the backward's mode
  OpCall call{ts, sc};
  ASSERT_TRUE(check_op_call(*op, call).ok());
  ASSERT_TRUE(op->run(call).ok());
  std::vector<double> want, want_lse;
  naive(c, d, want, want_lse);
  for (std::size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(load_as_double(out.data(), DType::f32, std::int64_t(i)), want[i], 1e-5) << i;
  OutputShape shapes[2];
  ASSERT_TRUE(op->infer(call, shapes).ok());
  EXPECT_EQ(shapes[0].rank, 4);
  EXPECT_EQ(shapes[0].shape[3], 8);
  EXPECT_EQ(shapes[1].rank, 3);
  EXPECT_EQ(shapes[1].shape[1], 2);
  EXPECT_EQ(shapes[1].shape[2], 9);
}

}  // namespace
}  // namespace kiln
