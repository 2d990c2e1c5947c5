// Activation-and-mul over LLM shapes (bf16): SiLU for every shape, GELU (erf) and GELU (tanh) at
// the MLP widths of large token counts, where their extra arithmetic could show. Correctness
// against the CPU reference first, then bandwidth. Minimal bytes: read rows of 2d, write rows of d.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "bench/gpu_harness.h"
#include "common/half.h"
#include "families/act_and_mul/act_and_mul.h"

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

struct Shape {
  std::int64_t tokens, d;
  Activation act;
};

const char* act_name(Activation a) {
  return a == Activation::silu ? "silu" : a == Activation::gelu ? "gelu" : "gelu_tanh";
}

int run(Context& ctx) {
  std::vector<Shape> shapes;
  for (std::int64_t tokens : {1, 16, 512, 4096, 32768})
    for (std::int64_t d : {2048, 4096, 8192, 11008, 14336, 16384}) shapes.push_back({tokens, d, Activation::silu});
  shapes.push_back({4096, 65536, Activation::silu});
  for (Activation a : {Activation::gelu, Activation::gelu_tanh})
    for (std::int64_t tokens : {1, 4096, 32768}) shapes.push_back({tokens, 14336, a});
  if (ctx.quick)
    shapes = {{1, 4096, Activation::silu}, {4096, 14336, Activation::silu}, {32768, 11008, Activation::silu},
              {4096, 14336, Activation::gelu}, {4096, 65536, Activation::silu}};
  const Family& f = *Registry::global().find("act_and_mul");
  std::printf("\nact_and_mul (bf16)\n%8s %6s %10s %10s %10s %8s %9s %32s\n", "tokens", "d", "act", "median_us", "GB/s",
              "%copy", "rel_err", "variant");
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& [tokens, d, act] : shapes) {
    const std::int64_t out_elems = tokens * d;
    const std::size_t out_bytes = std::size_t(out_elems) * 2;
    const int sets = rotation_sets(3 * out_bytes);
    auto hx = random_rows(ctx, tokens, 2 * d);
    std::vector<std::unique_ptr<DeviceBuffer>> xs, outs;
    for (int s = 0; s < sets; ++s) {
      xs.push_back(std::make_unique<DeviceBuffer>(2 * out_bytes));
      outs.push_back(std::make_unique<DeviceBuffer>(out_bytes));
      xs.back()->upload(hx.data());
      outs.back()->poison();
    }
    auto call = [&](int i) {
      const int s = i % sets;
      check(act_and_mul(TensorView::contiguous(xs[s]->get(), DType::bf16, {tokens, 2 * d}, Device::cuda(0)),
                        TensorView::contiguous(outs[s]->get(), DType::bf16, {tokens, d}, Device::cuda(0)), act, nullptr,
                        ctx.runtime),
            "act_and_mul");
    };
    call(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    const std::int64_t check_rows = std::min<std::int64_t>(tokens, 64);
    std::vector<unsigned char> got(out_bytes), want(check_rows * d * 2);
    outs[0]->download(got.data());
    families::ActAndMulProblem ap{.rows = check_rows,
                                  .d = d,
                                  .x_row_stride = 2 * d,
                                  .out_row_stride = d,
                                  .activation = act == Activation::silu   ? families::k_am_silu
                                                : act == Activation::gelu ? families::k_am_gelu
                                                                          : families::k_am_gelu_tanh};
    const Problem p = Problem::of(DType::bf16, 16, ap);
    void* refb[2] = {hx.data(), want.data()};
    check(f.cpu_reference(f.heuristic(p), p, refb), "reference");
    const double err = rel_l2(got.data(), want.data(), DType::bf16, check_rows * d);
    bool all_written = true;
    for (std::int64_t i = 0; i < out_elems && all_written; i += 97)
      all_written = !std::isnan(load_as_double(got.data(), DType::bf16, i));
    if (!(err < 1e-2) || !all_written) {
      std::printf("act_and_mul %lldx%lld %s: FAILED against the CPU reference (rel err %.3g, all written %d)\n",
                  (long long)tokens, (long long)d, act_name(act), err, all_written);
      return 1;
    }
    const double ms = time_events(call, 10, ctx.quick ? 30 : 100);
    const double gbs = double(3 * out_bytes) / (ms * 1e-3) / 1e9;
    ap.rows = tokens;
    const Problem hp = Problem::of(DType::bf16, 16, ap);
    const Params chosen = f.heuristic(hp);
    std::printf("%8lld %6lld %10s %10.2f %10.1f %7.1f%% %9.2e %32s\n", (long long)tokens, (long long)d, act_name(act),
                ms * 1e3, gbs, 100 * gbs / ctx.copy_gbs, err, chosen.canonical().c_str());
    rows.push_back({{"tokens", tokens}, {"d", d}, {"act", act_name(act)}, {"median_us", ms * 1e3}, {"gbs", gbs},
                    {"fraction_of_copy", gbs / ctx.copy_gbs}, {"rel_err", err}, {"variant", chosen.canonical()}});
  }
  (*ctx.out)["act_and_mul"] = rows;
  return 0;
}

Register reg("act_and_mul", run);

}  // namespace
}  // namespace kiln::bench
