// The tuner's timing: single launches between two CUDA events after a warm-up, rotating over a
// pool of input sets larger than L2 (or flushing L2 when the pool cannot be), and the median of
// the timed launches.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <memory>
#include <random>
#include <vector>

#include "cache/tuning.h"
#include "jit/autotune.h"
#include "jit/tune_memory.h"
#include "kiln/family.h"
#include "kiln/status.h"

namespace kiln::jit {

// The timing pool: `sets` copies of every buffer, inputs random, and an L2-sized scratch buffer
// written between launches when the pool alone would stay cache-resident.
struct TimingPool {
  std::vector<std::vector<DeviceMem>> sets;
  DeviceMem scratch;
  bool flush = false;
};

// A pool for buffers `specs` on a GPU with `l2` bytes of L2 cache.
Result<std::unique_ptr<TimingPool>> make_timing_pool(const std::vector<BufferSpec>& specs, std::size_t l2,
                                                     std::mt19937& rng);

// Warm-up, then single launches between two events, rotating over the pool's sets.
// A candidate more than twice as slow as the best so far (best_ms > 0) stops after three timed
// launches: it cannot win, and slow variants would otherwise eat the time budget.
cache::CandidateResult time_candidate(const Family& f, const Params& params, const Problem& p, CUfunction fn,
                                      TimingPool& pool, const TuneOptions& o, double best_ms = 0);

}  // namespace kiln::jit
