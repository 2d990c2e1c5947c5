// RoPE on q and k (bf16, 32 q heads + 8 kv heads, out of place, f32 cos/sin cache, positions
// 0..tokens-1): correctness against the CPU reference, then bandwidth, for neox and gptj.
// Minimal bytes: read q and k, write q_out and k_out, plus the cos/sin rows and position ids read.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "bench/gpu_harness.h"
#include "common/half.h"
#include "families/rope/rope.h"

namespace kiln::bench {
namespace {

constexpr std::int64_t k_q_heads = 32, k_kv_heads = 8;

// Random bf16 token rows, the first 256 distinct and then repeated: fresh data every run without
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
  struct Shape {
    std::int64_t tokens, d;
    RopeLayout layout;
  };
  std::vector<Shape> shapes;
  for (RopeLayout layout : {RopeLayout::neox, RopeLayout::gptj})
    for (std::int64_t d : {64, 128})
      for (std::int64_t tokens : {1, 16, 512, 4096, 32768}) shapes.push_back({tokens, d, layout});
  if (ctx.quick)
    shapes = {{1, 128, RopeLayout::neox}, {4096, 128, RopeLayout::neox}, {16384, 128, RopeLayout::neox},
              {32768, 64, RopeLayout::gptj}};
  const Family& f = *Registry::global().find("rope");
  std::printf("\nrope (bf16, %lld q + %lld kv heads, out of place, f32 cos/sin)\n%8s %4s %6s %10s %10s %8s %9s %36s\n",
              (long long)k_q_heads, (long long)k_kv_heads, "tokens", "d", "layout", "median_us", "GB/s", "%copy",
              "rel_err", "variant");
  nlohmann::json rows = nlohmann::json::array();
  for (const Shape& sh : shapes) {
    const std::int64_t tokens = sh.tokens, d = sh.d, half = d / 2;
    const std::int64_t qn = tokens * k_q_heads * d, kn = tokens * k_kv_heads * d;
    const std::int64_t max_pos = std::max<std::int64_t>(tokens, 4096);
    const std::size_t qk_bytes = std::size_t(qn + kn) * 2;
    const int sets = rotation_sets(2 * qk_bytes);
    auto hq = random_rows(ctx, tokens, k_q_heads * d);
    auto hk = random_rows(ctx, tokens, k_kv_heads * d);
    std::vector<float> hcos(max_pos * half), hsin(max_pos * half);
    for (std::int64_t p = 0; p < max_pos; ++p)
      for (std::int64_t i = 0; i < half; ++i) {
        const double a = double(p) * std::pow(10000.0, -2.0 * double(i) / double(d));
        hcos[p * half + i] = float(std::cos(a));
        hsin[p * half + i] = float(std::sin(a));
      }
    std::vector<std::int64_t> hpos(tokens);
    for (std::int64_t t = 0; t < tokens; ++t) hpos[t] = t;
    std::vector<std::unique_ptr<DeviceBuffer>> qs, ks, qos, kos;
    for (int s = 0; s < sets; ++s) {
      qs.push_back(std::make_unique<DeviceBuffer>(qn * 2));
      ks.push_back(std::make_unique<DeviceBuffer>(kn * 2));
      qos.push_back(std::make_unique<DeviceBuffer>(qn * 2));
      kos.push_back(std::make_unique<DeviceBuffer>(kn * 2));
      qs.back()->upload(hq.data());
      ks.back()->upload(hk.data());
      qos.back()->poison();
      kos.back()->poison();
    }
    DeviceBuffer dcos(hcos.size() * 4), dsin(hsin.size() * 4), dpos(hpos.size() * 8);
    dcos.upload(hcos.data());
    dsin.upload(hsin.data());
    dpos.upload(hpos.data());
    const Device dev = Device::cuda(0);
    const TensorView cos = TensorView::contiguous(dcos.get(), DType::f32, {max_pos, half}, dev);
    const TensorView sin = TensorView::contiguous(dsin.get(), DType::f32, {max_pos, half}, dev);
    const TensorView pos = TensorView::contiguous(dpos.get(), DType::i64, {tokens}, dev);
    auto qkv = [&](const DeviceBuffer& b, std::int64_t heads) {
      return TensorView::contiguous(b.get(), DType::bf16, {tokens, heads, d}, dev);
    };
    auto call = [&](int i) {
      const int s = i % sets;
      check(apply_rope_qk(qkv(*qs[s], k_q_heads), qkv(*ks[s], k_kv_heads), cos, sin, pos, qkv(*qos[s], k_q_heads),
                          qkv(*kos[s], k_kv_heads), sh.layout, nullptr, ctx.runtime),
            "apply_rope_qk");
    };
    call(0);
    check(ctx.driver->ctx_synchronize(), "sync");

    // The reference over the first tokens (the kernel wrote every token: no NaN may be left).
    const std::int64_t check_tokens = std::min<std::int64_t>(tokens, 64);
    std::vector<unsigned char> got_q(qn * 2), got_k(kn * 2), want_q(check_tokens * k_q_heads * d * 2),
        want_k(check_tokens * k_kv_heads * d * 2);
    qos[0]->download(got_q.data());
    kos[0]->download(got_k.data());
    const families::RopeProblem rp{.tokens = check_tokens,
                                   .q_heads = k_q_heads,
                                   .kv_heads = k_kv_heads,
                                   .head_dim = d,
                                   .layout = sh.layout == RopeLayout::neox ? families::k_rope_neox
                                                                           : families::k_rope_gptj,
                                   .max_pos = max_pos,
                                   .q_stride = k_q_heads * d,
                                   .k_stride = k_kv_heads * d,
                                   .q_out_stride = k_q_heads * d,
                                   .k_out_stride = k_kv_heads * d};
    const Problem p = Problem::of(DType::bf16, 16, rp);
    void* refb[7] = {hq.data(), hk.data(), hcos.data(), hsin.data(), hpos.data(), want_q.data(), want_k.data()};
    check(f.cpu_reference(f.heuristic(p), p, refb), "reference");
    const double err = std::max(rel_l2(got_q.data(), want_q.data(), DType::bf16, check_tokens * k_q_heads * d),
                                rel_l2(got_k.data(), want_k.data(), DType::bf16, check_tokens * k_kv_heads * d));
    bool all_written = true;
    for (std::int64_t i = 0; i < qn && all_written; i += 97)
      all_written = !std::isnan(load_as_double(got_q.data(), DType::bf16, i));
    for (std::int64_t i = 0; i < kn && all_written; i += 97)
      all_written = !std::isnan(load_as_double(got_k.data(), DType::bf16, i));
    const char* layout = sh.layout == RopeLayout::neox ? "neox" : "gptj";
    if (!(err < 1e-2) || !all_written) {
      std::printf("rope %lld tokens d%lld %s: FAILED against the CPU reference (rel err %.3g, all written %d)\n",
                  (long long)tokens, (long long)d, layout, err, all_written);
      return 1;
    }
    const double ms = time_events(call, 10, ctx.quick ? 30 : 100);
    const double bytes = 2.0 * double(qk_bytes) + double(tokens) * double(2 * half * 4 + 8);
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    families::RopeProblem hrp = rp;
    hrp.tokens = tokens;
    const Problem hp = Problem::of(DType::bf16, 16, hrp);
    const Params chosen = f.heuristic(hp);
    std::printf("%8lld %4lld %6s %10.2f %10.1f %7.1f%% %9.2e %36s\n", (long long)tokens, (long long)d, layout, ms * 1e3,
                gbs, 100 * gbs / ctx.copy_gbs, err, chosen.canonical().c_str());
    rows.push_back({{"tokens", tokens}, {"head_dim", d}, {"layout", layout}, {"q_heads", k_q_heads},
                    {"kv_heads", k_kv_heads}, {"median_us", ms * 1e3}, {"gbs", gbs},
                    {"fraction_of_copy", gbs / ctx.copy_gbs}, {"rel_err", err}, {"variant", chosen.canonical()}});
  }
  (*ctx.out)["rope"] = rows;
  return 0;
}

Register reg("rope", run);

}  // namespace
}  // namespace kiln::bench
