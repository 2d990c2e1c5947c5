#include "jit/autotune.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "common/half.h"
#include "common/paths.h"
#include "common/sha256.h"
#include "jit/driver.h"
#include "jit/nvrtc.h"
#include "jit/templates.h"

namespace kiln::jit {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// Device memory freed on scope exit.
class DeviceMem {
 public:
  DeviceMem() = default;
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem(DeviceMem&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = 0; }
  ~DeviceMem() {
    if (ptr_) Driver::get().value()->mem_free(ptr_);
  }
  Status alloc(std::size_t bytes) {
    const Driver* d = Driver::get().value();
    bytes_ = bytes;
    return d->check(d->mem_alloc(&ptr_, bytes ? bytes : 1), "cuMemAlloc");
  }
  CUdeviceptr ptr() const { return ptr_; }
  void* get() const { return reinterpret_cast<void*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  CUdeviceptr ptr_ = 0;
  std::size_t bytes_ = 0;
};

std::size_t buffer_bytes(const BufferSpec& b) { return std::size_t(std::max<std::int64_t>(b.elements, 0)) * dtype_size(b.dtype); }

std::vector<unsigned char> random_block(DType t, std::int64_t n, std::mt19937& rng) {
  std::vector<unsigned char> v(std::size_t(n) * dtype_size(t));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (std::int64_t i = 0; i < n; ++i) store_from_double(v.data(), t, i, dist(rng));
  return v;
}

// Fills a device buffer with random values without generating all of them on the host: one
// random block (up to 2^20 elements) is uploaded and then doubled in place with device copies.
Status fill_random(const DeviceMem& m, DType t, std::mt19937& rng) {
  const Driver* d = Driver::get().value();
  const std::size_t esize = dtype_size(t);
  const std::size_t n = m.bytes() / esize;
  if (n == 0) return {};
  const std::size_t block = std::min<std::size_t>(n, std::size_t(1) << 20);
  auto host = random_block(t, std::int64_t(block), rng);
  KILN_TRY(d->check(d->memcpy_htod(m.ptr(), host.data(), host.size()), "cuMemcpyHtoD"));
  std::size_t done = block * esize;
  while (done < m.bytes()) {
    const std::size_t chunk = std::min(done, m.bytes() - done);
    KILN_TRY(d->check(d->memcpy_dtod(m.ptr() + done, m.ptr(), chunk), "cuMemcpyDtoD"));
    done += chunk;
  }
  return {};
}

// One loaded candidate.
struct Loaded {
  CUmodule module = nullptr;
  CUfunction function = nullptr;
  ~Loaded() {
    if (module) Driver::get().value()->module_unload(module);
  }
};

Status launch(const Family& f, const Params& params, const Problem& p, CUfunction fn, const std::vector<void*>& bufs) {
  const Driver* d = Driver::get().value();
  const LaunchGeometry g = f.geometry(params, p);
  ArgPack args;
  f.pack_args(params, p, std::span<void* const>(bufs.data(), bufs.size()), args);
  if (args.overflow()) return internal_error("kernel arguments exceed the argument block");
  KILN_TRY(encode_tensor_maps(args));
  return d->check(d->launch_kernel(fn, g.grid.x, g.grid.y, g.grid.z, g.block.x, g.block.y, g.block.z, g.shared_bytes,
                                   nullptr, args.pointers(), nullptr),
                  "cuLaunchKernel");
}

// f32 allows for fp32 accumulation order over rows of up to 2^16 elements (reductions); a kernel
// that skips or misplaces elements is off by far more than any of these.
double tolerance(DType t) { return t == DType::f32 ? 1e-4 : t == DType::f16 ? 2e-3 : 1e-2; }

// Relative L2 error of got against want over the elements the reference wrote (want is poisoned
// like got beforehand, so an element it left alone, a row-stride gap, stays NaN and is skipped).
// NaN when got holds a NaN where want does not: an element the kernel never wrote.
double compare(const unsigned char* got, const unsigned char* want, DType t, std::int64_t n) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double w = load_as_double(want, t, i);
    if (std::isnan(w)) continue;
    const double g = load_as_double(got, t, i);
    if (!std::isfinite(g)) return NAN;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// The reference check: small inputs with every element random, the CPU reference's outputs, and
// the device buffers a candidate writes into.
struct CheckSet {
  Problem problem;
  std::vector<BufferSpec> specs;
  std::vector<std::vector<unsigned char>> host;  // inputs random, outputs what the reference wrote
  std::vector<DeviceMem> dev;
};

Result<std::unique_ptr<CheckSet>> make_check_set(const Family& f, const Params& ref_params, const Problem& cp,
                                                 std::mt19937& rng) {
  auto cs = std::make_unique<CheckSet>();
  cs->problem = cp;
  cs->specs = f.buffers(ref_params, cp);
  std::vector<void*> host_ptrs;
  for (const auto& b : cs->specs) {
    if (b.role == BufferRole::input)
      cs->host.push_back(random_block(b.dtype, b.elements, rng));
    else
      cs->host.emplace_back(buffer_bytes(b), 0xFF);
    host_ptrs.push_back(cs->host.back().data());
  }
  KILN_TRY(f.cpu_reference(ref_params, cp, std::span<void* const>(host_ptrs.data(), host_ptrs.size())));
  const Driver* d = Driver::get().value();
  for (std::size_t i = 0; i < cs->specs.size(); ++i) {
    cs->dev.emplace_back();
    KILN_TRY(cs->dev.back().alloc(buffer_bytes(cs->specs[i])));
    if (cs->specs[i].role == BufferRole::input)
      KILN_TRY(d->check(d->memcpy_htod(cs->dev.back().ptr(), cs->host[i].data(), cs->host[i].size()), "cuMemcpyHtoD"));
  }
  return cs;
}

// Runs the candidate once on the check set (outputs poisoned first) and compares every output.
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
  Status s = launch(f, params, cs.problem, fn, bufs);
  if (s.ok()) s = d->check(d->ctx_synchronize(), "kernel execution");
  if (!s.ok()) return r.status = cache::CandidateStatus::launch_failed, r.error = s.message(), r;
  for (std::size_t i = 0; i < cs.specs.size(); ++i) {
    if (cs.specs[i].role != BufferRole::output) continue;
    std::vector<unsigned char> got(cs.dev[i].bytes());
    s = d->check(d->memcpy_dtoh(got.data(), cs.dev[i].ptr(), got.size()), "cuMemcpyDtoH");
    if (!s.ok()) return r.status = cache::CandidateStatus::launch_failed, r.error = s.message(), r;
    const double err = compare(got.data(), cs.host[i].data(), cs.specs[i].dtype, cs.specs[i].elements);
    if (!(err <= tolerance(cs.specs[i].dtype))) {
      r.status = cache::CandidateStatus::wrong_result;
      r.error = "output " + cs.specs[i].name + ": relative L2 error " + (std::isnan(err) ? "NaN (unwritten or non-finite elements)" : std::to_string(err)) +
                " above " + std::to_string(tolerance(cs.specs[i].dtype));
      return r;
    }
  }
  return r;
}

// The timing pool: `sets` copies of every buffer, inputs random, and an L2-sized scratch buffer
// written between launches when the pool alone would stay cache-resident.
struct TimingPool {
  std::vector<std::vector<DeviceMem>> sets;
  DeviceMem scratch;
  bool flush = false;
};

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
        KILN_TRY(fill_random(m, b.dtype, rng));
      else
        KILN_TRY(d->check(d->memset_d8(m.ptr(), 0xFF, m.bytes()), "cuMemsetD8"));
    }
  }
  if (pool->flush) KILN_TRY(pool->scratch.alloc(target));
  return pool;
}

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

// Warm-up, then single launches between two events, rotating over the pool's sets.
// A candidate more than twice as slow as the best so far (best_ms > 0) stops after three timed
// launches: it cannot win, and slow variants would otherwise eat the time budget.
cache::CandidateResult time_candidate(const Family& f, const Params& params, const Problem& p, CUfunction fn,
                                      TimingPool& pool, const TuneOptions& o, double best_ms = 0) {
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
    return launch(f, params, p, fn, bufs);
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
    if (s.ok()) s = launch(f, params, p, fn, bufs);
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

// Halves the bucketed dim until the largest buffer has at most `cap` elements, so the CPU
// reference stays fast; the kernel code is the same, only the grid is smaller.
Problem check_problem_for(const Family& f, const Params& h, const Problem& tp, std::int64_t cap) {
  Problem cp = tp;
  const int bd = f.bucketed_dim();
  if (bd < 0 || bd >= Problem::k_max_dims) return cp;
  auto largest = [&](const Problem& p) {
    std::int64_t m = 0;
    for (const auto& b : f.buffers(h, p)) m = std::max(m, b.elements);
    return m;
  };
  while (cp.dims[bd] > 1 && largest(cp) > cap) cp.dims[bd] = (cp.dims[bd] + 1) / 2;
  return f.check_problem(h, cp).ok() ? cp : tp;
}

std::string layout_key(const std::vector<BufferSpec>& specs) {
  std::string k;
  for (const auto& b : specs) k += b.name + ":" + std::to_string(b.elements) + ":" + dtype_name(b.dtype) + ";";
  return k;
}

std::mutex g_gpu_mu;  // the process-wide half of GpuLock

}  // namespace

Result<std::string> tuning_toolchain(const Family& family, const Problem& problem) {
  static std::mutex mu;
  static std::map<std::string, std::string> memo;  // family name + rendered source -> fingerprint
  KILN_ASSIGN_OR_RETURN(Rendered rendered, family.render(family.heuristic(problem)));
  const std::string memo_key = std::string(family.name()) + "\n" + rendered.source;
  {
    std::lock_guard lock(mu);
    if (auto it = memo.find(memo_key); it != memo.end()) return it->second;
  }
  KILN_ASSIGN_OR_RETURN(Nvrtc * nvrtc, Nvrtc::get());
  KILN_ASSIGN_OR_RETURN(auto closure, TemplateSet::active().closure(rendered.source));
  std::string text = "kiln-tune 1\nnvrtc " + nvrtc->version() + "\nfamily " + std::string(family.name()) + " " +
                     std::to_string(family.version()) + "\ntemplates " + closure.hash + "\noptions";
  for (const auto& o : Nvrtc::base_options()) text += " " + o;
  std::string fp = sha256_hex(text + "\n");
  std::lock_guard lock(mu);
  memo.emplace(memo_key, fp);
  return fp;
}

Result<cache::Setup> tuning_setup(const Family& family, const Problem& problem, const std::string& arch,
                                  const std::string& device_name, const std::string& driver_version) {
  KILN_ASSIGN_OR_RETURN(std::string toolchain, tuning_toolchain(family, problem));
  return cache::Setup{arch, device_name, driver_version, std::move(toolchain)};
}

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

Result<std::unique_ptr<GpuLock>> GpuLock::acquire(const DeviceInfo& device) {
  const auto dir = runtime_dir();
  KILN_TRY(ensure_private_dir(dir));
  std::string name = "gpu-" + device.pci_bus_id + ".lock";
  std::replace(name.begin(), name.end(), ':', '-');
  const auto path = dir / name;
  std::unique_ptr<GpuLock> lock(new GpuLock);
  g_gpu_mu.lock();
  lock->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock->fd_ < 0) {
    Status s = io_error("cannot open the GPU lock " + path.string() + ": " + std::strerror(errno));
    g_gpu_mu.unlock();
    lock->fd_ = -2;  // nothing to release
    return s;
  }
  int rc;
  do rc = ::flock(lock->fd_, LOCK_EX);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) return io_error("cannot lock " + path.string() + ": " + std::strerror(errno));
  return lock;
}

GpuLock::~GpuLock() {
  if (fd_ == -2) return;
  if (fd_ >= 0) ::close(fd_);  // releases the flock
  g_gpu_mu.unlock();
}

Result<cache::TuningRecord> Tuner::tune(const Family& family, const Problem& problem, const TuneOptions& o) {
  const Problem tp = family.tuning_problem(problem);
  const Params heuristic = family.heuristic(tp);
  // Bad input fails here, before anything is compiled or launched.
  KILN_TRY(family.validate(heuristic));
  KILN_TRY(family.check_problem(heuristic, tp));
  KILN_ASSIGN_OR_RETURN(const DeviceInfo* device, device_info(o.device));
  const DeviceInfo& dev = *device;
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
    const Driver* d = Driver::get().value();
    std::mt19937 rng(std::random_device{}());

    std::vector<std::unique_ptr<Loaded>> loaded(cands.size());
    for (std::size_t i : to_build) {
      if (!arts[i]) continue;
      auto l = std::make_unique<Loaded>();
      Status s = d->check(d->module_load_data(&l->module, arts[i]->entry.cubin.data()), "cuModuleLoadData");
      if (s.ok())
        s = d->check(d->module_get_function(&l->function, l->module, arts[i]->entry.lowered_name.c_str()),
                     "cuModuleGetFunction");
      if (s.ok()) s = allow_dynamic_smem(l->function);
      if (!s.ok()) {
        results[i].status = cache::CandidateStatus::launch_failed;
        results[i].error = first_line(s.message());
        continue;
      }
      loaded[i] = std::move(l);
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

Result<AutotuneMode> autotune_mode_from_env() {
  const char* v = std::getenv("KILN_AUTOTUNE");
  if (!v || !*v) return AutotuneMode::off;
  if (auto m = parse_autotune_mode(v)) return *m;
  return invalid_argument(std::string("KILN_AUTOTUNE must be 0, 1 or wait (got '") + v + "')");
}

const char* autotune_mode_name(AutotuneMode m) {
  switch (m) {
    case AutotuneMode::off: return "off";
    case AutotuneMode::background: return "background";
    case AutotuneMode::wait: return "wait";
  }
  return "off";
}

std::optional<AutotuneMode> parse_autotune_mode(const std::string& name) {
  if (name == "0" || name == "off") return AutotuneMode::off;
  if (name == "1" || name == "background") return AutotuneMode::background;
  if (name == "wait") return AutotuneMode::wait;
  return std::nullopt;
}

std::string describe_problem(const Family& family, const Problem& problem) {
  const auto names = family.problem_dims();
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < std::size_t(Problem::k_max_dims); ++i)
    s += (s.empty() ? "" : ",") + names[i] + "=" + std::to_string(problem.dims[i]);
  return s;
}

}  // namespace kiln::jit
