// Fused add + RMSNorm on the CPU: the reference against hand-computed rows (including the rounding
// of h), the heuristic, problem checks, argument packing, every catalog variant through NVRTC for
// sm_80 and sm_90a, and the typed op's fallback and error paths (which must resolve nothing).
#include "families/add_rmsnorm/add_rmsnorm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "common/half.h"
#include "kiln/ops.h"
#include "tests/test_util.h"

namespace kiln::families {
namespace {

const Family& fam() { return *Registry::global().find("add_rmsnorm"); }

Problem problem(DType t, std::int64_t rows, std::int64_t cols, std::int64_t stride = 0, std::uint32_t align = 16) {
  const std::int64_t s = stride ? stride : cols;
  return Problem::of(t, align,
                     AddRmsNormProblem{.rows = rows, .cols = cols, .x_row_stride = s, .residual_row_stride = s,
                                       .y_row_stride = s, .residual_out_row_stride = s, .eps = 1e-6});
}

// p with its fields edited by `change`.
template <class F>
Problem changed(Problem p, F change) {
  auto q = p.as<AddRmsNormProblem>();
  change(q);
  p.set(q);
  return p;
}

Params variant(const char* dtype, std::int64_t block, std::int64_t vec, std::int64_t row = 0) {
  return Params{{"dtype", std::string(dtype)}, {"block", block}, {"vec", vec}, {"row", row}};
}

// `kiln tune --shape rows=...,cols=...`: the four row strides default to the row length.
TEST(AddRmsNorm, ShapeDefaultsToContiguousRows) {
  const Family& f = *Registry::global().find("add_rmsnorm");
  auto p = f.problem_from_shape(DType::bf16, {{"rows", 16}, {"cols", 4096}});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const auto q = p->as<AddRmsNormProblem>();
  EXPECT_EQ(q.x_row_stride, 4096);
  EXPECT_EQ(q.residual_row_stride, 4096);
  EXPECT_EQ(q.y_row_stride, 4096);
  EXPECT_EQ(q.residual_out_row_stride, 4096);
  EXPECT_TRUE(f.check_problem(f.heuristic(*p), *p).ok());
  auto strided = f.problem_from_shape(DType::bf16, {{"rows", 16}, {"cols", 4096}, {"x_row_stride", 4160}});
  ASSERT_TRUE(strided.ok());
  EXPECT_EQ(strided->as<AddRmsNormProblem>().x_row_stride, 4160);
  EXPECT_EQ(strided->as<AddRmsNormProblem>().y_row_stride, 4096);
}

TEST(AddRmsNorm, ReferenceMatchesHandComputedRows) {
  // Row 0: h = [1+2, 2+2] = [3, 4], mean(h^2) = 12.5; w = [1, 2].
  // Row 1: h = [1, 1], mean 1, eps 0 -> y = w.
  std::vector<float> x = {1, 2, 0.5f, 0.5f}, r = {2, 2, 0.5f, 0.5f}, w = {1, 2}, y(4, -1), ro(4, -1);
  Problem p = changed(problem(DType::f32, 2, 2), [](auto& q) { q.eps = 0; });
  void* b[5] = {x.data(), r.data(), w.data(), y.data(), ro.data()};
  ASSERT_TRUE(fam().cpu_reference(fam().heuristic(p), p, b).ok());
  EXPECT_NEAR(y[0], 3 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y[1], 8 / std::sqrt(12.5), 1e-6);
  EXPECT_FLOAT_EQ(y[2], 1);
  EXPECT_FLOAT_EQ(y[3], 2);
  EXPECT_EQ(ro, (std::vector<float>{3, 4, 1, 1}));
}

TEST(AddRmsNorm, ReferenceNormalizesTheRoundedSum) {
  // bf16: 256 + 1 = 257 is a tie between 256 and 258 and rounds to even, 256. The rounded h is
  // [256, 1], mean(h^2) = 32768.5: y[1] = 1/sqrt(32768.5), a different bf16 value than the
  // unrounded 1/sqrt(33025).
  std::vector<std::uint16_t> x = {float_to_bf16(256), 0}, r = {float_to_bf16(1), float_to_bf16(1)},
                             w = {float_to_bf16(1), float_to_bf16(1)}, y(2), ro(2);
  Problem p = changed(problem(DType::bf16, 1, 2), [](auto& q) { q.eps = 0; });
  void* b[5] = {x.data(), r.data(), w.data(), y.data(), ro.data()};
  ASSERT_TRUE(fam().cpu_reference(fam().heuristic(p), p, b).ok());
  EXPECT_EQ(ro[0], float_to_bf16(256));
  EXPECT_EQ(ro[1], float_to_bf16(1));
  EXPECT_EQ(y[1], float_to_bf16(float(1 / std::sqrt(32768.5))));
  EXPECT_NE(y[1], float_to_bf16(float(1 / std::sqrt(33025.0))));
  EXPECT_EQ(y[0], float_to_bf16(float(256 / std::sqrt(32768.5))));
}

TEST(AddRmsNorm, ReferenceHonoursStridesAndAliasing) {
  // Two rows of 3 in a stride of 4: the padding stays. Then the same in place (y = x, ro = r).
  const float xv[] = {1, 2, 2, 9, -2, 0, 0, 9}, rv[] = {0, 0, 0, 9, 0, 0, 0, 9};
  std::vector<std::uint16_t> x(8), r(8), w(3), y(8, 0xBEEF), ro(8, 0xBEEF);
  for (int i = 0; i < 8; ++i) {
    x[i] = float_to_f16(xv[i]);
    r[i] = float_to_f16(rv[i]);
  }
  for (auto& v : w) v = float_to_f16(1.0f);
  Problem p = changed(problem(DType::f16, 2, 3, 4), [](auto& q) { q.eps = 0; });
  void* b[5] = {x.data(), r.data(), w.data(), y.data(), ro.data()};
  ASSERT_TRUE(fam().cpu_reference(fam().heuristic(p), p, b).ok());
  EXPECT_NEAR(f16_to_float(y[0]), 1 / std::sqrt(3.0), 1e-3);  // rms of [1, 2, 2] is sqrt(3)
  EXPECT_NEAR(f16_to_float(y[4]), -std::sqrt(3.0), 1e-3);     // rms of [-2, 0, 0] is 2/sqrt(3)
  EXPECT_EQ(y[3], 0xBEEF);
  EXPECT_EQ(ro[7], 0xBEEF);
  void* in_place[5] = {x.data(), r.data(), w.data(), x.data(), r.data()};
  ASSERT_TRUE(fam().cpu_reference(fam().heuristic(p), p, in_place).ok());
  for (int i : {0, 1, 2, 4, 5, 6}) {
    EXPECT_EQ(x[i], y[i]) << i;
    EXPECT_EQ(r[i], ro[i]) << i;
  }
}

TEST(AddRmsNorm, HeuristicPicksWidestAlignedAccess) {
  auto h = add_rmsnorm_heuristic(problem(DType::bf16, 4096, 4096));
  EXPECT_EQ(h.vec, 8);
  EXPECT_EQ(h.block, 256);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::f32, 1, 4096)).vec, 4);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 8, 4095)).vec, 1);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 8, 4096, 0, 4)).vec, 2);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1, 65536)).block, 1024);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1, 65536)).vec, 4);  // past the registers: 8 bytes
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 4096, 65536)).block, 512);  // from 2048 rows
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 4096, 65536)).vec, 4);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 4096, 16384)).block, 1024);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1, 16384)).vec, 8);  // fits them: 16 bytes
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1, 16384)).block, 1024);  // two packs per thread
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1, 5120)).block, 320);  // whole warps: 640 packs
  // From 2048 rows up to 2.5 packs per thread: 640 packs in 256 threads, power-of-two rows unchanged.
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 4096, 5120)).block, 256);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 32768, 5120)).block, 256);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 4096, 8192)).block, 512);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 4096, 2048)).block, 128);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 4096, 6144)).block, 512);  // 768 packs: 1.5 each
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1025, 2048)).block, 128);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::f32, 1, 64)).block, 64);
  // Up to 1024 rows of whole 16-byte packs: the one-row kernel, two packs per thread.
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1, 2048)).block, 128);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1, 2048)).row, 2);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1000, 8192)).block, 512);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1000, 8192)).row, 2);
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 16, 4100)).row, 0);    // not whole packs
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1025, 4096)).row, 0);  // past 1024 rows
  EXPECT_EQ(add_rmsnorm_heuristic(problem(DType::bf16, 1, 3)).vec, 1);
  // One stride a multiple of 4 but not 8.
  Problem odd_residual = changed(problem(DType::f16, 8, 4096), [](auto& q) { q.residual_row_stride = 4100; });
  EXPECT_EQ(add_rmsnorm_heuristic(odd_residual).vec, 4);
  for (auto cols : {1, 3, 7, 64, 1000, 4095, 4096, 5120, 65536})
    for (auto t : {DType::f32, DType::f16, DType::bf16}) {
      Problem p = problem(t, 3, cols);
      EXPECT_TRUE(fam().check_problem(fam().heuristic(p), p).ok()) << cols;
    }
}

TEST(AddRmsNorm, CheckProblemRejectsMismatches) {
  const Params v = variant("bf16", 256, 8);
  EXPECT_EQ(fam().check_problem(v, problem(DType::f16, 2, 64)).code(), Code::unsupported_dtype);
  EXPECT_EQ(fam().check_problem(v, problem(DType::bf16, 2, 60)).code(), Code::invalid_argument);
  EXPECT_EQ(fam().check_problem(v, problem(DType::bf16, 2, 64, 64, 8)).code(), Code::invalid_argument);
  const Problem p = problem(DType::bf16, 2, 64);
  EXPECT_EQ(fam().check_problem(v, changed(p, [](auto& q) { q.residual_out_row_stride = 32; })).code(),
            Code::shape_mismatch);
  EXPECT_EQ(fam().check_problem(v, changed(p, [](auto& q) { q.residual_row_stride = 68; })).code(),
            Code::invalid_argument);
  EXPECT_EQ(fam().check_problem(v, changed(p, [](auto& q) { q.eps = -1; })).code(), Code::invalid_argument);
  EXPECT_EQ(fam().check_problem(v, changed(p, [](auto& q) { q.eps = INFINITY; })).code(), Code::invalid_argument);
  EXPECT_EQ(fam().check_problem(v, problem(DType::bf16, 2, 0)).code(), Code::shape_mismatch);
  EXPECT_TRUE(fam().check_problem(v, problem(DType::bf16, 2, 64)).ok());
  // The one-row kernel holds at most block * row whole packs.
  const Params row = variant("bf16", 64, 8, 2);
  EXPECT_TRUE(fam().check_problem(row, problem(DType::bf16, 2, 1024)).ok());
  EXPECT_EQ(fam().check_problem(row, problem(DType::bf16, 2, 1032)).code(), Code::invalid_argument);
  EXPECT_EQ(fam().check_problem(row, problem(DType::bf16, 2, 1020)).code(), Code::invalid_argument);
}

TEST(AddRmsNorm, ValidateRejectsBadParams) {
  EXPECT_EQ(fam().validate(variant("f32", 256, 8)).code(), Code::invalid_argument);  // 32-byte access
  EXPECT_EQ(fam().validate(variant("bf16", 96, 8)).code(), Code::invalid_argument);
  EXPECT_EQ(fam().validate(variant("f64", 256, 1)).code(), Code::invalid_argument);
  EXPECT_FALSE(fam().render(variant("f32", 256, 8)).ok());
}

TEST(AddRmsNorm, ArgsPackInKernelOrder) {
  Problem p = changed(problem(DType::bf16, 7, 64, 128), [](auto& q) { q.residual_out_row_stride = 192; });
  ArgPack args;
  int a, b, c, d, e;
  void* bufs[5] = {&a, &b, &c, &d, &e};
  fam().pack_args(fam().heuristic(p), p, bufs, args);
  ASSERT_FALSE(args.overflow());
  ASSERT_EQ(args.count(), 12u);  // the kernel reads its shared-memory cache size off the launch
  EXPECT_EQ(*static_cast<void**>(args.pointers()[0]), &a);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[4]), &e);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[5]), 7);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[6]), 64);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[10]), 192);
  EXPECT_FLOAT_EQ(*static_cast<float*>(args.pointers()[11]), 1e-6f);
  auto bs = fam().buffers(fam().heuristic(p), p);
  ASSERT_EQ(bs.size(), 5u);
  EXPECT_EQ(bs[0].elements, 6 * 128 + 64);
  EXPECT_EQ(bs[2].elements, 64);
  EXPECT_EQ(bs[4].elements, 6 * 192 + 64);
  EXPECT_EQ(bs[3].role, BufferRole::output);
  EXPECT_EQ(bs[4].role, BufferRole::output);
  const LaunchGeometry g = fam().geometry(fam().heuristic(p), p);
  EXPECT_EQ(g.grid.x, 7u);
}

// The typed op on host memory: the fallback, in place, and every error before any resolve.
class AddRmsNormOp : public ::testing::Test {
 protected:
  void SetUp() override {
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    o.cache_file = (dir_.path() / "k.sqlite").string();
    rt_ = Runtime::create(o).value();
    std::mt19937 rng(testing::fresh_seed());
    std::normal_distribution<float> n;
    for (auto* v : {&x_, &r_}) {
      v->resize(rows_ * cols_);
      for (auto& e : *v) e = n(rng);
    }
    w_.resize(cols_);
    for (auto& e : w_) e = n(rng);
    y_.assign(rows_ * cols_, NAN);
    ro_.assign(rows_ * cols_, NAN);
  }
  TensorView view(std::vector<float>& v, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(v.data(), DType::f32, shape, Device::cpu());
  }
  Status call(const TensorView& x, const TensorView& r, const TensorView& w, const TensorView& y, const TensorView& ro,
              double eps = 1e-6) {
    return add_rms_norm(x, r, w, y, ro, eps, nullptr, rt_.get());
  }
  void expect(const Status& s, Code c, const char* what) {
    EXPECT_EQ(s.code(), c) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
    RuntimeCounters k = rt_->counters();
    EXPECT_EQ(k.from_embedded + k.from_daemon + k.module_loads, 0) << what << " resolved a kernel";
  }
  static constexpr std::int64_t rows_ = 5, cols_ = 37;
  testing::TempDir dir_;
  std::shared_ptr<Runtime> rt_;
  std::vector<float> x_, r_, w_, y_, ro_;
};

TEST_F(AddRmsNormOp, FallbackMatchesReferenceOutOfPlaceAndInPlace) {
  ASSERT_TRUE(call(view(x_, {rows_, cols_}), view(r_, {rows_, cols_}), view(w_, {cols_}), view(y_, {rows_, cols_}),
                   view(ro_, {rows_, cols_}), 1e-5)
                  .ok());
  for (std::int64_t row = 0; row < rows_; ++row) {
    double ss = 0;
    for (std::int64_t c = 0; c < cols_; ++c) {
      const double h = double(float(x_[row * cols_ + c] + r_[row * cols_ + c]));
      ss += h * h;
      EXPECT_FLOAT_EQ(ro_[row * cols_ + c], float(h));
    }
    const double s = 1 / std::sqrt(ss / cols_ + 1e-5);
    for (std::int64_t c = 0; c < cols_; ++c)
      EXPECT_NEAR(y_[row * cols_ + c], ro_[row * cols_ + c] * s * w_[c], 1e-5 * (1 + std::fabs(y_[row * cols_ + c])));
  }
  // In place (y = x, residual_out = residual) on a 3-d view gives the same values.
  ASSERT_TRUE(call(view(x_, {1, rows_, cols_}), view(r_, {1, rows_, cols_}), view(w_, {cols_}),
                   view(x_, {1, rows_, cols_}), view(r_, {1, rows_, cols_}), 1e-5)
                  .ok());
  EXPECT_EQ(x_, y_);
  EXPECT_EQ(r_, ro_);
  EXPECT_EQ(rt_->counters().module_loads, 0);
}

TEST_F(AddRmsNormOp, ShapeErrors) {
  auto x = view(x_, {rows_, cols_}), r = view(r_, {rows_, cols_}), w = view(w_, {cols_}), y = view(y_, {rows_, cols_}),
       ro = view(ro_, {rows_, cols_});
  expect(call(x, view(r_, {cols_, rows_}), w, y, ro), Code::shape_mismatch, "residual shape");
  expect(call(x, r, w, view(y_, {rows_ * cols_}), ro), Code::shape_mismatch, "y rank");
  expect(call(x, r, w, y, view(ro_, {rows_, cols_ - 1})), Code::shape_mismatch, "residual_out shape");
  expect(call(x, r, view(w_, {cols_ - 1}), y, ro), Code::shape_mismatch, "weight length");
  expect(call(x, r, view(w_, {1, cols_}), y, ro), Code::shape_mismatch, "weight rank");
  auto ws = w;
  ws.strides[0] = 2;
  expect(call(x, r, ws, y, ro), Code::shape_mismatch, "strided weight");
  auto xt = x;  // last dimension not contiguous
  xt.strides[1] = 2;
  expect(call(xt, r, w, y, ro), Code::shape_mismatch, "non-contiguous x");
  auto e = view(x_, {rows_, 0});
  expect(call(e, view(r_, {rows_, 0}), view(w_, {0}), view(y_, {rows_, 0}), view(ro_, {rows_, 0})),
         Code::shape_mismatch, "empty rows");
}

TEST_F(AddRmsNormOp, DtypeDeviceArgumentAndOverlapErrors) {
  auto x = view(x_, {rows_, cols_}), r = view(r_, {rows_, cols_}), w = view(w_, {cols_}), y = view(y_, {rows_, cols_}),
       ro = view(ro_, {rows_, cols_});
  auto with_dtype = [](TensorView t, DType d) { t.dtype = d; return t; };
  expect(call(with_dtype(x, DType::i32), with_dtype(r, DType::i32), with_dtype(w, DType::i32), with_dtype(y, DType::i32),
              with_dtype(ro, DType::i32)),
         Code::unsupported_dtype, "int tensors");
  expect(call(x, with_dtype(r, DType::bf16), w, y, ro), Code::unsupported_dtype, "residual dtype differs");
  expect(call(x, r, w, y, with_dtype(ro, DType::f16)), Code::unsupported_dtype, "residual_out dtype differs");
  auto on_gpu = [](TensorView t) { t.device = Device::cuda(0); return t; };
  expect(call(on_gpu(x), on_gpu(r), on_gpu(w), on_gpu(y), on_gpu(ro)), Code::device_error, "host pointers as cuda");
  expect(call(x, r, w, on_gpu(y), ro), Code::device_error, "mixed devices");
  auto null = x;
  null.data = nullptr;
  expect(call(null, r, w, y, ro), Code::invalid_argument, "null x");
  expect(call(x, r, w, y, ro, -1), Code::invalid_argument, "negative eps");
  expect(call(x, r, w, y, ro, NAN), Code::invalid_argument, "NaN eps");
  expect(call(x, r, w, y, y), Code::invalid_argument, "y is residual_out");
  expect(call(x, r, w, y, x), Code::invalid_argument, "residual_out is x");
  expect(call(x, r, w, r, ro), Code::invalid_argument, "y is residual");
  auto shifted = TensorView::contiguous(x_.data() + 1, DType::f32, {rows_ - 1, cols_}, Device::cpu());
  expect(call(view(x_, {rows_ - 1, cols_}), view(r_, {rows_ - 1, cols_}), w, shifted, view(ro_, {rows_ - 1, cols_})),
         Code::invalid_argument, "y overlaps x shifted by one element");
  expect(call(x, r, w, y, TensorView::contiguous(w_.data(), DType::f32, {1, cols_}, Device::cpu())),
         Code::shape_mismatch, "residual_out of the wrong shape");
  std::vector<float> big(rows_ * cols_ + cols_);
  auto wy = TensorView::contiguous(big.data(), DType::f32, {rows_, cols_}, Device::cpu());
  auto wb = TensorView::contiguous(big.data() + (rows_ - 1) * cols_, DType::f32, {cols_}, Device::cpu());
  expect(call(x, r, wb, wy, ro), Code::invalid_argument, "y overlaps weight");
}

}  // namespace
}  // namespace kiln::families
