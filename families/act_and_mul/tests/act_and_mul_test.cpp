// Activation-and-mul on the CPU: the reference against hand-computed values for each activation,
// the host side of the kernel's fast division, the heuristic, problem checks, argument packing,
// every catalog variant through NVRTC for sm_80 and sm_90a, and the typed op's fallback and error
// paths (which must resolve nothing).
#include "families/act_and_mul/act_and_mul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "common/half.h"
#include "families/act_and_mul/ops.h"
#include "kiln/ops.h"
#include "tests/test_util.h"

namespace kiln::families {
namespace {

const Family& fam() { return *Registry::global().find("act_and_mul"); }

Problem problem(DType t, std::int64_t rows, std::int64_t d, int act = k_am_silu, std::int64_t xs = 0,
                std::int64_t os = 0, std::uint32_t align = 16) {
  return Problem::of(t, align,
                     ActAndMulProblem{.rows = rows,
                                      .d = d,
                                      .x_row_stride = xs ? xs : 2 * d,
                                      .out_row_stride = os ? os : d,
                                      .activation = act});
}

Params variant(const char* act, const char* dtype, std::int64_t block, std::int64_t vec) {
  return Params{{"act", std::string(act)}, {"dtype", std::string(dtype)}, {"block", block}, {"vec", vec}};
}

TEST(ActAndMul, ReferenceMatchesHandComputedValues) {
  // Rows [a0, a1 | b0, b1] = [1, -1 | 2, 3], out = [act(1) * 2, act(-1) * 3].
  struct Want {
    int act;
    double at_1, at_minus_1;
  };
  const Want wants[] = {
      {k_am_silu, 0.7310585786300049, -0.2689414213699951},        // 1 / (1 + e^-1), -1 / (1 + e)
      {k_am_gelu, 0.8413447460685429, -0.15865525393145707},       // Phi(1), -Phi(-1)
      {k_am_gelu_tanh, 0.8411919906082768, -0.15880800939172324},  // 0.5 (1 + tanh(0.79788 * 1.044715))
  };
  for (const auto& w : wants) {
    std::vector<float> x = {1, -1, 2, 3}, out(2, NAN);
    Problem p = problem(DType::f32, 1, 2, w.act);
    void* b[2] = {x.data(), out.data()};
    ASSERT_TRUE(fam().cpu_reference(fam().heuristic(p), p, b).ok());
    EXPECT_NEAR(out[0], w.at_1 * 2, 1e-6) << w.act;
    EXPECT_NEAR(out[1], w.at_minus_1 * 3, 1e-6) << w.act;
  }
}

TEST(ActAndMul, ReferenceKeepsFarNegativeGatesAccurate) {
  // act(-10) * 1 in f32: 1 + erf and 1 + tanh cancel to 0 in double there; the reference's forms
  // must not (values from 0.5 v erfc(-v / sqrt(2)) and v / (1 + exp(-2u)) in double).
  struct Want {
    int act;
    double at_minus_10;
  };
  const Want wants[] = {{k_am_silu, -4.539786870243439e-4},
                        {k_am_gelu, -7.619853024160593e-23},
                        {k_am_gelu_tanh, -1.2040923482098023e-37}};
  for (const auto& w : wants) {
    std::vector<float> x = {-10, 1}, out(1, NAN);
    Problem p = problem(DType::f32, 1, 1, w.act);
    void* b[2] = {x.data(), out.data()};
    ASSERT_TRUE(fam().cpu_reference(fam().heuristic(p), p, b).ok());
    EXPECT_NEAR(out[0] / w.at_minus_10, 1.0, 1e-6) << w.act << ": " << out[0];
  }
}

TEST(ActAndMul, ReferenceHonoursStridesHalfTypesAndInPlace) {
  // Two rows with d = 2 in x rows of stride 6 and out rows of stride 3; padding stays.
  const float xv[] = {0, 1, 5, 7, 9, 9, -1, 2, 4, 0.5f, 9, 9};
  std::vector<std::uint16_t> x(12), out(6, 0xBEEF);
  for (int i = 0; i < 12; ++i) x[i] = float_to_bf16(xv[i]);
  Problem p = problem(DType::bf16, 2, 2, k_am_silu, 6, 3);
  void* b[2] = {x.data(), out.data()};
  ASSERT_TRUE(fam().cpu_reference(fam().heuristic(p), p, b).ok());
  EXPECT_EQ(bf16_to_float(out[0]), 0.0f);  // silu(0) * 5
  EXPECT_NEAR(bf16_to_float(out[1]), 0.7310585786 * 7, 2e-2);
  EXPECT_NEAR(bf16_to_float(out[3]), -0.2689414214 * 4, 1e-2);
  EXPECT_NEAR(bf16_to_float(out[4]), 1.7615941560 * 0.5, 1e-2);
  EXPECT_EQ(out[2], 0xBEEF);
  EXPECT_EQ(out[5], 0xBEEF);
  // In place: out = x[..., :d], same row stride as x.
  Problem inplace = problem(DType::bf16, 2, 2, k_am_silu, 6, 6);
  void* bi[2] = {x.data(), x.data()};
  ASSERT_TRUE(fam().cpu_reference(fam().heuristic(inplace), inplace, bi).ok());
  EXPECT_EQ(x[0], out[0]);
  EXPECT_EQ(x[1], out[1]);
  EXPECT_EQ(x[6], out[3]);
  EXPECT_EQ(x[7], out[4]);
  EXPECT_EQ(x[8], float_to_bf16(4));  // the gate half is read, never written
}

TEST(ActAndMul, FastDivisionIsExactBelow2To31) {
  std::mt19937 rng(testing::fresh_seed());
  std::uniform_int_distribution<std::uint32_t> any(0, 0x7fffffffu);
  for (std::uint32_t d : {1u, 2u, 3u, 7u, 256u, 512u, 1376u, 1792u, 1000003u, (1u << 20) + 1, 0x40000001u, 0x7fffffffu}) {
    const FastDiv f = fast_div(d);
    for (std::uint32_t n : {0u, 1u, d - 1, d, d + 1, 2 * d - 1, 0x7ffffffeu, 0x7fffffffu})
      if (n <= 0x7fffffffu) {
        EXPECT_EQ(fast_div_apply(f, n), n / d) << n << " / " << d;
      }
    for (int i = 0; i < 20000; ++i) {
      const std::uint32_t n = any(rng);
      ASSERT_EQ(fast_div_apply(f, n), n / d) << n << " / " << d;
    }
  }
}

TEST(ActAndMul, HeuristicPicksWidestAlignedAccessAndBlock) {
  auto h = act_and_mul_heuristic(problem(DType::bf16, 32768, 11008));
  EXPECT_EQ(h.vec, 4);  // 8-byte accesses
  EXPECT_EQ(h.block, 128);
  EXPECT_EQ(act_and_mul_heuristic(problem(DType::bf16, 1, 4096)).block, 128);
  EXPECT_EQ(act_and_mul_heuristic(problem(DType::f32, 4096, 4096)).vec, 2);
  EXPECT_EQ(act_and_mul_heuristic(problem(DType::bf16, 4, 4099)).vec, 1);   // odd d: the gate half misaligns
  EXPECT_EQ(act_and_mul_heuristic(problem(DType::f16, 4, 4098)).vec, 2);
  EXPECT_EQ(act_and_mul_heuristic(problem(DType::bf16, 4, 4096, k_am_silu, 8200)).vec, 4);
  EXPECT_EQ(act_and_mul_heuristic(problem(DType::bf16, 4, 4096, k_am_silu, 8194)).vec, 2);
  EXPECT_EQ(act_and_mul_heuristic(problem(DType::bf16, 4, 4096, k_am_silu, 0, 0, 4)).vec, 2);
  for (int act : {k_am_silu, k_am_gelu, k_am_gelu_tanh})
    for (auto d : {1, 3, 7, 64, 1000, 4095, 4096, 11008, 14336})
      for (auto t : {DType::f32, DType::f16, DType::bf16}) {
        Problem p = problem(t, 3, d, act);
        const Params params = fam().heuristic(p);
        EXPECT_TRUE(fam().check_problem(params, p).ok()) << d;
        EXPECT_EQ(*params.get_str("act"), act == k_am_silu ? "silu" : act == k_am_gelu ? "gelu" : "gelu_tanh");
      }
}

TEST(ActAndMul, CheckProblemRejectsMismatches) {
  const Params v = variant("silu", "bf16", 256, 8);
  EXPECT_TRUE(fam().check_problem(v, problem(DType::bf16, 2, 64)).ok());
  EXPECT_EQ(fam().check_problem(v, problem(DType::f16, 2, 64)).code(), Code::unsupported_dtype);
  EXPECT_EQ(fam().check_problem(v, problem(DType::bf16, 2, 64, k_am_gelu)).code(), Code::invalid_argument);
  EXPECT_EQ(fam().check_problem(v, problem(DType::bf16, 2, 64, 3)).code(), Code::invalid_argument);
  EXPECT_EQ(fam().check_problem(v, problem(DType::bf16, 2, 60)).code(), Code::invalid_argument);
  EXPECT_EQ(fam().check_problem(v, problem(DType::bf16, 2, 64, k_am_silu, 0, 0, 8)).code(), Code::invalid_argument);
  EXPECT_EQ(fam().check_problem(v, problem(DType::bf16, 2, 64, k_am_silu, 120)).code(), Code::shape_mismatch);
  EXPECT_EQ(fam().check_problem(v, problem(DType::bf16, 2, 64, k_am_silu, 0, 32)).code(), Code::shape_mismatch);
  EXPECT_EQ(fam().check_problem(v, problem(DType::bf16, 2, 0)).code(), Code::shape_mismatch);
}

TEST(ActAndMul, ValidateRejectsBadParams) {
  EXPECT_EQ(fam().validate(variant("relu", "bf16", 256, 8)).code(), Code::invalid_argument);
  EXPECT_EQ(fam().validate(variant("silu", "f32", 256, 8)).code(), Code::invalid_argument);  // 32-byte access
  EXPECT_EQ(fam().validate(variant("silu", "bf16", 48, 8)).code(), Code::invalid_argument);
  Params missing{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}};
  EXPECT_EQ(fam().validate(missing).code(), Code::invalid_argument);
}

TEST(ActAndMul, ArgsPackInKernelOrderAndGridCoversEveryPack) {
  Problem p = problem(DType::bf16, 3, 1376 * 8, k_am_gelu, 2 * 1376 * 8 + 16, 1376 * 8 + 8);
  const Params params = variant("gelu", "bf16", 256, 8);
  ASSERT_TRUE(fam().check_problem(params, p).ok());
  ArgPack args;
  int a, b;
  void* bufs[2] = {&a, &b};
  fam().pack_args(params, p, bufs, args);
  ASSERT_FALSE(args.overflow());
  ASSERT_EQ(args.count(), 9u);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[0]), &a);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[1]), &b);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[2]), 3 * 1376);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[3]), 1376);
  const FastDiv f = fast_div(1376);
  EXPECT_EQ(*static_cast<unsigned*>(args.pointers()[4]), f.magic);
  EXPECT_EQ(*static_cast<unsigned*>(args.pointers()[5]), f.shift);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[6]), 1376 * 8);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[7]), 2 * 1376 * 8 + 16);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[8]), 1376 * 8 + 8);
  const LaunchGeometry g = fam().geometry(params, p);
  EXPECT_GE(std::int64_t(g.grid.x) * g.block.x, 3 * 1376);
  EXPECT_LT(std::int64_t(g.grid.x - 1) * g.block.x, 3 * 1376);
  auto bs = fam().buffers(params, p);
  ASSERT_EQ(bs.size(), 2u);
  EXPECT_EQ(bs[0].elements, 2 * (2 * 1376 * 8 + 16) + 2 * 1376 * 8);
  EXPECT_EQ(bs[1].elements, 2 * (1376 * 8 + 8) + 1376 * 8);
  EXPECT_EQ(bs[1].role, BufferRole::output);
}

// The typed op on host memory: the fallback, in place, and every error before any resolve.
class ActAndMulOp : public ::testing::Test {
 protected:
  void SetUp() override {
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    o.cache_file = (dir_.path() / "k.sqlite").string();
    rt_ = Runtime::create(o).value();
    std::mt19937 rng(testing::fresh_seed());
    std::normal_distribution<float> n;
    x_.resize(rows_ * 2 * d_);
    for (auto& e : x_) e = n(rng);
    out_.assign(rows_ * d_, NAN);
  }
  TensorView view(std::vector<float>& v, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(v.data(), DType::f32, shape, Device::cpu());
  }
  void expect(const Status& s, Code c, const char* what) {
    EXPECT_EQ(s.code(), c) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
    RuntimeCounters k = rt_->counters();
    EXPECT_EQ(k.from_embedded + k.from_daemon + k.module_loads, 0) << what << " resolved a kernel";
  }
  static constexpr std::int64_t rows_ = 6, d_ = 19;
  testing::TempDir dir_;
  std::shared_ptr<Runtime> rt_;
  std::vector<float> x_, out_;
};

TEST_F(ActAndMulOp, FallbackMatchesReferenceOutOfPlaceAndInPlace) {
  const Activation acts[] = {Activation::silu, Activation::gelu, Activation::gelu_tanh};
  for (int a = 0; a < 3; ++a) {
    ASSERT_TRUE(act_and_mul(view(x_, {2, 3, 2 * d_}), view(out_, {2, 3, d_}), acts[a], nullptr, rt_.get()).ok());
    for (std::int64_t r = 0; r < rows_; ++r)
      for (std::int64_t c = 0; c < d_; ++c) {
        const double v = x_[r * 2 * d_ + c], g = x_[r * 2 * d_ + d_ + c];
        const double act = a == 0   ? v / (1 + std::exp(-v))
                           : a == 1 ? 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)))
                                    : 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
        EXPECT_NEAR(out_[r * d_ + c], act * g, 1e-6 * (1 + std::fabs(act * g))) << a << " " << r << " " << c;
      }
  }
  // In place: out = x[..., :d], a view with x's row stride.
  std::vector<float> copy = x_;
  TensorView first_half = view(copy, {rows_, d_});
  first_half.strides[0] = 2 * d_;
  ASSERT_TRUE(act_and_mul(view(copy, {rows_, 2 * d_}), first_half, Activation::gelu_tanh, nullptr, rt_.get()).ok());
  for (std::int64_t r = 0; r < rows_; ++r)
    for (std::int64_t c = 0; c < d_; ++c) {
      EXPECT_EQ(copy[r * 2 * d_ + c], out_[r * d_ + c]);
      EXPECT_EQ(copy[r * 2 * d_ + d_ + c], x_[r * 2 * d_ + d_ + c]);
    }
  EXPECT_EQ(rt_->counters().module_loads, 0);
}

TEST_F(ActAndMulOp, Errors) {
  auto x = view(x_, {rows_, 2 * d_}), out = view(out_, {rows_, d_});
  auto call = [&](const TensorView& xv, const TensorView& ov, Activation a = Activation::silu) {
    return act_and_mul(xv, ov, a, nullptr, rt_.get());
  };
  expect(call(view(x_, {rows_, 2 * d_ - 1}), out), Code::shape_mismatch, "odd last dim");
  expect(call(x, view(out_, {rows_, d_ - 1})), Code::shape_mismatch, "out too short");
  expect(call(x, view(out_, {rows_ / 2, 2 * d_})), Code::shape_mismatch, "leading shape");
  expect(call(x, view(out_, {rows_ * d_})), Code::shape_mismatch, "rank");
  expect(call(view(x_, {rows_, 0}), view(out_, {rows_, 0})), Code::shape_mismatch, "empty");
  auto xt = x;
  xt.strides[1] = 2;
  expect(call(xt, out), Code::shape_mismatch, "non-contiguous last dim");
  auto xi = x, oi = out;
  xi.dtype = oi.dtype = DType::i64;
  expect(call(xi, oi), Code::unsupported_dtype, "int tensors");
  auto oh = out;
  oh.dtype = DType::f16;
  expect(call(x, oh), Code::unsupported_dtype, "dtypes differ");
  expect(call(x, out, static_cast<Activation>(7)), Code::invalid_argument, "unknown activation");
  auto null = x;
  null.data = nullptr;
  expect(call(null, out), Code::invalid_argument, "null x");
  auto xg = x, og = out;
  xg.device = og.device = Device::cuda(0);
  expect(call(xg, og), Code::device_error, "host pointers as cuda");
  expect(call(x, og), Code::device_error, "mixed devices");
  expect(call(x, view(x_, {rows_, d_})), Code::invalid_argument, "out packed over x's rows");
  auto shifted = view(x_, {rows_, d_});
  shifted.data = x_.data() + d_;
  shifted.strides[0] = 2 * d_;
  expect(call(x, shifted), Code::invalid_argument, "out over the gate half");
}

// ---- the backward (family act_and_mul_bwd, op act_and_mul_backward) ----

TEST(ActAndMulBwd, DerivativesMatchCentralDifferencesOfTheActivation) {
  // Over [-12, 12], where every form's pieces stay finite: (f(v + h) - f(v - h)) / 2h is off by
  // about h^2 |f'''| / 6 plus rounding of 1e-16 / h.
  for (int act = 0; act < 3; ++act)
    for (double v = -12.0; v <= 12.0; v += 0.0625) {
      const double h = 1e-5;
      const double numeric = (act_and_mul_activate(act, v + h) - act_and_mul_activate(act, v - h)) / (2 * h);
      EXPECT_NEAR(act_and_mul_derivative(act, v), numeric, 1e-8 * (1 + std::fabs(numeric))) << act << " at " << v;
    }
  // Hand-computed values: silu'(0) = gelu'(0) = 1/2, gelu'(1) = Phi(1) + phi(1).
  EXPECT_NEAR(act_and_mul_derivative(k_am_silu, 0.0), 0.5, 1e-15);
  EXPECT_NEAR(act_and_mul_derivative(k_am_gelu, 0.0), 0.5, 1e-15);
  EXPECT_NEAR(act_and_mul_derivative(k_am_gelu, 1.0), 0.8413447460685429 + 0.24197072451914337, 1e-14);
  EXPECT_NEAR(act_and_mul_derivative(k_am_gelu_tanh, 0.0), 0.5, 1e-15);
}

TEST(ActAndMulBwd, FamilyChecksAndHeuristic) {
  const Family& f = *Registry::global().find("act_and_mul_bwd");
  auto problem = [](std::int64_t d, std::int64_t xs, std::int64_t ys, std::int64_t dxs, std::uint32_t align = 16,
                    std::int64_t act = k_am_gelu) {
    return Problem::of(DType::bf16, align,
                       ActAndMulBwdProblem{.rows = 8, .d = d, .x_row_stride = xs, .dy_row_stride = ys,
                                           .dx_row_stride = dxs, .activation = act});
  };
  const Problem p = problem(4096, 8192, 4096, 8192);
  const Params h = f.heuristic(p);
  EXPECT_EQ(h, (Params{{"act", std::string("gelu")}, {"block", std::int64_t(128)}, {"dtype", std::string("bf16")},
                       {"vec", std::int64_t(4)}}));
  EXPECT_TRUE(f.check_problem(h, p).ok());
  EXPECT_EQ(*f.heuristic(problem(4096, 8192, 4098, 8192)).get_int("vec"), 2) << "dy's stride limits the access";
  EXPECT_EQ(*f.heuristic(problem(4096, 8192, 4096, 8192, 2)).get_int("vec"), 1) << "alignment limits it";
  EXPECT_EQ(f.check_problem(h, problem(4096, 8191, 4096, 8192)).code(), Code::shape_mismatch);
  EXPECT_EQ(f.check_problem(h, problem(4096, 8192, 4096, 8190)).code(), Code::shape_mismatch);
  EXPECT_EQ(f.check_problem(h, problem(4096, 8192, 4096, 8192, 16, k_am_silu)).code(), Code::invalid_argument);
  EXPECT_EQ(f.check_problem(h, problem(4096, 8192, 4096, 8192, 4)).code(), Code::invalid_argument);
  for (const Params& c : f.tuning_space(p)) EXPECT_TRUE(f.check_problem(c, p).ok()) << c.canonical();
  const auto bufs = f.buffers(h, p);
  ASSERT_EQ(bufs.size(), 3u);
  EXPECT_EQ(bufs[0].elements, 7 * 8192 + 8192);
  EXPECT_EQ(bufs[1].elements, 7 * 4096 + 4096);
  EXPECT_EQ(bufs[2].role, BufferRole::output);
  EXPECT_EQ(f.geometry(h, p).grid.x, 8u * 1024 / 128);
  EXPECT_EQ(f.signature(p), "dtype=bf16,align=16,rows<=8,d=4096,x_row_stride=8192,dy_row_stride=4096,"
                            "dx_row_stride=8192,activation=1");
}

TEST_F(ActAndMulOp, BackwardFallbackMatchesTheDerivativeOutOfPlaceAndInPlace) {
  std::mt19937 rng(testing::fresh_seed());
  std::normal_distribution<float> n;
  std::vector<float> dy(rows_ * d_), dx(rows_ * 2 * d_, NAN);
  for (auto& e : dy) e = n(rng);
  for (int a = 0; a < 3; ++a) {
    ASSERT_TRUE(act_and_mul_backward(view(x_, {2, 3, 2 * d_}), view(dy, {2, 3, d_}), view(dx, {2, 3, 2 * d_}),
                                     static_cast<Activation>(a), nullptr, rt_.get())
                    .ok());
    for (std::int64_t r = 0; r < rows_; ++r)
      for (std::int64_t c = 0; c < d_; ++c) {
        const double g = x_[r * 2 * d_ + c], u = x_[r * 2 * d_ + d_ + c], gy = dy[r * d_ + c];
        const double want_g = gy * u * act_and_mul_derivative(a, g), want_u = gy * act_and_mul_activate(a, g);
        EXPECT_NEAR(dx[r * 2 * d_ + c], want_g, 1e-6 * (1 + std::fabs(want_g))) << a << " " << r << " " << c;
        EXPECT_NEAR(dx[r * 2 * d_ + d_ + c], want_u, 1e-6 * (1 + std::fabs(want_u))) << a << " " << r << " " << c;
      }
  }
  // In place: dx = x; the result equals the out-of-place one (gelu_tanh, the last above).
  std::vector<float> copy = x_;
  ASSERT_TRUE(act_and_mul_backward(view(copy, {rows_, 2 * d_}), view(dy, {rows_, d_}), view(copy, {rows_, 2 * d_}),
                                   Activation::gelu_tanh, nullptr, rt_.get())
                  .ok());
  EXPECT_EQ(copy, dx);
  EXPECT_EQ(rt_->counters().module_loads, 0);
}

TEST_F(ActAndMulOp, BackwardErrors) {
  std::vector<float> dy(rows_ * d_), dx(rows_ * 2 * d_);
  auto x = view(x_, {rows_, 2 * d_}), y = view(dy, {rows_, d_}), g = view(dx, {rows_, 2 * d_});
  auto call = [&](const TensorView& xv, const TensorView& yv, const TensorView& gv, Activation a = Activation::silu) {
    return act_and_mul_backward(xv, yv, gv, a, nullptr, rt_.get());
  };
  expect(call(view(x_, {rows_, 2 * d_ - 1}), y, g), Code::shape_mismatch, "odd last dim");
  expect(call(x, view(dy, {rows_, d_ - 1}), g), Code::shape_mismatch, "dy too short");
  expect(call(x, y, view(dx, {rows_, 2 * d_ - 2})), Code::shape_mismatch, "dx too short");
  expect(call(x, view(dy, {rows_ / 2, 2 * d_}), g), Code::shape_mismatch, "leading shape");
  expect(call(x, y, view(dx, {rows_ * 2 * d_})), Code::shape_mismatch, "rank");
  auto yh = y;
  yh.dtype = DType::f16;
  expect(call(x, yh, g), Code::unsupported_dtype, "dtypes differ");
  expect(call(x, y, g, static_cast<Activation>(5)), Code::invalid_argument, "unknown activation");
  auto gg = g;
  gg.device = Device::cuda(0);
  expect(call(x, y, gg), Code::device_error, "mixed devices");
  std::vector<float> shared(rows_ * 2 * d_);
  expect(call(x, view(shared, {rows_, d_}), view(shared, {rows_, 2 * d_})), Code::invalid_argument, "dx over dy");
  auto shifted = view(x_, {rows_ - 1, 2 * d_});
  shifted.data = x_.data() + 2;
  expect(call(view(x_, {rows_ - 1, 2 * d_}), view(dy, {rows_ - 1, d_}), shifted), Code::invalid_argument,
         "dx shifted over x");
}

}  // namespace
}  // namespace kiln::families
