// Attention forward (bf16): first a small causal GQA problem and a packed one against the CPU
// reference (outputs poisoned, so an unwritten element fails), then B4 H32 S4096 D128, B2 H16
// S8192 D128, B4 H32 S4096 D64 and B2 H16 S4096 D256, full and causal, timed with CUDA events after
// warm-up. TFLOP/s = 4 B H S^2 D / time (QK^T and PV), half that for causal.
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench/gpu_harness.h"
#include "families/attention/ops.h"

namespace kiln::bench {
namespace {

TensorView dev(const DeviceBuffer& b, DType t, std::initializer_list<std::int64_t> s) {
  return TensorView::contiguous(b.get(), t, s, Device::cuda(0));
}
TensorView host(std::vector<unsigned char>& b, DType t, std::initializer_list<std::int64_t> s) {
  return TensorView::contiguous(b.data(), t, s, Device::cpu());
}

// GPU against the CPU reference at a small shape; the relative L2 error of out.
double check_padded(Context& ctx, bool causal) {
  const std::int64_t b = 2, s = 300, h = 8, hk = 2, d = 128, n = b * s * h * d, nk = b * s * hk * d;
  const DType t = DType::bf16;
  auto hq = random_values(t, n, ctx.rng), hk_ = random_values(t, nk, ctx.rng), hv = random_values(t, nk, ctx.rng);
  DeviceBuffer q(n * 2), k(nk * 2), v(nk * 2), o(n * 2);
  q.upload(hq.data());
  k.upload(hk_.data());
  v.upload(hv.data());
  o.poison();
  AttentionOptions opt;
  opt.causal = causal;
  check(attention(dev(q, t, {b, s, h, d}), dev(k, t, {b, s, hk, d}), dev(v, t, {b, s, hk, d}), dev(o, t, {b, s, h, d}),
                  nullptr, opt, nullptr, ctx.runtime),
        "attention");
  check(ctx.driver->ctx_synchronize(), "sync");
  std::vector<unsigned char> got(n * 2), want(n * 2);
  o.download(got.data());
  check(attention(host(hq, t, {b, s, h, d}), host(hk_, t, {b, s, hk, d}), host(hv, t, {b, s, hk, d}),
                  host(want, t, {b, s, h, d}), nullptr, opt),
        "attention (cpu)");
  return rel_l2(got.data(), want.data(), t, n);
}

int run(Context& ctx) {
  nlohmann::json rows = nlohmann::json::array();
  for (bool causal : {false, true}) {
    const double err = check_padded(ctx, causal);
    if (!(err < 1e-2)) {
      std::printf("attention %s: FAILED against the CPU reference (rel err %.3g)\n", causal ? "causal" : "full", err);
      return 1;
    }
    std::printf("attention check (B2 S300 H8/2 D128 bf16 %s): rel err %.2e\n", causal ? "causal" : "full", err);
  }
  struct Shape {
    std::int64_t b, h, s, d;
  };
  std::vector<Shape> shapes = {{4, 32, 4096, 128}, {2, 16, 8192, 128}, {4, 32, 4096, 64}, {2, 16, 4096, 256}};
  if (ctx.quick) shapes = {{4, 32, 4096, 128}, {2, 16, 4096, 256}};
  std::printf("\nattention forward (bf16)\n%3s %4s %6s %5s %7s %10s %9s\n", "B", "H", "S", "D", "causal", "median_us",
              "TFLOP/s");
  const DType t = DType::bf16;
  for (const auto& [b, h, s, d] : shapes) {
    const std::int64_t n = b * s * h * d;
    auto base = random_values(t, std::min<std::int64_t>(n, std::int64_t(1) << 22), ctx.rng);
    std::vector<unsigned char> hx(std::size_t(n) * 2);
    for (std::size_t i = 0; i < hx.size(); ++i) hx[i] = base[i % base.size()];
    DeviceBuffer q(n * 2), k(n * 2), v(n * 2), o(n * 2);
    q.upload(hx.data());
    k.upload(hx.data());
    v.upload(hx.data());
    for (bool causal : {false, true}) {
      AttentionOptions opt;
      opt.causal = causal;
      auto call = [&](int) {
        check(attention(dev(q, t, {b, s, h, d}), dev(k, t, {b, s, h, d}), dev(v, t, {b, s, h, d}),
                        dev(o, t, {b, s, h, d}), nullptr, opt, nullptr, ctx.runtime),
              "attention");
      };
      call(0);
      check(ctx.driver->ctx_synchronize(), "sync");
      const double ms = time_events(call, 5, ctx.quick ? 10 : 30);
      const double flops = 4.0 * double(b) * double(h) * double(s) * double(s) * double(d) * (causal ? 0.5 : 1.0);
      const double tflops = flops / (ms * 1e-3) / 1e12;
      std::printf("%3lld %4lld %6lld %5lld %7s %10.1f %9.1f\n", (long long)b, (long long)h, (long long)s, (long long)d,
                  causal ? "yes" : "no", ms * 1e3, tflops);
      rows.push_back({{"batch", b}, {"heads", h}, {"seq", s}, {"head_dim", d}, {"causal", causal},
                      {"median_us", ms * 1e3}, {"tflops", tflops}});
    }
  }
  (*ctx.out)["attention"] = rows;
  return 0;
}

Register reg("attention", run);

}  // namespace
}  // namespace kiln::bench
