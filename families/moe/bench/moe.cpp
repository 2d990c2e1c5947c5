// The MoE grouped GEMM (bf16; FP8 rowwise and block-scaled on sm_90a), balanced and Zipf routing: Mixtral
// gate_up (8 experts x 4096 tokens, K 4096, N 28672) and down (K 14336, N 4096), DeepSeek-V3
// gate_up (256 experts x 1024 tokens, K 7168, N 4096) and down (K 2048, N 7168), DeepSeek-V3 decode
// (256 x 16 tokens, gate_up) contiguous and masked; the weight-gradient form (kgrouped) at Mixtral
// down and Qwen3-MoE down (128 experts x 256 rows), the input-gradient form (dgrad, the weight as
// stored) at Mixtral down; and the routing kernels (top-k, permute, combine) at Mixtral and DeepSeek-V3 prefill.
// Zipf routing gives expert e a share proportional to 1 / (e + 1) of the same total rows
// (bench/moe.py builds the same counts). Sampled outputs are checked against fp64 first (every
// output poisoned before the first call), then timed; TFLOP/s = 2 rows N K / time, the
// torch._grouped_mm anchor beside it in the same run (families/moe/bench/moe.py).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "bench/gpu_harness.h"
#include "common/fp8.h"
#include "common/half.h"
#include "families/moe/moe.h"
#include "families/moe/ops.h"
#include "jit/device_info.h"
#include "jit/tune_launch.h"

namespace kiln::bench {
namespace {

namespace m = families::moe;

// A device buffer of `elements` values repeating a host block of `block` random values (filled on
// the device by doubling copies, so the 15 GB DeepSeek-V3 weights need no host copy); element i
// is base[i % block].
struct Tiled {
  std::unique_ptr<DeviceBuffer> dev;
  std::vector<unsigned char> base;
  std::int64_t block;
  double at(std::int64_t i, DType t) const {
    return t == DType::u8 ? double(e4m3_to_float(base[std::size_t(i % block)])) : load_as_double(base.data(), t, i % block);
  }
};
Tiled tiled(Context& ctx, DType t, std::int64_t elements, float scale) {
  Tiled out;
  out.block = std::min<std::int64_t>(elements, 1000003);
  if (t == DType::u8) {  // e4m3 codes of normal values times scale (NaN codes never come out)
    std::normal_distribution<float> d(0.0f, scale);
    out.base.resize(std::size_t(out.block));
    for (auto& v : out.base) v = float_to_e4m3(d(ctx.rng));
  } else {
    out.base = random_values(t, out.block, ctx.rng, scale);
  }
  const std::size_t es = dtype_size(t), total = std::size_t(elements) * es;
  out.dev = std::make_unique<DeviceBuffer>(total);
  std::vector<unsigned char> first(out.base);
  check(ctx.driver->memcpy_htod(out.dev->ptr, first.data(), first.size()), "upload");
  // Whole blocks only, so the tiling stays aligned to `block` elements.
  std::size_t done = first.size();
  while (done < total) {
    const std::size_t n = std::min(done / first.size() * first.size(), total - done);
    check(ctx.driver->memcpy_dtod(out.dev->ptr + done, out.dev->ptr, n), "tile");
    done += n;
  }
  return out;
}

std::vector<std::int32_t> expert_counts(std::int64_t experts, std::int64_t rows, bool zipf) {
  std::vector<std::int32_t> c(std::size_t(experts), std::int32_t(rows / experts));
  if (zipf) {
    double h = 0;
    for (std::int64_t e = 0; e < experts; ++e) h += 1.0 / double(e + 1);
    std::int64_t given = 0;
    for (std::int64_t e = 0; e < experts; ++e) given += c[e] = std::int32_t(std::floor(double(rows) / h / double(e + 1)));
    c[0] += std::int32_t(rows - given);
  } else {
    c[0] += std::int32_t(rows - rows / experts * experts);
  }
  return c;
}

struct Case {
  const char* name;
  std::int64_t experts, per_expert, n, k;
  m::Layout layout;
};

// The schedules beside the heuristic's pick: its path and layout with the pingpong schedule at the
// tiles that fit it (128 x 128, 64 x 256) and the cooperative one at 128 x 256 and 128 x 128, 4
// stages, timed on the same buffers (the op's order) and printed with their ratio to the
// heuristic's time `ms`. Shows which schedule pays where.
void time_schedules(Context& ctx, const char* family, const Problem& base, const std::vector<void*>& bufs, double ms,
                    double flops) {
  const Family& f = *Registry::global().find(family);
  Problem p = base;
  jit::set_device(p, *jit::device_info(0).value());
  const Params h = f.heuristic(p);
  if (*h.get_str("path") != "wgmma") return;
  struct Cand {
    const char* schedule;
    int bm, bn;
  };
  for (const Cand& cand : {Cand{"pingpong", 128, 128}, Cand{"pingpong", 64, 256}, Cand{"cooperative", 128, 256},
                           Cand{"cooperative", 128, 128}}) {
    Params c = h;
    c.set("schedule", cand.schedule);
    c.set("bm", std::int64_t(cand.bm));
    c.set("bn", std::int64_t(cand.bn));
    c.set("stages", std::int64_t(4));
    if (c == h || !f.validate(c).ok() || !f.check_problem(c, p).ok()) continue;
    auto k = ctx.runtime->kernel(KernelSpec{family, c});
    check(k.status(), "kernel");
    const auto fn = static_cast<CUfunction>((*k)->function);
    const double t = time_events([&](int) { check(jit::launch_candidate(f, c, p, fn, bufs), "launch"); }, 5,
                                 ctx.quick ? 10 : 30);
    std::printf("    %-60s %10.1f %9.1f  %.3fx the heuristic\n", c.canonical().c_str(), t * 1e3,
                flops / (t * 1e-3) / 1e12, ms / t);
  }
}

// grouped_gemm_fp8 (e4m3, bf16 out; rowwise scales, or DeepSeek-V3's 1x128 / 128x128 blocks) on
// one case: checked against fp64 on sampled outputs, then timed; the rows beside the bf16 one.
Status fp8(Context& ctx, nlohmann::json& rows, const Case& c, bool zipf, const std::vector<std::int32_t>& counts,
           const std::vector<std::int32_t>& offs, std::int64_t max_t, bool block) {
  const bool masked = c.layout == m::k_masked;
  const std::int64_t total = c.experts * c.per_expert, a_rows = masked ? c.experts * max_t : total;
  const std::int64_t kb = (c.k + 127) / 128, nb = (c.n + 127) / 128;
  const auto cuda = Device::cuda(0);
  Tiled a = tiled(ctx, DType::u8, a_rows * c.k, 2.0f), b = tiled(ctx, DType::u8, c.experts * c.n * c.k, 0.5f);
  std::vector<float> sa(static_cast<std::size_t>(block ? a_rows * kb : a_rows)),
      sb(static_cast<std::size_t>(block ? c.experts * nb * kb : c.experts * c.n));
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  for (auto& v : sa) v = u(ctx.rng) / 16;
  for (auto& v : sb) v = u(ctx.rng) / 16;
  DeviceBuffer dsa(sa.size() * 4), dsb(sb.size() * 4), dout(std::size_t(a_rows * c.n) * 2), doffs(offs.size() * 4);
  dsa.upload(sa.data());
  dsb.upload(sb.data());
  doffs.upload((masked ? counts : offs).data());
  auto call = [&](int) {
    const TensorView ov = TensorView::contiguous(doffs.get(), DType::i32, {c.experts}, cuda);
    const TensorView bv = TensorView::contiguous(b.dev->get(), DType::u8, {c.experts, c.n, c.k}, cuda);
    const TensorView sbv = block ? TensorView::contiguous(dsb.get(), DType::f32, {c.experts, nb, kb}, cuda)
                                 : TensorView::contiguous(dsb.get(), DType::f32, {c.experts, c.n}, cuda);
    if (masked)
      check(grouped_gemm_fp8_masked(TensorView::contiguous(a.dev->get(), DType::u8, {c.experts, max_t, c.k}, cuda), bv, ov,
                                    block ? TensorView::contiguous(dsa.get(), DType::f32, {c.experts, max_t, kb}, cuda)
                                          : TensorView::contiguous(dsa.get(), DType::f32, {c.experts, max_t}, cuda),
                                    sbv,
                                    TensorView::contiguous(dout.get(), DType::bf16, {c.experts, max_t, c.n}, cuda),
                                    nullptr, ctx.runtime),
            "grouped_gemm_fp8_masked");
    else
      check(grouped_gemm_fp8(TensorView::contiguous(a.dev->get(), DType::u8, {total, c.k}, cuda), bv, ov,
                             block ? TensorView::contiguous(dsa.get(), DType::f32, {total, kb}, cuda)
                                   : TensorView::contiguous(dsa.get(), DType::f32, {total}, cuda),
                             sbv,
                             TensorView::contiguous(dout.get(), DType::bf16, {total, c.n}, cuda), nullptr, ctx.runtime),
            "grouped_gemm_fp8");
  };
  dout.poison();
  call(0);
  check(ctx.driver->ctx_synchronize(), "sync");
  std::vector<unsigned char> got(std::size_t(a_rows * c.n) * 2);
  dout.download(got.data());
  std::uniform_int_distribution<std::int64_t> pick_e(0, c.experts - 1);
  double num = 0, den = 0;
  bool nan = false;
  for (int s = 0; s < 256; ++s) {
    const std::int64_t e = pick_e(ctx.rng), cnt = counts[e];
    if (cnt == 0) continue;
    const std::int64_t lo = masked ? e * max_t : (e ? offs[e - 1] : 0);
    std::uniform_int_distribution<std::int64_t> pr(0, cnt - 1), pj(0, c.n - 1);
    const std::int64_t r = lo + pr(ctx.rng), j = pj(ctx.rng);
    double want = 0;
    for (std::int64_t blk = 0; blk < kb; ++blk) {
      double part = 0;
      for (std::int64_t q = blk * 128; q < std::min(c.k, (blk + 1) * 128); ++q)
        part += a.at(r * c.k + q, DType::u8) * b.at((e * c.n + j) * c.k + q, DType::u8);
      want += block ? part * double(sa[r * kb + blk]) * double(sb[(e * nb + j / 128) * kb + blk]) : part;
    }
    if (!block) want *= double(sa[r]) * double(sb[e * c.n + j]);
    const double g = load_as_double(got.data(), DType::bf16, r * c.n + j);
    nan = nan || std::isnan(g);
    num += (g - want) * (g - want);
    den += want * want;
  }
  const double err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (nan || !(err < 1e-2))
    return internal_error(std::string("FAILED against fp64: ") + c.name + (zipf ? " zipf" : " balanced") + ", rel err " +
                          std::to_string(err) + (nan ? ", unwritten outputs" : ""));
  const double ms = time_events(call, 5, ctx.quick ? 10 : 30);
  const double tflops = 2.0 * double(total) * double(c.n) * double(c.k) / (ms * 1e-3) / 1e12;
  Problem p = Problem::of(DType::bf16, 16,
                          m::GroupedGemmFp8Problem{.m = masked ? max_t : total, .n = c.n, .k = c.k,
                                                   .experts = c.experts, .layout = c.layout,
                                                   .scaling = block ? m::k_fp8_block : m::k_fp8_rowwise});
  jit::set_device(p, *jit::device_info(0).value());
  const std::string variant = Registry::global().find("grouped_gemm_fp8")->heuristic(p).canonical();
  std::printf("%-20s %8s %8lld %6lld %6lld %8lld %10.1f %9.1f %9.2e  %s (fp8 %s)\n", c.name,
              zipf ? "zipf" : "balanced", (long long)total, (long long)c.n, (long long)c.k, (long long)c.experts, ms * 1e3,
              tflops, err, variant.c_str(), block ? "block" : "rowwise");
  rows.push_back({{"kind", block ? "grouped_gemm_fp8_block" : "grouped_gemm_fp8"}, {"shape", c.name},
                  {"routing", zipf ? "zipf" : "balanced"},
                  {"rows", total}, {"n", c.n}, {"k", c.k}, {"experts", c.experts}, {"median_us", ms * 1e3},
                  {"tflops", tflops}, {"rel_err", err}, {"variant", variant}});
  if (!block && !masked)
    time_schedules(ctx, "grouped_gemm_fp8", p, {a.dev->get(), b.dev->get(), doffs.get(), dsa.get(), dsb.get(), dout.get()},
                   ms, 2.0 * double(total) * double(c.n) * double(c.k));
  return {};
}

int grouped(Context& ctx, nlohmann::json& rows) {
  std::vector<Case> cases = {{"mixtral_gate_up", 8, 4096, 28672, 4096, m::k_contiguous},
                             {"mixtral_down", 8, 4096, 4096, 14336, m::k_contiguous},
                             {"dsv3_gate_up", 256, 1024, 4096, 7168, m::k_contiguous},
                             {"dsv3_down", 256, 1024, 7168, 2048, m::k_contiguous},
                             {"dsv3_decode", 256, 16, 4096, 7168, m::k_contiguous},
                             {"dsv3_decode_masked", 256, 16, 4096, 7168, m::k_masked},
                             {"mixtral_down_wgrad", 8, 4096, 4096, 14336, m::k_kgrouped},
                             {"qwen3_down_wgrad", 128, 256, 2048, 768, m::k_kgrouped},
                             {"mixtral_down_dgrad", 8, 4096, 14336, 4096, m::k_dgrad}};
  if (ctx.quick) cases = {cases[1], cases[3], cases[4]};
  const Family& f = *Registry::global().find("grouped_gemm");
  const auto cuda = Device::cuda(0);
  std::printf("\ngrouped_gemm (bf16)\n%-20s %8s %8s %6s %6s %8s %10s %9s %9s  %s\n", "shape", "routing", "rows", "N", "K",
              "experts", "median_us", "TFLOP/s", "rel_err", "variant");
  for (const Case& c : cases)
    for (bool zipf : {false, true}) {
      if (c.layout == m::k_masked && zipf) continue;  // masked: the same counts, balanced
      const std::int64_t total = c.experts * c.per_expert;
      const auto counts = expert_counts(c.experts, total, zipf);
      std::vector<std::int32_t> offs(counts.size());
      std::partial_sum(counts.begin(), counts.end(), offs.begin());
      const bool masked = c.layout == m::k_masked, kg = c.layout == m::k_kgrouped, dg = c.layout == m::k_dgrad;
      // Masked: max_tokens is the largest count (the fixed shape a decode graph would allocate).
      const std::int64_t max_t = *std::max_element(counts.begin(), counts.end());
      const std::int64_t a_rows = masked ? c.experts * max_t : total;
      // kgrouped (dW = dY^T X): a = dY [rows, n], b = X [rows, k], out [experts, n, k]. dgrad
      // (dX = dY W): a = dY [rows, k], b = W [experts, k, n] as the forward stores it.
      Tiled a = tiled(ctx, DType::bf16, a_rows * (kg ? c.n : c.k), 1.0f);
      Tiled b = tiled(ctx, DType::bf16, kg ? total * c.k : c.experts * c.n * c.k, 1.0f / 64);
      const std::int64_t out_elems = kg ? c.experts * c.n * c.k : a_rows * c.n;
      DeviceBuffer dout(std::size_t(out_elems) * 2), doffs(offs.size() * 4);
      const std::vector<std::int32_t>& o = masked ? counts : offs;
      doffs.upload(o.data());
      auto call = [&](int) {
        const TensorView ov = TensorView::contiguous(doffs.get(), DType::i32, {c.experts}, cuda);
        if (kg)
          check(grouped_gemm_wgrad(TensorView::contiguous(a.dev->get(), DType::bf16, {total, c.n}, cuda),
                                   TensorView::contiguous(b.dev->get(), DType::bf16, {total, c.k}, cuda), ov,
                                   TensorView::contiguous(dout.get(), DType::bf16, {c.experts, c.n, c.k}, cuda), nullptr,
                                   ctx.runtime),
                "grouped_gemm_wgrad");
        else if (dg)
          check(grouped_gemm_dgrad(TensorView::contiguous(a.dev->get(), DType::bf16, {total, c.k}, cuda),
                                   TensorView::contiguous(b.dev->get(), DType::bf16, {c.experts, c.k, c.n}, cuda), ov,
                                   TensorView::contiguous(dout.get(), DType::bf16, {total, c.n}, cuda), nullptr,
                                   ctx.runtime),
                "grouped_gemm_dgrad");
        else if (masked)
          check(grouped_gemm_masked(TensorView::contiguous(a.dev->get(), DType::bf16, {c.experts, max_t, c.k}, cuda),
                                    TensorView::contiguous(b.dev->get(), DType::bf16, {c.experts, c.n, c.k}, cuda), ov,
                                    TensorView::contiguous(dout.get(), DType::bf16, {c.experts, max_t, c.n}, cuda),
                                    nullptr, ctx.runtime),
                "grouped_gemm_masked");
        else
          check(grouped_gemm(TensorView::contiguous(a.dev->get(), DType::bf16, {total, c.k}, cuda),
                             TensorView::contiguous(b.dev->get(), DType::bf16, {c.experts, c.n, c.k}, cuda), ov,
                             TensorView::contiguous(dout.get(), DType::bf16, {total, c.n}, cuda), nullptr, ctx.runtime),
                "grouped_gemm");
      };
      dout.poison();
      call(0);
      check(ctx.driver->ctx_synchronize(), "sync");
      // 256 sampled outputs of covered rows against fp64.
      std::vector<unsigned char> got(std::size_t(out_elems) * 2);
      dout.download(got.data());
      std::uniform_int_distribution<std::int64_t> pick_e(0, c.experts - 1);
      double num = 0, den = 0;
      bool nan = false;
      for (int s = 0; s < 256; ++s) {
        const std::int64_t e = pick_e(ctx.rng);
        const std::int64_t lo = masked ? e * max_t : (e ? offs[e - 1] : 0), cnt = counts[e];
        if (!kg && cnt == 0) continue;
        std::uniform_int_distribution<std::int64_t> pr(0, std::max<std::int64_t>(cnt, 1) - 1), pj(0, c.n - 1),
            pq(0, c.k - 1);
        double want = 0, g;
        if (kg) {
          const std::int64_t i = pj(ctx.rng), j = pq(ctx.rng);
          for (std::int64_t r = lo; r < lo + cnt; ++r) want += a.at(r * c.n + i, DType::bf16) * b.at(r * c.k + j, DType::bf16);
          g = load_as_double(got.data(), DType::bf16, (e * c.n + i) * c.k + j);
        } else {
          const std::int64_t r = lo + pr(ctx.rng), j = pj(ctx.rng);
          for (std::int64_t q = 0; q < c.k; ++q)
            want += a.at(r * c.k + q, DType::bf16) *
                    b.at(dg ? (e * c.k + q) * c.n + j : (e * c.n + j) * c.k + q, DType::bf16);
          g = load_as_double(got.data(), DType::bf16, r * c.n + j);
        }
        nan = nan || std::isnan(g);
        num += (g - want) * (g - want);
        den += want * want;
      }
      const double err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
      if (nan || !(err < 1e-2)) {
        std::printf("grouped_gemm %s %s: FAILED against fp64 (rel err %.3g, unwritten %d)\n", c.name,
                    zipf ? "zipf" : "balanced", err, int(nan));
        return 1;
      }
      const double ms = time_events(call, 5, ctx.quick ? 10 : 30);
      const double tflops = 2.0 * double(total) * double(c.n) * double(c.k) / (ms * 1e-3) / 1e12;
      Problem p = Problem::of(DType::bf16, 16,
                              m::GroupedGemmProblem{.m = masked ? max_t : total, .n = c.n, .k = c.k,
                                                    .experts = c.experts, .layout = c.layout});
      jit::set_device(p, *jit::device_info(0).value());
      const std::string variant = f.heuristic(p).canonical();
      std::printf("%-20s %8s %8lld %6lld %6lld %8lld %10.1f %9.1f %9.2e  %s\n", c.name, zipf ? "zipf" : "balanced",
                  (long long)total, (long long)c.n, (long long)c.k, (long long)c.experts, ms * 1e3, tflops, err,
                  variant.c_str());
      rows.push_back({{"kind", "grouped_gemm"}, {"shape", c.name}, {"routing", zipf ? "zipf" : "balanced"},
                      {"rows", total}, {"n", c.n}, {"k", c.k}, {"experts", c.experts}, {"median_us", ms * 1e3},
                      {"tflops", tflops}, {"rel_err", err}, {"variant", variant}});
      if (c.layout == m::k_contiguous || dg)
        time_schedules(ctx, "grouped_gemm", p, {a.dev->get(), b.dev->get(), doffs.get(), dout.get()}, ms,
                       2.0 * double(total) * double(c.n) * double(c.k));
      if (!kg && !dg && jit::device_info(0).value()->compute_capability == 90) {
        a.dev.reset();
        b.dev.reset();
        for (bool block : {false, true}) check(fp8(ctx, rows, c, zipf, counts, offs, max_t, block), "grouped_gemm_fp8");
      }
    }
  return 0;
}

// Routing at prefill sizes: top-k, permute (sort + gather) and combine; GB/s of the rows moved.
int routing(Context& ctx, nlohmann::json& rows) {
  struct R {
    const char* name;
    std::int64_t tokens, experts, top_k, hidden;
    bool sigmoid;
  };
  const std::vector<R> cases = {{"mixtral", 4096, 8, 2, 4096, false}, {"dsv3", 4096, 256, 8, 7168, true}};
  const auto cuda = Device::cuda(0);
  std::printf("\nmoe routing (bf16 rows)\n%-8s %6s %7s %5s %6s %12s %12s %12s\n", "model", "tokens", "experts", "top_k",
              "hidden", "topk_us", "permute_us", "combine_us");
  for (const R& r : cases) {
    const std::int64_t n = r.tokens * r.top_k;
    auto logits = random_values(DType::f32, r.tokens * r.experts, ctx.rng);
    auto x = random_values(DType::bf16, r.tokens * r.hidden, ctx.rng);
    std::vector<float> bias(std::size_t(r.experts), 0.0f);
    DeviceBuffer dl(logits.size()), dx(x.size()), db(bias.size() * 4), dw(n * 4), di(n * 4), doff((r.experts + 1) * 4),
        drow(n * 4), dsrc(n * 4), dxs(std::size_t(n * r.hidden) * 2), dout(x.size());
    dl.upload(logits.data());
    dx.upload(x.data());
    db.upload(bias.data());
    const TensorView bv = TensorView::contiguous(db.get(), DType::f32, {r.experts}, cuda);
    auto topk = [&](int) {
      check(moe_topk(TensorView::contiguous(dl.get(), DType::f32, {r.tokens, r.experts}, cuda), r.sigmoid ? &bv : nullptr,
                     TensorView::contiguous(dw.get(), DType::f32, {r.tokens, r.top_k}, cuda),
                     TensorView::contiguous(di.get(), DType::i32, {r.tokens, r.top_k}, cuda),
                     r.sigmoid ? MoeScoring::sigmoid_group : MoeScoring::softmax, true, r.sigmoid ? 8 : 1,
                     r.sigmoid ? 4 : 1, r.sigmoid ? 2.5 : 1.0, nullptr, ctx.runtime),
            "moe_topk");
    };
    auto permute = [&](int) {
      check(moe_permute(TensorView::contiguous(dx.get(), DType::bf16, {r.tokens, r.hidden}, cuda),
                        TensorView::contiguous(di.get(), DType::i32, {r.tokens, r.top_k}, cuda),
                        TensorView::contiguous(dxs.get(), DType::bf16, {n, r.hidden}, cuda),
                        TensorView::contiguous(doff.get(), DType::i32, {r.experts + 1}, cuda),
                        TensorView::contiguous(drow.get(), DType::i32, {r.tokens, r.top_k}, cuda),
                        TensorView::contiguous(dsrc.get(), DType::i32, {n}, cuda), nullptr, ctx.runtime),
            "moe_permute");
    };
    const TensorView wv = TensorView::contiguous(dw.get(), DType::f32, {r.tokens, r.top_k}, cuda);
    auto combine = [&](int) {
      check(moe_combine(TensorView::contiguous(dxs.get(), DType::bf16, {n, r.hidden}, cuda),
                        TensorView::contiguous(drow.get(), DType::i32, {r.tokens, r.top_k}, cuda), &wv,
                        TensorView::contiguous(dout.get(), DType::bf16, {r.tokens, r.hidden}, cuda), nullptr, ctx.runtime),
            "moe_combine");
    };
    topk(0);
    permute(0);
    combine(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    const double t_topk = time_events(topk, 5, 30), t_perm = time_events(permute, 5, 30),
                 t_comb = time_events(combine, 5, 30);
    std::printf("%-8s %6lld %7lld %5lld %6lld %12.1f %12.1f %12.1f\n", r.name, (long long)r.tokens, (long long)r.experts,
                (long long)r.top_k, (long long)r.hidden, t_topk * 1e3, t_perm * 1e3, t_comb * 1e3);
    rows.push_back({{"kind", "routing"}, {"model", r.name}, {"tokens", r.tokens}, {"experts", r.experts},
                    {"top_k", r.top_k}, {"hidden", r.hidden}, {"topk_us", t_topk * 1e3},
                    {"permute_us", t_perm * 1e3}, {"combine_us", t_comb * 1e3}});
  }
  return 0;
}

int run(Context& ctx) {
  nlohmann::json rows = nlohmann::json::array();
  int rc = grouped(ctx, rows);
  if (rc == 0) rc = routing(ctx, rows);
  (*ctx.out)["moe"] = rows;
  return rc;
}

Register reg("moe", run);

}  // namespace
}  // namespace kiln::bench
