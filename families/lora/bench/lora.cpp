// Fused LoRA (bf16): lora_linear at LLM projection shapes (M 8192 and 16, K 4096, N 4096 rank 16; N
// 14336 rank 64; M 4096), and lora_linear_multi for a decode batch of 16 rows over 16 adapters
// (ranks 16 and 64) against the same batch on one adapter. Sampled outputs are checked against fp64 first (outputs
// poisoned before the first call), then timed; TFLOP/s counts the base GEMM's 2 M N K. The cuBLAS
// base GEMM and PyTorch's eager base + adapter are timed on the same shapes by
// families/lora/bench/lora.py in the same run (bench/torch_anchors.py), which gives the ratios.
#include <cmath>
#include <cstdio>

#include "bench/gpu_harness.h"
#include "common/half.h"
#include "families/lora/ops.h"

namespace kiln::bench {
namespace {

struct Shape {
  const char* name;
  std::int64_t m, n, k, r;
};

// out[i, j] in fp64 for sampled (i, j).
double expect_at(const std::vector<unsigned char>& x, const std::vector<unsigned char>& w,
                 const std::vector<unsigned char>& a, const std::vector<unsigned char>& b, std::int64_t k,
                 std::int64_t r, double s, std::int64_t i, std::int64_t j) {
  const DType t = DType::bf16;
  double base = 0;
  for (std::int64_t c = 0; c < k; ++c) base += load_as_double(x.data(), t, i * k + c) * load_as_double(w.data(), t, j * k + c);
  double low = 0;
  for (std::int64_t q = 0; q < r; ++q) {
    double xa = 0;
    for (std::int64_t c = 0; c < k; ++c) xa += load_as_double(x.data(), t, i * k + c) * load_as_double(a.data(), t, q * k + c);
    low += xa * load_as_double(b.data(), t, j * r + q);
  }
  return base + s * low;
}

int linear(Context& ctx, nlohmann::json& rows) {
  std::vector<Shape> shapes = {{"llama_4096_r16", 8192, 4096, 4096, 16},
                               {"llama_mlp_up_r64", 8192, 14336, 4096, 64},
                               {"m4096_r16", 4096, 4096, 4096, 16},
                               {"decode16_r16", 16, 4096, 4096, 16}};
  if (ctx.quick) shapes = {shapes[0], shapes[3]};
  const auto cuda = Device::cuda(0);
  const DType t = DType::bf16;
  const double s = 2.0;
  std::printf("\nlora_linear (bf16)\n%-20s %6s %6s %6s %4s %10s %9s %9s\n", "shape", "m", "n", "k", "r", "us", "TFLOP/s",
              "rel_err");
  for (const Shape& sh : shapes) {
    auto x = random_values(t, sh.m * sh.k, ctx.rng);
    auto w = random_values(t, sh.n * sh.k, ctx.rng, float(1.0 / std::sqrt(double(sh.k))));
    auto a = random_values(t, sh.r * sh.k, ctx.rng, float(1.0 / std::sqrt(double(sh.k))));
    auto b = random_values(t, sh.n * sh.r, ctx.rng, float(1.0 / std::sqrt(double(sh.r))));
    DeviceBuffer dx(x.size()), dw(w.size()), da(a.size()), db(b.size()), dout(std::size_t(sh.m * sh.n) * 2);
    dx.upload(x.data());
    dw.upload(w.data());
    da.upload(a.data());
    db.upload(b.data());
    check(ctx.driver->memset_d8(dout.ptr, 0xFF, dout.bytes), "poison");
    auto call = [&](int) {
      check(lora_linear(TensorView::contiguous(dx.get(), t, {sh.m, sh.k}, cuda),
                        TensorView::contiguous(dw.get(), t, {sh.n, sh.k}, cuda),
                        TensorView::contiguous(da.get(), t, {sh.r, sh.k}, cuda),
                        TensorView::contiguous(db.get(), t, {sh.n, sh.r}, cuda), nullptr,
                        TensorView::contiguous(dout.get(), t, {sh.m, sh.n}, cuda), s, 0, 0, nullptr, ctx.runtime),
            "lora_linear");
    };
    call(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    std::vector<unsigned char> got(dout.bytes);
    dout.download(got.data());
    double num = 0, den = 0;
    for (int q = 0; q < 64; ++q) {
      const std::int64_t i = std::int64_t(ctx.rng() % std::uint64_t(sh.m)), j = std::int64_t(ctx.rng() % std::uint64_t(sh.n));
      const double want = expect_at(x, w, a, b, sh.k, sh.r, s, i, j), g = load_as_double(got.data(), t, i * sh.n + j);
      num += (g - want) * (g - want);
      den += want * want;
    }
    const double err = std::sqrt(num / den);
    if (!(err < 1e-2)) {
      std::printf("lora_linear %s: relative error %.3g against fp64\n", sh.name, err);
      return 1;
    }
    const double sec = time_events(call, 5, ctx.quick ? 20 : 50) * 1e-3;  // time_events: milliseconds
    const double tflops = 2.0 * double(sh.m) * double(sh.n) * double(sh.k) / sec / 1e12;
    std::printf("%-20s %6lld %6lld %6lld %4lld %10.1f %9.1f %9.2g\n", sh.name, (long long)sh.m, (long long)sh.n,
                (long long)sh.k, (long long)sh.r, sec * 1e6, tflops, err);
    rows.push_back({{"kind", "lora_linear"}, {"shape", sh.name}, {"m", sh.m}, {"n", sh.n}, {"k", sh.k}, {"r", sh.r},
                    {"us", sec * 1e6}, {"tflops", tflops}, {"rel_err", err}});
  }
  return 0;
}

// A decode batch: 16 rows, K 4096, N 4096, a stack of 16 adapters of rank r; every row on its
// own adapter against every row on adapter 0.
int multi(Context& ctx, nlohmann::json& rows, std::int64_t r) {
  const std::int64_t m = 16, n = 4096, k = 4096, adapters = 16;
  const auto cuda = Device::cuda(0);
  const DType t = DType::bf16;
  auto x = random_values(t, m * k, ctx.rng);
  auto w = random_values(t, n * k, ctx.rng, 1.0f / 64);
  auto a = random_values(t, adapters * r * k, ctx.rng, 1.0f / 64);
  auto b = random_values(t, adapters * n * r, ctx.rng, 1.0f / 8);
  std::vector<std::int32_t> spread(m), one(m, 0), ranks(adapters, std::int32_t(r));
  for (std::int64_t i = 0; i < m; ++i) spread[i] = std::int32_t(i % adapters);
  std::vector<float> scales(adapters, 1.0f);
  DeviceBuffer dx(x.size()), dw(w.size()), da(a.size()), db(b.size()), dout(std::size_t(m * n) * 2), dspread(m * 4),
      done(m * 4), dranks(adapters * 4), dscales(adapters * 4);
  dx.upload(x.data());
  dw.upload(w.data());
  da.upload(a.data());
  db.upload(b.data());
  dspread.upload(spread.data());
  done.upload(one.data());
  dranks.upload(ranks.data());
  dscales.upload(scales.data());
  auto call = [&](const DeviceBuffer& idx) {
    return [&](int) {
      check(lora_linear_multi(TensorView::contiguous(dx.get(), t, {m, k}, cuda),
                              TensorView::contiguous(dw.get(), t, {n, k}, cuda),
                              TensorView::contiguous(da.get(), t, {adapters, r, k}, cuda),
                              TensorView::contiguous(db.get(), t, {adapters, n, r}, cuda),
                              TensorView::contiguous(idx.get(), DType::i32, {m}, cuda),
                              TensorView::contiguous(dranks.get(), DType::i32, {adapters}, cuda),
                              TensorView::contiguous(dscales.get(), DType::f32, {adapters}, cuda), nullptr,
                              TensorView::contiguous(dout.get(), t, {m, n}, cuda), 0, 0, nullptr, ctx.runtime),
            "lora_linear_multi");
    };
  };
  // time_events: milliseconds.
  const double t16 = time_events(call(dspread), 5, 50) * 1e-3, t1 = time_events(call(done), 5, 50) * 1e-3;
  std::printf("\nlora_linear_multi decode (16 rows, K 4096, N 4096, rank %lld)\n16 adapters %8.1f us, one adapter %8.1f us, "
              "ratio %.2f\n",
              (long long)r, t16 * 1e6, t1 * 1e6, t16 / t1);
  rows.push_back({{"kind", "lora_multi_decode"}, {"m", m}, {"n", n}, {"k", k}, {"r", r}, {"us_16_adapters", t16 * 1e6},
                  {"us_1_adapter", t1 * 1e6}, {"ratio", t16 / t1}});
  return 0;
}

int run(Context& ctx) {
  nlohmann::json rows = nlohmann::json::array();
  int rc = linear(ctx, rows);
  for (std::int64_t r : {16, 64})
    if (rc == 0) rc = multi(ctx, rows, r);
  (*ctx.out)["lora"] = rows;
  return rc;
}

Register reg("lora", run);

}  // namespace
}  // namespace kiln::bench
