// The tuner's correctness check: a candidate runs once on small random inputs with poisoned
// outputs, and every output must match the family's CPU reference within its dtype's tolerance
// before the candidate may be timed.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache/tuning.h"
#include "jit/tune_memory.h"
#include "kiln/family.h"
#include "kiln/status.h"

namespace kiln::jit {

// The reference check: small inputs with every element random, the CPU reference's outputs, and
// the device buffers a candidate writes into.
struct CheckSet {
  Problem problem;
  std::vector<BufferSpec> specs;
  std::vector<std::vector<unsigned char>> host;  // inputs random, outputs what the reference wrote
  std::vector<DeviceMem> dev;
  std::string reference_params;  // canonical params the host outputs were computed for
};

// Builds the check set for the buffer layout of `ref_params` on problem `cp`: random inputs, the CPU
// reference's outputs, and device copies of the inputs.
Result<std::unique_ptr<CheckSet>> make_check_set(const Family& f, const Params& ref_params, const Problem& cp,
                                                 std::mt19937& rng);

// Relative L2 error of `got` against `want` (n elements of dtype t) over the elements the reference
// wrote: `want` is poisoned like `got` beforehand, so an element it left alone (a row-stride gap)
// stays NaN and is skipped. An infinity the reference wrote (the lse of a split that saw no key,
// say) must be the same infinity in `got` and counts as exact. NaN when `got` holds a non-finite
// value where the reference has a finite one, or not the reference's infinity: an element the
// kernel never wrote or got wrong.
double tune_output_error(const unsigned char* got, const unsigned char* want, DType t, std::int64_t n);

// Recomputes the check set's expected outputs for `params` when they were computed for other
// params, on the same inputs: a family's outputs may depend on its variant (a split kernel's
// partials follow its tile width). The tuner calls it for a candidate that missed another
// candidate's reference, so every candidate is held to the reference of its own params.
Status use_reference_of(const Family& f, const Params& params, CheckSet& cs);

// Runs the candidate once on the check set (outputs poisoned first) and compares every output
// (tune_output_error) within the dtype's tolerance.
cache::CandidateResult check_candidate(const Family& f, const Params& params, CUfunction fn, CheckSet& cs);

// Halves the bucketed dim until the largest buffer has at most `cap` elements, so the CPU
// reference stays fast; the kernel code is the same, only the grid is smaller.
Problem check_problem_for(const Family& f, const Params& h, const Problem& tp, std::int64_t cap);

}  // namespace kiln::jit
