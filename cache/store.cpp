#include "cache/store.h"

#include <sqlite3.h>

#include <chrono>
#include <system_error>

#include "common/sha256.h"

namespace kiln::cache {
namespace {

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
    "compile_log, compile_ms, registers, shared_bytes, spill_bytes, created, last_used, hits";

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
  return e;
}

bool blob_ok(const Entry& e) {
  return std::int64_t(e.cubin.size()) == e.size && e.size > 0 && sha256_hex(e.cubin) == e.checksum;
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

}  // namespace

Result<std::unique_ptr<Store>> Store::open(const std::filesystem::path& file) {
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
  // WAL lets readers proceed while one writer commits; NORMAL sync is durable across process
  // crashes (the case that matters here) and avoids an fsync per stored kernel.
  KILN_TRY(exec(db, "PRAGMA journal_mode=WAL"));
  KILN_TRY(exec(db, "PRAGMA synchronous=NORMAL"));
  KILN_TRY(exec(db, "PRAGMA foreign_keys=ON"));
  KILN_TRY(store->migrate());
  return store;
}

Store::~Store() { sqlite3_close(db_); }

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

Result<std::optional<Entry>> Store::get(const std::string& key) {
  std::lock_guard lock(mu_);
  std::optional<Entry> found;
  {
    Stmt s(db_, (std::string("SELECT ") + k_columns + ", cubin FROM kernels WHERE key = ?1").c_str());
    if (!s.ok()) return sql_error(db_, "preparing lookup");
    s.bind(1, key);
    int rc = s.step();
    if (rc == SQLITE_ROW) {
      Entry e = read_meta(s);
      e.cubin = s.blob(18);
      found = std::move(e);
    } else if (rc != SQLITE_DONE) {
      return sql_error(db_, "looking up " + key);
    }
  }
  Transaction tx(db_);
  KILN_TRY(tx.status());
  if (found && !blob_ok(*found)) {
    Stmt del(db_, "DELETE FROM kernels WHERE key = ?1 AND checksum = ?2");
    del.bind(1, key).bind(2, found->checksum);
    if (del.step() != SQLITE_DONE) return sql_error(db_, "dropping corrupt entry " + key);
    KILN_TRY(bump("corrupt", 1));
    found.reset();
  }
  if (found) {
    Stmt up(db_, "UPDATE kernels SET last_used = ?2, hits = hits + 1 WHERE key = ?1");
    up.bind(1, key).bind(2, now_s());
    if (up.step() != SQLITE_DONE) return sql_error(db_, "updating use of " + key);
    found->hits += 1;
  }
  KILN_TRY(bump(found ? "hits" : "misses", 1));
  KILN_TRY(tx.commit());
  return found;
}

Status Store::put(const Entry& e) {
  std::lock_guard lock(mu_);
  Status s = [&]() -> Status {
    if (e.cubin.empty()) return invalid_argument("refusing to store an empty cubin for " + e.key);
    Transaction tx(db_);
    KILN_TRY(tx.status());
    Stmt ins(db_,
             "INSERT OR REPLACE INTO kernels(key, family, family_version, params, arch, toolchain, key_text, size,"
             " checksum, lowered_name, compile_log, compile_ms, registers, shared_bytes, spill_bytes, created,"
             " last_used, hits, cubin) VALUES(?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14,?15,?16,?16,0,?17)");
    if (!ins.ok()) return sql_error(db_, "preparing insert");
    ins.bind(1, e.key).bind(2, e.family).bind(3, std::int64_t(e.family_version)).bind(4, e.params).bind(5, e.arch);
    ins.bind(6, e.toolchain).bind(7, e.key_text).bind(8, std::int64_t(e.cubin.size()));
    ins.bind(9, sha256_hex(e.cubin)).bind(10, e.lowered_name).bind(11, e.compile_log).bind(12, e.compile_ms);
    ins.bind(13, std::int64_t(e.registers)).bind(14, std::int64_t(e.shared_bytes)).bind(15, std::int64_t(e.spill_bytes));
    ins.bind(16, now_s()).bind_blob(17, e.cubin);
    if (ins.step() != SQLITE_DONE) return sql_error(db_, "storing " + e.key);
    KILN_TRY(bump("stores", 1));
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
    found->cubin = s.blob(18);
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
  }
  if (rc != SQLITE_DONE) return sql_error(db_, "reading counters");
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

}  // namespace kiln::cache
