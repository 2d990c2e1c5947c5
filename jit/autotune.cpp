#include "jit/autotune.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "jit/device_info.h"
#include "jit/driver.h"
#include "jit/gpu_lock.h"
#include "jit/tune_check.h"
#include "jit/tune_launch.h"
#include "jit/tune_timing.h"
#include "jit/tuning_setup.h"

namespace kiln::jit {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::string layout_key(const std::vector<BufferSpec>& specs) {
  std::string k;
  for (const auto& b : specs) k += b.name + ":" + std::to_string(b.elements) + ":" + dtype_name(b.dtype) + ";";
  return k;
}

}  // namespace

std::string rank_candidates(std::vector<cache::CandidateResult>& cands, const std::string& heuristic, double band,
                            double floor_ms) {
  using cache::CandidateStatus;
  std::stable_sort(cands.begin(), cands.end(), [](const auto& a, const auto& b) {
    const bool aok = a.status == CandidateStatus::ok, bok = b.status == CandidateStatus::ok;
    if (aok != bok) return aok;
    if (aok && a.median_ms != b.median_ms) return a.median_ms < b.median_ms;
    if (!aok && a.status != b.status) return int(a.status) < int(b.status);
    return a.params < b.params;
  });
  if (cands.empty() || cands.front().status != CandidateStatus::ok) return "";
  const double best = cands.front().median_ms;
  const double limit = best + std::max(best * band, floor_ms);
  std::string winner;
  for (const auto& c : cands) {
    if (c.status != CandidateStatus::ok || c.median_ms > limit) break;
    if (c.params == heuristic) return c.params;
    if (winner.empty() || c.params < winner) winner = c.params;
  }
  return winner;
}

Result<cache::TuningRecord> Tuner::tune(const Family& family, const Problem& given, const TuneOptions& o) {
  // The problem as it runs on the tuning device; without one, the checks below still run (and the
  // device error comes after them).
  auto device = device_info(o.device);
  Problem problem = given;
  if (device.ok()) set_device(problem, **device);
  const Problem tp = family.tuning_problem(problem);
  const Params heuristic = family.heuristic(tp);
  // Bad input fails here, before anything is compiled or launched.
  KILN_TRY(family.validate(heuristic));
  KILN_TRY(family.check_problem(heuristic, tp));
  if (!device.ok()) return device.status();
  const DeviceInfo& dev = **device;
  KILN_ASSIGN_OR_RETURN(cache::Setup setup, tuning_setup(family, tp, dev.arch, dev.name, dev.driver_version));

  std::vector<Params> cands = o.candidates.empty() ? family.tuning_space(tp) : o.candidates;
  cands.push_back(heuristic);
  std::sort(cands.begin(), cands.end(), [](const Params& a, const Params& b) { return a.canonical() < b.canonical(); });
  cands.erase(std::unique(cands.begin(), cands.end()), cands.end());

  cache::TuningRecord rec;
  rec.family = std::string(family.name());
  rec.signature = family.signature(problem);
  rec.setup = setup;
  rec.heuristic = heuristic.canonical();
  rec.noise_band = o.noise_band;
  rec.problem = describe_problem(family, tp);

  // Compile (or fetch from the cache) every candidate the family accepts, in parallel.
  std::vector<cache::CandidateResult> results(cands.size());
  std::vector<std::optional<Artifact>> arts(cands.size());
  std::vector<std::size_t> to_build;
  for (std::size_t i = 0; i < cands.size(); ++i) {
    results[i].params = cands[i].canonical();
    Status s = family.validate(cands[i]);
    if (s.ok()) s = family.check_problem(cands[i], tp);
    if (!s.ok()) {
      results[i].status = cache::CandidateStatus::invalid;
      results[i].error = first_line(s.message());
    } else {
      to_build.push_back(i);
    }
  }
  const auto t_compile = Clock::now();
  {
    std::atomic<std::size_t> next{0};
    auto worker = [&] {
      for (std::size_t k; (k = next.fetch_add(1)) < to_build.size();) {
        const std::size_t i = to_build[k];
        auto a = builder_->get(KernelSpec{rec.family, cands[i]}, dev.arch);
        if (a.ok()) {
          arts[i] = std::move(a).value();
        } else {
          results[i].status = cache::CandidateStatus::compile_failed;
          results[i].error = first_line(a.status().message());
        }
      }
    };
    const int threads = std::max(1, std::min<int>(o.compile_threads > 0 ? o.compile_threads
                                                                        : int(std::thread::hardware_concurrency()),
                                                  int(to_build.size())));
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
    for (auto& t : pool) t.join();
  }
  rec.compile_ms = ms_since(t_compile);

  const auto t_measure = Clock::now();
  {
    KILN_ASSIGN_OR_RETURN(auto gpu, GpuLock::acquire(dev));
    KILN_TRY(current_context(o.device).status());
    std::mt19937 rng(std::random_device{}());

    std::vector<std::unique_ptr<LoadedCandidate>> loaded(cands.size());
    for (std::size_t i : to_build) {
      if (!arts[i]) continue;
      auto l = load_candidate(*arts[i]);
      if (!l.ok()) {
        results[i].status = cache::CandidateStatus::launch_failed;
        results[i].error = first_line(l.status().message());
        continue;
      }
      loaded[i] = std::move(l).value();
    }

    // Correctness first: a candidate that does not match the reference is never timed.
    const Problem cp = check_problem_for(family, heuristic, tp, o.check_elements);
    std::map<std::string, std::unique_ptr<CheckSet>> checks;  // by buffer layout
    for (std::size_t i = 0; i < cands.size(); ++i) {
      if (!loaded[i]) continue;
      const auto specs = family.buffers(cands[i], cp);
      auto& cs = checks[layout_key(specs)];
      if (!cs) {
        KILN_ASSIGN_OR_RETURN(cs, make_check_set(family, cands[i], cp, rng));
      }
      cache::CandidateResult r = check_candidate(family, cands[i], loaded[i]->function, *cs);
      if (r.status == cache::CandidateStatus::wrong_result && cs->reference_params != cands[i].canonical()) {
        // The reference was computed for another candidate; the outputs may follow the variant.
        KILN_TRY(use_reference_of(family, cands[i], *cs));
        r = check_candidate(family, cands[i], loaded[i]->function, *cs);
      }
      if (r.status != cache::CandidateStatus::ok) {
        results[i] = r;
        loaded[i].reset();
      }
    }
    checks.clear();

    // Then timing on the full problem, one pool per buffer layout.
    std::map<std::string, std::unique_ptr<TimingPool>> pools;
    bool warmed = false;
    double best_ms = 0;
    for (std::size_t i = 0; i < cands.size(); ++i) {
      if (!loaded[i]) continue;
      const auto specs = family.buffers(cands[i], tp);
      auto& pool = pools[layout_key(specs)];
      if (!pool) {
        KILN_ASSIGN_OR_RETURN(pool, make_timing_pool(specs, dev.l2_bytes, rng));
      }
      if (!warmed) {
        // Clocks ramp up under load: the first candidate timed must not pay for it.
        TuneOptions w = o;
        w.min_launches = 1;
        w.max_launches = 200;
        w.launch_budget_ms = 20;
        (void)time_candidate(family, cands[i], tp, loaded[i]->function, *pool, w);
        warmed = true;
      }
      results[i] = time_candidate(family, cands[i], tp, loaded[i]->function, *pool, o, best_ms);
      if (results[i].status == cache::CandidateStatus::ok && (best_ms <= 0 || results[i].median_ms < best_ms))
        best_ms = results[i].median_ms;
    }
  }
  rec.measure_ms = ms_since(t_measure);

  for (const auto& r : results)
    if (r.params == rec.heuristic && r.status == cache::CandidateStatus::ok) rec.heuristic_ms = r.median_ms;
  rec.winner = rank_candidates(results, rec.heuristic, o.noise_band, o.noise_floor_ms);
  for (const auto& r : results)
    if (r.params == rec.winner) rec.winner_ms = r.median_ms;
  rec.candidates = std::move(results);
  rec.created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
                    .count();
  if (o.store && table_ && !rec.winner.empty()) KILN_TRY(table_->put(rec));
  return rec;
}

std::string describe_problem(const Family& family, const Problem& problem) {
  std::string s;
  for (const ProblemField& f : family.problem_fields())
    s += (s.empty() ? "" : ",") + f.name + "=" + field_value_text(f, problem);
  if (problem.sm_count || problem.cc)
    s += (s.empty() ? "" : ",") + std::string("sm_count=") + std::to_string(problem.sm_count) +
         ",cc=" + std::to_string(problem.cc);
  return s;
}

}  // namespace kiln::jit
