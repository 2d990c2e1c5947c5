// Host-side costs that sit on the request path, measured on the CPU machine (no GPU needed):
// spec canonicalization, key derivation, cache lookup with verification, and the family's share
// of a fast-path launch.
#include <benchmark/benchmark.h>

#include <filesystem>

#include "cache/store.h"
#include "jit/builder.h"
#include "families/rmsnorm/rmsnorm.h"
#include "jit/key.h"
#include "kiln/family.h"

namespace {

using namespace kiln;

void BM_SpecCanonical(benchmark::State& state) {
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}}};
  for (auto _ : state) benchmark::DoNotOptimize(spec.canonical());
}
BENCHMARK(BM_SpecCanonical);

void BM_KeyText(benchmark::State& state) {
  jit::Builder b(nullptr, &Registry::global());
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}}};
  for (auto _ : state) benchmark::DoNotOptimize(b.key_text(spec, "sm_90a"));
}
BENCHMARK(BM_KeyText);

void BM_CacheHit(benchmark::State& state) {
  auto dir = std::filesystem::temp_directory_path() / "kiln-host-bench";
  std::filesystem::remove_all(dir);
  auto store = cache::Store::open(dir / "k.sqlite").value();
  jit::Builder b(store.get(), &Registry::global());
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}}};
  if (!b.get(spec, "sm_90a").ok()) {
    state.SkipWithError("NVRTC unavailable");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(b.get(spec, "sm_90a"));
  std::filesystem::remove_all(dir);
}
BENCHMARK(BM_CacheHit)->Unit(benchmark::kMicrosecond);

// The family's share of a fast-path hit (Runtime::run after the first call): packing the kernel
// arguments of the decode-sized RMSNorm (1 x 4096 bf16) for the variant the runtime holds, with
// the handle bound when the kernel was loaded (one call through the plugin ABI).
void BM_FastPathPackArgs(benchmark::State& state) {
  const Family& f = *Registry::global().find("rmsnorm");
  Problem p = Problem::of(DType::bf16, 16,
                          families::RmsNormProblem{
                              .rows = 1, .cols = 4096, .x_row_stride = 4096, .y_row_stride = 4096, .eps = 1e-6});
  p.sm_count = 132;
  const Params params = f.heuristic(p);
  const void* bound = f.bind(params);
  int x, w, y;
  void* bufs[4] = {&x, &w, &y, nullptr};
  for (auto _ : state) {
    ArgPack args;
    f.pack_bound(bound, params, p, bufs, args);
    benchmark::DoNotOptimize(args.pointers());
  }
}
BENCHMARK(BM_FastPathPackArgs);

}  // namespace

BENCHMARK_MAIN();
