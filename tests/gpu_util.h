// GPU test helpers over the driver API: device buffers, random fills, a skip when no GPU exists.
#pragma once

#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <vector>

#include <execinfo.h>
#include <unistd.h>

#include "common/half.h"
#include "jit/driver.h"
#include "kiln/runtime.h"
#include "tests/test_util.h"

namespace kiln::testing {

// Skips the calling test (reported as skipped, never as passed) when there is no usable GPU.
#define KILN_REQUIRE_GPU()                                                        \
  do {                                                                            \
    auto kiln_ctx_ = ::kiln::jit::current_context();                              \
    if (!kiln_ctx_.ok()) GTEST_SKIP() << "no usable GPU: " << kiln_ctx_.status().to_string(); \
  } while (0)

class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    const jit::Driver* d = jit::Driver::get().value();
    EXPECT_TRUE(d->check(d->mem_alloc(&ptr_, bytes ? bytes : 1), "cuMemAlloc").ok());
  }
  ~DeviceBuffer() { jit::Driver::get().value()->mem_free(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  void* get() const { return reinterpret_cast<void*>(ptr_); }
  void upload(const void* src) { EXPECT_EQ(jit::Driver::get().value()->memcpy_htod(ptr_, src, bytes_), CUDA_SUCCESS); }
  void download(void* dst) const { EXPECT_EQ(jit::Driver::get().value()->memcpy_dtoh(dst, ptr_, bytes_), CUDA_SUCCESS); }
  // Fills every byte with 0xFF: NaN for f32/f16/bf16, so an element never written fails the check.
  void poison() { EXPECT_EQ(jit::Driver::get().value()->memset_d8(ptr_, 0xFF, bytes_), CUDA_SUCCESS); }

 private:
  CUdeviceptr ptr_ = 0;
  std::size_t bytes_;
};

// n random normal values of dtype t as raw bytes.
inline std::vector<unsigned char> random_bytes(DType t, std::int64_t n, std::mt19937& rng, float scale = 1.0f) {
  std::vector<unsigned char> out(std::size_t(n) * dtype_size(t));
  std::normal_distribution<float> dist(0.0f, scale);
  for (std::int64_t i = 0; i < n; ++i) store_from_double(out.data(), t, i, dist(rng));
  return out;
}

// ||got - want|| and ||want|| over the given element indices; the first is NaN if any got is NaN.
struct L2Norms {
  double diff, want;
};
inline L2Norms l2_norms(const void* got, const void* want, DType t, const std::vector<std::int64_t>& idx) {
  double num = 0, den = 0;
  for (auto i : idx) {
    double g = load_as_double(got, t, i), w = load_as_double(want, t, i);
    if (std::isnan(g)) return {NAN, std::sqrt(den)};
    num += (g - w) * (g - w);
    den += w * w;
  }
  return {std::sqrt(num), std::sqrt(den)};
}

// Relative L2 error of `got` against `want` over the given element indices; NaN if any got is NaN.
inline double rel_l2(const void* got, const void* want, DType t, const std::vector<std::int64_t>& idx) {
  const L2Norms n = l2_norms(got, want, t, idx);
  return n.want == 0 ? n.diff : n.diff / n.want;
}

// GPU tests run on a lent machine without a debugger: a crash prints the stack to stderr (resolve
// the +0x offsets with `addr2line -f -C -e <test binary> <offset>` on the build machine) and then
// dies of the same signal.
inline void print_stack_and_die(int sig) {
  static const char msg[] = "\n*** fatal signal in a GPU test binary; stack:\n";
  (void)!write(2, msg, sizeof msg - 1);
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
inline const bool k_stack_on_crash = [] {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, print_stack_and_die);
  return true;
}();

// The fixture every GPU test shares: skips without a GPU; an embedded runtime on a private cache
// (also KILN_CACHE_DIR for anything else the test starts); a fresh seed per test, printed by the
// checks that use it. When KILN_GPU_TEST_CACHE names a prewarmed cache file (scripts/gpu_run.sh
// sets it), the private cache starts as a copy of it, so the tests do not spend minutes compiling
// the catalogs one variant at a time; tests about compiling override seed_cache() to start empty.
class GpuFixture : public ::testing::Test {
 protected:
  virtual bool seed_cache() const { return true; }
  void SetUp() override {
    KILN_REQUIRE_GPU();
    env_ = std::make_unique<ScopedEnv>("KILN_CACHE_DIR", dir_.path().string());
    const char* seed = std::getenv("KILN_GPU_TEST_CACHE");
    if (seed_cache() && seed && *seed) {
      std::error_code ec;
      std::filesystem::copy_file(seed, dir_.path() / "k.sqlite", ec);
      ASSERT_FALSE(ec) << "copying KILN_GPU_TEST_CACHE " << seed << ": " << ec.message();
    }
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    o.cache_file = (dir_.path() / "k.sqlite").string();
    rt_ = Runtime::create(o).value();
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }
  TempDir dir_;
  std::unique_ptr<ScopedEnv> env_;
  std::shared_ptr<Runtime> rt_;
  unsigned seed_ = 0;
  std::mt19937 rng_;
};

inline double tolerance(DType t) { return t == DType::f32 ? 1e-5 : t == DType::f16 ? 2e-3 : 1e-2; }

}  // namespace kiln::testing
