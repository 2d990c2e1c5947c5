// The conformance test every family must pass, built-in or plugin (docs/plugins.md): every catalog
// variant compiles through NVRTC for each of sm_80 and sm_90a that it runs on (Family::runs_on;
// the one place the whole catalog is compiled), and the family's descriptions agree with each other: catalog, schema, rendering,
// heuristic, tuning space, geometry, buffers and arguments on its benchmark problems. The GPU half
// (outputs against the CPU reference) is conformance_gpu_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
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
  auto for_arch = catalog_for(*f, arch);
  ASSERT_TRUE(for_arch.ok()) << for_arch.status().to_string();
  const std::vector<Params>& catalog = *for_arch;
  ASSERT_FALSE(catalog.empty()) << family_name << " has no catalog variant for " << arch;
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

// Catalogs per arch: the GEMM families' wgmma variants (sm_90a only) are left out of sm_80's
// catalog and kept in sm_90a's, through the plugin ABI that registered the built-in families.
TEST(CatalogForArch, WgmmaVariantsAreForSm90aOnly) {
  for (const char* name : {"fp8_gemm", "gated_mlp"}) {
    const Family* f = Registry::global().find(name);
    ASSERT_NE(f, nullptr) << name;
    auto wgmma_count = [&](const char* arch) {
      auto catalog = catalog_for(*f, arch);
      EXPECT_TRUE(catalog.ok()) << catalog.status().to_string();
      std::size_t n = 0;
      for (const Params& p : *catalog) n += *p.get_str("path") == "wgmma";
      return std::pair{n, catalog->size()};
    };
    const auto [sm80_wgmma, sm80_all] = wgmma_count("sm_80");
    const auto [sm90a_wgmma, sm90a_all] = wgmma_count("sm_90a");
    EXPECT_EQ(sm80_wgmma, 0u) << name;
    EXPECT_GT(sm80_all, 0u) << name << ": the mma.sync variants run on sm_80";
    EXPECT_GT(sm90a_wgmma, 0u) << name;
    EXPECT_EQ(wgmma_count("sm_90").first, 0u) << name << ": wgmma needs the 'a' features";
    EXPECT_LT(sm80_all, f->catalog().size()) << name;
  }
  // rmsnorm_bwd's clustered and bulk-copy kernels need sm_90.
  const Family* bwd = Registry::global().find("rmsnorm_bwd");
  ASSERT_NE(bwd, nullptr);
  auto sm80 = catalog_for(*bwd, "sm_80");
  ASSERT_TRUE(sm80.ok());
  for (const Params& p : *sm80)
    EXPECT_TRUE(*p.get_int("cluster") == 1 && *p.get_int("stages") == 0) << p.canonical();
  EXPECT_EQ(catalog_for(*bwd, "sm_90a")->size(), bwd->catalog().size());
  EXPECT_EQ(catalog_for(*bwd, "sm_8x").status().code(), Code::invalid_argument);
}

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
  // Every variant runs somewhere, and catalog_for keeps catalog order.
  auto sm80 = catalog_for(f, "sm_80");
  auto sm90a = catalog_for(f, "sm_90a");
  ASSERT_TRUE(sm80.ok() && sm90a.ok());
  std::set<std::string> runs;
  for (const auto* list : {&*sm80, &*sm90a}) {
    auto next = f.catalog();
    auto at = next.begin();
    for (const Params& p : *list) {
      runs.insert(p.canonical());
      at = std::find(at, next.end(), p);
      EXPECT_NE(at, next.end()) << p.canonical() << ": not in catalog order";
    }
  }
  for (const Params& p : f.catalog())
    EXPECT_TRUE(runs.count(p.canonical())) << p.canonical() << " runs on neither sm_80 nor sm_90a";
  const Status fields = check_problem_fields(f.problem_fields());
  EXPECT_TRUE(fields.ok()) << fields.to_string();
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
      const Problem tp = f.tuning_problem(p);
      const Status tuned = f.check_problem(f.heuristic(tp), tp);
      EXPECT_TRUE(tuned.ok()) << where << ": the heuristic refuses the bucket's tuning problem: " << tuned.to_string();
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

// The runtime remembers a problem's kernel and launch geometry by its key fields alone (value
// fields vary from call to call: token counts, scales), so the heuristic and the geometry must not
// read a value field: a later call with another value would run the first call's choice. Each value
// field of each benchmark problem is moved (0 and 1 swapped, other numbers to 2 v + 3) on devices of
// compute capability 8.0 and 9.0 and none; the choice and the geometry must stay.
TEST_P(Consistency, OnlyKeyFieldsChooseTheVariantAndItsGeometry) {
  const Family& f = family();
  for (DType dtype : family_dtypes(f))
    for (Problem p : f.benchmark_problems(dtype))
      for (const auto& [cc, sms] : {std::pair{0, 0}, std::pair{80, 108}, std::pair{90, 132}}) {
        p.cc = std::uint8_t(cc);
        p.sm_count = std::uint16_t(sms);
        const Params chosen = f.heuristic(p);
        const LaunchGeometry g = f.geometry(chosen, p);
        for (const ProblemField& field : f.problem_fields()) {
          if (field.key) continue;
          Problem moved = p;
          kiln_problem_value& v = moved.fields[field.slot];
          if (field.type == FieldType::i64)
            v.i = v.i == 0 || v.i == 1 ? 1 - v.i : 2 * v.i + 3;
          else
            v.f = 2 * v.f + 3;
          const std::string what = f.signature(p) + " cc " + std::to_string(cc) + ", value field " + field.name;
          const Params again = f.heuristic(moved);
          EXPECT_EQ(again.canonical(), chosen.canonical()) << what;
          if (again != chosen) continue;
          const LaunchGeometry h = f.geometry(chosen, moved);
          EXPECT_TRUE(h.grid.x == g.grid.x && h.grid.y == g.grid.y && h.grid.z == g.grid.z && h.block.x == g.block.x &&
                      h.block.y == g.block.y && h.block.z == g.block.z && h.shared_bytes == g.shared_bytes)
              << what << " (" << chosen.canonical() << "): grid " << g.grid.x << "x" << g.grid.y << "x" << g.grid.z
              << " becomes " << h.grid.x << "x" << h.grid.y << "x" << h.grid.z;
        }
      }
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, Consistency, ::testing::ValuesIn(conformance_families()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kiln::testing
