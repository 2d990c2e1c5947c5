// The autotuner: times every candidate of a family's tuning space on this GPU and picks a winner.
//
// Method (docs/autotune.md): candidates compile through the Builder (so through the cache); each
// must match the family's CPU reference on fresh random inputs with poisoned outputs before it may
// win; timing uses CUDA events around single launches after a warm-up, the median of repeated
// launches, inputs rotated across a pool larger than L2 and L2 flushed when the pool cannot be;
// a failing candidate is recorded with its status, never fatal. The winner is the fastest ok
// candidate, with ties (within the noise band) going to the heuristic's choice, then to the
// smallest canonical spec. Timing holds the GPU exclusively: a process-wide mutex plus an flock
// on a per-device lock file shared by every kiln process (kilnd, `kiln tune`, embedded clients).
// The steps live beside it: jit/tune_check.h, jit/tune_timing.h, jit/gpu_lock.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/tuning.h"
#include "jit/builder.h"
#include "kiln/family.h"
#include "kiln/status.h"

namespace kiln::jit {

struct TuneOptions {
  int device = 0;                    // CUDA device ordinal to tune on
  double noise_band = 0.03;          // relative: candidates within 3 % of the fastest are ties ...
  double noise_floor_ms = 0.0005;    // ... or within 0.5 us of it (event resolution)
  int warmup = 3;                    // untimed launches per candidate
  int min_launches = 5;              // timed launches per candidate: at least ...
  int max_launches = 30;             // ... at most, and stop once this much GPU time is spent:
  double launch_budget_ms = 30;
  std::int64_t check_elements = std::int64_t(1) << 22;  // largest buffer in the reference check
  int compile_threads = 0;           // 0: one per CPU
  // The candidates to try; empty: the family's tuning_space() for the tuned problem. The
  // heuristic's choice is always added.
  std::vector<Params> candidates;
  bool store = true;                 // write the record to the table (when there is one)
};

// The tie-break (docs/autotune.md), exposed so it can be tested without a GPU. Ranks `cands`
// in place (ok ones by median time, then the rest by status and spec) and returns the winner's
// params, or "" when no candidate is ok. Ties: every ok candidate whose median is within
// max(best * band, floor_ms) of the best; among them the heuristic's choice if present, else the
// smallest canonical spec string.
std::string rank_candidates(std::vector<cache::CandidateResult>& cands, const std::string& heuristic,
                            double band, double floor_ms);

class Tuner {
 public:
  // Neither pointer is owned; `table` may be null (nothing stored).
  Tuner(Builder* builder, cache::TuningTable* table) : builder_(builder), table_(table) {}

  // Tunes problem's signature (family.tuning_problem(problem)) on options.device. The record
  // lists every candidate; its winner is empty when none ran ok (then nothing is stored and the
  // record still says why each failed). Errors: bad input (before any compile or launch), no
  // GPU, a failed allocation of the problem's buffers.
  Result<cache::TuningRecord> tune(const Family& family, const Problem& problem, const TuneOptions& options = {});

 private:
  Builder* builder_;
  cache::TuningTable* table_;
};

// "rows=4096,cols=4096,...,sm_count=132,cc=90" for people: the fields by name, then the device
// facts when known.
std::string describe_problem(const Family& family, const Problem& problem);

}  // namespace kiln::jit
