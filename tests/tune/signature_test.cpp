// Tuning signatures: the power-of-two bucket of the row count, exact other dims, dtype and
// alignment, and the problems the CLI builds from named sizes.
#include <set>

#include <gtest/gtest.h>

#include "kiln/family.h"

namespace kiln {
namespace {

const Family& family(const char* name) {
  const Family* f = Registry::global().find(name);
  EXPECT_NE(f, nullptr) << name;
  return *f;
}

Problem rmsnorm_problem(std::int64_t rows, std::int64_t cols, DType t = DType::bf16, std::uint32_t align = 16) {
  Problem p = family("rmsnorm").problem_from_shape(t, {{"rows", rows}, {"cols", cols}}).value();
  p.alignment = align;
  return p;
}

TEST(TuningBucket, RoundsUpToPowersOfTwo) {
  EXPECT_EQ(tuning_bucket(0), 0);
  EXPECT_EQ(tuning_bucket(-5), 0);
  EXPECT_EQ(tuning_bucket(1), 1);
  EXPECT_EQ(tuning_bucket(2), 2);
  EXPECT_EQ(tuning_bucket(3), 4);
  EXPECT_EQ(tuning_bucket(4096), 4096);
  EXPECT_EQ(tuning_bucket(4097), 8192);
  EXPECT_EQ(tuning_bucket(3000), 4096);
  EXPECT_EQ(tuning_bucket((std::int64_t(1) << 40) + 1), std::int64_t(1) << 41);
}

TEST(Signature, RowsShareABucketOtherDimsAreExact) {
  const Family& f = family("rmsnorm");
  const std::string s4096 = f.signature(rmsnorm_problem(4096, 4096));
  EXPECT_EQ(s4096, "dtype=bf16,align=16,rows<=4096,cols=4096,x_row_stride=4096,y_row_stride=4096,sms=0,cc=0");
  EXPECT_EQ(f.signature(rmsnorm_problem(3000, 4096)), s4096);
  EXPECT_EQ(f.signature(rmsnorm_problem(2049, 4096)), s4096);
  EXPECT_NE(f.signature(rmsnorm_problem(2048, 4096)), s4096);
  EXPECT_NE(f.signature(rmsnorm_problem(4097, 4096)), s4096);
  EXPECT_NE(f.signature(rmsnorm_problem(4096, 4095)), s4096);
  EXPECT_NE(f.signature(rmsnorm_problem(4096, 4096, DType::f16)), s4096);
  EXPECT_NE(f.signature(rmsnorm_problem(4096, 4096, DType::bf16, 8)), s4096);
}

TEST(Signature, RmsNormIgnoresTheSmCountAndComputeCapability) {
  // The typed op passes the device's SM count and compute capability; `kiln tune --shape` leaves
  // them 0 unless given: one winner for both (the tuning key's arch tells devices apart).
  const Family& f = family("rmsnorm");
  Problem op = rmsnorm_problem(4096, 4096);
  op.dims[4] = 132;
  op.dims[5] = 90;
  EXPECT_EQ(f.signature(op), f.signature(rmsnorm_problem(4096, 4096)));
  EXPECT_EQ(f.tuning_problem(op).dims[4], 132);  // timed as the op runs it
  EXPECT_EQ(f.tuning_problem(op).dims[5], 90);
}

TEST(Signature, ScalarsAreNotPartOfIt) {
  const Family& f = family("rmsnorm");
  Problem a = rmsnorm_problem(16, 2048), b = a;
  b.scalars[0] = 1e-5;
  EXPECT_EQ(f.signature(a), f.signature(b));
}

TEST(Signature, TuningProblemIsTheBucketsUpperBound) {
  const Family& f = family("rmsnorm");
  Problem p = rmsnorm_problem(3000, 5120);
  Problem t = f.tuning_problem(p);
  EXPECT_EQ(t.dims[0], 4096);
  EXPECT_EQ(t.dims[1], 5120);
  EXPECT_EQ(f.signature(t), f.signature(p));
  EXPECT_TRUE(f.check_problem(f.heuristic(t), t).ok());
}

TEST(ProblemFromShape, RmsNormFillsContiguousStridesAndEps) {
  Problem p = rmsnorm_problem(7, 4096);
  EXPECT_EQ(p.dims[0], 7);
  EXPECT_EQ(p.dims[1], 4096);
  EXPECT_EQ(p.dims[2], 4096);
  EXPECT_EQ(p.dims[3], 4096);
  EXPECT_EQ(p.dims[4], 0);  // sms: one block per row unless given
  EXPECT_GT(p.scalars[0], 0);
  EXPECT_EQ(p.alignment, 16u);
}

TEST(ProblemFromShape, ActAndMulFillsStridesAndActivation) {
  const Family& f = family("act_and_mul");
  Problem p = f.problem_from_shape(DType::bf16, {{"rows", 16}, {"d", 14336}}).value();
  EXPECT_EQ(p.dims[1], 14336);
  EXPECT_EQ(p.dims[2], 2 * 14336);
  EXPECT_EQ(p.dims[3], 14336);
  EXPECT_EQ(p.dims[4], 0);
  EXPECT_TRUE(f.check_problem(f.heuristic(p), p).ok());
}

TEST(ProblemFromShape, RejectsUnknownMissingAndRepeatedDims) {
  const Family& f = family("rmsnorm");
  auto unknown = f.problem_from_shape(DType::bf16, {{"rows", 1}, {"cols", 8}, {"tokens", 3}});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), Code::invalid_argument);
  EXPECT_NE(unknown.status().message().find("tokens"), std::string::npos);
  auto missing = f.problem_from_shape(DType::bf16, {{"rows", 1}});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("cols"), std::string::npos);
  auto twice = f.problem_from_shape(DType::bf16, {{"rows", 1}, {"rows", 2}, {"cols", 8}});
  ASSERT_FALSE(twice.ok());
  // The base rule (no family defaults) needs every dim.
  const Family& rope = family("rope");
  auto partial = rope.problem_from_shape(DType::bf16, {{"tokens", 4}});
  ASSERT_FALSE(partial.ok());
  EXPECT_NE(partial.status().message().find("missing"), std::string::npos);
}

TEST(BenchmarkProblems, TokensTimesHiddenAllValid) {
  for (const char* name : {"rmsnorm", "act_and_mul"}) {
    const Family& f = family(name);
    auto ps = f.benchmark_problems(DType::bf16);
    EXPECT_EQ(ps.size(), 30u) << name;
    std::set<std::string> sigs;
    for (const auto& p : ps) {
      EXPECT_TRUE(f.check_problem(f.heuristic(p), p).ok()) << name << " " << f.signature(p);
      sigs.insert(f.signature(p));
    }
    EXPECT_EQ(sigs.size(), ps.size()) << name << ": every benchmark shape is its own signature";
  }
}

}  // namespace
}  // namespace kiln
