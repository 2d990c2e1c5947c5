// End-to-end tests of the `kiln` executable: real processes, a real SQLite file in a temporary
// KILN_CACHE_DIR, real NVRTC compiles and, for the daemon tests, a real kilnd.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sqlite3.h>

#include "kiln/family.h"
#include "tests/cli/sandbox.h"
#include "tests/plugin_util.h"

#ifndef KILN_CLI_PATH
#error "KILN_CLI_PATH must name the built kiln executable"
#endif
#ifndef KILN_KILND_PATH
#error "KILN_KILND_PATH must name the built kilnd executable"
#endif

namespace fs = std::filesystem;
using nlohmann::json;
using kiln::testing::Proc;
using kiln::testing::Sandbox;
using kiln::testing::slurp;

namespace {

constexpr const char* k_arch = "sm_80";

// The canonical params of every rmsnorm catalog variant that runs on k_arch: the oracle for what
// prewarm must produce.
std::set<std::string> rmsnorm_catalog() {
  const kiln::Family* f = kiln::Registry::global().find("rmsnorm");
  if (!f) return {};
  const auto catalog = kiln::catalog_for(*f, k_arch);
  if (!catalog.ok()) return {};
  std::set<std::string> out;
  for (const auto& p : *catalog) out.insert(p.canonical());
  return out;
}

std::set<std::string> listed_params(const json& ls) {
  std::set<std::string> out;
  for (const auto& e : ls) out.insert(e.at("params").get<std::string>());
  return out;
}

bool is_key(const std::string& s) { return std::regex_match(s, std::regex("[0-9a-f]{64}")); }

// Rewrites one row's cubin through the SQLite C API, as a disk or a crash would.
void damage_blob(const fs::path& db_file, const std::string& key, bool truncate) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(db_file.c_str(), &db), SQLITE_OK);
  sqlite3_busy_timeout(db, 5000);
  sqlite3_stmt* sel = nullptr;
  ASSERT_EQ(sqlite3_prepare_v2(db, "SELECT cubin FROM kernels WHERE key = ?1", -1, &sel, nullptr), SQLITE_OK)
      << sqlite3_errmsg(db);
  sqlite3_bind_text(sel, 1, key.c_str(), -1, SQLITE_TRANSIENT);
  ASSERT_EQ(sqlite3_step(sel), SQLITE_ROW) << "no row for " << key;
  std::string blob(static_cast<const char*>(sqlite3_column_blob(sel, 0)), sqlite3_column_bytes(sel, 0));
  sqlite3_finalize(sel);
  ASSERT_GT(blob.size(), 64u);
  if (truncate)
    blob.resize(blob.size() / 2);
  else
    blob[blob.size() / 2] = static_cast<char>(blob[blob.size() / 2] ^ 0x5a);
  sqlite3_stmt* upd = nullptr;
  ASSERT_EQ(sqlite3_prepare_v2(db, "UPDATE kernels SET cubin = ?1 WHERE key = ?2", -1, &upd, nullptr), SQLITE_OK)
      << sqlite3_errmsg(db);
  sqlite3_bind_blob(upd, 1, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
  sqlite3_bind_text(upd, 2, key.c_str(), -1, SQLITE_TRANSIENT);
  ASSERT_EQ(sqlite3_step(upd), SQLITE_DONE) << sqlite3_errmsg(db);
  sqlite3_finalize(upd);
  ASSERT_EQ(sqlite3_changes(db), 1);
  sqlite3_close(db);
}

// One prewarm of the rmsnorm catalog shared by the tests that need a filled cache; each copies
// the resulting cache so that none sees another's changes. Made on first use: ctest runs every
// test in a process of its own, and the tests that need no filled cache should not pay for one.
class CliTest : public ::testing::Test {
 protected:
  static const Proc& golden_run() {
    if (!golden_) {
      golden_ = new Sandbox();
      golden_run_ = new Proc(golden_->kiln({"prewarm", "--arch", k_arch, "--family", "rmsnorm", "--json"}));
    }
    return *golden_run_;
  }
  static void TearDownTestSuite() {
    delete golden_run_;
    delete golden_;
    golden_run_ = nullptr;
    golden_ = nullptr;
  }

  // A sandbox whose cache is a copy of the golden prewarm.
  std::unique_ptr<Sandbox> filled() {
    auto s = std::make_unique<Sandbox>();
    if (golden_run().rc == 0) fs::copy(golden_->cache_dir(), s->cache_dir(), fs::copy_options::recursive);
    return s;
  }

  static Sandbox* golden_;
  static Proc* golden_run_;
};
Sandbox* CliTest::golden_ = nullptr;
Proc* CliTest::golden_run_ = nullptr;

TEST_F(CliTest, PrewarmFillsAnEmptyCacheWithTheWholeCatalog) {
  const auto catalog = rmsnorm_catalog();
  ASSERT_FALSE(catalog.empty()) << "the rmsnorm family is not registered";
  const Proc& r = golden_run();
  ASSERT_EQ(r.rc, 0) << r.all();
  const json j = json::parse(r.out);
  EXPECT_EQ(j.at("via"), "embedded");
  EXPECT_EQ(j.at("requested").get<std::size_t>(), catalog.size());
  EXPECT_EQ(j.at("compiled").get<std::size_t>(), catalog.size());
  EXPECT_EQ(j.at("cached"), 0);
  EXPECT_EQ(j.at("failed"), 0);
  // Progress on stderr: a counter line per variant.
  EXPECT_NE(r.err.find("[1/" + std::to_string(catalog.size()) + "] rmsnorm("), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(" compiled "), std::string::npos) << r.err;

  auto s = filled();
  const json ls = s->kiln_json({"ls", "--json"});
  ASSERT_TRUE(ls.is_array());
  EXPECT_EQ(ls.size(), catalog.size());
  EXPECT_EQ(listed_params(ls), catalog);
  std::set<std::string> keys;
  for (const auto& e : ls) {
    EXPECT_EQ(e.at("family"), "rmsnorm");
    EXPECT_EQ(e.at("arch"), k_arch);
    EXPECT_GT(e.at("size").get<std::int64_t>(), 0);
    EXPECT_TRUE(is_key(e.at("key"))) << e.dump();
    keys.insert(e.at("key"));
  }
  EXPECT_EQ(keys.size(), catalog.size());

  // The table form names each variant by its short key.
  const Proc table = s->kiln({"ls", "--family", "rmsnorm", "--arch", k_arch});
  ASSERT_EQ(table.rc, 0) << table.all();
  EXPECT_NE(table.out.find("KEY"), std::string::npos);
  EXPECT_NE(table.out.find(ls[0].at("key").get<std::string>().substr(0, 12)), std::string::npos) << table.out;
  // A filter that matches nothing is an empty list, not an error.
  const json none = s->kiln_json({"ls", "--arch", "sm_90a", "--json"});
  EXPECT_TRUE(none.is_array() && none.empty()) << none.dump();
}

TEST_F(CliTest, SecondPrewarmFindsEverythingCached) {
  ASSERT_EQ(golden_run().rc, 0) << golden_run().all();
  auto s = filled();
  const auto n = rmsnorm_catalog().size();
  const Proc r = s->kiln({"prewarm", "--arch", k_arch, "--family", "rmsnorm", "--jobs", "1", "--json"});
  ASSERT_EQ(r.rc, 0) << r.all();
  const json j = json::parse(r.out);
  EXPECT_EQ(j.at("requested").get<std::size_t>(), n);
  EXPECT_EQ(j.at("compiled"), 0);
  EXPECT_EQ(j.at("cached").get<std::size_t>(), n);
  EXPECT_EQ(j.at("failed"), 0);
  EXPECT_NE(r.err.find(" cached"), std::string::npos) << r.err;

  // The human summary says the same.
  const Proc text = s->kiln({"prewarm", "--arch", k_arch, "--family", "rmsnorm"});
  ASSERT_EQ(text.rc, 0) << text.all();
  EXPECT_NE(text.out.find(std::to_string(n) + " already cached"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("0 compiled"), std::string::npos) << text.out;
}

// NVRTC's automatic PCH left an 8 MB /tmp/__nvrtc_auto_pch_<pid>_<n> behind every compiling
// process. kiln's own per-process PCH directory goes when the process exits, and the first compile
// of a process removes those of dead processes (pid 999999999 is above any pid_max) but not a
// live one's (pid 1).
TEST_F(CliTest, PrewarmLeavesNoPrecompiledHeadersBehind) {
  Sandbox s;
  const fs::path tmp = s.root() / "tmp";
  fs::create_directories(tmp / "kiln-pch-999999999-dead");
  std::ofstream(tmp / "kiln-pch-999999999-dead" / "kiln_kernel_0.pch") << "stale";
  fs::create_directories(tmp / "kiln-pch-1-live");
  s.set_env("TMPDIR", tmp.string());
  const Proc r = s.kiln({"prewarm", "--arch", k_arch, "--family", "rmsnorm_bwd_reduce", "--jobs", "1"});
  ASSERT_EQ(r.rc, 0) << r.all();
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(tmp)) left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"kiln-pch-1-live"});
}

TEST_F(CliTest, ShowPrintsAllMetadataOfAListedKey) {
  ASSERT_EQ(golden_run().rc, 0) << golden_run().all();
  auto s = filled();
  const json ls = s->kiln_json({"ls", "--json"});
  ASSERT_FALSE(ls.empty());
  const std::string key = ls[0].at("key");
  const std::string params = ls[0].at("params");

  const Proc r = s->kiln({"show", key.substr(0, 12)});
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_NE(r.out.find(key), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rmsnorm(" + params + ")"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(k_arch), std::string::npos);
  EXPECT_NE(r.out.find("key text"), std::string::npos);
  EXPECT_NE(r.out.find("compile log"), std::string::npos);
  EXPECT_NE(r.out.find("integrity"), std::string::npos);

  const json j = s->kiln_json({"show", key, "--json"});
  EXPECT_EQ(j.at("key"), key);
  EXPECT_EQ(j.at("params"), params);
  EXPECT_EQ(j.at("arch"), k_arch);
  EXPECT_TRUE(j.at("intact").get<bool>());
  EXPECT_EQ(j.at("blob_size"), j.at("size"));
  EXPECT_FALSE(j.at("key_text").get<std::string>().empty());
  EXPECT_NE(j.at("key_text").get<std::string>().find("rmsnorm"), std::string::npos);
  EXPECT_FALSE(j.at("lowered_name").get<std::string>().empty());
  EXPECT_TRUE(j.contains("compile_log"));

  // Absent keys are an error (exit 1); malformed ones are bad input (exit 2).
  const Proc missing = s->kiln({"show", "0000000000000000"});
  EXPECT_EQ(missing.rc, 1) << missing.all();
  EXPECT_NE(missing.err.find("kiln: error:"), std::string::npos);
  const Proc bad = s->kiln({"show", "not-a-key"});
  EXPECT_EQ(bad.rc, 2) << bad.all();
  EXPECT_NE(bad.err.find("kiln: error:"), std::string::npos);
}

TEST_F(CliTest, VerifyFindsACorruptBlobAndPrewarmRecompilesIt) {
  ASSERT_EQ(golden_run().rc, 0) << golden_run().all();
  auto s = filled();
  const auto n = rmsnorm_catalog().size();

  int rc = -1;
  json v = s->kiln_json({"verify", "--json"}, &rc);
  EXPECT_EQ(rc, 0) << v.dump();
  EXPECT_EQ(v.at("integrity"), "ok");
  EXPECT_EQ(v.at("checked").get<std::size_t>(), n);
  EXPECT_TRUE(v.at("bad_keys").empty());
  const Proc text_ok = s->kiln({"verify"});
  EXPECT_EQ(text_ok.rc, 0) << text_ok.all();
  EXPECT_NE(text_ok.out.find("verify: ok"), std::string::npos) << text_ok.out;

  const json ls = s->kiln_json({"ls", "--json"});
  ASSERT_GE(ls.size(), 2u);
  const std::string flipped = ls[0].at("key"), truncated = ls[1].at("key");
  damage_blob(s->cache_file(), flipped, /*truncate=*/false);

  const Proc bad = s->kiln({"verify"});
  EXPECT_EQ(bad.rc, 1) << bad.all();
  EXPECT_NE(bad.out.find(flipped), std::string::npos) << bad.out;
  EXPECT_NE(bad.err.find("kiln: error:"), std::string::npos) << bad.err;
  // verify dropped the row: it is gone from the listing until rebuilt.
  EXPECT_EQ(s->kiln_json({"ls", "--json"}).size(), n - 1);

  json re = s->kiln_json({"prewarm", "--arch", k_arch, "--family", "rmsnorm", "--json"}, &rc);
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(re.at("compiled"), 1);
  EXPECT_EQ(re.at("cached").get<std::size_t>(), n - 1);

  // A truncated blob that no verify has seen is caught by prewarm's verified read and rebuilt.
  damage_blob(s->cache_file(), truncated, /*truncate=*/true);
  re = s->kiln_json({"prewarm", "--arch", k_arch, "--family", "rmsnorm", "--json"}, &rc);
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(re.at("compiled"), 1);
  bool rebuilt = false;
  for (const auto& var : re.at("variants"))
    if (var.at("key") == truncated) rebuilt = var.at("result") == "compiled";
  EXPECT_TRUE(rebuilt) << re.dump(2);

  v = s->kiln_json({"verify", "--json"}, &rc);
  EXPECT_EQ(rc, 0) << v.dump();
  EXPECT_EQ(v.at("checked").get<std::size_t>(), n);
  const json st = s->kiln_json({"stats", "--json", "--embedded"});
  EXPECT_GE(st.at("cache").at("corrupt").get<std::int64_t>(), 2) << st.dump(2);
  EXPECT_EQ(st.at("cache").at("entries").get<std::size_t>(), n);
}

TEST_F(CliTest, BadInputExitsTwoAndCompilesNothing) {
  Sandbox s;
  const std::vector<std::vector<std::string>> bad = {
      {"prewarm", "--arch", "sm_9x"},
      {"prewarm", "--arch", "sm_90;rm"},
      {"prewarm", "--arch", "sm_80,sm_9x", "--family", "rmsnorm"},
      {"prewarm", "--arch", "sm_80", "--family", "no_such_family"},
      {"prewarm", "--arch", "sm_80", "--family", "rmsnorm,nope"},
      {"prewarm", "--arch", "sm_80", "--jobs", "0"},
      {"prewarm"},
      {"prewarm", "--arch", "sm_80", "--bogus"},
      {"ls", "--arch", "sm_9x"},
      {"why", "rmsnorm(block=256", "--arch", "sm_80"},
      {"why", "rmsnorm(block=256,bulk=0,dtype=bf16,row=0,vec=8)", "--arch", "90"},
      {"why", "no_such_family(a=1)", "--arch", "sm_80"},
      {},
      {"frobnicate"},
      {"daemon"},
  };
  for (const auto& args : bad) {
    const Proc r = s.kiln(args);
    std::string cmd;
    for (const auto& a : args) cmd += a + " ";
    EXPECT_EQ(r.rc, 2) << cmd << "\n" << r.all();
    EXPECT_NE(r.err.find("kiln: error:"), std::string::npos) << cmd << "\n" << r.all();
    EXPECT_EQ(r.err.find(" compiled "), std::string::npos) << cmd << "\n" << r.all();
  }
  const Proc arch = s.kiln({"prewarm", "--arch", "sm_90;rm"});
  EXPECT_NE(arch.err.find("sm_90;rm"), std::string::npos) << arch.err;
  const Proc fam = s.kiln({"prewarm", "--arch", "sm_80", "--family", "no_such_family"});
  EXPECT_NE(fam.err.find("no_such_family"), std::string::npos) << fam.err;
  EXPECT_NE(fam.err.find("rmsnorm"), std::string::npos) << "should list known families\n" << fam.err;

  // Nothing compiled, nothing stored: the read-only commands do not even create the cache file.
  EXPECT_FALSE(fs::exists(s.cache_file()));
  const json ls = s.kiln_json({"ls", "--json"});
  EXPECT_TRUE(ls.is_array() && ls.empty()) << ls.dump();
  const json st = s.kiln_json({"stats", "--json"});
  EXPECT_EQ(st.at("cache").at("entries"), 0);
  EXPECT_EQ(st.at("cache").at("stores"), 0);

  // Help is not an error.
  EXPECT_EQ(s.kiln({"--help"}).rc, 0);
  EXPECT_EQ(s.kiln({"prewarm", "--help"}).rc, 0);
}

TEST_F(CliTest, WhyExplainsAStableKeyWithoutCompiling) {
  Sandbox s;
  const std::string spec = "rmsnorm(block=256,bulk=0,dtype=bf16,row=0,vec=8)";
  const Proc a = s.kiln({"why", spec, "--arch", "sm_90a"});
  ASSERT_EQ(a.rc, 0) << a.all();
  const Proc b = s.kiln({"why", spec, "--arch", "sm_90a"});
  ASSERT_EQ(b.rc, 0) << b.all();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(a.out, m, std::regex("key\\s+([0-9a-f]{64})"))) << a.out;
  const std::string key = m[1];
  EXPECT_NE(b.out.find(key), std::string::npos) << "same spec, same key\n" << b.out;
  EXPECT_NE(a.out.find("rmsnorm"), std::string::npos);
  EXPECT_NE(a.out.find("sm_90a"), std::string::npos);
  EXPECT_NE(a.out.find("cached  no"), std::string::npos) << a.out;

  // Parameter order does not matter; the arch does.
  const json same = s.kiln_json({"why", "rmsnorm(vec=8,row=0,dtype=bf16,bulk=0,block=256)", "--arch", "sm_90a", "--json"});
  EXPECT_EQ(same.at("key"), key);
  const json other = s.kiln_json({"why", spec, "--arch", "sm_90", "--json"});
  EXPECT_NE(other.at("key"), key);
  EXPECT_FALSE(other.at("key_text").get<std::string>().empty());
  // why compiles nothing and creates no cache.
  EXPECT_FALSE(fs::exists(s.cache_file()));
}

TEST_F(CliTest, WhyGivesTheKeyThatPrewarmStored) {
  ASSERT_EQ(golden_run().rc, 0) << golden_run().all();
  auto s = filled();
  const json ls = s->kiln_json({"ls", "--json"});
  ASSERT_FALSE(ls.empty());
  for (std::size_t i : {std::size_t(0), ls.size() - 1}) {
    const json w = s->kiln_json({"why", ls[i].at("spec").get<std::string>(), "--arch", k_arch, "--json"});
    EXPECT_EQ(w.at("key"), ls[i].at("key")) << w.dump(2);
    EXPECT_TRUE(w.at("cached").get<bool>());
    const json shown = s->kiln_json({"show", ls[i].at("key").get<std::string>(), "--json"});
    EXPECT_EQ(w.at("key_text"), shown.at("key_text"));
  }
}

TEST_F(CliTest, GlobalCacheDirOptionOverridesTheEnvironment) {
  ASSERT_EQ(golden_run().rc, 0) << golden_run().all();
  Sandbox s;  // its own KILN_CACHE_DIR is empty
  const json ls = s.kiln_json({"--cache-dir", golden_->cache_dir().string(), "ls", "--json"});
  EXPECT_EQ(ls.size(), rmsnorm_catalog().size());
  const json after = s.kiln_json({"ls", "--cache-dir", golden_->cache_dir().string(), "--json"});
  EXPECT_EQ(after.size(), rmsnorm_catalog().size());
  const json own = s.kiln_json({"ls", "--json"});
  EXPECT_TRUE(own.empty());
}

TEST_F(CliTest, DaemonStartStatusStatsPrewarmStop) {
  Sandbox s;
  const auto catalog = rmsnorm_catalog();

  Proc r = s.kiln({"daemon", "status"});
  EXPECT_EQ(r.rc, 3) << r.all();
  EXPECT_NE(r.out.find("not running"), std::string::npos);

  r = s.kiln({"daemon", "start", "--jobs", "1"}, 60);
  ASSERT_EQ(r.rc, 0) << r.all() << "\nlog:\n" << slurp(s.root() / "run" / "kiln" / "kilnd.log");
  EXPECT_NE(r.out.find("pid"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(s.socket()));

  int rc = -1;
  json st = s.kiln_json({"daemon", "status", "--json"}, &rc);
  EXPECT_EQ(rc, 0) << st.dump();
  EXPECT_TRUE(st.at("running").get<bool>());
  ASSERT_TRUE(st.at("pid").is_number()) << st.dump(2);
  const long pid = st.at("pid").get<long>();
  s.remember_daemon_pid(pid);
  EXPECT_GT(pid, 0);
  EXPECT_EQ(::kill(static_cast<pid_t>(pid), 0), 0);
  EXPECT_EQ(st.at("socket"), s.socket().string());
  EXPECT_FALSE(st.at("version").is_null()) << st.dump(2);
  EXPECT_EQ(st.at("stats").at("daemon").value("jobs", -1), 1) << "--jobs should reach kilnd\n" << st.dump(2);

  r = s.kiln({"daemon", "status"});
  EXPECT_EQ(r.rc, 0) << r.all();
  EXPECT_NE(r.out.find("kilnd is running"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(std::to_string(pid)), std::string::npos) << r.out;

  // A second start finds it and leaves it alone.
  r = s.kiln({"daemon", "start"}, 60);
  EXPECT_EQ(r.rc, 0) << r.all();
  EXPECT_NE(r.out.find("already running"), std::string::npos) << r.out;

  json stats = s.kiln_json({"stats", "--json"}, &rc);
  EXPECT_EQ(rc, 0) << stats.dump(2);
  EXPECT_TRUE(stats.at("daemon").at("running").get<bool>()) << stats.dump(2);
  EXPECT_TRUE(stats.at("daemon").contains("stats")) << stats.dump(2);
  // --embedded keeps away from the daemon.
  const json emb = s.kiln_json({"stats", "--json", "--embedded"});
  EXPECT_FALSE(emb.at("daemon").at("running").get<bool>()) << emb.dump(2);

  r = s.kiln({"prewarm", "--arch", k_arch, "--family", "rmsnorm", "--json"}, 600);
  ASSERT_EQ(r.rc, 0) << r.all();
  const json pw = json::parse(r.out);
  EXPECT_EQ(pw.at("via"), "daemon");
  EXPECT_EQ(pw.at("requested").get<std::size_t>(), catalog.size());
  EXPECT_EQ(pw.at("compiled").get<std::size_t>() + pw.at("cached").get<std::size_t>(), catalog.size());
  EXPECT_EQ(pw.at("failed"), 0);
  EXPECT_NE(r.err.find("kilnd"), std::string::npos) << "prewarm should say it used the daemon\n" << r.err;

  // ls through the daemon and straight from the file agree.
  const json via_daemon = s.kiln_json({"ls", "--json"});
  const json direct = s.kiln_json({"ls", "--json", "--embedded"});
  EXPECT_EQ(listed_params(via_daemon), catalog);
  EXPECT_EQ(listed_params(direct), catalog);

  // Another cache named on the command line is not the daemon's: the command uses that file.
  r = s.kiln({"ls", "--cache-dir", (s.root() / "other-cache").string(), "--json"});
  EXPECT_EQ(r.rc, 0) << r.all();
  EXPECT_EQ(r.out, "[]\n") << r.all();
  EXPECT_NE(r.err.find("warning"), std::string::npos) << r.all();

  // A second prewarm through the daemon compiles nothing.
  const json again = s.kiln_json({"prewarm", "--arch", k_arch, "--family", "rmsnorm", "--json"});
  EXPECT_EQ(again.at("via"), "daemon");
  EXPECT_EQ(again.at("compiled"), 0);
  EXPECT_EQ(again.at("cached").get<std::size_t>(), catalog.size());

  r = s.kiln({"daemon", "stop"}, 60);
  EXPECT_EQ(r.rc, 0) << r.all();
  EXPECT_NE(r.out.find("stopped"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(s.socket()));
  r = s.kiln({"daemon", "status"});
  EXPECT_EQ(r.rc, 3) << r.all();
  // Stopping what is not running is not an error.
  EXPECT_EQ(s.kiln({"daemon", "stop"}).rc, 0);
}

TEST_F(CliTest, DaemonStartReportsAKilndThatCannotRun) {
  Sandbox s;
  s.set_env("KILN_KILND", "/bin/false");
  Proc r = s.kiln({"daemon", "start"}, 60);
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_NE(r.err.find("kiln: error: kilnd exited with status 1"), std::string::npos) << r.all();
  EXPECT_NE(r.err.find("kilnd.log"), std::string::npos) << r.all();

  s.set_env("KILN_KILND", (s.root() / "no-such-kilnd").string());
  r = s.kiln({"daemon", "start"}, 60);
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_NE(r.err.find("no-such-kilnd"), std::string::npos) << r.all();
  EXPECT_EQ(s.kiln({"daemon", "status"}).rc, 3);
}

// Plugin families are families like the built-in ones: `kiln plugins` lists what loaded and what
// was skipped (with why), prewarm compiles a plugin's catalog, ls lists it, why names the plugin
// in the key.
TEST(CliPlugins, ListsPluginsAndTreatsTheirFamiliesLikeBuiltIns) {
  Sandbox s;
  const fs::path dir = s.root() / "plugins";
  fs::create_directories(dir);
  ::chmod(dir.c_str(), 0755);
  kiln::testing::private_copy(kiln::testing::c_plugin("ok"), dir);
  kiln::testing::private_copy(kiln::testing::c_plugin("wrong_version"), dir);
  s.set_env("KILN_PLUGIN_PATH", dir.string());

  const json j = s.kiln_json({"plugins", "--json"});
  ASSERT_EQ(j.at("loaded").size(), 2u) << j.dump(2);
  EXPECT_EQ(j.at("loaded")[0].at("name"), "builtin");
  EXPECT_EQ(j.at("loaded")[1].at("name"), "c-scale");
  EXPECT_EQ(j.at("loaded")[1].at("families"), json::array({"c_scale"}));
  EXPECT_EQ(j.at("loaded")[1].at("templates_hash").get<std::string>().size(), 64u);
  ASSERT_EQ(j.at("skipped").size(), 1u);
  EXPECT_NE(j.at("skipped")[0].at("reason").get<std::string>().find("plugin ABI version 100"), std::string::npos);
  EXPECT_EQ(j.at("search_path"), json::array({dir.string()}));

  const Proc table = s.kiln({"plugins"});
  ASSERT_EQ(table.rc, 0) << table.all();
  EXPECT_NE(table.out.find("c-scale"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("skipped:"), std::string::npos) << table.out;
  EXPECT_NE(table.err.find("libc_wrong_version.so skipped: built for plugin ABI version 100"), std::string::npos)
      << "one log line per skipped plugin: " << table.err;

  const json pw = s.kiln_json({"prewarm", "--arch", k_arch, "--family", "c_scale", "--json"});
  EXPECT_EQ(pw.at("compiled"), 2) << pw.dump(2);
  EXPECT_EQ(pw.at("failed"), 0);
  const json ls = s.kiln_json({"ls", "--family", "c_scale", "--json"});
  EXPECT_EQ(listed_params(ls), (std::set<std::string>{"block=128,dtype=f32", "block=256,dtype=f32"}));
  const Proc why = s.kiln({"why", "c_scale(block=128,dtype=f32)", "--arch", k_arch});
  ASSERT_EQ(why.rc, 0) << why.all();
  EXPECT_NE(why.out.find("plugin c-scale 0.3.1"), std::string::npos) << why.out;
  EXPECT_NE(why.out.find("cached  yes"), std::string::npos) << why.out;

  s.set_env("KILN_PLUGIN_PATH", "");
  const Proc gone = s.kiln({"why", "c_scale(block=128,dtype=f32)", "--arch", k_arch});
  EXPECT_EQ(gone.rc, 2) << "without the plugin its family is unknown: " << gone.all();
}

}  // namespace
