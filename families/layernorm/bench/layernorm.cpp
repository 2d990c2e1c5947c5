// LayerNorm forward and backward over LLM and encoder shapes (bf16, with bias): correctness
// against the CPU reference first, then bandwidth against the device copy. Minimal bytes: the
// forward reads x and writes y (weight, bias and the f32 statistics are counted too); the
// backward reads dy and x and writes dx.
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "bench/gpu_harness.h"
#include "common/half.h"
#include "families/layernorm/ops.h"

namespace kiln::bench {
namespace {

TensorView dev(const DeviceBuffer& b, DType t, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(b.get(), t, shape, Device::cuda(0));
}
TensorView hostv(std::vector<unsigned char>& b, DType t, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(b.data(), t, shape, Device::cpu());
}

int run(Context& ctx) {
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  for (std::int64_t rows : {1, 4096, 32768})
    for (std::int64_t cols : {768, 1024, 2048, 4096, 8192}) shapes.emplace_back(rows, cols);
  if (ctx.quick) shapes = {{4096, 1024}, {4096, 4096}, {32768, 4096}};
  const DType t = DType::bf16;
  std::printf("\nlayernorm (bf16, with bias)\n%8s %6s %5s %10s %10s %8s %9s\n", "rows", "cols", "pass", "median_us",
              "GB/s", "%copy", "rel_err");
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [rows, cols] : shapes) {
    const std::int64_t n = rows * cols;
    auto hx = random_values(t, n, ctx.rng, 2.0f), hw = random_values(t, cols, ctx.rng),
         hb = random_values(t, cols, ctx.rng), hdy = random_values(t, n, ctx.rng);
    DeviceBuffer x(n * 2), w(cols * 2), b(cols * 2), y(n * 2), mean(rows * 4), rstd(rows * 4), dy(n * 2), dx(n * 2),
        dw(cols * 2), db(cols * 2);
    x.upload(hx.data());
    w.upload(hw.data());
    b.upload(hb.data());
    dy.upload(hdy.data());
    y.poison();
    dx.poison();
    auto bv = dev(b, t, {cols}), mv = dev(mean, DType::f32, {rows}), rv = dev(rstd, DType::f32, {rows}),
         dbv = dev(db, t, {cols});
    auto fwd = [&](int) {
      check(layer_norm(dev(x, t, {rows, cols}), dev(w, t, {cols}), &bv, dev(y, t, {rows, cols}), &mv, &rv, 1e-5,
                       nullptr, ctx.runtime),
            "layer_norm");
    };
    auto bwd = [&](int) {
      check(layer_norm_backward(dev(dy, t, {rows, cols}), dev(x, t, {rows, cols}), dev(w, t, {cols}), mv, rv,
                                dev(dx, t, {rows, cols}), dev(dw, t, {cols}), &dbv, nullptr, ctx.runtime),
            "layer_norm_backward");
    };
    fwd(0);
    bwd(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    // The first rows against the CPU ops (fp64 references).
    const std::int64_t cr = std::min<std::int64_t>(rows, 32), cn = cr * cols;
    std::vector<unsigned char> gy(n * 2), gdx(n * 2), gmean(rows * 4), grstd(rows * 4), wy(cn * 2), wdx(cn * 2),
        wdw(cols * 2), wmean(cr * 4), wrstd(cr * 4);
    y.download(gy.data());
    dx.download(gdx.data());
    mean.download(gmean.data());
    rstd.download(grstd.data());
    auto hbv = hostv(hb, t, {cols}), hmv = hostv(wmean, DType::f32, {cr}), hrv = hostv(wrstd, DType::f32, {cr});
    check(layer_norm(hostv(hx, t, {cr, cols}), hostv(hw, t, {cols}), &hbv, hostv(wy, t, {cr, cols}), &hmv, &hrv),
          "reference");
    check(layer_norm_backward(hostv(hdy, t, {cr, cols}), hostv(hx, t, {cr, cols}), hostv(hw, t, {cols}), hmv, hrv,
                              hostv(wdx, t, {cr, cols}), hostv(wdw, t, {cols}), nullptr),
          "reference");
    const double err = std::max(rel_l2(gy.data(), wy.data(), t, cn), rel_l2(gdx.data(), wdx.data(), t, cn));
    if (!(err < 1e-2)) {
      std::printf("layernorm %lldx%lld: FAILED against the CPU reference (rel err %.3g)\n", (long long)rows,
                  (long long)cols, err);
      return 1;
    }
    for (int pass = 0; pass < 2; ++pass) {
      const double ms = pass == 0 ? time_events(fwd, 10, ctx.quick ? 30 : 100) : time_events(bwd, 10, ctx.quick ? 30 : 100);
      const double bytes = pass == 0 ? double(2 * n * 2 + 2 * cols * 2 + 2 * rows * 4)
                                     : double(3 * n * 2 + 2 * rows * 4 + 3 * cols * 2);
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      std::printf("%8lld %6lld %5s %10.2f %10.1f %7.1f%% %9.2e\n", (long long)rows, (long long)cols,
                  pass == 0 ? "fwd" : "bwd", ms * 1e3, gbs, 100 * gbs / ctx.copy_gbs, err);
      out.push_back({{"rows", rows}, {"cols", cols}, {"pass", pass == 0 ? "fwd" : "bwd"}, {"median_us", ms * 1e3},
                     {"gbs", gbs}, {"fraction_of_copy", gbs / ctx.copy_gbs}, {"rel_err", err}});
    }
  }
  (*ctx.out)["layernorm"] = out;
  return 0;
}

Register reg("layernorm", run);

}  // namespace
}  // namespace kiln::bench
