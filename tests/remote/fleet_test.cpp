// Two kilnd "hosts" (two cache directories, two sockets) and one real redis-server: what one host
// compiled the other is served from Redis without compiling; two hosts asked for the same new
// kernel at the same moment compile it once between them; a flipped byte in Redis or another
// fleet's key is rejected and the kernel compiled locally; Redis killed during a run of requests
// loses none, and restarted it is used again; the same over TLS, where a host that cannot verify
// the server compiles locally. Kernels are real NVRTC compiles (no GPU needed).
#include <gtest/gtest.h>

#include <atomic>
#include <latch>
#include <thread>

#include "kiln/family.h"
#include "remote/signed.h"
#include "tests/daemon/kilnd_harness.h"
#include "tests/remote/redis_harness.h"

namespace kiln::testing {
namespace {

const std::string k_arch = "sm_90a";

// The first n catalog variants of rmsnorm for sm_90a (small, quick compiles).
std::vector<KernelSpec> specs(std::size_t n, std::size_t skip = 0) {
  const Family* f = Registry::global().find("rmsnorm");
  auto cat = catalog_for(*f, k_arch);
  EXPECT_TRUE(cat.ok());
  std::vector<KernelSpec> out;
  for (std::size_t i = skip; i < cat->size() && out.size() < n; ++i) out.push_back({"rmsnorm", (*cat)[i]});
  return out;
}

struct Host {
  DaemonEnv env;
  std::unique_ptr<Kilnd> kilnd;
  std::unique_ptr<client::DaemonClient> client;

  Host(const std::string& url, const fs::path& key, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--jobs", "2", "--remote", url, "--fleet-key-file", key.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    kilnd = env.start(args);
    if (!kilnd) return;
    auto c = client::DaemonClient::connect(env.socket());
    if (c.ok()) client = std::move(c).value();
  }
  bool ok() const { return kilnd && client; }
  Result<jit::Artifact> get(const KernelSpec& s) { return client->get_kernel(s, k_arch); }
  nlohmann::json stats() { return stats_of(env.socket()); }
  std::int64_t remote(const char* counter) { return stats()["daemon"]["remote"].value(counter, std::int64_t{-1}); }
  std::int64_t builder(const char* counter) { return stats()["builder"].value(counter, std::int64_t{-1}); }
  bool written(std::int64_t n) {
    return eventually([&] { return remote("writes") >= n && remote("pending_writes") == 0; });
  }
};

class Fleet : public ::testing::Test {
 protected:
  void SetUp() override {
    KILN_REQUIRE_REDIS();
    redis = RedisServer::start(tmp.path());
    ASSERT_TRUE(redis);
    key = write_secret(tmp.path() / "fleet.key", "fleet test key: 0123456789abcdef\n");
  }
  TempDir tmp;
  std::unique_ptr<RedisServer> redis;
  fs::path key;
};

TEST_F(Fleet, HostBIsServedWhatHostACompiledWithoutCompiling) {
  Host a(redis->url(), key), b(redis->url(), key);
  ASSERT_TRUE(a.ok() && b.ok());
  const auto s = specs(2);
  for (const auto& spec : s) {
    auto r = a.get(spec);
    ASSERT_TRUE(r.ok()) << r.status().to_string() << a.kilnd->log();
    EXPECT_EQ(r->source, jit::ArtifactSource::compiled);
  }
  ASSERT_TRUE(a.written(2)) << a.stats().dump();

  for (const auto& spec : s) {
    auto r = b.get(spec);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->source, jit::ArtifactSource::remote);
    auto again = b.get(spec);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->source, jit::ArtifactSource::cache) << "kept in B's local cache";
    EXPECT_EQ(again->entry.cubin, r->entry.cubin);
  }
  EXPECT_EQ(b.builder("compiles"), 0);
  EXPECT_EQ(b.builder("remote_hits"), 2);
  EXPECT_EQ(b.remote("hits"), 2);
  EXPECT_EQ(b.remote("rejected"), 0);
  EXPECT_EQ(b.remote("writes"), 0) << "nothing compiled, nothing written back";
}

TEST_F(Fleet, AByteFlippedInRedisIsRejectedAndRecompiled) {
  Host a(redis->url(), key), b(redis->url(), key);
  ASSERT_TRUE(a.ok() && b.ok());
  const KernelSpec spec = specs(1, 2).front();
  auto first = a.get(spec);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  ASSERT_TRUE(a.written(1));

  const std::string name = "kiln:v1:" + remote::entry_name(first->entry.key);
  auto value = redis->command({"GET", name});
  ASSERT_TRUE(value.ok());
  ASSERT_EQ(value->type, remote::Reply::Type::bulk);
  std::string flipped = value->text;
  flipped[flipped.size() - 100] = char(flipped[flipped.size() - 100] ^ 0x01);  // in the cubin
  ASSERT_TRUE(redis->command({"SET", name, flipped}).ok());

  auto r = b.get(spec);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->source, jit::ArtifactSource::compiled);
  EXPECT_EQ(r->entry.cubin, first->entry.cubin) << "the same kernel, compiled locally";
  EXPECT_EQ(b.remote("rejected"), 1);
  EXPECT_EQ(b.builder("compiles"), 1);
  EXPECT_NE(b.kilnd->log().find("rejected the entry"), std::string::npos) << b.kilnd->log();
  // B's write-back replaced the bad record: a third host is served again.
  ASSERT_TRUE(b.written(1));
  Host c(redis->url(), key);
  ASSERT_TRUE(c.ok());
  auto third = c.get(spec);
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->source, jit::ArtifactSource::remote);
}

TEST_F(Fleet, AnotherFleetKeyIsRejected) {
  Host a(redis->url(), key);
  const fs::path other = write_secret(tmp.path() / "other.key", "another fleet's key, 0123456789\n");
  Host b(redis->url(), other);
  ASSERT_TRUE(a.ok() && b.ok());
  const KernelSpec spec = specs(1, 3).front();
  ASSERT_TRUE(a.get(spec).ok());
  ASSERT_TRUE(a.written(1));
  auto r = b.get(spec);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->source, jit::ArtifactSource::compiled);
  EXPECT_EQ(b.remote("rejected"), 1);
  EXPECT_EQ(b.builder("remote_hits"), 0);
}

TEST_F(Fleet, AFleetKeyOthersCanReadStopsKilnd) {
  const fs::path open_key = write_secret(tmp.path() / "open.key", "fleet test key: 0123456789abcdef\n", 0644);
  DaemonEnv env;
  auto k = Kilnd::spawn(env.options({"--remote", redis->url(), "--fleet-key-file", open_key.string()}));
  auto code = k->wait_exit(10s);
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 1);
  EXPECT_NE(k->log().find("must be 0600"), std::string::npos) << k->log();
  EXPECT_FALSE(fs::exists(env.socket())) << "nothing was served";
}

// Host B serves a run of 10,000 `get` requests (4 client threads) for 8 kernels host A compiled,
// each kernel first asked for in its own stretch of the run; Redis is killed halfway. Every
// request is answered: the kernels first asked for before the kill come from Redis, the rest are
// compiled. Redis restarted (empty) is used again once B's back-off lets a probe through.
TEST_F(Fleet, RedisKilledDuringARunLosesNoRequestAndIsUsedAgainAfterARestart) {
  Host a(redis->url(), key), b(redis->url(), key);
  ASSERT_TRUE(a.ok() && b.ok());
  constexpr int k_kernels = 8, k_requests = 10000, k_threads = 4;
  const auto s = specs(k_kernels + 1, 4);
  {
    std::vector<std::thread> ts;
    for (int t = 0; t < 2; ++t)
      ts.emplace_back([&, t] {
        auto c = client::DaemonClient::connect(a.env.socket());
        ASSERT_TRUE(c.ok());
        for (int i = t; i < k_kernels; i += 2) ASSERT_TRUE((*c)->get_kernel(s[std::size_t(i)], k_arch).ok());
      });
    for (auto& t : ts) t.join();
  }
  ASSERT_TRUE(a.written(k_kernels));

  std::atomic<int> next{0}, ok{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t)
    threads.emplace_back([&] {
      auto c = client::DaemonClient::connect(b.env.socket());
      ASSERT_TRUE(c.ok());
      for (;;) {
        const int i = next.fetch_add(1);
        if (i >= k_requests) return;
        if (i == k_requests / 2) redis->kill();
        auto r = (*c)->get_kernel(s[std::size_t(i * k_kernels / k_requests)], k_arch);
        if (r.ok()) ++ok;
        else {
          ++failed;
          ADD_FAILURE() << "request " << i << ": " << r.status().to_string();
        }
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), k_requests);
  EXPECT_EQ(failed.load(), 0);
  const auto remote_hits = b.builder("remote_hits"), compiles = b.builder("compiles");
  EXPECT_EQ(remote_hits + compiles, k_kernels);
  EXPECT_GE(remote_hits, k_kernels / 2 - 1);
  EXPECT_GE(compiles, k_kernels / 2 - 1);
  EXPECT_GE(b.remote("errors") + b.remote("timeouts"), 1);
  EXPECT_FALSE(b.stats()["daemon"]["remote"].value("up", true));
  std::printf("[ figures  ] %d requests, %lld kernels from Redis, %lld compiled after the kill\n", k_requests,
              static_cast<long long>(remote_hits), static_cast<long long>(compiles));

  ASSERT_TRUE(redis->restart());
  const KernelSpec fresh = s[k_kernels];
  ASSERT_TRUE(a.get(fresh).ok());  // A never saw the outage: it writes at once
  ASSERT_TRUE(a.written(k_kernels + 1));
  // B's back-off is at most 2 s; once it passes, B's next miss probes the server and is served.
  std::this_thread::sleep_for(2200ms);
  auto r = b.get(fresh);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->source, jit::ArtifactSource::remote);
  EXPECT_TRUE(b.stats()["daemon"]["remote"].value("up", false));
}

// Both hosts are asked for the same new kernel at the same moment, three kernels in turn: one
// host takes the compile lock and compiles, the other waits for its record. Without the lock
// both would compile every kernel.
TEST_F(Fleet, TwoHostsAskedForTheSameNewKernelAtOnceCompileItOnce) {
  Host a(redis->url(), key), b(redis->url(), key);
  ASSERT_TRUE(a.ok() && b.ok());
  const auto s = specs(3, 20);
  for (const auto& spec : s) {
    std::latch start(2);
    std::vector<std::thread> ts;
    for (Host* h : {&a, &b})
      ts.emplace_back([&, h] {
        auto c = client::DaemonClient::connect(h->env.socket());
        ASSERT_TRUE(c.ok());
        start.arrive_and_wait();
        auto r = (*c)->get_kernel(spec, k_arch);
        ASSERT_TRUE(r.ok()) << r.status().to_string();
      });
    for (auto& t : ts) t.join();
  }
  const std::int64_t compiles = a.builder("compiles") + b.builder("compiles");
  const std::int64_t won = a.remote("locks_won") + b.remote("locks_won");
  const std::int64_t waited = a.remote("lock_wait_hits") + b.remote("lock_wait_hits");
  EXPECT_EQ(compiles, 3) << "each kernel compiled once in the fleet";
  EXPECT_EQ(won, 3);
  EXPECT_EQ(a.builder("remote_hits") + b.builder("remote_hits"), 3) << "the other host got each from Redis";
  // Each wait proves that both hosts missed at once; a host slowed past the other's whole compile
  // finds the record without waiting, which a loaded test machine may do now and then.
  EXPECT_GE(waited, 1) << "the hosts never missed at the same moment: the test proves nothing";
  EXPECT_EQ(a.remote("lock_timeouts") + b.remote("lock_timeouts"), 0);
  std::printf("[ figures  ] 3 kernels asked of 2 hosts at once: %lld compiles, %lld locks won, %lld waits served\n",
              static_cast<long long>(compiles), static_cast<long long>(won), static_cast<long long>(waited));
}

class FleetTls : public ::testing::Test {
 protected:
  void SetUp() override {
    KILN_REQUIRE_REDIS();
    std::string why;
    auto p = TestPki::make(tmp.path(), why);
    if (!p) GTEST_SKIP() << why;
    pki = *p;
    redis = RedisServer::start_tls(tmp.path(), pki);
    ASSERT_TRUE(redis);
    key = write_secret(tmp.path() / "fleet.key", "fleet test key: 0123456789abcdef\n");
  }
  TempDir tmp;
  TestPki pki;
  std::unique_ptr<RedisServer> redis;
  fs::path key;
};

TEST_F(FleetTls, HostBIsServedWhatHostACompiledOverTls) {
  Host a(redis->url(), key, {"--remote-ca-file", pki.ca.string()});
  Host b(redis->url(), key, {"--remote-ca-file", pki.ca.string()});
  ASSERT_TRUE(a.ok() && b.ok()) << a.kilnd->log();
  EXPECT_TRUE(a.stats()["daemon"]["remote"].value("tls", false));
  const KernelSpec spec = specs(1, 30).front();
  auto first = a.get(spec);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_EQ(first->source, jit::ArtifactSource::compiled);
  ASSERT_TRUE(a.written(1)) << a.stats().dump();
  auto r = b.get(spec);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->source, jit::ArtifactSource::remote);
  EXPECT_EQ(r->entry.cubin, first->entry.cubin);
  EXPECT_EQ(b.builder("compiles"), 0);
  EXPECT_EQ(b.remote("tls_errors"), 0);
}

TEST_F(FleetTls, AHostThatCannotVerifyTheServerCompilesLocallyAndCountsIt) {
  Host a(redis->url(), key, {"--remote-ca-file", pki.ca.string()});
  Host b(redis->url(), key, {"--remote-ca-file", pki.other_ca.string()});
  ASSERT_TRUE(a.ok() && b.ok());
  const KernelSpec spec = specs(1, 31).front();
  ASSERT_TRUE(a.get(spec).ok());
  ASSERT_TRUE(a.written(1));
  auto r = b.get(spec);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->source, jit::ArtifactSource::compiled);
  EXPECT_EQ(b.builder("compiles"), 1);
  // The lookup's handshake fails; the write-back after the compile may probe again once the
  // back-off has passed, and fail the same way.
  EXPECT_GE(b.remote("tls_errors"), 1);
  EXPECT_EQ(b.remote("tls_errors"), b.remote("errors")) << "every failure was the certificate";
  EXPECT_EQ(b.remote("hits"), 0);
  EXPECT_FALSE(b.stats()["daemon"]["remote"].value("up", true));
  EXPECT_NE(b.kilnd->log().find("does not verify"), std::string::npos) << b.kilnd->log();
}

TEST_F(FleetTls, AnUnusableClientKeyStopsKilnd) {
  const fs::path open_key = tmp.path() / "open-client.key";
  fs::copy_file(pki.client_key, open_key);
  ::chmod(open_key.c_str(), 0644);
  DaemonEnv env;
  auto k = Kilnd::spawn(env.options({"--remote", redis->url(), "--fleet-key-file", key.string(), "--remote-ca-file",
                                     pki.ca.string(), "--remote-cert-file", pki.client_cert.string(),
                                     "--remote-key-file", open_key.string()}));
  auto code = k->wait_exit(10s);
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 1);
  EXPECT_NE(k->log().find("TLS client key"), std::string::npos) << k->log();
  EXPECT_NE(k->log().find("must be 0600"), std::string::npos) << k->log();
}

}  // namespace
}  // namespace kiln::testing
