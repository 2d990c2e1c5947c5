// The rope_hf_bwd family and rms_norm_rope_backward on the CPU: the rotation's transpose against
// hand values, the op against finite differences of an fp64 forward, the heuristic, problem
// checks, the catalog (compiled through NVRTC by tests/conformance), and the typed op's errors
// (none of which may resolve a kernel).
#include "families/rmsnorm_rope/rope_hf_bwd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "common/half.h"
#include "families/rmsnorm_rope/ops.h"
#include "families/rmsnorm_rope/tests/rope_bwd_ref.h"

namespace kiln::families {
namespace {

const Family& rope_bwd() { return *Registry::global().find("rope_hf_bwd"); }

Problem problem(DType t, std::int64_t rows, std::int64_t hidden, std::int64_t d, std::int64_t seq,
                DType cos_dtype = DType::f32, std::uint32_t align = 16) {
  return Problem::of(t, align,
                     RopeHfBwdProblem{.rows = rows, .hidden = hidden, .head_dim = d, .seq = seq,
                                      .num_heads = d ? hidden / d : 0, .cos_dtype = std::int64_t(cos_dtype)});
}

TEST(RopeHfBwd, ReferenceIsTheTransposeWithBothHalvesOfTheTables) {
  // One head of 64 at two positions. dout[j] = 1 + j; cos 0.5 / 0.25 and sin 0.75 / -1 in the
  // first / second half at position 0, the identity at position 1.
  const std::int64_t d = 64, seq = 2;
  std::vector<float> dout(seq * d), cos(seq * d), sin(seq * d, 0.f), dn(seq * d, -7.f);
  for (int j = 0; j < seq * d; ++j) dout[j] = float(1 + j % d);
  for (int j = 0; j < d; ++j) {
    cos[j] = j < 32 ? 0.5f : 0.25f;
    sin[j] = j < 32 ? 0.75f : -1.f;
    cos[d + j] = 1.f;
  }
  const Problem p = problem(DType::f32, seq, d, d, seq);
  void* b[4] = {dout.data(), cos.data(), sin.data(), dn.data()};
  ASSERT_TRUE(rope_bwd().cpu_reference(rope_bwd().heuristic(p), p, b).ok());
  for (int j = 0; j < 32; ++j) {
    const double g1 = 1 + j, g2 = 33 + j;
    EXPECT_DOUBLE_EQ(dn[j], g1 * 0.5 + g2 * -1.0) << j;
    EXPECT_DOUBLE_EQ(dn[j + 32], g2 * 0.25 - g1 * 0.75) << j;
    EXPECT_EQ(dn[d + j], dout[d + j]);
    EXPECT_EQ(dn[d + j + 32], dout[d + j + 32]);
  }
}

TEST(RopeHfBwd, ReferenceUndoesAPureRotationInPlaceInBf16) {
  // cos = cos(a), sin = sin(a) in both halves: the transpose is the inverse rotation, so
  // R^T(R(v)) = v. dn is dout (in place).
  const std::int64_t d = 128;
  std::vector<double> v(d), cs(d), sn(d);
  std::vector<std::uint16_t> g(d), c(d), s(d);
  for (int j = 0; j < 64; ++j) {
    const double a = 0.1 * j;
    cs[j] = cs[j + 64] = std::cos(a);
    sn[j] = sn[j + 64] = std::sin(a);
  }
  for (int j = 0; j < d; ++j) {
    v[j] = std::sin(1.0 + j);
    c[j] = float_to_bf16(float(cs[j]));
    s[j] = float_to_bf16(float(sn[j]));
  }
  for (int j = 0; j < 64; ++j) {
    g[j] = float_to_bf16(float(v[j] * cs[j] - v[j + 64] * sn[j]));
    g[j + 64] = float_to_bf16(float(v[j + 64] * cs[j] + v[j] * sn[j]));
  }
  const Problem p = problem(DType::bf16, 1, d, d, 1, DType::bf16);
  void* b[4] = {g.data(), c.data(), s.data(), g.data()};
  ASSERT_TRUE(rope_bwd().cpu_reference(rope_bwd().heuristic(p), p, b).ok());
  for (int j = 0; j < d; ++j) EXPECT_NEAR(bf16_to_float(g[j]), v[j], 2e-2) << j;
}

TEST(RopeHfBwd, HeuristicPicksTheWidestAlignedAccess) {
  EXPECT_EQ(rope_hf_bwd_heuristic(problem(DType::bf16, 64, 4096, 128, 64)).vec, 8);
  EXPECT_EQ(rope_hf_bwd_heuristic(problem(DType::bf16, 64, 4096, 128, 64)).block, 256);
  EXPECT_EQ(rope_hf_bwd_heuristic(problem(DType::f32, 1, 4096, 64, 1)).vec, 4);
  EXPECT_EQ(rope_hf_bwd_heuristic(problem(DType::bf16, 1, 4096, 128, 1, DType::f32, 8)).vec, 2);
  EXPECT_EQ(rope_hf_bwd_heuristic(problem(DType::bf16, 1, 4096, 128, 1, DType::bf16, 8)).vec, 4);
  EXPECT_EQ(rope_hf_bwd_heuristic(problem(DType::f16, 1, 4096, 128, 1, DType::f32, 2)).vec, 1);
  for (auto d : {64, 80, 96, 128, 256})
    for (auto t : {DType::f32, DType::f16, DType::bf16})
      for (DType c : {DType::f32, t})
        for (std::uint32_t align : {2u, 4u, 8u, 16u}) {
          if (t == DType::f32 && align < 4) continue;
          const Problem p = problem(t, 6, 14 * d, d, 3, c, align);
          const Params params = rope_bwd().heuristic(p);
          EXPECT_TRUE(rope_bwd().validate(params).ok()) << params.canonical();
          EXPECT_TRUE(rope_bwd().check_problem(params, p).ok()) << params.canonical();
        }
}

TEST(RopeHfBwd, CheckProblemAndValidateRejectMismatches) {
  Params bf16{{"dtype", std::string("bf16")}, {"cos_dtype", std::string("f32")}, {"head_dim", std::int64_t(128)},
              {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}};
  EXPECT_TRUE(rope_bwd().check_problem(bf16, problem(DType::bf16, 8, 4096, 128, 4)).ok());
  EXPECT_EQ(rope_bwd().check_problem(bf16, problem(DType::f16, 8, 4096, 128, 4)).code(), Code::unsupported_dtype);
  EXPECT_EQ(rope_bwd().check_problem(bf16, problem(DType::bf16, 8, 4096, 128, 4, DType::bf16)).code(),
            Code::unsupported_dtype);
  EXPECT_EQ(rope_bwd().check_problem(bf16, problem(DType::bf16, 8, 4096, 64, 4)).code(), Code::shape_mismatch);
  EXPECT_EQ(rope_bwd().check_problem(bf16, problem(DType::bf16, 8, 4096, 128, 3)).code(), Code::shape_mismatch);
  EXPECT_EQ(rope_bwd().check_problem(bf16, problem(DType::bf16, 8, 4096, 128, 4, DType::f32, 8)).code(),
            Code::invalid_argument);
  Params p = bf16;
  p.set("dtype", "f16").set("cos_dtype", "bf16");
  EXPECT_EQ(rope_bwd().validate(p).code(), Code::invalid_argument);  // cos neither f32 nor dtype
  p.set("dtype", "f32").set("cos_dtype", "f32");
  EXPECT_EQ(rope_bwd().validate(p).code(), Code::invalid_argument);  // 32-byte access
  p.set("vec", std::int64_t(4)).set("head_dim", std::int64_t(100));
  EXPECT_EQ(rope_bwd().validate(p).code(), Code::invalid_argument);
}

TEST(RopeHfBwd, CatalogIsValidAndRendersDistinctNames) {
  const auto cat = rope_bwd().catalog();
  EXPECT_EQ(cat.size(), 25u);  // 5 dtype/cos pairs x 5 head dims
  std::set<std::string> names;
  for (const auto& p : cat) {
    ASSERT_TRUE(rope_bwd().validate(p).ok()) << p.canonical();
    auto r = rope_bwd().render(p);
    ASSERT_TRUE(r.ok());
    names.insert(r->name_expression);
  }
  EXPECT_EQ(names.size(), cat.size());
}

TEST(RopeHfBwd, GeometryArgsAndBuffers) {
  const Problem p = problem(DType::bf16, 6, 4096, 128, 3, DType::bf16);
  const Params h = rope_bwd().heuristic(p);
  const LaunchGeometry g = rope_bwd().geometry(h, p);
  EXPECT_EQ(g.block.x, 256u);
  EXPECT_EQ(g.grid.x, 6u);  // 6 rows x 256 items of 8 pairs, one per thread
  ArgPack args;
  int bufs[4];
  void* b[4];
  for (int i = 0; i < 4; ++i) b[i] = &bufs[i];
  rope_bwd().pack_args(h, p, b, args);
  ASSERT_EQ(args.count(), 7u);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[3]), &bufs[3]);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[4]), 6);
  EXPECT_EQ(*static_cast<int*>(args.pointers()[5]), 4096);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[6]), 3);
  const auto bs = rope_bwd().buffers(h, p);
  ASSERT_EQ(bs.size(), 4u);
  EXPECT_EQ(bs[0].elements, 6 * 4096);
  EXPECT_EQ(bs[1].elements, 3 * 128);
  EXPECT_EQ(bs[3].role, BufferRole::output);
  EXPECT_FALSE(rope_bwd().tuning_space(p).empty());
}

// --- the typed op on the CPU ------------------------------------------------------------------

struct HostCase {
  testing::RopeShape s;
  std::int64_t batch;
  std::vector<double> x, w, cos, sin, dout;
};

HostCase host_case(std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t d, unsigned seed) {
  HostCase c{{batch * seq, seq, heads, d, 1e-5}, batch, {}, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<double> n(0, 1);
  std::uniform_real_distribution<double> a(-3.1, 3.1);
  const std::int64_t hidden = heads * d, size = batch * seq * hidden;
  for (std::int64_t i = 0; i < size; ++i) c.x.push_back(float(n(rng))), c.dout.push_back(float(n(rng)));
  for (std::int64_t i = 0; i < hidden; ++i) c.w.push_back(float(1 + 0.3 * n(rng)));
  // Independent angles per element: the two halves' tables differ, as they may in the op.
  for (std::int64_t i = 0; i < seq * d; ++i) {
    const double t = a(rng);
    c.cos.push_back(float(std::cos(t)));
    c.sin.push_back(float(std::sin(t)));
  }
  return c;
}

std::vector<float> as_f32(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

// The op on host f32 tensors: (dx, dw).
Status run_host(const HostCase& c, std::vector<float>& dx, std::vector<float>& dw, bool in_place = false) {
  auto x = as_f32(c.x), w = as_f32(c.w), cos = as_f32(c.cos), sin = as_f32(c.sin), dout = as_f32(c.dout);
  const std::int64_t hidden = c.s.hidden(), seq = c.s.seq;
  dw.assign(std::size_t(hidden), -1.f);
  dx.assign(dout.size(), -1.f);
  float* dx_data = in_place ? dout.data() : dx.data();
  const Device h = Device::cpu();
  Status st = rms_norm_rope_backward(
      TensorView::contiguous(dout.data(), DType::f32, {c.batch, seq, hidden}, h),
      TensorView::contiguous(x.data(), DType::f32, {c.batch, seq, hidden}, h),
      TensorView::contiguous(w.data(), DType::f32, {hidden}, h),
      TensorView::contiguous(cos.data(), DType::f32, {seq, c.s.d}, h),
      TensorView::contiguous(sin.data(), DType::f32, {seq, c.s.d}, h), c.s.eps, c.s.heads,
      TensorView::contiguous(dx_data, DType::f32, {c.batch, seq, hidden}, h),
      TensorView::contiguous(dw.data(), DType::f32, {hidden}, h));
  if (in_place) dx = dout;
  return st;
}

TEST(RmsNormRopeBackward, HostOpMatchesFiniteDifferencesOfTheForward) {
  // batch 2, seq 3, 3 heads of 64: loss = sum(out * dout), central differences in fp64.
  HostCase c = host_case(2, 3, 3, 64, 7);
  std::vector<float> dx, dw;
  ASSERT_TRUE(run_host(c, dx, dw).ok());
  auto loss = [&](const std::vector<double>& x, const std::vector<double>& w) {
    const auto out = testing::rms_norm_rope_fwd(c.s, x, w, c.cos, c.sin);
    double l = 0;
    for (std::size_t i = 0; i < out.size(); ++i) l += out[i] * c.dout[i];
    return l;
  };
  const double h = 1e-5;
  double worst = 0;
  for (std::size_t i = 0; i < c.x.size(); i += 7) {
    auto xp = c.x, xm = c.x;
    xp[i] += h, xm[i] -= h;
    const double fd = (loss(xp, c.w) - loss(xm, c.w)) / (2 * h);
    worst = std::max(worst, std::abs(fd - dx[i]) / (1 + std::abs(fd)));
  }
  for (std::size_t i = 0; i < c.w.size(); ++i) {
    auto wp = c.w, wm = c.w;
    wp[i] += h, wm[i] -= h;
    const double fd = (loss(c.x, wp) - loss(c.x, wm)) / (2 * h);
    worst = std::max(worst, std::abs(fd - dw[i]) / (1 + std::abs(fd)));
  }
  EXPECT_LT(worst, 1e-4);
}

TEST(RmsNormRopeBackward, HostOpMatchesTheFp64ChainRuleInPlaceAndWithFourteenHeadsOf96) {
  HostCase c = host_case(1, 5, 14, 96, 11);
  std::vector<double> want_dx, want_dw;
  testing::rms_norm_rope_bwd(c.s, c.dout, c.x, c.w, c.cos, c.sin, want_dx, want_dw);
  for (bool in_place : {false, true}) {
    std::vector<float> dx, dw;
    ASSERT_TRUE(run_host(c, dx, dw, in_place).ok());
    for (std::size_t i = 0; i < dx.size(); ++i) ASSERT_NEAR(dx[i], want_dx[i], 1e-4 * (1 + std::abs(want_dx[i]))) << i;
    for (std::size_t i = 0; i < dw.size(); ++i) ASSERT_NEAR(dw[i], want_dw[i], 1e-4 * (1 + std::abs(want_dw[i]))) << i;
  }
}

// --- the typed op's errors: none may resolve a kernel -----------------------------------------

class RmsNormRopeBackwardOp : public ::testing::Test {
 protected:
  void SetUp() override {
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    rt_ = Runtime::create(o).value();
    const Device dev = Device::cuda(0);
    dout_ = TensorView::contiguous(gb_.data(), DType::bf16, {2, 4, 256}, dev);
    x_ = TensorView::contiguous(xb_.data(), DType::bf16, {2, 4, 256}, dev);
    w_ = TensorView::contiguous(wb_.data(), DType::bf16, {256}, dev);
    cos_ = TensorView::contiguous(cb_.data(), DType::bf16, {4, 64}, dev);
    sin_ = TensorView::contiguous(sb_.data(), DType::bf16, {4, 64}, dev);
    dx_ = TensorView::contiguous(ob_.data(), DType::bf16, {2, 4, 256}, dev);
    dw_ = TensorView::contiguous(vb_.data(), DType::bf16, {256}, dev);
  }
  void expect(const Status& s, Code c, const char* what) {
    EXPECT_EQ(s.code(), c) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
    RuntimeCounters k = rt_->counters();
    EXPECT_EQ(k.from_embedded + k.from_daemon + k.module_loads, 0) << what << " resolved a kernel";
  }
  Status run(const TensorView& g, const TensorView& x, const TensorView& w, const TensorView& c, const TensorView& s,
             const TensorView& dx, const TensorView& dw, double eps = 1e-6, std::int64_t heads = 0,
             const TensorView* ws = nullptr) {
    return rms_norm_rope_backward(g, x, w, c, s, eps, heads, dx, dw, nullptr, rt_.get(), ws);
  }
  Status run() { return run(dout_, x_, w_, cos_, sin_, dx_, dw_); }
  static TensorView host(TensorView t) {
    t.device = Device::cpu();
    return t;
  }
  static TensorView as(TensorView t, DType d) {
    t.dtype = d;
    return t;
  }
  std::shared_ptr<Runtime> rt_;
  std::vector<std::uint16_t> gb_ = std::vector<std::uint16_t>(2 * 4 * 512), xb_ = gb_, ob_ = gb_,
                             wb_ = std::vector<std::uint16_t>(512), vb_ = wb_,
                             cb_ = std::vector<std::uint16_t>(4 * 128), sb_ = cb_;
  TensorView dout_, x_, w_, cos_, sin_, dx_, dw_;
};

TEST_F(RmsNormRopeBackwardOp, DeviceErrors) {
  expect(run(dout_, x_, w_, host(cos_), sin_, dx_, dw_), Code::device_error, "cos on the host");
  expect(run(host(dout_), host(x_), host(w_), host(cos_), host(sin_), dx_, host(dw_)), Code::device_error,
         "dx on the GPU, the rest on the host");
  std::vector<float> ws(64);
  const TensorView wsv = TensorView::contiguous(ws.data(), DType::f32, {64}, Device::cpu());
  expect(run(host(dout_), host(x_), host(w_), host(cos_), host(sin_), host(dx_), host(dw_), 1e-6, 0, &wsv),
         Code::device_error, "a workspace with host tensors");
  // Host memory labelled as CUDA: caught by the pointer check, before any launch.
  expect(run(), Code::device_error, "host pointers labelled cuda");
}

TEST_F(RmsNormRopeBackwardOp, ShapeErrors) {
  const Device dev = Device::cuda(0);
  auto x2 = TensorView::contiguous(xb_.data(), DType::bf16, {8, 256}, dev);
  expect(run(TensorView::contiguous(gb_.data(), DType::bf16, {8, 256}, dev), x2, w_, cos_, sin_,
             TensorView::contiguous(ob_.data(), DType::bf16, {8, 256}, dev), dw_),
         Code::shape_mismatch, "x rank 2");
  expect(run(TensorView::contiguous(gb_.data(), DType::bf16, {2, 4, 128}, dev), x_, w_, cos_, sin_, dx_, dw_),
         Code::shape_mismatch, "dout shape");
  expect(run(dout_, x_, w_, cos_, sin_, TensorView::contiguous(ob_.data(), DType::bf16, {2, 4, 128}, dev), dw_),
         Code::shape_mismatch, "dx shape");
  expect(run(dout_, x_, w_, cos_, sin_, dx_, TensorView::contiguous(vb_.data(), DType::bf16, {128}, dev)),
         Code::shape_mismatch, "dw length");
  auto c3 = TensorView::contiguous(cb_.data(), DType::bf16, {3, 64}, dev);
  expect(run(dout_, x_, w_, c3, c3, dx_, dw_), Code::shape_mismatch, "cos positions != seq");
  expect(run(dout_, x_, w_, cos_, TensorView::contiguous(sb_.data(), DType::bf16, {1, 4, 1, 64}, dev), dx_, dw_),
         Code::shape_mismatch, "sin shape differs from cos");
  auto odd = TensorView::contiguous(cb_.data(), DType::bf16, {4, 63}, dev);
  expect(run(dout_, x_, w_, odd, odd, dx_, dw_), Code::shape_mismatch, "odd head_dim");
  auto c32 = TensorView::contiguous(cb_.data(), DType::bf16, {4, 32}, dev);
  expect(run(dout_, x_, w_, c32, c32, dx_, dw_), Code::invalid_argument, "head_dim 32 has no kernel");
  expect(run(dout_, x_, w_, cos_, sin_, dx_, dw_, 1e-6, 3), Code::shape_mismatch, "num_heads * head_dim != hidden");
  auto gs = dout_;
  gs.strides[0] = 2048;
  expect(run(gs, x_, w_, cos_, sin_, dx_, dw_), Code::shape_mismatch, "dout not contiguous");
}

TEST_F(RmsNormRopeBackwardOp, DtypeErrors) {
  expect(run(dout_, as(x_, DType::i32), w_, cos_, sin_, dx_, dw_), Code::unsupported_dtype, "int x");
  expect(run(as(dout_, DType::f16), x_, w_, cos_, sin_, dx_, dw_), Code::unsupported_dtype, "dout dtype");
  expect(run(dout_, x_, w_, cos_, sin_, dx_, as(dw_, DType::f32)), Code::unsupported_dtype, "dw dtype");
  expect(run(dout_, x_, w_, as(cos_, DType::f16), as(sin_, DType::f16), dx_, dw_), Code::unsupported_dtype,
         "f16 cos, bf16 x");
  expect(run(dout_, x_, w_, as(cos_, DType::f32), sin_, dx_, dw_), Code::unsupported_dtype, "cos and sin differ");
  const TensorView ws = TensorView::contiguous(cb_.data(), DType::bf16, {64}, Device::cuda(0));
  expect(run(dout_, x_, w_, cos_, sin_, dx_, dw_, 1e-6, 0, &ws), Code::unsupported_dtype, "bf16 workspace");
}

TEST_F(RmsNormRopeBackwardOp, ArgumentErrors) {
  auto null_x = x_;
  null_x.data = nullptr;
  expect(run(dout_, null_x, w_, cos_, sin_, dx_, dw_), Code::invalid_argument, "null x");
  expect(run(dout_, x_, w_, cos_, sin_, dx_, dw_, -1.0), Code::invalid_argument, "negative eps");
  expect(run(dout_, x_, w_, cos_, sin_, dx_, dw_, NAN), Code::invalid_argument, "nan eps");
  expect(run(dout_, x_, w_, cos_, sin_, dx_, dw_, 1e-6, -4), Code::invalid_argument, "negative num_heads");
  auto shifted = dx_;
  shifted.data = gb_.data() + 8;
  expect(run(dout_, x_, w_, cos_, sin_, shifted, dw_), Code::invalid_argument, "dx partly overlaps dout");
  expect(run(dout_, x_, w_, cos_, sin_, x_, dw_), Code::invalid_argument, "dx is x");
  auto dw_on_w = dw_;
  dw_on_w.data = wb_.data();
  expect(run(dout_, x_, w_, cos_, sin_, dx_, dw_on_w), Code::invalid_argument, "dw is weight");
  auto odd = dout_;
  odd.data = reinterpret_cast<char*>(gb_.data()) + 1;
  expect(run(odd, x_, w_, cos_, sin_, dx_, dw_), Code::invalid_argument, "dout not aligned to its element size");
}

}  // namespace
}  // namespace kiln::families
