#include "cache/store.h"

#include <sqlite3.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include "common/sha256.h"

namespace kiln::cache {
namespace {

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::int64_t now_s() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Status sql_error(sqlite3* db, const std::string& what) {
  return io_error(what + ": " + sqlite3_errmsg(db), "sqlite error code " + std::to_string(sqlite3_extended_errcode(db)));
}

// A prepared statement that finalizes itself.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) : db_(db) { rc_ = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr); }
  ~Stmt() { sqlite3_finalize(s_); }
  bool ok() const { return rc_ == SQLITE_OK; }
  sqlite3_stmt* get() { return s_; }
  Stmt& bind(int i, const std::string& v) { sqlite3_bind_text(s_, i, v.data(), int(v.size()), SQLITE_TRANSIENT); return *this; }
  Stmt& bind(int i, std::int64_t v) { sqlite3_bind_int64(s_, i, v); return *this; }
  Stmt& bind(int i, double v) { sqlite3_bind_double(s_, i, v); return *this; }
  Stmt& bind_blob(int i, const std::string& v) { sqlite3_bind_blob(s_, i, v.data(), int(v.size()), SQLITE_TRANSIENT); return *this; }
  int step() { return sqlite3_step(s_); }
  std::string text(int c) {
    auto* p = reinterpret_cast<const char*>(sqlite3_column_text(s_, c));
    return p ? std::string(p, sqlite3_column_bytes(s_, c)) : std::string();
  }
  std::string blob(int c) {
    auto* p = static_cast<const char*>(sqlite3_column_blob(s_, c));
    return p ? std::string(p, sqlite3_column_bytes(s_, c)) : std::string();
  }
  std::int64_t i64(int c) { return sqlite3_column_int64(s_, c); }
  double f64(int c) { return sqlite3_column_double(s_, c); }

 private:
  sqlite3* db_;
  sqlite3_stmt* s_ = nullptr;
  int rc_;
};

Status exec(sqlite3* db, const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown";
    sqlite3_free(err);
    return io_error(std::string("sqlite: ") + msg, sql);
  }
  return {};
}

constexpr const char* k_columns =
    "key, family, family_version, params, arch, toolchain, key_text, size, checksum, lowered_name, "
    "compile_log, compile_ms, registers, shared_bytes, spill_bytes, created, last_used, hits, pinned";
constexpr int k_blob_column = 19;  // "..., cubin" after k_columns

Entry read_meta(Stmt& s) {
  Entry e;
  e.key = s.text(0);
  e.family = s.text(1);
  e.family_version = int(s.i64(2));
  e.params = s.text(3);
  e.arch = s.text(4);
  e.toolchain = s.text(5);
  e.key_text = s.text(6);
  e.size = s.i64(7);
  e.checksum = s.text(8);
  e.lowered_name = s.text(9);
  e.compile_log = s.text(10);
  e.compile_ms = s.f64(11);
  e.registers = int(s.i64(12));
  e.shared_bytes = int(s.i64(13));
  e.spill_bytes = int(s.i64(14));
  e.created = s.i64(15);
  e.last_used = s.i64(16);
  e.hits = s.i64(17);
  e.pinned = s.i64(18) != 0;
  return e;
}

bool blob_ok(const Entry& e) {
  return std::int64_t(e.cubin.size()) == e.size && e.size > 0 && sha256_hex(e.cubin) == e.checksum;
}

// KILN_CACHE_MAX_MB: the size cap in MiB (0: none); unset: k_default_max_bytes.
Result<std::int64_t> max_bytes_from_env() {
  const char* v = std::getenv("KILN_CACHE_MAX_MB");
  if (!v || !*v) return k_default_max_bytes;
  std::int64_t mb = 0;
  const char* end = v + std::strlen(v);
  auto [ptr, ec] = std::from_chars(v, end, mb);
  if (ec != std::errc() || ptr != end || mb < 0 || mb > (std::int64_t(1) << 40))
    return invalid_argument(std::string("KILN_CACHE_MAX_MB must be a whole number of MiB (0: no cap), not '") + v + "'");
  return mb * 1024 * 1024;
}

bool matches(const Entry& e, const Expected& x) {
  return (x.arch.empty() || e.arch == x.arch) && (x.toolchain.empty() || e.toolchain == x.toolchain);
}

// RAII transaction: BEGIN IMMEDIATE takes the write lock up front so busy_timeout applies to it
// rather than failing on a read-to-write upgrade later.
class Transaction {
 public:
  explicit Transaction(sqlite3* db) : db_(db) { status_ = exec(db, "BEGIN IMMEDIATE"); }
  ~Transaction() { if (status_.ok() && !done_) (void)exec(db_, "ROLLBACK"); }
  const Status& status() const { return status_; }
  Status commit() { done_ = true; return exec(db_, "COMMIT"); }

 private:
  sqlite3* db_;
  Status status_;
  bool done_ = false;
};

// Step 1 -> 2: bounded cache (docs/reliability.md). A pinned row is never evicted; eviction takes
// unpinned rows least recently used first, which the index serves in order.
// last_used_ms orders uses finer than last_used (seconds, kept for display and old readers).
Status migrate_1_to_2(sqlite3* db) {
  return exec(db,
              "ALTER TABLE kernels ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0;"
              "ALTER TABLE kernels ADD COLUMN last_used_ms INTEGER NOT NULL DEFAULT 0;"
              "UPDATE kernels SET last_used_ms = last_used * 1000;"
              "CREATE INDEX kernels_lru ON kernels(pinned, last_used_ms);"
              "PRAGMA user_version = 2;");
}

// Step 2 -> 3: the tuning table (cache/tuning.h). One row per family, signature and setup; the
// setup columns are all part of the key so that another GPU, driver or toolchain never matches.
Status migrate_2_to_3(sqlite3* db) {
  return exec(db,
              "CREATE TABLE tuning ("
              " family TEXT NOT NULL, signature TEXT NOT NULL, arch TEXT NOT NULL, device_name TEXT NOT NULL,"
              " driver_version TEXT NOT NULL, toolchain TEXT NOT NULL, winner TEXT NOT NULL, winner_ms REAL NOT NULL,"
              " heuristic TEXT NOT NULL, heuristic_ms REAL NOT NULL, noise_band REAL NOT NULL,"
              " compile_ms REAL NOT NULL, measure_ms REAL NOT NULL, problem TEXT NOT NULL,"
              " candidates TEXT NOT NULL, created INTEGER NOT NULL,"
              " PRIMARY KEY (family, signature, arch, device_name, driver_version, toolchain));"
              "PRAGMA user_version = 3;");
}

}  // namespace

Result<std::unique_ptr<Store>> Store::open(const std::filesystem::path& file) {
  auto rw = open_read_write(file);
  if (rw.ok()) return rw;
  // A cache this process may not write (a read-only file system, a read-only file) still serves
  // its kernels: opened read-only, every store fails (and is counted by the caller) and the
  // bookkeeping of hits is skipped.
  if (::access(file.c_str(), F_OK) == 0 && ::access(file.c_str(), W_OK) != 0) {
    auto ro = open_read_only(file);
    if (ro.ok()) return ro;
  }
  return rw;
}

std::string Store::read_only_uri(const std::filesystem::path& file) {
  std::string uri = "file:";
  for (char ch : file.string()) {
    if (ch == '%' || ch == '?' || ch == '#') {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", static_cast<unsigned char>(ch));
      uri += buf;
    } else {
      uri += ch;
    }
  }
  return uri + "?immutable=1";
}

Result<std::unique_ptr<Store>> Store::open_read_only(const std::filesystem::path& file) {
  // immutable=1: nobody can change a file this process cannot write either... except its owner;
  // what this process reads is still verified row by row, so a change mid-read is a miss at worst.
  // It also spares SQLite the -shm file it could not create.
  const std::string uri = read_only_uri(file);
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(uri.c_str(), &db, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI | SQLITE_OPEN_FULLMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    Status s = io_error("cannot open cache " + file.string() + " read-only: " + (db ? sqlite3_errmsg(db) : "out of memory"));
    sqlite3_close(db);
    return s;
  }
  std::unique_ptr<Store> store(new Store(db, file));
  store->read_only_ = true;
  Stmt v(db, "PRAGMA user_version");
  if (v.step() != SQLITE_ROW) return sql_error(db, "reading schema version");
  if (v.i64(0) != k_schema_version)
    return io_error("cache " + file.string() + " is read-only and has schema version " + std::to_string(v.i64(0)) +
                    "; this kiln needs version " + std::to_string(k_schema_version) + " and cannot migrate it");
  return store;
}

Result<std::unique_ptr<Store>> Store::open_read_write(const std::filesystem::path& file) {
  std::error_code ec;
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path(), ec);
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(file.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                           nullptr);
  if (rc != SQLITE_OK) {
    Status s = io_error("cannot open cache " + file.string() + ": " + (db ? sqlite3_errmsg(db) : "out of memory"));
    sqlite3_close(db);
    return s;
  }
  sqlite3_busy_timeout(db, 10000);
  std::unique_ptr<Store> store(new Store(db, file));
  KILN_ASSIGN_OR_RETURN(store->max_bytes_, max_bytes_from_env());
  // WAL lets readers proceed while one writer commits; NORMAL sync is durable across process
  // crashes (the case that matters here) and avoids an fsync per stored kernel.
  KILN_TRY(exec(db, "PRAGMA journal_mode=WAL"));
  KILN_TRY(exec(db, "PRAGMA synchronous=NORMAL"));
  KILN_TRY(exec(db, "PRAGMA foreign_keys=ON"));
  KILN_TRY(store->migrate());
  return store;
}

Store::~Store() { sqlite3_close(db_); }

Result<std::unique_ptr<Store>> Store::open_recovering(const std::filesystem::path& file,
                                                      std::filesystem::path* moved_to) {
  auto first = open(file);
  if (first.ok()) return first;
  const std::string& m = first.status().message();
  const bool damaged = m.find("malformed") != std::string::npos || m.find("not a database") != std::string::npos;
  if (!damaged) return first;
  const std::filesystem::path aside = file.string() + ".corrupt-" + std::to_string(now_s());
  std::error_code ec;
  std::filesystem::rename(file, aside, ec);
  if (ec)
    return io_error("cache " + file.string() + " is damaged (" + m + ") and cannot be moved aside: " + ec.message());
  for (const char* suffix : {"-wal", "-shm"}) {
    std::error_code ignored;
    std::filesystem::rename(file.string() + suffix, aside.string() + suffix, ignored);
  }
  if (moved_to) *moved_to = aside;
  return open(file);
}

Status Store::migrate() {
  std::lock_guard lock(mu_);
  Transaction tx(db_);
  KILN_TRY(tx.status());
  Stmt v(db_, "PRAGMA user_version");
  if (v.step() != SQLITE_ROW) return sql_error(db_, "reading schema version");
  int version = int(v.i64(0));
  if (version > k_schema_version)
    return io_error("cache " + path_.string() + " has schema version " + std::to_string(version) +
                    ", newer than this kiln understands (" + std::to_string(k_schema_version) + ")");
  if (version < 1) {
    KILN_TRY(exec(db_,
                  "CREATE TABLE kernels ("
                  " key TEXT PRIMARY KEY, family TEXT NOT NULL, family_version INTEGER NOT NULL,"
                  " params TEXT NOT NULL, arch TEXT NOT NULL, toolchain TEXT NOT NULL, key_text TEXT NOT NULL,"
                  " cubin BLOB NOT NULL, size INTEGER NOT NULL, checksum TEXT NOT NULL,"
                  " lowered_name TEXT NOT NULL, compile_log TEXT NOT NULL, compile_ms REAL NOT NULL,"
                  " registers INTEGER NOT NULL, shared_bytes INTEGER NOT NULL, spill_bytes INTEGER NOT NULL,"
                  " created INTEGER NOT NULL, last_used INTEGER NOT NULL, hits INTEGER NOT NULL);"
                  "CREATE INDEX kernels_family_arch ON kernels(family, arch);"
                  "CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);"
                  "PRAGMA user_version = 1;"));
  }
  if (version < 2) KILN_TRY(migrate_1_to_2(db_));
  if (version < 3) KILN_TRY(migrate_2_to_3(db_));
  return tx.commit();
}

Status Store::bump(const char* counter, std::int64_t delta) {
  Stmt s(db_, "INSERT INTO counters(name, value) VALUES(?1, ?2) "
              "ON CONFLICT(name) DO UPDATE SET value = value + ?2");
  if (!s.ok()) return sql_error(db_, "preparing counter update");
  s.bind(1, std::string(counter)).bind(2, delta);
  if (s.step() != SQLITE_DONE) return sql_error(db_, std::string("updating counter ") + counter);
  return {};
}

Result<std::optional<Entry>> Store::get(const std::string& key, const Expected& expected) {
  std::lock_guard lock(mu_);
  std::optional<Entry> found;
  {
    Stmt s(db_, (std::string("SELECT ") + k_columns + ", cubin FROM kernels WHERE key = ?1").c_str());
    if (!s.ok()) return sql_error(db_, "preparing lookup");
    s.bind(1, key);
    int rc = s.step();
    if (rc == SQLITE_ROW) {
      Entry e = read_meta(s);
      e.cubin = s.blob(k_blob_column);
      found = std::move(e);
    } else if (rc != SQLITE_DONE) {
      return sql_error(db_, "looking up " + key);
    }
  }
  const bool bad = found && (!blob_ok(*found) || !matches(*found, expected));
  const std::string bad_checksum = bad ? found->checksum : std::string();
  if (bad) found.reset();
  if (read_only_) {
    if (found) found->hits += 1;
    return found;
  }
  // The answer is settled; what follows is bookkeeping. When it cannot be written (disk full,
  // read-only file) a verified entry is still served rather than recompiled.
  Status booked = [&]() -> Status {
    Transaction tx(db_);
    KILN_TRY(tx.status());
    if (bad) {
      // Only the row judged bad: another process may have replaced it with a good one meanwhile.
      Stmt del(db_, "DELETE FROM kernels WHERE key = ?1 AND checksum = ?2");
      del.bind(1, key).bind(2, bad_checksum);
      if (del.step() != SQLITE_DONE) return sql_error(db_, "dropping corrupt entry " + key);
      KILN_TRY(bump("corrupt", 1));
    }
    if (found) {
      Stmt up(db_, "UPDATE kernels SET last_used = ?2, last_used_ms = ?3, hits = hits + 1 WHERE key = ?1");
      up.bind(1, key).bind(2, now_s()).bind(3, now_ms());
      if (up.step() != SQLITE_DONE) return sql_error(db_, "updating use of " + key);
    }
    KILN_TRY(bump(found ? "hits" : "misses", 1));
    return tx.commit();
  }();
  if (found && booked.ok()) found->hits += 1;
  // A failed bookkeeping write is not the caller's problem: a hit is still a hit, and a miss (or
  // a dropped row) is a miss; the put that follows a miss reports a disk that cannot be written.
  return found;
}

Status Store::put(const Entry& e) {
  std::lock_guard lock(mu_);
  if (read_only_) return io_error("cannot store " + e.key + ": the cache " + path_.string() + " is read-only");
  Status s = [&]() -> Status {
    if (e.cubin.empty()) return invalid_argument("refusing to store an empty cubin for " + e.key);
    Transaction tx(db_);
    KILN_TRY(tx.status());
    Stmt ins(db_,
             "INSERT OR REPLACE INTO kernels(key, family, family_version, params, arch, toolchain, key_text, size,"
             " checksum, lowered_name, compile_log, compile_ms, registers, shared_bytes, spill_bytes, created,"
             " last_used, hits, cubin, last_used_ms, pinned) VALUES(?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14,?15,"
             "?16,?16,0,?17,?18,coalesce((SELECT pinned FROM kernels WHERE key = ?1), 0))");
    if (!ins.ok()) return sql_error(db_, "preparing insert");
    ins.bind(1, e.key).bind(2, e.family).bind(3, std::int64_t(e.family_version)).bind(4, e.params).bind(5, e.arch);
    ins.bind(6, e.toolchain).bind(7, e.key_text).bind(8, std::int64_t(e.cubin.size()));
    ins.bind(9, sha256_hex(e.cubin)).bind(10, e.lowered_name).bind(11, e.compile_log).bind(12, e.compile_ms);
    ins.bind(13, std::int64_t(e.registers)).bind(14, std::int64_t(e.shared_bytes)).bind(15, std::int64_t(e.spill_bytes));
    ins.bind(16, now_s()).bind_blob(17, e.cubin).bind(18, now_ms());
    if (ins.step() != SQLITE_DONE) return sql_error(db_, "storing " + e.key);
    KILN_TRY(bump("stores", 1));
    // The cap holds after every store: the least recently used unpinned rows make room.
    if (max_bytes_ > 0) KILN_TRY(evict_locked(max_bytes_).status());
    return tx.commit();
  }();
  if (!s.ok()) (void)bump("store_errors", 1);  // best effort: the file may be what failed
  return s;
}

Result<std::vector<Entry>> Store::list(const ListFilter& f) {
  std::lock_guard lock(mu_);
  Stmt s(db_, (std::string("SELECT ") + k_columns +
               " FROM kernels WHERE (?1 = '' OR family = ?1) AND (?2 = '' OR arch = ?2)"
               " ORDER BY last_used DESC, key")
                  .c_str());
  if (!s.ok()) return sql_error(db_, "preparing listing");
  s.bind(1, f.family).bind(2, f.arch);
  std::vector<Entry> out;
  int rc;
  while ((rc = s.step()) == SQLITE_ROW) out.push_back(read_meta(s));
  if (rc != SQLITE_DONE) return sql_error(db_, "listing entries");
  return out;
}

Result<std::optional<Entry>> Store::show(const std::string& prefix) {
  std::lock_guard lock(mu_);
  for (char c : prefix)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
      return invalid_argument("a key is lowercase hex; got '" + prefix + "'");
  if (prefix.empty()) return invalid_argument("empty key");
  Stmt s(db_, (std::string("SELECT ") + k_columns + ", cubin FROM kernels WHERE substr(key, 1, ?2) = ?1 LIMIT 2")
                  .c_str());
  s.bind(1, prefix).bind(2, std::int64_t(prefix.size()));
  std::optional<Entry> found;
  int rc;
  while ((rc = s.step()) == SQLITE_ROW) {
    if (found) return invalid_argument("key prefix '" + prefix + "' is ambiguous");
    found = read_meta(s);
    found->cubin = s.blob(k_blob_column);
  }
  if (rc != SQLITE_DONE) return sql_error(db_, "reading " + prefix);
  return found;
}

Result<Stats> Store::stats() {
  std::lock_guard lock(mu_);
  Stats st;
  Stmt a(db_, "SELECT count(*), coalesce(sum(size), 0) FROM kernels");
  if (a.step() != SQLITE_ROW) return sql_error(db_, "counting entries");
  st.entries = a.i64(0);
  st.bytes = a.i64(1);
  Stmt c(db_, "SELECT name, value FROM counters");
  int rc;
  while ((rc = c.step()) == SQLITE_ROW) {
    std::string n = c.text(0);
    std::int64_t v = c.i64(1);
    if (n == "hits") st.hits = v;
    else if (n == "misses") st.misses = v;
    else if (n == "corrupt") st.corrupt = v;
    else if (n == "stores") st.stores = v;
    else if (n == "store_errors") st.store_errors = v;
    else if (n == "evictions") st.evictions = v;
  }
  if (rc != SQLITE_DONE) return sql_error(db_, "reading counters");
  Stmt p(db_, "SELECT count(*), coalesce(sum(size), 0) FROM kernels WHERE pinned != 0");
  if (p.step() != SQLITE_ROW) return sql_error(db_, "counting pinned entries");
  st.pinned_entries = p.i64(0);
  st.pinned_bytes = p.i64(1);
  st.max_bytes = max_bytes_;
  return st;
}

Result<VerifyReport> Store::verify() {
  std::lock_guard lock(mu_);
  VerifyReport r;
  {
    Stmt ic(db_, "PRAGMA integrity_check");
    int rc;
    while ((rc = ic.step()) == SQLITE_ROW) r.integrity += (r.integrity.empty() ? "" : "\n") + ic.text(0);
    if (rc != SQLITE_DONE) return sql_error(db_, "integrity check");
  }
  {
    Stmt s(db_, "SELECT key, size, checksum, cubin FROM kernels");
    int rc;
    while ((rc = s.step()) == SQLITE_ROW) {
      Entry e;
      e.key = s.text(0);
      e.size = s.i64(1);
      e.checksum = s.text(2);
      e.cubin = s.blob(3);
      ++r.checked;
      if (!blob_ok(e)) r.bad_keys.push_back(e.key);
    }
    if (rc != SQLITE_DONE) return sql_error(db_, "checksum sweep");
  }
  if (!r.bad_keys.empty()) {
    Transaction tx(db_);
    KILN_TRY(tx.status());
    for (const auto& k : r.bad_keys) {
      Stmt del(db_, "DELETE FROM kernels WHERE key = ?1");
      del.bind(1, k);
      if (del.step() != SQLITE_DONE) return sql_error(db_, "dropping " + k);
    }
    KILN_TRY(bump("corrupt", std::int64_t(r.bad_keys.size())));
    KILN_TRY(tx.commit());
  }
  return r;
}

Status Store::remove(const std::string& key) {
  std::lock_guard lock(mu_);
  Stmt del(db_, "DELETE FROM kernels WHERE key = ?1");
  del.bind(1, key);
  if (del.step() != SQLITE_DONE) return sql_error(db_, "removing " + key);
  return {};
}

Result<EvictReport> Store::evict_locked(std::int64_t target_bytes) {
  EvictReport r;
  Stmt total(db_, "SELECT coalesce(sum(size), 0) FROM kernels");
  if (total.step() != SQLITE_ROW) return sql_error(db_, "summing sizes");
  r.bytes_before = r.bytes_after = total.i64(0);
  if (r.bytes_after <= target_bytes) return r;
  std::vector<std::pair<std::string, std::int64_t>> victims;
  {
    Stmt s(db_, "SELECT key, size FROM kernels WHERE pinned = 0 ORDER BY last_used_ms, key");
    int rc;
    std::int64_t left = r.bytes_after;
    while (left > target_bytes && (rc = s.step()) == SQLITE_ROW) {
      victims.emplace_back(s.text(0), s.i64(1));
      left -= s.i64(1);
    }
  }
  for (const auto& [key, size] : victims) {
    Stmt del(db_, "DELETE FROM kernels WHERE key = ?1");
    del.bind(1, key);
    if (del.step() != SQLITE_DONE) return sql_error(db_, "evicting " + key);
    r.evicted_keys.push_back(key);
    r.bytes_after -= size;
  }
  if (!victims.empty()) KILN_TRY(bump("evictions", std::int64_t(victims.size())));
  return r;
}

Result<EvictReport> Store::evict_to(std::int64_t target_bytes) {
  if (target_bytes < 0) return invalid_argument("an eviction target is a size in bytes, not negative");
  std::lock_guard lock(mu_);
  Transaction tx(db_);
  KILN_TRY(tx.status());
  KILN_ASSIGN_OR_RETURN(EvictReport r, evict_locked(target_bytes));
  KILN_TRY(tx.commit());
  return r;
}

Status Store::pin(const std::string& key, bool pinned) {
  std::lock_guard lock(mu_);
  Stmt up(db_, "UPDATE kernels SET pinned = ?2 WHERE key = ?1");
  up.bind(1, key).bind(2, std::int64_t(pinned ? 1 : 0));
  if (up.step() != SQLITE_DONE) return sql_error(db_, "pinning " + key);
  if (sqlite3_changes(db_) == 0) return not_found("no cached entry with key " + key);
  return {};
}

Status Store::checkpoint() {
  std::lock_guard lock(mu_);
  if (read_only_) return {};  // nothing was written
  int log_frames = 0, done_frames = 0;
  int rc = sqlite3_wal_checkpoint_v2(db_, nullptr, SQLITE_CHECKPOINT_TRUNCATE, &log_frames, &done_frames);
  if (rc == SQLITE_BUSY)
    return unavailable("WAL checkpoint incomplete: another process is using the cache",
                       std::to_string(done_frames) + " of " + std::to_string(log_frames) + " frames copied");
  if (rc != SQLITE_OK) return sql_error(db_, "WAL checkpoint");
  return {};
}

}  // namespace kiln::cache
