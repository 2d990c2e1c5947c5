// docs/reliability.md, item 1: SIGKILL at random moments while kilnd compiles and stores. After
// every kill the cache file passes PRAGMA integrity_check and every row passes its checksum.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "tests/reliability/rel_util.h"

namespace kiln::testing {
namespace {

TEST(Crash, SigkillDuringCompilesAndStoresLeavesASoundCache) {
  const int iterations = scaled(20, 200);
  DaemonEnv env;
  const auto pool = spec_pool(60);
  int killed_with_work = 0;
  for (int it = 0; it < iterations; ++it) {
    auto k = env.start({"--jobs", "2"});
    ASSERT_TRUE(k) << "iteration " << it;
    // Clients keep asking for variants, cached or not, until the daemon dies under them.
    std::atomic<bool> stop{false};
    std::atomic<int> served{0}, in_flight{0};
    std::vector<std::thread> clients;
    for (int t = 0; t < 3; ++t)
      clients.emplace_back([&, t] {
        auto c = client::DaemonClient::connect(env.socket());
        if (!c.ok()) return;
        for (int j = 0; !stop; ++j) {
          ++in_flight;
          auto r = (*c)->get_kernel(pool[(it * 7 + t * 20 + j) % pool.size()], "sm_90a", std::chrono::seconds(20));
          if (!r.ok()) return;  // the daemon is gone (in_flight stays raised)
          --in_flight;
          ++served;
        }
      });
    std::this_thread::sleep_for(std::chrono::milliseconds(uniform(30, 900)));
    k->signal(SIGKILL);
    ASSERT_TRUE(k->wait_exit()) << "iteration " << it;
    stop = true;
    for (auto& t : clients) t.join();
    if (in_flight > 0) ++killed_with_work;
    expect_cache_sound(cache_file_of(env), "after kill " + std::to_string(it));
    if (::testing::Test::HasFailure()) return;
    // Forget some variants, so that later iterations compile and store again.
    RawDb db(cache_file_of(env));
    auto keys = db.keys();
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (uniform(0, 2) == 0) db.exec("DELETE FROM kernels WHERE key = '" + keys[i] + "'");
  }
  std::printf("%d kills, %d with requests in flight\n", iterations, killed_with_work);
  EXPECT_GE(killed_with_work, iterations / 2) << "the kills should land while work is under way";
}

}  // namespace
}  // namespace kiln::testing
