// The tuning table: which variant of a family won for a problem signature on one GPU setup.
//
// Rows live in the kernel cache's SQLite file (table `tuning`, schema step 2 -> 3 in store.cpp)
// and are keyed by family, signature and the full setup: arch, device name, driver version and
// toolchain fingerprint. A lookup matches all of them exactly, so a new GPU, driver or NVRTC /
// template set never reuses a stale winner (the old rows stay, listed, until replaced). Every
// candidate's median time and status is kept with the winner. Thread-safe (one connection behind
// a mutex); several processes share the file through WAL like the Store.
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

class Store;

// What a candidate did during tuning. Only `ok` candidates may win.
enum class CandidateStatus {
  ok,              // compiled, launched, matched the reference, timed
  invalid,         // rejected by the family (validate / check_problem) before any compile
  compile_failed,  // NVRTC or the cache failed
  launch_failed,   // module load or launch failed
  wrong_result,    // output differs from the CPU reference beyond the dtype's tolerance
};
const char* candidate_status_name(CandidateStatus s);
std::optional<CandidateStatus> parse_candidate_status(const std::string& name);

struct CandidateResult {
  std::string params;      // canonical
  CandidateStatus status = CandidateStatus::ok;
  double median_ms = -1;   // of the timed launches; -1 unless ok
  double spread = 0;       // (p75 - p25) / median of the timed launches
  int launches = 0;        // timed launches
  std::string error;       // why it failed (first line)
};

// The setup a tuning result is valid for. All four fields take part in every lookup.
struct Setup {
  std::string arch;            // exact, e.g. sm_90a
  std::string device_name;     // cuDeviceGetName, e.g. "NVIDIA H100 80GB HBM3"
  std::string driver_version;  // kernel module version and CUDA driver API version
  std::string toolchain;       // NVRTC version + template set + family version (jit/autotune.h)
  bool operator==(const Setup&) const = default;
};

struct TuningRecord {
  std::string family;
  std::string signature;
  Setup setup;
  std::string winner;          // canonical params
  double winner_ms = -1;
  std::string heuristic;       // what the family's heuristic picks for the tuned problem
  double heuristic_ms = -1;    // -1 when the heuristic did not run ok
  double noise_band = 0;       // relative tie band used when this winner was picked
  double compile_ms = 0;       // wall time spent getting candidates compiled (or from the cache)
  double measure_ms = 0;       // wall time of the checks and timed launches
  std::string problem;         // the tuned problem's dims, for people ("rows=4096,cols=4096,...")
  std::vector<CandidateResult> candidates;  // in ranking order: ok by time, then the failures
  std::int64_t created = 0;    // unix seconds; set by put()
};

struct TuningFilter {
  std::string family;  // empty: any
  std::string arch;    // empty: any
};

class TuningTable {
 public:
  // A second connection to `store`'s file, which Store::open has already migrated.
  static Result<std::unique_ptr<TuningTable>> open(const Store& store);
  ~TuningTable();
  TuningTable(const TuningTable&) = delete;
  TuningTable& operator=(const TuningTable&) = delete;

  // Inserts or replaces the row for (family, signature, setup). Refuses a record whose winner is
  // not an ok candidate.
  Status put(const TuningRecord& r);
  // The row whose family, signature and whole setup match; nullopt otherwise (stale rows for
  // another setup never match).
  Result<std::optional<TuningRecord>> lookup(const std::string& family, const std::string& signature,
                                             const Setup& setup);
  // Every row, newest first.
  Result<std::vector<TuningRecord>> list(const TuningFilter& filter = {});

 private:
  TuningTable(sqlite3* db) : db_(db) {}
  std::mutex mu_;
  sqlite3* db_;
};

}  // namespace kiln::cache
