// Fused RMSNorm + RoPE (bf16, batch 1, seq = tokens, hidden 4096, bf16 cos/sin [seq, head_dim]):
// correctness against the CPU reference, then bandwidth, for head_dim 64 and 128.
// Minimal bytes: read x, write y, plus the cos/sin rows (the weight is counted once).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "bench/gpu_harness.h"
#include "common/half.h"
#include "families/rmsnorm_rope/rmsnorm_rope.h"

namespace kiln::bench {
namespace {

constexpr std::int64_t k_hidden = 4096;

// Random bf16 rows, the first 256 distinct and then repeated.
std::vector<unsigned char> random_rows(Context& ctx, std::int64_t rows, std::int64_t cols, float scale) {
  const std::int64_t distinct = std::min<std::int64_t>(rows, 256);
  const std::size_t row_bytes = std::size_t(cols) * 2;
  auto base = random_values(DType::bf16, distinct * cols, ctx.rng, scale);
  std::vector<unsigned char> out(std::size_t(rows) * row_bytes);
  for (std::int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + r * row_bytes, base.data() + (r % distinct) * row_bytes, row_bytes);
  return out;
}

int run(Context& ctx) {
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;  // tokens, head_dim
  for (std::int64_t d : {64, 128})
    for (std::int64_t tokens : {1, 16, 512, 4096, 32768}) shapes.emplace_back(tokens, d);
  if (ctx.quick) shapes = {{1, 128}, {4096, 128}, {32768, 64}};
  const Family& f = *Registry::global().find("rmsnorm_rope");
  std::printf("\nrmsnorm_rope (bf16, batch 1, hidden %lld, bf16 cos/sin)\n%8s %4s %10s %10s %8s %9s %44s\n",
              (long long)k_hidden, "tokens", "d", "median_us", "GB/s", "%copy", "rel_err", "variant");
  nlohmann::json rows = nlohmann::json::array();
  for (auto [tokens, d] : shapes) {
    const std::int64_t elems = tokens * k_hidden;
    const std::size_t bytes = std::size_t(elems) * 2, table_bytes = std::size_t(tokens * d) * 2;
    const int sets = rotation_sets(2 * bytes + 2 * table_bytes);
    auto hx = random_rows(ctx, tokens, k_hidden, 2.0f);
    auto hw = random_values(DType::bf16, k_hidden, ctx.rng);
    std::vector<unsigned char> hcos(table_bytes), hsin(table_bytes);
    for (std::int64_t s = 0; s < tokens; ++s)
      for (std::int64_t j = 0; j < d; ++j) {
        const double a = double(s) * std::pow(10000.0, -2.0 * double(j % (d / 2)) / double(d));
        store_from_double(hcos.data(), DType::bf16, s * d + j, std::cos(a));
        store_from_double(hsin.data(), DType::bf16, s * d + j, std::sin(a));
      }
    std::vector<std::unique_ptr<DeviceBuffer>> xs, ys;
    for (int s = 0; s < sets; ++s) {
      xs.push_back(std::make_unique<DeviceBuffer>(bytes));
      ys.push_back(std::make_unique<DeviceBuffer>(bytes));
      xs.back()->upload(hx.data());
      ys.back()->poison();
    }
    DeviceBuffer w(k_hidden * 2), dcos(table_bytes), dsin(table_bytes);
    w.upload(hw.data());
    dcos.upload(hcos.data());
    dsin.upload(hsin.data());
    const Device dev = Device::cuda(0);
    const TensorView wv = TensorView::contiguous(w.get(), DType::bf16, {k_hidden}, dev);
    const TensorView cos = TensorView::contiguous(dcos.get(), DType::bf16, {tokens, d}, dev);
    const TensorView sin = TensorView::contiguous(dsin.get(), DType::bf16, {tokens, d}, dev);
    auto call = [&](int i) {
      const int s = i % sets;
      check(rms_norm_rope(TensorView::contiguous(xs[s]->get(), DType::bf16, {1, tokens, k_hidden}, dev), wv, cos, sin,
                          TensorView::contiguous(ys[s]->get(), DType::bf16, {1, tokens, k_hidden}, dev), 1e-6, 0,
                          nullptr, ctx.runtime),
            "rms_norm_rope");
    };
    call(0);
    check(ctx.driver->ctx_synchronize(), "sync");

    // The reference over the first rows (positions 0..check_rows-1 of the same tables).
    const std::int64_t check_rows = std::min<std::int64_t>(tokens, 64);
    std::vector<unsigned char> got(bytes), want(check_rows * k_hidden * 2);
    ys[0]->download(got.data());
    // Sequences of `tokens` positions, bf16 cos and sin.
    auto problem = [&](std::int64_t rows) {
      return Problem::of(DType::bf16, 16,
                         families::RmsNormRopeProblem{.rows = rows, .hidden = k_hidden, .head_dim = d, .seq = rows,
                                                      .num_heads = k_hidden / d,
                                                      .cos_dtype = std::int64_t(DType::bf16), .eps = 1e-6});
    };
    const Problem p = problem(check_rows);
    void* refb[5] = {hx.data(), hw.data(), hcos.data(), hsin.data(), want.data()};
    check(f.cpu_reference(f.heuristic(p), p, refb), "reference");
    const double err = rel_l2(got.data(), want.data(), DType::bf16, check_rows * k_hidden);
    bool all_written = true;
    for (std::int64_t i = 0; i < elems && all_written; i += 97)
      all_written = !std::isnan(load_as_double(got.data(), DType::bf16, i));
    if (!(err < 1e-2) || !all_written) {
      std::printf("rmsnorm_rope %lld tokens d%lld: FAILED against the CPU reference (rel err %.3g, all written %d)\n",
                  (long long)tokens, (long long)d, err, all_written);
      return 1;
    }
    const double ms = time_events(call, 10, ctx.quick ? 30 : 100);
    const double gbs = double(2 * bytes + 2 * table_bytes + k_hidden * 2) / (ms * 1e-3) / 1e9;
    const Params chosen = f.heuristic(problem(tokens));
    std::printf("%8lld %4lld %10.2f %10.1f %7.1f%% %9.2e %44s\n", (long long)tokens, (long long)d, ms * 1e3, gbs,
                100 * gbs / ctx.copy_gbs, err, chosen.canonical().c_str());
    rows.push_back({{"tokens", tokens}, {"hidden", k_hidden}, {"head_dim", d}, {"median_us", ms * 1e3}, {"gbs", gbs},
                    {"fraction_of_copy", gbs / ctx.copy_gbs}, {"rel_err", err}, {"variant", chosen.canonical()}});
  }
  (*ctx.out)["rmsnorm_rope"] = rows;
  return 0;
}

Register reg("rmsnorm_rope", run);

}  // namespace
}  // namespace kiln::bench
