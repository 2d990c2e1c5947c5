// RMSNorm backward over LLM shapes (bf16): correctness of dx and dw against the CPU reference on
// the first rows, then the full shape's median time and bandwidth. Minimal bytes: read dy, x, w
// and inv_rms, write dx (the partial dw rows stay in L2 and are not counted).
#include <cmath>
#include <cstdio>

#include "bench/gpu_harness.h"
#include "client/validate.h"
#include "common/half.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd_reduce.h"
#include "jit/device_info.h"

namespace kiln::bench {
namespace {

// The inverse RMS of every row of a bf16 [rows, cols] matrix, as the forward saves it.
std::vector<float> inverse_rms(const std::vector<unsigned char>& x, std::int64_t rows, std::int64_t cols) {
  std::vector<float> out(static_cast<std::size_t>(rows));
  const auto* bits = reinterpret_cast<const std::uint16_t*>(x.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      const double v = bf16_to_float(bits[r * cols + c]);
      ss += v * v;
    }
    out[std::size_t(r)] = float(1 / std::sqrt(ss / double(cols) + 1e-6));
  }
  return out;
}

int run(Context& ctx) {
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  for (std::int64_t tokens : {4096, 32768})
    for (std::int64_t hidden : {2048, 4096, 8192, 16384}) shapes.emplace_back(tokens, hidden);
  shapes.emplace_back(4096, 65536);
  if (ctx.quick) shapes = {{4096, 4096}, {32768, 4096}, {4096, 65536}};
  const Family& bwd = *Registry::global().find("rmsnorm_bwd");
  const Family& red = *Registry::global().find("rmsnorm_bwd_reduce");
  auto dev = jit::device_info(0);
  check(dev.status(), "device");
  const int sms = (*dev)->sm_count, major = (*dev)->major;

  std::printf("%8s %7s %10s %10s %8s %9s %9s  %s\n", "tokens", "hidden", "median_us", "GB/s", "%copy", "dx_err",
              "dw_err", "variant");
  nlohmann::json rows = nlohmann::json::array();
  for (auto [tokens, hidden] : shapes) {
    const std::int64_t elems = tokens * hidden;
    const std::size_t bytes = std::size_t(elems) * 2;
    const int sets = rotation_sets(3 * bytes);
    auto hdy = random_values(DType::bf16, elems, ctx.rng);
    auto hx = random_values(DType::bf16, elems, ctx.rng, 2.0f);
    auto hw = random_values(DType::bf16, hidden, ctx.rng);
    const auto hinv = inverse_rms(hx, tokens, hidden);
    std::vector<std::unique_ptr<DeviceBuffer>> dys, xs, dxs;
    for (int s = 0; s < sets; ++s) {
      dys.push_back(std::make_unique<DeviceBuffer>(bytes));
      xs.push_back(std::make_unique<DeviceBuffer>(bytes));
      dxs.push_back(std::make_unique<DeviceBuffer>(bytes));
      dys.back()->upload(hdy.data());
      xs.back()->upload(hx.data());
      dxs.back()->poison();
    }
    DeviceBuffer w(hidden * 2), inv(std::size_t(tokens) * 4), dw(hidden * 2);
    w.upload(hw.data());
    inv.upload(hinv.data());
    auto view = [&](const DeviceBuffer& b, std::int64_t r) {
      return TensorView::contiguous(b.get(), DType::bf16, {r, hidden}, Device::cuda(0));
    };
    const auto wv = TensorView::contiguous(w.get(), DType::bf16, {hidden}, Device::cuda(0));
    const auto dwv = TensorView::contiguous(dw.get(), DType::bf16, {hidden}, Device::cuda(0));
    auto call_rows = [&](int s, std::int64_t r) {
      check(rms_norm_backward(view(*dys[s], r), view(*xs[s], r), wv,
                              TensorView::contiguous(inv.get(), DType::f32, {r}, Device::cuda(0)), view(*dxs[s], r), dwv,
                              nullptr, ctx.runtime),
            "rms_norm_backward");
    };
    auto call = [&](int i) { call_rows(i % sets, tokens); };

    // Correctness on the first rows (dw over those rows only), then the whole shape is written.
    const std::int64_t check_rows = std::min<std::int64_t>(tokens, 64);
    dw.poison();
    call_rows(0, check_rows);
    check(ctx.driver->ctx_synchronize(), "sync");
    std::vector<unsigned char> got_dx(std::size_t(check_rows * hidden) * 2), got_dw(hidden * 2);
    std::vector<unsigned char> want_dx(got_dx.size()), want_dw(got_dw.size());
    check(ctx.driver->memcpy_dtoh(got_dx.data(), dxs[0]->ptr, got_dx.size()), "download dx");
    dw.download(got_dw.data());
    const Problem p = Problem::of(DType::bf16, 16,
                                  families::RmsNormBwdProblem{.rows = check_rows,
                                                              .cols = hidden,
                                                              .dy_row_stride = hidden,
                                                              .x_row_stride = hidden,
                                                              .dx_row_stride = hidden,
                                                              .slabs = 1,
                                                              .max_cluster = 1});
    std::vector<float> partial(static_cast<std::size_t>(hidden));
    void* refb[6] = {hdy.data(), hx.data(), hw.data(), const_cast<float*>(hinv.data()), want_dx.data(), partial.data()};
    check(bwd.cpu_reference(bwd.heuristic(p), p, refb), "reference");
    const Problem pr = Problem::of(DType::bf16, 16, families::RmsNormBwdReduceProblem{.slabs = 1, .cols = hidden});
    void* refr[2] = {partial.data(), want_dw.data()};
    check(red.cpu_reference(red.heuristic(pr), pr, refr), "reference");
    const double dx_err = rel_l2(got_dx.data(), want_dx.data(), DType::bf16, check_rows * hidden);
    const double dw_err = rel_l2(got_dw.data(), want_dw.data(), DType::bf16, hidden);
    call(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    std::vector<unsigned char> full(bytes);
    dxs[0]->download(full.data());
    bool all_written = true;
    for (std::int64_t i = 0; i < elems && all_written; i += 97)
      all_written = !std::isnan(load_as_double(full.data(), DType::bf16, i));
    if (!(dx_err < 1e-2) || !(dw_err < 1e-2) || !all_written) {
      std::printf("rmsnorm_bwd %lldx%lld: FAILED against the CPU reference (dx err %.3g, dw err %.3g, all written %d)\n",
                  (long long)tokens, (long long)hidden, dx_err, dw_err, all_written);
      return 1;
    }

    const double ms = time_events(call, 10, ctx.quick ? 30 : 100);
    const double gbs = double(3 * bytes + hidden * 2 + tokens * 4) / (ms * 1e-3) / 1e9;
    const Problem hp = Problem::of(DType::bf16, 16,
                                   families::RmsNormBwdProblem{.rows = tokens,
                                                               .cols = hidden,
                                                               .dy_row_stride = hidden,
                                                               .x_row_stride = hidden,
                                                               .dx_row_stride = hidden,
                                                               .max_cluster = major >= 9 ? 8 : 1});
    // As the op counts them: clustered kernels take one slab per cluster resident at once.
    auto resident = client::rmsnorm_bwd_resident_clusters(*ctx.runtime, bwd, bwd.heuristic(hp), hp);
    check(resident.status(), "resident clusters");
    const std::int64_t slabs =
        families::rmsnorm_bwd_slabs(families::rmsnorm_bwd_heuristic(hp), hp, sms, *resident);
    const std::string variant = bwd.heuristic(hp).canonical() + ",slabs=" + std::to_string(slabs);
    std::printf("%8lld %7lld %10.2f %10.1f %7.1f%% %9.2e %9.2e  %s\n", (long long)tokens, (long long)hidden, ms * 1e3,
                gbs, 100 * gbs / ctx.copy_gbs, dx_err, dw_err, variant.c_str());
    rows.push_back({{"tokens", tokens}, {"hidden", hidden}, {"median_us", ms * 1e3}, {"gbs", gbs},
                    {"fraction_of_copy", gbs / ctx.copy_gbs}, {"dx_rel_err", dx_err}, {"dw_rel_err", dw_err},
                    {"variant", variant}});
  }
  (*ctx.out)["rmsnorm_bwd"] = rows;
  return 0;
}

Register reg("rmsnorm_bwd", run);

}  // namespace
}  // namespace kiln::bench
