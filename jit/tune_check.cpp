#include "jit/tune_check.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <string>

#include "common/half.h"
#include "jit/driver.h"
#include "jit/tune_launch.h"

namespace kiln::jit {
namespace {

// f32 allows for fp32 accumulation order over rows of up to 2^16 elements (reductions); a kernel
// that skips or misplaces elements is off by far more than any of these.
double tolerance(DType t) { return t == DType::f32 ? 1e-4 : t == DType::f16 ? 2e-3 : 1e-2; }

}  // namespace

double tune_output_error(const unsigned char* got, const unsigned char* want, DType t, std::int64_t n) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double w = load_as_double(want, t, i);
    if (std::isnan(w)) continue;
    const double g = load_as_double(got, t, i);
    if (std::isinf(w)) {
      if (g != w) return NAN;
      continue;
    }
    if (!std::isfinite(g)) return NAN;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

Result<std::unique_ptr<CheckSet>> make_check_set(const Family& f, const Params& ref_params, const Problem& cp,
                                                 std::mt19937& rng) {
  auto cs = std::make_unique<CheckSet>();
  cs->problem = cp;
  cs->specs = f.buffers(ref_params, cp);
  std::vector<void*> host_ptrs;
  for (const auto& b : cs->specs) {
    if (b.role == BufferRole::input)
      cs->host.push_back(random_input(b, b.elements, rng));
    else
      cs->host.emplace_back(buffer_bytes(b), 0xFF);
    host_ptrs.push_back(cs->host.back().data());
  }
  KILN_TRY(f.cpu_reference(ref_params, cp, std::span<void* const>(host_ptrs.data(), host_ptrs.size())));
  cs->reference_params = ref_params.canonical();
  const Driver* d = Driver::get().value();
  for (std::size_t i = 0; i < cs->specs.size(); ++i) {
    cs->dev.emplace_back();
    KILN_TRY(cs->dev.back().alloc(buffer_bytes(cs->specs[i])));
    if (cs->specs[i].role == BufferRole::input)
      KILN_TRY(d->check(d->memcpy_htod(cs->dev.back().ptr(), cs->host[i].data(), cs->host[i].size()), "cuMemcpyHtoD"));
  }
  return cs;
}

Status use_reference_of(const Family& f, const Params& params, CheckSet& cs) {
  const std::string canonical = params.canonical();
  if (canonical == cs.reference_params) return {};
  std::vector<void*> host_ptrs;
  for (std::size_t i = 0; i < cs.specs.size(); ++i) {
    if (cs.specs[i].role == BufferRole::output) std::fill(cs.host[i].begin(), cs.host[i].end(), 0xFF);
    host_ptrs.push_back(cs.host[i].data());
  }
  KILN_TRY(f.cpu_reference(params, cs.problem, std::span<void* const>(host_ptrs.data(), host_ptrs.size())));
  cs.reference_params = canonical;
  return {};
}

cache::CandidateResult check_candidate(const Family& f, const Params& params, CUfunction fn, CheckSet& cs) {
  cache::CandidateResult r;
  r.params = params.canonical();
  const Driver* d = Driver::get().value();
  std::vector<void*> bufs;
  for (std::size_t i = 0; i < cs.specs.size(); ++i) {
    if (cs.specs[i].role == BufferRole::output) {
      Status s = d->check(d->memset_d8(cs.dev[i].ptr(), 0xFF, cs.dev[i].bytes()), "cuMemsetD8");
      if (!s.ok()) return r.status = cache::CandidateStatus::launch_failed, r.error = s.message(), r;
    }
    bufs.push_back(cs.dev[i].get());
  }
  Status s = launch_candidate(f, params, cs.problem, fn, bufs);
  if (s.ok()) s = d->check(d->ctx_synchronize(), "kernel execution");
  if (!s.ok()) return r.status = cache::CandidateStatus::launch_failed, r.error = s.message(), r;
  for (std::size_t i = 0; i < cs.specs.size(); ++i) {
    if (cs.specs[i].role != BufferRole::output) continue;
    std::vector<unsigned char> got(cs.dev[i].bytes());
    s = d->check(d->memcpy_dtoh(got.data(), cs.dev[i].ptr(), got.size()), "cuMemcpyDtoH");
    if (!s.ok()) return r.status = cache::CandidateStatus::launch_failed, r.error = s.message(), r;
    const double err = tune_output_error(got.data(), cs.host[i].data(), cs.specs[i].dtype, cs.specs[i].elements);
    if (!(err <= tolerance(cs.specs[i].dtype))) {
      r.status = cache::CandidateStatus::wrong_result;
      r.error = "output " + cs.specs[i].name + ": relative L2 error " + (std::isnan(err) ? "NaN (unwritten elements, or non-finite ones the reference does not have)" : std::to_string(err)) +
                " above " + std::to_string(tolerance(cs.specs[i].dtype));
      return r;
    }
  }
  return r;
}

Problem check_problem_for(const Family& f, const Params& h, const Problem& tp, std::int64_t cap) {
  Problem cp = tp;
  const auto& fields = f.problem_fields();
  const auto bucketed = std::find_if(fields.begin(), fields.end(), [](const ProblemField& pf) { return pf.bucketed; });
  if (bucketed == fields.end()) return cp;
  std::int64_t& n = cp.fields[bucketed->slot].i;
  auto largest = [&](const Problem& p) {
    std::int64_t m = 0;
    for (const auto& b : f.buffers(h, p)) m = std::max(m, b.elements);
    return m;
  };
  while (n > 1 && largest(cp) > cap) n = (n + 1) / 2;
  return f.check_problem(h, cp).ok() ? cp : tp;
}

}  // namespace kiln::jit
