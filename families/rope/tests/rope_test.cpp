// The rope family and apply_rope_qk on the CPU: hand-computed rotations, the reference's layouts,
// strides and in-place use, the heuristic, problem checks, every catalog variant through NVRTC, and
// every error path of the typed op (none of which may resolve a kernel).
#include "families/rope/rope.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <numeric>
#include <random>
#include <set>

#include "common/half.h"
#include "kiln/ops.h"
#include "tests/test_util.h"

namespace kiln::families {
namespace {

const Family& rope() { return *Registry::global().find("rope"); }

Problem problem(DType t, std::int64_t tokens, std::int64_t qh, std::int64_t kvh, std::int64_t d, bool neox = true,
                std::int64_t max_pos = 16, std::uint32_t align = 16) {
  return Problem::of(t, align,
                     RopeProblem{.tokens = tokens,
                                 .q_heads = qh,
                                 .kv_heads = kvh,
                                 .head_dim = d,
                                 .layout = neox ? k_rope_neox : k_rope_gptj,
                                 .max_pos = max_pos,
                                 .q_stride = qh * d,
                                 .k_stride = kvh * d,
                                 .q_out_stride = qh * d,
                                 .k_out_stride = kvh * d});
}

// Host tensors for one f32 problem: q, k, cos, sin [max_pos, d/2], position ids, outputs.
struct HostRope {
  std::int64_t tokens, qh, kvh, d, max_pos;
  std::vector<float> q, k, cos, sin, q_out, k_out;
  std::vector<std::int64_t> pos;
  HostRope(std::int64_t t, std::int64_t qh_, std::int64_t kvh_, std::int64_t d_, std::int64_t mp)
      : tokens(t), qh(qh_), kvh(kvh_), d(d_), max_pos(mp), q(t * qh_ * d_), k(t * kvh_ * d_), cos(mp * d_ / 2),
        sin(mp * d_ / 2), q_out(q.size(), -7.f), k_out(k.size(), -7.f), pos(t) {}
  void* const* buffers() {
    bufs_[0] = q.data(), bufs_[1] = k.data(), bufs_[2] = cos.data(), bufs_[3] = sin.data();
    bufs_[4] = pos.data(), bufs_[5] = q_out.data(), bufs_[6] = k_out.data();
    return bufs_;
  }
  Status reference(bool neox) {
    Problem p = problem(DType::f32, tokens, qh, kvh, d, neox, max_pos);
    return rope().cpu_reference(rope().heuristic(p), p, std::span<void* const>(buffers(), 7));
  }

 private:
  void* bufs_[7];
};

// `kiln tune --shape` names the keys; the token strides default to contiguous tokens.
TEST(Rope, ShapeDefaultsToContiguousTokens) {
  const Family& f = *Registry::global().find("rope");
  auto p = f.problem_from_shape(DType::bf16, {{"tokens", 16}, {"q_heads", 32}, {"kv_heads", 8}, {"head_dim", 128},
                                              {"layout", 0}, {"max_pos", 4096}});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const auto q = p->as<RopeProblem>();
  EXPECT_EQ(q.q_stride, 32 * 128);
  EXPECT_EQ(q.q_out_stride, 32 * 128);
  EXPECT_EQ(q.k_stride, 8 * 128);
  EXPECT_EQ(q.k_out_stride, 8 * 128);
  EXPECT_TRUE(f.check_problem(f.heuristic(*p), *p).ok());
  auto given = f.problem_from_shape(DType::bf16, {{"tokens", 16}, {"q_heads", 32}, {"kv_heads", 8}, {"head_dim", 128},
                                                  {"layout", 0}, {"max_pos", 4096}, {"q_stride", 6144}});
  ASSERT_TRUE(given.ok());
  EXPECT_EQ(given->as<RopeProblem>().q_stride, 6144);
  EXPECT_FALSE(f.problem_from_shape(DType::bf16, {{"tokens", 16}, {"q_heads", 32}}).ok());
}

TEST(Rope, ReferenceIsIdentityAtAngleZero) {
  for (bool neox : {true, false}) {
    HostRope h(2, 2, 1, 64, 4);
    std::iota(h.q.begin(), h.q.end(), 1.f);
    std::iota(h.k.begin(), h.k.end(), -50.f);
    std::fill(h.cos.begin(), h.cos.begin() + 32, 1.f);  // row 0: cos 1, sin 0
    h.pos = {0, 0};
    ASSERT_TRUE(h.reference(neox).ok());
    EXPECT_EQ(h.q_out, h.q);
    EXPECT_EQ(h.k_out, h.k);
  }
}

TEST(Rope, ReferenceRotatesByNinetyDegreesPerLayout) {
  HostRope h(1, 1, 1, 64, 2);
  std::iota(h.q.begin(), h.q.end(), 1.f);
  std::iota(h.k.begin(), h.k.end(), 100.f);
  std::fill(h.sin.begin() + 32, h.sin.end(), 1.f);  // row 1: cos 0, sin 1
  h.pos = {1};
  ASSERT_TRUE(h.reference(true).ok());
  // neox: (a, b) = (x[i], x[i + 32]) -> (-b, a).
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(h.q_out[i], -h.q[i + 32]) << i;
    EXPECT_EQ(h.q_out[i + 32], h.q[i]) << i;
    EXPECT_EQ(h.k_out[i], -h.k[i + 32]) << i;
  }
  ASSERT_TRUE(h.reference(false).ok());
  // gptj: (a, b) = (x[2i], x[2i + 1]) -> (-b, a).
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(h.q_out[2 * i], -h.q[2 * i + 1]) << i;
    EXPECT_EQ(h.q_out[2 * i + 1], h.q[2 * i]) << i;
    EXPECT_EQ(h.k_out[2 * i + 1], h.k[2 * i]) << i;
  }
}

TEST(Rope, ReferenceUsesEachPairsOwnAngleAtEachTokensPosition) {
  // Token 0 at position 2, token 1 at position 0; pair i at position p turns by (p + 1) * (i + 1) * 10 degrees.
  HostRope h(2, 1, 1, 64, 3);
  for (int p = 0; p < 3; ++p)
    for (int i = 0; i < 32; ++i) {
      const double a = (p + 1) * (i + 1) * 10.0 * std::numbers::pi / 180;
      h.cos[p * 32 + i] = float(std::cos(a));
      h.sin[p * 32 + i] = float(std::sin(a));
    }
  std::mt19937 rng(testing::fresh_seed());
  std::normal_distribution<float> n;
  for (auto& v : h.q) v = n(rng);
  for (auto& v : h.k) v = n(rng);
  h.pos = {2, 0};
  ASSERT_TRUE(h.reference(true).ok());
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < 32; ++i) {
      const int p = t == 0 ? 2 : 0;
      const double c = h.cos[p * 32 + i], s = h.sin[p * 32 + i];
      const double a = h.q[t * 64 + i], b = h.q[t * 64 + i + 32];
      EXPECT_NEAR(h.q_out[t * 64 + i], a * c - b * s, 1e-6);
      EXPECT_NEAR(h.q_out[t * 64 + i + 32], b * c + a * s, 1e-6);
    }
  // One worked value: pair 0 at position 0 turns by 10 degrees; (1, 2) -> (cos - 2 sin, 2 cos + sin).
  h.q[64] = 1, h.q[96] = 2;
  ASSERT_TRUE(h.reference(true).ok());
  EXPECT_NEAR(h.q_out[64], 0.9848077530 - 2 * 0.1736481777, 1e-6);
  EXPECT_NEAR(h.q_out[96], 2 * 0.9848077530 + 0.1736481777, 1e-6);
}

TEST(Rope, ReferenceHonoursStridesInPlaceAndHalfTypes) {
  // bf16, q and k as views of one fused [tokens, 2 + 1 + 1 heads, 64] tensor, rotated in place.
  const std::int64_t t = 3, d = 64, stride = 4 * d;
  std::vector<std::uint16_t> qkv(t * stride);
  for (std::size_t i = 0; i < qkv.size(); ++i) qkv[i] = float_to_bf16(float(i % 17) - 8);
  const std::vector<std::uint16_t> before = qkv;
  std::vector<float> cos(4 * 32, 0.f), sin(4 * 32, 1.f);
  std::vector<std::int64_t> pos = {3, 1, 0};
  Problem p = problem(DType::bf16, t, 2, 1, d, true, 4);
  auto rq = p.as<RopeProblem>();
  rq.q_stride = rq.k_stride = rq.q_out_stride = rq.k_out_stride = stride;
  p.set(rq);
  std::uint16_t* q = qkv.data();
  std::uint16_t* k = qkv.data() + 2 * d;
  void* b[7] = {q, k, cos.data(), sin.data(), pos.data(), q, k};
  ASSERT_TRUE(rope().cpu_reference(rope().heuristic(p), p, b).ok());
  for (std::int64_t tok = 0; tok < t; ++tok) {
    const std::int64_t o = tok * stride;
    for (int h = 0; h < 3; ++h)
      for (int i = 0; i < 32; ++i) {
        EXPECT_EQ(bf16_to_float(qkv[o + h * d + i]), -bf16_to_float(before[o + h * d + i + 32]));
        EXPECT_EQ(bf16_to_float(qkv[o + h * d + i + 32]), bf16_to_float(before[o + h * d + i]));
      }
    for (int i = 0; i < d; ++i) EXPECT_EQ(qkv[o + 3 * d + i], before[o + 3 * d + i]) << "v was touched";
  }
}

TEST(Rope, ReferenceWritesNanForPositionsOutsideTheCache) {
  HostRope h(3, 1, 1, 64, 2);
  std::fill(h.cos.begin(), h.cos.end(), 1.f);
  h.pos = {1, 2, -1};
  ASSERT_TRUE(h.reference(true).ok());
  EXPECT_EQ(h.q_out[0], h.q[0]);
  EXPECT_TRUE(std::isnan(h.q_out[64]));
  EXPECT_TRUE(std::isnan(h.k_out[128 + 5]));
}

TEST(Rope, HeuristicPicksWidestAlignedAccessAndBlockBySize) {
  auto big = rope_heuristic(problem(DType::bf16, 16384, 32, 8, 128));
  EXPECT_EQ(big.vec, 8);  // 16-byte packs
  EXPECT_EQ(big.block, 256);
  auto decode = rope_heuristic(problem(DType::bf16, 1, 32, 8, 128));
  EXPECT_EQ(decode.vec, 8);
  EXPECT_EQ(rope_heuristic(problem(DType::bf16, 1, 32, 8, 128, false)).vec, 8);  // gptj too
  EXPECT_EQ(decode.block, 128);
  EXPECT_EQ(rope_heuristic(problem(DType::f32, 4096, 32, 8, 64)).vec, 4);
  EXPECT_EQ(rope_heuristic(problem(DType::f32, 4096, 32, 8, 64, false)).vec, 4);
  EXPECT_EQ(rope_heuristic(problem(DType::f16, 4096, 32, 8, 64, true, 16, 8)).vec, 2);  // f32 cos limits to 8 bytes
  EXPECT_EQ(rope_heuristic(problem(DType::bf16, 4096, 32, 8, 64, true, 16, 2)).vec, 1);
  EXPECT_EQ(rope_heuristic(problem(DType::f32, 4096, 32, 8, 64, true, 16, 4)).vec, 1);
  for (auto d : {64, 80, 96, 128, 256})
    for (auto t : {DType::f32, DType::f16, DType::bf16})
      for (std::uint32_t align : {2u, 4u, 8u, 16u})
        for (bool neox : {true, false}) {
          Problem p = problem(t, 5, 3, 1, d, neox, 16, t == DType::f32 ? std::max(align, 4u) : align);
          const Params params = rope().heuristic(p);
          EXPECT_TRUE(rope().validate(params).ok()) << params.canonical();
          EXPECT_TRUE(rope().check_problem(params, p).ok()) << params.canonical();
        }
}

TEST(Rope, CheckProblemRejectsMismatches) {
  Params bf16{{"dtype", std::string("bf16")}, {"head_dim", std::int64_t(128)}, {"layout", std::string("neox")},
              {"vec", std::int64_t(8)}, {"block", std::int64_t(256)}};
  EXPECT_TRUE(rope().check_problem(bf16, problem(DType::bf16, 4, 8, 2, 128)).ok());
  EXPECT_EQ(rope().check_problem(bf16, problem(DType::f16, 4, 8, 2, 128)).code(), Code::unsupported_dtype);
  EXPECT_EQ(rope().check_problem(bf16, problem(DType::bf16, 4, 8, 2, 64)).code(), Code::shape_mismatch);
  EXPECT_EQ(rope().check_problem(bf16, problem(DType::bf16, 4, 8, 2, 128, false)).code(), Code::invalid_argument);
  EXPECT_EQ(rope().check_problem(bf16, problem(DType::bf16, 4, 8, 2, 128, true, 16, 8)).code(), Code::invalid_argument);
  // Checks one field changed from a good bf16 problem.
  auto with = [](auto change) {
    Problem p = problem(DType::bf16, 4, 8, 2, 128);
    auto q = p.as<RopeProblem>();
    change(q);
    p.set(q);
    return p;
  };
  EXPECT_EQ(rope().check_problem(bf16, with([](RopeProblem& q) { q.k_out_stride = 128; })).code(),
            Code::shape_mismatch);  // shorter than two heads
  EXPECT_EQ(rope().check_problem(bf16, with([](RopeProblem& q) { q.q_stride = 8 * 128 + 4; })).code(),
            Code::invalid_argument);  // not a multiple of vec
  EXPECT_EQ(rope().check_problem(bf16, with([](RopeProblem& q) { q.q_stride = -8; })).code(),
            Code::invalid_argument);
  EXPECT_EQ(rope().check_problem(bf16, with([](RopeProblem& q) { q.layout = 7; })).code(), Code::invalid_argument);
  EXPECT_EQ(rope().check_problem(bf16, problem(DType::bf16, -1, 8, 2, 128)).code(), Code::shape_mismatch);
  EXPECT_EQ(rope().check_problem(bf16, problem(DType::bf16, 4, 70000, 2, 128)).code(), Code::shape_mismatch);
}

TEST(Rope, ValidateRejectsImpossibleParams) {
  Params p{{"dtype", std::string("f32")}, {"head_dim", std::int64_t(64)}, {"layout", std::string("gptj")},
           {"vec", std::int64_t(8)}, {"block", std::int64_t(128)}};
  EXPECT_EQ(rope().validate(p).code(), Code::invalid_argument);  // 32-byte access
  p.set("vec", std::int64_t(4));
  EXPECT_TRUE(rope().validate(p).ok());
  p.set("layout", "half");
  EXPECT_EQ(rope().validate(p).code(), Code::invalid_argument);
  p.set("layout", "neox").set("head_dim", std::int64_t(72));
  EXPECT_EQ(rope().validate(p).code(), Code::invalid_argument);
}

TEST(Rope, GeometryAndTuningSpace) {
  Problem p = problem(DType::bf16, 16384, 32, 8, 128);
  const Params h = rope().heuristic(p);
  const LaunchGeometry g = rope().geometry(h, p);
  EXPECT_EQ(g.block.x, 256u);
  EXPECT_EQ(g.grid.x, 16384u * 40 * 8 / 256);
  auto space = rope().tuning_space(p);
  EXPECT_EQ(space.size(), 16u);  // 4 vec x 4 block for bf16
  EXPECT_NE(std::find(space.begin(), space.end(), h), space.end());
  EXPECT_EQ(rope().tuning_space(problem(DType::f32, 8, 4, 4, 64, false, 16, 8)).size(), 8u);  // vec 1, 2
}

TEST(Rope, CatalogIsValidAndRendersDistinctNames) {
  auto cat = rope().catalog();
  EXPECT_EQ(cat.size(), 60u);  // 3 dtypes x 5 head dims x 2 layouts x 2 blocks
  std::set<std::string> names;
  for (const auto& p : cat) {
    ASSERT_TRUE(rope().validate(p).ok()) << p.canonical();
    auto r = rope().render(p);
    ASSERT_TRUE(r.ok());
    names.insert(r->name_expression);
  }
  EXPECT_EQ(names.size(), cat.size());
}

TEST(Rope, ArgsPackInKernelOrder) {
  Problem p = problem(DType::bf16, 7, 4, 2, 128, true, 99);
  auto rq = p.as<RopeProblem>();
  rq.q_stride = 1024;
  p.set(rq);
  ArgPack args;
  int bufs[7];
  void* b[7];
  for (int i = 0; i < 7; ++i) b[i] = &bufs[i];
  rope().pack_args(rope().heuristic(p), p, b, args);
  ASSERT_EQ(args.count(), 15u);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[4]), &bufs[4]);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[7]), 7);
  EXPECT_EQ(*static_cast<int*>(args.pointers()[8]), 4);
  EXPECT_EQ(*static_cast<int*>(args.pointers()[9]), 2);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[10]), 99);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[11]), 1024);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[14]), 2 * 128);
  auto bs = rope().buffers(rope().heuristic(p), p);
  ASSERT_EQ(bs.size(), 7u);
  EXPECT_EQ(bs[0].elements, 6 * 1024 + 4 * 128);
  EXPECT_EQ(bs[2].dtype, DType::f32);
  EXPECT_EQ(bs[2].elements, 99 * 64);
  EXPECT_EQ(bs[4].dtype, DType::i64);
  EXPECT_EQ(bs[6].role, BufferRole::output);
}

// --- the typed op on host memory ---------------------------------------------------------------

class RopeOp : public ::testing::Test {
 protected:
  void SetUp() override {
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    rt_ = Runtime::create(o).value();
  }
  void expect(const Status& s, Code c, const char* what) {
    EXPECT_EQ(s.code(), c) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
    RuntimeCounters k = rt_->counters();
    EXPECT_EQ(k.from_embedded + k.from_daemon + k.module_loads, 0) << what << " resolved a kernel";
  }
  std::shared_ptr<Runtime> rt_;
};

struct OpTensors {
  HostRope h{3, 4, 2, 64, 8};
  TensorView q, k, cos, sin, pos, q_out, k_out;
  explicit OpTensors(Device dev = Device::cpu()) {
    std::mt19937 rng(testing::fresh_seed());
    std::normal_distribution<float> n;
    for (auto* v : {&h.q, &h.k, &h.cos, &h.sin}) for (auto& x : *v) x = n(rng);
    h.pos = {5, 0, 7};
    q = TensorView::contiguous(h.q.data(), DType::f32, {3, 4, 64}, dev);
    k = TensorView::contiguous(h.k.data(), DType::f32, {3, 2, 64}, dev);
    cos = TensorView::contiguous(h.cos.data(), DType::f32, {8, 32}, dev);
    sin = TensorView::contiguous(h.sin.data(), DType::f32, {8, 32}, dev);
    pos = TensorView::contiguous(h.pos.data(), DType::i64, {3}, dev);
    q_out = TensorView::contiguous(h.q_out.data(), DType::f32, {3, 4, 64}, dev);
    k_out = TensorView::contiguous(h.k_out.data(), DType::f32, {3, 2, 64}, dev);
  }
  Status run(Runtime* rt, RopeLayout layout = RopeLayout::neox) {
    return apply_rope_qk(q, k, cos, sin, pos, q_out, k_out, layout, nullptr, rt);
  }
};

TEST_F(RopeOp, HostFallbackMatchesTheReferenceOutOfPlaceAndInPlace) {
  for (RopeLayout layout : {RopeLayout::neox, RopeLayout::gptj}) {
    OpTensors t;
    ASSERT_TRUE(t.run(rt_.get(), layout).ok());
    HostRope want = t.h;
    ASSERT_TRUE(want.reference(layout == RopeLayout::neox).ok());
    EXPECT_EQ(t.h.q_out, want.q_out);
    EXPECT_EQ(t.h.k_out, want.k_out);
    // In place: the outputs are the inputs.
    ASSERT_TRUE(apply_rope_qk(t.q, t.k, t.cos, t.sin, t.pos, t.q, t.k, layout, nullptr, rt_.get()).ok());
    EXPECT_EQ(t.h.q, want.q_out);
    EXPECT_EQ(t.h.k, want.k_out);
  }
  RuntimeCounters k = rt_->counters();
  EXPECT_EQ(k.from_embedded + k.module_loads, 0);
}

TEST_F(RopeOp, HostFallbackChecksPositionIds) {
  OpTensors t;
  t.h.pos[2] = 8;
  expect(t.run(rt_.get()), Code::invalid_argument, "position id = max_pos");
  t.h.pos[2] = -1;
  expect(t.run(rt_.get()), Code::invalid_argument, "negative position id");
  EXPECT_TRUE(std::all_of(t.h.q_out.begin(), t.h.q_out.end(), [](float v) { return v == -7.f; })) << "wrote output";
}

TEST_F(RopeOp, ShapeErrors) {
  OpTensors t;
  auto bad = t;
  bad.k = TensorView::contiguous(t.h.k.data(), DType::f32, {2, 2, 64}, Device::cpu());
  expect(bad.run(rt_.get()), Code::shape_mismatch, "k tokens");
  bad = t;
  bad.k_out = TensorView::contiguous(t.h.k_out.data(), DType::f32, {3, 1, 64}, Device::cpu());
  expect(bad.run(rt_.get()), Code::shape_mismatch, "k_out heads");
  bad = t;
  bad.q = TensorView::contiguous(t.h.q.data(), DType::f32, {3, 256}, Device::cpu());
  expect(bad.run(rt_.get()), Code::shape_mismatch, "q rank 2");
  bad = t;
  bad.cos = TensorView::contiguous(t.h.cos.data(), DType::f32, {4, 64}, Device::cpu());
  expect(bad.run(rt_.get()), Code::shape_mismatch, "cos width");
  bad = t;
  bad.sin = TensorView::contiguous(t.h.sin.data(), DType::f32, {4, 32}, Device::cpu());
  expect(bad.run(rt_.get()), Code::shape_mismatch, "sin rows");
  bad = t;
  bad.pos = TensorView::contiguous(t.h.pos.data(), DType::i64, {2}, Device::cpu());
  expect(bad.run(rt_.get()), Code::shape_mismatch, "position_ids length");
  bad = t;
  bad.q.strides[1] = 128;  // heads not contiguous
  expect(bad.run(rt_.get()), Code::shape_mismatch, "head stride");
  bad = t;
  bad.q.strides[0] = 128;  // tokens overlap
  expect(bad.run(rt_.get()), Code::shape_mismatch, "token stride");
  bad = t;
  bad.cos.strides[0] = 1, bad.cos.strides[1] = 8;
  expect(bad.run(rt_.get()), Code::shape_mismatch, "cos not contiguous");
  // Odd head dim (shape error) and an even one without a kernel (invalid argument).
  std::vector<float> big(3 * 4 * 66), cs(8 * 33);
  bad = t;
  bad.q = TensorView::contiguous(big.data(), DType::f32, {3, 4, 65}, Device::cpu());
  bad.k = TensorView::contiguous(big.data(), DType::f32, {3, 2, 65}, Device::cpu());
  bad.q_out = TensorView::contiguous(t.h.q_out.data(), DType::f32, {3, 4, 65}, Device::cpu());
  bad.k_out = TensorView::contiguous(t.h.k_out.data(), DType::f32, {3, 2, 65}, Device::cpu());
  expect(bad.run(rt_.get()), Code::shape_mismatch, "odd head_dim");
  bad.q = TensorView::contiguous(big.data(), DType::f32, {3, 4, 66}, Device::cpu());
  bad.k = TensorView::contiguous(big.data(), DType::f32, {3, 2, 66}, Device::cpu());
  bad.q_out = TensorView::contiguous(t.h.q_out.data(), DType::f32, {3, 4, 66}, Device::cpu());
  bad.k_out = TensorView::contiguous(t.h.k_out.data(), DType::f32, {3, 2, 66}, Device::cpu());
  bad.cos = TensorView::contiguous(cs.data(), DType::f32, {8, 33}, Device::cpu());
  bad.sin = bad.cos;
  expect(bad.run(rt_.get()), Code::invalid_argument, "head_dim 66");
}

TEST_F(RopeOp, DtypeErrors) {
  OpTensors t;
  auto bad = t;
  bad.q.dtype = bad.k.dtype = bad.q_out.dtype = bad.k_out.dtype = DType::i32;
  expect(bad.run(rt_.get()), Code::unsupported_dtype, "int q");
  bad = t;
  bad.k.dtype = DType::bf16;
  expect(bad.run(rt_.get()), Code::unsupported_dtype, "k dtype differs");
  bad = t;
  bad.cos.dtype = bad.sin.dtype = DType::bf16;
  expect(bad.run(rt_.get()), Code::unsupported_dtype, "bf16 cos");
  bad = t;
  bad.pos.dtype = DType::i32;
  expect(bad.run(rt_.get()), Code::unsupported_dtype, "i32 position ids");
}

TEST_F(RopeOp, ArgumentAndOverlapErrors) {
  OpTensors t;
  auto bad = t;
  bad.q.data = nullptr;
  expect(bad.run(rt_.get()), Code::invalid_argument, "null q");
  expect(t.run(rt_.get(), RopeLayout(9)), Code::invalid_argument, "unknown layout");
  bad = t;
  bad.pos.data = reinterpret_cast<char*>(t.h.pos.data()) + 4;
  bad.pos.shape[0] = 3;
  expect(bad.run(rt_.get()), Code::invalid_argument, "misaligned position ids");
  bad = t;
  bad.k_out.data = t.h.q_out.data() + 64;
  expect(bad.run(rt_.get()), Code::invalid_argument, "k_out overlaps q_out");
  bad = t;
  bad.q_out.data = t.h.q.data() + 64;
  expect(bad.run(rt_.get()), Code::invalid_argument, "q_out partly overlaps q");
  bad = t;
  bad.q_out = t.k;
  bad.q_out.shape[1] = 4;
  bad.q_out.strides[0] = 4 * 64;
  expect(bad.run(rt_.get()), Code::invalid_argument, "q_out writes over k");
  bad = t;
  bad.k_out.data = t.h.cos.data();
  expect(bad.run(rt_.get()), Code::invalid_argument, "k_out over cos");
}

TEST_F(RopeOp, FusedQkvViewsInPlaceAreNotOverlaps) {
  // q and k interleaved in one [tokens, 4 + 2 + 2 heads, 64] buffer: disjoint element sets.
  const std::int64_t tokens = 3, stride = 8 * 64;
  std::vector<float> qkv(tokens * stride);
  std::iota(qkv.begin(), qkv.end(), 0.f);
  std::vector<float> cos(8 * 32, 0.f), sin(8 * 32, 1.f);
  std::vector<std::int64_t> pos = {1, 2, 3};
  auto q = TensorView::contiguous(qkv.data(), DType::f32, {tokens, 4, 64}, Device::cpu());
  q.strides[0] = stride;
  auto k = TensorView::contiguous(qkv.data() + 4 * 64, DType::f32, {tokens, 2, 64}, Device::cpu());
  k.strides[0] = stride;
  auto c = TensorView::contiguous(cos.data(), DType::f32, {8, 32}, Device::cpu());
  auto s = TensorView::contiguous(sin.data(), DType::f32, {8, 32}, Device::cpu());
  auto p = TensorView::contiguous(pos.data(), DType::i64, {tokens}, Device::cpu());
  ASSERT_TRUE(apply_rope_qk(q, k, c, s, p, q, k, RopeLayout::gptj, nullptr, rt_.get()).ok());
  EXPECT_EQ(qkv[0], -1.f);
  EXPECT_EQ(qkv[1], 0.f);
  EXPECT_EQ(qkv[4 * 64], -float(4 * 64 + 1));
  EXPECT_EQ(qkv[6 * 64], float(6 * 64)) << "v changed";
  // Out of place into another fused buffer: q_out and k_out interleave without sharing elements.
  std::vector<float> out(qkv.size(), -7.f);
  auto qo = q, ko = k;
  qo.data = out.data();
  ko.data = out.data() + 4 * 64;
  EXPECT_TRUE(apply_rope_qk(q, k, c, s, p, qo, ko, RopeLayout::neox, nullptr, rt_.get()).ok());
  EXPECT_EQ(out[6 * 64], -7.f);
}

TEST_F(RopeOp, DeviceErrors) {
  OpTensors t;
  auto bad = t;
  bad.cos.device = Device::cuda(0);
  expect(bad.run(rt_.get()), Code::device_error, "cos on the GPU, the rest on the host");
  // Host memory labelled as CUDA: the driver (or its absence) says no before any launch.
  OpTensors gpu(Device::cuda(0));
  expect(gpu.run(rt_.get()), Code::device_error, "host pointers labelled cuda");
}

TEST_F(RopeOp, EmptyInputsDoNothing) {
  OpTensors t;
  auto e = t;
  e.q.shape[0] = e.k.shape[0] = e.q_out.shape[0] = e.k_out.shape[0] = e.pos.shape[0] = 0;
  EXPECT_TRUE(e.run(rt_.get()).ok());
  EXPECT_EQ(t.h.q_out[0], -7.f);
}

}  // namespace
}  // namespace kiln::families
