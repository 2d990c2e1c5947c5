// The rmsnorm_rope family and rms_norm_rope on the CPU: hand-computed references, the heuristic,
// problem checks, every catalog variant through NVRTC, and every error path of the typed op (none
// of which may resolve a kernel).
#include "families/rmsnorm_rope/rmsnorm_rope.h"
#include "families/rmsnorm_rope/rope_hf_bwd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <set>

#include "common/half.h"
#include "kiln/ops.h"

namespace kiln::families {
namespace {

const Family& fused() { return *Registry::global().find("rmsnorm_rope"); }

Problem problem(DType t, std::int64_t rows, std::int64_t hidden, std::int64_t d, std::int64_t seq,
                DType cos_dtype = DType::f32, std::uint32_t align = 16) {
  return Problem::of(t, align,
                     RmsNormRopeProblem{.rows = rows, .hidden = hidden, .head_dim = d, .seq = seq,
                                        .num_heads = d ? hidden / d : 0, .cos_dtype = std::int64_t(cos_dtype),
                                        .eps = 1e-6});
}

// p with its fields edited by `change`.
template <class F>
Problem changed(Problem p, F change) {
  auto q = p.as<RmsNormRopeProblem>();
  change(q);
  p.set(q);
  return p;
}

TEST(RmsNormRope, ReferenceIsRmsNormWhenCosIsOneAndSinZero) {
  // Row of 2 heads of 64: all 2.0 except the first element 4.0; weight 0.5 everywhere.
  const std::int64_t hidden = 128, d = 64;
  std::vector<float> x(hidden, 2.f), w(hidden, 0.5f), cos(d, 1.f), sin(d, 0.f), y(hidden, -1.f);
  x[0] = 4.f;
  Problem p = changed(problem(DType::f32, 1, hidden, d, 1), [](auto& q) { q.eps = 0; });
  void* b[5] = {x.data(), w.data(), cos.data(), sin.data(), y.data()};
  ASSERT_TRUE(fused().cpu_reference(fused().heuristic(p), p, b).ok());
  const double rms = std::sqrt((127 * 4.0 + 16.0) / 128);
  EXPECT_NEAR(y[0], 4 * 0.5 / rms, 1e-6);
  for (int j = 1; j < hidden; ++j) EXPECT_NEAR(y[j], 2 * 0.5 / rms, 1e-6) << j;
}

TEST(RmsNormRope, ReferenceRotatesHalvesPerHeadAtEachTokensPosition) {
  // batch 2, seq 2, one head of 64, eps 0, weight 1. Position 0: identity; position 1: 90 degrees
  // (cos 0, sin 1): y[j] = -n[j + 32], y[j + 32] = n[j].
  const std::int64_t d = 64, seq = 2, rows = 4;
  std::vector<float> x(rows * d), w(d, 1.f), cos(seq * d, 0.f), sin(seq * d, 0.f), y(rows * d, -1.f);
  std::iota(x.begin(), x.end(), 1.f);
  std::fill(cos.begin(), cos.begin() + d, 1.f);
  std::fill(sin.begin() + d, sin.end(), 1.f);
  Problem p = changed(problem(DType::f32, rows, d, d, seq), [](auto& q) { q.eps = 0; });
  void* b[5] = {x.data(), w.data(), cos.data(), sin.data(), y.data()};
  ASSERT_TRUE(fused().cpu_reference(fused().heuristic(p), p, b).ok());
  for (std::int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int j = 0; j < d; ++j) ss += double(x[r * d + j]) * x[r * d + j];
    const double scale = 1 / std::sqrt(ss / d);
    for (int j = 0; j < 32; ++j) {
      if (r % seq == 0) {
        EXPECT_NEAR(y[r * d + j], x[r * d + j] * scale, 1e-5);
        EXPECT_NEAR(y[r * d + j + 32], x[r * d + j + 32] * scale, 1e-5);
      } else {
        EXPECT_NEAR(y[r * d + j], -x[r * d + j + 32] * scale, 1e-5);
        EXPECT_NEAR(y[r * d + j + 32], x[r * d + j] * scale, 1e-5);
      }
    }
  }
}

TEST(RmsNormRope, ReferenceUsesFullHeadDimCosAndSinInPlaceInHalfTypes) {
  // cos/sin differ between the halves (the seed's [seq, head_dim] form): y[j] = n[j] c[j] - n[j+32] s[j],
  // y[j+32] = n[j+32] c[j+32] + n[j] s[j+32]. bf16 x, f16 would be the same path; here x is
  // overwritten (in place).
  const std::int64_t d = 64, hidden = 128;
  std::vector<std::uint16_t> x(hidden), w(hidden), cos(d), sin(d);
  std::vector<double> xv(hidden);
  for (int j = 0; j < hidden; ++j) {
    xv[j] = double(bf16_to_float(float_to_bf16(float(j % 7) - 3)));
    x[j] = float_to_bf16(float(xv[j]));
    w[j] = float_to_bf16(1.f);
  }
  for (int j = 0; j < d; ++j) {
    cos[j] = float_to_bf16(j < 32 ? 0.5f : 0.25f);
    sin[j] = float_to_bf16(j < 32 ? 0.75f : -1.f);
  }
  Problem p = changed(problem(DType::bf16, 1, hidden, d, 1, DType::bf16), [](auto& q) { q.eps = 0; });
  void* b[5] = {x.data(), w.data(), cos.data(), sin.data(), x.data()};
  ASSERT_TRUE(fused().cpu_reference(fused().heuristic(p), p, b).ok());
  double ss = 0;
  for (double v : xv) ss += v * v;
  const double scale = 1 / std::sqrt(ss / hidden);
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 32; ++j) {
      const double lo = xv[h * d + j] * scale, hi = xv[h * d + j + 32] * scale;
      EXPECT_NEAR(bf16_to_float(x[h * d + j]), lo * 0.5 - hi * 0.75, 2e-2);
      EXPECT_NEAR(bf16_to_float(x[h * d + j + 32]), hi * 0.25 + lo * -1.0, 2e-2);
    }
}

TEST(RmsNormRope, HeuristicPicksWidestAccessAndAboutTwoItemsPerThread) {
  auto h = rmsnorm_rope_heuristic(problem(DType::bf16, 4096, 4096, 128, 4096));
  EXPECT_EQ(h.vec, 8);
  EXPECT_EQ(h.block, 128);  // 256 items of 8 pairs, two per thread
  EXPECT_EQ(rmsnorm_rope_heuristic(problem(DType::bf16, 1, 4096, 64, 1)).block, 128);
  EXPECT_EQ(rmsnorm_rope_heuristic(problem(DType::f32, 1, 4096, 64, 1)).vec, 4);
  EXPECT_EQ(rmsnorm_rope_heuristic(problem(DType::f32, 1, 4096, 64, 1)).block, 256);
  EXPECT_EQ(rmsnorm_rope_heuristic(problem(DType::bf16, 1, 65536, 128, 1)).block, 1024);
  EXPECT_EQ(rmsnorm_rope_heuristic(problem(DType::bf16, 1, 6144, 128, 1)).block, 128);  // 384 items
  EXPECT_EQ(rmsnorm_rope_heuristic(problem(DType::bf16, 1, 4096, 128, 1, DType::f32, 8)).vec, 2);
  EXPECT_EQ(rmsnorm_rope_heuristic(problem(DType::bf16, 1, 4096, 128, 1, DType::bf16, 8)).vec, 4);
  EXPECT_EQ(rmsnorm_rope_heuristic(problem(DType::f16, 1, 4096, 128, 1, DType::f32, 2)).vec, 1);
  for (auto d : {64, 80, 96, 128, 256})
    for (auto t : {DType::f32, DType::f16, DType::bf16})
      for (DType c : {DType::f32, t})
        for (std::uint32_t align : {2u, 4u, 8u, 16u}) {
          if (t == DType::f32 && align < 4) continue;
          Problem p = problem(t, 6, 8 * d, d, 3, c, align);
          const Params params = fused().heuristic(p);
          EXPECT_TRUE(fused().validate(params).ok()) << params.canonical();
          EXPECT_TRUE(fused().check_problem(params, p).ok()) << params.canonical();
        }
}

// A bucket is tuned on its upper bound in rows, which must stay a whole number of sequences: 4
// sequences of 2047 (8188 rows, bucket 8192) are tuned at 8188 rows, and the rotation backward
// does the same.
TEST(RmsNormRope, TuningProblemKeepsWholeSequences) {
  const Problem p = problem(DType::bf16, 8188, 3584, 128, 2047, DType::bf16);
  const Problem tp = fused().tuning_problem(p);
  EXPECT_EQ(tp.as<RmsNormRopeProblem>().rows, 8188);
  EXPECT_TRUE(fused().check_problem(fused().heuristic(tp), tp).ok());
  EXPECT_EQ(fused().signature(tp), fused().signature(p));
  EXPECT_EQ(fused().tuning_problem(problem(DType::bf16, 3, 4096, 128, 3)).as<RmsNormRopeProblem>().rows, 3);
  EXPECT_EQ(fused().tuning_problem(problem(DType::bf16, 5, 4096, 128, 5)).as<RmsNormRopeProblem>().rows, 5);
  EXPECT_EQ(fused().tuning_problem(problem(DType::bf16, 10, 4096, 128, 1)).as<RmsNormRopeProblem>().rows, 16);

  const Family& bwd = *Registry::global().find("rope_hf_bwd");
  const Problem b = Problem::of(DType::bf16, 16,
                                RopeHfBwdProblem{.rows = 4095, .hidden = 3072, .head_dim = 96, .seq = 4095,
                                                 .num_heads = 32, .cos_dtype = std::int64_t(DType::bf16)});
  const Problem tb = bwd.tuning_problem(b);
  EXPECT_EQ(tb.as<RopeHfBwdProblem>().rows, 4095);
  EXPECT_TRUE(bwd.check_problem(bwd.heuristic(tb), tb).ok());
}

TEST(RmsNormRope, CheckProblemRejectsMismatches) {
  Params bf16{{"dtype", std::string("bf16")}, {"cos_dtype", std::string("f32")}, {"head_dim", std::int64_t(128)},
              {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}};
  EXPECT_TRUE(fused().check_problem(bf16, problem(DType::bf16, 8, 4096, 128, 4)).ok());
  EXPECT_EQ(fused().check_problem(bf16, problem(DType::f16, 8, 4096, 128, 4)).code(), Code::unsupported_dtype);
  EXPECT_EQ(fused().check_problem(bf16, problem(DType::bf16, 8, 4096, 128, 4, DType::bf16)).code(),
            Code::unsupported_dtype);
  EXPECT_EQ(fused().check_problem(bf16, problem(DType::bf16, 8, 4096, 64, 4)).code(), Code::shape_mismatch);
  EXPECT_EQ(fused().check_problem(bf16, problem(DType::bf16, 8, 4096, 128, 3)).code(), Code::shape_mismatch);
  EXPECT_EQ(fused().check_problem(bf16, problem(DType::bf16, 8, 4096, 128, 4, DType::f32, 8)).code(),
            Code::invalid_argument);
  const Problem p = problem(DType::bf16, 8, 4096, 128, 4);
  EXPECT_EQ(fused().check_problem(bf16, changed(p, [](auto& q) { q.num_heads = 31; })).code(), Code::shape_mismatch);
  EXPECT_EQ(fused().check_problem(bf16, changed(p, [](auto& q) { q.eps = -1; })).code(), Code::invalid_argument);
  EXPECT_EQ(fused().check_problem(bf16, changed(p, [](auto& q) { q.eps = INFINITY; })).code(),
            Code::invalid_argument);
}

TEST(RmsNormRope, ValidateRejectsImpossibleParams) {
  Params p{{"dtype", std::string("f16")}, {"cos_dtype", std::string("bf16")}, {"head_dim", std::int64_t(64)},
           {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}};
  EXPECT_EQ(fused().validate(p).code(), Code::invalid_argument);  // cos neither f32 nor f16
  p.set("cos_dtype", "f16");
  EXPECT_TRUE(fused().validate(p).ok());
  p.set("dtype", "f32").set("cos_dtype", "f32");
  EXPECT_EQ(fused().validate(p).code(), Code::invalid_argument);  // 32-byte access
  p.set("vec", std::int64_t(4)).set("head_dim", std::int64_t(100));
  EXPECT_EQ(fused().validate(p).code(), Code::invalid_argument);
}

TEST(RmsNormRope, CatalogIsValidAndRendersDistinctNames) {
  auto cat = fused().catalog();
  EXPECT_EQ(cat.size(), 125u);  // 5 dtype/cos pairs x 5 head dims x 5 blocks
  std::set<std::string> names;
  for (const auto& p : cat) {
    ASSERT_TRUE(fused().validate(p).ok()) << p.canonical();
    auto r = fused().render(p);
    ASSERT_TRUE(r.ok());
    names.insert(r->name_expression);
  }
  EXPECT_EQ(names.size(), cat.size());
}

TEST(RmsNormRope, GeometryArgsAndBuffers) {
  Problem p = problem(DType::bf16, 6, 4096, 128, 3, DType::bf16);
  const Params h = fused().heuristic(p);
  EXPECT_EQ(*h.get_str("cos_dtype"), "bf16");
  const LaunchGeometry g = fused().geometry(h, p);
  EXPECT_EQ(g.grid.x, 6u);
  EXPECT_EQ(g.block.x, 128u);
  // 128 threads x two items of 16-byte packs hold the row: the weight (8 KiB) is staged.
  EXPECT_EQ(g.shared_bytes, 4096u * 2);
  // Two-byte packs are not staged (cp.async moves 4 bytes and more), nor rows past the cache
  // (64 threads x 2 items x 16 elements = 2048 < 4096).
  Params narrow = h;
  narrow.set("vec", std::int64_t(1)).set("block", std::int64_t(1024));
  EXPECT_EQ(fused().geometry(narrow, p).shared_bytes, 0u);
  Params few = h;
  few.set("block", std::int64_t(64));
  EXPECT_EQ(fused().geometry(few, p).shared_bytes, 0u);
  ArgPack args;
  int bufs[5];
  void* b[5];
  for (int i = 0; i < 5; ++i) b[i] = &bufs[i];
  fused().pack_args(h, p, b, args);
  ASSERT_EQ(args.count(), 9u);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[4]), &bufs[4]);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[5]), 6);
  EXPECT_EQ(*static_cast<int*>(args.pointers()[6]), 4096);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[7]), 3);
  EXPECT_FLOAT_EQ(*static_cast<float*>(args.pointers()[8]), 1e-6f);
  auto bs = fused().buffers(h, p);
  ASSERT_EQ(bs.size(), 5u);
  EXPECT_EQ(bs[0].elements, 6 * 4096);
  EXPECT_EQ(bs[2].elements, 3 * 128);
  EXPECT_EQ(bs[2].dtype, DType::bf16);
  EXPECT_EQ(bs[4].role, BufferRole::output);
  EXPECT_FALSE(fused().tuning_space(p).empty());
}

// --- the typed op: errors only (it is CUDA only; nothing here may resolve a kernel) ------------

class RmsNormRopeOp : public ::testing::Test {
 protected:
  void SetUp() override {
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    rt_ = Runtime::create(o).value();
    const Device dev = Device::cuda(0);
    x_ = TensorView::contiguous(xb_.data(), DType::bf16, {2, 4, 256}, dev);
    w_ = TensorView::contiguous(wb_.data(), DType::bf16, {256}, dev);
    cos_ = TensorView::contiguous(cb_.data(), DType::bf16, {4, 64}, dev);
    sin_ = TensorView::contiguous(sb_.data(), DType::bf16, {4, 64}, dev);
    out_ = TensorView::contiguous(ob_.data(), DType::bf16, {2, 4, 256}, dev);
  }
  void expect(const Status& s, Code c, const char* what) {
    EXPECT_EQ(s.code(), c) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
    RuntimeCounters k = rt_->counters();
    EXPECT_EQ(k.from_embedded + k.from_daemon + k.module_loads, 0) << what << " resolved a kernel";
  }
  Status run(const TensorView& x, const TensorView& w, const TensorView& c, const TensorView& s, const TensorView& o,
             double eps = 1e-6, std::int64_t heads = 0) {
    return rms_norm_rope(x, w, c, s, o, eps, heads, nullptr, rt_.get());
  }
  std::shared_ptr<Runtime> rt_;
  std::vector<std::uint16_t> xb_ = std::vector<std::uint16_t>(2 * 4 * 512), wb_ = std::vector<std::uint16_t>(512),
                             cb_ = std::vector<std::uint16_t>(4 * 128), sb_ = std::vector<std::uint16_t>(4 * 128),
                             ob_ = std::vector<std::uint16_t>(2 * 4 * 512);
  TensorView x_, w_, cos_, sin_, out_;
};

TEST_F(RmsNormRopeOp, DeviceErrors) {
  auto host = [](TensorView t) {
    t.device = Device::cpu();
    return t;
  };
  expect(run(host(x_), host(w_), host(cos_), host(sin_), host(out_)), Code::device_error, "host tensors");
  expect(run(x_, w_, host(cos_), sin_, out_), Code::device_error, "cos on the host");
  // Host memory labelled as CUDA: caught by the pointer check, the last one before the launch.
  expect(run(x_, w_, cos_, sin_, out_), Code::device_error, "host pointers labelled cuda");
}

TEST_F(RmsNormRopeOp, ShapeErrors) {
  expect(run(TensorView::contiguous(xb_.data(), DType::bf16, {8, 256}, Device::cuda(0)), w_, cos_, sin_,
             TensorView::contiguous(ob_.data(), DType::bf16, {8, 256}, Device::cuda(0))),
         Code::shape_mismatch, "x rank 2");
  expect(run(x_, w_, cos_, sin_, TensorView::contiguous(ob_.data(), DType::bf16, {2, 4, 128}, Device::cuda(0))),
         Code::shape_mismatch, "out shape");
  expect(run(x_, TensorView::contiguous(wb_.data(), DType::bf16, {128}, Device::cuda(0)), cos_, sin_, out_),
         Code::shape_mismatch, "weight length");
  auto c3 = TensorView::contiguous(cb_.data(), DType::bf16, {3, 64}, Device::cuda(0));
  expect(run(x_, w_, c3, c3, out_), Code::shape_mismatch, "cos positions != seq");
  expect(run(x_, w_, cos_, TensorView::contiguous(sb_.data(), DType::bf16, {1, 4, 1, 64}, Device::cuda(0)), out_),
         Code::shape_mismatch, "sin shape differs from cos");
  auto c4 = TensorView::contiguous(cb_.data(), DType::bf16, {2, 4, 1, 64}, Device::cuda(0));
  expect(run(x_, w_, c4, c4, out_), Code::shape_mismatch, "4-d cos with batch 2");
  auto odd = TensorView::contiguous(cb_.data(), DType::bf16, {4, 63}, Device::cuda(0));
  expect(run(x_, w_, odd, odd, out_), Code::shape_mismatch, "odd head_dim");
  auto c32 = TensorView::contiguous(cb_.data(), DType::bf16, {4, 32}, Device::cuda(0));
  expect(run(x_, w_, c32, c32, out_), Code::invalid_argument, "head_dim 32 has no kernel");
  expect(run(x_, w_, cos_, sin_, out_, 1e-6, 3), Code::shape_mismatch, "num_heads * head_dim != hidden");
  auto x288 = TensorView::contiguous(xb_.data(), DType::bf16, {2, 4, 288}, Device::cuda(0));
  expect(run(x288, TensorView::contiguous(wb_.data(), DType::bf16, {288}, Device::cuda(0)), cos_, sin_,
             TensorView::contiguous(ob_.data(), DType::bf16, {2, 4, 288}, Device::cuda(0))),
         Code::shape_mismatch, "hidden not a multiple of head_dim");
  auto xs = x_;
  xs.strides[0] = 2048;
  expect(run(xs, w_, cos_, sin_, out_), Code::shape_mismatch, "x not contiguous");
}

TEST_F(RmsNormRopeOp, DtypeErrors) {
  auto as = [](TensorView t, DType d) {
    t.dtype = d;
    return t;
  };
  expect(run(as(x_, DType::i32), as(w_, DType::i32), cos_, sin_, as(out_, DType::i32)), Code::unsupported_dtype,
         "int x");
  expect(run(x_, as(w_, DType::f16), cos_, sin_, out_), Code::unsupported_dtype, "weight dtype");
  expect(run(x_, w_, as(cos_, DType::f16), as(sin_, DType::f16), out_), Code::unsupported_dtype, "f16 cos, bf16 x");
  expect(run(x_, w_, as(cos_, DType::f32), sin_, out_), Code::unsupported_dtype, "cos and sin differ");
  expect(run(x_, w_, as(cos_, DType::i64), as(sin_, DType::i64), out_), Code::unsupported_dtype, "int cos");
}

TEST_F(RmsNormRopeOp, ArgumentErrors) {
  auto null_x = x_;
  null_x.data = nullptr;
  expect(run(null_x, w_, cos_, sin_, out_), Code::invalid_argument, "null x");
  expect(run(x_, w_, cos_, sin_, out_, -1.0), Code::invalid_argument, "negative eps");
  expect(run(x_, w_, cos_, sin_, out_, NAN), Code::invalid_argument, "nan eps");
  expect(run(x_, w_, cos_, sin_, out_, 1e-6, -4), Code::invalid_argument, "negative num_heads");
  auto shifted = out_;
  shifted.data = xb_.data() + 8;
  expect(run(x_, w_, cos_, sin_, shifted), Code::invalid_argument, "out partly overlaps x");
  auto over_w = out_;
  over_w.data = wb_.data();
  over_w.shape[0] = 1, over_w.shape[1] = 1;
  over_w.strides[0] = over_w.strides[1] = 256;
  auto x1 = x_;
  x1.shape[0] = 1, x1.shape[1] = 1;
  auto c1 = TensorView::contiguous(cb_.data(), DType::bf16, {1, 64}, Device::cuda(0));
  expect(run(x1, w_, c1, c1, over_w), Code::invalid_argument, "out over weight");
  auto odd = x_;
  odd.data = reinterpret_cast<char*>(xb_.data()) + 1;
  expect(run(odd, w_, cos_, sin_, out_), Code::invalid_argument, "x not aligned to its element size");
}

}  // namespace
}  // namespace kiln::families
