// The conformance test every family must pass, built-in or plugin (docs/plugins.md): every catalog
// variant compiles for sm_80 and sm_90a through NVRTC (the one place the whole catalog is
// compiled), and the family's descriptions agree with each other: catalog, schema, rendering,
// heuristic, tuning space, geometry, buffers and arguments on its benchmark problems. The GPU half
// (outputs against the CPU reference) is conformance_gpu_test.cpp.
#include <gtest/gtest.h>

#include <cctype>

#include <set>
#include <tuple>

#include "jit/builder.h"
#include "jit/nvrtc.h"
#include "tests/conformance/conformance_util.h"

namespace kiln::testing {
namespace {

std::vector<std::tuple<std::string, std::string>> every_family_and_arch() {
  std::vector<std::tuple<std::string, std::string>> out;
  for (const auto& name : conformance_families())
    for (const char* arch : {"sm_80", "sm_90a"}) out.emplace_back(name, arch);
  return out;
}

// One test per (family, arch) so that ctest spreads the catalog compiles over the cores and no
// single test carries every family's compile time.
class CatalogCompiles : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(CatalogCompiles, EveryVariant) {
  auto nv = jit::Nvrtc::get();
  ASSERT_TRUE(nv.ok()) << nv.status().to_string();
  const auto& [family_name, arch] = GetParam();
  const Family* f = Registry::global().find(family_name);
  ASSERT_NE(f, nullptr);
  jit::Builder b(nullptr, &Registry::global());
  const auto catalog = f->catalog();
  ASSERT_FALSE(catalog.empty());
  for (const Params& p : catalog) {
    auto a = b.get(KernelSpec{family_name, p}, arch);
    ASSERT_TRUE(a.ok()) << family_name << "(" << p.canonical() << ") " << arch << ": " << a.status().to_string();
    EXPECT_GT(a->entry.cubin.size(), 100u);
    EXPECT_FALSE(a->entry.lowered_name.empty());
    EXPECT_GT(a->entry.registers, 0) << "ptxas resource report not parsed";
    // ptxas spills a few words in some 1024-thread variants (64-register cap); a row cache pushed
    // to local memory (hundreds of bytes) is what this catches.
    EXPECT_GE(a->entry.spill_bytes, 0) << "spill report not parsed";
    // rmsnorm_bwd's sm_threads=1024 variants spill up to ~90 bytes under their 64-register cap and
    // are still faster than the unspilled 128-register ones on Hopper (docs/benchmarks.md).
    const bool capped_on_purpose = family_name == "rmsnorm_bwd" && p.get_int("sm_threads") == 1024;
    EXPECT_LE(a->entry.spill_bytes, capped_on_purpose ? 128 : 32)
        << family_name << "(" << p.canonical() << ")\n" << a->entry.compile_log;
    // ptxas serializes every wgmma of a kernel (C7510-C7515) when it cannot prove an
    // accumulator untouched while a batch is in flight: correct, and far slower.
    EXPECT_EQ(a->entry.compile_log.find("are serialized"), std::string::npos)
        << family_name << "(" << p.canonical() << ")\n" << a->entry.compile_log;
    // A stack frame beyond the spill slots (the spill stores, rounded up to 16 bytes) is an array
    // moved to local memory, which ptxas reports as no spill at all (a wgmma kernel whose
    // accumulators land there is far slower). The wgmma GEMM kernels keep every accumulator in
    // registers and may have no frame at all. Every catalog variant of both archs is within this;
    // the largest frames, 24 bytes, hold spills.
    const bool wgmma = arch == "sm_90a" && p.get_str("path") && *p.get_str("path") == "wgmma";
    const std::int64_t frame_limit = wgmma ? 0 : (std::int64_t(a->entry.spill_bytes) + 15) / 16 * 16;
    const std::string& log = a->entry.compile_log;
    int frames = 0;
    for (std::size_t at = log.find(" bytes stack frame"); at != std::string::npos;
         at = log.find(" bytes stack frame", at + 1)) {
      std::size_t begin = at;
      while (begin > 0 && std::isdigit(static_cast<unsigned char>(log[begin - 1]))) --begin;
      ++frames;
      EXPECT_LE(std::stoll(log.substr(begin, at - begin)), frame_limit)
          << family_name << "(" << p.canonical() << "): a stack frame beyond its spills\n" << log;
    }
    EXPECT_GT(frames, 0) << family_name << "(" << p.canonical() << "): no stack frame report\n" << log;
  }
  EXPECT_EQ(b.stats().compiles, std::int64_t(catalog.size()));
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, CatalogCompiles, ::testing::ValuesIn(every_family_and_arch()),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

class Consistency : public ::testing::TestWithParam<std::string> {
 protected:
  const Family& family() const { return *Registry::global().find(GetParam()); }
};

TEST_P(Consistency, CatalogValidatesAndRendersDistinctKernels) {
  const Family& f = family();
  ASSERT_NE(f.plugin(), nullptr) << "every family is registered through the plugin loader";
  std::set<std::string> names, canon;
  for (const Params& p : f.catalog()) {
    EXPECT_TRUE(f.validate(p).ok()) << p.canonical() << ": " << f.validate(p).to_string();
    EXPECT_TRUE(canon.insert(p.canonical()).second) << p.canonical() << " listed twice";
    auto r = f.render(p);
    ASSERT_TRUE(r.ok()) << p.canonical() << ": " << r.status().to_string();
    EXPECT_FALSE(r->source.empty());
    EXPECT_TRUE(names.insert(r->name_expression).second) << r->name_expression << " rendered twice";
  }
  EXPECT_LE(f.problem_dims().size(), std::size_t(Problem::k_max_dims));
  EXPECT_LE(f.problem_scalars().size(), std::size_t(Problem::k_max_scalars));
  EXPECT_LT(f.bucketed_dim(), int(f.problem_dims().size()));
}

// On every benchmark problem of every dtype: the heuristic and every tuning candidate are valid
// variants that accept the problem, with a launchable geometry, buffers that include an output,
// and arguments that fit the argument block.
TEST_P(Consistency, HeuristicAndTuningSpaceAcceptTheBenchmarkProblems) {
  const Family& f = family();
  int problems = 0;
  for (DType dtype : family_dtypes(f)) {
    for (const Problem& p : f.benchmark_problems(dtype)) {
      ++problems;
      const std::string where = f.signature(p);
      EXPECT_FALSE(where.empty());
      EXPECT_EQ(f.signature(f.tuning_problem(p)), where) << "a bucket's tuning problem has the bucket's signature";
      std::vector<Params> variants = f.tuning_space(p);
      EXPECT_FALSE(variants.empty()) << where << ": empty tuning space";
      variants.insert(variants.begin(), f.heuristic(p));
      for (const Params& v : variants) {
        const std::string what = where + " " + v.canonical();
        ASSERT_TRUE(f.validate(v).ok()) << what << ": " << f.validate(v).to_string();
        ASSERT_TRUE(f.check_problem(v, p).ok()) << what << ": " << f.check_problem(v, p).to_string();
        const LaunchGeometry g = f.geometry(v, p);
        EXPECT_GE(g.grid.x, 1u) << what;
        EXPECT_GE(g.grid.y * g.grid.z, 1u) << what;
        const std::uint64_t threads = std::uint64_t(g.block.x) * g.block.y * g.block.z;
        EXPECT_TRUE(threads >= 1 && threads <= 1024) << what << ": " << threads << " threads";
        EXPECT_LE(g.shared_bytes, 227u * 1024) << what;
        const auto bufs = f.buffers(v, p);
        ASSERT_FALSE(bufs.empty()) << what;
        bool output = false;
        std::vector<void*> ptrs;
        for (const BufferSpec& b : bufs) {
          output |= b.role == BufferRole::output;
          EXPECT_GE(b.elements, 0) << what << " " << b.name;
          ptrs.push_back(reinterpret_cast<void*>(std::uintptr_t(4096 * (ptrs.size() + 1))));
        }
        EXPECT_TRUE(output) << what << ": no output buffer";
        ArgPack args;
        f.pack_bound(f.bind(v), v, p, ptrs, args);
        EXPECT_FALSE(args.overflow()) << what;
        EXPECT_GE(args.count(), bufs.size()) << what;
      }
    }
  }
  EXPECT_GT(problems, 0) << GetParam() << " declares no benchmark problems: the conformance test and kiln tune --all "
                                          "need some (Family::benchmark_problems)";
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, Consistency, ::testing::ValuesIn(conformance_families()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kiln::testing
