// resolve and tune requests against a real kilnd on a real socket, with the tuning table in its
// real SQLite file. No GPU is needed: the table is filled by the test, and tuning without a GPU
// must fail cleanly (recorded, the daemon keeps serving).
#include <gtest/gtest.h>

#include <thread>

#include "cache/store.h"
#include "cache/tuning.h"
#include "jit/autotune_mode.h"
#include "jit/driver.h"
#include "jit/tuning_setup.h"
#include "tests/daemon/kilnd_harness.h"
#include "tests/stub_family.h"

namespace kiln::testing {
namespace {

const Family& rmsnorm() { return *Registry::global().find("rmsnorm"); }

Problem problem(std::int64_t rows, std::int64_t cols) {
  return rmsnorm().problem_from_shape(DType::bf16, {{"rows", rows}, {"cols", cols}}).value();
}

// A family kilnd does not have: requests for it are refused by name, before its problem is read.
const StubFamily& unregistered() {
  static const StubFamily f("no_such_family");
  return f;
}

client::ResolveTarget target() { return {"sm_90a", "Test GPU 80GB", "999.1.2 cuda 13000", "0000:01:00"}; }

// Writes a tuning record for problem's signature on target()'s setup, as a tuner would.
void store_winner(const fs::path& cache_dir, const Problem& p, const std::string& winner,
                  const std::string& driver = target().driver_version) {
  auto store = cache::Store::open(cache_dir / "kernels.sqlite").value();
  auto table = cache::TuningTable::open(*store).value();
  cache::TuningRecord r;
  r.family = "rmsnorm";
  r.signature = rmsnorm().signature(p);
  r.setup = jit::tuning_setup(rmsnorm(), p, target().arch, target().device_name, driver).value();
  r.winner = winner;
  r.winner_ms = 0.01;
  r.heuristic = rmsnorm().heuristic(p).canonical();
  r.candidates = {{winner, cache::CandidateStatus::ok, 0.01, 0.01, 10, ""}};
  Status s = table->put(r);
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST(KilndResolve, HeuristicUntilTunedThenTheWinnerForEveryClient) {
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  const Problem p = problem(4096, 4096);
  const std::string heuristic = rmsnorm().heuristic(p).canonical();
  const std::string winner = "block=1024,bulk=0,dtype=bf16,row=0,vec=2";
  ASSERT_NE(heuristic, winner);
  ASSERT_TRUE(rmsnorm().check_problem(Params::parse(winner).value(), p).ok());

  auto a = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(a.ok());
  auto before = (*a)->resolve(rmsnorm(), p, target(), jit::AutotuneMode::off);
  ASSERT_TRUE(before.ok()) << before.status().to_string() << "\n" << k->log();
  EXPECT_EQ(before->params.canonical(), heuristic);
  EXPECT_FALSE(before->tuned);
  EXPECT_FALSE(before->queued);
  EXPECT_EQ(before->signature, rmsnorm().signature(p));

  store_winner(env.cache_dir(), p, winner);

  // A second client, and the first one again: both get the winner, for every row count of the bucket.
  auto b = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(b.ok());
  for (auto* c : {b->get(), a->get()})
    for (std::int64_t rows : {4096, 3000, 2049}) {
      auto r = c->resolve(rmsnorm(), problem(rows, 4096), target(), jit::AutotuneMode::off);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_TRUE(r->tuned) << rows;
      EXPECT_EQ(r->params.canonical(), winner) << rows;
    }
  // Outside the bucket, on another driver or another GPU: the heuristic.
  auto other_bucket = (*b)->resolve(rmsnorm(), problem(2048, 4096), target(), jit::AutotuneMode::off);
  ASSERT_TRUE(other_bucket.ok());
  EXPECT_FALSE(other_bucket->tuned);
  auto new_driver = target();
  new_driver.driver_version = "999.2.0 cuda 13000";
  auto stale = (*b)->resolve(rmsnorm(), p, new_driver, jit::AutotuneMode::off);
  ASSERT_TRUE(stale.ok());
  EXPECT_FALSE(stale->tuned);
  EXPECT_EQ(stale->params.canonical(), heuristic);
  auto new_gpu = target();
  new_gpu.device_name = "Test GPU 141GB";
  EXPECT_FALSE((*b)->resolve(rmsnorm(), p, new_gpu, jit::AutotuneMode::off)->tuned);
}

TEST(KilndResolve, AWinnerThatNoLongerValidatesFallsBackToTheHeuristic) {
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  const Problem p = problem(16, 2048);
  store_winner(env.cache_dir(), p, "block=3,bulk=0,dtype=bf16,row=0,vec=2");
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  auto r = (*c)->resolve(rmsnorm(), p, target(), jit::AutotuneMode::off);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_FALSE(r->tuned);
  EXPECT_EQ(r->params.canonical(), rmsnorm().heuristic(p).canonical());
}

TEST(KilndResolve, BadRequestsAreErrorsBeforeAnythingIsQueued) {
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  auto unknown = (*c)->resolve(unregistered(), problem(1, 8), target(), jit::AutotuneMode::background);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), Code::not_found);
  Problem bad = problem(4, 8);
  for (const auto& f : rmsnorm().problem_fields())
    if (f.name == "cols") bad.fields[f.slot].i = 0;
  auto shape = (*c)->resolve(rmsnorm(), bad, target(), jit::AutotuneMode::background);
  ASSERT_FALSE(shape.ok());
  EXPECT_EQ(shape.status().code(), Code::shape_mismatch);
  auto arch = target();
  arch.arch = "sm_9";
  auto bad_arch = (*c)->resolve(rmsnorm(), problem(1, 8), arch, jit::AutotuneMode::off);
  ASSERT_FALSE(bad_arch.ok());
  EXPECT_EQ(bad_arch.status().code(), Code::invalid_argument);
  auto tune = (*c)->tune(rmsnorm(), bad, 0);
  ASSERT_FALSE(tune.ok());
  EXPECT_EQ(tune.status().code(), Code::shape_mismatch);
  EXPECT_TRUE((*c)->ping().ok());
}

// Without a GPU (CI), tuning fails: the failure is an error reply or a note in the log, never a
// dead daemon, and a failed background tuning is not retried for every resolve.
TEST(KilndResolve, TuningWithoutAGpuFailsCleanly) {
  if (jit::current_context().ok()) GTEST_SKIP() << "this machine has a GPU; tests/tune/*_gpu_test.cpp cover tuning";
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  const Problem p = problem(512, 4096);
  auto tune = (*c)->tune(rmsnorm(), p, 0);
  ASSERT_FALSE(tune.ok());
  EXPECT_EQ(tune.status().code(), Code::unavailable) << tune.status().to_string();

  auto wait = (*c)->resolve(rmsnorm(), p, target(), jit::AutotuneMode::wait);
  ASSERT_TRUE(wait.ok()) << wait.status().to_string();
  EXPECT_FALSE(wait->tuned);
  EXPECT_EQ(wait->params.canonical(), rmsnorm().heuristic(p).canonical());

  auto queued = (*c)->resolve(rmsnorm(), p, target(), jit::AutotuneMode::background);
  ASSERT_TRUE(queued.ok());
  EXPECT_TRUE(queued->queued);
  EXPECT_EQ(queued->params.canonical(), rmsnorm().heuristic(p).canonical());
  // The background job fails at once here; after that the signature is not queued again.
  bool settled = false;
  for (int i = 0; i < 200 && !settled; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
    auto again = (*c)->resolve(rmsnorm(), p, target(), jit::AutotuneMode::background);
    ASSERT_TRUE(again.ok());
    settled = !again->queued;
  }
  EXPECT_TRUE(settled) << k->log();
  EXPECT_TRUE(k->running());
  EXPECT_NE(k->log().find("tuning rmsnorm"), std::string::npos) << k->log();
}

TEST(KilndResolve, TheAutotuneFlagQueuesWithoutTheClientAsking) {
  if (jit::current_context().ok()) GTEST_SKIP() << "this machine has a GPU; tests/tune/*_gpu_test.cpp cover tuning";
  DaemonEnv env;
  auto k = env.start({"--jobs", "2", "--autotune"});
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  auto r = (*c)->resolve(rmsnorm(), problem(1, 4096), target(), jit::AutotuneMode::off);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->queued);
  EXPECT_FALSE(r->tuned);
}

}  // namespace
}  // namespace kiln::testing
