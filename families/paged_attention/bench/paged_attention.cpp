// Paged decode (bf16, H32/KV8, one query, D128). First a check against the CPU reference (B2,
// 4097 and 1000 keys, page 16), then, timed with CUDA events after warm-up, for batch {1, 8, 64,
// 256} x context {512, 2k, 8k, 32k} (B256 at 32k left out: 34 GB of K and V per layout): kiln's
// contiguous decode path (the attention op on [B, L, KV, D]) and the paged decode at page 16 over
// the same keys scattered through a shuffled pool, each in µs, GB/s of K and V read once and the
// fraction of the device copy of this run, paged / contiguous, and the best paged time of a sweep
// of split counts (1 to 128) beside the heuristic's. The plan is made once per shape
// (host, untimed) and the call runs on a caller-given workspace, as a CUDA graph would replay it.
// Then the page sizes 1, 8, 16, 32, 64 and 128 at B8 8k and B64 2k, each against page 16. Then the
// cascade: 32 requests sharing a 4096-token prefix with 256 own tokens each, one decode step
// without sharing (each request's table names the shared blocks: every request reads 4352 keys)
// and with it (paged_cascade_decode: the prefix once as one request of 32 queries, the own keys
// apart, one combine over both passes' partials), and the speed-up. KILN_BENCH_PAGED_PART=cascade
// runs the cascade alone, adds the step with every request holding its own copy of the prefix, and
// sweeps both passes' split counts. bench/paged_attention.py times torch's SDPA decode on the
// same shapes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "bench/gpu_harness.h"
#include "families/attention/ops.h"
#include "families/paged_attention/ops.h"
#include "families/paged_attention/paged_attention.h"
#include "jit/device_info.h"

namespace kiln::bench {
namespace {

constexpr std::int64_t k_heads = 32, k_kv = 8, k_dim = 128;
constexpr DType k_t = DType::bf16;

TensorView dev(const DeviceBuffer& b, DType t, std::initializer_list<std::int64_t> s) {
  return TensorView::contiguous(b.get(), t, s, Device::cuda(0));
}
TensorView host(std::vector<unsigned char>& b, DType t, std::initializer_list<std::int64_t> s) {
  return TensorView::contiguous(b.data(), t, s, Device::cpu());
}

std::int64_t sm_count() {
  auto info = jit::device_info(0);
  return info.ok() ? (*info)->sm_count : 0;
}

// A batch's tables over a shuffled pool: request b's blocks are ids[b * per .. (b + 1) * per).
struct Tables {
  std::vector<std::int32_t> tables, lens;
  std::int64_t max_blocks = 0, num_blocks = 0;
};
Tables scattered(std::int64_t batch, std::int64_t len, std::int64_t page, std::mt19937& rng) {
  Tables t;
  t.max_blocks = (len + page - 1) / page;
  t.num_blocks = batch * t.max_blocks;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(t.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  t.tables = ids;
  t.lens.assign(std::size_t(batch), std::int32_t(len));
  return t;
}

// The paged decode of a planned batch on device tables: µs per call (median).
struct PagedRun {
  DeviceBuffer q, out, tables, lens;
  std::unique_ptr<DeviceBuffer> ws;
  std::int64_t ws_elements = 0;
  PagedDecodeOptions opt;
  std::int64_t batch, max_blocks;
  PagedRun(std::int64_t batch_, const Tables& t, std::int64_t num_blocks, std::int64_t page, const void* qdata)
      : q(batch_ * k_heads * k_dim * 2), out(batch_ * k_heads * k_dim * 2), tables(t.tables.size() * 4),
        lens(t.lens.size() * 4), batch(batch_), max_blocks(t.max_blocks) {
    const PagedDecodeShape shape{.heads = k_heads, .kv_heads = k_kv, .head_dim = k_dim, .page_size = page,
                                 .num_blocks = num_blocks, .max_blocks = t.max_blocks};
    auto plan = plan_paged_decode(shape, t.lens, {}, t.tables, sm_count());
    check(plan.status(), "plan_paged_decode");
    opt = plan->options();
    ws_elements = plan->workspace_elements;
    ws = std::make_unique<DeviceBuffer>(std::size_t(ws_elements) * 4);
    q.upload(qdata);
    tables.upload(t.tables.data());
    lens.upload(t.lens.data());
  }
  TensorView workspace() const { return dev(*ws, DType::f32, {ws_elements}); }
  void call(Context& ctx, const DeviceBuffer& kc, const DeviceBuffer& vc, std::int64_t num_blocks, std::int64_t page) {
    const TensorView wv = workspace();
    check(paged_decode(dev(q, k_t, {batch, k_heads, k_dim}), dev(kc, k_t, {num_blocks, page, k_kv, k_dim}),
                       dev(vc, k_t, {num_blocks, page, k_kv, k_dim}), dev(tables, DType::i32, {batch, max_blocks}),
                       dev(lens, DType::i32, {batch}), nullptr, dev(out, k_t, {batch, k_heads, k_dim}), nullptr, &wv, opt,
                       nullptr, ctx.runtime),
          "paged_decode");
  }
};

int check_reference(Context& ctx) {
  const std::int64_t batch = 2, page = 16;
  const std::vector<std::int32_t> lens = {4097, 1000};
  Tables t = scattered(batch, 4097, page, ctx.rng);
  t.lens = lens;
  const std::int64_t cache = t.num_blocks * page * k_kv * k_dim;
  auto hq = random_values(k_t, batch * k_heads * k_dim, ctx.rng), hk = random_values(k_t, cache, ctx.rng),
       hv = random_values(k_t, cache, ctx.rng);
  DeviceBuffer kc(cache * 2), vc(cache * 2);
  kc.upload(hk.data());
  vc.upload(hv.data());
  PagedRun run(batch, t, t.num_blocks, page, hq.data());
  run.out.poison();
  run.call(ctx, kc, vc, t.num_blocks, page);
  check(ctx.driver->ctx_synchronize(), "sync");
  std::vector<unsigned char> got(batch * k_heads * k_dim * 2), want(got.size());
  run.out.download(got.data());
  auto tables = t.tables;
  auto hl = t.lens;
  check(paged_decode(host(hq, k_t, {batch, k_heads, k_dim}), host(hk, k_t, {t.num_blocks, page, k_kv, k_dim}),
                     host(hv, k_t, {t.num_blocks, page, k_kv, k_dim}),
                     TensorView::contiguous(tables.data(), DType::i32, {batch, t.max_blocks}, Device::cpu()),
                     TensorView::contiguous(hl.data(), DType::i32, {batch}, Device::cpu()), nullptr,
                     host(want, k_t, {batch, k_heads, k_dim}), nullptr, nullptr),
        "paged_decode (cpu)");
  const double err = rel_l2(got.data(), want.data(), k_t, batch * k_heads * k_dim);
  if (!(err < 1e-2)) {
    std::printf("paged decode: FAILED against the CPU reference (rel err %.3g)\n", err);
    return 1;
  }
  std::printf("\npaged decode check (B2 H32/8 lk 4097 and 1000 D128 bf16 page 16): rel err %.2e\n", err);
  return 0;
}

// A pool of `tokens` rows of K and V filled from a repeated random pattern: the pattern is uploaded
// once, then doubled by device-to-device copies (no host buffer of the pool's size).
struct Pool {
  DeviceBuffer k, v;
  Pool(Context& ctx, std::int64_t tokens) : k(tokens * k_kv * k_dim * 2), v(tokens * k_kv * k_dim * 2) {
    const std::size_t bytes = std::size_t(tokens * k_kv * k_dim * 2);
    const std::size_t first = std::min<std::size_t>(bytes, std::size_t(8) << 20);
    const auto base = random_values(k_t, std::int64_t(first / 2), ctx.rng);
    for (const DeviceBuffer* b : {&k, &v}) {
      check(ctx.driver->memcpy_htod(b->ptr, base.data(), first), "cuMemcpyHtoD");
      for (std::size_t filled = first; filled < bytes; filled *= 2)
        check(ctx.driver->memcpy_dtod(b->ptr + filled, b->ptr, std::min(filled, bytes - filled)), "cuMemcpyDtoD");
    }
  }
};

int decode_grid(Context& ctx, nlohmann::json& rows) {
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  for (std::int64_t b : {1, 8, 64, 256})
    for (std::int64_t l : {512, 2048, 8192, 32768})
      if (b * l <= (std::int64_t(1) << 21)) shapes.push_back({b, l});
  if (ctx.quick) shapes = {{1, 32768}, {8, 8192}, {64, 2048}, {256, 512}};
  const std::int64_t page = 16;
  std::printf("\npaged decode (bf16, H32/KV8, lq 1, D128, page 16) against kiln's contiguous decode\n%4s %6s %7s %10s "
              "%8s %6s %12s %8s %6s %7s %11s %8s\n",
              "B", "lk", "splits", "paged_us", "GB/s", "%copy", "contig_us", "GB/s", "%copy", "ratio", "best_splits",
              "best_us");
  for (const auto& [b, lk] : shapes) {
    Pool pool(ctx, b * lk);
    auto hq = random_values(k_t, b * k_heads * k_dim, ctx.rng);
    Tables t = scattered(b, lk, page, ctx.rng);
    PagedRun run(b, t, t.num_blocks, page, hq.data());
    auto paged = [&](int) { run.call(ctx, pool.k, pool.v, t.num_blocks, page); };
    paged(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    const double us = time_events(paged, 5, ctx.quick ? 10 : 30) * 1e3;
    // The heuristic's split count against the best of a sweep of counts, on a workspace for the most.
    const std::int64_t heuristic_splits = run.opt.splits;
    const std::vector<std::int64_t> counts = ctx.quick ? std::vector<std::int64_t>{} : split_counts_to_sweep((lk + 63) / 64);
    double best_us = us;
    std::int64_t best_splits = heuristic_splits;
    if (!counts.empty()) {
      const std::int64_t elements = families::paged_decode_workspace_elements(counts.back(), b, k_heads, k_dim);
      DeviceBuffer sweep_ws(std::size_t(elements) * 4);
      const TensorView wv = dev(sweep_ws, DType::f32, {elements});
      keep_fastest(
          counts,
          [&](std::int64_t n) {
            PagedDecodeOptions o = run.opt;
            o.splits = n;
            check(paged_decode(dev(run.q, k_t, {b, k_heads, k_dim}), dev(pool.k, k_t, {t.num_blocks, page, k_kv, k_dim}),
                               dev(pool.v, k_t, {t.num_blocks, page, k_kv, k_dim}),
                               dev(run.tables, DType::i32, {b, run.max_blocks}), dev(run.lens, DType::i32, {b}),
                               nullptr, dev(run.out, k_t, {b, k_heads, k_dim}), nullptr, &wv, o, nullptr, ctx.runtime),
                  "paged_decode");
          },
          best_splits, best_us);
    }
    DeviceBuffer out(b * k_heads * k_dim * 2);
    auto contiguous = [&](int) {
      check(attention(dev(run.q, k_t, {b, 1, k_heads, k_dim}), dev(pool.k, k_t, {b, lk, k_kv, k_dim}),
                      dev(pool.v, k_t, {b, lk, k_kv, k_dim}), dev(out, k_t, {b, 1, k_heads, k_dim}), nullptr, {}, nullptr,
                      ctx.runtime),
            "attention decode");
    };
    contiguous(0);
    check(ctx.driver->ctx_synchronize(), "sync");
    const double cus = time_events(contiguous, 5, ctx.quick ? 10 : 30) * 1e3;
    const double bytes = double(b) * double(lk) * k_kv * k_dim * 2 * 2;
    const double gbs = bytes / (us * 1e-6) / 1e9, cgbs = bytes / (cus * 1e-6) / 1e9;
    std::printf("%4lld %6lld %7lld %10.1f %8.0f %5.0f%% %12.1f %8.0f %5.0f%% %7.2f %11lld %8.1f\n", (long long)b,
                (long long)lk, (long long)heuristic_splits, us, gbs, 100 * gbs / ctx.copy_gbs, cus, cgbs,
                100 * cgbs / ctx.copy_gbs, cus / us, (long long)best_splits, best_us);
    rows.push_back({{"kind", "decode"}, {"batch", b}, {"seqlen_k", lk}, {"page_size", page}, {"splits", heuristic_splits},
                    {"median_us", us}, {"gbs", gbs}, {"fraction_of_copy", gbs / ctx.copy_gbs},
                    {"contiguous_us", cus}, {"contiguous_gbs", cgbs}, {"speed_vs_contiguous", cus / us},
                    {"best_swept_splits", best_splits}, {"best_swept_us", best_us}});
  }
  return 0;
}

int page_sweep(Context& ctx, nlohmann::json& rows) {
  std::printf("\npaged decode by page size (bf16, H32/KV8, lq 1, D128)\n%4s %6s %5s %10s %8s %6s %9s\n", "B", "lk",
              "page", "median_us", "GB/s", "%copy", "vs_p16");
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{8, 8192}, {64, 2048}};
  for (const auto& [b, lk] : shapes) {
    Pool pool(ctx, b * lk);
    auto hq = random_values(k_t, b * k_heads * k_dim, ctx.rng);
    double us16 = 0;
    for (std::int64_t page : {16, 1, 8, 32, 64, 128}) {
      Tables t = scattered(b, lk, page, ctx.rng);
      PagedRun run(b, t, t.num_blocks, page, hq.data());
      auto paged = [&](int) { run.call(ctx, pool.k, pool.v, t.num_blocks, page); };
      paged(0);
      check(ctx.driver->ctx_synchronize(), "sync");
      const double us = time_events(paged, 5, ctx.quick ? 10 : 30) * 1e3;
      if (page == 16) us16 = us;
      const double gbs = double(b) * double(lk) * k_kv * k_dim * 4 / (us * 1e-6) / 1e9;
      std::printf("%4lld %6lld %5lld %10.1f %8.0f %5.0f%% %9.3f\n", (long long)b, (long long)lk, (long long)page, us, gbs,
                  100 * gbs / ctx.copy_gbs, us16 / us);
      rows.push_back({{"kind", "page_sweep"}, {"batch", b}, {"seqlen_k", lk}, {"page_size", page}, {"median_us", us},
                      {"gbs", gbs}, {"speed_vs_page16", us16 / us}});
    }
  }
  return 0;
}

int cascade(Context& ctx, nlohmann::json& rows) {
  const std::int64_t batch = 32, prefix = 4096, own = 256, page = 16;
  const std::int64_t pb = prefix / page, ob = own / page, blocks = pb + batch * ob;
  Pool pool(ctx, blocks * page);
  auto hq = random_values(k_t, batch * k_heads * k_dim, ctx.rng);
  // Without sharing: each table names the prefix's blocks then its own.
  Tables full;
  full.max_blocks = pb + ob;
  full.num_blocks = blocks;
  Tables mine;
  mine.max_blocks = ob;
  mine.num_blocks = blocks;
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t j = 0; j < pb; ++j) full.tables.push_back(std::int32_t(j));
    for (std::int64_t j = 0; j < ob; ++j) {
      full.tables.push_back(std::int32_t(pb + b * ob + j));
      mine.tables.push_back(std::int32_t(pb + b * ob + j));
    }
    full.lens.push_back(std::int32_t(prefix + own));
    mine.lens.push_back(std::int32_t(own));
  }
  std::vector<std::int32_t> shared_ids(static_cast<std::size_t>(pb));
  std::iota(shared_ids.begin(), shared_ids.end(), 0);
  PagedRun whole(batch, full, blocks, page, hq.data()), own_run(batch, mine, blocks, page, hq.data());
  const PagedDecodeShape shape{.heads = k_heads, .kv_heads = k_kv, .head_dim = k_dim, .page_size = page,
                               .num_blocks = blocks, .max_blocks = ob};
  auto plan = plan_paged_cascade_decode(shape, shared_ids, prefix, mine.lens, mine.tables, sm_count());
  check(plan.status(), "plan_paged_cascade_decode");
  const PagedCascadeOptions co = plan->options();
  const std::int32_t prefix_len = std::int32_t(prefix);
  DeviceBuffer st(shared_ids.size() * 4), sl(4), ws(std::size_t(plan->workspace_elements) * 4),
      cascade_out(batch * k_heads * k_dim * 2);
  st.upload(shared_ids.data());
  sl.upload(&prefix_len);
  auto unshared = [&](int) { whole.call(ctx, pool.k, pool.v, blocks, page); };
  auto cascaded = [&](int) {
    const TensorView wv = dev(ws, DType::f32, {plan->workspace_elements});
    check(paged_cascade_decode(dev(own_run.q, k_t, {batch, k_heads, k_dim}), dev(pool.k, k_t, {blocks, page, k_kv, k_dim}),
                               dev(pool.v, k_t, {blocks, page, k_kv, k_dim}), dev(st, DType::i32, {pb}),
                               dev(sl, DType::i32, {1}), dev(own_run.tables, DType::i32, {batch, ob}),
                               dev(own_run.lens, DType::i32, {batch}), dev(cascade_out, k_t, {batch, k_heads, k_dim}), nullptr,
                               &wv, co, nullptr, ctx.runtime),
          "paged_cascade_decode");
  };
  unshared(0);
  cascaded(0);
  check(ctx.driver->ctx_synchronize(), "sync");
  std::vector<unsigned char> a(batch * k_heads * k_dim * 2), c(a.size());
  whole.out.download(a.data());
  cascade_out.download(c.data());
  const double err = rel_l2(c.data(), a.data(), k_t, batch * k_heads * k_dim);
  if (!(err < 1e-2)) {
    std::printf("paged cascade: FAILED against the unshared decode (rel err %.3g)\n", err);
    return 1;
  }
  const double us = time_events(unshared, 5, ctx.quick ? 10 : 30) * 1e3;
  const double cus = time_events(cascaded, 5, ctx.quick ? 10 : 30) * 1e3;
  std::printf("\npaged cascade (bf16, H32/KV8, D128, page 16): 32 requests, shared prefix 4096 + own 256 (rel err "
              "%.1e)\n  without sharing %8.1f us   cascade %8.1f us   speed-up %.2fx   (prefix splits %lld, own "
              "splits %lld)\n",
              err, us, cus, us / cus, (long long)co.shared_splits, (long long)co.splits);
  rows.push_back({{"kind", "cascade"}, {"batch", batch}, {"prefix", prefix}, {"own", own}, {"page_size", page},
                  {"unshared_us", us}, {"cascade_us", cus}, {"speedup", us / cus}, {"shared_splits", co.shared_splits},
                  {"splits", co.splits}});
  if (const char* part = std::getenv("KILN_BENCH_PAGED_PART"); part && std::string(part) == "cascade") {
    // Probe: each request with its own copy of the prefix, then the split counts of both passes.
    const std::int64_t cblocks = batch * (pb + ob);
    Pool copies(ctx, cblocks * page);
    Tables sep;
    sep.max_blocks = pb + ob;
    sep.num_blocks = cblocks;
    for (std::int64_t j = 0; j < cblocks; ++j) sep.tables.push_back(std::int32_t(j));
    sep.lens.assign(std::size_t(batch), std::int32_t(prefix + own));
    PagedRun sep_run(batch, sep, cblocks, page, hq.data());
    const double cp = time_events([&](int) { sep_run.call(ctx, copies.k, copies.v, cblocks, page); }, 5, 30) * 1e3;
    const double ow = time_events([&](int) { own_run.call(ctx, pool.k, pool.v, blocks, page); }, 5, 30) * 1e3;
    std::printf("  own copies (no shared blocks) %8.1f us (%.2fx the cascade); own pass alone %8.1f us\n", cp, cp / cus, ow);
    for (std::int64_t ps : {1, 2, 4, 8, 12, 16, 24, 32, 48, 64}) {
      std::printf("  prefix splits %3lld:", (long long)ps);
      for (std::int64_t os : {1, 2, 4}) {
        PagedCascadeOptions o2 = co;
        o2.shared_splits = ps;
        o2.splits = os;
        const std::int64_t need = (ps + os) * batch * k_heads * (k_dim + 1);
        DeviceBuffer w2(std::size_t(need) * 4);
        const TensorView wv = dev(w2, DType::f32, {need});
        auto fn = [&](int) {
          check(paged_cascade_decode(dev(own_run.q, k_t, {batch, k_heads, k_dim}),
                                     dev(pool.k, k_t, {blocks, page, k_kv, k_dim}), dev(pool.v, k_t, {blocks, page, k_kv, k_dim}),
                                     dev(st, DType::i32, {pb}), dev(sl, DType::i32, {1}), dev(own_run.tables, DType::i32, {batch, ob}),
                                     dev(own_run.lens, DType::i32, {batch}), dev(cascade_out, k_t, {batch, k_heads, k_dim}),
                                     nullptr, &wv, o2, nullptr, ctx.runtime),
                "paged_cascade_decode");
        };
        std::printf("  own %lld %7.1f us", (long long)os, time_events(fn, 3, 20) * 1e3);
      }
      std::printf("\n");
    }
  }
  return 0;
}

int run(Context& ctx) {
  nlohmann::json rows = nlohmann::json::array();
  if (const char* part = std::getenv("KILN_BENCH_PAGED_PART"); part && std::string(part) == "cascade") {
    const int rc = cascade(ctx, rows);
    (*ctx.out)["paged_attention"] = rows;
    return rc;
  }
  int rc = check_reference(ctx);
  if (rc == 0) rc |= decode_grid(ctx, rows);
  if (rc == 0) rc |= page_sweep(ctx, rows);
  if (rc == 0) rc |= cascade(ctx, rows);
  (*ctx.out)["paged_attention"] = rows;
  return rc;
}

Register reg("paged_attention", run);

}  // namespace
}  // namespace kiln::bench
