// Real NVRTC compiles (no GPU needed): single-flight, compile errors with their log, the cache
// round trip through the builder. Every catalog variant of every family is compiled once, in the
// conformance test (tests/conformance).
#include <gtest/gtest.h>
#include <sqlite3.h>

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "cache/store.h"
#include "common/sha256.h"
#include "jit/builder.h"
#include "jit/nvrtc.h"
#include "kiln/family.h"
#include "tests/stub_family.h"
#include "tests/test_util.h"

namespace kiln::jit {
namespace {

bool nvrtc_available() { return Nvrtc::get().ok(); }

TEST(Builder, StoresThenServesFromCache) {
  ASSERT_TRUE(nvrtc_available());
  testing::TempDir dir;
  auto store = cache::Store::open(dir.path() / "k.sqlite");
  ASSERT_TRUE(store.ok());
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("f16")}, {"block", std::int64_t(128)}, {"vec", std::int64_t(4)}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}}};
  {
    Builder b(store->get(), &Registry::global());
    auto a = b.get(spec, "sm_90a");
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ(a->source, ArtifactSource::compiled);
    EXPECT_GT(a->entry.compile_ms, 0);
  }
  Builder fresh(store->get(), &Registry::global());  // a new process would see the same
  auto a = fresh.get(spec, "sm_90a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->source, ArtifactSource::cache);
  EXPECT_EQ(a->entry.checksum, sha256_hex(a->entry.cubin));
  EXPECT_EQ(fresh.stats().compiles, 0);
  auto other_arch = fresh.get(spec, "sm_80");
  ASSERT_TRUE(other_arch.ok());
  EXPECT_EQ(other_arch->source, ArtifactSource::compiled);
  EXPECT_NE(other_arch->entry.key, a->entry.key);
}

// With PCH on, NVRTC writes its header image into kiln's per-process directory under TMPDIR
// (kiln-pch-<pid>-*), which kiln removes at exit, and not into /tmp/__nvrtc_auto_pch_<pid>_<n>,
// which nothing removed.
TEST(Builder, PrecompiledHeadersGoToKilnsOwnDirectory) {
  ASSERT_TRUE(nvrtc_available());
  testing::TempDir dir;
  testing::ScopedEnv tmp("TMPDIR", dir.path().string());
  auto store = cache::Store::open(dir.path() / "k.sqlite");
  ASSERT_TRUE(store.ok());
  Builder b(store->get(), &Registry::global(), BuilderOptions{.use_pch = true});
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("f16")}, {"block", std::int64_t(128)}, {"vec", std::int64_t(4)}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}}};
  auto a = b.get(spec, "sm_90a");
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  const std::string mine = "kiln-pch-" + std::to_string(::getpid()) + "-";
  int dirs = 0, pch_files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    if (e.path().filename().string().rfind(mine, 0) != 0) continue;
    ++dirs;
    for (const auto& f : std::filesystem::directory_iterator(e.path())) pch_files += f.path().extension() == ".pch";
  }
  EXPECT_EQ(dirs, 1);
  EXPECT_EQ(pch_files, 1);
  const std::string auto_prefix = "__nvrtc_auto_pch_" + std::to_string(::getpid()) + "_";
  for (const std::filesystem::path& root : {dir.path(), std::filesystem::path("/tmp")})
    for (const auto& e : std::filesystem::directory_iterator(root))
      EXPECT_NE(e.path().filename().string().rfind(auto_prefix, 0), 0u) << e.path();
}

TEST(Builder, CorruptEntryIsRecompiled) {
  ASSERT_TRUE(nvrtc_available());
  testing::TempDir dir;
  auto store = cache::Store::open(dir.path() / "k.sqlite");
  ASSERT_TRUE(store.ok());
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("f32")}, {"block", std::int64_t(64)}, {"vec", std::int64_t(1)}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}}};
  Builder b(store->get(), &Registry::global());
  auto first = b.get(spec, "sm_80");
  ASSERT_TRUE(first.ok());
  // Flip a byte of the stored cubin from another connection, as a crash or a bad disk would.
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(((*store)->path()).c_str(), &db), SQLITE_OK);
  std::string sql = "UPDATE kernels SET cubin = substr(cubin, 1, 200) || x'ff' || substr(cubin, 202) WHERE key = '" +
                    first->entry.key + "'";
  ASSERT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(db);
  auto again = b.get(spec, "sm_80");
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(again->source, ArtifactSource::compiled);
  EXPECT_EQ(again->entry.checksum, first->entry.checksum);
  EXPECT_EQ(b.stats().compiles, 2);
  EXPECT_EQ((*store)->stats()->corrupt, 1);
  auto third = b.get(spec, "sm_80");
  EXPECT_EQ(third->source, ArtifactSource::cache);
}

TEST(Builder, ConcurrentRequestsForOneKeyCompileOnce) {
  ASSERT_TRUE(nvrtc_available());
  testing::TempDir dir;
  auto store = cache::Store::open(dir.path() / "k.sqlite");
  Builder b(store->get(), &Registry::global());
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("bf16")}, {"block", std::int64_t(512)}, {"vec", std::int64_t(8)}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}}};
  constexpr int k_threads = 8;
  std::atomic<int> ok{0};
  std::vector<std::thread> ts;
  std::vector<std::string> checksums(k_threads);
  for (int i = 0; i < k_threads; ++i)
    ts.emplace_back([&, i] {
      auto a = b.get(spec, "sm_90a");
      if (a.ok()) {
        ++ok;
        checksums[i] = a->entry.checksum;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(ok.load(), k_threads);
  EXPECT_EQ(b.stats().compiles, 1);
  EXPECT_EQ(b.stats().coalesced + b.stats().cache_hits, k_threads - 1);
  for (const auto& c : checksums) EXPECT_EQ(c, checksums[0]);
}

// A family whose template does not compile: the error carries NVRTC's log and the options.
class BrokenFamily final : public testing::StubFamily {
 public:
  BrokenFamily() : StubFamily("broken") {}
  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> d = {{"n", {1}, {}, ""}};
    return d;
  }
  Result<Rendered> render(const Params&) const override {
    return Rendered{"template <int N> __global__ void k(float* x) { x[0] = undefined_symbol_xyz; }\n", "k<1>", {}};
  }
  std::vector<Params> catalog() const override { return {Params{{"n", std::int64_t(1)}}}; }
  Params heuristic(const Problem&) const override { return catalog()[0]; }
  std::vector<Params> tuning_space(const Problem&) const override { return catalog(); }
};

TEST(Builder, CompileErrorCarriesLogAndOptions) {
  ASSERT_TRUE(nvrtc_available());
  Registry reg;
  ASSERT_TRUE(reg.add(std::make_shared<BrokenFamily>()).ok());
  EXPECT_EQ(reg.add(std::make_shared<BrokenFamily>()).code(), Code::invalid_argument);  // duplicate name
  Builder b(nullptr, &reg);
  auto a = b.get(KernelSpec{"broken", Params{{"n", std::int64_t(1)}}}, "sm_90a");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), Code::compile_error);
  EXPECT_NE(a.status().details().find("undefined_symbol_xyz"), std::string::npos) << a.status().details();
  EXPECT_NE(a.status().details().find("-arch=sm_90a"), std::string::npos);
  EXPECT_EQ(b.stats().compile_failures, 1);
}

TEST(Builder, BadSpecsFailBeforeAnyCompile) {
  Builder b(nullptr, &Registry::global());
  auto expect_code = [&](const KernelSpec& s, const std::string& arch, Code c) {
    auto a = b.get(s, arch);
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), c) << s.canonical() << " " << arch << ": " << a.status().to_string();
  };
  Params good{{"dtype", std::string("f16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}};
  expect_code({"nosuch", good}, "sm_90a", Code::not_found);
  expect_code({"rmsnorm", good}, "sm_9x", Code::invalid_argument);
  Params p = good;
  p.set("block", std::int64_t(100));
  expect_code({"rmsnorm", p}, "sm_90a", Code::invalid_argument);
  p = good;
  p.set("dtype", "f64");
  expect_code({"rmsnorm", p}, "sm_90a", Code::invalid_argument);
  p = good;
  p.set("extra", std::int64_t(1));
  expect_code({"rmsnorm", p}, "sm_90a", Code::invalid_argument);
  p = Params{{"dtype", std::string("f32")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}};  // 32-byte access
  expect_code({"rmsnorm", p}, "sm_90a", Code::invalid_argument);
  expect_code({"rmsnorm", Params{}}, "sm_90a", Code::invalid_argument);
  EXPECT_EQ(b.stats().compiles, 0);
}

}  // namespace
}  // namespace kiln::jit
