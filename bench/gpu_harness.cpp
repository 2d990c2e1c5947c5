#include "bench/gpu_harness.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "common/half.h"

namespace kiln::bench {
namespace {

const jit::Driver& drv() { return *jit::Driver::get().value(); }

std::map<std::string, Section>& sections() {
  static std::map<std::string, Section> s;
  return s;
}

}  // namespace

void check(CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS) {
    std::fprintf(stderr, "%s\n", drv().check(rc, what).to_string().c_str());
    std::exit(1);
  }
}

void check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.to_string().c_str());
    std::exit(1);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, std::size_t(q * double(v.size())))];
}

double time_events(const std::function<void(int)>& fn, int warmup, int iters) {
  CUevent a, b;
  check(drv().event_create(&a, CU_EVENT_DEFAULT), "cuEventCreate");
  check(drv().event_create(&b, CU_EVENT_DEFAULT), "cuEventCreate");
  // Before each timed call the GPU clears a 256 MiB buffer (as triton.testing.do_bench does): L2
  // then holds none of the inputs, and the GPU is busy when the start event is enqueued, so the
  // interval measures the kernel, not the host's launch latency after an idle GPU.
  static DeviceBuffer flush(256u << 20);
  for (int i = 0; i < warmup; ++i) fn(i);
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    check(drv().memset_d8_async(flush.ptr, 0, flush.bytes, nullptr), "cuMemsetD8Async");
    check(drv().event_record(a, nullptr), "cuEventRecord");
    fn(warmup + i);
    check(drv().event_record(b, nullptr), "cuEventRecord");
    check(drv().event_synchronize(b), "cuEventSynchronize");
    float ms = 0;
    check(drv().event_elapsed_time(&ms, a, b), "cuEventElapsedTime");
    t.push_back(ms);
  }
  drv().event_destroy(a);
  drv().event_destroy(b);
  return median(t);
}

double time_back_to_back(const std::function<void(int)>& fn, int warmup, int iters) {
  CUevent a, b;
  check(drv().event_create(&a, CU_EVENT_DEFAULT), "cuEventCreate");
  check(drv().event_create(&b, CU_EVENT_DEFAULT), "cuEventCreate");
  for (int i = 0; i < warmup; ++i) fn(i);
  std::vector<double> t;
  for (int r = 0; r < 5; ++r) {
    check(drv().event_record(a, nullptr), "cuEventRecord");
    for (int i = 0; i < iters; ++i) fn(warmup + r * iters + i);
    check(drv().event_record(b, nullptr), "cuEventRecord");
    check(drv().event_synchronize(b), "cuEventSynchronize");
    float ms = 0;
    check(drv().event_elapsed_time(&ms, a, b), "cuEventElapsedTime");
    t.push_back(double(ms) / iters);
  }
  drv().event_destroy(a);
  drv().event_destroy(b);
  return median(t);
}

std::vector<std::int64_t> split_counts_to_sweep(std::int64_t tiles) {
  std::vector<std::int64_t> out;
  for (std::int64_t n : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128})
    if (n <= tiles) out.push_back(n);
  return out;
}

void keep_fastest(const std::vector<std::int64_t>& values, const std::function<void(std::int64_t)>& run,
                  std::int64_t& best, double& best_us) {
  for (std::int64_t value : values) {
    run(value);
    check(drv().ctx_synchronize(), "sync");
    const double us = time_events([&](int) { run(value); }, 3, 15) * 1e3;
    if (us < best_us) {
      best_us = us;
      best = value;
    }
  }
}

double host_us_per_call(const std::function<void()>& fn, int n) {
  // Short batches with a synchronize between them (not timed): a long run of launches fills the
  // driver's launch queue, and the host then waits for the GPU, so the figure would be the
  // kernel's GPU throughput rather than the host's cost per call.
  using Clock = std::chrono::steady_clock;
  constexpr int k_batch = 64;
  std::vector<double> reps;
  for (int r = 0; r < std::max(1, n / k_batch); ++r) {
    check(drv().ctx_synchronize(), "cuCtxSynchronize");
    auto t0 = Clock::now();
    for (int i = 0; i < k_batch; ++i) fn();
    reps.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / k_batch);
  }
  check(drv().ctx_synchronize(), "cuCtxSynchronize");
  return median(reps);
}

DeviceBuffer::DeviceBuffer(std::size_t n) : bytes(n) { check(drv().mem_alloc(&ptr, n ? n : 1), "cuMemAlloc"); }
DeviceBuffer::~DeviceBuffer() { drv().mem_free(ptr); }
void DeviceBuffer::upload(const void* src) { check(drv().memcpy_htod(ptr, src, bytes), "cuMemcpyHtoD"); }
void DeviceBuffer::download(void* dst) const { check(drv().memcpy_dtoh(dst, ptr, bytes), "cuMemcpyDtoH"); }
void DeviceBuffer::poison() { check(drv().memset_d8(ptr, 0xFF, bytes), "cuMemsetD8"); }

std::vector<unsigned char> random_values(DType t, std::int64_t n, std::mt19937& rng, float scale) {
  std::vector<unsigned char> v(std::size_t(n) * dtype_size(t));
  std::normal_distribution<float> d(0.0f, scale);
  for (std::int64_t i = 0; i < n; ++i) store_from_double(v.data(), t, i, d(rng));
  return v;
}

double rel_l2(const void* got, const void* want, DType t, std::int64_t n) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double g = load_as_double(got, t, i), w = load_as_double(want, t, i);
    if (std::isnan(g)) return NAN;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

int rotation_sets(std::size_t bytes_per_set) {
  return int(std::clamp<std::size_t>((256u << 20) / (bytes_per_set + 1), 1, 64));
}

Register::Register(const char* name, Section fn) { sections().emplace(name, std::move(fn)); }

int run_sections(Context& ctx, const std::string& only) {
  int rc = 0;
  for (auto& [name, fn] : sections()) {
    // `only`: one section name or several, comma-separated.
    if (!only.empty() && ("," + only + ",").find("," + name + ",") == std::string::npos) continue;
    std::printf("\n== %s ==\n", name.c_str());
    std::fflush(stdout);
    if (fn(ctx) != 0) rc = 1;
  }
  return rc;
}

}  // namespace kiln::bench
