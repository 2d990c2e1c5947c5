// RMSNorm forward over LLM shapes (bf16): correctness against the CPU reference, then bandwidth.
#include <cmath>
#include <cstdio>

#include "bench/gpu_harness.h"
#include "common/half.h"
#include "families/rmsnorm/rmsnorm.h"
#include "jit/device_info.h"

namespace kiln::bench {
namespace {

int run(Context& ctx) {
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  for (std::int64_t tokens : {1, 16, 512, 4096, 32768})
    for (std::int64_t hidden : {2048, 4096, 5120, 8192, 16384}) shapes.emplace_back(tokens, hidden);
  shapes.emplace_back(1, 65536);
  shapes.emplace_back(16, 65536);
  shapes.emplace_back(4096, 65536);
  if (ctx.quick) shapes = {{1, 4096}, {4096, 4096}, {32768, 4096}, {4096, 65536}};
  const Family& f = *Registry::global().find("rmsnorm");
  // The device facts the runtime puts in the typed op's problem, for the variant printed.
  const jit::DeviceInfo* dev = jit::device_info(0).value();
  std::printf("%8s %7s %10s %10s %8s %9s %9s\n", "tokens", "hidden", "median_us", "GB/s", "%copy", "rel_err", "variant");
  nlohmann::json rows = nlohmann::json::array();
  for (auto [tokens, hidden] : shapes) {
    const std::int64_t elems = tokens * hidden;
    const std::size_t bytes = std::size_t(elems) * 2;
    const int sets = rotation_sets(2 * bytes);
    auto hx = random_values(DType::bf16, elems, ctx.rng, 2.0f);
    auto hw = random_values(DType::bf16, hidden, ctx.rng);
    std::vector<std::unique_ptr<DeviceBuffer>> xs, ys;
    for (int s = 0; s < sets; ++s) {
      xs.push_back(std::make_unique<DeviceBuffer>(bytes));
      ys.push_back(std::make_unique<DeviceBuffer>(bytes));
      xs.back()->upload(hx.data());
      ys.back()->poison();
    }
    DeviceBuffer w(hidden * 2);
    w.upload(hw.data());
    auto view = [&](const DeviceBuffer& b, std::initializer_list<std::int64_t> shape) {
      return TensorView::contiguous(b.get(), DType::bf16, shape, Device::cuda(0));
    };
    auto call = [&](int i) {
      const int s = i % sets;
      check(rms_norm(view(*xs[s], {tokens, hidden}), view(w, {hidden}), view(*ys[s], {tokens, hidden}), 1e-6, nullptr,
                     ctx.runtime),
            "rms_norm");
    };
    call(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    const std::int64_t check_rows = std::min<std::int64_t>(tokens, 64);
    std::vector<unsigned char> got(bytes), want(check_rows * hidden * 2);
    ys[0]->download(got.data());
    const Problem p = Problem::of(DType::bf16, 16,
                                  families::RmsNormProblem{.rows = check_rows, .cols = hidden, .x_row_stride = hidden,
                                                           .y_row_stride = hidden, .eps = 1e-6});
    void* refb[3] = {hx.data(), hw.data(), want.data()};
    check(f.cpu_reference(f.heuristic(p), p, refb), "reference");
    const double err = rel_l2(got.data(), want.data(), DType::bf16, check_rows * hidden);
    bool all_written = true;
    for (std::int64_t i = 0; i < elems && all_written; i += 97) all_written = !std::isnan(load_as_double(got.data(), DType::bf16, i));
    if (!(err < 1e-2) || !all_written) {
      std::printf("rmsnorm %lldx%lld: FAILED against the CPU reference (rel err %.3g, all written %d)\n",
                  (long long)tokens, (long long)hidden, err, all_written);
      return 1;
    }
    const double ms = time_events(call, 10, ctx.quick ? 30 : 100);
    const double gbs = double(2 * bytes + hidden * 2) / (ms * 1e-3) / 1e9;
    // The variant the typed op picks: its problem carries the device's SM count and compute
    // capability.
    Problem hp = Problem::of(DType::bf16, 16,
                             families::RmsNormProblem{.rows = tokens, .cols = hidden, .x_row_stride = hidden,
                                                      .y_row_stride = hidden, .eps = 1e-6});
    jit::set_device(hp, *dev);
    const Params chosen = f.heuristic(hp);
    std::printf("%8lld %7lld %10.2f %10.1f %7.1f%% %9.2e %9s\n", (long long)tokens, (long long)hidden, ms * 1e3, gbs,
                100 * gbs / ctx.copy_gbs, err, chosen.canonical().c_str());
    rows.push_back({{"tokens", tokens}, {"hidden", hidden}, {"median_us", ms * 1e3}, {"gbs", gbs},
                    {"fraction_of_copy", gbs / ctx.copy_gbs}, {"rel_err", err}, {"variant", chosen.canonical()}});
  }
  (*ctx.out)["rmsnorm"] = rows;
  return 0;
}

Register reg("rmsnorm", run);

}  // namespace
}  // namespace kiln::bench
