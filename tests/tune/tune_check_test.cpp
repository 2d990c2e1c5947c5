// The tuner's output comparison (jit/tune_check.h) and problems built from named sizes: what a
// candidate's outputs must match before it is timed, and the defaults of value fields a shape does
// not name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <limits>
#include <vector>

#include "common/half.h"
#include "families/attention/attention_splitkv.h"
#include "jit/tune_check.h"
#include "jit/tune_memory.h"
#include "kiln/family.h"

namespace kiln::testing {
namespace {

std::vector<unsigned char> f32_bytes(const std::vector<float>& v) {
  std::vector<unsigned char> out(v.size() * 4);
  for (std::size_t i = 0; i < v.size(); ++i) store_from_double(out.data(), DType::f32, std::int64_t(i), v[i]);
  return out;
}

constexpr float k_inf = std::numeric_limits<float>::infinity();
constexpr float k_nan = std::numeric_limits<float>::quiet_NaN();

TEST(TuneOutputError, EqualInfinitiesMatchAndOthersFail) {
  // An lse of -inf (a split that saw no key) on both sides is exact.
  const auto want = f32_bytes({1.0f, -k_inf, 2.0f, k_nan});
  EXPECT_EQ(jit::tune_output_error(f32_bytes({1.0f, -k_inf, 2.0f, 5.0f}).data(), want.data(), DType::f32, 4), 0.0);
  // The other infinity, a finite value, or NaN where the reference has -inf: wrong.
  EXPECT_TRUE(std::isnan(jit::tune_output_error(f32_bytes({1.0f, k_inf, 2.0f, 0.0f}).data(), want.data(), DType::f32, 4)));
  EXPECT_TRUE(std::isnan(jit::tune_output_error(f32_bytes({1.0f, -3.0f, 2.0f, 0.0f}).data(), want.data(), DType::f32, 4)));
  EXPECT_TRUE(std::isnan(jit::tune_output_error(f32_bytes({1.0f, k_nan, 2.0f, 0.0f}).data(), want.data(), DType::f32, 4)));
  // A non-finite value where the reference is finite (an unwritten element): wrong.
  EXPECT_TRUE(std::isnan(jit::tune_output_error(f32_bytes({k_nan, -k_inf, 2.0f, 0.0f}).data(), want.data(), DType::f32, 4)));
  EXPECT_TRUE(std::isnan(jit::tune_output_error(f32_bytes({-k_inf, -k_inf, 2.0f, 0.0f}).data(), want.data(), DType::f32, 4)));
  // The finite elements' relative L2 error; the reference's NaN (a gap it never wrote) is skipped.
  const double err = jit::tune_output_error(f32_bytes({1.0f, -k_inf, 2.2f, 9.0f}).data(), want.data(), DType::f32, 4);
  EXPECT_NEAR(err, 0.2 / std::sqrt(5.0), 1e-6);
}

TEST(ProblemFromShape, ValueFieldsNotNamedTakeTheStructDefaults) {
  const Family* f = Registry::global().find("attention_splitkv");
  ASSERT_NE(f, nullptr);
  auto p = f->problem_from_shape(DType::bf16, {{"batch", 2}, {"seqlen_q", 1}, {"seqlen_k", 4096}, {"heads", 32},
                                               {"kv_heads", 8}, {"head_dim", 128}, {"head_dim_v", 128},
                                               {"varlen", 0}, {"splits", 4}, {"total_q", 2}, {"total_k", 8192}});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const auto a = p->as<families::AttentionSplitKvProblem>();
  // Windows unbounded, as a default-constructed problem has them (0 would mean the diagonal only).
  EXPECT_EQ(a.window_left, -1);
  EXPECT_EQ(a.window_right, -1);
  EXPECT_EQ(a.splits, 4);
  EXPECT_EQ(a.total_k, 8192);
  EXPECT_TRUE(f->check_problem(f->heuristic(*p), *p).ok());
}

// Index buffers (block tables, lengths) get values inside their bound, as a kernel may read
// through them; float buffers and unbounded integers keep the normal draw.
TEST(TuneInputs, IndexBuffersStayInsideTheirBound) {
  std::mt19937 rng(7);
  const BufferSpec table{"block_tables", BufferRole::input, DType::i32, 4096, 37};
  const auto t = jit::random_input(table, table.elements, rng);
  ASSERT_EQ(t.size(), 4096u * 4);
  std::vector<int> seen(37, 0);
  for (std::size_t i = 0; i < 4096; ++i) {
    std::int32_t v;
    std::memcpy(&v, t.data() + i * 4, 4);
    ASSERT_GE(v, 0);
    ASSERT_LT(v, 37);
    ++seen[std::size_t(v)];
  }
  for (int c : seen) EXPECT_GT(c, 0) << "every value of the bound is drawn";
  const BufferSpec lens{"seq_lens", BufferRole::input, DType::i64, 1000, 5};
  const auto l = jit::random_input(lens, lens.elements, rng);
  for (std::size_t i = 0; i < 1000; ++i) {
    std::int64_t v;
    std::memcpy(&v, l.data() + i * 8, 8);
    ASSERT_GE(v, 0);
    ASSERT_LT(v, 5);
  }
  const BufferSpec x{"x", BufferRole::input, DType::f32, 1000, 0};
  const auto f = jit::random_input(x, x.elements, rng);
  bool negative = false;
  for (std::size_t i = 0; i < 1000; ++i) negative |= load_as_double(f.data(), DType::f32, std::int64_t(i)) < 0;
  EXPECT_TRUE(negative) << "float inputs are normal draws, not indices";
}

}  // namespace
}  // namespace kiln::testing
