// docs/reliability.md, item 16: a size cap with LRU eviction by last use, pinned entries,
// `kiln evict` and `kiln stats`; and the schema step 1 -> 2 that added pinning.
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "common/sha256.h"
#include "kiln/family.h"
#include "tests/reliability/rel_util.h"

namespace kiln::testing {
namespace {

cache::Entry fake_entry(int i, std::size_t bytes) {
  cache::Entry e;
  e.key = sha256_hex("bounded-" + std::to_string(i));
  e.family = "rmsnorm";
  e.family_version = 1;
  e.params = "block=64,dtype=f32,vec=" + std::to_string(i);
  e.arch = "sm_90a";
  e.toolchain = std::string(64, 'a');
  e.key_text = "test " + std::to_string(i);
  e.cubin.assign(bytes, char('A' + i % 26));
  e.lowered_name = "k" + std::to_string(i);
  return e;
}

std::set<int> present(cache::Store& s, int n) {
  std::set<int> out;
  for (int i = 0; i < n; ++i) {
    auto e = s.show(fake_entry(i, 1).key);
    if (e.ok() && e->has_value()) out.insert(i);
  }
  return out;
}

void tick() { std::this_thread::sleep_for(std::chrono::milliseconds(3)); }

TEST(BoundedCache, CapEvictsLeastRecentlyUsedAndNeverPinned) {
  TempDir dir;
  auto store = cache::Store::open(dir.path() / "kernels.sqlite");
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  cache::Store& s = **store;
  constexpr std::size_t kb100 = 100 * 1024;
  s.set_max_bytes(5 * kb100);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(s.put(fake_entry(i, kb100)).ok());
    tick();
  }
  EXPECT_EQ(present(s, 5), (std::set<int>{0, 1, 2, 3, 4}));
  // Using 0 makes 1 the least recently used: the next store evicts 1, not 0.
  ASSERT_TRUE(s.get(fake_entry(0, 1).key)->has_value());
  tick();
  ASSERT_TRUE(s.put(fake_entry(5, kb100)).ok());
  tick();
  EXPECT_EQ(present(s, 6), (std::set<int>{0, 2, 3, 4, 5}));
  // Pinned 2 survives although it is now the oldest; 3 and 4 go instead.
  ASSERT_TRUE(s.pin(fake_entry(2, 1).key).ok());
  for (int i = 6; i < 8; ++i) {
    ASSERT_TRUE(s.put(fake_entry(i, kb100)).ok());
    tick();
  }
  EXPECT_EQ(present(s, 8), (std::set<int>{0, 2, 5, 6, 7}));
  auto st = s.stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->evictions, 3);
  EXPECT_EQ(st->bytes, std::int64_t(5 * kb100));
  EXPECT_EQ(st->pinned_entries, 1);
  EXPECT_EQ(st->pinned_bytes, std::int64_t(kb100));
  // Re-storing a pinned key keeps it pinned.
  ASSERT_TRUE(s.put(fake_entry(2, kb100)).ok());
  EXPECT_EQ(s.stats()->pinned_entries, 1);
  // Evicting to zero leaves only the pinned entry.
  auto r = s.evict_to(0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->evicted_keys.size(), 4u);
  EXPECT_EQ(r->bytes_after, std::int64_t(kb100));
  EXPECT_EQ(present(s, 8), (std::set<int>{2}));
  EXPECT_EQ(s.pin(sha256_hex("no such key")).code(), Code::not_found);
  EXPECT_FALSE(s.evict_to(-1).ok());
}

TEST(BoundedCache, MalformedCapIsAClearError) {
  TempDir dir;
  ScopedEnv cap("KILN_CACHE_MAX_MB", "12abc");
  auto store = cache::Store::open(dir.path() / "kernels.sqlite");
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), Code::invalid_argument);
  EXPECT_NE(store.status().message().find("KILN_CACHE_MAX_MB"), std::string::npos);
}

TEST(BoundedCache, VersionOneFilesMigrateAndKeepTheirEntries) {
  TempDir dir;
  const fs::path file = dir.path() / "kernels.sqlite";
  const cache::Entry e = fake_entry(1, 1000);
  {
    RawDb db(file);
    db.exec("CREATE TABLE kernels ("
            " key TEXT PRIMARY KEY, family TEXT NOT NULL, family_version INTEGER NOT NULL,"
            " params TEXT NOT NULL, arch TEXT NOT NULL, toolchain TEXT NOT NULL, key_text TEXT NOT NULL,"
            " cubin BLOB NOT NULL, size INTEGER NOT NULL, checksum TEXT NOT NULL,"
            " lowered_name TEXT NOT NULL, compile_log TEXT NOT NULL, compile_ms REAL NOT NULL,"
            " registers INTEGER NOT NULL, shared_bytes INTEGER NOT NULL, spill_bytes INTEGER NOT NULL,"
            " created INTEGER NOT NULL, last_used INTEGER NOT NULL, hits INTEGER NOT NULL);"
            "CREATE INDEX kernels_family_arch ON kernels(family, arch);"
            "CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);"
            "PRAGMA user_version = 1;");
    db.exec("INSERT INTO kernels VALUES('" + e.key + "','rmsnorm',1,'p','sm_90a','" + e.toolchain +
            "','t',x'00',1000,'" + sha256_hex(e.cubin) + "','k','',1.0,-1,-1,-1,1700000000,1700000000,0)");
    db.set_blob(e.key, e.cubin);
  }
  auto store = cache::Store::open(file);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  auto got = (*store)->get(e.key);
  ASSERT_TRUE(got.ok() && got->has_value()) << (got.ok() ? "miss" : got.status().to_string());
  EXPECT_EQ((*got)->cubin, e.cubin);
  EXPECT_FALSE((*got)->pinned);
  ASSERT_TRUE((*store)->pin(e.key).ok());
  EXPECT_EQ((*store)->stats()->pinned_entries, 1);
  RawDb db(file);
  sqlite3_stmt* v = nullptr;
  sqlite3_prepare_v2(db.get(), "PRAGMA user_version", -1, &v, nullptr);
  ASSERT_EQ(sqlite3_step(v), SQLITE_ROW);
  EXPECT_EQ(sqlite3_column_int(v, 0), cache::k_schema_version);
  sqlite3_finalize(v);
}

// Runs the kiln CLI with KILN_CACHE_DIR set; {exit code, stdout+stderr}.
std::pair<int, std::string> kiln(const fs::path& cache_dir, const std::string& args, const fs::path& out) {
  const std::string cmd = "KILN_CACHE_DIR='" + cache_dir.string() + "' KILN_SOCKET='" + (cache_dir / "none.sock").string() +
                          "' '" KILN_CLI_PATH "' " + args + " > '" + out.string() + "' 2>&1";
  int st = std::system(cmd.c_str());
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, Kilnd::read_file(out)};
}

TEST(BoundedCache, PrewarmPinsAndKilnEvictAndStatsShowIt) {
  TempDir dir;
  const fs::path cache_dir = dir.path() / "cache";
  const fs::path out = dir.path() / "out.txt";
  // The family's whole catalog pinned, then the same unpinned for another arch.
  const std::size_t n = kiln::Registry::global().find("rmsnorm_bwd_reduce")->catalog().size();
  ASSERT_GT(n, 1u);
  const std::string all = std::to_string(n);
  auto [c1, o1] = kiln(cache_dir, "--embedded prewarm --arch sm_80 --family rmsnorm_bwd_reduce --pin", out);
  ASSERT_EQ(c1, 0) << o1;
  EXPECT_NE(o1.find("pinned " + all + " of " + all), std::string::npos) << o1;
  auto [c2, o2] = kiln(cache_dir, "--embedded prewarm --arch sm_86 --family rmsnorm_bwd_reduce", out);
  ASSERT_EQ(c2, 0) << o2;
  auto [c3, o3] = kiln(cache_dir, "--embedded evict --all --json", out);
  ASSERT_EQ(c3, 0) << o3;
  auto j = nlohmann::json::parse(o3.substr(o3.find('{')));
  EXPECT_EQ(j["evicted"].size(), n) << o3;
  EXPECT_EQ(j["entries"], n);
  EXPECT_EQ(j["pinned_entries"], n);
  auto [c4, o4] = kiln(cache_dir, "--embedded stats --json", out);
  ASSERT_EQ(c4, 0) << o4;
  auto s = nlohmann::json::parse(o4.substr(o4.find('{')));
  EXPECT_EQ(s["cache"]["evictions"], n) << o4;
  EXPECT_EQ(s["cache"]["pinned_entries"], n) << o4;
  auto [c5, o5] = kiln(cache_dir, "--embedded stats", out);
  EXPECT_NE(o5.find("evictions"), std::string::npos) << o5;
  EXPECT_NE(o5.find(all + " entries"), std::string::npos) << o5;
  // Unpin one (by a key prefix), then evict to zero: exactly that one goes.
  RawDb db(cache_dir / "kernels.sqlite");
  const std::string key = db.keys().front();
  auto [c6, o6] = kiln(cache_dir, "--embedded evict --unpin " + key.substr(0, 12), out);
  ASSERT_EQ(c6, 0) << o6;
  auto [c7, o7] = kiln(cache_dir, "--embedded evict --max-mb 0", out);
  ASSERT_EQ(c7, 0) << o7;
  EXPECT_NE(o7.find("evicted  " + key), std::string::npos) << o7;
  EXPECT_NE(o7.find("evicted 1 entries"), std::string::npos) << o7;
  auto [c8, o8] = kiln(cache_dir, "--embedded evict --unpin 0123456789abcdef", out);
  EXPECT_NE(c8, 0) << o8;
  auto [c9, o9] = kiln(cache_dir, "--embedded evict --all --max-mb 3", out);
  EXPECT_NE(c9, 0) << o9;
}

}  // namespace
}  // namespace kiln::testing
