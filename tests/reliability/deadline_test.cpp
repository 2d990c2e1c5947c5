// docs/reliability.md, item 7: a compile that runs too long is cancelled with a clear timeout error
// (its worker process killed), and other clients are served meanwhile at their usual speed.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "tests/reliability/rel_util.h"

namespace kiln::testing {
namespace {

using Clock = std::chrono::steady_clock;

// 2^27 distinct instantiations: NVRTC works on this for far longer than any deadline here.
constexpr const char* k_bomb = R"(
namespace kiln_bomb {
template <int N, int M> struct X { static constexpr long long v = X<N - 1, 2 * M>::v + X<N - 1, 2 * M + 1>::v; };
template <int M> struct X<0, M> { static constexpr long long v = M; };
static_assert(X<27, 0>::v != 1, "never true");
}
)";

KernelSpec act(int i) {
  const Family* f = Registry::global().find("act_and_mul");
  EXPECT_TRUE(f);
  return KernelSpec{"act_and_mul", f->catalog().at(std::size_t(i))};
}

// Children of `pid` that are zombies (killed workers nobody reaped).
int zombie_children(pid_t pid) {
  int n = 0;
  for (const auto& p : fs::directory_iterator("/proc")) {
    const std::string stat = Kilnd::read_file(p.path() / "stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos || close + 4 >= stat.size()) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == pid && state == 'Z') ++n;
  }
  return n;
}

TEST(Deadline, CompileBombTimesOutCleanlyWhileOthersAreServed) {
  DaemonEnv env;
  auto o = env.options({"--jobs", "2", "--compile-timeout-ms", "2000"});
  o.env["KILN_TEMPLATE_DIR"] = broken_templates(env.root(), k_bomb).string();
  auto k = Kilnd::spawn(o);
  ASSERT_TRUE(k->wait_ready()) << k->log();
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  // A normal compile, for reference, and a cached variant to ask for during the bomb.
  auto t0 = Clock::now();
  ASSERT_TRUE((*c)->get_kernel(act(0), "sm_90a").ok()) << k->log();
  const auto first_compile = Clock::now() - t0;

  Status bomb_status;
  Clock::duration bomb_took{};
  std::thread bomb([&] {
    auto bc = client::DaemonClient::connect(env.socket());
    if (!bc.ok()) return;
    auto t = Clock::now();
    auto r = (*bc)->get_kernel(spec_pool(1)[0], "sm_90a");
    bomb_took = Clock::now() - t;
    bomb_status = r.ok() ? Status() : r.status();
  });
  std::this_thread::sleep_for(300ms);
  // While the bomb holds one compile thread: cached requests and a fresh compile go through.
  Clock::duration worst_hit{};
  for (int i = 0; i < 20; ++i) {
    auto t = Clock::now();
    auto r = (*c)->get_kernel(act(0), "sm_90a");
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->source, jit::ArtifactSource::cache);
    worst_hit = std::max(worst_hit, Clock::now() - t);
  }
  t0 = Clock::now();
  auto fresh = (*c)->get_kernel(act(1), "sm_90a");
  const auto fresh_took = Clock::now() - t0;
  ASSERT_TRUE(fresh.ok()) << fresh.status().to_string();
  bomb.join();

  auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  std::printf("bomb: %s after %.0f ms; meanwhile worst cached get %.1f ms, a fresh compile %.0f ms "
              "(the first compile took %.0f ms)\n",
              code_name(bomb_status.code()), ms(bomb_took), ms(worst_hit), ms(fresh_took), ms(first_compile));
  EXPECT_EQ(bomb_status.code(), Code::timeout) << bomb_status.to_string();
  EXPECT_NE(bomb_status.message().find("compile deadline"), std::string::npos) << bomb_status.to_string();
  EXPECT_GE(bomb_took, 2s);
  EXPECT_LT(bomb_took, 6s);
  EXPECT_LT(worst_hit, 500ms);
  EXPECT_LT(fresh_took, first_compile + 3s);
  auto st = stats_of(env.socket());
  EXPECT_EQ(st["daemon"]["compile_timeouts"], 1) << st.dump();
  EXPECT_EQ(zombie_children(k->pid()), 0);
  // The daemon goes on compiling with a fresh worker.
  auto after = (*c)->get_kernel(act(2), "sm_90a");
  EXPECT_TRUE(after.ok()) << after.status().to_string();
}

TEST(Deadline, WorkersDieWithTheirDaemon) {
  DaemonEnv env;
  auto o = env.options({"--jobs", "1", "--compile-timeout-ms", "60000"});
  o.env["KILN_TEMPLATE_DIR"] = broken_templates(env.root(), k_bomb).string();
  auto k = Kilnd::spawn(o);
  ASSERT_TRUE(k->wait_ready()) << k->log();
  std::thread bomb([&] {
    auto bc = client::DaemonClient::connect(env.socket());
    if (bc.ok()) (void)(*bc)->get_kernel(spec_pool(1)[0], "sm_90a", 10s);
  });
  // Find the worker, then SIGKILL the daemon: the worker must go too.
  pid_t worker = -1;
  for (int i = 0; i < 200 && worker < 0; ++i) {
    std::this_thread::sleep_for(20ms);
    for (const auto& p : fs::directory_iterator("/proc")) {
      const std::string stat = Kilnd::read_file(p.path() / "stat");
      const auto close = stat.rfind(')');
      if (close == std::string::npos || close + 4 >= stat.size()) continue;
      std::istringstream rest(stat.substr(close + 2));
      char state = 0;
      long ppid = 0;
      rest >> state >> ppid;
      if (ppid == k->pid()) worker = pid_t(std::atol(p.path().filename().c_str()));
    }
  }
  ASSERT_GT(worker, 0) << "no compile worker appeared";
  k->signal(SIGKILL);
  ASSERT_TRUE(k->wait_exit());
  bomb.join();
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    gone = ::kill(worker, 0) != 0;
    if (!gone) {
      // It may linger as a zombie of init for a moment; that is gone too.
      const std::string stat = Kilnd::read_file("/proc/" + std::to_string(worker) + "/stat");
      gone = stat.empty() || stat.find(") Z") != std::string::npos;
    }
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(gone) << "compile worker " << worker << " outlived its daemon";
  if (!gone) ::kill(worker, SIGKILL);
}

// The compile workers of a daemon (its direct children).
std::vector<pid_t> workers_of(pid_t daemon) {
  std::vector<pid_t> out;
  for (const auto& p : fs::directory_iterator("/proc")) {
    const std::string stat = Kilnd::read_file(p.path() / "stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos || close + 4 >= stat.size()) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == daemon && state != 'Z') out.push_back(pid_t(std::atol(p.path().filename().c_str())));
  }
  return out;
}

TEST(Deadline, AWorkerKilledMidCompileCostsOneRequestAndAnIdleOneNothing) {
  DaemonEnv env;
  auto o = env.options({"--jobs", "1", "--compile-timeout-ms", "60000"});
  o.env["KILN_TEMPLATE_DIR"] = broken_templates(env.root(), k_bomb).string();
  auto k = Kilnd::spawn(o);
  ASSERT_TRUE(k->wait_ready()) << k->log();
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  // An idle worker killed from outside: the next compile gets a fresh one and succeeds.
  ASSERT_TRUE((*c)->get_kernel(act(0), "sm_90a").ok());
  auto idle = workers_of(k->pid());
  ASSERT_EQ(idle.size(), 1u);
  ::kill(idle[0], SIGKILL);
  std::this_thread::sleep_for(100ms);
  auto r = (*c)->get_kernel(act(1), "sm_90a");
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  // A worker killed while it compiles (the bomb): that request fails with internal, the daemon
  // lives, and the next compile works.
  Status bomb_status;
  std::thread bomb([&] {
    auto bc = client::DaemonClient::connect(env.socket());
    if (bc.ok()) bomb_status = (*bc)->get_kernel(spec_pool(1)[0], "sm_90a").status();
  });
  std::this_thread::sleep_for(500ms);
  auto busy = workers_of(k->pid());
  ASSERT_EQ(busy.size(), 1u);
  ::kill(busy[0], SIGKILL);
  bomb.join();
  EXPECT_EQ(bomb_status.code(), Code::internal) << bomb_status.to_string();
  EXPECT_NE(bomb_status.message().find("killed by signal 9"), std::string::npos) << bomb_status.to_string();
  EXPECT_TRUE(k->running());
  auto after = (*c)->get_kernel(act(2), "sm_90a");
  EXPECT_TRUE(after.ok()) << after.status().to_string();
  auto st = stats_of(env.socket());
  EXPECT_EQ(st["daemon"]["compile_worker_deaths"], 2) << st.dump();
}

}  // namespace
}  // namespace kiln::testing
