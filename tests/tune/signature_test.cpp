// Typed problems and tuning signatures: the field list rules, the power-of-two bucket of the
// bucketed key, exact other keys, value fields left out, dtype and alignment, the device facts, and
// the problems the CLI builds from named sizes.
#include <set>

#include <gtest/gtest.h>

#include "kiln/family.h"
#include "tests/stub_family.h"

namespace kiln {
namespace {

const Family& family(const char* name) {
  const Family* f = Registry::global().find(name);
  EXPECT_NE(f, nullptr) << name;
  return *f;
}

// A field of a problem by name, as an integer (i64 fields) or a double (f64 fields).
const ProblemField& field_of(const Family& f, const std::string& name) {
  for (const auto& pf : f.problem_fields())
    if (pf.name == name) return pf;
  ADD_FAILURE() << f.name() << " has no field " << name;
  static const ProblemField none;
  return none;
}
std::int64_t int_field(const Family& f, const Problem& p, const std::string& name) {
  return p.fields[field_of(f, name).slot].i;
}
double real_field(const Family& f, const Problem& p, const std::string& name) {
  return p.fields[field_of(f, name).slot].f;
}

// A family with every kind of field, so the defaults are tested apart from any real family.
struct TestProblem {
  std::int64_t rows = 0;
  std::int64_t stride = 0;
  double scale = 0;
  std::int64_t cols = 0;
  double eps = 0;
};

class TestFamily final : public testing::StubFamily {
 public:
  TestFamily() : StubFamily("typed_test") {}
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<TestProblem>({
        bucketed(&TestProblem::rows, "rows", "rows"),
        key(&TestProblem::cols, "cols", "columns"),
        key(&TestProblem::scale, "scale", "a key that is a double"),
        value(&TestProblem::stride, "stride", "a per-call integer"),
        value(&TestProblem::eps, "eps", "a per-call double"),
    });
    return fields;
  }
};

Problem test_problem(std::int64_t rows, std::int64_t cols, double scale = 0.5) {
  return Problem::of(DType::bf16, 16, TestProblem{.rows = rows, .stride = cols, .scale = scale, .cols = cols, .eps = 1e-6});
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

TEST(TypedProblem, FieldsFollowTheStructLayout) {
  TestFamily f;
  const auto& fields = f.problem_fields();
  ASSERT_EQ(fields.size(), 5u);
  EXPECT_EQ(fields[0].slot, 0u);  // rows
  EXPECT_EQ(fields[1].slot, 3u);  // cols
  EXPECT_EQ(fields[2].slot, 2u);  // scale
  EXPECT_EQ(fields[2].type, FieldType::f64);
  EXPECT_TRUE(fields[0].bucketed && fields[0].key);
  EXPECT_FALSE(fields[3].key);
  EXPECT_EQ(fields[4].type, FieldType::f64);
  const Problem p = test_problem(3, 7, 0.25);
  const TestProblem t = p.as<TestProblem>();
  EXPECT_EQ(t.rows, 3);
  EXPECT_EQ(t.cols, 7);
  EXPECT_EQ(t.scale, 0.25);
  EXPECT_EQ(t.eps, 1e-6);
  EXPECT_EQ(p.fields[3].i, 7);
  EXPECT_EQ(p.fields[2].f, 0.25);
}

TEST(TypedProblem, FieldListsAreChecked) {
  auto field = [](std::string name, std::uint32_t slot, FieldType type = FieldType::i64, bool key = true,
                  bool bucketed = false) {
    ProblemField f;
    f.name = std::move(name);
    f.slot = slot;
    f.type = type;
    f.key = key;
    f.bucketed = bucketed;
    return f;
  };
  EXPECT_TRUE(check_problem_fields({field("a", 0), field("b", 1)}).ok());
  EXPECT_TRUE(check_problem_fields({}).ok());
  auto refused = [](const std::vector<ProblemField>& fs, const char* why) {
    Status s = check_problem_fields(fs);
    EXPECT_EQ(s.code(), Code::invalid_argument) << why;
    EXPECT_NE(s.message().find(why), std::string::npos) << s.message();
  };
  refused({field("a", 0), field("a", 1)}, "declared twice");
  refused({field("a", 0), field("b", 0)}, "each named once");
  refused({field("a", 1)}, "each named once");
  refused({field("Bad", 0)}, "is not [a-z]");
  refused({field("", 0)}, "is not [a-z]");
  refused({field("a", 0, FieldType::f64, true, true)}, "must be an i64 key");
  refused({field("a", 0, FieldType::i64, false, true)}, "must be an i64 key");
  refused({field("a", 0, FieldType::i64, true, true), field("b", 1, FieldType::i64, true, true)}, "at most one bucketed");
  std::vector<ProblemField> many;
  for (int i = 0; i <= Problem::k_max_fields; ++i) many.push_back(field("f" + std::to_string(i), std::uint32_t(i)));
  refused(many, ("at most " + std::to_string(Problem::k_max_fields) + " fields").c_str());
}

TEST(TypedProblem, AListThatMissesAMemberThrows) {
  EXPECT_THROW(problem_fields_of<TestProblem>({key(&TestProblem::rows, "rows", "")}), std::logic_error);
  EXPECT_THROW(problem_fields_of<TestProblem>({key(&TestProblem::rows, "rows", ""), key(&TestProblem::rows, "r2", ""),
                                               key(&TestProblem::cols, "cols", ""), value(&TestProblem::eps, "eps", ""),
                                               value(&TestProblem::scale, "scale", "")}),
               std::logic_error);
}

TEST(TypedProblem, RegistryRefusesABadFieldList) {
  class Bad final : public testing::StubFamily {
   public:
    Bad() : StubFamily("bad_fields") {}
    const std::vector<ProblemField>& problem_fields() const override {
      static const std::vector<ProblemField> fields = {ProblemField{"x", FieldType::i64, 3, true, false, ""}};
      return fields;
    }
  };
  Registry r;
  EXPECT_EQ(r.add(std::make_shared<Bad>()).code(), Code::invalid_argument);
  EXPECT_EQ(r.find("bad_fields"), nullptr);
  EXPECT_TRUE(r.add(std::make_shared<TestFamily>()).ok());
}

TEST(Signature, KeysInOrderBucketedRoundedValuesLeftOut) {
  TestFamily f;
  const std::string s = f.signature(test_problem(3000, 4096));
  EXPECT_EQ(s, "dtype=bf16,align=16,rows<=4096,cols=4096,scale=0.5");
  EXPECT_EQ(f.signature(test_problem(2049, 4096)), s);
  EXPECT_NE(f.signature(test_problem(2048, 4096)), s);
  EXPECT_NE(f.signature(test_problem(4097, 4096)), s);
  EXPECT_NE(f.signature(test_problem(4096, 4095)), s);
  EXPECT_NE(f.signature(test_problem(4096, 4096, 0.25)), s);
  Problem other = test_problem(3000, 4096);
  other.dtype = DType::f16;
  EXPECT_NE(f.signature(other), s);
  other = test_problem(3000, 4096);
  other.alignment = 8;
  EXPECT_NE(f.signature(other), s);
  // Value fields and the device never change it (the tuning key's setup tells devices apart).
  auto t = test_problem(3000, 4096).as<TestProblem>();
  t.stride = 9999;
  t.eps = 0.125;
  Problem values = Problem::of(DType::bf16, 16, t);
  values.sm_count = 132;
  values.cc = 90;
  EXPECT_EQ(f.signature(values), s);
}

TEST(Signature, TuningProblemIsTheBucketsUpperBound) {
  TestFamily f;
  Problem p = test_problem(3000, 5120);
  p.sm_count = 132;
  p.cc = 90;
  const TestProblem t = f.tuning_problem(p).as<TestProblem>();
  EXPECT_EQ(t.rows, 4096);
  EXPECT_EQ(t.cols, 5120);
  EXPECT_EQ(t.stride, 5120);
  EXPECT_EQ(f.tuning_problem(p).sm_count, 132);  // timed as the op runs it
  EXPECT_EQ(f.tuning_problem(p).cc, 90);
  EXPECT_EQ(f.signature(f.tuning_problem(p)), f.signature(p));
}

TEST(ProblemFromShape, NeedsEveryKeyAndDefaultsTheRest) {
  TestFamily f;
  auto p = f.problem_from_shape(DType::f16, {{"rows", 7}, {"cols", 64}, {"scale", 3}});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const TestProblem t = p->as<TestProblem>();
  EXPECT_EQ(t.rows, 7);
  EXPECT_EQ(t.cols, 64);
  EXPECT_EQ(t.scale, 3.0);
  EXPECT_EQ(t.stride, 0);
  EXPECT_EQ(t.eps, 0.0);
  EXPECT_EQ(p->alignment, 16u);
  EXPECT_EQ(p->dtype, DType::f16);
  auto with_value = f.problem_from_shape(DType::f16, {{"rows", 7}, {"cols", 64}, {"scale", 3}, {"stride", 80}});
  ASSERT_TRUE(with_value.ok());
  EXPECT_EQ(with_value->as<TestProblem>().stride, 80);

  auto unknown = f.problem_from_shape(DType::bf16, {{"rows", 1}, {"cols", 8}, {"scale", 1}, {"tokens", 3}});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), Code::invalid_argument);
  EXPECT_NE(unknown.status().message().find("tokens"), std::string::npos);
  auto missing = f.problem_from_shape(DType::bf16, {{"rows", 1}, {"scale", 1}});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("cols"), std::string::npos);
  auto twice = f.problem_from_shape(DType::bf16, {{"rows", 1}, {"rows", 2}, {"cols", 8}, {"scale", 1}});
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("twice"), std::string::npos);
}

TEST(Describe, ListsFieldsAndSchema) {
  const std::string d = describe_family(family("rope"));
  for (const char* s : {"\"name\":\"rope\"", "\"fields\"", "\"tokens\"", "\"bucketed\":true", "\"type\":\"i64\"",
                        "\"params\"", "\"head_dim\""})
    EXPECT_NE(d.find(s), std::string::npos) << s << " in " << d;
}

// The built-in families on this path: every field list is valid, RMSNorm's signature names its
// keys, and the CLI's shapes fill what follows from the rest.
TEST(BuiltinFamilies, FieldListsAreValid) {
  for (const Family* f : Registry::global().all()) {
    EXPECT_TRUE(check_problem_fields(f->problem_fields()).ok()) << f->name();
    int bucketed = 0;
    for (const auto& pf : f->problem_fields()) bucketed += pf.bucketed;
    EXPECT_LE(bucketed, 1) << f->name();
  }
}

TEST(BuiltinFamilies, RmsNormSignatureAndShape) {
  const Family& f = family("rmsnorm");
  Problem p = f.problem_from_shape(DType::bf16, {{"rows", 3000}, {"cols", 4096}}).value();
  EXPECT_EQ(int_field(f, p, "rows"), 3000);
  EXPECT_EQ(int_field(f, p, "cols"), 4096);
  EXPECT_EQ(int_field(f, p, "x_row_stride"), 4096);  // contiguous rows unless given
  EXPECT_EQ(int_field(f, p, "y_row_stride"), 4096);
  EXPECT_GT(real_field(f, p, "eps"), 0);
  EXPECT_EQ(f.signature(p), "dtype=bf16,align=16,rows<=4096,cols=4096,x_row_stride=4096,y_row_stride=4096");
  Problem on_h100 = p;
  on_h100.sm_count = 132;
  on_h100.cc = 90;
  EXPECT_EQ(f.signature(on_h100), f.signature(p));
  EXPECT_TRUE(f.check_problem(f.heuristic(on_h100), on_h100).ok());
  EXPECT_TRUE(f.check_problem(f.heuristic(p), p).ok());
}

TEST(BuiltinFamilies, ActAndMulFillsStridesAndActivation) {
  const Family& f = family("act_and_mul");
  Problem p = f.problem_from_shape(DType::bf16, {{"rows", 16}, {"d", 14336}}).value();
  EXPECT_EQ(int_field(f, p, "d"), 14336);
  EXPECT_EQ(int_field(f, p, "x_row_stride"), 2 * 14336);
  EXPECT_EQ(int_field(f, p, "out_row_stride"), 14336);
  EXPECT_EQ(int_field(f, p, "activation"), 0);
  EXPECT_TRUE(f.check_problem(f.heuristic(p), p).ok());
}

TEST(BuiltinFamilies, RopeNeedsEveryKey) {
  auto partial = family("rope").problem_from_shape(DType::bf16, {{"tokens", 4}});
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
