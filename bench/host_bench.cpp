// Host-side costs that sit on the request path, measured on the CPU machine (no GPU needed):
// spec canonicalization, key derivation, cache lookup with verification.
#include <benchmark/benchmark.h>

#include <filesystem>

#include "cache/store.h"
#include "jit/builder.h"
#include "jit/key.h"
#include "kiln/family.h"

namespace {

using namespace kiln;

void BM_SpecCanonical(benchmark::State& state) {
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}}};
  for (auto _ : state) benchmark::DoNotOptimize(spec.canonical());
}
BENCHMARK(BM_SpecCanonical);

void BM_KeyText(benchmark::State& state) {
  jit::Builder b(nullptr, &Registry::global());
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}}};
  for (auto _ : state) benchmark::DoNotOptimize(b.key_text(spec, "sm_90a"));
}
BENCHMARK(BM_KeyText);

void BM_CacheHit(benchmark::State& state) {
  auto dir = std::filesystem::temp_directory_path() / "kiln-host-bench";
  std::filesystem::remove_all(dir);
  auto store = cache::Store::open(dir / "k.sqlite").value();
  jit::Builder b(store.get(), &Registry::global());
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}}};
  if (!b.get(spec, "sm_90a").ok()) {
    state.SkipWithError("NVRTC unavailable");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(b.get(spec, "sm_90a"));
  std::filesystem::remove_all(dir);
}
BENCHMARK(BM_CacheHit)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
