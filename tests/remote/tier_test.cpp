// The remote tier against real redis-server processes: hits, misses and write-backs, rejected
// records, a server that stops answering, one killed during a run of reads and restarted, a full
// one, an ACL user, and the compile locks hosts coordinate with. Entries here are made up (no
// compile): the tier checks signatures and checksums, not what a cubin does.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "common/sha256.h"
#include "remote/signed.h"
#include "remote/tier.h"
#include "tests/remote/redis_harness.h"
#include "tests/test_util.h"

namespace kiln::testing {
namespace {

using Clock = std::chrono::steady_clock;

const std::string k_fleet_key = "tier-test fleet key, 32+ bytes long";

cache::Entry entry(int i, std::size_t bytes = 4096) {
  cache::Entry e;
  e.cubin = std::string("\x7f" "ELF", 4) + std::string(bytes, char('a' + i % 26));
  e.key = sha256_hex("entry " + std::to_string(i));
  e.family = "rmsnorm";
  e.family_version = 1;
  e.params = "i=" + std::to_string(i);
  e.arch = "sm_90a";
  e.toolchain = sha256_hex("toolchain");
  e.lowered_name = "_Z1kv";
  return e;
}

remote::Config config_for(const RedisServer& r, const std::string& key = k_fleet_key) {
  remote::Config c;
  c.url = r.url();
  c.endpoint.host = "127.0.0.1";
  c.endpoint.port = r.port();
  c.fleet_key = key;
  return c;
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// A read waits at most the timeout, plus this much for a busy test machine's scheduling.
constexpr double k_slack_ms = 150;

class Tier : public ::testing::Test {
 protected:
  void SetUp() override {
    KILN_REQUIRE_REDIS();
    redis = RedisServer::start(tmp.path());
    ASSERT_TRUE(redis);
  }
  TempDir tmp;
  std::unique_ptr<RedisServer> redis;
};

TEST_F(Tier, WritesBackAndServesVerifiedEntries) {
  auto writer = remote::Tier::create(config_for(*redis));
  const cache::Entry e = entry(1);
  writer->put_entry(e);
  ASSERT_TRUE(writer->flush(5s));
  EXPECT_EQ(writer->counters().writes, 1);

  auto reader = remote::Tier::create(config_for(*redis));  // another host
  auto got = reader->get_entry(e.key, {e.arch, e.toolchain});
  ASSERT_TRUE(got);
  EXPECT_EQ(got->cubin, e.cubin);
  EXPECT_FALSE(reader->get_entry(entry(2).key, {}));
  const remote::Counters c = reader->counters();
  EXPECT_EQ(c.lookups, 2);
  EXPECT_EQ(c.hits, 1);
  EXPECT_EQ(c.misses, 1);
  EXPECT_EQ(c.rejected, 0);
  EXPECT_TRUE(c.up);
  // The key in Redis is the content key under kiln's prefix, nothing else.
  auto raw = redis->command({"EXISTS", "kiln:v1:k/" + e.key});
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(raw->integer, 1);
}

TEST_F(Tier, NeverServesAFlippedByteOrAnotherFleetsEntry) {
  auto tier = remote::Tier::create(config_for(*redis));
  const cache::Entry e = entry(3);
  tier->put_entry(e);
  ASSERT_TRUE(tier->flush(5s));

  auto other = remote::Tier::create(config_for(*redis, "a different fleet key, 32+ bytes"));
  EXPECT_FALSE(other->get_entry(e.key, {}));
  EXPECT_EQ(other->counters().rejected, 1);

  auto value = redis->command({"GET", "kiln:v1:k/" + e.key});
  ASSERT_TRUE(value.ok());
  std::string flipped = value->text;
  flipped[flipped.size() / 2] = char(flipped[flipped.size() / 2] ^ 0x20);
  ASSERT_TRUE(redis->command({"SET", "kiln:v1:k/" + e.key, flipped}).ok());
  EXPECT_FALSE(tier->get_entry(e.key, {}));
  // Moved under another key: valid bytes, wrong name.
  ASSERT_TRUE(redis->command({"SET", "kiln:v1:k/" + entry(4).key, value->text}).ok());
  EXPECT_FALSE(tier->get_entry(entry(4).key, {}));
  EXPECT_EQ(tier->counters().rejected, 2);
  EXPECT_TRUE(tier->counters().up) << "a bad record is not a server failure";
}

TEST_F(Tier, AServerThatStopsAnsweringCostsOneTimeoutThenNothing) {
  auto tier = remote::Tier::create(config_for(*redis));
  const cache::Entry e = entry(5);
  tier->put_entry(e);
  ASSERT_TRUE(tier->flush(5s));
  ASSERT_TRUE(tier->get_entry(e.key, {}));  // a pooled connection exists now

  redis->pause();  // accepts nothing, answers nothing
  auto t0 = Clock::now();
  EXPECT_FALSE(tier->get_entry(e.key, {}));
  const double first = ms_since(t0);
  EXPECT_LT(first, 50 + k_slack_ms);
  EXPECT_GE(first, 45) << "it did wait for the server";
  t0 = Clock::now();
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(tier->get_entry(e.key, {}));
  EXPECT_LT(ms_since(t0), 50 + k_slack_ms) << "while backing off, no read waits";
  remote::Counters c = tier->counters();
  EXPECT_EQ(c.timeouts, 1);
  EXPECT_FALSE(c.up);
  EXPECT_EQ(c.outages, 1);
  EXPECT_GE(c.skipped, 99);

  redis->resume();
  EXPECT_TRUE(eventually([&] { return tier->get_entry(e.key, {}).has_value(); }, 5s))
      << "used again once it answers";
  EXPECT_TRUE(tier->counters().up);
}

// A run of 5000 reads over 16 entries from 4 threads; the server is killed halfway. Every read
// returns within the bound, the ones before the kill hit, none after; restarted (empty), the tier
// comes back and serves what is written to it again.
TEST_F(Tier, KilledDuringARunOfReadsThenRestarted) {
  auto tier = remote::Tier::create(config_for(*redis));
  constexpr int k_entries = 16, k_reads = 5000, k_threads = 4;
  for (int i = 0; i < k_entries; ++i) tier->put_entry(entry(i));
  ASSERT_TRUE(tier->flush(10s));
  ASSERT_EQ(tier->counters().writes, k_entries);

  std::atomic<int> next{0}, hits{0}, misses{0}, answered{0};
  std::atomic<bool> killed{false};
  std::atomic<long long> slowest_us{0};
  auto worker = [&] {
    for (;;) {
      const int i = next.fetch_add(1);
      if (i >= k_reads) return;
      if (i == k_reads / 2) {
        redis->kill();
        killed = true;
      }
      const bool after_kill = killed.load();
      const auto t0 = Clock::now();
      auto got = tier->get_entry(entry(i % k_entries).key, {});
      const long long us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
      long long prev = slowest_us.load();
      while (us > prev && !slowest_us.compare_exchange_weak(prev, us)) {
      }
      ++answered;
      if (got) {
        ++hits;
        EXPECT_EQ(got->cubin, entry(i % k_entries).cubin);
        EXPECT_FALSE(after_kill && i > k_reads / 2 + k_threads) << "served after the server died";
      } else {
        ++misses;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  EXPECT_EQ(answered.load(), k_reads) << "every read returned";
  EXPECT_GE(hits.load(), k_reads / 2 - k_threads);
  EXPECT_LT(double(slowest_us.load()) / 1000.0, 50 + k_slack_ms);
  remote::Counters c = tier->counters();
  EXPECT_FALSE(c.up);
  EXPECT_GE(c.errors + c.timeouts, 1);
  EXPECT_GE(c.skipped, k_reads / 2 - 50) << "while down, reads are not sent";
  std::printf("[ figures  ] %d reads, %d hits, %d misses, slowest %.1f ms, %lld skipped while down\n", k_reads,
              hits.load(), misses.load(), double(slowest_us.load()) / 1000.0, static_cast<long long>(c.skipped));

  ASSERT_TRUE(redis->restart());
  auto writer = remote::Tier::create(config_for(*redis));  // a host that never saw the outage
  writer->put_entry(entry(100));
  ASSERT_TRUE(writer->flush(5s));
  EXPECT_TRUE(eventually([&] { return tier->get_entry(entry(100).key, {}).has_value(); }, 5s))
      << "the restarted server is used again";
  EXPECT_TRUE(tier->counters().up);
}

TEST_F(Tier, AFullServerRefusesWritesAndStillServesReads) {
  auto small = RedisServer::start(tmp.path(), {"--maxmemory", "3mb", "--maxmemory-policy", "noeviction"});
  ASSERT_TRUE(small);
  auto tier = remote::Tier::create(config_for(*small));
  tier->put_entry(entry(0));
  ASSERT_TRUE(tier->flush(5s));
  for (int i = 1; i < 40; ++i) tier->put_entry(entry(i, 256 * 1024));
  ASSERT_TRUE(tier->flush(10s));
  const remote::Counters c = tier->counters();
  EXPECT_GT(c.full, 0);
  EXPECT_TRUE(c.up) << "full is not down";
  EXPECT_TRUE(tier->get_entry(entry(0).key, {}));
}

TEST_F(Tier, AuthenticatesAsAnAclUser) {
  const fs::path acl = tmp.path() / "users.acl";
  {
    std::ofstream out(acl);
    out << "user default off\nuser kiln on >s3cret ~kiln:* +get +set +ping\n";
  }
  auto guarded = RedisServer::start(tmp.path(), {"--aclfile", acl.string()});
  ASSERT_TRUE(guarded);
  remote::Config c = config_for(*guarded);
  c.user = "kiln";
  c.password = "s3cret";
  auto tier = remote::Tier::create(c);
  tier->put_entry(entry(7));
  ASSERT_TRUE(tier->flush(5s));
  EXPECT_EQ(tier->counters().writes, 1);
  EXPECT_TRUE(tier->get_entry(entry(7).key, {}));

  c.password = "wrong";
  auto refused = remote::Tier::create(c);
  EXPECT_FALSE(refused->get_entry(entry(7).key, {}));
  EXPECT_EQ(refused->counters().errors, 1);
  EXPECT_FALSE(refused->counters().up);
  c.user.clear();
  c.password.clear();
  auto anonymous = remote::Tier::create(c);
  EXPECT_FALSE(anonymous->get_entry(entry(7).key, {})) << "NOAUTH";
}

TEST_F(Tier, AuthenticatesWithAPasswordAlone) {
  auto guarded = RedisServer::start(tmp.path(), {"--requirepass", "only-a-password"});
  ASSERT_TRUE(guarded);
  remote::Config c = config_for(*guarded);
  c.password = "only-a-password";  // AUTH <password>: the default user
  auto tier = remote::Tier::create(c);
  tier->put_entry(entry(8));
  ASSERT_TRUE(tier->flush(5s));
  EXPECT_EQ(tier->counters().writes, 1);
  EXPECT_TRUE(tier->get_entry(entry(8).key, {}));
}

TEST_F(Tier, SignedRecordsByName) {
  auto tier = remote::Tier::create(config_for(*redis));
  cache::Setup setup{"sm_90a", "NVIDIA H100", "580 cuda 13000", sha256_hex("tc")};
  const std::string name = remote::tuning_name("rmsnorm", "f32 cols=4096", setup);
  EXPECT_EQ(name.rfind("t/", 0), 0u);
  EXPECT_NE(name, remote::tuning_name("rmsnorm", "f32 cols=4096", {"sm_80", setup.device_name, setup.driver_version,
                                                                    setup.toolchain}));
  tier->put_record(name, "{\"winner\":\"block=256\"}");
  ASSERT_TRUE(tier->flush(5s));
  auto got = tier->get_record(name);
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, "{\"winner\":\"block=256\"}");
  auto raw = redis->command({"GET", "kiln:v1:" + name});
  ASSERT_TRUE(raw.ok());
  ASSERT_TRUE(redis->command({"SET", "kiln:v1:t/other", raw->text}).ok());
  EXPECT_FALSE(tier->get_record("t/other"));
  EXPECT_EQ(tier->counters().rejected, 1);
}

TEST(TierWithoutServer, NothingListeningIsLocalOnlyAtOnce) {
  remote::Config c;
  c.endpoint.host = "127.0.0.1";
  c.endpoint.port = RedisServer::free_port();
  c.fleet_key = k_fleet_key;
  auto tier = remote::Tier::create(c);
  const auto t0 = Clock::now();
  for (int i = 0; i < 1000; ++i) EXPECT_FALSE(tier->get_entry(entry(i).key, {}));
  tier->put_entry(entry(1));
  EXPECT_TRUE(tier->flush(5s));
  EXPECT_LT(ms_since(t0), 50 + k_slack_ms);
  const remote::Counters r = tier->counters();
  EXPECT_FALSE(r.up);
  EXPECT_EQ(r.errors, 1) << "one refused connection, then back-off";
  EXPECT_EQ(r.skipped, 999);
  EXPECT_EQ(r.writes_dropped, 1);
}

}  // namespace
}  // namespace kiln::testing

namespace kiln::testing {
namespace {

// Compile coordination between hosts (Tier::claim): each test is two or more tiers, as two hosts
// would have, on one server.
class Locks : public Tier {
 protected:
  remote::Config config(std::chrono::milliseconds wait = 5s) {
    remote::Config c = config_for(*redis);
    c.lock_wait = wait;
    return c;
  }
  bool lock_exists(const std::string& key) {
    auto r = redis->command({"EXISTS", "kiln:v1:l/" + key});
    return r.ok() && r->integer == 1;
  }
};

TEST_F(Locks, OneHostCompilesTheOtherWaitsForItsRecord) {
  auto a = remote::Tier::create(config()), b = remote::Tier::create(config());
  const cache::Entry e = entry(20);
  ASSERT_FALSE(a->get_entry(e.key, {}));
  remote::Claim ca = a->claim(e.key, {});
  ASSERT_TRUE(ca.lock.held());
  EXPECT_FALSE(ca.entry);
  EXPECT_TRUE(lock_exists(e.key));

  std::optional<remote::Claim> cb;
  double waited_ms = 0;
  std::thread t([&] {
    const auto t0 = Clock::now();
    cb = b->claim(e.key, {});
    waited_ms = ms_since(t0);
  });
  std::this_thread::sleep_for(300ms);  // A "compiles"
  a->put_entry(e, std::move(ca.lock));
  t.join();
  ASSERT_TRUE(cb);
  ASSERT_TRUE(cb->entry) << "B got A's record instead of compiling";
  EXPECT_EQ(cb->entry->cubin, e.cubin);
  EXPECT_FALSE(cb->lock.held());
  EXPECT_GE(waited_ms, 250);
  EXPECT_LT(waited_ms, 300 + 500) << "B saw the record within a few polls";
  ASSERT_TRUE(a->flush(5s));
  EXPECT_FALSE(lock_exists(e.key)) << "released after the write-back";
  EXPECT_EQ(a->counters().locks_won, 1);
  const remote::Counters c = b->counters();
  EXPECT_EQ(c.locks_won, 0);
  EXPECT_EQ(c.locks_waited, 1);
  EXPECT_EQ(c.lock_wait_hits, 1);
  EXPECT_EQ(c.lock_timeouts, 0);
  EXPECT_EQ(c.hits, 1);
}

TEST_F(Locks, ManyHostsAtOnceOneWins) {
  constexpr int k_hosts = 8;
  std::vector<std::unique_ptr<remote::Tier>> hosts;
  for (int i = 0; i < k_hosts; ++i) hosts.push_back(remote::Tier::create(config()));
  const cache::Entry e = entry(21);
  std::atomic<int> won{0}, served{0}, other{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < k_hosts; ++i)
    ts.emplace_back([&, i] {
      remote::Claim c = hosts[std::size_t(i)]->claim(e.key, {});
      if (c.lock.held()) {
        ++won;
        std::this_thread::sleep_for(200ms);
        hosts[std::size_t(i)]->put_entry(e, std::move(c.lock));
      } else if (c.entry) {
        ++served;
      } else {
        ++other;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(won.load(), 1);
  EXPECT_EQ(served.load(), k_hosts - 1);
  EXPECT_EQ(other.load(), 0);
}

TEST_F(Locks, AHostThatCompiledNothingReleasesAtOnceAndAWaiterTakesOver) {
  auto a = remote::Tier::create(config()), b = remote::Tier::create(config());
  const cache::Entry e = entry(22);
  std::optional<remote::Claim> ca(a->claim(e.key, {}));
  ASSERT_TRUE(ca->lock.held());
  std::optional<remote::Claim> cb;
  double waited_ms = 0;
  std::thread t([&] {
    const auto t0 = Clock::now();
    cb = b->claim(e.key, {});
    waited_ms = ms_since(t0);
  });
  std::this_thread::sleep_for(200ms);
  ca.reset();  // A's compile failed: no entry, the lock goes
  t.join();
  ASSERT_TRUE(cb);
  EXPECT_FALSE(cb->entry);
  EXPECT_TRUE(cb->lock.held()) << "B took the lock over and compiles";
  EXPECT_LT(waited_ms, 200 + 500);
  EXPECT_EQ(b->counters().locks_waited, 1);
  EXPECT_EQ(b->counters().locks_won, 1);
  EXPECT_EQ(b->counters().lock_timeouts, 0);
}

TEST_F(Locks, ADeadHoldersLockExpiresAndAWaiterTakesOver) {
  auto b = remote::Tier::create(config());
  const cache::Entry e = entry(23);
  // A holder that died after taking the lock: nobody releases it, its TTL (400 ms) ends it.
  ASSERT_TRUE(redis->command({"SET", "kiln:v1:l/" + e.key, "dead-host", "NX", "PX", "400"}).ok());
  const auto t0 = Clock::now();
  remote::Claim cb = b->claim(e.key, {});
  const double waited_ms = ms_since(t0);
  EXPECT_TRUE(cb.lock.held());
  EXPECT_GE(waited_ms, 300);
  EXPECT_LT(waited_ms, 400 + 500);
  EXPECT_EQ(b->counters().locks_waited, 1);
  EXPECT_EQ(b->counters().lock_timeouts, 0);
}

TEST_F(Locks, AWaitRunsOutAfterLockWaitAndTheHostCompiles) {
  auto b = remote::Tier::create(config(300ms));
  const cache::Entry e = entry(24);
  ASSERT_TRUE(redis->command({"SET", "kiln:v1:l/" + e.key, "slow-host", "NX", "PX", "60000"}).ok());
  const auto t0 = Clock::now();
  remote::Claim cb = b->claim(e.key, {});
  const double waited_ms = ms_since(t0);
  EXPECT_FALSE(cb.entry);
  EXPECT_FALSE(cb.lock.held()) << "compiles without the lock: the other host still holds it";
  EXPECT_GE(waited_ms, 250);
  EXPECT_LT(waited_ms, 300 + k_slack_ms + 100);
  EXPECT_EQ(b->counters().lock_timeouts, 1);
  EXPECT_TRUE(lock_exists(e.key)) << "another host's lock is left alone";
}

TEST_F(Locks, AReleaseNeverDeletesAnotherHostsLock) {
  remote::Config short_lived = config();
  short_lived.lock_ttl = 200ms;
  auto a = remote::Tier::create(short_lived), b = remote::Tier::create(config());
  const cache::Entry e = entry(25);
  std::optional<remote::Claim> ca(a->claim(e.key, {}));
  ASSERT_TRUE(ca->lock.held());
  std::this_thread::sleep_for(300ms);  // A's lock expired: A compiles for longer than its TTL
  remote::Claim cb = b->claim(e.key, {});
  ASSERT_TRUE(cb.lock.held());
  ca.reset();  // A gives up late: its release must not free B's lock
  ASSERT_TRUE(a->flush(5s));
  EXPECT_TRUE(lock_exists(e.key));
  EXPECT_EQ(a->counters().write_errors, 0);
}

TEST_F(Locks, RedisKilledDuringAWaitCostsOneTimeoutAtMost) {
  auto b = remote::Tier::create(config());
  const cache::Entry e = entry(26);
  ASSERT_TRUE(redis->command({"SET", "kiln:v1:l/" + e.key, "other-host", "NX", "PX", "60000"}).ok());
  double waited_ms = 0;
  std::optional<remote::Claim> cb;
  std::thread t([&] {
    const auto t0 = Clock::now();
    cb = b->claim(e.key, {});
    waited_ms = ms_since(t0);
  });
  std::this_thread::sleep_for(150ms);
  redis->kill();
  t.join();
  ASSERT_TRUE(cb);
  EXPECT_FALSE(cb->entry);
  EXPECT_FALSE(cb->lock.held());
  EXPECT_LT(waited_ms, 150 + 20 + 50 + k_slack_ms) << "one poll, one timeout at most";
  EXPECT_FALSE(b->counters().up);
}

TEST_F(Locks, LockTimeZeroTurnsCoordinationOff) {
  remote::Config off = config();
  off.lock_ttl = 0ms;
  auto a = remote::Tier::create(off);
  const cache::Entry e = entry(27);
  remote::Claim c = a->claim(e.key, {});
  EXPECT_FALSE(c.lock.held());
  EXPECT_FALSE(c.entry);
  EXPECT_FALSE(lock_exists(e.key));
  EXPECT_EQ(a->counters().locks_won, 0);
}

}  // namespace
}  // namespace kiln::testing
