// docs/reliability.md, item 17: mixed load against one kilnd for KILN_SOAK_SECONDS (15 s in CI;
// 1800 from `scripts/reliability.sh --soak`), sampling its resident memory and open descriptors
// every second. After a warm-up, both stay flat and no request fails.
//
// The load: 8 clients asking for 240 variants (4 archs x 60), mostly cache hits; the cache is
// emptied now and then so compiles and stores keep happening; list and stats requests; clients
// that connect and hang up, or send garbage; and one client that stays silent until cut off.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <mutex>
#include <thread>

#include "tests/reliability/rel_util.h"

namespace kiln::testing {
namespace {

using Clock = std::chrono::steady_clock;

int soak_seconds() {
  const char* v = std::getenv("KILN_SOAK_SECONDS");
  return v && *v ? std::max(5, std::atoi(v)) : 15;
}

struct Sample {
  double t;
  long rss_kib;
  int fds;
  long workers_rss_kib;  // the compile worker processes, reported (not bounded here)
};

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / double(v.size());
}

TEST(Soak, MixedLoadKeepsMemoryAndDescriptorsFlatWithoutErrors) {
  const int seconds = soak_seconds();
  DaemonEnv env;
  auto k = env.start({"--jobs", "2", "--idle-timeout-ms", "3000", "--frame-timeout-ms", "2000"});
  ASSERT_TRUE(k);
  const auto pool = spec_pool(60);
  const std::vector<std::string> archs{"sm_80", "sm_86", "sm_89", "sm_90a"};
  std::atomic<bool> stop{false};
  std::atomic<long> requests{0}, errors{0}, churn{0};
  std::mutex mu;
  std::string first_error;
  auto fail = [&](const std::string& what) {
    if (errors++ == 0) {
      std::lock_guard lock(mu);
      first_error = what;
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 g(unsigned(t * 7919 + 1));
      auto c = client::DaemonClient::connect(env.socket());
      if (!c.ok()) return fail(c.status().to_string());
      while (!stop) {
        // Hot set: the first 20 variants on sm_90a most of the time, the rest now and then.
        const bool hot = g() % 10 < 8;
        const KernelSpec& s = pool[hot ? g() % 20 : g() % pool.size()];
        const std::string& arch = hot ? archs[3] : archs[g() % archs.size()];
        auto r = (*c)->get_kernel(s, arch, std::chrono::seconds(60));
        ++requests;
        if (!r.ok()) fail("get: " + r.status().to_string());
        if (g() % 50 == 0) {
          auto st = (*c)->stats();
          if (!st.ok()) fail("stats: " + st.status().to_string());
          auto ls = (*c)->list({"rmsnorm", "sm_90a"});
          if (!ls.ok()) fail("list: " + ls.status().to_string());
        }
      }
    });
  // Churn: connect-and-hang-up, garbage frames, a silent peer.
  threads.emplace_back([&] {
    std::mt19937 g(42);
    while (!stop) {
      {
        RawConn r(env.socket());
        if (g() % 2) (void)r.send_bytes(RawConn::frame("{not json"));
        else (void)r.send_bytes("KILNxx");
      }
      ++churn;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  // The cache is emptied every 20 s, so that compiles and stores go on for the whole run.
  threads.emplace_back([&] {
    auto store = cache::Store::open(cache_file_of(env));
    if (!store.ok()) return fail("evictor open: " + store.status().to_string());
    auto next = Clock::now() + std::chrono::seconds(20);
    while (!stop) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (Clock::now() < next) continue;
      next += std::chrono::seconds(20);
      auto r = (*store)->evict_to(0);
      if (!r.ok()) fail("evict: " + r.status().to_string());
    }
  });

  std::vector<Sample> samples;
  const auto t0 = Clock::now();
  while (Clock::now() - t0 < std::chrono::seconds(seconds)) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    samples.push_back({std::chrono::duration<double>(Clock::now() - t0).count(), rss_kib(k->pid()), fd_count(k->pid()),
                       children_rss_kib(k->pid())});
    if (!k->running()) break;
  }
  stop = true;
  for (auto& t : threads) t.join();
  ASSERT_TRUE(k->running()) << k->log();
  auto st = stats_of(env.socket());

  if (const char* csv = std::getenv("KILN_SOAK_CSV")) {
    std::ofstream out(csv);
    out << "seconds,rss_kib,fds,workers_rss_kib\n";
    for (const auto& s : samples) out << s.t << "," << s.rss_kib << "," << s.fds << "," << s.workers_rss_kib << "\n";
  }
  // Warm-up: the first quarter (NVRTC, PCH and SQLite page caches fill). Then the second quarter
  // is the reference and the last quarter must sit within 5% of it (2 descriptors at least, for
  // the connections that are open at any instant).
  const std::size_t n = samples.size();
  ASSERT_GE(n, 4u);
  std::vector<double> rss_ref, rss_end, fd_ref, fd_end;
  for (std::size_t i = n / 4; i < n / 2; ++i) rss_ref.push_back(double(samples[i].rss_kib)), fd_ref.push_back(samples[i].fds);
  for (std::size_t i = 3 * n / 4; i < n; ++i) rss_end.push_back(double(samples[i].rss_kib)), fd_end.push_back(samples[i].fds);
  const double rss_drift = mean(rss_end) / mean(rss_ref) - 1.0;
  const double fd_drift = mean(fd_end) - mean(fd_ref);
  std::vector<double> w_ref, w_end;
  for (std::size_t i = n / 4; i < n / 2; ++i) w_ref.push_back(double(samples[i].workers_rss_kib));
  for (std::size_t i = 3 * n / 4; i < n; ++i) w_end.push_back(double(samples[i].workers_rss_kib));
  std::printf("compile workers' RSS: %.0f -> %.0f KiB\n", mean(w_ref), mean(w_end));
  std::printf("soak %d s: %ld requests, %ld errors, %ld churn connections, %s compiles, %s evicted connections; "
              "RSS %.0f -> %.0f KiB (%+.1f%%), fds %.1f -> %.1f\n",
              seconds, requests.load(), errors.load(), churn.load(), st["builder"]["compiles"].dump().c_str(),
              st["daemon"]["evicted_connections"].dump().c_str(), mean(rss_ref), mean(rss_end), rss_drift * 100,
              mean(fd_ref), mean(fd_end));
  EXPECT_EQ(errors, 0) << first_error;
  // Load did happen: an idle machine serves hundreds of requests in 15 s, far fewer when the cpu
  // suite compiles catalogs on its cores beside it; the bound only rules out a stalled run.
  EXPECT_GT(requests, 10);
  // The ±5% of docs/reliability.md is for the long soak; the 15 s CI run has a 4 s warm-up in which
  // SQLite's page cache and malloc's arenas are still filling, so it only guards against gross
  // leaks (±10%).
  EXPECT_LE(std::abs(rss_drift), seconds >= 600 ? 0.05 : 0.10);
  EXPECT_LE(std::abs(fd_drift), std::max(2.0, 0.05 * mean(fd_ref)));
  EXPECT_GT(st["builder"]["compiles"].get<int>(), 20) << "the load must keep compiling";
}

}  // namespace
}  // namespace kiln::testing
