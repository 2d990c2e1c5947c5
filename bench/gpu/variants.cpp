// Every variant in a family's tuning space, timed on each benchmark shape: the data behind the
// heuristics (families/*) and what the autotuner searches. Bytes are the family's buffers (every
// input read once, every output written once), so GB/s here is comparable with the family's own
// section. Correctness is the family sections' job (they check the heuristic's variant) and the
// GPU tests' (every catalog variant); this section only ranks.
//   kiln_bench_gpu --only variants [--quick]
// KILN_BENCH_VARIANTS=fam1,fam2 limits the families.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "client/validate.h"
#include "bench/gpu_harness.h"
#include "kiln/runtime.h"
#include "families/act_and_mul/act_and_mul.h"
#include "families/add_rmsnorm/add_rmsnorm.h"
#include "families/rmsnorm/rmsnorm.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd.h"
#include "families/rmsnorm_rope/rmsnorm_rope.h"
#include "families/rope/rope.h"
#include "jit/device_info.h"

namespace kiln::bench {
namespace {

struct Case {
  std::string family;
  std::string label;
  Problem problem;
};

std::vector<Case> cases(bool quick, int sms, int cc) {
  using namespace families;
  std::vector<Case> out;
  auto shape = [](std::int64_t t, std::int64_t h) { return std::to_string(t) + "x" + std::to_string(h); };
  std::vector<std::pair<std::int64_t, std::int64_t>> norm = {
      {4096, 2048},  {4096, 4096},  {4096, 5120},  {4096, 8192},   {4096, 16384}, {4096, 65536},
      {32768, 2048}, {32768, 4096}, {32768, 5120}, {32768, 8192}, {32768, 16384}, {16, 4096}};
  if (quick) norm = {{4096, 4096}, {4096, 16384}, {4096, 65536}, {32768, 4096}};
  for (auto [t, h] : norm) {
    // rmsnorm without device facts (one block per row, no sm_90 kernel), then with the device's
    // (as the runtime fills them in: variants whose rows fit half their register cache pipeline
    // several rows per block on a capped grid, and the bulk-copy kernel joins on sm_90).
    const RmsNormProblem rp{.rows = t, .cols = h, .x_row_stride = h, .y_row_stride = h, .eps = 1e-6};
    const Problem plain = Problem::of(DType::bf16, 16, rp);
    out.push_back({"rmsnorm", shape(t, h), plain});
    Problem capped = plain;
    capped.sm_count = std::uint16_t(sms);
    capped.cc = std::uint8_t(cc);
    out.push_back({"rmsnorm", shape(t, h) + " sms", capped});
    out.push_back({"add_rmsnorm", shape(t, h),
                   Problem::of(DType::bf16, 16,
                               AddRmsNormProblem{.rows = t, .cols = h, .x_row_stride = h, .residual_row_stride = h,
                                                 .y_row_stride = h, .residual_out_row_stride = h, .eps = 1e-6})});
  }
  // The backward's first stage (dx and the partial dw rows; the small reduction over slabs is
  // left out). Its slab count follows each variant's block shape (see run()).
  std::vector<std::pair<std::int64_t, std::int64_t>> bwd = {{4096, 4096}, {4096, 8192}, {32768, 4096},
                                                            {32768, 16384}, {4096, 32768}, {4096, 65536}};
  if (quick) bwd = {{4096, 4096}, {32768, 16384}};
  for (auto [t, h] : bwd) {
    // Slabs as many as any variant takes (rmsnorm_bwd_slabs: at most SMs x 16), so the partial
    // rows' buffer fits every variant; run() sets each variant's own count.
    const RmsNormBwdProblem p{.rows = t, .cols = h, .dy_row_stride = h, .x_row_stride = h, .dx_row_stride = h,
                              .slabs = std::min<std::int64_t>(t, std::int64_t(sms) * 16), .max_cluster = 8};
    out.push_back({"rmsnorm_bwd", shape(t, h), Problem::of(DType::bf16, 16, p)});
  }
  // add_rms_norm_backward's first stage (inv_rms recomputed, dh added): 4096 and 16384 bf16 rows
  // take the bulk-copy and the clustered kernel there (the one-block kernel spills with dh).
  for (auto [t, h] : std::vector<std::pair<std::int64_t, std::int64_t>>{{4096, 4096}, {4096, 16384}}) {
    const RmsNormBwdProblem p{.rows = t, .cols = h, .dy_row_stride = h, .x_row_stride = h, .dx_row_stride = h,
                              .slabs = std::min<std::int64_t>(t, std::int64_t(sms) * 16), .max_cluster = 8,
                              .dh_row_stride = h, .recompute = 1, .eps = 1e-6};
    out.push_back({"rmsnorm_bwd", shape(t, h) + " add", Problem::of(DType::bf16, 16, p)});
  }
  for (auto [t, d] : std::vector<std::pair<std::int64_t, std::int64_t>>{{4096, 14336}, {32768, 11008}}) {
    ActAndMulProblem q{.rows = t, .d = d, .x_row_stride = 2 * d, .out_row_stride = d, .activation = k_am_silu};
    out.push_back({"act_and_mul", shape(t, d) + " silu", Problem::of(DType::bf16, 16, q)});
    q.activation = k_am_gelu;
    out.push_back({"act_and_mul", shape(t, d) + " gelu", Problem::of(DType::bf16, 16, q)});
  }
  for (std::int64_t t : {4096, 32768})
    for (std::int64_t d : {64, 128}) {
      const RopeProblem r{.tokens = t, .q_heads = 32, .kv_heads = 8, .head_dim = d, .layout = k_rope_neox,
                          .max_pos = std::max<std::int64_t>(t, 4096), .q_stride = 32 * d, .k_stride = 8 * d,
                          .q_out_stride = 32 * d, .k_out_stride = 8 * d};
      out.push_back({"rope", std::to_string(t) + " neox d" + std::to_string(d), Problem::of(DType::bf16, 16, r)});
      const RmsNormRopeProblem n{.rows = t, .hidden = 4096, .head_dim = d, .seq = t, .num_heads = 4096 / d,
                                 .cos_dtype = std::int64_t(DType::bf16), .eps = 1e-6};
      out.push_back({"rmsnorm_rope", std::to_string(t) + "x4096 d" + std::to_string(d), Problem::of(DType::bf16, 16, n)});
    }
  return out;
}

// Random floats for floating buffers; integer buffers (position ids) count up modulo their index
// bound (BufferSpec::index_bound; 1 when they have none).
void fill(DeviceBuffer& b, const BufferSpec& spec, std::mt19937& rng) {
  const std::int64_t modulo = spec.index_bound;
  if (spec.dtype == DType::i64 || spec.dtype == DType::i32) {
    std::vector<std::int64_t> v(spec.elements);
    for (std::int64_t i = 0; i < spec.elements; ++i) v[i] = i % std::max<std::int64_t>(1, modulo);
    if (spec.dtype == DType::i64) return b.upload(v.data());
    std::vector<std::int32_t> w(v.begin(), v.end());
    return b.upload(w.data());
  }
  // At most 1M distinct values, repeated: fresh data each run without drawing gigabytes on the host.
  const std::int64_t distinct = std::min<std::int64_t>(spec.elements, 1 << 20);
  auto base = random_values(spec.dtype, distinct, rng, 1.0f);
  const std::size_t esize = dtype_size(spec.dtype);
  std::vector<unsigned char> all(std::size_t(spec.elements) * esize);
  for (std::size_t off = 0; off < all.size(); off += base.size())
    std::memcpy(all.data() + off, base.data(), std::min(base.size(), all.size() - off));
  b.upload(all.data());
}

bool wanted(const std::string& family) {
  const char* only = std::getenv("KILN_BENCH_VARIANTS");
  if (!only || !*only) return true;
  std::stringstream ss(only);
  for (std::string item; std::getline(ss, item, ',');)
    if (item == family) return true;
  return false;
}

int run(Context& ctx) {
  // Its own embedded runtime on the default cache (KILN_CACHE_DIR), which scripts/gpu_run.sh
  // prewarms with all cores: compiling ~200 variants one by one here would take minutes.
  RuntimeOptions options;
  options.mode = ResolverMode::embedded;
  auto rt = Runtime::create(options);
  check(rt.status(), "runtime");
  nlohmann::json all = nlohmann::json::array();
  const jit::DeviceInfo* dev = jit::device_info(0).value();
  const int sms = dev->sm_count, cc = dev->compute_capability;
  for (const Case& c : cases(ctx.quick, sms, cc)) {
    if (!wanted(c.family)) continue;
    const Family& f = *Registry::global().find(c.family);
    const Params heuristic = f.heuristic(c.problem);
    const auto specs = f.buffers(heuristic, c.problem);
    std::size_t bytes = 0;
    for (const auto& s : specs)  // the backward's partial dw rows are workspace, not traffic the op must move
      if (s.name != "partial") bytes += std::size_t(s.elements) * dtype_size(s.dtype);
    const int sets = rotation_sets(bytes);
    std::vector<std::vector<std::unique_ptr<DeviceBuffer>>> bufs(sets);
    for (int s = 0; s < sets; ++s)
      for (const auto& spec : specs) {
        bufs[s].push_back(std::make_unique<DeviceBuffer>(std::max<std::size_t>(1, spec.elements * dtype_size(spec.dtype))));
        if (spec.role == BufferRole::input) fill(*bufs[s].back(), spec, ctx.rng);
      }
    std::vector<std::pair<double, std::string>> results;
    for (const Params& params : f.tuning_space(c.problem)) {
      auto k = (*rt)->kernel(KernelSpec{c.family, params});
      check(k.status(), "kernel");
      Problem problem = c.problem;
      if (c.family == "rmsnorm_bwd") {
        // Clustered kernels: one slab per cluster resident at once, as the op asks the driver.
        auto resident = client::rmsnorm_bwd_resident_clusters(**rt, f, params, problem);
        check(resident.status(), "resident clusters");
        auto q = problem.as<families::RmsNormBwdProblem>();
        q.slabs = families::rmsnorm_bwd_slabs(families::rmsnorm_bwd_choice(params), problem, sms, *resident);
        problem.set(q);
      }
      std::vector<void*> ptrs(specs.size());
      double ms = time_events([&](int i) {
        for (std::size_t j = 0; j < specs.size(); ++j) ptrs[j] = bufs[i % sets][j]->get();
        check((*rt)->launch(**k, problem, ptrs, nullptr), "launch");
      }, 5, ctx.quick ? 15 : 40);
      results.emplace_back(ms, params.canonical());
    }
    std::sort(results.begin(), results.end());
    double heuristic_ms = 0;
    for (auto& [ms, name] : results)
      if (name == heuristic.canonical()) heuristic_ms = ms;
    auto gbs = [&](double ms) { return double(bytes) / (ms * 1e-3) / 1e9; };
    std::printf("%-12s %-18s best %5.1f%% %-44s | heuristic %5.1f%% %-44s", c.family.c_str(), c.label.c_str(),
                100 * gbs(results[0].first) / ctx.copy_gbs, results[0].second.c_str(),
                100 * gbs(heuristic_ms) / ctx.copy_gbs, heuristic.canonical().c_str());
    for (std::size_t i = 1; i < std::min<std::size_t>(4, results.size()); ++i)
      std::printf(" | %s %.1f%%", results[i].second.c_str(), 100 * gbs(results[i].first) / ctx.copy_gbs);
    std::printf("\n");
    std::fflush(stdout);
    nlohmann::json r = {{"family", c.family}, {"shape", c.label}, {"heuristic", heuristic.canonical()},
                        {"bytes", bytes}, {"variants", nlohmann::json::array()}};
    for (auto& [ms, name] : results) r["variants"].push_back({{"variant", name}, {"us", ms * 1e3}, {"gbs", gbs(ms)}});
    all.push_back(r);
  }
  (*ctx.out)["variants"] = all;
  return 0;
}

Register reg("variants", run);

}  // namespace
}  // namespace kiln::bench
