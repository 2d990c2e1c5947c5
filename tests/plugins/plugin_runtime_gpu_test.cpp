// A plugin family through the runtime's launch path on a GPU: Runtime::run with the example
// LayerNorm plugin loaded from its .so, first call and fast-path hits, against the CPU reference;
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

// Runs layernorm on rows x cols bf16 through `rt` three times (one miss, two hits) on fresh random
// inputs each time, poisoned output, and compares with the CPU reference.
void run_and_check(Runtime& rt, std::int64_t rows, std::int64_t cols, unsigned seed) {
  const Family& ln = *Registry::global().find("layernorm");
  std::mt19937 rng(seed);
  Problem p;
  p.dtype = DType::bf16;
  p.dims[0] = rows;
  p.dims[1] = cols;
  p.scalars[0] = 1e-5;
  p.alignment = 16;
  for (int call = 0; call < 3; ++call) {
    auto x = random_bytes(DType::bf16, rows * cols, rng), g = random_bytes(DType::bf16, cols, rng),
         b = random_bytes(DType::bf16, cols, rng);
    std::vector<unsigned char> want(x.size(), 0xFF), got(x.size());
    DeviceBuffer dx(x.size()), dg(g.size()), db(b.size()), dy(x.size());
    dx.upload(x.data());
    dg.upload(g.data());
    db.upload(b.data());
    dy.poison();
    void* dev[4] = {dx.get(), dg.get(), db.get(), dy.get()};
    Status s = rt.run(ln, p, dev, nullptr);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
    dy.download(got.data());
    void* host[4] = {x.data(), g.data(), b.data(), want.data()};
    ASSERT_TRUE(ln.cpu_reference(ln.heuristic(p), p, host).ok());
    std::vector<std::int64_t> all(std::size_t(rows * cols));
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
    ASSERT_NE(Registry::global().find("layernorm"), nullptr)
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
  run_and_check(*rt, 77, 768, fresh_seed());
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
  run_and_check(*rt, 4096, 1023, fresh_seed());
  EXPECT_EQ(rt->counters().from_daemon, 0);
  EXPECT_EQ(rt->counters().from_embedded, 1);
  EXPECT_EQ(rt->resolver(), "embedded");
}

}  // namespace
}  // namespace kiln::testing
