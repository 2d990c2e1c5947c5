// docs/reliability.md, items 2 and 13: corrupt, truncated, mismatched and foreign cache rows are
// detected before their bytes leave the store, served as misses, recompiled and counted.
#include <gtest/gtest.h>

#include <fstream>

#include "common/sha256.h"
#include "tests/reliability/rel_util.h"

namespace kiln::testing {
namespace {

struct Filled {
  std::vector<KernelSpec> specs;
  std::map<std::string, std::string> checksum_by_key;  // what an honest compile produces
  std::map<std::string, std::string> key_by_spec;
};

// Compiles `n` variants through a daemon on env's cache, then stops the daemon.
Filled fill(const DaemonEnv& env, int n) {
  Filled f;
  f.specs = spec_pool(n);
  auto k = env.start();
  EXPECT_TRUE(k);
  if (!k) return f;
  auto c = client::DaemonClient::connect(env.socket());
  EXPECT_TRUE(c.ok());
  for (const auto& s : f.specs) {
    auto r = (*c)->get_kernel(s, "sm_90a");
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) continue;
    f.checksum_by_key[r->entry.key] = r->entry.checksum;
    f.key_by_spec[s.canonical()] = r->entry.key;
  }
  EXPECT_TRUE((*c)->shutdown().ok());
  EXPECT_EQ(k->wait_exit(), 0);
  return f;
}

// Serves every spec again and checks that each reply is the honest kernel, recompiled.
void expect_recompiled(const DaemonEnv& env, const Filled& f, std::int64_t corrupt_expected) {
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  for (const auto& s : f.specs) {
    auto r = (*c)->get_kernel(s, "sm_90a");
    ASSERT_TRUE(r.ok()) << s.canonical() << ": " << r.status().to_string();
    EXPECT_EQ(r->source, jit::ArtifactSource::compiled) << s.canonical();
    EXPECT_EQ(sha256_hex(r->entry.cubin), f.checksum_by_key.at(r->entry.key)) << s.canonical();
  }
  auto st = stats_of(env.socket());
  EXPECT_EQ(st["builder"]["compiles"], std::int64_t(f.specs.size())) << st.dump();
  EXPECT_EQ(st["cache"]["corrupt"], corrupt_expected) << st.dump();
}

TEST(Corruption, FlippedAndTruncatedBlobsAndBadMetadataAreMissesRecompiledAndCounted) {
  DaemonEnv env;
  const int n = 8;
  Filled f = fill(env, n);
  ASSERT_EQ(int(f.checksum_by_key.size()), n);
  {
    RawDb db(cache_file_of(env));
    auto keys = db.keys();
    ASSERT_EQ(int(keys.size()), n);
    for (int i = 0; i < n; ++i) {
      const std::string& key = keys[i];
      std::string blob = db.blob(key);
      ASSERT_FALSE(blob.empty());
      switch (i % 6) {
        case 0:  // one flipped bit anywhere in the cubin
          blob[uniform(0, int(blob.size()) - 1)] ^= char(1 << uniform(0, 7));
          db.set_blob(key, blob);
          break;
        case 1:  // truncated at a random length
          db.set_blob(key, blob.substr(0, uniform(0, int(blob.size()) - 1)));
          break;
        case 2:  // emptied
          db.set_blob(key, "");
          break;
        case 3:  // size column lies
          db.exec("UPDATE kernels SET size = size + 1 WHERE key = '" + key + "'");
          break;
        case 4:  // checksum column damaged
          db.set_text(key, "checksum", std::string(64, '0'));
          break;
        case 5:  // another row's (valid) cubin under this key
          db.set_blob(key, db.blob(keys[(i + 1) % n]));
          break;
      }
    }
  }
  expect_recompiled(env, f, n);
  expect_cache_sound(cache_file_of(env), "after recompiling");
}

TEST(Corruption, RowsForAnotherArchOrToolchainUnderTheKeyAreMisses) {
  // A key hashes arch and toolchain, so an honest cache never holds such a row; a tampered (or
  // colliding) one must still not be served for the wrong target.
  DaemonEnv env;
  Filled f = fill(env, 2);
  ASSERT_EQ(f.checksum_by_key.size(), 2u);
  {
    RawDb db(cache_file_of(env));
    auto keys = db.keys();
    db.set_text(keys[0], "arch", "sm_80");
    db.set_text(keys[1], "toolchain", std::string(64, 'f'));
  }
  expect_recompiled(env, f, 2);
}

TEST(Corruption, EntriesOfOtherArchsAreNotReused) {
  DaemonEnv env;
  Filled f = fill(env, 1);
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  auto r = (*c)->get_kernel(f.specs[0], "sm_80");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->source, jit::ArtifactSource::compiled);
  EXPECT_EQ(r->entry.arch, "sm_80");
  EXPECT_NE(r->entry.key, f.key_by_spec.at(f.specs[0].canonical()));
}

TEST(Corruption, DamagedDatabasePagesNeverYieldWrongBytes) {
  // Bytes flipped in the SQLite file itself (not through SQL): whatever SQLite makes of it, every
  // request is answered with the honest kernel or a clear error, never with other bytes.
  DaemonEnv env;
  const int n = 6;
  Filled f = fill(env, n);
  ASSERT_EQ(int(f.checksum_by_key.size()), n);
  const fs::path file = cache_file_of(env);
  const auto size = fs::file_size(file);
  ASSERT_GT(size, 8192u);
  {
    std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
    for (int i = 0; i < 40; ++i) {
      // Past the 100-byte file header, so the file is still recognised as a database.
      const auto off = std::streamoff(uniform(100, int(size) - 1));
      char b = 0;
      io.seekg(off);
      io.read(&b, 1);
      b = char(b ^ (1 << uniform(0, 7)));
      io.seekp(off);
      io.write(&b, 1);
    }
  }
  // kilnd serves either from the damaged file or, when SQLite cannot read it as a database, from a
  // fresh one after moving it aside (logged).
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  int served = 0;
  for (const auto& s : f.specs) {
    auto r = (*c)->get_kernel(s, "sm_90a");
    if (!r.ok()) continue;
    ++served;
    EXPECT_EQ(sha256_hex(r->entry.cubin), f.checksum_by_key.at(r->entry.key)) << s.canonical();
  }
  // A lookup that fails is treated as a miss and compiled: every request is served.
  EXPECT_EQ(served, n) << k->log();
}

TEST(Corruption, AFileThatIsNotADatabaseIsMovedAsideAndTheDaemonServes) {
  DaemonEnv env;
  const fs::path file = cache_file_of(env);
  std::ofstream(file, std::ios::binary) << std::string(64 * 1024, '\x5a');
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  auto r = (*c)->get_kernel(spec_pool(1)[0], "sm_90a");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_NE(k->log().find("was damaged; moved it to"), std::string::npos) << k->log();
  int aside = 0;
  for (const auto& e : fs::directory_iterator(env.cache_dir()))
    if (e.path().filename().string().rfind("kernels.sqlite.corrupt-", 0) == 0) ++aside;
  EXPECT_EQ(aside, 1);
  EXPECT_EQ(stats_of(env.socket())["cache"]["entries"], 1);
}

}  // namespace
}  // namespace kiln::testing
