// LayerNorm forward and backward over LLM shapes (bf16, with bias), contiguous and with rows of
// wider tensors: correctness against the CPU reference first, then bandwidth against the device
// copy of the run, and time against a device copy of the same bytes. Minimal bytes: the forward
// reads x and writes y (weight, bias and the f32 statistics are counted too); the backward reads
// dy and x and writes dx.
#include <algorithm>
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
// A [rows, cols] view of b with rows `stride` elements apart.
TensorView dev_rows(const DeviceBuffer& b, DType t, std::int64_t rows, std::int64_t cols, std::int64_t stride) {
  TensorView v = TensorView::contiguous(b.get(), t, {rows, cols}, Device::cuda(0));
  v.strides[0] = stride;
  return v;
}
TensorView hostv(std::vector<unsigned char>& b, DType t, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(b.data(), t, shape, Device::cpu());
}

struct Shape {
  std::int64_t rows, cols, stride;  // stride: elements between rows of x, y, dy and dx
};

int run(Context& ctx) {
  // Decode to prefill row counts over LLM hidden sizes, and rows of wider tensors (slices of the
  // last dimension; the backward's worst case before it took strided rows).
  std::vector<Shape> shapes;
  for (std::int64_t rows : {1, 16, 77, 1000, 4096, 16384})
    for (std::int64_t cols : {896, 2880, 4096, 8192}) shapes.push_back({rows, cols, cols});
  shapes.push_back({16, 4096, 4160});
  shapes.push_back({4096, 4096, 4160});
  shapes.push_back({16384, 8192, 8256});
  if (ctx.quick) shapes = {{16, 4096, 4096}, {4096, 4096, 4096}, {16384, 8192, 8192}, {16384, 8192, 8256}};
  const DType t = DType::bf16;
  const std::size_t es = 2;
  std::printf("\nlayernorm (bf16, with bias; %%copy: against the copy bandwidth of this run; copy/kiln: a device "
              "copy moving the same bytes, timed alike, over kiln's time)\n%8s %6s %6s %5s %10s %10s %8s %9s %9s\n",
              "rows", "cols", "stride", "pass", "median_us", "GB/s", "%copy", "copy/kiln", "rel_err");
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [rows, cols, stride] : shapes) {
    const std::int64_t n = rows * cols, wide = rows * stride;
    auto hx = random_values(t, n, ctx.rng, 2.0f), hw = random_values(t, cols, ctx.rng),
         hb = random_values(t, cols, ctx.rng), hdy = random_values(t, n, ctx.rng);
    // Rows `stride` apart, the padding zero.
    auto spread = [&](const std::vector<unsigned char>& v) {
      std::vector<unsigned char> w(std::size_t(wide) * es, 0);
      for (std::int64_t r = 0; r < rows; ++r)
        std::copy_n(v.data() + r * cols * es, cols * es, w.data() + r * stride * es);
      return w;
    };
    DeviceBuffer x(wide * es), w(cols * es), b(cols * es), y(wide * es), mean(rows * 4), rstd(rows * 4),
        dy(wide * es), dx(wide * es), dw(cols * es), db(cols * es);
    x.upload(spread(hx).data());
    w.upload(hw.data());
    b.upload(hb.data());
    dy.upload(spread(hdy).data());
    y.poison();
    dx.poison();
    auto bv = dev(b, t, {cols}), mv = dev(mean, DType::f32, {rows}), rv = dev(rstd, DType::f32, {rows}),
         dbv = dev(db, t, {cols});
    auto fwd = [&](int) {
      check(layer_norm(dev_rows(x, t, rows, cols, stride), dev(w, t, {cols}), &bv, dev_rows(y, t, rows, cols, stride),
                       &mv, &rv, 1e-5, nullptr, ctx.runtime),
            "layer_norm");
    };
    auto bwd = [&](int) {
      check(layer_norm_backward(dev_rows(dy, t, rows, cols, stride), dev_rows(x, t, rows, cols, stride),
                                dev(w, t, {cols}), mv, rv, dev_rows(dx, t, rows, cols, stride), dev(dw, t, {cols}),
                                &dbv, nullptr, ctx.runtime),
            "layer_norm_backward");
    };
    fwd(0);
    bwd(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    // The first rows against the CPU ops (fp64 references).
    const std::int64_t cr = std::min<std::int64_t>(rows, 32), cn = cr * cols;
    std::vector<unsigned char> wide_y(wide * es), wide_dx(wide * es), gy(cn * es), gdx(cn * es), wy(cn * es),
        wdx(cn * es), wdw(cols * es), wmean(cr * 4), wrstd(cr * 4);
    y.download(wide_y.data());
    dx.download(wide_dx.data());
    for (std::int64_t r = 0; r < cr; ++r) {
      std::copy_n(wide_y.data() + r * stride * es, cols * es, gy.data() + r * cols * es);
      std::copy_n(wide_dx.data() + r * stride * es, cols * es, gdx.data() + r * cols * es);
    }
    auto hbv = hostv(hb, t, {cols}), hmv = hostv(wmean, DType::f32, {cr}), hrv = hostv(wrstd, DType::f32, {cr});
    check(layer_norm(hostv(hx, t, {cr, cols}), hostv(hw, t, {cols}), &hbv, hostv(wy, t, {cr, cols}), &hmv, &hrv),
          "reference");
    check(layer_norm_backward(hostv(hdy, t, {cr, cols}), hostv(hx, t, {cr, cols}), hostv(hw, t, {cols}), hmv, hrv,
                              hostv(wdx, t, {cr, cols}), hostv(wdw, t, {cols}), nullptr),
          "reference");
    const double err = std::max(rel_l2(gy.data(), wy.data(), t, cn), rel_l2(gdx.data(), wdx.data(), t, cn));
    if (!(err < 1e-2)) {
      std::printf("layernorm %lldx%lld (stride %lld): FAILED against the CPU reference (rel err %.3g)\n",
                  (long long)rows, (long long)cols, (long long)stride, err);
      return 1;
    }
    const int iters = ctx.quick ? 30 : 100;
    // The copy's buffers: as many bytes as the backward moves one way (its half), the larger pass.
    const std::size_t copy_max = std::size_t(3 * n * es + 2 * rows * 4 + 3 * cols * es) / 2 + 16;
    DeviceBuffer copy_src(copy_max), copy_dst(copy_max);
    for (int pass = 0; pass < 2; ++pass) {
      const double ms = pass == 0 ? time_events(fwd, 10, iters) : time_events(bwd, 10, iters);
      const double bytes = pass == 0 ? double(2 * n * es + 2 * cols * es + 2 * rows * 4)
                                     : double(3 * n * es + 2 * rows * 4 + 3 * cols * es);
      // A device copy reading and writing the same bytes in all (half of them each way).
      const std::size_t copy_bytes = std::size_t(bytes / 2) / 16 * 16;
      const double copy_ms = time_events(
          [&](int) {
            check(ctx.driver->memcpy_dtod_async(copy_dst.ptr, copy_src.ptr, copy_bytes, nullptr), "cuMemcpyDtoDAsync");
          },
          10, iters);
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      std::printf("%8lld %6lld %6lld %5s %10.2f %10.1f %7.1f%% %9.2f %9.2e\n", (long long)rows, (long long)cols,
                  (long long)stride, pass == 0 ? "fwd" : "bwd", ms * 1e3, gbs, 100 * gbs / ctx.copy_gbs,
                  copy_ms / ms, err);
      out.push_back({{"rows", rows}, {"cols", cols}, {"stride", stride}, {"pass", pass == 0 ? "fwd" : "bwd"},
                     {"median_us", ms * 1e3}, {"gbs", gbs}, {"fraction_of_copy", gbs / ctx.copy_gbs},
                     {"copy_over_kiln", copy_ms / ms}, {"rel_err", err}});
    }
  }
  (*ctx.out)["layernorm"] = out;
  return 0;
}

Register reg("layernorm", run);

}  // namespace
}  // namespace kiln::bench
