// Attention forward (bf16): first small GQA problems (head dims 64, 128, 256; full and causal)
// against the CPU reference (outputs poisoned, so an unwritten element fails), then B4 H32 S4096
// D128, B2 H16 S8192 D128, B4 H32 S4096 D64 and B2 H16 S4096 D256, full and causal, timed with CUDA
// events after warm-up. TFLOP/s = 4 B H S^2 D / time (QK^T and PV), half that for causal. Each row
// names the variant that ran (the heuristic's on this device: path wgmma is the sm_90a kernel,
// mma the sm_80 one). With KILN_BENCH_ATTENTION_VARIANTS=1 (after the rest) or =only (alone),
// every variant of the tuning space at the same shapes, launched by its params: the key tiles and
// schedules (overlap, pingpong) of the sm_90a kernel beside the sm_80 kernel's tiles, the data
// behind the heuristic (=masks: the same at causal windows of 128-4096 keys, alone). Their correctness is
// the GPU tests' job (attention_sm90_gpu_test.cpp).
// Then decode (run_decode below): one query against 8k and 32k keys, in GB/s of K and V read, the
// heuristic's split count beside the best of a sweep of counts; KILN_BENCH_ATTENTION_PART=decode
// runs decode alone, =backward the backward alone, =masks the sliding windows and packed documents
// (run_masks below) alone.
//
// The backward (bf16): first small problems
// (head dims 64 and 128, GQA, full and causal, both modes) against the CPU reference with poisoned
// gradients, then B4 H32 S4096 D128, B2 H16 S8192 D128 and B4 H32 S4096 D64, full and causal, fast
// and deterministic, out and lse from kiln's forward. TFLOP/s = 2.5 x the forward's count
// (10 B H S^2 D: five S^2-sized GEMMs against the forward's two), half for causal. D256 has no GPU
// backward and prints no row.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench/gpu_harness.h"
#include "families/attention/attention.h"
#include "families/attention/attention_splitkv.h"
#include "families/attention/attention_bwd.h"
#include "families/attention/ops.h"
#include "jit/device_info.h"

namespace kiln::bench {
namespace {

TensorView dev(const DeviceBuffer& b, DType t, std::initializer_list<std::int64_t> s) {
  return TensorView::contiguous(b.get(), t, s, Device::cuda(0));
}
TensorView host(std::vector<unsigned char>& b, DType t, std::initializer_list<std::int64_t> s) {
  return TensorView::contiguous(b.data(), t, s, Device::cpu());
}

// n random 16-bit values for the timed shapes: a block of up to 2^22 drawn once, repeated (drawing
// every element of the largest shapes would take longer than timing them).
std::vector<unsigned char> tiled_values(DType t, std::int64_t n, std::mt19937& rng) {
  const auto base = random_values(t, std::min<std::int64_t>(n, std::int64_t(1) << 22), rng);
  std::vector<unsigned char> out(std::size_t(n) * 2);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = base[i % base.size()];
  return out;
}

// GPU against the CPU reference at a small shape; the relative L2 error of out.
double check_padded(Context& ctx, bool causal, std::int64_t d) {
  const std::int64_t b = 2, s = 300, h = 8, hk = 2, n = b * s * h * d, nk = b * s * hk * d;
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

// A padded bf16 problem on this device: B x S queries and keys, H query and KV key/value heads of
// D, causal or not, a causal window of `window` keys (0: none).
Problem padded_problem(std::int64_t b, std::int64_t h, std::int64_t hk, std::int64_t s, std::int64_t d, bool causal,
                       std::int64_t window = 0) {
  families::AttentionProblem a;
  a.batch = b;
  a.seqlen_q = a.seqlen_k = s;
  a.total_q = a.total_k = b * s;
  a.heads = h;
  a.kv_heads = hk;
  a.head_dim = a.head_dim_v = d;
  a.causal = causal;
  a.window_left = window > 0 ? window - 1 : -1;
  a.window_right = causal ? 0 : -1;
  a.scale = 1.0 / std::sqrt(double(d));
  Problem p = Problem::of(DType::bf16, 16, a);
  jit::set_device(p, *jit::device_info(0).value());
  return p;
}

// The variant the runtime runs for a padded problem on this device (no tuned entries in the
// bench's private cache: the heuristic's).
std::string variant(std::int64_t b, std::int64_t h, std::int64_t hk, std::int64_t s, std::int64_t d, bool causal) {
  const Family* f = Registry::global().find("attention");
  return f ? f->heuristic(padded_problem(b, h, hk, s, d, causal)).canonical() : std::string("?");
}

// Every tuning-space variant at the benchmark shapes (see the header), or with `masks` at causal
// windows of 128-4096 keys at B2 H32 S8192 D128 (TFLOP/s on the window's work, 4 B H S W D, as
// run_masks counts it).
int variants(Context& ctx, nlohmann::json& rows, bool masks) {
  const Family& f = *Registry::global().find("attention");
  struct Case {
    std::int64_t b, h, hk, s, d;
    bool causal;
    std::int64_t window;  // keys a query sees, causal; 0: no window
  };
  std::vector<Case> cases;
  if (masks) {
    for (std::int64_t w : {128, 256, 512, 1024, 2048, 4096}) cases.push_back({2, 32, 32, 8192, 128, true, w});
  } else {
    for (const auto& [b, h, s, d] : std::vector<std::array<std::int64_t, 4>>{
             {4, 32, 4096, 128}, {2, 16, 8192, 128}, {4, 32, 4096, 64}, {2, 16, 4096, 256}})
      for (bool causal : {false, true}) cases.push_back({b, h, h, s, d, causal, 0});
  }
  std::printf("\nattention variants (bf16; median of rounds, spread = (max - min) / median)\n%3s %4s %4s %6s %5s %7s "
              "%6s %10s %9s %7s  %s\n",
              "B", "H", "KV", "S", "D", "causal", "window", "median_us", "TFLOP/s", "spread", "variant");
  const DType t = DType::bf16;
  for (const auto& [b, h, hk, s, d, causal, window] : cases) {
    const std::int64_t n = b * s * h * d, nk = b * s * hk * d;
    const auto hx = tiled_values(t, n, ctx.rng);
    DeviceBuffer q(n * 2), k(nk * 2), v(nk * 2), o(n * 2), cu(4);
    q.upload(hx.data());
    k.upload(hx.data());
    v.upload(hx.data());
    const Problem p = padded_problem(b, h, hk, s, d, causal, window);
    const Params heuristic = f.heuristic(p);
    void* ptrs[7] = {q.get(), k.get(), v.get(), cu.get(), cu.get(), o.get(), nullptr};
    const double flops = window > 0 ? 4.0 * double(b) * double(h) * double(s) * double(window) * double(d)
                                    : 4.0 * double(b) * double(h) * double(s) * double(s) * double(d) *
                                          (causal ? 0.5 : 1.0);
    // Rounds over the variants, each timing every variant once in a fresh random order, and the
    // median of a variant's rounds: the clock drifts with the load (a GPU cooled by slow variants
    // boosts for the next ones), and a fixed order would hand that to the same variants each round.
    const auto vars = f.tuning_space(p);
    const auto t_load = std::chrono::steady_clock::now();
    std::vector<std::function<void(int)>> calls;
    for (const Params& var : vars) {
      auto kern = ctx.runtime->kernel(KernelSpec{"attention", var});
      check(kern.status(), "kernel");
      const Kernel* kp = *kern;
      calls.push_back([&ctx, kp, p, ptrs](int) mutable { check(ctx.runtime->launch(*kp, p, ptrs, nullptr), "launch"); });
      calls.back()(0);
    }
    check(ctx.driver->ctx_synchronize(), "sync");
    const auto t_time = std::chrono::steady_clock::now();
    const int rounds = ctx.quick ? 2 : 4;
    std::vector<std::vector<double>> us(vars.size());
    std::vector<std::size_t> order(vars.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    for (int r = 0; r < rounds; ++r) {
      std::shuffle(order.begin(), order.end(), ctx.rng);
      for (std::size_t i : order) us[i].push_back(time_events(calls[i], 1, 7) * 1e3);
    }
    const auto t_end = std::chrono::steady_clock::now();
    std::printf("(%zu variants: loaded and launched once in %.1f s, timed in %.1f s)\n", vars.size(),
                std::chrono::duration<double>(t_time - t_load).count(),
                std::chrono::duration<double>(t_end - t_time).count());
    for (std::size_t i = 0; i < vars.size(); ++i) {
      const Params& var = vars[i];
      const auto [lo_it, hi_it] = std::minmax_element(us[i].begin(), us[i].end());
      const double med = median(us[i]), spread = (*hi_it - *lo_it) / med;
      const double tflops = flops / (med * 1e-6) / 1e12;
      std::printf("%3lld %4lld %4lld %6lld %5lld %7s %6lld %10.1f %9.1f %6.1f%%  %s%s\n", (long long)b, (long long)h,
                  (long long)hk, (long long)s, (long long)d, causal ? "yes" : "no", (long long)window, med, tflops,
                  100 * spread, var.canonical().c_str(), var == heuristic ? "  (heuristic)" : "");
      rows.push_back({{"kind", "variant"}, {"batch", b}, {"heads", h}, {"kv_heads", hk}, {"seq", s},
                      {"head_dim", d}, {"causal", causal}, {"window", window}, {"median_us", med},
                      {"spread", spread}, {"tflops", tflops}, {"variant", var.canonical()},
                      {"heuristic", var == heuristic}});
    }
  }
  return 0;
}

// Decode: B x H32/KV8 x 1 query x lk keys x D128 (bf16), the heuristic's path (its split count
// shown; 0: the one-pass kernel) beside the one-pass kernel (decode_splits -1). GB/s counts the
// K and V bytes read once (B * lk * KV * 2 * D * 2 bytes) over the median time, and %copy puts
// it beside the device copy bandwidth of this run. First a check of the heuristic's path
// against the CPU reference at B2 H32/KV8 lq 1 lk 4097.
int run_decode(Context& ctx, nlohmann::json& rows) {
  const DType t = DType::bf16;
  {
    const std::int64_t b = 2, h = 32, hk = 8, d = 128, lk = 4097, nq = b * h * d, nk = b * lk * hk * d;
    auto hq = random_values(t, nq, ctx.rng), hk_ = random_values(t, nk, ctx.rng), hv = random_values(t, nk, ctx.rng);
    DeviceBuffer q(nq * 2), k(nk * 2), v(nk * 2), o(nq * 2);
    q.upload(hq.data());
    k.upload(hk_.data());
    v.upload(hv.data());
    o.poison();
    check(attention(dev(q, t, {b, 1, h, d}), dev(k, t, {b, lk, hk, d}), dev(v, t, {b, lk, hk, d}),
                    dev(o, t, {b, 1, h, d}), nullptr, {}, nullptr, ctx.runtime),
          "attention decode");
    check(ctx.driver->ctx_synchronize(), "sync");
    std::vector<unsigned char> got(nq * 2), want(nq * 2);
    o.download(got.data());
    check(attention(host(hq, t, {b, 1, h, d}), host(hk_, t, {b, lk, hk, d}), host(hv, t, {b, lk, hk, d}),
                    host(want, t, {b, 1, h, d}), nullptr, {}),
          "attention decode (cpu)");
    const double err = rel_l2(got.data(), want.data(), t, nq);
    if (!(err < 1e-2)) {
      std::printf("attention decode: FAILED against the CPU reference (rel err %.3g)\n", err);
      return 1;
    }
    std::printf("\nattention decode check (B2 H32/8 lq 1 lk 4097 D128 bf16): rel err %.2e\n", err);
  }
  struct Shape {
    std::int64_t b, lk;
  };
  std::vector<Shape> shapes = {{1, 8192}, {1, 32768}, {8, 8192}, {8, 32768}, {64, 8192}, {64, 32768}, {256, 8192}};
  if (ctx.quick) shapes = {{1, 32768}, {8, 8192}, {64, 8192}};
  const std::int64_t h = 32, hk = 8, d = 128;
  auto info = jit::device_info(0);
  const std::int64_t sms = info.ok() ? (*info)->sm_count : 0;
  std::printf("\nattention decode (bf16, H32/KV8, lq 1, D128)\n%3s %6s %7s %10s %8s %6s %14s %8s %6s %11s %8s\n",
              "B", "lk", "splits", "median_us", "GB/s", "%copy", "one-pass_us", "GB/s", "%copy", "best_splits",
              "best_us");
  for (const auto& [b, lk] : shapes) {
    const std::int64_t nq = b * h * d, nk = b * lk * hk * d;
    const auto hx = tiled_values(t, nk, ctx.rng);
    DeviceBuffer q(nq * 2), k(nk * 2), v(nk * 2), o(nq * 2);
    q.upload(hx.data());
    k.upload(hx.data());
    v.upload(hx.data());
    families::AttentionProblem a;
    a.batch = b;
    a.seqlen_q = 1;
    a.seqlen_k = lk;
    a.total_q = b;
    a.total_k = b * lk;
    a.heads = h;
    a.kv_heads = hk;
    a.head_dim = a.head_dim_v = d;
    a.scale = 1.0 / std::sqrt(double(d));
    const std::int64_t splits = families::attention_decode_splits(a, sms, info.ok() ? (*info)->compute_capability : 0);
    const double bytes = double(nk) * 2 * 2;  // K and V
    // decode_splits 0: the heuristic's path; -1: the one-pass kernel; n: n splits.
    auto call = [&](std::int64_t decode_splits) {
      AttentionOptions opt;
      opt.decode_splits = decode_splits;
      check(attention(dev(q, t, {b, 1, h, d}), dev(k, t, {b, lk, hk, d}), dev(v, t, {b, lk, hk, d}),
                      dev(o, t, {b, 1, h, d}), nullptr, opt, nullptr, ctx.runtime),
            "attention decode");
    };
    double us[2];
    for (int i = 0; i < 2; ++i) {
      call(i == 0 ? 0 : -1);
      check(ctx.driver->ctx_synchronize(), "sync");
      us[i] = time_events([&](int) { call(i == 0 ? 0 : -1); }, 5, ctx.quick ? 10 : 30) * 1e3;
    }
    // The heuristic's split count against the best of a sweep of counts.
    double best_us = us[0];
    std::int64_t best_splits = splits;
    if (!ctx.quick) keep_fastest(split_counts_to_sweep((lk + 63) / 64), call, best_splits, best_us);
    const double gbs = bytes / (us[0] * 1e-6) / 1e9, gbs1 = bytes / (us[1] * 1e-6) / 1e9;
    std::printf("%3lld %6lld %7lld %10.1f %8.0f %5.0f%% %14.1f %8.0f %5.0f%% %11lld %8.1f\n", (long long)b,
                (long long)lk, (long long)splits, us[0], gbs, 100 * gbs / ctx.copy_gbs, us[1], gbs1,
                100 * gbs1 / ctx.copy_gbs, (long long)best_splits, best_us);
    rows.push_back({{"batch", b}, {"heads", h}, {"kv_heads", hk}, {"seqlen_q", 1}, {"seqlen_k", lk}, {"head_dim", d},
                    {"splits", splits}, {"median_us", us[0]}, {"gbs", gbs}, {"fraction_of_copy", gbs / ctx.copy_gbs},
                    {"one_pass_us", us[1]}, {"one_pass_gbs", gbs1},
                    {"best_swept_splits", best_splits}, {"best_swept_us", best_us}});
  }
  return 0;
}

// Masks that skip key tiles: first a causal sliding window (B2 S300 H8/2 D128, window 100) and
// packed causal documents of uneven lengths against the CPU reference, then at B2 H32 S8192 D128
// a causal sliding window of 256, 1024 and 4096 keys (TFLOP/s on the window's work, 4 B H S W D,
// as FlexAttention's anchor counts it) beside full causal attention at the same shape, a window
// of 128 at B1 H64/KV8 S8192 D64 (a local layer of GPT-OSS), and 8 packed documents of 2048
// tokens, causal within each (H32 D128, 8 x 2 H 2048^2 D).
int run_masks(Context& ctx, nlohmann::json& rows) {
  const DType t = DType::bf16;
  const std::int64_t h = 32, d = 128;
  {
    // Window (99, 0) over padded sequences; packed documents of 100, 250 and 250 tokens, causal.
    const std::int64_t b = 2, s = 300, hq = 8, hk = 2, n = b * s * hq * d, nk = b * s * hk * d;
    auto xq = random_values(t, n, ctx.rng), xk = random_values(t, nk, ctx.rng), xv = random_values(t, nk, ctx.rng);
    DeviceBuffer q(n * 2), k(nk * 2), v(nk * 2), o(n * 2), cu(4 * 4);
    q.upload(xq.data());
    k.upload(xk.data());
    v.upload(xv.data());
    std::vector<unsigned char> got(n * 2), want(n * 2);
    AttentionOptions opt;
    opt.causal = true;
    opt.window_left = 99;
    o.poison();
    check(attention(dev(q, t, {b, s, hq, d}), dev(k, t, {b, s, hk, d}), dev(v, t, {b, s, hk, d}), dev(o, t, {b, s, hq, d}),
                    nullptr, opt, nullptr, ctx.runtime),
          "attention window");
    check(ctx.driver->ctx_synchronize(), "sync");
    o.download(got.data());
    check(attention(host(xq, t, {b, s, hq, d}), host(xk, t, {b, s, hk, d}), host(xv, t, {b, s, hk, d}),
                    host(want, t, {b, s, hq, d}), nullptr, opt),
          "attention window (cpu)");
    const double err_window = rel_l2(got.data(), want.data(), t, n);
    const std::int32_t cu_host[4] = {0, 100, 350, 600};
    std::vector<unsigned char> cu_bytes(reinterpret_cast<const unsigned char*>(cu_host),
                                        reinterpret_cast<const unsigned char*>(cu_host) + sizeof(cu_host));
    cu.upload(cu_bytes.data());
    const std::int64_t total = b * s;
    AttentionOptions causal;
    causal.causal = true;
    o.poison();
    check(attention_varlen(dev(q, t, {total, hq, d}), dev(k, t, {total, hk, d}), dev(v, t, {total, hk, d}),
                           dev(cu, DType::i32, {4}), dev(cu, DType::i32, {4}), dev(o, t, {total, hq, d}), nullptr, 250,
                           250, causal, nullptr, ctx.runtime),
          "attention varlen");
    check(ctx.driver->ctx_synchronize(), "sync");
    o.download(got.data());
    check(attention_varlen(host(xq, t, {total, hq, d}), host(xk, t, {total, hk, d}), host(xv, t, {total, hk, d}),
                           host(cu_bytes, DType::i32, {4}), host(cu_bytes, DType::i32, {4}),
                           host(want, t, {total, hq, d}), nullptr, 250, 250, causal),
          "attention varlen (cpu)");
    const double err_varlen = rel_l2(got.data(), want.data(), t, n);
    if (!(err_window < 1e-2) || !(err_varlen < 1e-2)) {
      std::printf("attention masks: FAILED against the CPU reference (window rel err %.3g, varlen %.3g)\n",
                  err_window, err_varlen);
      return 1;
    }
    std::printf("\nattention mask checks (bf16 D128 H8/2): window (99, 0) rel err %.2e, packed 100/250/250 causal "
                "rel err %.2e\n",
                err_window, err_varlen);
  }
  std::printf("\nattention masks (bf16, H32, D128)\n%-34s %10s %9s\n", "case", "median_us", "TFLOP/s");
  auto row = [&](const std::string& name, double us, double flops) {
    const double tflops = flops / (us * 1e-6) / 1e12;
    std::printf("%-34s %10.1f %9.1f\n", name.c_str(), us, tflops);
    rows.push_back({{"kind", "mask"}, {"case", name}, {"median_us", us}, {"tflops", tflops}});
  };
  {
    const std::int64_t b = 2, s = 8192, n = b * s * h * d;
    const auto hx = tiled_values(t, n, ctx.rng);
    DeviceBuffer q(n * 2), k(n * 2), v(n * 2), o(n * 2);
    q.upload(hx.data());
    k.upload(hx.data());
    v.upload(hx.data());
    auto time = [&](const AttentionOptions& opt) {
      auto call = [&](int) {
        check(attention(dev(q, t, {b, s, h, d}), dev(k, t, {b, s, h, d}), dev(v, t, {b, s, h, d}),
                        dev(o, t, {b, s, h, d}), nullptr, opt, nullptr, ctx.runtime),
              "attention");
      };
      call(0);
      check(ctx.driver->ctx_synchronize(), "sync");
      return time_events(call, 3, ctx.quick ? 10 : 30) * 1e3;
    };
    for (std::int64_t w : {256, 1024, 4096}) {
      AttentionOptions opt;
      opt.causal = true;
      opt.window_left = w - 1;
      row("window " + std::to_string(w) + " B2 S8192", time(opt), 4.0 * b * h * s * double(w) * d);
    }
    AttentionOptions causal;
    causal.causal = true;
    row("causal B2 S8192", time(causal), 2.0 * b * h * double(s) * s * d);
  }
  {
    // A local layer of GPT-OSS's shape: 64 query heads over 8 KV heads of 64, a window of 128.
    const std::int64_t s = 8192, hq = 64, hk = 8, dq = 64, w = 128, nq = s * hq * dq, nk = s * hk * dq;
    const auto hx = tiled_values(t, nq, ctx.rng);
    DeviceBuffer q(nq * 2), k(nk * 2), v(nk * 2), o(nq * 2);
    q.upload(hx.data());
    k.upload(hx.data());
    v.upload(hx.data());
    AttentionOptions opt;
    opt.causal = true;
    opt.window_left = w - 1;
    auto call = [&](int) {
      check(attention(dev(q, t, {1, s, hq, dq}), dev(k, t, {1, s, hk, dq}), dev(v, t, {1, s, hk, dq}),
                      dev(o, t, {1, s, hq, dq}), nullptr, opt, nullptr, ctx.runtime),
            "attention");
    };
    call(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    row("window 128 H64/8 D64 B1 S8192", time_events(call, 3, ctx.quick ? 10 : 30) * 1e3,
        4.0 * hq * s * double(w) * dq);
  }
  {
    const std::int64_t docs = 8, len = 2048, total = docs * len, n = total * h * d;
    const auto hx = tiled_values(t, n, ctx.rng);
    std::vector<std::int32_t> cu_host;
    for (std::int64_t i = 0; i <= docs; ++i) cu_host.push_back(std::int32_t(i * len));
    DeviceBuffer q(n * 2), k(n * 2), v(n * 2), o(n * 2), cu(cu_host.size() * 4);
    q.upload(hx.data());
    k.upload(hx.data());
    v.upload(hx.data());
    cu.upload(cu_host.data());
    AttentionOptions causal;
    causal.causal = true;
    const auto cu_view = dev(cu, DType::i32, {docs + 1});
    auto call = [&](int) {
      check(attention_varlen(dev(q, t, {total, h, d}), dev(k, t, {total, h, d}), dev(v, t, {total, h, d}), cu_view,
                             cu_view, dev(o, t, {total, h, d}), nullptr, len, len, causal, nullptr, ctx.runtime),
            "attention varlen");
    };
    call(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    row("packed 8 docs x 2048 causal", time_events(call, 3, ctx.quick ? 10 : 30) * 1e3,
        double(docs) * 2.0 * h * double(len) * len * d);
  }
  return 0;
}

// Backward at a small shape on the GPU against the CPU reference from the same inputs (out and lse
// from the host forward); the largest relative L2 error of dq, dk, dv.
double check_backward(Context& ctx, bool causal, std::int64_t d, bool deterministic) {
  const std::int64_t b = 2, s = 300, h = 8, hk = 2, n = b * s * h * d, nk = b * s * hk * d, nl = b * h * s;
  const DType t = DType::bf16;
  auto hq = random_values(t, n, ctx.rng), hk_ = random_values(t, nk, ctx.rng), hv = random_values(t, nk, ctx.rng),
       hg = random_values(t, n, ctx.rng);
  std::vector<unsigned char> ho(n * 2), hl(nl * 4);
  AttentionOptions opt;
  opt.causal = causal;
  TensorView hlv = host(hl, DType::f32, {b, h, s});
  check(attention(host(hq, t, {b, s, h, d}), host(hk_, t, {b, s, hk, d}), host(hv, t, {b, s, hk, d}),
                  host(ho, t, {b, s, h, d}), &hlv, opt),
        "attention (cpu)");
  DeviceBuffer q(n * 2), k(nk * 2), v(nk * 2), o(n * 2), g(n * 2), l(nl * 4), dq(n * 2), dk(nk * 2), dv(nk * 2);
  q.upload(hq.data());
  k.upload(hk_.data());
  v.upload(hv.data());
  o.upload(ho.data());
  g.upload(hg.data());
  l.upload(hl.data());
  dq.poison();
  dk.poison();
  dv.poison();
  check(attention_backward(dev(g, t, {b, s, h, d}), dev(q, t, {b, s, h, d}), dev(k, t, {b, s, hk, d}),
                           dev(v, t, {b, s, hk, d}), dev(o, t, {b, s, h, d}),
                           TensorView::contiguous(l.get(), DType::f32, {b, h, s}, Device::cuda(0)),
                           dev(dq, t, {b, s, h, d}), dev(dk, t, {b, s, hk, d}), dev(dv, t, {b, s, hk, d}), opt,
                           deterministic, nullptr, ctx.runtime),
        "attention_backward");
  check(ctx.driver->ctx_synchronize(), "sync");
  std::vector<unsigned char> gq(n * 2), gk(nk * 2), gv(nk * 2), wq(n * 2), wk(nk * 2), wv(nk * 2);
  dq.download(gq.data());
  dk.download(gk.data());
  dv.download(gv.data());
  check(attention_backward(host(hg, t, {b, s, h, d}), host(hq, t, {b, s, h, d}), host(hk_, t, {b, s, hk, d}),
                           host(hv, t, {b, s, hk, d}), host(ho, t, {b, s, h, d}), hlv, host(wq, t, {b, s, h, d}),
                           host(wk, t, {b, s, hk, d}), host(wv, t, {b, s, hk, d}), opt),
        "attention_backward (cpu)");
  return std::max({rel_l2(gq.data(), wq.data(), t, n), rel_l2(gk.data(), wk.data(), t, nk),
                   rel_l2(gv.data(), wv.data(), t, nk)});
}

int backward(Context& ctx, nlohmann::json& rows) {
  for (std::int64_t d : {64, 128})
    for (bool causal : {false, true})
      for (bool det : {false, true}) {
        const double err = check_backward(ctx, causal, d, det);
        const char* mode = det ? "deterministic" : "fast";
        if (!(err < 2e-2)) {
          std::printf("attention backward D%lld %s %s: FAILED against the CPU reference (rel err %.3g)\n",
                      (long long)d, causal ? "causal" : "full", mode, err);
          return 1;
        }
        std::printf("attention backward check (B2 S300 H8/2 D%lld bf16 %s %s): rel err %.2e\n", (long long)d,
                    causal ? "causal" : "full", mode, err);
      }
  struct Shape {
    std::int64_t b, h, s, d;
  };
  std::vector<Shape> shapes = {{4, 32, 4096, 128}, {2, 16, 8192, 128}, {4, 32, 4096, 64}};
  if (ctx.quick) shapes = {{4, 32, 4096, 128}};
  std::printf("\nattention backward (bf16)\n%3s %4s %6s %5s %7s %14s %10s %9s\n", "B", "H", "S", "D", "causal", "mode",
              "median_us", "TFLOP/s");
  const DType t = DType::bf16;
  for (const auto& [b, h, s, d] : shapes) {
    if (!families::attention_bwd_head_dims_supported(d, d)) continue;
    const std::int64_t n = b * s * h * d;
    const auto hx = tiled_values(t, n, ctx.rng);
    DeviceBuffer q(n * 2), k(n * 2), v(n * 2), o(n * 2), g(n * 2), l(b * h * s * 4), dq(n * 2), dk(n * 2), dv(n * 2);
    q.upload(hx.data());
    k.upload(hx.data());
    v.upload(hx.data());
    g.upload(hx.data());
    const TensorView lse = TensorView::contiguous(l.get(), DType::f32, {b, h, s}, Device::cuda(0));
    for (bool causal : {false, true}) {
      AttentionOptions opt;
      opt.causal = causal;
      check(attention(dev(q, t, {b, s, h, d}), dev(k, t, {b, s, h, d}), dev(v, t, {b, s, h, d}),
                      dev(o, t, {b, s, h, d}), &lse, opt, nullptr, ctx.runtime),
            "attention");
      for (bool det : {false, true}) {
        auto call = [&](int) {
          check(attention_backward(dev(g, t, {b, s, h, d}), dev(q, t, {b, s, h, d}), dev(k, t, {b, s, h, d}),
                                   dev(v, t, {b, s, h, d}), dev(o, t, {b, s, h, d}), lse, dev(dq, t, {b, s, h, d}),
                                   dev(dk, t, {b, s, h, d}), dev(dv, t, {b, s, h, d}), opt, det, nullptr, ctx.runtime),
                "attention_backward");
        };
        call(0);
        check(ctx.driver->ctx_synchronize(), "sync");
        const double ms = time_events(call, 3, ctx.quick ? 10 : 20);
        const double flops =
            2.5 * 4.0 * double(b) * double(h) * double(s) * double(s) * double(d) * (causal ? 0.5 : 1.0);
        const double tflops = flops / (ms * 1e-3) / 1e12;
        const char* mode = det ? "deterministic" : "fast";
        std::printf("%3lld %4lld %6lld %5lld %7s %14s %10.1f %9.1f\n", (long long)b, (long long)h, (long long)s,
                    (long long)d, causal ? "yes" : "no", mode, ms * 1e3, tflops);
        rows.push_back({{"kind", "backward"}, {"batch", b}, {"heads", h}, {"seq", s}, {"head_dim", d},
                        {"causal", causal}, {"mode", mode}, {"median_us", ms * 1e3}, {"tflops", tflops}});
      }
    }
  }
  return 0;
}

int run(Context& ctx) {
  nlohmann::json rows = nlohmann::json::array();
  const char* only_variants = std::getenv("KILN_BENCH_ATTENTION_VARIANTS");
  if (only_variants && (std::string(only_variants) == "only" || std::string(only_variants) == "masks")) {
    const int rc = variants(ctx, rows, std::string(only_variants) == "masks");
    (*ctx.out)["attention"] = rows;
    return rc;
  }
  if (const char* part = std::getenv("KILN_BENCH_ATTENTION_PART"); part && std::string(part) == "backward") {
    const int rc = backward(ctx, rows);
    (*ctx.out)["attention"] = rows;
    return rc;
  }
  if (const char* part = std::getenv("KILN_BENCH_ATTENTION_PART"); part && std::string(part) == "masks") {
    const int rc = run_masks(ctx, rows);
    (*ctx.out)["attention"] = rows;
    return rc;
  }
  if (const char* part = std::getenv("KILN_BENCH_ATTENTION_PART"); part && std::string(part) == "decode") {
    nlohmann::json decode_rows = nlohmann::json::array();
    const int rc = run_decode(ctx, decode_rows);
    (*ctx.out)["attention_decode"] = decode_rows;
    return rc;
  }
  for (std::int64_t d : {64, 128, 256})
    for (bool causal : {false, true}) {
      const double err = check_padded(ctx, causal, d);
      const std::string v = variant(2, 8, 2, 300, d, causal);
      if (!(err < 1e-2)) {
        std::printf("attention D%lld %s (%s): FAILED against the CPU reference (rel err %.3g)\n", (long long)d,
                    causal ? "causal" : "full", v.c_str(), err);
        return 1;
      }
      std::printf("attention check (B2 S300 H8/2 D%lld bf16 %s, %s): rel err %.2e\n", (long long)d,
                  causal ? "causal" : "full", v.c_str(), err);
    }
  struct Shape {
    std::int64_t b, h, s, d;
  };
  std::vector<Shape> shapes = {{4, 32, 4096, 128}, {2, 16, 8192, 128}, {4, 32, 4096, 64}, {2, 16, 4096, 256}};
  if (ctx.quick) shapes = {{4, 32, 4096, 128}, {2, 16, 4096, 256}};
  std::printf("\nattention forward (bf16)\n%3s %4s %6s %5s %7s %10s %9s  %s\n", "B", "H", "S", "D", "causal",
              "median_us", "TFLOP/s", "variant");
  const DType t = DType::bf16;
  for (const auto& [b, h, s, d] : shapes) {
    const std::int64_t n = b * s * h * d;
    const auto hx = tiled_values(t, n, ctx.rng);
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
      const std::string v = variant(b, h, h, s, d, causal);
      std::printf("%3lld %4lld %6lld %5lld %7s %10.1f %9.1f  %s\n", (long long)b, (long long)h, (long long)s,
                  (long long)d, causal ? "yes" : "no", ms * 1e3, tflops, v.c_str());
      rows.push_back({{"batch", b}, {"heads", h}, {"seq", s}, {"head_dim", d}, {"causal", causal},
                      {"median_us", ms * 1e3}, {"tflops", tflops}, {"variant", v}});
    }
  }
  nlohmann::json decode_rows = nlohmann::json::array();
  int rc = backward(ctx, rows);
  if (rc == 0 && only_variants && std::string(only_variants) == "1") rc = variants(ctx, rows, false);
  if (run_decode(ctx, decode_rows)) rc = 1;
  (*ctx.out)["attention"] = rows;
  (*ctx.out)["attention_decode"] = decode_rows;
  return rc;
}

Register reg("attention", run);

}  // namespace
}  // namespace kiln::bench
