// Helpers for the reliability suite (docs/reliability.md): scaled iteration counts, a pool of
// distinct kernel specs, direct SQLite tampering, and /proc readings of a daemon's file descriptors
// and memory.
#pragma once

#include <sqlite3.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cache/store.h"
#include "jit/templates.h"
#include "kiln/family.h"
#include "kiln/spec.h"
#include "tests/daemon/kilnd_harness.h"

namespace kiln::testing {

// KILN_RELIABILITY_LONG=1 (scripts/reliability.sh --long) selects the long-run counts.
inline bool long_run() {
  const char* v = std::getenv("KILN_RELIABILITY_LONG");
  return v && *v && std::string(v) != "0";
}
inline int scaled(int ci, int long_count) { return long_run() ? long_count : ci; }

// The first n variants of the rmsnorm catalog (every one of them valid), cycling past its end.
inline std::vector<KernelSpec> spec_pool(int n) {
  const Family* f = Registry::global().find("rmsnorm");
  EXPECT_TRUE(f);
  std::vector<KernelSpec> out;
  if (!f) return out;
  const auto catalog = f->catalog();
  for (int i = 0; i < n && i < int(catalog.size()); ++i) out.push_back(KernelSpec{"rmsnorm", catalog[i]});
  return out;
}

// The embedded templates written to <root>/templates, with `text` appended to rmsnorm's header
// (for KILN_TEMPLATE_DIR).
inline fs::path broken_templates(const fs::path& root, const std::string& text) {
  const fs::path dir = root / "templates";
  for (const auto& f : jit::embedded_templates()) {
    fs::create_directories((dir / f.path).parent_path());
    std::ofstream out(dir / f.path, std::ios::binary);
    out << f.bytes;
    if (std::string_view(f.path) == "rmsnorm/rmsnorm_fwd.cuh") out << "\n" << text << "\n";
  }
  EXPECT_TRUE(fs::exists(dir / "rmsnorm" / "rmsnorm_fwd.cuh"));
  return dir;
}

inline fs::path cache_file_of(const DaemonEnv& env) { return env.cache_dir() / "kernels.sqlite"; }

// Raw SQL against a cache file, bypassing kiln (to corrupt it on purpose). Fails the test on error.
class RawDb {
 public:
  explicit RawDb(const fs::path& file) {
    if (sqlite3_open(file.c_str(), &db_) != SQLITE_OK) ADD_FAILURE() << "open " << file;
    sqlite3_busy_timeout(db_, 10000);
  }
  ~RawDb() { sqlite3_close(db_); }
  sqlite3* get() { return db_; }
  void exec(const std::string& sql) {
    char* err = nullptr;
    if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
      ADD_FAILURE() << sql << ": " << (err ? err : "?");
      sqlite3_free(err);
    }
  }
  std::vector<std::string> keys() {
    std::vector<std::string> out;
    sqlite3_stmt* s = nullptr;
    sqlite3_prepare_v2(db_, "SELECT key FROM kernels ORDER BY key", -1, &s, nullptr);
    while (sqlite3_step(s) == SQLITE_ROW) out.emplace_back(reinterpret_cast<const char*>(sqlite3_column_text(s, 0)));
    sqlite3_finalize(s);
    return out;
  }
  std::string blob(const std::string& key) {
    sqlite3_stmt* s = nullptr;
    sqlite3_prepare_v2(db_, "SELECT cubin FROM kernels WHERE key = ?1", -1, &s, nullptr);
    sqlite3_bind_text(s, 1, key.c_str(), -1, SQLITE_TRANSIENT);
    std::string out;
    if (sqlite3_step(s) == SQLITE_ROW)
      out.assign(static_cast<const char*>(sqlite3_column_blob(s, 0)), sqlite3_column_bytes(s, 0));
    sqlite3_finalize(s);
    return out;
  }
  void set_blob(const std::string& key, const std::string& blob) {
    sqlite3_stmt* s = nullptr;
    sqlite3_prepare_v2(db_, "UPDATE kernels SET cubin = ?2 WHERE key = ?1", -1, &s, nullptr);
    sqlite3_bind_text(s, 1, key.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_blob(s, 2, blob.data(), int(blob.size()), SQLITE_TRANSIENT);
    if (sqlite3_step(s) != SQLITE_DONE) ADD_FAILURE() << "set_blob: " << sqlite3_errmsg(db_);
    sqlite3_finalize(s);
  }
  void set_text(const std::string& key, const std::string& column, const std::string& value) {
    sqlite3_stmt* s = nullptr;
    sqlite3_prepare_v2(db_, ("UPDATE kernels SET " + column + " = ?2 WHERE key = ?1").c_str(), -1, &s, nullptr);
    sqlite3_bind_text(s, 1, key.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_text(s, 2, value.c_str(), -1, SQLITE_TRANSIENT);
    if (sqlite3_step(s) != SQLITE_DONE) ADD_FAILURE() << "set_text: " << sqlite3_errmsg(db_);
    sqlite3_finalize(s);
  }

 private:
  sqlite3* db_ = nullptr;
};

// Opens the cache like any kiln process would (WAL recovery included) and checks it fully:
// PRAGMA integrity_check is "ok" and every row passes its size and checksum.
inline void expect_cache_sound(const fs::path& file, const std::string& context) {
  auto store = cache::Store::open(file);
  ASSERT_TRUE(store.ok()) << context << ": " << store.status().to_string();
  auto report = (*store)->verify();
  ASSERT_TRUE(report.ok()) << context << ": " << report.status().to_string();
  EXPECT_EQ(report->integrity, "ok") << context;
  EXPECT_TRUE(report->bad_keys.empty()) << context << ": " << report->bad_keys.size() << " bad row(s)";
}

// Open descriptors and resident memory (KiB) of a process, from /proc; -1 if unreadable.
inline int fd_count(pid_t pid) {
  std::error_code ec;
  int n = 0;
  for (auto it = fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec); !ec && it != fs::directory_iterator();
       it.increment(ec))
    ++n;
  return ec ? -1 : n;
}
inline long rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  return -1;
}

// Resident memory (KiB) of the direct children of `pid` (kilnd's compile workers).
inline long children_rss_kib(pid_t pid) {
  long total = 0;
  std::error_code ec;
  for (const auto& p : fs::directory_iterator("/proc", ec)) {
    std::ifstream in(p.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    const auto close = stat.rfind(')');
    if (close == std::string::npos || close + 4 >= stat.size()) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == pid) total += std::max(0L, rss_kib(pid_t(std::atol(p.path().filename().c_str()))));
  }
  return total;
}

inline std::mt19937& rng() {
  static std::mt19937 g([] {
    unsigned seed = fresh_seed();
    std::printf("reliability seed %u\n", seed);
    return seed;
  }());
  return g;
}
inline int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng()); }

}  // namespace kiln::testing
