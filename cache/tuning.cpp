#include "cache/tuning.h"

#include <sqlite3.h>

#include <chrono>

#include <nlohmann/json.hpp>

#include "cache/store.h"

namespace kiln::cache {
namespace {

using nlohmann::json;

std::int64_t now_s() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Status sql_error(sqlite3* db, const std::string& what) {
  return io_error(what + ": " + sqlite3_errmsg(db), "sqlite error code " + std::to_string(sqlite3_extended_errcode(db)));
}

class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) { rc_ = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr); }
  ~Stmt() { sqlite3_finalize(s_); }
  bool ok() const { return rc_ == SQLITE_OK; }
  Stmt& bind(int i, const std::string& v) { sqlite3_bind_text(s_, i, v.data(), int(v.size()), SQLITE_TRANSIENT); return *this; }
  Stmt& bind(int i, std::int64_t v) { sqlite3_bind_int64(s_, i, v); return *this; }
  Stmt& bind(int i, double v) { sqlite3_bind_double(s_, i, v); return *this; }
  int step() { return sqlite3_step(s_); }
  std::string text(int c) {
    auto* p = reinterpret_cast<const char*>(sqlite3_column_text(s_, c));
    return p ? std::string(p, sqlite3_column_bytes(s_, c)) : std::string();
  }
  std::int64_t i64(int c) { return sqlite3_column_int64(s_, c); }
  double f64(int c) { return sqlite3_column_double(s_, c); }

 private:
  sqlite3_stmt* s_ = nullptr;
  int rc_;
};

constexpr const char* k_columns =
    "family, signature, arch, device_name, driver_version, toolchain, winner, winner_ms, heuristic, heuristic_ms,"
    " noise_band, compile_ms, measure_ms, problem, candidates, created";

std::string candidates_to_text(const std::vector<CandidateResult>& cs) {
  json arr = json::array();
  for (const auto& c : cs) {
    json j = {{"params", c.params}, {"status", candidate_status_name(c.status)}, {"median_ms", c.median_ms},
              {"spread", c.spread}, {"launches", c.launches}};
    if (!c.error.empty()) j["error"] = c.error;
    arr.push_back(std::move(j));
  }
  return arr.dump(-1, ' ', false, json::error_handler_t::replace);
}

// A row whose candidate list cannot be read is still listed (winner and times are columns), with
// the candidates left out.
std::vector<CandidateResult> candidates_from_text(const std::string& text) {
  std::vector<CandidateResult> out;
  json arr = json::parse(text, nullptr, false);
  if (!arr.is_array()) return out;
  for (const auto& j : arr) {
    if (!j.is_object()) continue;
    CandidateResult c;
    c.params = j.value("params", std::string());
    c.status = parse_candidate_status(j.value("status", std::string())).value_or(CandidateStatus::invalid);
    c.median_ms = j.value("median_ms", -1.0);
    c.spread = j.value("spread", 0.0);
    c.launches = j.value("launches", 0);
    c.error = j.value("error", std::string());
    out.push_back(std::move(c));
  }
  return out;
}

TuningRecord read_row(Stmt& s) {
  TuningRecord r;
  r.family = s.text(0);
  r.signature = s.text(1);
  r.setup = Setup{s.text(2), s.text(3), s.text(4), s.text(5)};
  r.winner = s.text(6);
  r.winner_ms = s.f64(7);
  r.heuristic = s.text(8);
  r.heuristic_ms = s.f64(9);
  r.noise_band = s.f64(10);
  r.compile_ms = s.f64(11);
  r.measure_ms = s.f64(12);
  r.problem = s.text(13);
  r.candidates = candidates_from_text(s.text(14));
  r.created = s.i64(15);
  return r;
}

}  // namespace

const char* candidate_status_name(CandidateStatus s) {
  switch (s) {
    case CandidateStatus::ok: return "ok";
    case CandidateStatus::invalid: return "invalid";
    case CandidateStatus::compile_failed: return "compile_failed";
    case CandidateStatus::launch_failed: return "launch_failed";
    case CandidateStatus::wrong_result: return "wrong_result";
  }
  return "invalid";
}

std::optional<CandidateStatus> parse_candidate_status(const std::string& name) {
  for (auto s : {CandidateStatus::ok, CandidateStatus::invalid, CandidateStatus::compile_failed,
                 CandidateStatus::launch_failed, CandidateStatus::wrong_result})
    if (name == candidate_status_name(s)) return s;
  return std::nullopt;
}

Result<std::unique_ptr<TuningTable>> TuningTable::open(const Store& store) {
  sqlite3* db = nullptr;
  // A read-only cache (Store::read_only) is read the way the Store reads it.
  int rc = store.read_only()
               ? sqlite3_open_v2(Store::read_only_uri(store.path()).c_str(), &db,
                                 SQLITE_OPEN_READONLY | SQLITE_OPEN_URI | SQLITE_OPEN_FULLMUTEX, nullptr)
               : sqlite3_open_v2(store.path().c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    Status s = io_error("cannot open the tuning table in " + store.path().string() + ": " +
                        (db ? sqlite3_errmsg(db) : "out of memory"));
    sqlite3_close(db);
    return s;
  }
  sqlite3_busy_timeout(db, 10000);
  std::unique_ptr<TuningTable> t(new TuningTable(db));
  // The Store migrated the file; a file without the table is one an older kiln recreated.
  Stmt check(db, "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'tuning'");
  if (check.step() != SQLITE_ROW)
    return io_error("cache " + store.path().string() + " has no tuning table (schema version below 3?)");
  return t;
}

TuningTable::~TuningTable() { sqlite3_close(db_); }

Status TuningTable::put(const TuningRecord& r) {
  bool winner_ok = false;
  for (const auto& c : r.candidates) winner_ok |= c.params == r.winner && c.status == CandidateStatus::ok;
  if (r.family.empty() || r.signature.empty() || r.winner.empty() || !winner_ok)
    return invalid_argument("a tuning record needs a family, a signature and a winner that ran ok");
  std::lock_guard lock(mu_);
  Stmt ins(db_,
           "INSERT OR REPLACE INTO tuning(family, signature, arch, device_name, driver_version, toolchain, winner,"
           " winner_ms, heuristic, heuristic_ms, noise_band, compile_ms, measure_ms, problem, candidates, created)"
           " VALUES(?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14,?15,?16)");
  if (!ins.ok()) return sql_error(db_, "preparing tuning insert");
  ins.bind(1, r.family).bind(2, r.signature).bind(3, r.setup.arch).bind(4, r.setup.device_name);
  ins.bind(5, r.setup.driver_version).bind(6, r.setup.toolchain).bind(7, r.winner).bind(8, r.winner_ms);
  ins.bind(9, r.heuristic).bind(10, r.heuristic_ms).bind(11, r.noise_band).bind(12, r.compile_ms);
  ins.bind(13, r.measure_ms).bind(14, r.problem).bind(15, candidates_to_text(r.candidates));
  ins.bind(16, r.created > 0 ? r.created : now_s());
  if (ins.step() != SQLITE_DONE) return sql_error(db_, "storing the tuning result for " + r.family + " " + r.signature);
  return {};
}

Result<std::optional<TuningRecord>> TuningTable::lookup(const std::string& family, const std::string& signature,
                                                        const Setup& setup) {
  std::lock_guard lock(mu_);
  Stmt s(db_, (std::string("SELECT ") + k_columns +
               " FROM tuning WHERE family = ?1 AND signature = ?2 AND arch = ?3 AND device_name = ?4"
               " AND driver_version = ?5 AND toolchain = ?6")
                  .c_str());
  if (!s.ok()) return sql_error(db_, "preparing tuning lookup");
  s.bind(1, family).bind(2, signature).bind(3, setup.arch).bind(4, setup.device_name);
  s.bind(5, setup.driver_version).bind(6, setup.toolchain);
  int rc = s.step();
  if (rc == SQLITE_ROW) return std::optional<TuningRecord>(read_row(s));
  if (rc != SQLITE_DONE) return sql_error(db_, "looking up the tuning result for " + family + " " + signature);
  return std::optional<TuningRecord>();
}

Result<std::vector<TuningRecord>> TuningTable::list(const TuningFilter& f) {
  std::lock_guard lock(mu_);
  Stmt s(db_, (std::string("SELECT ") + k_columns +
               " FROM tuning WHERE (?1 = '' OR family = ?1) AND (?2 = '' OR arch = ?2)"
               " ORDER BY created DESC, family, signature")
                  .c_str());
  if (!s.ok()) return sql_error(db_, "preparing tuning listing");
  s.bind(1, f.family).bind(2, f.arch);
  std::vector<TuningRecord> out;
  int rc;
  while ((rc = s.step()) == SQLITE_ROW) out.push_back(read_row(s));
  if (rc != SQLITE_DONE) return sql_error(db_, "listing tuning results");
  return out;
}

}  // namespace kiln::cache
