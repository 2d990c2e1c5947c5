// RMSNorm backward families on the CPU: schema and problem checks, the references against
// hand-computed values and against finite differences of an fp64 forward (with the options:
// inv_rms recomputed, dh added), the heuristic, the catalog (every variant is compiled through
// NVRTC for sm_80 and sm_90a by tests/conformance), and the typed ops' error paths and fallbacks.
#include "families/rmsnorm_bwd/rmsnorm_bwd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <tuple>

#include "common/half.h"
#include "families/rmsnorm_bwd/ops.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd_reduce.h"
#include "jit/nvrtc.h"
#include "kiln/ops.h"
#include "tests/test_util.h"

namespace kiln::families {
namespace {

const Family& bwd() { return *Registry::global().find("rmsnorm_bwd"); }
const Family& reduce() { return *Registry::global().find("rmsnorm_bwd_reduce"); }

Problem problem(DType t, std::int64_t rows, std::int64_t cols, std::int64_t slabs = 1, std::int64_t max_cluster = 1,
                std::int64_t stride = 0, std::uint32_t align = 16) {
  if (!stride) stride = cols;
  return Problem::of(t, align,
                     RmsNormBwdProblem{.rows = rows,
                                       .cols = cols,
                                       .dy_row_stride = stride,
                                       .x_row_stride = stride,
                                       .dx_row_stride = stride,
                                       .slabs = slabs,
                                       .max_cluster = max_cluster});
}

// `p` with the options: inv_rms recomputed with `eps`, and dh in rows of `dh_stride` (0: none).
Problem with_options(Problem p, std::int64_t dh_stride, bool recompute = true, double eps = 1e-6) {
  auto q = p.as<RmsNormBwdProblem>();
  q.dh_row_stride = dh_stride;
  q.recompute = recompute ? 1 : 0;
  q.eps = eps;
  p.set(q);
  return p;
}

// `p` with its slab count set to `slabs`.
Problem with_slabs(Problem p, std::int64_t slabs) {
  auto q = p.as<RmsNormBwdProblem>();
  q.slabs = slabs;
  p.set(q);
  return p;
}

Problem reduce_problem(DType t, std::int64_t slabs, std::int64_t cols) {
  return Problem::of(t, 16, RmsNormBwdReduceProblem{.slabs = slabs, .cols = cols});
}

Params bwd_params(const char* dtype, std::int64_t group, std::int64_t rows, std::int64_t vec, std::int64_t packs,
                  std::int64_t cluster, std::int64_t sm_threads = 512, std::int64_t stages = 0,
                  std::int64_t recompute = 0, std::int64_t dh = 0) {
  return Params{{"dtype", std::string(dtype)}, {"group", group},     {"rows", rows},
                {"vec", vec},                  {"packs", packs},     {"cluster", cluster},
                {"sm_threads", sm_threads},    {"stages", stages},   {"recompute", recompute},
                {"dh", dh}};
}

Params reduce_params(const char* dtype, std::int64_t block, std::int64_t columns = 32) {
  return Params{{"dtype", std::string(dtype)}, {"block", block}, {"columns", columns}};
}

double inv_rms_of(const std::vector<double>& x, std::int64_t r, std::int64_t cols, double eps) {
  double ss = 0;
  for (std::int64_t c = 0; c < cols; ++c) ss += x[r * cols + c] * x[r * cols + c];
  return 1.0 / std::sqrt(ss / double(cols) + eps);
}

// L = sum(dy * rmsnorm(x, w)) in fp64.
double loss(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& dy,
            std::int64_t rows, std::int64_t cols, double eps) {
  double l = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const double s = inv_rms_of(x, r, cols, eps);
    for (std::int64_t c = 0; c < cols; ++c) l += dy[r * cols + c] * x[r * cols + c] * s * w[c];
  }
  return l;
}

TEST(RmsNormBwd, SchemaRejectsBadCombinations) {
  EXPECT_TRUE(bwd().validate(bwd_params("bf16", 512, 1, 8, 2, 2)).ok());
  EXPECT_EQ(bwd().validate(bwd_params("f32", 256, 1, 8, 1, 1)).code(), Code::invalid_argument);    // 32-byte access
  EXPECT_EQ(bwd().validate(bwd_params("f16", 256, 4, 8, 1, 1)).code(), Code::invalid_argument);    // 1024 threads
  EXPECT_EQ(bwd().validate(bwd_params("f16", 128, 1, 8, 4, 1)).code(), Code::invalid_argument);    // packs
  EXPECT_EQ(bwd().validate(bwd_params("f16", 100, 1, 8, 1, 1)).code(), Code::invalid_argument);    // not enumerated
  EXPECT_EQ(bwd().validate(bwd_params("f16", 96, 1, 8, 1, 1)).code(), Code::invalid_argument);     // not a power of 2
  // Bulk copies: 16-byte packs, one row per block, no cluster, the 128-register cap; buffers fit.
  EXPECT_TRUE(bwd().validate(bwd_params("bf16", 320, 1, 8, 2, 1, 512, 4)).ok());
  EXPECT_TRUE(bwd().validate(bwd_params("f32", 512, 1, 4, 4, 1, 512, 2)).ok());
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 320, 1, 4, 2, 1, 512, 4)).code(), Code::invalid_argument);  // 8 bytes
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 128, 2, 8, 2, 1, 512, 4)).code(), Code::invalid_argument);  // rows
  // With a cluster (the clustered bulk kernel): at least 3 buffers, which must fit in one block.
  EXPECT_TRUE(bwd().validate(bwd_params("bf16", 256, 1, 8, 2, 2, 512, 4)).ok());
  EXPECT_TRUE(bwd().validate(bwd_params("bf16", 512, 1, 8, 4, 4, 512, 3)).ok());
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 512, 1, 8, 4, 4, 512, 2)).code(), Code::invalid_argument);  // 2 buffers
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 512, 1, 8, 4, 4, 512, 4)).code(), Code::invalid_argument);  // 256 KiB
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 256, 2, 8, 2, 4, 512, 3)).code(), Code::invalid_argument);  // rows
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 512, 1, 8, 2, 4, 1024, 3)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 256, 1, 8, 2, 1, 1024, 4)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 512, 1, 8, 4, 1, 512, 4)).code(), Code::invalid_argument);  // 256 KiB
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 512, 1, 8, 4, 1)).code(), Code::invalid_argument);  // 4 packs, no bulk
  EXPECT_EQ(bwd().validate(bwd_params("f64", 128, 1, 1, 1, 1)).code(), Code::invalid_argument);
  EXPECT_TRUE(bwd().validate(bwd_params("bf16", 512, 1, 8, 2, 1, 1024)).ok());
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 512, 1, 8, 2, 1, 768)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 128, 1, 8, 2, 1, 1024)).code(), Code::invalid_argument);  // small block
  EXPECT_FALSE(bwd().validate(Params{{"dtype", std::string("f16")}}).ok());
  EXPECT_FALSE(bwd().render(bwd_params("f32", 256, 1, 8, 1, 1)).ok());
  EXPECT_TRUE(reduce().validate(reduce_params("bf16", 256)).ok());
  EXPECT_TRUE(reduce().validate(reduce_params("bf16", 256, 8)).ok());
  EXPECT_FALSE(reduce().validate(reduce_params("bf16", 64)).ok());
  EXPECT_FALSE(reduce().validate(reduce_params("bf16", 256, 4)).ok());
  EXPECT_FALSE(reduce().validate(Params{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}}).ok());
  // The options: every kernel takes them, but the one-block bulk kernel with dh only up to 16
  // elements per thread.
  EXPECT_TRUE(bwd().validate(bwd_params("bf16", 512, 1, 8, 2, 1, 1024, 0, 1, 1)).ok());
  EXPECT_TRUE(bwd().validate(bwd_params("bf16", 320, 1, 8, 2, 1, 512, 4, 1, 1)).ok());
  EXPECT_TRUE(bwd().validate(bwd_params("bf16", 512, 1, 8, 4, 4, 512, 3, 1, 1)).ok());
  EXPECT_TRUE(bwd().validate(bwd_params("bf16", 512, 1, 8, 4, 1, 512, 2, 1, 0)).ok());
  EXPECT_TRUE(bwd().validate(bwd_params("f32", 512, 1, 4, 4, 1, 512, 2, 1, 1)).ok());
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 512, 1, 8, 4, 1, 512, 2, 1, 1)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 512, 1, 8, 4, 1, 512, 2, 0, 1)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().validate(bwd_params("bf16", 512, 1, 8, 2, 1, 1024, 0, 2, 0)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().problem_fields().size(), 10u);
  for (const ProblemField& f : bwd().problem_fields()) EXPECT_EQ(f.key, f.name != "eps") << f.name;
  EXPECT_EQ(reduce().problem_fields().size(), 2u);
}

TEST(RmsNormBwd, ReferenceMatchesHandComputedRow) {
  // x = [3, 4], w = [1, 2], dy = [1, 1], eps = 0: s = 1/sqrt(12.5), mean(dy*w*x) = (3 + 8) / 2.
  std::vector<float> dy = {1, 1}, x = {3, 4}, w = {1, 2}, dx(2, NAN), partial(2, NAN);
  const float inv = float(1 / std::sqrt(12.5));
  std::vector<float> inv_rms = {inv};
  Problem p = problem(DType::f32, 1, 2);
  void* b[6] = {dy.data(), x.data(), w.data(), inv_rms.data(), dx.data(), partial.data()};
  ASSERT_TRUE(bwd().cpu_reference(bwd().heuristic(p), p, b).ok());
  const double s = inv, s3 = s * s * s;
  EXPECT_NEAR(dx[0], s * 1 - 3 * s3 * 5.5, 1e-6);  // -0.0905
  EXPECT_NEAR(dx[1], s * 2 - 4 * s3 * 5.5, 1e-6);  // 0.0679
  EXPECT_NEAR(partial[0], 3 * s, 1e-6);
  EXPECT_NEAR(partial[1], 4 * s, 1e-6);
  EXPECT_NEAR(dx[0], -0.0905097, 1e-6);
}

TEST(RmsNormBwd, ReferenceIsTheGradientOfTheForward) {
  const std::int64_t rows = 3, cols = 7;
  const double eps = 1e-5;
  std::mt19937 rng(testing::fresh_seed());
  std::normal_distribution<double> n;
  std::vector<double> x(rows * cols), w(cols), dy(rows * cols);
  for (auto& v : x) v = n(rng);
  for (auto& v : w) v = n(rng);
  for (auto& v : dy) v = n(rng);
  // The reference in f32 buffers, every row in one slab.
  std::vector<float> fx(x.begin(), x.end()), fw(w.begin(), w.end()), fdy(dy.begin(), dy.end());
  // Round the inputs to f32 first so both sides see the same values.
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = fx[i], dy[i] = fdy[i];
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = fw[i];
  std::vector<float> inv_rms(rows), dx(rows * cols), partial(cols);
  for (std::int64_t r = 0; r < rows; ++r) inv_rms[r] = float(inv_rms_of(x, r, cols, eps));
  Problem p = problem(DType::f32, rows, cols);
  void* b[6] = {fdy.data(), fx.data(), fw.data(), inv_rms.data(), dx.data(), partial.data()};
  ASSERT_TRUE(bwd().cpu_reference(bwd().heuristic(p), p, b).ok());

  const double h = 1e-6;
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    auto xp = x, xm = x;
    xp[i] += h;
    xm[i] -= h;
    const double fd = (loss(xp, w, dy, rows, cols, eps) - loss(xm, w, dy, rows, cols, eps)) / (2 * h);
    EXPECT_NEAR(dx[i], fd, 1e-5 * (1 + std::abs(fd))) << "dx[" << i << "]";
  }
  for (std::int64_t c = 0; c < cols; ++c) {
    auto wp = w, wm = w;
    wp[c] += h;
    wm[c] -= h;
    const double fd = (loss(x, wp, dy, rows, cols, eps) - loss(x, wm, dy, rows, cols, eps)) / (2 * h);
    EXPECT_NEAR(partial[c], fd, 1e-5 * (1 + std::abs(fd))) << "dw[" << c << "]";
  }
}

TEST(RmsNormBwd, ReferenceRecomputesInvRmsAndAddsDh) {
  // x = [3, 4], w = [1, 2], dy = [1, 1], dh = [0.5, -1], eps = 0.5: s = 1/sqrt(12.5 + 0.5) from x
  // itself (no inv_rms buffer), mean(dy*w*x) = 5.5, and dh added to dx.
  std::vector<float> dy = {1, 1}, x = {3, 4}, w = {1, 2}, dh = {0.5f, -1}, dx(2, NAN), partial(2, NAN);
  const Problem p = with_options(problem(DType::f32, 1, 2), 2, true, 0.5);
  void* b[7] = {dy.data(), x.data(), w.data(), nullptr, dx.data(), partial.data(), dh.data()};
  ASSERT_TRUE(bwd().cpu_reference(bwd().heuristic(p), p, b).ok());
  const double s = 1 / std::sqrt(13.0), s3 = s * s * s;
  EXPECT_NEAR(dx[0], s * 1 - 3 * s3 * 5.5 + 0.5, 1e-6);
  EXPECT_NEAR(dx[1], s * 2 - 4 * s3 * 5.5 - 1, 1e-6);
  EXPECT_NEAR(partial[0], 3 * s, 1e-6);
  EXPECT_NEAR(partial[1], 4 * s, 1e-6);
  // Recompute without dh: six buffers will do.
  const Problem pr = with_options(problem(DType::f32, 1, 2), 0, true, 0.5);
  ASSERT_TRUE(bwd().cpu_reference(bwd().heuristic(pr), pr, std::span<void* const>(b, 6)).ok());
  EXPECT_NEAR(dx[0], s * 1 - 3 * s3 * 5.5, 1e-6);
  // A saved inv_rms with dh: the saved value is used, whatever x says.
  std::vector<float> inv = {0.5f};
  b[3] = inv.data();
  const Problem ps = with_options(problem(DType::f32, 1, 2), 2, false);
  ASSERT_TRUE(bwd().cpu_reference(bwd().heuristic(ps), ps, b).ok());
  EXPECT_NEAR(dx[0], 0.5 * 1 - 3 * 0.125 * 5.5 + 0.5, 1e-6);
  EXPECT_NEAR(partial[1], 4 * 0.5, 1e-6);
  // dh needs its buffer.
  EXPECT_EQ(bwd().cpu_reference(bwd().heuristic(p), p, std::span<void* const>(b, 6)).code(), Code::invalid_argument);
}

// With the options the reference is the gradient of add + RMSNorm through h (whose output h is
// also used, with gradient dh): L = sum(dy * rmsnorm(h, w)) + sum(dh * h), inv_rms from h.
TEST(RmsNormBwd, ReferenceWithOptionsIsTheGradientOfAddRmsNorm) {
  const std::int64_t rows = 3, cols = 7, stride = 9;
  const double eps = 1e-2;
  std::mt19937 rng(testing::fresh_seed());
  std::normal_distribution<float> n;
  std::vector<float> fh(rows * stride, NAN), fdy(rows * stride, NAN), fdh(rows * cols), fw(cols);
  std::vector<double> h(rows * cols), dy(rows * cols), dh(rows * cols), w(cols);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      h[r * cols + c] = fh[r * stride + c] = n(rng);
      dy[r * cols + c] = fdy[r * stride + c] = n(rng);
      dh[r * cols + c] = fdh[r * cols + c] = n(rng);
    }
  for (std::int64_t c = 0; c < cols; ++c) w[c] = fw[c] = n(rng);
  Problem p = with_options(problem(DType::f32, rows, cols, 1, 1, stride), cols, true, eps);
  std::vector<float> dx(rows * stride, NAN), partial(cols);
  void* b[7] = {fdy.data(), fh.data(), fw.data(), nullptr, dx.data(), partial.data(), fdh.data()};
  ASSERT_TRUE(bwd().cpu_reference(bwd().heuristic(p), p, b).ok());
  auto full_loss = [&](const std::vector<double>& hv, const std::vector<double>& wv) {
    double l = loss(hv, wv, dy, rows, cols, eps);
    for (std::size_t i = 0; i < hv.size(); ++i) l += dh[i] * hv[i];
    return l;
  };
  const double step = 1e-6;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      auto hp = h, hm = h;
      hp[r * cols + c] += step;
      hm[r * cols + c] -= step;
      const double fd = (full_loss(hp, w) - full_loss(hm, w)) / (2 * step);
      EXPECT_NEAR(dx[r * stride + c], fd, 1e-5 * (1 + std::abs(fd))) << "dx[" << r << ", " << c << "]";
    }
  EXPECT_TRUE(std::isnan(dx[cols])) << "padding between rows was written";
  for (std::int64_t c = 0; c < cols; ++c) {
    auto wp = w, wm = w;
    wp[c] += step;
    wm[c] -= step;
    const double fd = (full_loss(h, wp) - full_loss(h, wm)) / (2 * step);
    EXPECT_NEAR(partial[c], fd, 1e-5 * (1 + std::abs(fd))) << "dw[" << c << "]";
  }
}

TEST(RmsNormBwd, ReferenceSlabsPartitionRowsAndTheReductionSumsThem) {
  // 5 rows dealt to 2 slabs: rows 0, 2, 4 and 1, 3. Row r: x = r + 1, dy = 1, s = 1.
  const std::int64_t rows = 5, cols = 3;
  std::vector<std::uint16_t> dy(rows * 4), x(rows * 4), w(cols), dx(rows * 4, 0xBEEF);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      dy[r * 4 + c] = float_to_bf16(1.0f);
      x[r * 4 + c] = float_to_bf16(float(r + 1));
    }
  for (auto& v : w) v = float_to_bf16(1.0f);
  std::vector<float> inv_rms(rows, 1.0f), partial(2 * cols, NAN);
  Problem p = problem(DType::bf16, rows, cols, 2, 1, 4);
  void* b[6] = {dy.data(), x.data(), w.data(), inv_rms.data(), dx.data(), partial.data()};
  ASSERT_TRUE(bwd().cpu_reference(bwd().heuristic(p), p, b).ok());
  EXPECT_FLOAT_EQ(partial[0], 1 + 3 + 5);
  EXPECT_FLOAT_EQ(partial[cols], 2 + 4);
  EXPECT_EQ(dx[3], 0xBEEF);  // padding left alone
  // Row 0: dx = 1 - x * mean(x) = 1 - 1 = 0; row 1: 1 - 2 * 2 = -3.
  EXPECT_FLOAT_EQ(bf16_to_float(dx[0]), 0.0f);
  EXPECT_FLOAT_EQ(bf16_to_float(dx[4]), -3.0f);

  Problem pr = reduce_problem(DType::bf16, 2, cols);
  std::vector<std::uint16_t> dw(cols, 0xBEEF);
  void* r[2] = {partial.data(), dw.data()};
  ASSERT_TRUE(reduce().cpu_reference(reduce().heuristic(pr), pr, r).ok());
  for (auto v : dw) EXPECT_FLOAT_EQ(bf16_to_float(v), 15.0f);
  pr = reduce_problem(DType::bf16, 0, cols);  // no rows: dw = 0
  ASSERT_TRUE(reduce().cpu_reference(reduce().heuristic(pr), pr, r).ok());
  for (auto v : dw) EXPECT_EQ(v, 0);
}

TEST(RmsNormBwd, HeuristicFollowsItsRules) {
  auto h = rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 16384));
  EXPECT_EQ(h.vec, 8);
  EXPECT_EQ(h.cluster, 1);
  EXPECT_EQ(h.group, 512);  // half the row is re-read
  EXPECT_EQ(h.packs, 2);
  // Past 2048 16-byte packs, up to 8192: the clustered bulk kernel, clusters of 2 up to 4096 packs.
  h = rmsnorm_bwd_heuristic(problem(DType::f32, 4096, 16384, 1, 8));  // 4096 packs
  EXPECT_EQ(h.stages, 3);
  EXPECT_EQ(h.cluster, 2);
  EXPECT_EQ(h.group, 512);
  EXPECT_EQ(h.packs, 4);
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 32768, 1, 2)).cluster, 2);
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 65536, 1, 2)).stages, 0);  // needs clusters of 4
  h = rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 65536, 1, 8));
  EXPECT_EQ(h.stages, 3);
  EXPECT_EQ(h.cluster, 4);
  EXPECT_EQ(h.group, 512);
  EXPECT_EQ(h.packs, 4);
  EXPECT_EQ(h.sm_threads, 512);
  h = rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 20000, 1, 8));  // 2500 packs
  EXPECT_EQ(h.cluster, 2);
  EXPECT_EQ(h.group, 320);
  // Beyond 8192 packs, or without 16-byte rows or clusters: the register kernel in clusters of 8.
  h = rmsnorm_bwd_heuristic(problem(DType::f32, 4096, 65536, 1, 8));
  EXPECT_EQ(h.stages, 0);
  EXPECT_EQ(h.cluster, 8);
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 65540, 1, 8)).stages, 0);  // 131080-byte rows
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 65536, 1, 1)).stages, 0);
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 8192, 1, 8)).stages, 4);
  h = rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 2048, 1, 1));
  EXPECT_EQ(h.group, 128);
  EXPECT_EQ(h.rows, 2);
  EXPECT_EQ(h.stages, 0);
  // sm_90 (max_cluster 8), 256 to 2048 16-byte packs per row, aligned: bulk copies.
  h = rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 2048, 1, 8));
  EXPECT_EQ(h.stages, 4);
  EXPECT_EQ(h.group, 128);
  EXPECT_EQ(h.packs, 2);
  EXPECT_EQ(h.rows, 1);
  h = rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 5120, 1, 8));
  EXPECT_EQ(h.group, 320);  // 640 packs, two each, whole warps
  EXPECT_EQ(h.stages, 4);
  h = rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 16384, 1, 8));
  EXPECT_EQ(h.group, 512);
  EXPECT_EQ(h.packs, 4);
  EXPECT_EQ(h.stages, 2);  // 4 x 64 KiB would not fit
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::f32, 4096, 8192, 1, 8)).stages, 2);
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 1024, 1, 8)).stages, 0);   // 128 packs
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 2052, 1, 8)).stages, 0);   // 4104-byte rows
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 2048, 1, 8, 2052)).stages, 0);  // stride
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 4096, 2048, 1, 8, 0, 8)).stages, 0);  // alignment
  h = rmsnorm_bwd_heuristic(problem(DType::f32, 4096, 64));
  EXPECT_EQ(h.group, 32);
  EXPECT_EQ(h.rows, 8);  // one row per warp
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::f32, 3, 64)).rows, 2);
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 8, 4095)).vec, 1);
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::f16, 8, 4094)).vec, 2);
  EXPECT_EQ(rmsnorm_bwd_heuristic(problem(DType::bf16, 8, 4096, 1, 1, 0, 4)).vec, 2);
  // Whatever it picks passes check_problem, with the slab count it implies.
  for (std::int64_t max_cluster : {1, 8})
    for (std::int64_t rows : {1, 3, 37, 4096, 100000})
      for (std::int64_t cols : {1, 3, 7, 64, 1000, 2048, 4095, 4096, 5120, 16384, 20000, 32768, 65536, 131072})
        for (DType t : {DType::f32, DType::f16, DType::bf16}) {
          Problem p = problem(t, rows, cols, 1, max_cluster);
          const auto c = rmsnorm_bwd_heuristic(p);
          p = with_slabs(p, rmsnorm_bwd_slabs(c, p, 132));
          const Params params = bwd().heuristic(p);
          EXPECT_TRUE(bwd().validate(params).ok()) << params.canonical();
          EXPECT_TRUE(bwd().check_problem(params, p).ok()) << rows << "x" << cols << " " << params.canonical() << ": "
                                                           << bwd().check_problem(params, p).to_string();
          EXPECT_FALSE(bwd().tuning_space(p).empty());
        }
}

TEST(RmsNormBwd, HeuristicTakesTheOptions) {
  // The options follow the problem and leave the kernel's shape as it was...
  for (std::int64_t max_cluster : {1, 8})
    for (std::int64_t rows : {1, 37, 4096})
      for (std::int64_t cols : {7, 64, 1000, 2048, 4096, 5120, 8192, 20000, 32768, 65536})
        for (DType t : {DType::f32, DType::f16, DType::bf16})
          for (std::int64_t dh : {0, 1}) {
            const Problem plain = problem(t, rows, cols, 1, max_cluster);
            const Problem opts = with_options(plain, dh ? cols : 0);
            auto a = rmsnorm_bwd_heuristic(plain), b = rmsnorm_bwd_heuristic(opts);
            EXPECT_FALSE(a.recompute || a.dh);
            EXPECT_TRUE(b.recompute);
            EXPECT_EQ(b.dh, dh == 1);
            EXPECT_EQ(*bwd().heuristic(opts).get_int("recompute"), 1);
            EXPECT_EQ(*bwd().heuristic(opts).get_int("dh"), dh);
            auto shape = [](const RmsNormBwdChoice& c) {
              return std::tuple{c.group, c.rows, c.vec, c.packs, c.cluster, c.sm_threads, c.stages};
            };
            const bool spilling_bulk = dh && a.stages > 0 && a.cluster == 1 && a.packs * a.vec > 16;
            if (!spilling_bulk) {
              EXPECT_EQ(shape(a), shape(b)) << rows << "x" << cols;
            }
          }
  // ... but for f16 and bf16 rows of 1025 to 2048 packs with dh, which take the clustered kernel in
  // clusters of 2 at 2 packs per thread rather than the one-block kernel at 4.
  auto c = rmsnorm_bwd_heuristic(with_options(problem(DType::bf16, 4096, 16384, 1, 8), 16384));
  EXPECT_EQ(c.stages, 3);
  EXPECT_EQ(c.cluster, 2);
  EXPECT_EQ(c.group, 512);
  EXPECT_EQ(c.packs, 2);
  c = rmsnorm_bwd_heuristic(with_options(problem(DType::f16, 4096, 8200, 1, 8), 8200));  // 1025 packs
  EXPECT_EQ(c.cluster, 2);
  EXPECT_EQ(c.stages, 3);
  EXPECT_EQ(c.group, 288);
  EXPECT_EQ(c.packs, 2);
  EXPECT_EQ(rmsnorm_bwd_heuristic(with_options(problem(DType::bf16, 4096, 16384, 1, 8), 0)).cluster, 1);
  c = rmsnorm_bwd_heuristic(with_options(problem(DType::f32, 4096, 8192, 1, 8), 8192));  // 2048 f32 packs
  EXPECT_EQ(c.cluster, 1);
  EXPECT_EQ(c.stages, 2);
  EXPECT_EQ(rmsnorm_bwd_heuristic(with_options(problem(DType::bf16, 4096, 8192, 1, 8), 8192)).stages, 4);
  // dh's row stride counts like the others: for the access width and for bulk copies.
  EXPECT_EQ(rmsnorm_bwd_heuristic(with_options(problem(DType::bf16, 8, 4096), 4097)).vec, 1);
  EXPECT_EQ(rmsnorm_bwd_heuristic(with_options(problem(DType::bf16, 8, 4096), 4100)).vec, 4);
  EXPECT_EQ(rmsnorm_bwd_heuristic(with_options(problem(DType::bf16, 4096, 2048, 1, 8), 2052)).stages, 0);
  EXPECT_EQ(rmsnorm_bwd_heuristic(with_options(problem(DType::bf16, 4096, 2048, 1, 8), 2056)).stages, 4);
  // Whatever it picks passes check_problem, with the slab count it implies.
  for (std::int64_t max_cluster : {1, 8})
    for (std::int64_t rows : {1, 3, 37, 4096, 100000})
      for (std::int64_t cols : {1, 3, 7, 64, 1000, 2048, 4095, 4096, 5120, 8200, 16384, 20000, 32768, 65536, 131072})
        for (DType t : {DType::f32, DType::f16, DType::bf16})
          for (std::int64_t dh : {0, 1}) {
            Problem p = with_options(problem(t, rows, cols, 1, max_cluster), dh ? cols : 0);
            p = with_slabs(p, rmsnorm_bwd_slabs(rmsnorm_bwd_heuristic(p), p, 132));
            const Params params = bwd().heuristic(p);
            EXPECT_TRUE(bwd().validate(params).ok()) << params.canonical();
            EXPECT_TRUE(bwd().check_problem(params, p).ok()) << rows << "x" << cols << " " << params.canonical() << ": "
                                                             << bwd().check_problem(params, p).to_string();
            for (const Params& v : bwd().tuning_space(p)) {
              EXPECT_TRUE(bwd().validate(v).ok()) << v.canonical();
              EXPECT_EQ(*v.get_int("recompute"), 1) << v.canonical();
              EXPECT_EQ(*v.get_int("dh"), dh) << v.canonical();
            }
          }
}

TEST(RmsNormBwd, SlabsFillTheGpu) {
  for (std::int64_t rows : {1, 2, 5, 37, 1000, 4096, 32768, 100003})
    for (std::int64_t cols : {64, 2048, 4096, 16384, 65536})
      for (std::int64_t max_cluster : {1, 8}) {
        Problem p = problem(DType::bf16, rows, cols, 1, max_cluster);
        const auto c = rmsnorm_bwd_heuristic(p);
        const auto slabs = rmsnorm_bwd_slabs(c, p, 132);
        ASSERT_GE(slabs, 1);
        ASSERT_LE(slabs, rows);
        if (rows >= 4096) {
          EXPECT_GE(slabs * c.cluster, 132) << rows << "x" << cols;  // every SM busy
        }
      }
  EXPECT_EQ(rmsnorm_bwd_slabs(rmsnorm_bwd_heuristic(problem(DType::bf16, 0, 64)), problem(DType::bf16, 0, 64), 132), 0);
  // The clustered bulk kernel: one slab per resident cluster when the driver said how many, else
  // one per SMs / cluster; never more than the rows.
  const Problem wide = problem(DType::bf16, 4096, 65536, 1, 8);
  const auto c = rmsnorm_bwd_heuristic(wide);
  ASSERT_EQ(c.cluster, 4);
  EXPECT_EQ(rmsnorm_bwd_slabs(c, wide, 132, 30), 30);
  EXPECT_EQ(rmsnorm_bwd_slabs(c, wide, 132), 33);
  EXPECT_EQ(rmsnorm_bwd_slabs(c, problem(DType::bf16, 7, 65536, 1, 8), 132, 30), 7);
  // Smaller clustered blocks (dh's f16/bf16 rows of 1025 to 2048 packs) may come several to an SM:
  // without the driver's count, the bound counts them (a workspace sized by it must hold the
  // driver's count).
  const Problem small = with_options(problem(DType::bf16, 4096, 8200, 1, 8), 8200);
  const auto cs = rmsnorm_bwd_heuristic(small);
  ASSERT_EQ(cs.cluster, 2);
  ASSERT_EQ(cs.group, 288);  // 54 KiB of buffers: 4 blocks by shared memory, 7 by threads
  EXPECT_EQ(rmsnorm_bwd_slabs(cs, small, 132), 132 * 4 / 2);
  EXPECT_EQ(rmsnorm_bwd_slabs(cs, small, 132, 100), 100);
  // Other kernels ignore the resident count.
  const Problem narrow = problem(DType::bf16, 4096, 4096, 1, 8);
  EXPECT_EQ(rmsnorm_bwd_slabs(rmsnorm_bwd_heuristic(narrow), narrow, 132, 30),
            rmsnorm_bwd_slabs(rmsnorm_bwd_heuristic(narrow), narrow, 132));
}

TEST(RmsNormBwd, CheckProblemRejectsMismatches) {
  const Params p8 = bwd_params("bf16", 512, 1, 8, 2, 1);
  EXPECT_TRUE(bwd().check_problem(p8, problem(DType::bf16, 8, 4096, 4)).ok());
  EXPECT_EQ(bwd().check_problem(p8, problem(DType::f16, 8, 4096, 4)).code(), Code::unsupported_dtype);
  EXPECT_EQ(bwd().check_problem(p8, problem(DType::bf16, 8, 4092, 4)).code(), Code::invalid_argument);  // stride % vec
  EXPECT_EQ(bwd().check_problem(p8, problem(DType::bf16, 8, 4096, 4, 1, 0, 8)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().check_problem(p8, problem(DType::bf16, 8, 4096, 4, 1, 2048)).code(), Code::shape_mismatch);
  EXPECT_EQ(bwd().check_problem(p8, problem(DType::bf16, 8, 4096, 0)).code(), Code::invalid_argument);  // no slab
  EXPECT_EQ(bwd().check_problem(p8, problem(DType::bf16, 8, 4096, 9)).code(), Code::invalid_argument);  // > rows
  EXPECT_EQ(bwd().check_problem(p8, problem(DType::bf16, 8, 0, 1)).code(), Code::shape_mismatch);
  EXPECT_EQ(bwd().check_problem(bwd_params("bf16", 512, 1, 8, 2, 2), problem(DType::bf16, 8, 4096, 4)).code(),
            Code::invalid_argument);  // cluster on a device without clusters
  const Params bulk = bwd_params("bf16", 256, 1, 8, 2, 1, 512, 4);
  EXPECT_TRUE(bwd().check_problem(bulk, problem(DType::bf16, 8, 4096, 4, 8)).ok());
  EXPECT_EQ(bwd().check_problem(bulk, problem(DType::bf16, 8, 4096, 4, 1)).code(), Code::invalid_argument);  // sm_80
  EXPECT_EQ(bwd().check_problem(bulk, problem(DType::bf16, 8, 4104, 4, 8)).code(), Code::invalid_argument);  // long
  EXPECT_EQ(bwd().check_problem(bulk, problem(DType::bf16, 8, 4084, 4, 8, 4096)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().check_problem(bulk, problem(DType::bf16, 8, 4096, 4, 8, 0, 8)).code(), Code::invalid_argument);
  EXPECT_TRUE(bwd().check_problem(bwd_params("bf16", 512, 1, 8, 2, 2), problem(DType::bf16, 8, 4096, 4, 8)).ok());
  // The clustered bulk kernel: the row within cluster * group * packs packs (none beyond 2048
  // needed), 16-byte rows and strides, a device with clusters of that size.
  const Params wide = bwd_params("bf16", 512, 1, 8, 4, 4, 512, 3);
  EXPECT_TRUE(bwd().check_problem(wide, problem(DType::bf16, 8, 65536, 4, 8)).ok());
  EXPECT_TRUE(bwd().check_problem(wide, problem(DType::bf16, 8, 20000, 4, 8)).ok());
  EXPECT_TRUE(bwd().check_problem(wide, problem(DType::bf16, 8, 64, 4, 8)).ok());  // blocks 1-3 own nothing
  EXPECT_EQ(bwd().check_problem(wide, problem(DType::bf16, 8, 65544, 4, 8)).code(), Code::invalid_argument);  // long
  EXPECT_EQ(bwd().check_problem(wide, problem(DType::bf16, 8, 65532, 4, 8)).code(), Code::invalid_argument);  // 8 B
  EXPECT_EQ(bwd().check_problem(wide, problem(DType::bf16, 8, 65536, 4, 8, 0, 8)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().check_problem(wide, problem(DType::bf16, 8, 65536, 4, 2)).code(), Code::invalid_argument);
  // Several rows per block need the whole row in registers.
  EXPECT_EQ(bwd().check_problem(bwd_params("bf16", 128, 2, 8, 1, 1), problem(DType::bf16, 8, 4096, 4)).code(),
            Code::invalid_argument);
  EXPECT_TRUE(bwd().check_problem(bwd_params("bf16", 128, 2, 8, 1, 1), problem(DType::bf16, 8, 1024, 4)).ok());
  Problem pr = reduce_problem(DType::f16, 4, 0);
  const Params r = reduce_params("f16", 256);
  EXPECT_EQ(reduce().check_problem(r, pr).code(), Code::shape_mismatch);
  pr = reduce_problem(DType::f16, 4, 100);
  EXPECT_TRUE(reduce().check_problem(r, pr).ok());
  pr.dtype = DType::f32;
  EXPECT_EQ(reduce().check_problem(r, pr).code(), Code::unsupported_dtype);
}

TEST(RmsNormBwd, CheckProblemRejectsOptionMismatches) {
  const Params plain = bwd_params("bf16", 512, 1, 8, 2, 1);
  const Params both = bwd_params("bf16", 512, 1, 8, 2, 1, 512, 0, 1, 1);
  const Params recompute = bwd_params("bf16", 512, 1, 8, 2, 1, 512, 0, 1, 0);
  const Problem p = problem(DType::bf16, 8, 4096, 4);
  EXPECT_TRUE(bwd().check_problem(both, with_options(p, 4096)).ok());
  EXPECT_TRUE(bwd().check_problem(both, with_options(p, 8192)).ok());  // dh in wider rows
  EXPECT_TRUE(bwd().check_problem(recompute, with_options(p, 0)).ok());
  EXPECT_TRUE(bwd().check_problem(bwd_params("bf16", 512, 1, 8, 2, 1, 512, 0, 0, 1), with_options(p, 4096, false)).ok());
  // The kernel's options must be the problem's.
  EXPECT_EQ(bwd().check_problem(plain, with_options(p, 4096)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().check_problem(plain, with_options(p, 0)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().check_problem(both, p).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().check_problem(both, with_options(p, 0)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().check_problem(recompute, with_options(p, 4096)).code(), Code::invalid_argument);
  // dh's rows: at least the row length, and aligned to the access width.
  EXPECT_EQ(bwd().check_problem(both, with_options(p, 2048)).code(), Code::shape_mismatch);
  EXPECT_EQ(bwd().check_problem(both, with_options(p, 4100)).code(), Code::invalid_argument);
  // eps (a value, checked here for direct launches) and the recompute flag itself.
  EXPECT_EQ(bwd().check_problem(both, with_options(p, 4096, true, -1)).code(), Code::invalid_argument);
  EXPECT_EQ(bwd().check_problem(both, with_options(p, 4096, true, NAN)).code(), Code::invalid_argument);
  EXPECT_TRUE(bwd().check_problem(bwd_params("bf16", 512, 1, 8, 2, 1, 512, 0, 0, 1), with_options(p, 4096, false, -1))
                  .ok());  // eps unused without recompute
  auto q = with_options(p, 4096).as<RmsNormBwdProblem>();
  q.recompute = 2;
  EXPECT_EQ(bwd().check_problem(both, Problem::of(DType::bf16, 16, q)).code(), Code::invalid_argument);
  // Bulk copies of dh need 16-byte rows too.
  const Params bulk = bwd_params("bf16", 256, 1, 8, 2, 1, 512, 4, 1, 1);
  EXPECT_TRUE(bwd().check_problem(bulk, with_options(problem(DType::bf16, 8, 4096, 4, 8), 4096)).ok());
  EXPECT_EQ(bwd().check_problem(bulk, with_options(problem(DType::bf16, 8, 4096, 4, 8), 4100)).code(),
            Code::invalid_argument);
  const Params wide = bwd_params("bf16", 512, 1, 8, 4, 4, 512, 3, 1, 1);
  EXPECT_TRUE(bwd().check_problem(wide, with_options(problem(DType::bf16, 8, 65536, 4, 8), 65536)).ok());
  EXPECT_EQ(bwd().check_problem(wide, with_options(problem(DType::bf16, 8, 65536, 4, 8), 65540)).code(),
            Code::invalid_argument);
}

TEST(RmsNormBwd, OptionsCompileOutOfTheRenderedSource) {
  // Variants without the options render as before the options existed (their template
  // arguments default to false); with them, both are spelled out.
  auto name = [](const Params& p) { return bwd().render(p)->name_expression; };
  EXPECT_EQ(name(bwd_params("bf16", 512, 1, 8, 2, 1, 1024)), "kiln::rmsnorm_bwd<kiln::bf16_t, 512, 1, 8, 2, 1, 1024>");
  EXPECT_EQ(name(bwd_params("bf16", 320, 1, 8, 2, 1, 512, 4)), "kiln::rmsnorm_bwd_bulk<kiln::bf16_t, 320, 2, 4>");
  EXPECT_EQ(name(bwd_params("bf16", 512, 1, 8, 4, 4, 512, 3)),
            "kiln::rmsnorm_bwd_bulk_cluster<kiln::bf16_t, 512, 4, 3, 4>");
  EXPECT_EQ(name(bwd_params("f32", 512, 1, 4, 2, 1, 1024, 0, 1, 1)),
            "kiln::rmsnorm_bwd<float, 512, 1, 4, 2, 1, 1024, true, true>");
  EXPECT_EQ(name(bwd_params("bf16", 320, 1, 8, 2, 1, 512, 4, 1, 0)),
            "kiln::rmsnorm_bwd_bulk<kiln::bf16_t, 320, 2, 4, true, false>");
  EXPECT_EQ(name(bwd_params("bf16", 512, 1, 8, 4, 4, 512, 3, 0, 1)),
            "kiln::rmsnorm_bwd_bulk_cluster<kiln::bf16_t, 512, 4, 3, 4, false, true>");
  EXPECT_EQ(bwd().render(bwd_params("bf16", 512, 1, 8, 4, 4, 512, 3, 1, 1))->source,
            bwd().render(bwd_params("bf16", 512, 1, 8, 4, 4, 512, 3))->source);
}

TEST(RmsNormBwd, GeometryBuffersAndArgs) {
  Problem p = problem(DType::bf16, 7, 64, 3, 8, 128);
  const Params params = bwd_params("bf16", 32, 2, 8, 1, 2);
  auto g = bwd().geometry(params, p);
  EXPECT_EQ(g.grid.x, 6u);  // 3 slabs x cluster 2
  EXPECT_EQ(g.block.x, 64u);
  auto bs = bwd().buffers(params, p);
  ASSERT_EQ(bs.size(), 7u);
  EXPECT_EQ(bs[0].elements, 6 * 128 + 64);
  EXPECT_EQ(bs[3].dtype, DType::f32);
  EXPECT_EQ(bs[3].elements, 7);
  EXPECT_EQ(bs[4].role, BufferRole::output);
  EXPECT_EQ(bs[5].elements, 3 * 64);
  EXPECT_EQ(bs[6].role, BufferRole::input);
  EXPECT_EQ(bs[6].elements, 0);  // no dh
  ArgPack args;
  int a[7];
  void* bufs[7] = {&a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6]};
  // Without dh the seventh buffer may be left out: its argument is then null.
  bwd().pack_args(params, p, std::span<void* const>(bufs, 6), args);
  ASSERT_EQ(args.count(), 15u);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[5]), &a[5]);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[6]), 7);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[8]), 128);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[11]), 3);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[12]), nullptr);
  // With the options: dh and its stride, eps as a float; no inv_rms to allocate.
  const Problem po = with_options(p, 96, true, 0.25);
  bs = bwd().buffers(params, po);
  EXPECT_EQ(bs[3].elements, 0);
  EXPECT_EQ(bs[6].dtype, DType::bf16);
  EXPECT_EQ(bs[6].elements, 6 * 96 + 64);
  args.clear();
  bwd().pack_args(params, po, bufs, args);
  ASSERT_EQ(args.count(), 15u);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[12]), &a[6]);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[13]), 96);
  EXPECT_EQ(*static_cast<float*>(args.pointers()[14]), 0.25f);

  Problem pr = reduce_problem(DType::bf16, 3, 100);
  const Params r = reduce().heuristic(pr);
  EXPECT_EQ(*r.get_int("block"), 128);
  EXPECT_EQ(*r.get_int("columns"), 8);  // 100 columns: as many blocks as there can be
  g = reduce().geometry(r, pr);
  EXPECT_EQ(g.grid.x, 13u);
  EXPECT_EQ(g.block.x, 128u);
  EXPECT_EQ(g.block.y, 1u);
  // The second stage waits for the first with griddepcontrol.wait, so it may launch as its
  // programmatic dependent (the flag crosses the plugin ABI that built-in families register
  // through); the first stage waits for nothing and must not.
  EXPECT_TRUE(reduce().programmatic_launch());
  EXPECT_FALSE(bwd().programmatic_launch());
  EXPECT_EQ(*reduce().heuristic(reduce_problem(DType::bf16, 3, 16384)).get_int("columns"),
            32);  // 32 columns still give 512 blocks
  EXPECT_EQ(*reduce().heuristic(reduce_problem(DType::bf16, 3, 4096)).get_int("columns"), 16);
  ArgPack ra;
  reduce().pack_args(r, pr, std::span<void* const>(bufs, 2), ra);
  ASSERT_EQ(ra.count(), 4u);
  EXPECT_EQ(*static_cast<long long*>(ra.pointers()[3]), 100);
}

// add_rms_norm_backward's training variants (recompute, with dh) are in the catalog for every
// kernel (the register kernel, the bulk-copy kernel and the clustered one), as many as those
// without options.
TEST(RmsNormBwd, CatalogHoldsTheOptionsForEveryKernel) {
  std::set<std::tuple<int, bool, bool>> seen;  // (kernel, recompute, dh)
  std::size_t plain = 0, fused = 0;
  for (const Params& p : bwd().catalog()) {
    const auto c = rmsnorm_bwd_choice(p);
    const int kernel = c.stages == 0 ? 0 : c.cluster == 1 ? 1 : 2;
    seen.insert({kernel, c.recompute, c.dh});
    EXPECT_EQ(c.recompute, c.dh) << p.canonical();
    (c.dh ? fused : plain) += 1;
  }
  for (int kernel : {0, 1, 2})
    for (bool options : {false, true}) EXPECT_TRUE(seen.count({kernel, options, options})) << kernel << " " << options;
  EXPECT_EQ(fused, plain);
}

TEST(RmsNormBwd, CatalogsAreValidAndRenderDistinctNames) {
  for (const Family* f : {&bwd(), &reduce()}) {
    auto cat = f->catalog();
    EXPECT_GE(cat.size(), 12u);
    std::set<std::string> names;
    for (const auto& p : cat) {
      ASSERT_TRUE(f->validate(p).ok()) << p.canonical();
      auto r = f->render(p);
      ASSERT_TRUE(r.ok());
      names.insert(r->name_expression);
    }
    EXPECT_EQ(names.size(), cat.size());
  }
}

// The typed op: every error before anything is resolved, and the host fallback.
class RmsNormBwdOp : public ::testing::Test {
 protected:
  static constexpr std::int64_t k_rows = 4, k_cols = 64;
  void SetUp() override {
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    rt_ = Runtime::create(o).value();
    for (auto* v : {&dy_, &x_, &dx_}) v->assign(k_rows * k_cols, 0.5f);
    w_.assign(k_cols, 1.0f);
    dw_.assign(k_cols, 0.0f);
    inv_.assign(k_rows, 1.0f);
  }
  TensorView view(std::vector<float>& v, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(v.data(), DType::f32, shape, Device::cpu());
  }
  Status call(TensorView dy, TensorView x, TensorView w, TensorView inv, TensorView dx, TensorView dw,
              const TensorView* ws = nullptr) {
    return rms_norm_backward(dy, x, w, inv, dx, dw, nullptr, rt_.get(), ws);
  }
  Status call_default() {
    return call(view(dy_, {k_rows, k_cols}), view(x_, {k_rows, k_cols}), view(w_, {k_cols}), view(inv_, {k_rows}),
                view(dx_, {k_rows, k_cols}), view(dw_, {k_cols}));
  }
  void expect(const Status& s, Code c, const char* what) {
    EXPECT_EQ(s.code(), c) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
    RuntimeCounters k = rt_->counters();
    EXPECT_EQ(k.from_embedded + k.from_daemon + k.module_loads + k.table_hits, 0) << what << " resolved a kernel";
  }
  std::shared_ptr<Runtime> rt_;
  std::vector<float> dy_, x_, w_, dx_, dw_, inv_;
};

TEST_F(RmsNormBwdOp, ShapeErrors) {
  auto dy = view(dy_, {k_rows, k_cols}), x = view(x_, {k_rows, k_cols}), w = view(w_, {k_cols}),
       inv = view(inv_, {k_rows}), dx = view(dx_, {k_rows, k_cols}), dw = view(dw_, {k_cols});
  expect(call(view(dy_, {k_cols, k_rows}), x, w, inv, dx, dw), Code::shape_mismatch, "dy shape");
  expect(call(dy, x, w, inv, view(dx_, {k_rows * k_cols}), dw), Code::shape_mismatch, "dx rank");
  expect(call(dy, x, view(w_, {k_cols / 2}), inv, dx, dw), Code::shape_mismatch, "weight length");
  expect(call(dy, x, w, inv, dx, view(dw_, {1, k_cols})), Code::shape_mismatch, "dw rank");
  expect(call(dy, x, w, view(inv_, {k_rows - 1}), dx, dw), Code::shape_mismatch, "inv_rms length");
  auto inv_strided = view(inv_, {2});
  inv_strided.shape[0] = k_rows / 2;
  inv_strided.strides[0] = 2;
  expect(call(view(dy_, {2, k_cols}), view(x_, {2, k_cols}), w, inv_strided, view(dx_, {2, k_cols}), dw),
         Code::shape_mismatch, "inv_rms strided");
  auto xt = x;  // last dimension not contiguous
  xt.strides[1] = 2;
  expect(call(dy, xt, w, inv, dx, dw), Code::shape_mismatch, "x last dim");
  auto ws = TensorView::contiguous(dw_.data(), DType::f32, {k_cols}, Device::cpu());
  ws.strides[0] = 2;
  expect(call(dy, x, w, inv, dx, dw, &ws), Code::shape_mismatch, "strided workspace");
}

TEST_F(RmsNormBwdOp, DtypeErrors) {
  auto dy = view(dy_, {k_rows, k_cols}), x = view(x_, {k_rows, k_cols}), w = view(w_, {k_cols}),
       inv = view(inv_, {k_rows}), dx = view(dx_, {k_rows, k_cols}), dw = view(dw_, {k_cols});
  auto xi = x;
  xi.dtype = DType::i32;
  expect(call(dy, xi, w, inv, dx, dw), Code::unsupported_dtype, "int x");
  auto wh = w;
  wh.dtype = DType::bf16;
  expect(call(dy, x, wh, inv, dx, dw), Code::unsupported_dtype, "weight dtype");
  auto dwh = dw;
  dwh.dtype = DType::f16;
  expect(call(dy, x, w, inv, dx, dwh), Code::unsupported_dtype, "dw dtype");
  auto invh = inv;
  invh.dtype = DType::bf16;
  expect(call(dy, x, w, invh, dx, dw), Code::unsupported_dtype, "inv_rms dtype");
  auto ws = view(dw_, {k_cols});
  ws.dtype = DType::f16;
  expect(call(dy, x, w, inv, dx, dw, &ws), Code::unsupported_dtype, "workspace dtype");
}

TEST_F(RmsNormBwdOp, DeviceAndPointerErrors) {
  auto dy = view(dy_, {k_rows, k_cols}), x = view(x_, {k_rows, k_cols}), w = view(w_, {k_cols}),
       inv = view(inv_, {k_rows}), dx = view(dx_, {k_rows, k_cols}), dw = view(dw_, {k_cols});
  auto on_gpu = dy;
  on_gpu.device = Device::cuda(0);
  expect(call(on_gpu, x, w, inv, dx, dw), Code::device_error, "dy on the GPU, x on the host");
  auto inv_gpu = inv;
  inv_gpu.device = Device::cuda(0);
  expect(call(dy, x, w, inv_gpu, dx, dw), Code::device_error, "inv_rms on the GPU");
  auto ws = view(dw_, {k_cols});
  expect(call(dy, x, w, inv, dx, dw, &ws), Code::device_error, "workspace with host tensors");
  // Host memory labelled as CUDA: the driver (or its absence) says it is not device memory.
  auto all_gpu = [](TensorView t) {
    t.device = Device::cuda(0);
    return t;
  };
  expect(call(all_gpu(dy), all_gpu(x), all_gpu(w), all_gpu(inv), all_gpu(dx), all_gpu(dw)), Code::device_error,
         "host pointers labelled CUDA");
  auto null_dx = dx;
  null_dx.data = nullptr;
  expect(call(dy, x, w, inv, null_dx, dw), Code::invalid_argument, "null dx");
}

TEST_F(RmsNormBwdOp, HostFallbackMatchesTheFormula) {
  std::mt19937 rng(testing::fresh_seed());
  std::normal_distribution<float> n;
  for (DType t : {DType::f32, DType::bf16}) {
    // 3 rows of 5 in a row stride of 8 (dy, x), dx contiguous.
    const std::int64_t rows = 3, cols = 5, stride = 8;
    std::vector<double> dy(rows * stride), x(rows * stride), w(cols);
    std::vector<unsigned char> bdy(rows * stride * 4), bx(rows * stride * 4), bw(cols * 4), bdx(rows * cols * 4),
        bdw(cols * 4);
    auto fill = [&](std::vector<double>& v, std::vector<unsigned char>& b) {
      for (std::size_t i = 0; i < v.size(); ++i) {
        store_from_double(b.data(), t, std::int64_t(i), n(rng));
        v[i] = load_as_double(b.data(), t, std::int64_t(i));
      }
    };
    fill(dy, bdy);
    fill(x, bx);
    fill(w, bw);
    std::vector<float> inv(rows);
    for (std::int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (std::int64_t c = 0; c < cols; ++c) ss += x[r * stride + c] * x[r * stride + c];
      inv[r] = float(1 / std::sqrt(ss / cols + 1e-6));
    }
    auto strided = [&](std::vector<unsigned char>& b) {
      auto v = TensorView::contiguous(b.data(), t, {rows, cols}, Device::cpu());
      v.strides[0] = stride;
      return v;
    };
    Status s = rms_norm_backward(strided(bdy), strided(bx), TensorView::contiguous(bw.data(), t, {cols}, Device::cpu()),
                                 TensorView::contiguous(inv.data(), DType::f32, {rows, 1}, Device::cpu()),
                                 TensorView::contiguous(bdx.data(), t, {rows, cols}, Device::cpu()),
                                 TensorView::contiguous(bdw.data(), t, {cols}, Device::cpu()), nullptr, rt_.get());
    ASSERT_TRUE(s.ok()) << s.to_string();
    const double tol = t == DType::f32 ? 1e-5 : 2e-2;
    std::vector<double> dw(cols, 0);
    for (std::int64_t r = 0; r < rows; ++r) {
      double dot = 0;
      for (std::int64_t c = 0; c < cols; ++c) dot += dy[r * stride + c] * w[c] * x[r * stride + c];
      const double sv = inv[r];
      for (std::int64_t c = 0; c < cols; ++c) {
        const double want = sv * dy[r * stride + c] * w[c] - x[r * stride + c] * sv * sv * sv * dot / cols;
        EXPECT_NEAR(load_as_double(bdx.data(), t, r * cols + c), want, tol * (1 + std::abs(want)));
        dw[c] += dy[r * stride + c] * x[r * stride + c] * sv;
      }
    }
    for (std::int64_t c = 0; c < cols; ++c)
      EXPECT_NEAR(load_as_double(bdw.data(), t, c), dw[c], tol * (1 + std::abs(dw[c])));
  }
  EXPECT_EQ(rt_->counters().module_loads, 0);
}

TEST_F(RmsNormBwdOp, NoRowsGiveAZeroWeightGradient) {
  dw_.assign(k_cols, NAN);
  Status s = call(view(dy_, {0, k_cols}), view(x_, {0, k_cols}), view(w_, {k_cols}), view(inv_, {0}),
                  view(dx_, {0, k_cols}), view(dw_, {k_cols}));
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (float v : dw_) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(rms_norm_backward_workspace_elements(view(x_, {k_rows, k_cols})).value(), 0);  // host tensors
  ASSERT_TRUE(call_default().ok());
}

// add_rms_norm_backward: its declaration, every error before anything is resolved, and the host
// fallback against the formula.
class AddRmsNormBwdOp : public RmsNormBwdOp {
 protected:
  void SetUp() override {
    RmsNormBwdOp::SetUp();
    dh_.assign(k_rows * k_cols, 0.25f);
  }
  Status add(TensorView dy, const TensorView* dh, TensorView h, TensorView w, TensorView dx, TensorView dw,
             double eps = 1e-6, const TensorView* ws = nullptr) {
    return add_rms_norm_backward(dy, dh, h, w, dx, dw, eps, nullptr, rt_.get(), ws);
  }
  std::vector<float> dh_;
};

TEST_F(AddRmsNormBwdOp, IsDeclared) {
  const OpDecl* op = Registry::global().find_op("add_rms_norm_backward");
  ASSERT_NE(op, nullptr);
  ASSERT_EQ(op->tensors.size(), 7u);
  EXPECT_EQ(op->tensors[1].name, "dh");
  EXPECT_TRUE(op->tensors[1].optional);
  EXPECT_EQ(op->tensors[1].grad_of, "residual_out");
  EXPECT_EQ(op->tensors[2].name, "h");
  EXPECT_EQ(op->input_count(), 5u);
  ASSERT_EQ(op->scalars.size(), 1u);
  EXPECT_EQ(op->scalars[0].name, "eps");
  EXPECT_TRUE(op->cpu);
  EXPECT_TRUE(op->check().ok()) << op->check().to_string();
}

TEST_F(AddRmsNormBwdOp, Errors) {
  auto dy = view(dy_, {k_rows, k_cols}), h = view(x_, {k_rows, k_cols}), w = view(w_, {k_cols}),
       dx = view(dx_, {k_rows, k_cols}), dw = view(dw_, {k_cols}), dh = view(dh_, {k_rows, k_cols});
  auto bad_shape = view(dh_, {k_cols, k_rows});
  expect(add(dy, &bad_shape, h, w, dx, dw), Code::shape_mismatch, "dh shape");
  auto flat = view(dh_, {k_rows * k_cols});
  expect(add(dy, &flat, h, w, dx, dw), Code::shape_mismatch, "dh rank");
  auto last_strided = dh;
  last_strided.strides[1] = 2;
  expect(add(dy, &last_strided, h, w, dx, dw), Code::shape_mismatch, "dh last dim");
  auto broadcast = dh;  // one row seen k_rows times, as an expanded gradient is
  broadcast.strides[0] = 0;
  expect(add(dy, &broadcast, h, w, dx, dw), Code::shape_mismatch, "dh rows overlap");
  auto dh_half = dh;
  dh_half.dtype = DType::bf16;
  expect(add(dy, &dh_half, h, w, dx, dw), Code::unsupported_dtype, "dh dtype");
  auto h_int = h;
  h_int.dtype = DType::i32;
  expect(add(dy, &dh, h_int, w, dx, dw), Code::unsupported_dtype, "int h");
  expect(add(dy, &dh, h, view(w_, {k_cols / 2}), dx, dw), Code::shape_mismatch, "weight length");
  expect(add(dy, &dh, h, w, dx, dw, -1e-6), Code::invalid_argument, "negative eps");
  expect(add(dy, &dh, h, w, dx, dw, NAN), Code::invalid_argument, "NaN eps");
  expect(add(dy, nullptr, h, w, dx, dw, INFINITY), Code::invalid_argument, "infinite eps");
  auto dh_gpu = dh;
  dh_gpu.device = Device::cuda(0);
  expect(add(dy, &dh_gpu, h, w, dx, dw), Code::device_error, "dh on the GPU, h on the host");
  auto ws = view(dw_, {k_cols});
  expect(add(dy, &dh, h, w, dx, dw, 1e-6, &ws), Code::device_error, "workspace with host tensors");
  auto null_dh = dh;
  null_dh.data = nullptr;
  expect(add(dy, &null_dh, h, w, dx, dw), Code::invalid_argument, "null dh");
}

TEST_F(AddRmsNormBwdOp, HostFallbackMatchesTheFormula) {
  std::mt19937 rng(testing::fresh_seed());
  std::normal_distribution<float> n;
  const double eps = 1e-3;
  for (DType t : {DType::f32, DType::bf16})
    for (bool with_dh : {false, true})
      for (bool in_place : {false, true}) {  // in place: dx is dh (or dy without dh)
        // 3 rows of 5: dy and h in a row stride of 8, dh of 6; dx contiguous unless in place.
        const std::int64_t rows = 3, cols = 5, stride = 8, dh_stride = 6;
        std::vector<double> dy(rows * stride), h(rows * stride), dh(rows * dh_stride, 0.0), w(cols);
        std::vector<unsigned char> bdy(rows * stride * 4), bh(rows * stride * 4), bdh(rows * dh_stride * 4),
            bw(cols * 4), bdx(rows * cols * 4), bdw(cols * 4);
        auto fill = [&](std::vector<double>& v, std::vector<unsigned char>& b) {
          for (std::size_t i = 0; i < v.size(); ++i) {
            store_from_double(b.data(), t, std::int64_t(i), n(rng));
            v[i] = load_as_double(b.data(), t, std::int64_t(i));
          }
        };
        fill(dy, bdy);
        fill(h, bh);
        fill(w, bw);
        if (with_dh) fill(dh, bdh);
        auto strided = [&](std::vector<unsigned char>& b, std::int64_t s) {
          auto v = TensorView::contiguous(b.data(), t, {rows, cols}, Device::cpu());
          v.strides[0] = s;
          return v;
        };
        const TensorView dhv = strided(bdh, dh_stride);
        const TensorView dxv = !in_place ? TensorView::contiguous(bdx.data(), t, {rows, cols}, Device::cpu())
                               : with_dh ? dhv
                                         : strided(bdy, stride);
        Status s = add_rms_norm_backward(strided(bdy, stride), with_dh ? &dhv : nullptr, strided(bh, stride),
                                         TensorView::contiguous(bw.data(), t, {cols}, Device::cpu()), dxv,
                                         TensorView::contiguous(bdw.data(), t, {cols}, Device::cpu()), eps, nullptr,
                                         rt_.get());
        ASSERT_TRUE(s.ok()) << s.to_string();
        const double tol = t == DType::f32 ? 1e-5 : 2e-2;
        std::vector<double> dw(cols, 0);
        for (std::int64_t r = 0; r < rows; ++r) {
          double dot = 0, ss = 0;
          for (std::int64_t c = 0; c < cols; ++c) {
            dot += dy[r * stride + c] * w[c] * h[r * stride + c];
            ss += h[r * stride + c] * h[r * stride + c];
          }
          const double sv = 1 / std::sqrt(ss / cols + eps);
          for (std::int64_t c = 0; c < cols; ++c) {
            const double want = sv * dy[r * stride + c] * w[c] - h[r * stride + c] * sv * sv * sv * dot / cols +
                                dh[r * dh_stride + c];
            const std::int64_t at = r * dxv.strides[0] + c;
            EXPECT_NEAR(load_as_double(dxv.data, t, at), want, tol * (1 + std::abs(want)))
                << dtype_name(t) << (with_dh ? " dh" : "") << (in_place ? " in place" : "") << " [" << r << ", " << c
                << "]";
            dw[c] += dy[r * stride + c] * h[r * stride + c] * sv;
          }
        }
        for (std::int64_t c = 0; c < cols; ++c)
          EXPECT_NEAR(load_as_double(bdw.data(), t, c), dw[c], tol * (1 + std::abs(dw[c])));
      }
  EXPECT_EQ(rt_->counters().module_loads, 0);
}

TEST_F(AddRmsNormBwdOp, NoRowsGiveAZeroWeightGradient) {
  dw_.assign(k_cols, NAN);
  auto dh = view(dh_, {0, k_cols});
  Status s = add(view(dy_, {0, k_cols}), &dh, view(x_, {0, k_cols}), view(w_, {k_cols}), view(dx_, {0, k_cols}),
                 view(dw_, {k_cols}));
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (float v : dw_) EXPECT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace kiln::families
