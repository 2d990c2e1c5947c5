// Round-trip latency of a cached `get` (and of `ping`) through kilnd, printed as p50/p99/max.
// Not a pass/fail benchmark: the bounds below only catch gross regressions (a round trip that
// waits on a timer or a compile).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "tests/daemon/kilnd_harness.h"

namespace kiln::testing {
namespace {

struct Percentiles {
  double p50, p99, max;
};

Percentiles percentiles(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  auto at = [&](double q) { return us[std::min(us.size() - 1, static_cast<std::size_t>(q * us.size()))]; };
  return {at(0.50), at(0.99), us.back()};
}

TEST(KilndLatency, CachedGetRoundTrip) {
  DaemonEnv env;
  auto k = env.start({"--jobs", "2"});
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  auto spec = KernelSpec::parse("rmsnorm(block=256,bulk=0,dtype=f16,row=0,vec=8)");
  ASSERT_TRUE(spec.ok());
  auto warm = (*c)->get_kernel(*spec, "sm_90a");
  ASSERT_TRUE(warm.ok()) << warm.status().to_string();
  const std::size_t cubin_bytes = warm->entry.cubin.size();

  constexpr int n = 1000;
  std::vector<double> get_us, ping_us;
  get_us.reserve(n);
  ping_us.reserve(n);
  for (int i = 0; i < n; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    auto r = (*c)->get_kernel(*spec, "sm_90a");
    auto t1 = std::chrono::steady_clock::now();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ASSERT_EQ(r->source, jit::ArtifactSource::cache);
    get_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  for (int i = 0; i < n; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE((*c)->ping().ok());
    ping_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  auto g = percentiles(get_us);
  auto p = percentiles(ping_us);
  std::printf("[ kilnd    ] cached get (%zu-byte cubin, verified): n=%d p50=%.0f us p99=%.0f us max=%.0f us\n",
              cubin_bytes, n, g.p50, g.p99, g.max);
  std::printf("[ kilnd    ] ping: n=%d p50=%.0f us p99=%.0f us max=%.0f us\n", n, p.p50, p.p99, p.max);
  RecordProperty("get_p50_us", static_cast<int>(g.p50));
  RecordProperty("get_p99_us", static_cast<int>(g.p99));
  RecordProperty("ping_p50_us", static_cast<int>(p.p50));
  EXPECT_LT(g.p50, 20'000.0);
  EXPECT_LT(p.p50, 10'000.0);
}

}  // namespace
}  // namespace kiln::testing
