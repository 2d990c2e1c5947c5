// Every RMSNorm variant that can run a shape, timed on that shape: the data behind the heuristic
// (families/rmsnorm) and a preview of what the autotuner will search.
#include <algorithm>
#include <cstdio>

#include "bench/gpu_harness.h"
#include "families/rmsnorm/rmsnorm.h"

namespace kiln::bench {
namespace {

int run(Context& ctx) {
  const Family& f = *Registry::global().find("rmsnorm");
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {
      {4096, 2048}, {4096, 4096}, {32768, 4096}, {4096, 8192}, {4096, 16384}, {4096, 65536}, {16, 4096}};
  if (ctx.quick) shapes = {{32768, 4096}, {4096, 65536}};
  nlohmann::json all = nlohmann::json::array();
  for (auto [tokens, hidden] : shapes) {
    const std::size_t bytes = std::size_t(tokens * hidden) * 2;
    const int sets = rotation_sets(2 * bytes);
    auto hx = random_values(DType::bf16, tokens * hidden, ctx.rng, 2.0f);
    std::vector<std::unique_ptr<DeviceBuffer>> xs, ys;
    for (int s = 0; s < sets; ++s) {
      xs.push_back(std::make_unique<DeviceBuffer>(bytes));
      ys.push_back(std::make_unique<DeviceBuffer>(bytes));
      xs.back()->upload(hx.data());
    }
    DeviceBuffer w(hidden * 2);
    w.upload(hx.data());
    Problem p;
    p.dtype = DType::bf16;
    p.dims = {tokens, hidden, hidden, hidden};
    p.scalars[0] = 1e-6;
    std::vector<std::pair<double, std::string>> results;
    for (const Params& params : f.tuning_space(p)) {
      auto k = ctx.runtime->kernel(KernelSpec{"rmsnorm", params});
      check(k.status(), "kernel");
      double ms = time_events([&](int i) {
        void* b[3] = {xs[i % sets]->get(), w.get(), ys[i % sets]->get()};
        check(ctx.runtime->launch(**k, p, b, nullptr), "launch");
      }, 5, ctx.quick ? 15 : 40);
      results.emplace_back(ms, params.canonical());
    }
    std::sort(results.begin(), results.end());
    const std::string heuristic = f.heuristic(p).canonical();
    double heuristic_ms = 0;
    for (auto& [ms, name] : results) if (name == heuristic) heuristic_ms = ms;
    auto gbs = [&](double ms) { return double(2 * bytes) / (ms * 1e-3) / 1e9; };
    std::printf("%6lldx%-6lld best %-30s %7.1f GB/s (%5.1f%%) | heuristic %-30s %7.1f GB/s | 2nd %s %.1f | 3rd %s %.1f\n",
                (long long)tokens, (long long)hidden, results[0].second.c_str(), gbs(results[0].first),
                100 * gbs(results[0].first) / ctx.copy_gbs, heuristic.c_str(), gbs(heuristic_ms),
                results[1].second.c_str(), gbs(results[1].first), results[2].second.c_str(), gbs(results[2].first));
    nlohmann::json r = {{"tokens", tokens}, {"hidden", hidden}, {"heuristic", heuristic}, {"variants", nlohmann::json::array()}};
    for (auto& [ms, name] : results) r["variants"].push_back({{"variant", name}, {"gbs", gbs(ms)}});
    all.push_back(r);
  }
  (*ctx.out)["rmsnorm_variants"] = all;
  return 0;
}

Register reg("rmsnorm_variants", run);

}  // namespace
}  // namespace kiln::bench
