// layernorm_bwd_rows without a GPU: the heuristic's shapes, which problems it holds, what
// check_problem refuses, the catalog, and its CPU reference against layernorm_bwd's on the same
// inputs (one slab: its partial rows are the column sums themselves).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "families/layernorm/layernorm.h"
#include "families/layernorm/layernorm_bwd_rows.h"
#include "kiln/family.h"

namespace kiln {
namespace {

using families::LayerNormBwdRowsProblem;

const Family& rows_family() { return *Registry::global().find("layernorm_bwd_rows"); }

Problem problem(DType t, std::int64_t rows, std::int64_t cols, std::int64_t stride = 0, std::uint32_t alignment = 16) {
  const std::int64_t s = stride ? stride : cols;
  return Problem::of(t, alignment,
                     LayerNormBwdRowsProblem{.rows = rows, .cols = cols, .dy_row_stride = s, .x_row_stride = s,
                                             .dx_row_stride = s});
}

TEST(LayerNormBwdRows, HeuristicHoldsTheRowsInOneCluster) {
  const Family& f = rows_family();
  const Params one = f.heuristic(problem(DType::bf16, 1, 4096));
  EXPECT_EQ(*one.get_int("cluster"), 1);
  EXPECT_EQ(*one.get_int("block"), 512);
  EXPECT_EQ(*one.get_int("packs"), 1);
  const Params three = f.heuristic(problem(DType::bf16, 3, 768));
  EXPECT_EQ(*three.get_int("cluster"), 4);
  EXPECT_EQ(*three.get_int("block"), 128);
  EXPECT_EQ(*f.heuristic(problem(DType::bf16, 8, 16384)).get_int("packs"), 2);
  EXPECT_EQ(f.geometry(three, problem(DType::bf16, 3, 768)).shared_bytes, 768u * 8);  // dweight's and dbias's terms
  EXPECT_EQ(f.geometry(one, problem(DType::bf16, 1, 4096)).shared_bytes, 0u);
  for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 8}, {3, 768}, {8, 4096}, {5, 16384}}) {
    const Problem p = problem(DType::bf16, rows, cols);
    EXPECT_TRUE(f.check_problem(f.heuristic(p), p).ok()) << rows << "x" << cols;
  }
}

TEST(LayerNormBwdRows, FitsOnlyWhatTheKernelHolds) {
  EXPECT_TRUE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 8, 4096), 8));
  EXPECT_TRUE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 1, 4096), 1));
  EXPECT_FALSE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 2, 4096), 1));  // no clusters
  // 9 to 16 rows: a cluster of 8 blocks, two rows a block.
  EXPECT_TRUE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 9, 4096), 8));
  EXPECT_TRUE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 16, 4096), 8));
  EXPECT_FALSE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 9, 4096), 4));
  EXPECT_FALSE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 17, 4096), 8));
  EXPECT_FALSE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 2, 4100), 8));
  EXPECT_FALSE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 2, 16392), 8));
  EXPECT_FALSE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 2, 4096, 4100), 8));
  EXPECT_FALSE(families::layernorm_bwd_rows_fits(problem(DType::bf16, 2, 4096, 0, 8), 8));
}

TEST(LayerNormBwdRows, CheckProblemRefusesBeforeAnyLaunch) {
  const Family& f = rows_family();
  const Params v = f.heuristic(problem(DType::bf16, 4, 4096));
  EXPECT_TRUE(f.check_problem(v, problem(DType::bf16, 4, 4096)).ok());
  // A cluster of 4 blocks holds 8 rows (two a block), one block one row.
  EXPECT_TRUE(f.check_problem(v, problem(DType::bf16, 8, 4096)).ok());
  EXPECT_EQ(f.check_problem(v, problem(DType::bf16, 9, 4096)).code(), Code::invalid_argument);
  EXPECT_EQ(f.check_problem(f.heuristic(problem(DType::bf16, 1, 4096)), problem(DType::bf16, 2, 4096)).code(),
            Code::invalid_argument);
  EXPECT_EQ(f.check_problem(v, problem(DType::bf16, 4, 4104)).code(), Code::invalid_argument);
  EXPECT_EQ(f.check_problem(v, problem(DType::f16, 4, 4096)).code(), Code::unsupported_dtype);
  EXPECT_EQ(f.check_problem(v, problem(DType::bf16, 4, 4096, 0, 8)).code(), Code::invalid_argument);
  EXPECT_EQ(f.check_problem(v, problem(DType::bf16, 4, 4096, 4000)).code(), Code::shape_mismatch);
  EXPECT_FALSE(f.runs_on(v, *parse_arch("sm_80")));
  EXPECT_TRUE(f.runs_on(f.heuristic(problem(DType::bf16, 1, 4096)), *parse_arch("sm_80")));
  std::set<std::string> names;
  for (const Params& p : f.catalog()) {
    ASSERT_TRUE(f.validate(p).ok()) << p.canonical();
    names.insert(f.render(p)->name_expression);
  }
  EXPECT_EQ(names.size(), f.catalog().size());
  EXPECT_GT(names.size(), 20u);
}

TEST(LayerNormBwdRows, ReferenceAgreesWithLayerNormBwd) {
  const Family& f = rows_family();
  const Family& bwd = *Registry::global().find("layernorm_bwd");
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  const std::int64_t rows = 3, cols = 96, stride = 104, n = (rows - 1) * stride + cols;
  std::vector<float> dy(n), x(n), w(cols), mean(rows), rstd(rows), dx1(n, 0.f), dx2(n, 0.f), dw(cols), db(cols),
      partial(2 * cols);
  for (auto* v : {&dy, &x, &w})
    for (float& e : *v) e = normal(rng);
  for (std::int64_t r = 0; r < rows; ++r) mean[r] = 0.1f * float(r), rstd[r] = 0.8f + 0.1f * float(r);
  const Problem p = problem(DType::f32, rows, cols, stride);
  void* b1[8] = {dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx1.data(), dw.data(), db.data()};
  ASSERT_TRUE(f.cpu_reference(f.heuristic(p), p, b1).ok());
  const Problem p2 = Problem::of(DType::f32, 16,
                                 families::LayerNormBwdProblem{.rows = rows, .cols = cols, .dy_row_stride = stride,
                                                               .x_row_stride = stride, .dx_row_stride = stride,
                                                               .slabs = 1});
  void* b2[7] = {dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx2.data(), partial.data()};
  ASSERT_TRUE(bwd.cpu_reference(bwd.heuristic(p2), p2, b2).ok());
  for (std::int64_t i = 0; i < n; ++i) EXPECT_NEAR(dx1[i], dx2[i], 1e-5) << i;
  for (std::int64_t c = 0; c < cols; ++c) {
    EXPECT_NEAR(dw[c], partial[c], 1e-5) << c;
    EXPECT_NEAR(db[c], partial[cols + c], 1e-5) << c;
  }
  EXPECT_GT(std::fabs(db[0]), 1e-3);  // the sums are not empty
}

}  // namespace
}  // namespace kiln
