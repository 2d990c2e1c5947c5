// The tensor-core GEMMs: fp8_gemm per tensor and block-scaled at 8192^3 and the LLM shapes (M in
// {128, 4096}, N x K in {7168 x 16384, 4096 x 7168, 2112 x 7168}) and the fused gated MLP (bf16,
// SiLU) at M 4096, hidden 4096, intermediate 11008 and 14336. Sampled outputs are checked against an fp64 dot product first (every output is
// poisoned before the first call and scanned for unwritten elements), then timed.
// TFLOP/s = 2 M N K / time (gated: 4 M N K, two projections).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "bench/gpu_harness.h"
#include "common/fp8.h"
#include "common/half.h"
#include "families/common/gemm/gemm_util.h"
#include "families/gemm/fp8_gemm.h"
#include "jit/device_info.h"

namespace kiln::bench {
namespace {

namespace g = families::gemm;

// Rows of random values, the first 512 distinct and then repeated (fresh data every run without
// drawing gigabytes on the host). e4m3: random codes, NaN excluded; floats: normal values.
std::vector<unsigned char> random_matrix(Context& ctx, DType t, std::int64_t rows, std::int64_t cols, float scale) {
  const std::int64_t distinct = std::min<std::int64_t>(rows, 512);
  const std::size_t es = dtype_size(t), row_bytes = std::size_t(cols) * es;
  std::vector<unsigned char> base;
  if (t == DType::u8) {
    std::normal_distribution<float> d(0.0f, 2.0f);
    base.resize(std::size_t(distinct * cols));
    for (auto& v : base) v = float_to_e4m3(d(ctx.rng));
  } else {
    base = random_values(t, distinct * cols, ctx.rng, scale);
  }
  std::vector<unsigned char> out(std::size_t(rows) * row_bytes);
  for (std::int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + r * row_bytes, base.data() + (r % distinct) * row_bytes, row_bytes);
  return out;
}

struct Checked {
  double err;
  bool all_written;
};

// ||got - want|| / ||want|| over 512 sampled outputs against fp64 `want(i, j)`, and whether any
// of a strided scan of every output still holds the poison.
template <class Want>
Checked check_samples(Context& ctx, const DeviceBuffer& out, DType t, std::int64_t m, std::int64_t n, Want want) {
  std::vector<unsigned char> got(std::size_t(m * n) * 2);
  out.download(got.data());
  Checked c{0, true};
  for (std::int64_t i = 0; i < m * n && c.all_written; i += 61) c.all_written = !std::isnan(load_as_double(got.data(), t, i));
  std::uniform_int_distribution<std::int64_t> ri(0, m - 1), rj(0, n - 1);
  double num = 0, den = 0;
  for (int s = 0; s < 512; ++s) {
    const std::int64_t i = ri(ctx.rng), j = rj(ctx.rng);
    const double w = want(i, j), gv = load_as_double(got.data(), t, i * n + j);
    num += (gv - w) * (gv - w);
    den += w * w;
  }
  c.err = std::sqrt(num / den);
  return c;
}

int fp8(Context& ctx, nlohmann::json& rows) {
  struct Shape {
    std::int64_t m, n, k;
  };
  std::vector<Shape> shapes = {{8192, 8192, 8192}};
  for (std::int64_t m : {128, 4096})
    for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{7168, 16384}, {4096, 7168}, {2112, 7168}})
      shapes.push_back({m, n, k});
  if (ctx.quick) shapes = {{8192, 8192, 8192}, {128, 7168, 16384}, {4096, 4096, 7168}};
  const Family& f = *Registry::global().find("fp8_gemm");
  float lut[256];
  for (int i = 0; i < 256; ++i) lut[i] = e4m3_to_float(std::uint8_t(i));
  std::printf("\nfp8_gemm (e4m3 -> bf16)\n%6s %6s %6s %7s %10s %9s %9s %44s\n", "M", "N", "K", "scales", "median_us",
              "TFLOP/s", "rel_err", "variant");
  for (const auto& [m, n, k] : shapes) {
    auto ha = random_matrix(ctx, DType::u8, m, k, 1), hb = random_matrix(ctx, DType::u8, n, k, 1);
    DeviceBuffer da(ha.size()), db(hb.size()), dout(std::size_t(m * n) * 2);
    da.upload(ha.data());
    db.upload(hb.data());
    const std::int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
    for (bool block : {false, true}) {
      std::uniform_real_distribution<float> u(0.5f, 1.5f);
      std::vector<float> sa(block ? m * kb : 1), sb(block ? nb * kb : 1);
      for (auto& v : sa) v = u(ctx.rng) / 64;
      for (auto& v : sb) v = u(ctx.rng) / 64;
      DeviceBuffer dsa(sa.size() * 4), dsb(sb.size() * 4);
      dsa.upload(sa.data());
      dsb.upload(sb.data());
      auto cuda = Device::cuda(0);
      TensorView bt = TensorView::contiguous(db.get(), DType::u8, {n, k}, cuda);
      std::swap(bt.shape[0], bt.shape[1]);
      std::swap(bt.strides[0], bt.strides[1]);
      auto sav = block ? TensorView::contiguous(dsa.get(), DType::f32, {m, kb}, cuda)
                       : TensorView::contiguous(dsa.get(), DType::f32, {1}, cuda);
      auto sbv = block ? TensorView::contiguous(dsb.get(), DType::f32, {nb, kb}, cuda)
                       : TensorView::contiguous(dsb.get(), DType::f32, {1}, cuda);
      auto call = [&](int) {
        check(fp8_gemm(TensorView::contiguous(da.get(), DType::u8, {m, k}, cuda), bt, sav, sbv,
                       TensorView::contiguous(dout.get(), DType::bf16, {m, n}, cuda), nullptr, ctx.runtime),
              "fp8_gemm");
      };
      dout.poison();
      call(0);
      check(ctx.driver->ctx_synchronize(), "sync");
      const Checked c = check_samples(ctx, dout, DType::bf16, m, n, [&](std::int64_t i, std::int64_t j) {
        double total = 0;
        for (std::int64_t q = 0; q < kb; ++q) {
          double part = 0;
          for (std::int64_t x = q * 128; x < std::min(k, (q + 1) * 128); ++x)
            part += double(lut[ha[i * k + x]]) * double(lut[hb[j * k + x]]);
          total += block ? part * sa[i * kb + q] * sb[(j / 128) * kb + q] : part;
        }
        return block ? total : total * sa[0] * sb[0];
      });
      if (!(c.err < 1e-2) || !c.all_written) {
        std::printf("fp8_gemm %lldx%lldx%lld %s: FAILED against fp64 (rel err %.3g, all written %d)\n", (long long)m,
                    (long long)n, (long long)k, block ? "block" : "tensor", c.err, c.all_written);
        return 1;
      }
      const double ms = time_events(call, 10, ctx.quick ? 20 : 50);
      const double tflops = 2.0 * m * n * k / (ms * 1e-3) / 1e12;
      Problem p = Problem::of(DType::bf16, 16,
                              g::GemmProblem{.m = m, .n = n, .k = k,
                                             .mode = block ? families::k_fp8_blockwise : families::k_fp8_per_tensor});
      jit::set_device(p, *jit::device_info(0).value());
      const std::string variant = f.heuristic(p).canonical();
      std::printf("%6lld %6lld %6lld %7s %10.1f %9.1f %9.2e %44s\n", (long long)m, (long long)n, (long long)k,
                  block ? "block" : "tensor", ms * 1e3, tflops, c.err, variant.c_str());
      rows.push_back({{"kind", "fp8"}, {"m", m}, {"n", n}, {"k", k}, {"scales", block ? "block" : "tensor"},
                      {"median_us", ms * 1e3}, {"tflops", tflops}, {"rel_err", c.err}, {"variant", variant}});
    }
  }
  return 0;
}

int gated(Context& ctx, nlohmann::json& rows) {
  std::printf("\nfused_gated_mlp (bf16, silu)\n%6s %6s %6s %10s %9s %9s\n", "M", "N", "K", "median_us", "TFLOP/s",
              "rel_err");
  for (std::int64_t n : {11008, 14336}) {
    const std::int64_t m = 4096, k = 4096;
    auto hx = random_matrix(ctx, DType::bf16, m, k, 1.0f);
    auto hg = random_matrix(ctx, DType::bf16, n, k, 2.0f / 64), hu = random_matrix(ctx, DType::bf16, n, k, 2.0f / 64);
    DeviceBuffer dx(hx.size()), dg(hg.size()), du(hu.size()), dout(std::size_t(m * n) * 2);
    dx.upload(hx.data());
    dg.upload(hg.data());
    du.upload(hu.data());
    auto cuda = Device::cuda(0);
    auto call = [&](int) {
      check(fused_gated_mlp(TensorView::contiguous(dx.get(), DType::bf16, {m, k}, cuda),
                            TensorView::contiguous(dg.get(), DType::bf16, {n, k}, cuda),
                            TensorView::contiguous(du.get(), DType::bf16, {n, k}, cuda),
                            TensorView::contiguous(dout.get(), DType::bf16, {m, n}, cuda), GatedActivation::silu,
                            nullptr, ctx.runtime),
            "fused_gated_mlp");
    };
    dout.poison();
    call(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    const Checked c = check_samples(ctx, dout, DType::bf16, m, n, [&](std::int64_t i, std::int64_t j) {
      double gate = 0, up = 0;
      for (std::int64_t q = 0; q < k; ++q) {
        const double xv = load_as_double(hx.data(), DType::bf16, i * k + q);
        gate += xv * load_as_double(hg.data(), DType::bf16, j * k + q);
        up += xv * load_as_double(hu.data(), DType::bf16, j * k + q);
      }
      return gate / (1 + std::exp(-gate)) * up;
    });
    if (!(c.err < 1e-2) || !c.all_written) {
      std::printf("fused_gated_mlp %lld: FAILED against fp64 (rel err %.3g, all written %d)\n", (long long)n, c.err,
                  c.all_written);
      return 1;
    }
    const double ms = time_events(call, 10, ctx.quick ? 20 : 50);
    const double tflops = 4.0 * m * n * k / (ms * 1e-3) / 1e12;
    std::printf("%6lld %6lld %6lld %10.1f %9.1f %9.2e\n", (long long)m, (long long)n, (long long)k, ms * 1e3, tflops, c.err);
    rows.push_back({{"kind", "gated_mlp"}, {"m", m}, {"n", n}, {"k", k}, {"median_us", ms * 1e3}, {"tflops", tflops},
                    {"rel_err", c.err}});
  }
  return 0;
}

// Candidate tiles around the heuristic's choice (families/common/gemm/gemm_util.h: default_tile) at the
// decode-sized LLM shapes (M = 128: tile shape, split-K and pipeline depth decide) and the
// block-scaled large shapes (bn 256 and 192, group orders), each with its default_stages (or the
// depth named) and group 8 (or the one named): the data behind the model. Correctness is the other parts' and the GPU
// tests' job. Only with KILN_BENCH_GEMM_VARIANTS=1 (after the other parts) or =only (alone);
// =sweep: the cases at the sweep's shapes alone.
int variants(Context& ctx, nlohmann::json& rows) {
  const jit::DeviceInfo* dev = jit::device_info(0).value();
  const int sms = dev->sm_count, cc = dev->compute_capability;
  struct Cand {
    int bm, bn, cluster, split;
    int stages = 0;  // 0: default_stages
    int group = 8;
  };
  struct Case {
    const char* family;
    std::int64_t m, n, k, mode;
    DType dtype;
    double flops;
    std::vector<Cand> cands;
  };
  const auto T = families::k_fp8_per_tensor, B = families::k_fp8_blockwise;
  const double F = 2.0;
  std::vector<Case> cases = {
      {"fp8_gemm", 8192, 8192, 8192, B, DType::bf16, F * 8192 * 8192 * 8192,
       {{128, 256, 1, 1}, {128, 256, 1, 1, 0, 16}, {128, 256, 1, 1, 0, 1}, {128, 256, 2, 1, 0, 16}}},
      {"fp8_gemm", 4096, 7168, 16384, B, DType::bf16, F * 4096 * 7168 * 16384, {{128, 256, 1, 1}, {128, 256, 1, 1, 0, 16}}},
      {"fp8_gemm", 4096, 4096, 7168, B, DType::bf16, F * 4096 * 4096 * 7168,
       {{128, 256, 1, 1}, {128, 256, 1, 1, 0, 16}, {128, 256, 2, 1}}},
      {"fp8_gemm", 4096, 2112, 7168, B, DType::bf16, F * 4096 * 2112 * 7168,
       {{128, 192, 1, 1}, {128, 192, 1, 1, 0, 16}, {128, 192, 2, 1}, {128, 192, 1, 1, 3}, {128, 192, 1, 1, 5}}},
      {"fp8_gemm", 128, 7168, 16384, B, DType::bf16, F * 128 * 7168 * 16384, {{64, 128, 1, 1}, {128, 64, 1, 1}}},
      {"fp8_gemm", 128, 4096, 7168, B, DType::bf16, F * 128 * 4096 * 7168, {{64, 64, 1, 1}, {64, 128, 1, 1}}},
      {"fp8_gemm", 128, 2112, 7168, B, DType::bf16, F * 128 * 2112 * 7168,
       {{64, 32, 1, 1}, {64, 32, 1, 1, 18}, {64, 64, 1, 1}, {128, 32, 1, 1}}},
      // Per tensor at 128 x 2112 x 7168 (level with cuBLAS): the pipeline depth, wider tiles and
      // clusters sharing A around the heuristic's 64 x 32.
      {"fp8_gemm", 128, 2112, 7168, T, DType::bf16, F * 128 * 2112 * 7168,
       {{64, 32, 1, 1}, {64, 32, 1, 1, 12}, {64, 32, 1, 1, 18}, {64, 64, 1, 1}, {128, 32, 1, 1}, {64, 32, 2, 1}}},
      // Per tensor at the large shapes (level with cuBLAS): the pipeline depth and the group order
      // around the heuristic's 128 x 256, 4 stages, group 8.
      {"fp8_gemm", 8192, 8192, 8192, T, DType::bf16, F * 8192 * 8192 * 8192,
       {{128, 256, 1, 1}, {128, 256, 1, 1, 3}, {128, 256, 1, 1, 5}, {128, 256, 1, 1, 0, 16}, {128, 256, 1, 1, 3, 16}}},
      {"fp8_gemm", 4096, 4096, 7168, T, DType::bf16, F * 4096 * 4096 * 7168,
       {{128, 256, 1, 1}, {128, 256, 1, 1, 3}, {128, 256, 1, 1, 5}, {128, 256, 1, 1, 0, 16}}}};
  // The sweep's shapes (KILN_BENCH_GEMM_VARIANTS=sweep): decode-sized M = 16 with swapped tiles
  // (bm 16, bn 64 or 128) unsplit and split over 2 to 4 CTAs, the deepest ring, and the 64-row
  // tiles they replace; 1000 tokens per tensor with the widths that fill waves (176, 56) beside
  // the staged ones; the gated MLP's swapped tiles at 16 tokens. These are timed as back-to-back calls over input sets that together exceed
  // L2 (time_back_to_back), as the sweep times them: a flush before each call of a few
  // microseconds would time the write-back of the flushed lines as much as the kernel.
  const std::vector<Cand> decode = {{16, 64, 1, 1},  {16, 64, 1, 2},      {16, 64, 1, 3},  {16, 64, 1, 4},
                                    {16, 128, 1, 1}, {16, 128, 1, 2},     {16, 128, 1, 4}, {16, 64, 1, 1, 18},
                                    {64, 32, 1, 1},  {64, 64, 1, 1}};
  std::vector<Case> sweep_cases;
  for (std::int64_t mode : {T, B})
    for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{4096, 14336}, {2880, 2880}, {4096, 4160}, {896, 4864},
                        {3072, 8192}, {5120, 14336}, {14336, 4096}, {7168, 2112}, {3584, 18944}})
      sweep_cases.push_back({"fp8_gemm", 16, n, k, mode, DType::bf16, F * 16 * n * k, decode});
  for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{14336, 4096}, {4864, 896}, {896, 4864}, {5120, 14336},
                      {14336, 4032}})
    sweep_cases.push_back({"fp8_gemm", 1000, n, k, T, DType::bf16, F * 1000 * n * k,
                            {{128, 176, 1, 1}, {128, 192, 1, 1}, {128, 256, 1, 1}, {128, 128, 1, 1}, {128, 64, 1, 1},
                             {128, 56, 1, 1}, {128, 192, 1, 1, 0, 16}}});
  // The gated MLP (bf16, SiLU) at 16 tokens: swapped tiles against the 64 x 64 they replace.
  for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{28672, 8192}, {14336, 4096}, {4864, 896}, {2880, 2880},
                      {25600, 5120}})
    sweep_cases.push_back({"gated_mlp", 16, n, k, 0, DType::bf16, 4.0 * 16 * n * k,
                           {{16, 64, 1, 1}, {16, 128, 1, 1}, {32, 64, 1, 1}, {64, 64, 1, 1}}});
  const char* which = std::getenv("KILN_BENCH_GEMM_VARIANTS");
  const bool sweep_only = which && std::string(which) == "sweep";
  if (sweep_only) cases = sweep_cases;
  std::printf("\ngemm variants\n%10s %6s %6s %6s %10s %9s  %s\n", "family", "M", "N", "K", "median_us", "TFLOP/s",
              "variant");
  // KILN_BENCH_GEMM_CASE=i: case i of the list above alone (one kernel family to profile, say).
  const char* only_case = std::getenv("KILN_BENCH_GEMM_CASE");
  int case_index = -1;
  for (const Case& c : cases) {
    ++case_index;
    if (only_case && std::atoi(only_case) != case_index) continue;
    const Family& f = *Registry::global().find(c.family);
    Problem p = Problem::of(c.dtype, 16, g::GemmProblem{.m = c.m, .n = c.n, .k = c.k, .mode = c.mode});
    p.sm_count = std::uint16_t(sms);
    p.cc = std::uint8_t(cc);
    const Params h = f.heuristic(p);
    const g::Kind kind = std::string(c.family) == "gated_mlp" ? g::k_gated : c.mode == B ? g::k_fp8_block : g::k_fp8_tensor;
    const auto specs = f.buffers(h, p);
    std::size_t set_bytes = 0;
    for (const auto& b : specs) set_bytes += std::size_t(b.elements) * dtype_size(b.dtype);
    const int sets = sweep_only ? rotation_sets(set_bytes) : 1;
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    auto ptrs = std::vector<std::vector<void*>>(std::size_t(sets));
    for (const auto& b : specs) {
      auto host = random_matrix(ctx, b.dtype == DType::u8 ? DType::u8 : b.dtype == DType::f32 ? DType::f32 : DType::bf16,
                                1, b.elements, 0.05f);
      if (b.dtype == DType::f32)
        for (std::size_t i = 0; i < host.size(); i += 4) {
          const float one = 1.0f / 64;
          std::memcpy(host.data() + i, &one, 4);
        }
      for (int set = 0; set < sets; ++set) {
        bufs.push_back(std::make_unique<DeviceBuffer>(host.size()));
        bufs.back()->upload(host.data());
        ptrs[std::size_t(set)].push_back(bufs.back()->get());
      }
    }
    for (const Cand& cand : c.cands) {
      g::Tile t{true, cand.bm, cand.bn, 4, cand.group, cand.cluster, cand.split};
      t.stages = cand.stages ? cand.stages : g::default_stages(kind, t, cc);
      const Params v = g::with_tile(h, t);
      if (!f.validate(v).ok() || !f.check_problem(v, p).ok()) continue;
      auto k = ctx.runtime->kernel(KernelSpec{c.family, v});
      check(k.status(), "kernel");
      auto call = [&](int i) { check(ctx.runtime->launch(**k, p, ptrs[std::size_t(i % sets)], nullptr), "launch"); };
      call(0);
      check(ctx.driver->ctx_synchronize(), "sync");
      const double ms = sweep_only ? time_back_to_back(call, sets, 40) : time_events(call, 3, 20);
      const double tflops = c.flops / (ms * 1e-3) / 1e12;
      std::printf("%10s %6lld %6lld %6lld %10.1f %9.1f  %s%s\n", c.family, (long long)c.m, (long long)c.n, (long long)c.k,
                  ms * 1e3, tflops, v.canonical().c_str(), v == h ? "  (heuristic)" : "");
      rows.push_back({{"kind", std::string("variant_") + c.family}, {"m", c.m}, {"n", c.n}, {"k", c.k},
                      {"median_us", ms * 1e3}, {"tflops", tflops}, {"variant", v.canonical()}, {"heuristic", v == h}});
    }
  }
  return 0;
}

int run(Context& ctx) {
  nlohmann::json rows = nlohmann::json::array();
  const char* v = std::getenv("KILN_BENCH_GEMM_VARIANTS");
  const bool only = v && (std::string(v) == "only" || std::string(v) == "sweep");
  int rc = only ? 0 : fp8(ctx, rows);
  if (rc == 0 && !only) rc = gated(ctx, rows);
  if (rc == 0 && v && (std::string(v) == "1" || only))
    rc = variants(ctx, rows);
  (*ctx.out)["gemm"] = rows;
  return rc;
}

Register reg("gemm", run);

}  // namespace
}  // namespace kiln::bench
