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
constexpr int k_schema_version = 3;

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
  bool pinned = false;        // never evicted (kiln prewarm --pin, kiln evict --pin)
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
  std::int64_t evictions = 0;     // rows removed to keep the file under its size cap
  std::int64_t pinned_entries = 0;
  std::int64_t pinned_bytes = 0;
  std::int64_t max_bytes = 0;     // this process's cap (0: none)
};

// Default size cap of the cubins in a cache file, when KILN_CACHE_MAX_MB is not set.
constexpr std::int64_t k_default_max_bytes = std::int64_t(2048) * 1024 * 1024;

struct EvictReport {
  std::int64_t bytes_before = 0;  // sum of cubin sizes
  std::int64_t bytes_after = 0;
  std::vector<std::string> evicted_keys;  // least recently used first
};

// What a lookup expects of the row it finds. The key already hashes both, so a row that differs
// is tampered or a collision: it is dropped and counted as corrupt, never served for the wrong
// target. Empty fields are not checked.
struct Expected {
  std::string arch;
  std::string toolchain;
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
  // Opens (creating file and parent directory if needed) and migrates the schema. A file this
  // process cannot write is opened read-only (read_only()): lookups work, puts fail.
  static Result<std::unique_ptr<Store>> open(const std::filesystem::path& file);
  // Like open, but a file SQLite cannot read as a database (damaged pages, not a database) is
  // renamed aside (with its -wal and -shm) to `<file>.corrupt-<unix time>` and a fresh cache is
  // created: the cache holds nothing that cannot be compiled again, and a long-lived service
  // must not stay down for it. `moved_to` receives the new name when that happened. A file of a
  // newer schema is not touched (an error, as with open).
  static Result<std::unique_ptr<Store>> open_recovering(const std::filesystem::path& file,
                                                        std::filesystem::path* moved_to = nullptr);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const std::filesystem::path& path() const { return path_; }
  bool read_only() const { return read_only_; }
  // How another connection opens this file when read_only(): a URI for sqlite3_open_v2 with
  // SQLITE_OPEN_READONLY | SQLITE_OPEN_URI (immutable: no -shm file is needed).
  static std::string read_only_uri(const std::filesystem::path& file);

  // The entry with its verified blob, or nullopt on a miss (a corrupt row is dropped, counted, and
  // is a miss, as is a row that does not match `expected`). Counts the hit or miss and updates
  // last_used and hits.
  Result<std::optional<Entry>> get(const std::string& key, const Expected& expected = {});
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
  // Least recently used unpinned rows are removed until the cubins total at most target_bytes
  // (pinned rows stay even when that leaves more). Counted as evictions.
  Result<EvictReport> evict_to(std::int64_t target_bytes);
  // A pinned row is never evicted. not_found when no row has the key.
  Status pin(const std::string& key, bool pinned = true);
  // The size cap that put() keeps (0: none). Starts as KILN_CACHE_MAX_MB (in MiB; unset:
  // k_default_max_bytes); open() fails with invalid_argument on a malformed value.
  void set_max_bytes(std::int64_t bytes) {
    std::lock_guard lock(mu_);
    max_bytes_ = bytes;
  }
  // Copies the WAL into the database and truncates it (PRAGMA wal_checkpoint(TRUNCATE)).
  // unavailable when another connection kept it from completing.
  Status checkpoint();

 private:
  Store(sqlite3* db, std::filesystem::path path) : db_(db), path_(std::move(path)) {}
  static Result<std::unique_ptr<Store>> open_read_write(const std::filesystem::path& file);
  static Result<std::unique_ptr<Store>> open_read_only(const std::filesystem::path& file);
  Status migrate();
  Status bump(const char* counter, std::int64_t delta);
  Result<EvictReport> evict_locked(std::int64_t target_bytes);  // mu_ held, inside a transaction

  std::mutex mu_;
  sqlite3* db_;
  std::filesystem::path path_;
  std::int64_t max_bytes_ = 0;
  bool read_only_ = false;
};

}  // namespace kiln::cache
