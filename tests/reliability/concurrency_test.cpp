// docs/reliability.md, items 3, 4, 5 and 6: a cold-key stampede, several processes writing one
// cache file, simultaneous daemon starts, and recovery from a killed daemon.
#include <gtest/gtest.h>

#include <atomic>
#include <latch>
#include <mutex>
#include <set>
#include <thread>

#include "common/sha256.h"
#include "jit/builder.h"
#include "kiln/family.h"
#include "daemon/server.h"
#include "tests/reliability/rel_util.h"

namespace kiln::testing {
namespace {

using Clock = std::chrono::steady_clock;

// Runs a program to completion with its output captured; returns {exit code, output}.
std::pair<int, std::string> run_program(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
                                        const fs::path& out_file) {
  std::string cmd;
  for (const auto& [k, v] : env) cmd += k + "='" + v + "' ";
  for (const auto& a : args) cmd += "'" + a + "' ";
  cmd += "> '" + out_file.string() + "' 2>&1";
  int st = std::system(cmd.c_str());
  int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return {code, Kilnd::read_file(out_file)};
}

TEST(Stampede, SixtyFourClientsHundredRequestsTwentyColdKeys) {
  DaemonEnv env;
  auto k = env.start({"--jobs", "2"});
  ASSERT_TRUE(k);
  const auto keys = spec_pool(20);
  constexpr int clients = 64, requests = 100;
  std::vector<std::unique_ptr<client::DaemonClient>> conns;
  for (int i = 0; i < clients; ++i) {
    auto c = client::DaemonClient::connect(env.socket());
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    conns.push_back(std::move(c).value());
  }
  std::latch go(clients);
  std::atomic<int> failures{0};
  std::mutex mu;
  std::map<std::string, std::set<std::string>> checksums;  // spec -> every checksum served
  std::string first_error;
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i)
    threads.emplace_back([&, i] {
      go.arrive_and_wait();
      for (int j = 0; j < requests; ++j) {
        const KernelSpec& s = keys[(i * 7 + j) % keys.size()];
        auto r = conns[i]->get_kernel(s, "sm_90a");
        std::lock_guard lock(mu);
        if (!r.ok()) {
          if (failures++ == 0) first_error = r.status().to_string();
          continue;
        }
        checksums[s.canonical()].insert(sha256_hex(r->entry.cubin));
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures, 0) << first_error;
  EXPECT_EQ(checksums.size(), keys.size());
  for (const auto& [spec, sums] : checksums) EXPECT_EQ(sums.size(), 1u) << spec;
  auto st = stats_of(env.socket());
  EXPECT_EQ(st["builder"]["requests"], clients * requests) << st.dump();
  EXPECT_EQ(st["builder"]["compiles"], 20) << st.dump();
  EXPECT_EQ(st["cache"]["entries"], 20) << st.dump();
  EXPECT_EQ(st["daemon"]["errors"], 0) << st.dump();
}

TEST(SharedFile, DaemonCliPrewarmAndEmbeddedBuildersWriteOneFile) {
  DaemonEnv env;
  auto k = env.start({"--jobs", "2"});
  ASSERT_TRUE(k);
  const fs::path file = cache_file_of(env);
  const auto pool = spec_pool(16);
  std::atomic<int> errors{0};
  std::mutex mu;
  std::vector<std::string> messages;
  auto fail = [&](const std::string& m) {
    std::lock_guard lock(mu);
    ++errors;
    messages.push_back(m);
  };
  std::vector<std::thread> threads;
  // The daemon's clients.
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&, t] {
      auto c = client::DaemonClient::connect(env.socket());
      if (!c.ok()) return fail(c.status().to_string());
      for (int j = 0; j < 16; ++j) {
        auto r = (*c)->get_kernel(pool[(t * 5 + j) % pool.size()], "sm_90a");
        if (!r.ok()) fail("daemon get: " + r.status().to_string());
      }
    });
  // Embedded resolvers: their own connection to the file, their own compiles, same keys.
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&, t] {
      auto store = cache::Store::open(file);
      if (!store.ok()) return fail("embedded open: " + store.status().to_string());
      jit::Builder b(store->get(), &Registry::global());
      for (int j = 0; j < 16; ++j) {
        auto r = b.get(pool[(t * 3 + j) % pool.size()], "sm_90a");
        if (!r.ok()) fail("embedded get: " + r.status().to_string());
      }
      if (b.stats().store_failures != 0) fail("embedded store failures: " + std::to_string(b.stats().store_failures));
    });
  // `kiln prewarm` processes that never use the daemon, and readers (ls, stats, verify).
  for (const char* arch : {"sm_80", "sm_86"})
    threads.emplace_back([&, arch] {
      auto [code, out] = run_program({KILN_CLI_PATH, "--embedded", "prewarm", "--arch", arch, "--family",
                                      "rmsnorm_bwd_reduce", "--jobs", "1"},
                                     {{"KILN_CACHE_DIR", env.cache_dir().string()}}, env.root() / (std::string(arch) + ".out"));
      if (code != 0) fail(std::string("kiln prewarm ") + arch + " exited " + std::to_string(code) + ": " + out);
      if (out.find("locked") != std::string::npos || out.find("busy") != std::string::npos)
        fail("kiln prewarm saw contention: " + out);
    });
  threads.emplace_back([&] {
    for (int j = 0; j < 10; ++j)
      for (const char* cmd : {"ls", "stats", "verify"}) {
        auto [code, out] = run_program({KILN_CLI_PATH, "--embedded", cmd}, {{"KILN_CACHE_DIR", env.cache_dir().string()}},
                                       env.root() / "reader.out");
        if (code != 0) fail(std::string("kiln ") + cmd + " exited " + std::to_string(code) + ": " + out);
      }
  });
  for (auto& t : threads) t.join();
  for (const auto& m : messages) ADD_FAILURE() << m;
  EXPECT_EQ(errors, 0);
  auto st = stats_of(env.socket());
  EXPECT_EQ(st["builder"]["store_failures"], 0) << st.dump();
  EXPECT_EQ(st["cache"]["store_errors"], 0) << st.dump();
  EXPECT_GE(st["cache"]["entries"].get<int>(), 16 + 24) << st.dump();
  k.reset();
  expect_cache_sound(file, "after concurrent writers");
}

TEST(Startup, ThirtyTwoSimultaneousDaemonsLeaveExactlyOne) {
  DaemonEnv env;
  std::vector<std::unique_ptr<Kilnd>> ks;
  for (int i = 0; i < 32; ++i) ks.push_back(Kilnd::spawn(env.options({"--jobs", "1"})));
  int refused = 0, running = 0, other = 0;
  for (auto& k : ks) {
    auto code = k->wait_exit(std::chrono::seconds(10));
    if (!code) ++running;
    else if (*code == daemon::k_exit_already_running) ++refused;
    else ++other;
  }
  EXPECT_EQ(running, 1) << Kilnd::read_file(env.log());
  EXPECT_EQ(refused, 31) << Kilnd::read_file(env.log());
  EXPECT_EQ(other, 0) << Kilnd::read_file(env.log());
  auto s = stats_of(env.socket());
  int answering = 0;
  for (auto& k : ks)
    if (k->running() && s["daemon"]["pid"] == k->pid()) ++answering;
  EXPECT_EQ(answering, 1) << s.dump();
}

TEST(Startup, ThirtyTwoSimultaneousClientStartsGiveOneDaemonAndNoError) {
  DaemonEnv env;
  const std::map<std::string, std::string> vars{{"KILN_SOCKET", env.socket().string()},
                                                {"KILN_CACHE_DIR", env.cache_dir().string()}};
  std::vector<std::pair<int, std::string>> results(32);
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i)
    threads.emplace_back([&, i] {
      results[i] = run_program({KILN_CLI_PATH, "daemon", "start", "--jobs", "1"}, vars,
                               env.root() / ("start" + std::to_string(i) + ".out"));
    });
  for (auto& t : threads) t.join();
  for (const auto& [code, out] : results) EXPECT_EQ(code, 0) << out;
  auto s = stats_of(env.socket());
  ASSERT_TRUE(s.contains("daemon")) << "no daemon answers";
  const int pid = s["daemon"]["pid"];
  // Exactly one kilnd process is left for this socket. A `kiln daemon start` that found another
  // daemon answering returns at once; its own kilnd may still be on its way to exit 3, so the
  // count is given a moment to settle.
  auto live_daemons = [&] {
    std::vector<pid_t> pids;
    for (const auto& p : fs::directory_iterator("/proc")) {
      const std::string cmdline = Kilnd::read_file(p.path() / "cmdline");
      if (cmdline.find("kilnd") == std::string::npos || cmdline.find("--compile-worker") != std::string::npos) continue;
      if (Kilnd::read_file(p.path() / "environ").find(env.socket().string()) != std::string::npos)
        pids.push_back(pid_t(std::atol(p.path().filename().c_str())));
    }
    return pids;
  };
  auto daemons = live_daemons();
  for (int i = 0; i < 200 && daemons.size() != 1; ++i) {
    std::this_thread::sleep_for(50ms);
    daemons = live_daemons();
  }
  EXPECT_EQ(daemons.size(), 1u);
  EXPECT_EQ(stats_of(env.socket())["daemon"]["pid"], pid);
  // Clean up: stop the daemon, and leave no straggler behind (they are not children of this
  // process, so nothing else would).
  ::kill(pid, SIGTERM);
  for (int i = 0; i < 500 && ::kill(pid, 0) == 0; ++i) std::this_thread::sleep_for(10ms);
  for (pid_t p : live_daemons()) ::kill(p, SIGKILL);
}

TEST(StaleState, KilledDaemonReleasesWaitersAndTheNextDaemonServesWithinThreeSeconds) {
  DaemonEnv env;
  auto k = env.start({"--jobs", "1"});
  ASSERT_TRUE(k);
  // Several waiters on one in-flight compile (plus queued ones behind it).
  const auto pool = spec_pool(3);
  std::vector<std::thread> waiters;
  std::vector<Result<jit::Artifact>> results(6, Result<jit::Artifact>(internal_error("not run")));
  std::vector<Clock::duration> took(6);
  for (int i = 0; i < 6; ++i)
    waiters.emplace_back([&, i] {
      auto c = client::DaemonClient::connect(env.socket());
      if (!c.ok()) return;
      auto t0 = Clock::now();
      results[i] = (*c)->get_kernel(pool[i % 3], "sm_90a");
      took[i] = Clock::now() - t0;
    });
  std::this_thread::sleep_for(150ms);
  const auto killed_at = Clock::now();
  k->signal(SIGKILL);
  ASSERT_TRUE(k->wait_exit());
  for (auto& t : waiters) t.join();
  for (int i = 0; i < 6; ++i) {
    if (results[i].ok()) continue;  // answered before the kill
    EXPECT_EQ(results[i].status().code(), Code::unavailable) << results[i].status().to_string();
    EXPECT_LT(took[i], std::chrono::seconds(5));
  }
  // The socket file is still there; the next daemon replaces it and serves within 3 s.
  EXPECT_TRUE(fs::exists(env.socket()));
  auto k2 = Kilnd::spawn(env.options({"--jobs", "1"}));
  ASSERT_TRUE(k2->wait_ready(3s)) << k2->log();
  auto recovered = Clock::now() - killed_at;
  std::printf("recovery after SIGKILL: %.0f ms\n", std::chrono::duration<double, std::milli>(recovered).count());
  EXPECT_LT(recovered, 3s + 200ms);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  auto r = (*c)->get_kernel(pool[0], "sm_90a");
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  // The live daemon's socket is never unlinked by a second one.
  auto k3 = Kilnd::spawn(env.options({"--jobs", "1"}));
  EXPECT_EQ(k3->wait_exit(), 3);
  EXPECT_TRUE(client::DaemonClient::connect(env.socket()).ok());
}

}  // namespace
}  // namespace kiln::testing
