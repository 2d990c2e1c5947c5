// Fused add + RMSNorm over LLM shapes (bf16), vLLM-style in place on the residual
// (residual_out = residual, y separate): correctness against the CPU reference, then bandwidth.
// Minimal bytes: read x and residual, write y and residual_out (the weight is counted once).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "bench/gpu_harness.h"
#include "common/half.h"
#include "families/add_rmsnorm/add_rmsnorm.h"

namespace kiln::bench {
namespace {

// Random bf16 rows, the first 256 distinct and then repeated: fresh data every run without
// drawing gigabytes of normals on the host.
std::vector<unsigned char> random_rows(Context& ctx, std::int64_t rows, std::int64_t cols) {
  const std::int64_t distinct = std::min<std::int64_t>(rows, 256);
  const std::size_t row_bytes = std::size_t(cols) * 2;
  auto base = random_values(DType::bf16, distinct * cols, ctx.rng, 2.0f);
  std::vector<unsigned char> out(std::size_t(rows) * row_bytes);
  for (std::int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + r * row_bytes, base.data() + (r % distinct) * row_bytes, row_bytes);
  return out;
}

int run(Context& ctx) {
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  for (std::int64_t tokens : {1, 16, 512, 4096, 32768})
    for (std::int64_t hidden : {2048, 4096, 8192, 16384}) shapes.emplace_back(tokens, hidden);
  shapes.emplace_back(4096, 65536);
  if (ctx.quick) shapes = {{1, 4096}, {4096, 4096}, {32768, 4096}, {4096, 65536}};
  const Family& f = *Registry::global().find("add_rmsnorm");
  std::printf("\nadd_rmsnorm (bf16, residual in place)\n%8s %7s %10s %10s %8s %9s %18s\n", "tokens", "hidden",
              "median_us", "GB/s", "%copy", "rel_err", "variant");
  nlohmann::json rows = nlohmann::json::array();
  for (auto [tokens, hidden] : shapes) {
    const std::int64_t elems = tokens * hidden;
    const std::size_t bytes = std::size_t(elems) * 2;
    const int sets = rotation_sets(3 * bytes);
    auto hx = random_rows(ctx, tokens, hidden);
    auto hr = random_rows(ctx, tokens, hidden);
    auto hw = random_values(DType::bf16, hidden, ctx.rng);
    std::vector<std::unique_ptr<DeviceBuffer>> xs, rs, ys;
    for (int s = 0; s < sets; ++s) {
      xs.push_back(std::make_unique<DeviceBuffer>(bytes));
      rs.push_back(std::make_unique<DeviceBuffer>(bytes));
      ys.push_back(std::make_unique<DeviceBuffer>(bytes));
      xs.back()->upload(hx.data());
      rs.back()->upload(hr.data());
      ys.back()->poison();
    }
    DeviceBuffer w(hidden * 2);
    w.upload(hw.data());
    auto view = [&](const DeviceBuffer& b, std::initializer_list<std::int64_t> shape) {
      return TensorView::contiguous(b.get(), DType::bf16, shape, Device::cuda(0));
    };
    auto call = [&](int i) {
      const int s = i % sets;
      const TensorView r = view(*rs[s], {tokens, hidden});
      check(add_rms_norm(view(*xs[s], {tokens, hidden}), r, view(w, {hidden}), view(*ys[s], {tokens, hidden}), r, 1e-6,
                         nullptr, ctx.runtime),
            "add_rms_norm");
    };
    call(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    const std::int64_t check_rows = std::min<std::int64_t>(tokens, 64);
    std::vector<unsigned char> got_y(bytes), got_h(bytes), want_y(check_rows * hidden * 2),
        want_h(check_rows * hidden * 2);
    ys[0]->download(got_y.data());
    rs[0]->download(got_h.data());
    auto contiguous = [&](std::int64_t rows) {
      return Problem::of(DType::bf16, 16,
                         families::AddRmsNormProblem{.rows = rows, .cols = hidden, .x_row_stride = hidden,
                                                     .residual_row_stride = hidden, .y_row_stride = hidden,
                                                     .residual_out_row_stride = hidden, .eps = 1e-6});
    };
    const Problem p = contiguous(check_rows);
    void* refb[5] = {hx.data(), hr.data(), hw.data(), want_y.data(), want_h.data()};
    check(f.cpu_reference(f.heuristic(p), p, refb), "reference");
    const double err = rel_l2(got_y.data(), want_y.data(), DType::bf16, check_rows * hidden);
    const double err_h = rel_l2(got_h.data(), want_h.data(), DType::bf16, check_rows * hidden);
    bool all_written = true;
    for (std::int64_t i = 0; i < elems && all_written; i += 97)
      all_written = !std::isnan(load_as_double(got_y.data(), DType::bf16, i));
    if (!(err < 1e-2) || err_h != 0 || !all_written) {
      std::printf("add_rmsnorm %lldx%lld: FAILED against the CPU reference (y rel err %.3g, residual rel err %.3g, "
                  "all written %d)\n",
                  (long long)tokens, (long long)hidden, err, err_h, all_written);
      return 1;
    }
    const double ms = time_events(call, 10, ctx.quick ? 30 : 100);
    const double gbs = double(4 * bytes + hidden * 2) / (ms * 1e-3) / 1e9;
    const Params chosen = f.heuristic(contiguous(tokens));
    std::printf("%8lld %7lld %10.2f %10.1f %7.1f%% %9.2e %18s\n", (long long)tokens, (long long)hidden, ms * 1e3, gbs,
                100 * gbs / ctx.copy_gbs, err, chosen.canonical().c_str());
    rows.push_back({{"tokens", tokens}, {"hidden", hidden}, {"median_us", ms * 1e3}, {"gbs", gbs},
                    {"fraction_of_copy", gbs / ctx.copy_gbs}, {"rel_err", err}, {"variant", chosen.canonical()}});
  }
  (*ctx.out)["add_rmsnorm"] = rows;
  return 0;
}

Register reg("add_rmsnorm", run);

}  // namespace
}  // namespace kiln::bench
