#include "jit/tune_timing.h"

#include <algorithm>

#include "jit/driver.h"
#include "jit/tune_launch.h"

namespace kiln::jit {
namespace {

struct Events {
  CUevent a = nullptr, b = nullptr;
  ~Events() {
    const Driver* d = Driver::get().value();
    if (a) d->event_destroy(a);
    if (b) d->event_destroy(b);
  }
};

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, std::size_t(q * double(v.size() - 1) + 0.5))];
}

}  // namespace

Result<std::unique_ptr<TimingPool>> make_timing_pool(const std::vector<BufferSpec>& specs, std::size_t l2,
                                                     std::mt19937& rng) {
  auto pool = std::make_unique<TimingPool>();
  std::size_t set_bytes = 0;
  for (const auto& b : specs) set_bytes += buffer_bytes(b);
  const std::size_t target = 2 * std::max<std::size_t>(l2, 1);
  const std::size_t sets = std::clamp<std::size_t>((target + set_bytes - 1) / std::max<std::size_t>(set_bytes, 1), 1, 64);
  pool->flush = sets * set_bytes < target;
  const Driver* d = Driver::get().value();
  for (std::size_t s = 0; s < sets; ++s) {
    pool->sets.emplace_back();
    for (const auto& b : specs) {
      pool->sets.back().emplace_back();
      DeviceMem& m = pool->sets.back().back();
      KILN_TRY(m.alloc(buffer_bytes(b)));
      if (b.role == BufferRole::input)
        KILN_TRY(fill_random(m, b, rng));
      else
        KILN_TRY(d->check(d->memset_d8(m.ptr(), 0xFF, m.bytes()), "cuMemsetD8"));
    }
  }
  if (pool->flush) KILN_TRY(pool->scratch.alloc(target));
  return pool;
}

cache::CandidateResult time_candidate(const Family& f, const Params& params, const Problem& p, CUfunction fn,
                                      TimingPool& pool, const TuneOptions& o, double best_ms) {
  cache::CandidateResult r;
  r.params = params.canonical();
  const Driver* d = Driver::get().value();
  auto fail = [&](const Status& s) {
    r.status = cache::CandidateStatus::launch_failed;
    r.error = s.message();
    return r;
  };
  Events ev;
  Status s = d->check(d->event_create(&ev.a, CU_EVENT_DEFAULT), "cuEventCreate");
  if (s.ok()) s = d->check(d->event_create(&ev.b, CU_EVENT_DEFAULT), "cuEventCreate");
  if (!s.ok()) return fail(s);
  std::vector<void*> bufs;
  unsigned flush_value = 0;
  auto one = [&](std::size_t i) -> Status {
    const auto& set = pool.sets[i % pool.sets.size()];
    bufs.clear();
    for (const auto& m : set) bufs.push_back(m.get());
    if (pool.flush)
      KILN_TRY(d->check(d->memset_d8(pool.scratch.ptr(), (unsigned char)(++flush_value), pool.scratch.bytes()), "cuMemsetD8"));
    return launch_candidate(f, params, p, fn, bufs);
  };
  for (int i = 0; i < o.warmup; ++i)
    if (s = one(std::size_t(i)); !s.ok()) return fail(s);
  if (s = d->check(d->ctx_synchronize(), "kernel execution"); !s.ok()) return fail(s);
  std::vector<double> times;
  double spent = 0;
  for (int i = 0; i < o.max_launches && (i < o.min_launches || spent < o.launch_budget_ms); ++i) {
    const std::size_t k = std::size_t(o.warmup + i);
    // The flush (when any) goes before the first event so it is not timed.
    if (pool.flush)
      if (s = d->check(d->memset_d8(pool.scratch.ptr(), (unsigned char)(++flush_value), pool.scratch.bytes()), "cuMemsetD8"); !s.ok())
        return fail(s);
    const auto& set = pool.sets[k % pool.sets.size()];
    bufs.clear();
    for (const auto& m : set) bufs.push_back(m.get());
    s = d->check(d->event_record(ev.a, nullptr), "cuEventRecord");
    if (s.ok()) s = launch_candidate(f, params, p, fn, bufs);
    if (s.ok()) s = d->check(d->event_record(ev.b, nullptr), "cuEventRecord");
    if (s.ok()) s = d->check(d->event_synchronize(ev.b), "kernel execution");
    float ms = 0;
    if (s.ok()) s = d->check(d->event_elapsed_time(&ms, ev.a, ev.b), "cuEventElapsedTime");
    if (!s.ok()) return fail(s);
    times.push_back(ms);
    spent += ms;
    if (best_ms > 0 && times.size() >= 3 && quantile(times, 0.5) > 2 * best_ms) break;
  }
  r.launches = int(times.size());
  r.median_ms = quantile(times, 0.5);
  r.spread = r.median_ms > 0 ? (quantile(times, 0.75) - quantile(times, 0.25)) / r.median_ms : 0;
  return r;
}

}  // namespace kiln::jit
