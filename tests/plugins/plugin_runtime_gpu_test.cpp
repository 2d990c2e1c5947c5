// A plugin family through the runtime's launch path on a GPU: Runtime::run with the example
// softcap plugin loaded from its .so, first call and fast-path hits, against the CPU reference;
// with a kilnd that has the plugin (the kernel comes from kilnd) and with one that does not (the
// kernel is compiled in the process instead of failing the call).
#include <gtest/gtest.h>

#include <cmath>

#include "tests/daemon/kilnd_harness.h"
#include "tests/gpu_util.h"
#include "tests/plugin_util.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;

// Runs softcap on n bf16 elements through `rt` three times (one miss, two hits) on fresh random
// inputs each time, poisoned output, and compares with the CPU reference.
void run_and_check(Runtime& rt, std::int64_t n, unsigned seed) {
  const Family& sc = *Registry::global().find("softcap");
  std::mt19937 rng(seed);
  const Problem p = named_problem(sc, DType::bf16, 16, {{"n", double(n)}, {"cap", 1.5}});
  for (int call = 0; call < 3; ++call) {
    // Inputs of scale 4 against a cap of 1.5: the near-linear part and the saturated one.
    auto x = random_bytes(DType::bf16, n, rng, 4.0f);
    std::vector<unsigned char> want(x.size(), 0xFF), got(x.size());
    DeviceBuffer dx(x.size()), dy(x.size());
    dx.upload(x.data());
    dy.poison();
    void* dev[2] = {dx.get(), dy.get()};
    Status s = rt.run(sc, p, dev, nullptr);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
    dy.download(got.data());
    void* host[2] = {x.data(), want.data()};
    ASSERT_TRUE(sc.cpu_reference(sc.heuristic(p), p, host).ok());
    std::vector<std::int64_t> all(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = std::int64_t(i);
    EXPECT_LE(rel_l2(got.data(), want.data(), DType::bf16, all), tolerance(DType::bf16))
        << "call " << call << ", seed " << seed;
  }
}

class PluginRuntimeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    KILN_REQUIRE_GPU();
    const auto& rep = register_test_plugins();
    ASSERT_NE(Registry::global().find("softcap"), nullptr)
        << (rep.skipped.empty() ? "" : rep.skipped[0].reason);
  }

  std::shared_ptr<Runtime> runtime(const DaemonEnv& env) {
    RuntimeOptions o;
    o.mode = ResolverMode::automatic;
    o.socket_path = env.socket().string();
    o.cache_file = (cache_.path() / "k.sqlite").string();
    return Runtime::create(o).value();
  }

  TempDir cache_;
};

TEST_F(PluginRuntimeGpu, KilndWithThePluginServesItsKernel) {
  DaemonEnv env;
  const fs::path dir = env.root() / "plugins";
  fs::create_directory(dir);
  ::chmod(dir.c_str(), 0755);
  private_copy(example_plugin(), dir);
  auto o = env.options({"--jobs", "1"});
  o.env["KILN_PLUGIN_PATH"] = dir.string();
  auto k = Kilnd::spawn(o);
  ASSERT_TRUE(k->wait_ready()) << k->log();
  auto rt = runtime(env);
  run_and_check(*rt, 77 * 768, fresh_seed());
  EXPECT_EQ(rt->counters().from_daemon, 1);
  EXPECT_EQ(rt->counters().from_embedded, 0);
}

TEST_F(PluginRuntimeGpu, KilndWithoutThePluginLeavesTheKernelToTheProcess) {
  DaemonEnv env;
  auto o = env.options({"--jobs", "1"});
  o.env["KILN_PLUGIN_PATH"] = "";
  auto k = Kilnd::spawn(o);
  ASSERT_TRUE(k->wait_ready()) << k->log();
  auto rt = runtime(env);
  run_and_check(*rt, 4096 * 1023, fresh_seed());
  EXPECT_EQ(rt->counters().from_daemon, 0);
  EXPECT_EQ(rt->counters().from_embedded, 1);
  EXPECT_EQ(rt->resolver(), "embedded");
}

}  // namespace
}  // namespace kiln::testing
