// The embedded resolver's tuned winners through the fleet's remote tier (client/embedded_tuning.h),
// with two "hosts" (two cache files) and a real redis-server: a winner host A tuned and wrote back
// reaches host B's first lookup and is kept in B's table; another setup, a tampered record and a
// record for another name are never used. A tuning run itself needs a GPU: here host A's write-back
// is the call the embedded resolver makes after one (remote::share_winner).
#include <gtest/gtest.h>

#include "cache/store.h"
#include "cache/tuning.h"
#include "client/embedded_tuning.h"
#include "jit/builder.h"
#include "jit/tuning_setup.h"
#include "kiln/family.h"
#include "remote/signed.h"
#include "remote/tier.h"
#include "remote/tuning.h"
#include "tests/remote/redis_harness.h"
#include "tests/test_util.h"

namespace kiln::testing {
namespace {

struct CacheHost {
  std::unique_ptr<cache::Store> store;
  std::unique_ptr<jit::Builder> builder;
  std::unique_ptr<remote::Tier> tier;
  std::unique_ptr<client::EmbeddedTuning> tuning;

  CacheHost(const fs::path& file, const remote::Config& config) {
    store = cache::Store::open(file).value();
    tier = remote::Tier::create(config);
    builder = std::make_unique<jit::Builder>(store.get(), &Registry::global(), jit::BuilderOptions{});
    tuning = client::EmbeddedTuning::open(*store, *builder, tier.get()).value();
  }
};

jit::DeviceInfo h100() {
  jit::DeviceInfo d;
  d.arch = "sm_90a";
  d.name = "NVIDIA H100 80GB HBM3";
  d.driver_version = "580.65.06 cuda 13000";
  return d;
}

class EmbeddedTuning : public ::testing::Test {
 protected:
  void SetUp() override {
    KILN_REQUIRE_REDIS();
    redis = RedisServer::start(tmp.path());
    ASSERT_TRUE(redis);
    config.endpoint.host = "127.0.0.1";
    config.endpoint.port = redis->port();
    config.fleet_key = "embedded tuning test fleet key, 32+ bytes";
    family = Registry::global().find("rmsnorm");
    ASSERT_TRUE(family);
    problem = family->problem_from_shape(DType::bf16, {{"rows", 4096}, {"cols", 4096}}).value();
  }

  // What a tuning run on host A recorded: a winner other than the heuristic's pick.
  cache::TuningRecord tuned_on(const jit::DeviceInfo& d) {
    cache::TuningRecord r;
    r.family = "rmsnorm";
    r.signature = family->signature(problem);
    r.setup = jit::tuning_setup(*family, problem, d.arch, d.name, d.driver_version).value();
    r.heuristic = family->heuristic(problem).canonical();
    auto cat = catalog_for(*family, d.arch).value();
    for (const Params& p : cat)
      if (p.canonical() != r.heuristic && family->check_problem(p, problem).ok()) {
        r.winner = p.canonical();
        break;
      }
    r.winner_ms = 0.010;
    r.heuristic_ms = 0.012;
    r.candidates = {{r.winner, cache::CandidateStatus::ok, 0.010, 0.01, 50, ""},
                    {r.heuristic, cache::CandidateStatus::ok, 0.012, 0.01, 50, ""}};
    return r;
  }

  TempDir tmp;
  std::unique_ptr<RedisServer> redis;
  remote::Config config;
  const Family* family = nullptr;
  Problem problem;
};

TEST_F(EmbeddedTuning, AWinnerAnotherHostTunedIsReadThroughAndKept) {
  CacheHost a(tmp.path() / "a.sqlite", config), b(tmp.path() / "b.sqlite", config);
  const cache::TuningRecord rec = tuned_on(h100());
  ASSERT_FALSE(rec.winner.empty());
  ASSERT_TRUE(cache::TuningTable::open(*a.store).value()->put(rec).ok());
  remote::share_winner(*a.tier, rec);
  ASSERT_TRUE(a.tier->flush(5s));
  EXPECT_EQ(a.tier->counters().writes, 1);

  auto w = b.tuning->winner(*family, problem, h100(), jit::AutotuneMode::off);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_TRUE(w->has_value()) << "B's table had nothing: the winner came from Redis";
  EXPECT_EQ((*w)->canonical(), rec.winner);
  EXPECT_NE((*w)->canonical(), family->heuristic(problem).canonical());
  EXPECT_EQ(b.tier->counters().hits, 1);

  // Kept in B's table: the next process on B needs no network.
  auto kept = cache::TuningTable::open(*b.store).value()->lookup("rmsnorm", rec.signature, rec.setup);
  ASSERT_TRUE(kept.ok());
  ASSERT_TRUE(kept->has_value());
  EXPECT_EQ((*kept)->winner, rec.winner);
  EXPECT_EQ((*kept)->candidates.size(), 2u);
  auto again = b.tuning->winner(*family, problem, h100(), jit::AutotuneMode::off);
  ASSERT_TRUE(again.ok() && again->has_value());
  EXPECT_EQ(b.tier->counters().lookups, 1) << "the second lookup was answered by B's table";
}

TEST_F(EmbeddedTuning, AnotherSetupATamperedRecordOrNoneAreNotUsed) {
  CacheHost a(tmp.path() / "a.sqlite", config), b(tmp.path() / "b.sqlite", config);
  const cache::TuningRecord rec = tuned_on(h100());
  remote::share_winner(*a.tier, rec);
  ASSERT_TRUE(a.tier->flush(5s));

  jit::DeviceInfo other = h100();
  other.driver_version = "575.51.03 cuda 12090";
  auto w = b.tuning->winner(*family, problem, other, jit::AutotuneMode::off);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_FALSE(w->has_value()) << "a winner for another driver is another record";
  EXPECT_EQ(b.tier->counters().misses, 1);

  const std::string name = "kiln:v1:" + remote::tuning_name(rec.family, rec.signature, rec.setup);
  auto raw = redis->command({"GET", name});
  ASSERT_TRUE(raw.ok());
  ASSERT_EQ(raw->type, remote::Reply::Type::bulk);
  std::string flipped = raw->text;
  flipped[flipped.size() / 3] = char(flipped[flipped.size() / 3] ^ 0x04);
  ASSERT_TRUE(redis->command({"SET", name, flipped}).ok());
  w = b.tuning->winner(*family, problem, h100(), jit::AutotuneMode::off);
  ASSERT_TRUE(w.ok());
  EXPECT_FALSE(w->has_value());
  EXPECT_EQ(b.tier->counters().rejected, 1);

  // A valid record moved under this name: its tag binds the name it was written under.
  const cache::TuningRecord elsewhere = tuned_on(other);
  remote::share_winner(*a.tier, elsewhere);
  ASSERT_TRUE(a.tier->flush(5s));
  auto moved = redis->command(
      {"GET", "kiln:v1:" + remote::tuning_name(elsewhere.family, elsewhere.signature, elsewhere.setup)});
  ASSERT_TRUE(moved.ok());
  ASSERT_TRUE(redis->command({"SET", name, moved->text}).ok());
  w = b.tuning->winner(*family, problem, h100(), jit::AutotuneMode::off);
  ASSERT_TRUE(w.ok());
  EXPECT_FALSE(w->has_value());
  EXPECT_EQ(b.tier->counters().rejected, 2);
  auto none = cache::TuningTable::open(*b.store).value()->list();
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty()) << "nothing unverified was kept";

  cache::TuningRecord no_winner = rec;
  no_winner.winner.clear();
  remote::share_winner(*a.tier, no_winner);
  ASSERT_TRUE(a.tier->flush(5s));
  EXPECT_EQ(a.tier->counters().writes, 2) << "a run without a winner is not shared";
}

TEST_F(EmbeddedTuning, RedisDownCostsTheWinnerNotTheCall) {
  CacheHost b(tmp.path() / "b.sqlite", config);
  redis->kill();
  auto w = b.tuning->winner(*family, problem, h100(), jit::AutotuneMode::off);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_FALSE(w->has_value());
  EXPECT_FALSE(b.tier->counters().up);
}

}  // namespace
}  // namespace kiln::testing
