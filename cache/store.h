// The SQLite store of compiled kernels.
//
// One row per compiled variant, keyed by the cache key (see jit/key.h). Every read verifies the
// blob's size and SHA-256 before handing it out: a bad row is deleted, counted as corrupt and
// reported as a miss, so the caller recompiles. WAL mode, busy_timeout and BEGIN IMMEDIATE let
// several processes (daemon, CLI, embedded clients) share one file. A Store is thread-safe (one
// connection behind a mutex); open one per process and file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kiln/status.h"

struct sqlite3;

namespace kiln::cache {

// Bump together with a migration step in store.cpp.
constexpr int k_schema_version = 1;

struct Entry {
  std::string key;            // 64 hex chars
  std::string family;
  int family_version = 0;
  std::string params;         // canonical
  std::string arch;           // exact, e.g. sm_90a
  std::string toolchain;      // toolchain fingerprint (hex)
  std::string key_text;       // the canonical text the key hashes (explains the key)
  std::string cubin;          // the blob (empty in listings)
  std::int64_t size = 0;      // bytes of cubin
  std::string checksum;       // sha256 hex of cubin
  std::string lowered_name;
  std::string compile_log;
  double compile_ms = 0;
  int registers = -1;         // -1: not known
  int shared_bytes = -1;
  int spill_bytes = -1;
  std::int64_t created = 0;   // unix seconds
  std::int64_t last_used = 0;
  std::int64_t hits = 0;
};

struct Stats {
  std::int64_t entries = 0;
  std::int64_t bytes = 0;
  // Persistent counters, summed over every process that used the file.
  std::int64_t hits = 0;
  std::int64_t misses = 0;
  std::int64_t corrupt = 0;       // rows that failed size or checksum and were dropped
  std::int64_t stores = 0;
  std::int64_t store_errors = 0;  // puts that failed (disk full, read-only file ...)
};

struct ListFilter {
  std::string family;  // empty: any
  std::string arch;    // empty: any
};

struct VerifyReport {
  std::string integrity;  // PRAGMA integrity_check's answer ("ok" when sound)
  std::int64_t checked = 0;
  std::vector<std::string> bad_keys;  // dropped from the store
};

class Store {
 public:
  // Opens (creating file and parent directory if needed) and migrates the schema.
  static Result<std::unique_ptr<Store>> open(const std::filesystem::path& file);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const std::filesystem::path& path() const { return path_; }

  // The entry with its verified blob, or nullopt on a miss (a corrupt row is dropped, counted, and
  // is a miss). Counts the hit or miss and updates last_used and hits.
  Result<std::optional<Entry>> get(const std::string& key);
  // Inserts or replaces; size, checksum and created are computed here from e.cubin.
  Status put(const Entry& e);
  // Metadata of matching rows, without blobs, most recently used first.
  Result<std::vector<Entry>> list(const ListFilter& filter = {});
  // One row with its blob, unverified and uncounted (for inspection). Accepts a unique key prefix.
  Result<std::optional<Entry>> show(const std::string& key_or_prefix);
  Result<Stats> stats();
  // PRAGMA integrity_check plus a checksum sweep over every row; bad rows are dropped and counted.
  Result<VerifyReport> verify();
  Status remove(const std::string& key);

 private:
  Store(sqlite3* db, std::filesystem::path path) : db_(db), path_(std::move(path)) {}
  Status migrate();
  Status bump(const char* counter, std::int64_t delta);

  std::mutex mu_;
  sqlite3* db_;
  std::filesystem::path path_;
};

}  // namespace kiln::cache
