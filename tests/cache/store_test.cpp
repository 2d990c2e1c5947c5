#include "cache/store.h"

#include <gtest/gtest.h>
#include <sqlite3.h>

#include "common/sha256.h"
#include "tests/test_util.h"

namespace kiln::cache {
namespace {

Entry make_entry(const std::string& key, const std::string& family = "rmsnorm", const std::string& arch = "sm_90a") {
  Entry e;
  e.key = key;
  e.family = family;
  e.family_version = 1;
  e.params = "block=256,bulk=0,dtype=bf16,row=0,vec=8";
  e.arch = arch;
  e.toolchain = std::string(64, 'c');
  e.key_text = "kiln-key 1\n";
  e.cubin = "\x7f" "ELF" + std::string(1000, 'x') + key;
  e.lowered_name = "_Z3foov";
  e.compile_log = "ptxas info";
  e.compile_ms = 12.5;
  e.registers = 32;
  e.shared_bytes = 132;
  e.spill_bytes = 0;
  return e;
}

std::string key_of(char c) { return std::string(64, c); }

// Runs one SQL statement on the file from outside the Store, as another process would.
void raw_sql(const std::filesystem::path& file, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(file.c_str(), &db), SQLITE_OK);
  char* err = nullptr;
  EXPECT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err), SQLITE_OK) << (err ? err : "");
  sqlite3_free(err);
  sqlite3_close(db);
}

TEST(Store, PutGetRoundTripWithMetadata) {
  testing::TempDir dir;
  auto st = Store::open(dir.path() / "sub" / "k.sqlite");
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  Entry e = make_entry(key_of('a'));
  ASSERT_TRUE((*st)->put(e).ok());
  auto got = (*st)->get(e.key);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  ASSERT_TRUE(got->has_value());
  const Entry& g = **got;
  EXPECT_EQ(g.cubin, e.cubin);
  EXPECT_EQ(g.size, std::int64_t(e.cubin.size()));
  EXPECT_EQ(g.checksum, sha256_hex(e.cubin));
  EXPECT_EQ(g.lowered_name, e.lowered_name);
  EXPECT_EQ(g.registers, 32);
  EXPECT_EQ(g.shared_bytes, 132);
  EXPECT_EQ(g.hits, 1);
  EXPECT_GT(g.created, 0);
  auto miss = (*st)->get(key_of('b'));
  ASSERT_TRUE(miss.ok());
  EXPECT_FALSE(miss->has_value());
  auto stats = (*st)->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->entries, 1);
  EXPECT_EQ(stats->hits, 1);
  EXPECT_EQ(stats->misses, 1);
  EXPECT_EQ(stats->stores, 1);
  EXPECT_EQ(stats->bytes, std::int64_t(e.cubin.size()));
}

TEST(Store, PersistsAcrossOpensAndUsesWal) {
  testing::TempDir dir;
  auto file = dir.path() / "k.sqlite";
  {
    auto st = Store::open(file);
    ASSERT_TRUE(st.ok());
    ASSERT_TRUE((*st)->put(make_entry(key_of('a'))).ok());
  }
  auto st = Store::open(file);
  ASSERT_TRUE(st.ok());
  auto got = (*st)->get(key_of('a'));
  ASSERT_TRUE(got.ok() && got->has_value());
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(file.c_str(), &db), SQLITE_OK);
  sqlite3_stmt* s = nullptr;
  sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &s, nullptr);
  ASSERT_EQ(sqlite3_step(s), SQLITE_ROW);
  EXPECT_STREQ(reinterpret_cast<const char*>(sqlite3_column_text(s, 0)), "wal");
  sqlite3_finalize(s);
  sqlite3_prepare_v2(db, "PRAGMA user_version", -1, &s, nullptr);
  ASSERT_EQ(sqlite3_step(s), SQLITE_ROW);
  EXPECT_EQ(sqlite3_column_int(s, 0), k_schema_version);
  sqlite3_finalize(s);
  sqlite3_close(db);
}

TEST(Store, FlippedByteIsAMissDroppedAndCounted) {
  testing::TempDir dir;
  auto file = dir.path() / "k.sqlite";
  auto st = Store::open(file);
  ASSERT_TRUE(st.ok());
  ASSERT_TRUE((*st)->put(make_entry(key_of('a'))).ok());
  // Flip one byte in the middle of the stored blob.
  raw_sql(file, "UPDATE kernels SET cubin = substr(cubin, 1, 500) || x'00' || substr(cubin, 502) WHERE key = '" +
                    key_of('a') + "'");
  auto got = (*st)->get(key_of('a'));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_FALSE(got->has_value());
  auto stats = (*st)->stats();
  EXPECT_EQ(stats->corrupt, 1);
  EXPECT_EQ(stats->entries, 0);  // dropped, so the next request recompiles and stores afresh
  ASSERT_TRUE((*st)->put(make_entry(key_of('a'))).ok());
  auto again = (*st)->get(key_of('a'));
  ASSERT_TRUE(again.ok() && again->has_value());
}

TEST(Store, TruncatedBlobAndWrongSizeAreMisses) {
  testing::TempDir dir;
  auto file = dir.path() / "k.sqlite";
  auto st = Store::open(file);
  ASSERT_TRUE((*st)->put(make_entry(key_of('a'))).ok());
  ASSERT_TRUE((*st)->put(make_entry(key_of('b'))).ok());
  raw_sql(file, "UPDATE kernels SET cubin = substr(cubin, 1, 100) WHERE key = '" + key_of('a') + "'");
  raw_sql(file, "UPDATE kernels SET size = size + 1 WHERE key = '" + key_of('b') + "'");
  EXPECT_FALSE((*st)->get(key_of('a'))->has_value());
  EXPECT_FALSE((*st)->get(key_of('b'))->has_value());
  EXPECT_EQ((*st)->stats()->corrupt, 2);
}

TEST(Store, VerifySweepsAndDropsBadRows) {
  testing::TempDir dir;
  auto file = dir.path() / "k.sqlite";
  auto st = Store::open(file);
  for (char c : {'a', 'b', 'c'}) ASSERT_TRUE((*st)->put(make_entry(key_of(c))).ok());
  raw_sql(file, "UPDATE kernels SET checksum = '" + std::string(64, '0') + "' WHERE key = '" + key_of('b') + "'");
  auto r = (*st)->verify();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->integrity, "ok");
  EXPECT_EQ(r->checked, 3);
  ASSERT_EQ(r->bad_keys.size(), 1u);
  EXPECT_EQ(r->bad_keys[0], key_of('b'));
  EXPECT_EQ((*st)->stats()->entries, 2);
  auto clean = (*st)->verify();
  EXPECT_TRUE(clean->bad_keys.empty());
}

TEST(Store, ListFiltersAndShowAcceptsPrefixes) {
  testing::TempDir dir;
  auto st = Store::open(dir.path() / "k.sqlite");
  ASSERT_TRUE((*st)->put(make_entry("ab" + std::string(62, '1'), "rmsnorm", "sm_90a")).ok());
  ASSERT_TRUE((*st)->put(make_entry("ab" + std::string(62, '2'), "rmsnorm", "sm_80")).ok());
  ASSERT_TRUE((*st)->put(make_entry("cd" + std::string(62, '3'), "other", "sm_80")).ok());
  EXPECT_EQ((*st)->list()->size(), 3u);
  EXPECT_EQ((*st)->list({"rmsnorm", ""})->size(), 2u);
  EXPECT_EQ((*st)->list({"", "sm_80"})->size(), 2u);
  EXPECT_EQ((*st)->list({"rmsnorm", "sm_80"})->size(), 1u);
  EXPECT_TRUE((*st)->list({"rmsnorm", "sm_80"})->at(0).cubin.empty());
  auto one = (*st)->show("cd");
  ASSERT_TRUE(one.ok() && one->has_value());
  EXPECT_EQ((*one)->family, "other");
  EXPECT_FALSE((*one)->cubin.empty());
  EXPECT_EQ((*st)->show("ab").status().code(), Code::invalid_argument);  // ambiguous
  EXPECT_FALSE((*st)->show("ee")->has_value());
  EXPECT_EQ((*st)->show("x' OR 1=1 --").status().code(), Code::invalid_argument);
}

TEST(Store, RefusesNewerSchema) {
  testing::TempDir dir;
  auto file = dir.path() / "k.sqlite";
  { ASSERT_TRUE(Store::open(file).ok()); }
  raw_sql(file, "PRAGMA user_version = 99");
  auto st = Store::open(file);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), Code::io_error);
  EXPECT_NE(st.status().message().find("newer"), std::string::npos);
}

TEST(Store, NotADatabaseIsAnError) {
  testing::TempDir dir;
  auto file = dir.path() / "k.sqlite";
  FILE* f = fopen(file.c_str(), "w");
  fputs("this is not a database, just text that is long enough to be a header ..........................", f);
  fclose(f);
  auto st = Store::open(file);
  EXPECT_FALSE(st.ok());
}

}  // namespace
}  // namespace kiln::cache
