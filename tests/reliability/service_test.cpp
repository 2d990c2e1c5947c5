// docs/reliability.md, items 8, 10, 12, 14 and 15: negative caching, slow and idle peers, hostile
// specs, a full disk, and SIGTERM with compiles in flight; all against real kilnd processes.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <atomic>
#include <latch>
#include <mutex>
#include <thread>

#include "common/sha256.h"
#include "tests/reliability/rel_util.h"

namespace kiln::testing {
namespace {

using Clock = std::chrono::steady_clock;

TEST(NegativeCache, ThousandRequestsForAFailingKeyCompileOnceAndCarryTheLog) {
  DaemonEnv env;
  const fs::path templates = broken_templates(env.root(), "#error kiln reliability: broken on purpose");
  auto o = env.options({"--jobs", "2"});
  o.env["KILN_TEMPLATE_DIR"] = templates.string();
  auto k = Kilnd::spawn(o);
  ASSERT_TRUE(k->wait_ready()) << k->log();
  const KernelSpec spec = spec_pool(1)[0];
  constexpr int clients = 8, per_client = 125;
  std::atomic<int> good{0};
  std::mutex mu;
  std::string bad;
  std::latch go(clients);
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i)
    threads.emplace_back([&] {
      auto c = client::DaemonClient::connect(env.socket());
      if (!c.ok()) return;
      go.arrive_and_wait();
      for (int j = 0; j < per_client; ++j) {
        auto r = (*c)->get_kernel(spec, "sm_90a");
        const std::string& d = r.status().details();
        if (!r.ok() && r.status().code() == Code::compile_error && d.find("options:") != std::string::npos &&
            d.find("-arch=sm_90a") != std::string::npos && d.find("broken on purpose") != std::string::npos) {
          ++good;
        } else {
          std::lock_guard lock(mu);
          bad = r.ok() ? "served a kernel" : r.status().to_string();
        }
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(good, clients * per_client) << bad;
  auto st = stats_of(env.socket());
  EXPECT_EQ(st["builder"]["compiles"], 1) << st.dump();
  EXPECT_EQ(st["builder"]["compile_failures"], 1) << st.dump();
  EXPECT_EQ(st["builder"]["requests"], clients * per_client) << st.dump();
  EXPECT_EQ(st["builder"]["negative_hits"].get<int>() + st["builder"]["coalesced"].get<int>(),
            clients * per_client - 1)
      << st.dump();
  // Another variant of the same family is a different key: it is compiled (and fails) on its own.
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->get_kernel(spec_pool(2)[1], "sm_90a").status().code(), Code::compile_error);
  EXPECT_EQ(stats_of(env.socket())["builder"]["compiles"], 2);
}

TEST(HostileSpecs, InjectionHugeAndNegativeValuesAreInvalidArgumentsAndNothingCompiles) {
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  const std::string ones(5000, '1');
  const std::vector<std::string> specs = {
      "rmsnorm(block=256,dtype=float);},vec=4)",
      "rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4);#include \"/etc/passwd\"",
      "rmsnorm(block=256,dtype=#include \"/etc/passwd\",vec=4)",
      "rmsnorm(block=256,dtype=f32\n#include \"/etc/passwd\"\n,vec=4)",
      "rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4>\n#include </etc/passwd>)",
      "rmsnorm(block=256);template<> struct X{};(dtype=f32,vec=4)",
      "rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4,name=\"x\")",
      "rmsnorm(block=99999999999999999999999,bulk=0,dtype=f32,row=0,vec=4)",
      "rmsnorm(block=9223372036854775807,bulk=0,dtype=f32,row=0,vec=4)",
      "rmsnorm(block=" + ones + ",dtype=f32,vec=4)",
      "rmsnorm(block=-256,dtype=f32,vec=4)",
      "rmsnorm(block=256,dtype=f32,vec=-4)",
      "rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=0)",
      "rmsnorm(block=0x100,dtype=f32,vec=4)",
      "rmsnorm(block=2.56e2,dtype=f32,vec=4)",
      "rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4",
      "rmsnorm(block=256,block=256,bulk=0,dtype=f32,row=0,vec=4)",
      "rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)\n",
      std::string("rmsnorm(block=256,dtype=f32\0,vec=4)", 35),
      "rmsnorm(block=256,dtype=f\xc3\xa9" "32,vec=4)",
      "rmsnorm(block=256,dtype=" + std::string(100000, 'f') + ",vec=4)",
  };
  for (const auto& spec : specs) {
    RawConn raw(env.socket());
    ASSERT_TRUE(raw.ok());
    nlohmann::json req{{"op", "get"}, {"spec", spec}, {"arch", "sm_90a"}};
    ASSERT_TRUE(raw.send_bytes(RawConn::frame(daemon::dump_json(req))));
    auto reply = raw.read_reply();
    ASSERT_TRUE(reply) << spec.substr(0, 80);
    EXPECT_EQ(error_code_of(*reply), "invalid_argument") << spec.substr(0, 80) << ": " << reply->dump().substr(0, 300);
  }
  // Hostile family names and archs: never found or invalid, never compiled.
  for (const auto& [spec, arch] : std::vector<std::pair<std::string, std::string>>{
           {"../../etc/passwd(a=1)", "sm_90a"},
           {"rmsnorm\";system(\"x\");(block=256,bulk=0,dtype=f32,row=0,vec=4)", "sm_90a"},
           {"rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)", "sm_90a --include-path=/etc"},
           {"rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)", "sm_90a\" -Dx=\"y"},
           {"rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)", "sm_99999999999999999999"},
           {"rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)", "sm_-90"}}) {
    RawConn raw(env.socket());
    nlohmann::json req{{"op", "get"}, {"spec", spec}, {"arch", arch}};
    ASSERT_TRUE(raw.send_bytes(RawConn::frame(daemon::dump_json(req))));
    auto reply = raw.read_reply();
    ASSERT_TRUE(reply) << spec;
    const std::string code = error_code_of(*reply);
    EXPECT_TRUE(code == "invalid_argument" || code == "not_found") << spec << " @ " << arch << ": " << reply->dump();
  }
  for (const char* body : {R"J({"op":"prewarm","archs":["sm_90a;rm"],"families":["rmsnorm"]})J",
                           R"J({"op":"prewarm","archs":["sm_90a"],"families":["rmsnorm(block=1)"]})J",
                           R"J({"op":"prewarm","archs":[7],"families":["rmsnorm"]})J",
                           R"J({"op":"prewarm","archs":"sm_90a"})J"}) {
    RawConn raw(env.socket());
    ASSERT_TRUE(raw.send_bytes(RawConn::frame(body)));
    auto reply = raw.read_reply();
    ASSERT_TRUE(reply) << body;
    const std::string code = error_code_of(*reply);
    EXPECT_TRUE(code == "invalid_argument" || code == "not_found") << body << ": " << reply->dump();
  }
  auto st = stats_of(env.socket());
  EXPECT_EQ(st["builder"]["requests"], 0) << st.dump();
  EXPECT_EQ(st["builder"]["compiles"], 0) << st.dump();
  EXPECT_EQ(st["cache"]["entries"], 0) << st.dump();
}

TEST(Shutdown, SigtermWithCompilesInFlightAnswersEveryoneCheckpointsAndRemovesTheSocket) {
  DaemonEnv env;
  auto k = env.start({"--jobs", "1"});
  ASSERT_TRUE(k);
  const auto pool = spec_pool(8);
  std::vector<std::unique_ptr<client::DaemonClient>> conns;
  for (int i = 0; i < 8; ++i) {
    auto c = client::DaemonClient::connect(env.socket());
    ASSERT_TRUE(c.ok());
    conns.push_back(std::move(c).value());
  }
  std::vector<Result<jit::Artifact>> results(8, Result<jit::Artifact>(internal_error("not run")));
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) threads.emplace_back([&, i] { results[i] = conns[i]->get_kernel(pool[i], "sm_90a"); });
  std::this_thread::sleep_for(150ms);
  k->signal(SIGTERM);
  for (auto& t : threads) t.join();
  auto code = k->wait_exit(30s);
  ASSERT_TRUE(code) << "kilnd did not stop";
  EXPECT_EQ(*code, 0) << k->log();
  int completed = 0, refused = 0;
  for (const auto& r : results) {
    if (r.ok()) {
      ++completed;
    } else {
      EXPECT_EQ(r.status().code(), Code::shutting_down) << r.status().to_string();
      ++refused;
    }
  }
  std::printf("SIGTERM with 8 requests: %d completed, %d answered shutting_down\n", completed, refused);
  EXPECT_GE(completed, 1) << "the compile running at SIGTERM completes";
  EXPECT_GE(refused, 1) << "queued requests are answered shutting_down";
  EXPECT_FALSE(fs::exists(env.socket()));
  const fs::path wal = cache_file_of(env).string() + "-wal";
  EXPECT_TRUE(!fs::exists(wal) || fs::file_size(wal) == 0) << "WAL left with " << fs::file_size(wal) << " bytes";
  expect_cache_sound(cache_file_of(env), "after SIGTERM");
  RawDb db(cache_file_of(env));
  EXPECT_GE(int(db.keys().size()), completed);
}

TEST(DiskFull, FileSizeLimitServesCompiledKernelsCountsLogsOnceAndCorruptsNothing) {
  DaemonEnv env;
  // Two kernels stored, then a clean stop: the database holds everything and the WAL is empty.
  {
    auto k = env.start();
    ASSERT_TRUE(k);
    auto c = client::DaemonClient::connect(env.socket());
    for (const auto& s : spec_pool(2)) ASSERT_TRUE((*c)->get_kernel(s, "sm_90a").ok());
    ASSERT_TRUE((*c)->shutdown().ok());
    ASSERT_EQ(k->wait_exit(), 0);
  }
  auto k = env.start();
  ASSERT_TRUE(k);
  // No file of the daemon may grow past 16 KiB beyond the log's current end: the log keeps
  // room, every cubin store (tens of KiB into the WAL) fails with EFBIG.
  const auto limit = rlim_t(fs::file_size(env.log()) + 16 * 1024);
  rlimit old{};
  ASSERT_EQ(::prlimit(k->pid(), RLIMIT_FSIZE, nullptr, &old), 0) << std::strerror(errno);
  rlimit rl{limit, old.rlim_max};  // the soft limit only, so that it can be lifted again
  ASSERT_EQ(::prlimit(k->pid(), RLIMIT_FSIZE, &rl, nullptr), 0) << std::strerror(errno);
  const auto pool = spec_pool(12);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  std::map<std::string, std::string> sums;
  for (const auto& s : pool) {
    auto r = (*c)->get_kernel(s, "sm_90a");
    ASSERT_TRUE(r.ok()) << s.canonical() << ": " << r.status().to_string() << "\n" << k->log();
    EXPECT_EQ(sha256_hex(r->entry.cubin), r->entry.checksum);
    sums[s.canonical()] = r->entry.checksum;
  }
  auto st = stats_of(env.socket());
  EXPECT_EQ(st["builder"]["compiles"], 10) << st.dump();
  EXPECT_GE(st["builder"]["store_failures"].get<int>(), 8) << st.dump();
  const std::string log = k->log();
  std::size_t lines = 0;
  for (std::size_t p = 0; (p = log.find("could not store", p)) != std::string::npos; ++p) ++lines;
  EXPECT_EQ(lines, 1u) << log;
  EXPECT_TRUE(k->running());
  // Space again: a stop, then the file is sound and a new daemon stores what it compiles.
  ASSERT_EQ(::prlimit(k->pid(), RLIMIT_FSIZE, &old, nullptr), 0) << std::strerror(errno);
  ASSERT_TRUE((*c)->shutdown().ok());
  ASSERT_TRUE(k->wait_exit());
  expect_cache_sound(cache_file_of(env), "after the disk was full");
  auto k2 = env.start();
  ASSERT_TRUE(k2);
  auto c2 = client::DaemonClient::connect(env.socket());
  for (const auto& s : pool) {
    auto r = (*c2)->get_kernel(s, "sm_90a");
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->entry.checksum, sums[s.canonical()]);
  }
  auto st2 = stats_of(env.socket());
  EXPECT_EQ(st2["builder"]["store_failures"], 0) << st2.dump();
  EXPECT_EQ(st2["cache"]["entries"], 12) << st2.dump();
}

TEST(SlowPeers, ThousandIdleAndTricklingConnectionsAreCutWhileClientsAreServed) {
  DaemonEnv env;
  auto k = env.start({"--jobs", "2", "--idle-timeout-ms", "2000", "--frame-timeout-ms", "2000"});
  ASSERT_TRUE(k);
  const KernelSpec spec = spec_pool(1)[0];
  {
    auto c = client::DaemonClient::connect(env.socket());
    ASSERT_TRUE((*c)->get_kernel(spec, "sm_90a").ok());
  }
  const long rss_before = rss_kib(k->pid());
  const int fds_before = fd_count(k->pid());

  // A legitimate client keeps asking throughout.
  std::atomic<bool> stop{false};
  std::atomic<int> served{0}, failed{0};
  std::atomic<long> worst_us{0};
  std::string last_error;
  std::thread legit([&] {
    auto c = client::DaemonClient::connect(env.socket());
    if (!c.ok()) {
      ++failed;
      return;
    }
    while (!stop) {
      auto t0 = Clock::now();
      auto r = (*c)->get_kernel(spec, "sm_90a", 5s);
      long us = long(std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count());
      if (us > worst_us) worst_us = us;
      if (r.ok()) ++served;
      else {
        ++failed;
        last_error = r.status().to_string();
      }
      std::this_thread::sleep_for(20ms);
    }
  });

  // 1000 hostile connections: a third silent, a third stuck in a header, a third trickling a body
  // that announces the largest allowed request (1 MiB).
  std::vector<std::unique_ptr<RawConn>> conns;
  for (int i = 0; i < 1000; ++i) {
    auto r = std::make_unique<RawConn>(env.socket());
    ASSERT_TRUE(r->ok()) << i;
    if (i % 3 == 1) (void)r->send_bytes(RawConn::header(100).substr(0, 7));
    if (i % 3 == 2) (void)r->send_bytes(RawConn::header(daemon::k_max_request_json) + "{\"op\":");
    conns.push_back(std::move(r));
  }
  int max_fds = 0;
  long max_rss = 0;
  const auto t_end = Clock::now() + 4s;
  while (Clock::now() < t_end) {
    for (int i = 2; i < 1000; i += 3) (void)::send(conns[i]->fd(), " ", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    max_fds = std::max(max_fds, fd_count(k->pid()));
    max_rss = std::max(max_rss, rss_kib(k->pid()));
    std::this_thread::sleep_for(100ms);
  }
  stop = true;
  legit.join();
  int closed = 0;
  for (auto& r : conns)
    if (r->closed_within(3s)) ++closed;
  auto st = stats_of(env.socket());
  std::printf("1000 hostile connections: %d closed, daemon fds %d -> max %d, RSS %ld -> max %ld KiB, "
              "legit client %d served, %d failed, worst %.1f ms, %s evicted\n",
              closed, fds_before, max_fds, rss_before, max_rss, served.load(), failed.load(), worst_us / 1000.0,
              st["daemon"]["evicted_connections"].dump().c_str());
  EXPECT_EQ(failed, 0) << last_error;
  EXPECT_GT(served, 50);
  EXPECT_LT(worst_us, 1'000'000);
  EXPECT_EQ(closed, 1000);
  EXPECT_LE(max_fds, fds_before + 256 + 8);
  EXPECT_LT(max_rss, rss_before + 64 * 1024);
  EXPECT_TRUE(k->running());
}

}  // namespace
}  // namespace kiln::testing
