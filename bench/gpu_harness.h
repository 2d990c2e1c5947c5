// The GPU benchmark harness: shared timing and buffer helpers, and a registry of per-family
// benchmark sections (families/<name>/bench/*.cpp, bench/gpu/*.cpp), all run by kiln_bench_gpu in one process so that
// every figure sits beside the copy bandwidth measured in the same run.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "jit/driver.h"
#include "kiln/ops.h"

namespace kiln::bench {

// Exits the process with a message when a call fails: a benchmark with a failed step is void.
void check(CUresult rc, const char* what);
void check(const Status& s, const char* what);

double median(std::vector<double> v);
double percentile(std::vector<double> v, double q);

// Median milliseconds of CUDA-event intervals around `fn(i)` on the default stream, after
// `warmup` untimed calls, each interval preceded by a 256 MiB memset (L2 flushed, GPU busy when
// the start event is enqueued: triton.testing.do_bench's method, so the PyTorch anchors compare
// like with like). Pass an index-dependent fn to rotate inputs as well.
double time_events(const std::function<void(int)>& fn, int warmup, int iters);

// Milliseconds per call over back-to-back calls (the GPU never idles between them, so no launch
// latency is timed, and no flush's write-back either): `warmup` calls, then the median of 5 runs
// of `iters` calls. fn(i) takes input set i % sets, where the sets together exceed L2
// (rotation_sets), as the shape sweep does.
double time_back_to_back(const std::function<void(int)>& fn, int warmup, int iters);

// The split counts the decode benches sweep beside their heuristic's: 1 to 128, at most `tiles`.
std::vector<std::int64_t> split_counts_to_sweep(std::int64_t tiles);

// Times `run(value)` for each of `values` (one untimed call, then time_events(3 warm-up, 15
// timed)) and keeps the fastest in (best, best_us) where it beats what they hold; µs.
void keep_fastest(const std::vector<std::int64_t>& values, const std::function<void(std::int64_t)>& run,
                  std::int64_t& best, double& best_us);

// Host microseconds per call of `fn`: the median over n/64 batches of 64 back-to-back calls, with
// the GPU drained between batches so that the launch queue never fills.
double host_us_per_call(const std::function<void()>& fn, int n);

// A device allocation (cuMemAlloc), freed on destruction.
struct DeviceBuffer {
  CUdeviceptr ptr = 0;
  std::size_t bytes = 0;
  explicit DeviceBuffer(std::size_t n);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  void* get() const { return reinterpret_cast<void*>(ptr); }
  void upload(const void* src);
  void download(void* dst) const;
  void poison();  // 0xFF bytes: NaN in every float type
};

// n normally distributed values of dtype t (f32, f16, bf16), as raw bytes.
std::vector<unsigned char> random_values(DType t, std::int64_t n, std::mt19937& rng, float scale = 1.0f);
// ||got - want|| / ||want|| over n elements of dtype t; NaN if got holds a NaN.
double rel_l2(const void* got, const void* want, DType t, std::int64_t n);

// How many input sets a shape needs so that one pass over all of them exceeds L2 (1 .. 64).
int rotation_sets(std::size_t bytes_per_set);

struct Context {
  const jit::Driver* driver = nullptr;
  Runtime* runtime = nullptr;  // embedded runtime on a private cache
  std::mt19937 rng;
  bool quick = false;        // fewer shapes and iterations
  double copy_gbs = 0;       // device-to-device copy bandwidth, this run
  nlohmann::json* out = nullptr;  // write your section's results under (*out)[name]
};

using Section = std::function<int(Context&)>;  // returns 0, or nonzero after printing why

// Registers a section; sections run in name order after the common measurements.
struct Register {
  Register(const char* name, Section fn);
};

}  // namespace kiln::bench

namespace kiln::bench {
// Runs every registered section (or only the one named), in name order; nonzero if any failed.
int run_sections(Context& ctx, const std::string& only);
}  // namespace kiln::bench
