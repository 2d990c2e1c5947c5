// The GPU half of the conformance test (docs/plugins.md): for every registered family (built-in,
// the example plugin loaded from its .so, the C fixture plugin, and whatever KILN_PLUGIN_PATH
// adds), the heuristic's variant for each of the family's benchmark problems, in every dtype it
// supports, matches the family's CPU reference: fresh random inputs (normal floats; u8 inputs
// without an index bound, which are e4m3 operands in every family, as the e4m3 codes of normal
// values; other integer inputs uniform below their index bound), outputs poisoned with NaN bytes on both sides, so an element
// the kernel never writes fails. Tolerance per output dtype: relative L2 error 1e-5 (f32), 2e-3
// (f16), 1e-2 (bf16); integer outputs exact. Problems over k_max_elements (all buffers together)
// (3 x 2^24) are left out so the CPU reference stays quick; the test prints what it checked and left out.
// For the families listed at the end, every tuning candidate of this device as well
// (ConformanceGpuTuning).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "common/fp8.h"
#include "common/half.h"
#include "jit/device_info.h"
#include "jit/driver.h"
#include "tests/conformance/conformance_util.h"
#include "tests/gpu_util.h"

namespace kiln::testing {
namespace {

constexpr std::int64_t k_max_elements = std::int64_t(3) << 24;  // 4096 x 4096 in and out fits

std::vector<unsigned char> random_input(const BufferSpec& b, std::mt19937& rng) {
  if (is_floating(b.dtype)) return random_bytes(b.dtype, b.elements, rng);
  if (b.dtype == DType::u8 && b.index_bound == 0) {
    // Arbitrary bytes would include e4m3's NaN codes and magnitudes whose products overflow f16.
    std::vector<unsigned char> out(std::size_t(b.elements));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& c : out) c = float_to_e4m3(normal(rng));
    return out;
  }
  std::vector<unsigned char> out(std::size_t(b.elements) * dtype_size(b.dtype));
  std::uniform_int_distribution<std::int64_t> dist(0, (b.index_bound > 0 ? b.index_bound : 1000) - 1);
  for (std::int64_t i = 0; i < b.elements; ++i) store_from_double(out.data(), b.dtype, i, double(dist(rng)));
  return out;
}

// Relative L2 error over the finite elements either side wrote (both NaN: a gap neither writes,
// such as the space between strided rows); an element only one side wrote counts as a mismatch,
// and so does an infinity (an lse of no key, say) the other side does not have with its sign.
struct Compared {
  double rel_l2 = 0;
  std::int64_t one_sided = 0;
  std::int64_t infinities_differ = 0;
};
Compared compare(const void* got, const void* want, DType t, std::int64_t n) {
  double num = 0, den = 0;
  Compared c;
  for (std::int64_t i = 0; i < n; ++i) {
    const double g = load_as_double(got, t, i), w = load_as_double(want, t, i);
    if (std::isnan(g) && std::isnan(w)) continue;
    if (std::isnan(g) || std::isnan(w)) {
      ++c.one_sided;
      continue;
    }
    if (std::isinf(g) || std::isinf(w)) {
      if (g != w) ++c.infinities_differ;
      continue;
    }
    num += (g - w) * (g - w);
    den += w * w;
  }
  c.rel_l2 = den == 0 ? std::sqrt(num) : std::sqrt(num / den);
  return c;
}

class ConformanceGpu : public GpuFixture, public ::testing::WithParamInterface<std::string> {
 protected:
  // Launches variant v on problem p with fresh random inputs and compares its outputs with the CPU
  // reference; false (nothing checked) when the problem is over k_max_elements.
  bool check_variant(const Family& f, const Params& v, const Problem& p) {
    const jit::Driver* d = jit::Driver::get().value();
    const std::string what = std::string(f.name()) + "(" + v.canonical() + ") on " + f.signature(p) + " (seed " +
                             std::to_string(seed_) + ")";
    EXPECT_TRUE(f.check_problem(v, p).ok()) << what;
    const auto specs = f.buffers(v, p);
    std::int64_t total = 0;
    for (const auto& b : specs) total += b.elements;
    if (total > k_max_elements) return false;
    std::vector<std::vector<unsigned char>> want;
    std::vector<std::unique_ptr<DeviceBuffer>> dev;
    std::vector<void*> host_ptrs, dev_ptrs;
    for (const auto& b : specs) {
      const std::size_t bytes = std::size_t(b.elements) * dtype_size(b.dtype);
      want.push_back(b.role == BufferRole::input ? random_input(b, rng_) : std::vector<unsigned char>(bytes, 0xFF));
      dev.push_back(std::make_unique<DeviceBuffer>(bytes));
      if (b.role == BufferRole::input) dev.back()->upload(want.back().data());
      else dev.back()->poison();
      host_ptrs.push_back(want.back().data());
      dev_ptrs.push_back(dev.back()->get());
    }
    auto k = rt_->kernel(KernelSpec{std::string(f.name()), v});
    EXPECT_TRUE(k.ok()) << what << ": " << k.status().to_string();
    if (!k.ok()) return true;
    Status s = rt_->launch(**k, p, dev_ptrs, nullptr);
    EXPECT_TRUE(s.ok()) << what << ": " << s.to_string();
    EXPECT_EQ(d->ctx_synchronize(), CUDA_SUCCESS) << what;
    s = f.cpu_reference(v, p, host_ptrs);
    EXPECT_TRUE(s.ok()) << what << ": " << s.to_string();
    for (std::size_t i = 0; i < specs.size(); ++i) {
      if (specs[i].role != BufferRole::output) continue;
      std::vector<unsigned char> got(want[i].size());
      dev[i]->download(got.data());
      const Compared c = compare(got.data(), want[i].data(), specs[i].dtype, specs[i].elements);
      EXPECT_EQ(c.one_sided, 0) << what << ": " << specs[i].name << " has elements only one side wrote";
      EXPECT_EQ(c.infinities_differ, 0) << what << ": " << specs[i].name << " has infinities on one side only";
      const double tol = is_floating(specs[i].dtype) ? tolerance(specs[i].dtype) : 0.0;
      EXPECT_LE(c.rel_l2, tol) << what << ": " << specs[i].name << " (" << dtype_name(specs[i].dtype) << ")";
    }
    return true;
  }
};

TEST_P(ConformanceGpu, HeuristicVariantsMatchTheCpuReference) {
  const Family& f = *Registry::global().find(GetParam());
  int checked = 0, left_out = 0;
  for (DType dtype : family_dtypes(f))
    for (const Problem& p : f.benchmark_problems(dtype)) {
      if (check_variant(f, f.heuristic(p), p)) ++checked;
      else ++left_out;
      if (::testing::Test::HasFatalFailure()) return;
    }
  std::printf("%s: %d problems checked, %d left out (over %lld elements)\n", GetParam().c_str(), checked, left_out,
              static_cast<long long>(k_max_elements));
  EXPECT_GT(checked, 0) << GetParam() << ": no benchmark problem small enough to check";
}

// `kiln tune` may pick any candidate of the tuning space, so the families whose candidates run
// different code (not only other tile sizes of one loop) have every candidate checked too, on the
// first benchmark problem that fits, with this device's facts (the attention backward's sm_90a
// kernel is a candidate on compute capability 9.0 only).
class ConformanceGpuTuning : public ConformanceGpu {};

TEST_P(ConformanceGpuTuning, EveryTuningCandidateMatchesTheCpuReference) {
  const Family* f = Registry::global().find(GetParam());
  ASSERT_NE(f, nullptr) << GetParam() << " is not registered";
  auto info = jit::device_info(0);
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  int checked = 0;
  for (DType dtype : family_dtypes(*f)) {
    for (Problem p : f->benchmark_problems(dtype)) {
      // The tuning space `kiln tune` times on this device (kernels for its compute capability
      // included).
      jit::set_device(p, **info);
      for (const Params& v : f->tuning_space(p))
        if (check_variant(*f, v, p)) ++checked;
      if (checked > 0) break;
    }
    if (checked > 0) break;
  }
  std::printf("%s: %d tuning candidates checked\n", GetParam().c_str(), checked);
  EXPECT_GT(checked, 1) << GetParam() << ": fewer than two candidates checked";
}

INSTANTIATE_TEST_SUITE_P(SplitKeyFamilies, ConformanceGpuTuning,
                         ::testing::Values(std::string("attention_splitkv"), std::string("paged_decode"),
                                           std::string("rmsnorm_bwd_rows"), std::string("layernorm_bwd_rows"),
                                           std::string("attention_bwd")),
                         [](const auto& info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(AllFamilies, ConformanceGpu, ::testing::ValuesIn(conformance_families()),
                         [](const auto& info) { return info.param; });

// The example plugin must be among them when it was built: the families above came from its .so.
TEST(ConformanceGpuPlugins, TheExamplePluginIsCovered) {
  const Family* f = Registry::global().find("softcap");
  ASSERT_NE(f, nullptr) << "the example plugin did not load: "
                        << (register_test_plugins().skipped.empty() ? "" : register_test_plugins().skipped[0].reason);
  EXPECT_NE(f->plugin()->path, plugin::k_builtin_path);
}

}  // namespace
}  // namespace kiln::testing
