// The tuning table on a real SQLite file: round trips, the staleness rules (every setup field
// must match), replacement, refusal of records without a working winner, migration of an older
// cache file, and the tie-break that picks winners.
#include <sqlite3.h>

#include <gtest/gtest.h>

#include "cache/store.h"
#include "cache/tuning.h"
#include "jit/autotune.h"
#include "tests/test_util.h"

namespace kiln::cache {
namespace {

using testing::TempDir;

Setup h100() { return Setup{"sm_90a", "NVIDIA H100 80GB HBM3", "580.65.06 cuda 13000", "abc123"}; }

TuningRecord record(const std::string& signature, const std::string& winner, double ms) {
  TuningRecord r;
  r.family = "rmsnorm";
  r.signature = signature;
  r.setup = h100();
  r.winner = winner;
  r.winner_ms = ms;
  r.heuristic = "block=256,bulk=0,dtype=bf16,row=0,vec=4";
  r.heuristic_ms = ms * 1.2;
  r.noise_band = 0.03;
  r.problem = "rows=4096,cols=4096";
  r.candidates = {{winner, CandidateStatus::ok, ms, 0.01, 20, ""},
                  {"block=256,bulk=0,dtype=bf16,row=0,vec=4", CandidateStatus::ok, ms * 1.2, 0.02, 20, ""},
                  {"block=64,bulk=0,dtype=bf16,row=0,vec=8", CandidateStatus::wrong_result, -1, 0, 0, "output y: relative L2 error NaN"}};
  return r;
}

struct Opened {
  std::unique_ptr<Store> store;
  std::unique_ptr<TuningTable> table;
};

Opened open_in(const TempDir& dir) {
  Opened o;
  o.store = Store::open(dir.path() / "k.sqlite").value();
  auto t = TuningTable::open(*o.store);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  o.table = std::move(t).value();
  return o;
}

TEST(TuningTable, RoundTripsEveryField) {
  TempDir dir;
  auto o = open_in(dir);
  const auto in = record("sig-a", "block=128,bulk=0,dtype=bf16,row=0,vec=4", 0.0123);
  ASSERT_TRUE(o.table->put(in).ok());
  auto got = o.table->lookup("rmsnorm", "sig-a", h100());
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  ASSERT_TRUE(got->has_value());
  const TuningRecord& r = **got;
  EXPECT_EQ(r.winner, in.winner);
  EXPECT_DOUBLE_EQ(r.winner_ms, in.winner_ms);
  EXPECT_EQ(r.heuristic, in.heuristic);
  EXPECT_DOUBLE_EQ(r.heuristic_ms, in.heuristic_ms);
  EXPECT_EQ(r.setup, in.setup);
  EXPECT_EQ(r.problem, in.problem);
  EXPECT_GT(r.created, 0);
  ASSERT_EQ(r.candidates.size(), 3u);
  EXPECT_EQ(r.candidates[2].status, CandidateStatus::wrong_result);
  EXPECT_EQ(r.candidates[2].error, "output y: relative L2 error NaN");
  EXPECT_EQ(r.candidates[1].launches, 20);
}

TEST(TuningTable, PersistsAcrossOpens) {
  TempDir dir;
  {
    auto o = open_in(dir);
    ASSERT_TRUE(o.table->put(record("sig-a", "block=128,bulk=0,dtype=bf16,row=0,vec=4", 0.01)).ok());
  }
  auto o = open_in(dir);
  auto got = o.table->lookup("rmsnorm", "sig-a", h100());
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(got->has_value());
}

TEST(TuningTable, AnotherGpuDriverOrToolchainNeverMatches) {
  TempDir dir;
  auto o = open_in(dir);
  ASSERT_TRUE(o.table->put(record("sig-a", "block=128,bulk=0,dtype=bf16,row=0,vec=4", 0.01)).ok());
  std::vector<cache::Setup> others;
  for (int field = 0; field < 4; ++field) {
    cache::Setup s = h100();
    (field == 0 ? s.arch : field == 1 ? s.device_name : field == 2 ? s.driver_version : s.toolchain) += "x";
    others.push_back(s);
  }
  others.push_back(cache::Setup{"sm_90a", "NVIDIA H200", h100().driver_version, h100().toolchain});
  others.push_back(cache::Setup{"sm_90a", h100().device_name, "580.95.05 cuda 13000", h100().toolchain});
  for (const cache::Setup& s : others) {
    auto got = o.table->lookup("rmsnorm", "sig-a", s);
    ASSERT_TRUE(got.ok());
    EXPECT_FALSE(got->has_value()) << s.arch << " | " << s.device_name << " | " << s.driver_version << " | "
                                   << s.toolchain;
  }
  // Nor another family or signature.
  EXPECT_FALSE(o.table->lookup("act_and_mul", "sig-a", h100())->has_value());
  EXPECT_FALSE(o.table->lookup("rmsnorm", "sig-b", h100())->has_value());
  // The stale row is still listed (for `kiln ls --tuned`), and a new setup gets its own row.
  cache::Setup h200 = others[4];
  TuningRecord r = record("sig-a", "block=512,bulk=0,dtype=bf16,row=0,vec=8", 0.009);
  r.setup = h200;
  ASSERT_TRUE(o.table->put(r).ok());
  EXPECT_EQ(o.table->list()->size(), 2u);
  EXPECT_EQ((*o.table->lookup("rmsnorm", "sig-a", h200))->winner, "block=512,bulk=0,dtype=bf16,row=0,vec=8");
  EXPECT_EQ((*o.table->lookup("rmsnorm", "sig-a", h100()))->winner, "block=128,bulk=0,dtype=bf16,row=0,vec=4");
}

TEST(TuningTable, ANewResultReplacesTheOldOneForTheSameSetup) {
  TempDir dir;
  auto o = open_in(dir);
  ASSERT_TRUE(o.table->put(record("sig-a", "block=128,bulk=0,dtype=bf16,row=0,vec=4", 0.01)).ok());
  ASSERT_TRUE(o.table->put(record("sig-a", "block=1024,bulk=0,dtype=bf16,row=0,vec=2", 0.008)).ok());
  EXPECT_EQ(o.table->list()->size(), 1u);
  EXPECT_EQ((*o.table->lookup("rmsnorm", "sig-a", h100()))->winner, "block=1024,bulk=0,dtype=bf16,row=0,vec=2");
}

TEST(TuningTable, RefusesAWinnerThatDidNotRunOk) {
  TempDir dir;
  auto o = open_in(dir);
  TuningRecord bad = record("sig-a", "block=64,bulk=0,dtype=bf16,row=0,vec=8", 0.01);
  bad.candidates.erase(bad.candidates.begin());  // the winner is now only the wrong_result entry
  Status s = o.table->put(bad);
  EXPECT_EQ(s.code(), Code::invalid_argument);
  TuningRecord none = record("sig-a", "", 0.01);
  EXPECT_EQ(o.table->put(none).code(), Code::invalid_argument);
  EXPECT_TRUE(o.table->list()->empty());
}

TEST(TuningTable, ListFiltersByFamilyAndArch) {
  TempDir dir;
  auto o = open_in(dir);
  ASSERT_TRUE(o.table->put(record("sig-a", "block=128,bulk=0,dtype=bf16,row=0,vec=4", 0.01)).ok());
  TuningRecord other = record("sig-b", "block=128,bulk=0,dtype=bf16,row=0,vec=4", 0.01);
  other.family = "act_and_mul";
  other.setup.arch = "sm_80";
  ASSERT_TRUE(o.table->put(other).ok());
  EXPECT_EQ(o.table->list({"rmsnorm", ""})->size(), 1u);
  EXPECT_EQ(o.table->list({"", "sm_80"})->size(), 1u);
  EXPECT_EQ(o.table->list({"rmsnorm", "sm_80"})->size(), 0u);
  EXPECT_EQ(o.table->list()->size(), 2u);
}

TEST(TuningTable, AVersionOneCacheIsMigratedAndKeepsItsKernels) {
  TempDir dir;
  const auto file = dir.path() / "old.sqlite";
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(file.c_str(), &db), SQLITE_OK);
    // The version-1 schema as the first kiln wrote it.
    const char* sql =
        "CREATE TABLE kernels ( key TEXT PRIMARY KEY, family TEXT NOT NULL, family_version INTEGER NOT NULL,"
        " params TEXT NOT NULL, arch TEXT NOT NULL, toolchain TEXT NOT NULL, key_text TEXT NOT NULL,"
        " cubin BLOB NOT NULL, size INTEGER NOT NULL, checksum TEXT NOT NULL, lowered_name TEXT NOT NULL,"
        " compile_log TEXT NOT NULL, compile_ms REAL NOT NULL, registers INTEGER NOT NULL,"
        " shared_bytes INTEGER NOT NULL, spill_bytes INTEGER NOT NULL, created INTEGER NOT NULL,"
        " last_used INTEGER NOT NULL, hits INTEGER NOT NULL);"
        "CREATE INDEX kernels_family_arch ON kernels(family, arch);"
        "CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);"
        "INSERT INTO kernels VALUES('k1','rmsnorm',2,'block=64,bulk=0,dtype=f32,row=0,vec=1','sm_80','t','text',x'00',1,"
        "'c','n','',1.0,-1,-1,-1,1,1,0);"
        "PRAGMA user_version = 1;";
    ASSERT_EQ(sqlite3_exec(db, sql, nullptr, nullptr, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
    sqlite3_close(db);
  }
  auto store = Store::open(file);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_EQ((*store)->list()->size(), 1u);
  auto table = TuningTable::open(**store);
  ASSERT_TRUE(table.ok()) << table.status().to_string();
  EXPECT_TRUE((*table)->put(record("sig-a", "block=128,bulk=0,dtype=bf16,row=0,vec=4", 0.01)).ok());
}

// ---- the tie-break (jit::rank_candidates) ----

CandidateResult ok(const std::string& p, double ms) { return {p, CandidateStatus::ok, ms, 0, 10, ""}; }
CandidateResult failed(const std::string& p, CandidateStatus s) { return {p, s, -1, 0, 0, "x"}; }

TEST(TieBreak, FastestWinsOutsideTheBand) {
  std::vector<CandidateResult> c = {ok("b", 0.100), ok("a", 0.050), ok("h", 0.060)};
  EXPECT_EQ(jit::rank_candidates(c, "h", 0.03, 0.0005), "a");
  EXPECT_EQ(c[0].params, "a");
  EXPECT_EQ(c[1].params, "h");
  EXPECT_EQ(c[2].params, "b");
}

TEST(TieBreak, TheHeuristicWinsATie) {
  std::vector<CandidateResult> c = {ok("a", 0.0500), ok("h", 0.0505), ok("z", 0.0495)};
  EXPECT_EQ(jit::rank_candidates(c, "h", 0.03, 0.0005), "h");
}

TEST(TieBreak, WithoutTheHeuristicTheSmallestSpecWinsATie) {
  std::vector<CandidateResult> c = {ok("block=512", 0.0500), ok("block=1024", 0.0510), ok("block=64", 0.0600)};
  EXPECT_EQ(jit::rank_candidates(c, "block=64", 0.03, 0.0005), "block=1024");
  // Same times in another order: same winner.
  std::vector<CandidateResult> d = {ok("block=64", 0.0600), ok("block=1024", 0.0510), ok("block=512", 0.0500)};
  EXPECT_EQ(jit::rank_candidates(d, "block=64", 0.03, 0.0005), "block=1024");
}

TEST(TieBreak, TheAbsoluteFloorCoversTinyKernels) {
  // 2.0 vs 2.4 us: 20 % apart, but within the 0.5 us floor.
  std::vector<CandidateResult> c = {ok("a", 0.0020), ok("h", 0.0024)};
  EXPECT_EQ(jit::rank_candidates(c, "h", 0.03, 0.0005), "h");
  std::vector<CandidateResult> d = {ok("a", 0.0020), ok("h", 0.0026)};
  EXPECT_EQ(jit::rank_candidates(d, "h", 0.03, 0.0005), "a");
}

TEST(TieBreak, FailedCandidatesNeverWinAndRankLast) {
  std::vector<CandidateResult> c = {failed("a", CandidateStatus::wrong_result), ok("h", 0.5),
                                    failed("b", CandidateStatus::compile_failed)};
  EXPECT_EQ(jit::rank_candidates(c, "a", 0.03, 0.0005), "h");
  EXPECT_EQ(c[0].params, "h");
  EXPECT_EQ(c[1].status, CandidateStatus::compile_failed);
  EXPECT_EQ(c[2].status, CandidateStatus::wrong_result);
  std::vector<CandidateResult> none = {failed("a", CandidateStatus::launch_failed)};
  EXPECT_EQ(jit::rank_candidates(none, "a", 0.03, 0.0005), "");
}

}  // namespace
}  // namespace kiln::cache
