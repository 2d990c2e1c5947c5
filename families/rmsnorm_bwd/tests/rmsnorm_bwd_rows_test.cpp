// rmsnorm_bwd_rows without a GPU: the heuristic's shapes, which problems it holds, what
// check_problem refuses, the catalog, and its CPU reference against the two-stage reference
// (rmsnorm_bwd, then rmsnorm_bwd_reduce) on the same inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "common/half.h"
#include "families/common/family_util.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd_rows.h"
#include "kiln/family.h"

namespace kiln {
namespace {

using families::RmsNormBwdRowsProblem;

const Family& rows_family() { return *Registry::global().find("rmsnorm_bwd_rows"); }

Problem problem(DType t, std::int64_t rows, std::int64_t cols, bool fused = false, std::int64_t stride = 0,
                std::uint32_t alignment = 16) {
  const std::int64_t s = stride ? stride : cols;
  return Problem::of(t, alignment,
                     RmsNormBwdRowsProblem{.rows = rows,
                                           .cols = cols,
                                           .dy_row_stride = s,
                                           .x_row_stride = s,
                                           .dx_row_stride = s,
                                           .dh_row_stride = fused ? s : 0,
                                           .recompute = fused ? 1 : 0,
                                           .eps = 1e-6});
}

TEST(RmsNormBwdRows, HeuristicHoldsTheRowsInOneCluster) {
  const Family& f = rows_family();
  const Params one = f.heuristic(problem(DType::bf16, 1, 4096));
  EXPECT_EQ(*one.get_int("cluster"), 1);
  EXPECT_EQ(*one.get_int("block"), 512);
  EXPECT_EQ(*one.get_int("packs"), 1);
  EXPECT_EQ(*one.get_int("vec"), 8);
  const Params three = f.heuristic(problem(DType::bf16, 3, 896, true));
  EXPECT_EQ(*three.get_int("cluster"), 4);
  EXPECT_EQ(*three.get_int("block"), 128);
  EXPECT_EQ(*three.get_int("recompute"), 1);
  EXPECT_EQ(*three.get_int("dh"), 1);
  const Params wide = f.heuristic(problem(DType::bf16, 8, 16384));
  EXPECT_EQ(*wide.get_int("cluster"), 8);
  EXPECT_EQ(*wide.get_int("block"), 1024);
  EXPECT_EQ(*wide.get_int("packs"), 2);
  EXPECT_EQ(*f.heuristic(problem(DType::f32, 2, 4096)).get_int("vec"), 4);
  for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 8}, {3, 896}, {8, 4096}, {5, 16384}}) {
    const Problem p = problem(DType::bf16, rows, cols);
    EXPECT_TRUE(f.check_problem(f.heuristic(p), p).ok()) << rows << "x" << cols;
    EXPECT_EQ(f.geometry(f.heuristic(p), p).grid.x, std::uint32_t(*f.heuristic(p).get_int("cluster")));
  }
  // Several blocks keep their rows' dw terms in shared memory; one row writes dw from registers.
  EXPECT_EQ(f.geometry(three, problem(DType::bf16, 3, 896, true)).shared_bytes, 896u * 4);
  EXPECT_EQ(f.geometry(one, problem(DType::bf16, 1, 4096)).shared_bytes, 0u);
}

TEST(RmsNormBwdRows, FitsOnlyWhatTheKernelHolds) {
  EXPECT_TRUE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 8, 4096), 8));
  EXPECT_TRUE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 1, 4096), 1));  // no cluster needed
  EXPECT_FALSE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 2, 4096), 1));  // no clusters
  // 9 to 16 rows: a cluster of 8 blocks, two rows a block.
  EXPECT_TRUE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 9, 4096), 8));
  EXPECT_TRUE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 16, 4096), 8));
  EXPECT_FALSE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 9, 4096), 4));
  EXPECT_FALSE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 17, 4096), 8));
  EXPECT_FALSE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 0, 4096), 8));
  EXPECT_FALSE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 2, 4100), 8));        // not whole packs
  EXPECT_FALSE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 2, 16392), 8));       // over 2048 packs
  EXPECT_FALSE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 2, 4096, false, 4100), 8));  // stride
  EXPECT_FALSE(families::rmsnorm_bwd_rows_fits(problem(DType::bf16, 2, 4096, false, 0, 8), 8));  // alignment
  EXPECT_TRUE(families::rmsnorm_bwd_rows_fits(problem(DType::f32, 4, 4096, true, 4160), 8));
}

// Which calls the ops send to the one launch: up to 8 rows always, 9 to 16 only for short rows.
TEST(RmsNormBwdRows, FewRowsLaunchRule) {
  EXPECT_TRUE(families::few_rows_launch(8, 8192, 1024));
  EXPECT_TRUE(families::few_rows_launch(16, 896, 1024));
  EXPECT_TRUE(families::few_rows_launch(9, 1024, 1024));
  EXPECT_FALSE(families::few_rows_launch(9, 1032, 1024));
  EXPECT_FALSE(families::few_rows_launch(16, 2880, 1024));
  EXPECT_TRUE(families::few_rows_launch(16, 4096, 4096));
  EXPECT_FALSE(families::few_rows_launch(17, 896, 4096));
  EXPECT_FALSE(families::few_rows_launch(0, 896, 4096));
}

TEST(RmsNormBwdRows, CheckProblemRefusesBeforeAnyLaunch) {
  const Family& f = rows_family();
  const Params v = f.heuristic(problem(DType::bf16, 4, 4096));
  EXPECT_TRUE(f.check_problem(v, problem(DType::bf16, 4, 4096)).ok());
  // A cluster of 4 blocks holds 8 rows (two a block), one block one row.
  EXPECT_TRUE(f.check_problem(v, problem(DType::bf16, 8, 4096)).ok());
  EXPECT_EQ(f.check_problem(v, problem(DType::bf16, 9, 4096)).code(), Code::invalid_argument);
  EXPECT_EQ(f.check_problem(f.heuristic(problem(DType::bf16, 1, 4096)), problem(DType::bf16, 2, 4096)).code(),
            Code::invalid_argument);
  EXPECT_EQ(f.check_problem(v, problem(DType::bf16, 4, 4104)).code(), Code::invalid_argument);  // past block * packs
  EXPECT_EQ(f.check_problem(v, problem(DType::f16, 4, 4096)).code(), Code::unsupported_dtype);
  EXPECT_EQ(f.check_problem(v, problem(DType::bf16, 4, 4096, true)).code(), Code::invalid_argument);  // options
  EXPECT_EQ(f.check_problem(v, problem(DType::bf16, 4, 4096, false, 0, 8)).code(), Code::invalid_argument);
  EXPECT_EQ(f.check_problem(v, problem(DType::bf16, 4, 4096, false, 4000)).code(), Code::shape_mismatch);
  Params bad = v;
  bad.set("vec", 4);  // 8-byte bf16 accesses
  EXPECT_EQ(f.validate(bad).code(), Code::invalid_argument);
  // Clusters need sm_90.
  EXPECT_FALSE(f.runs_on(v, *parse_arch("sm_80")));
  EXPECT_TRUE(f.runs_on(f.heuristic(problem(DType::bf16, 1, 4096)), *parse_arch("sm_80")));
}

TEST(RmsNormBwdRows, CatalogRendersDistinctKernels) {
  const Family& f = rows_family();
  const auto cat = f.catalog();
  EXPECT_GT(cat.size(), 20u);
  std::set<std::string> names;
  for (const Params& p : cat) {
    ASSERT_TRUE(f.validate(p).ok()) << p.canonical();
    names.insert(f.render(p)->name_expression);
  }
  EXPECT_EQ(names.size(), cat.size());
}

// The one-launch reference and the two-stage one agree on dx and dw, with and without the options.
TEST(RmsNormBwdRows, ReferenceAgreesWithTheTwoStageReference) {
  const Family& f = rows_family();
  const Family& bwd = *Registry::global().find("rmsnorm_bwd");
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (bool fused : {false, true}) {
    const std::int64_t rows = 3, cols = 96, stride = 104;
    const Problem p = problem(DType::f32, rows, cols, fused, stride);
    const std::int64_t n = (rows - 1) * stride + cols;
    std::vector<float> dy(n), x(n), w(cols), dh(n), inv(rows), dx1(n, 0.f), dx2(n, 0.f), dw1(cols), partial(cols);
    for (auto* v : {&dy, &x, &dh, &w})
      for (float& e : *v) e = normal(rng);
    for (std::int64_t r = 0; r < rows; ++r) inv[r] = 0.5f + 0.1f * float(r);
    void* b1[7] = {dy.data(), x.data(), w.data(), inv.data(), dx1.data(), dw1.data(), dh.data()};
    ASSERT_TRUE(f.cpu_reference(f.heuristic(p), p, b1).ok());
    Problem p2 = Problem::of(DType::f32, 16,
                             families::RmsNormBwdProblem{.rows = rows,
                                                         .cols = cols,
                                                         .dy_row_stride = stride,
                                                         .x_row_stride = stride,
                                                         .dx_row_stride = stride,
                                                         .slabs = 1,
                                                         .max_cluster = 1,
                                                         .dh_row_stride = fused ? stride : 0,
                                                         .recompute = fused ? 1 : 0,
                                                         .eps = 1e-6});
    void* b2[7] = {dy.data(), x.data(), w.data(), inv.data(), dx2.data(), partial.data(), dh.data()};
    ASSERT_TRUE(bwd.cpu_reference(bwd.heuristic(p2), p2, b2).ok());
    for (std::int64_t i = 0; i < n; ++i) EXPECT_NEAR(dx1[i], dx2[i], 1e-5) << i;
    for (std::int64_t c = 0; c < cols; ++c) EXPECT_NEAR(dw1[c], partial[c], 1e-5) << c;
    // The terms really change dx: not a copy of dy.
    EXPECT_GT(std::fabs(dx1[1] - dy[1]), 1e-3);
  }
}

}  // namespace
}  // namespace kiln
