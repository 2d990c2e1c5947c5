// Host costs of the paged KV cache's bookkeeping (serving/): manager operations per block, a
// decode step's planning for a batch of requests (slots, tables, and the paged decode kernels'
// plan, plan_paged_decode), radix matches and arena allocations. A plain
// program (no GPU): `kiln_bench_serving [--quick]`. Each figure is the median of repeated runs.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "families/paged_attention/ops.h"
#include "kiln/arena.h"
#include "kiln/kv_cache.h"
#include "kiln/radix_cache.h"

namespace {

using namespace kiln;
using Clock = std::chrono::steady_clock;

int g_repeats = 15;

// Median over repeats of fn()'s wall time in ns; setup() runs untimed before each.
double median_ns(const std::function<void()>& setup, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int r = 0; r < g_repeats; ++r) {
    setup();
    auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<std::int32_t> random_tokens(std::mt19937& rng, std::size_t n) {
  std::vector<std::int32_t> t(n);
  for (auto& v : t) v = std::int32_t(rng() % 128000);
  return t;
}

KVCacheManager manager(std::int32_t blocks, std::int32_t page, bool caching) {
  KVCacheConfig c;
  c.num_blocks = blocks;
  c.page_size = page;
  c.num_layers = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.enable_prefix_caching = caching;
  return std::move(KVCacheManager::create(c)).value();
}

void row(const char* what, double value, const char* unit) { std::printf("  %-64s %10.1f %s\n", what, value, unit); }

void bench_manager(std::int32_t page, bool caching) {
  std::printf("manager, page %d, prefix caching %s\n", page, caching ? "on" : "off");
  std::mt19937 rng(1);
  const std::int32_t requests = 64, tokens = 2048;
  const std::int32_t blocks_each = tokens / page;
  const std::int32_t pool = requests * blocks_each + 256;
  std::vector<std::vector<std::int32_t>> prompts;
  for (int i = 0; i < requests; ++i) prompts.push_back(random_tokens(rng, std::size_t(tokens)));
  const double blocks = double(requests) * blocks_each;
  std::optional<KVCacheManager> m;
  SlotPlan plan;
  plan.slot_mapping.reserve(std::size_t(requests) * std::size_t(tokens));
  auto fresh = [&] {
    m.emplace(manager(pool, page, caching));
    plan.clear();
  };
  auto allocate_all = [&] {
    for (int i = 0; i < requests; ++i) (void)m->allocate(i, prompts[std::size_t(i)], plan);
  };
  auto free_all = [&] {
    for (int i = 0; i < requests; ++i) (void)m->free(i);
  };
  row("allocate (prompt 2048 tokens, misses; slots included) per block", median_ns(fresh, allocate_all) / blocks, "ns");
  row("free per block", median_ns([&] { fresh(); allocate_all(); }, free_all) / blocks, "ns");
  if (caching) {
    // The same prompts again: every full block but the last is a prefix hit.
    row("allocate, prefix hits (cached, unreferenced) per block",
        median_ns([&] { fresh(); allocate_all(); free_all(); plan.clear(); }, allocate_all) / blocks, "ns");
  }
  // fork + free of a forked request (copy-on-write bookkeeping only).
  row("fork per block",
      median_ns([&] { fresh(); allocate_all(); },
                [&] {
                  for (int i = 0; i < requests; ++i) (void)m->fork(i, 1000 + i);
                }) / blocks,
      "ns");
  // Decode: every request grows one token per step, 2 * page steps (2 new blocks each, a copy for
  // forked ones).
  const int steps = 2 * page;
  std::vector<std::int32_t> tok{7};
  row("append_slots, 1 token (decode), per token",
      median_ns([&] { fresh(); allocate_all(); },
                [&] {
                  for (int s = 0; s < steps; ++s)
                    for (int i = 0; i < requests; ++i) (void)m->append_slots(i, tok, plan);
                }) / (double(steps) * requests),
      "ns");
}

void bench_decode_plan(std::int32_t page, bool caching, std::int32_t batch, std::int32_t context) {
  std::mt19937 rng(2);
  const std::int32_t blocks_each = context / page + 2;
  auto m = manager(batch * blocks_each + 64, page, caching);
  SlotPlan plan;
  PagedBatch pb;
  std::vector<RequestId> ids(static_cast<std::size_t>(batch));
  std::iota(ids.begin(), ids.end(), 0);
  for (int i = 0; i < batch; ++i) {
    // Staggered lengths so block boundaries fall on different steps.
    auto prompt = random_tokens(rng, std::size_t(context - (i % page)));
    (void)m.allocate(i, prompt, plan);
  }
  std::vector<std::int32_t> tok{11};
  // One step: a slot for each request's new token, then the batch's CSR block tables.
  std::vector<double> plan_only, with_tables;
  for (int step = 0; step < std::max(64, 4 * page); ++step) {
    plan.clear();
    auto t0 = Clock::now();
    for (RequestId id : ids) (void)m.append_slots(id, tok, plan);
    auto t1 = Clock::now();
    (void)m.build_batch(ids, pb);
    auto t2 = Clock::now();
    plan_only.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    with_tables.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto worst = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
  char what[128];
  std::snprintf(what, sizeof(what), "decode step, %d requests x %d tokens, page %d, caching %s: slots", batch, context, page,
                caching ? "on" : "off");
  std::printf("  %-64s %10.2f us (max %.2f)\n", what, median(plan_only), worst(plan_only));
  std::snprintf(what, sizeof(what), "  ... + CSR block tables (%zu indices)", pb.indices.size());
  std::printf("  %-64s %10.2f us (max %.2f)\n", what, median(with_tables), worst(with_tables));
  // The kernels' plan over the batch's padded tables (kept by the caller step to step): every
  // request's table checked against the pool, then the split count.
  std::int32_t max_blocks = 0;
  for (std::size_t i = 0; i + 1 < pb.indptr.size(); ++i) max_blocks = std::max(max_blocks, pb.indptr[i + 1] - pb.indptr[i]);
  std::vector<std::int32_t> padded(std::size_t(batch) * std::size_t(max_blocks), 0);
  for (std::size_t i = 0; i + 1 < pb.indptr.size(); ++i)
    std::copy(pb.indices.begin() + pb.indptr[i], pb.indices.begin() + pb.indptr[i + 1], padded.begin() + i * max_blocks);
  const PagedDecodeShape shape{.heads = 32, .kv_heads = 8, .head_dim = 128, .page_size = page,
                               .num_blocks = m.num_blocks(), .max_blocks = max_blocks};
  const double checked = median_ns([] {}, [&] { (void)plan_paged_decode(shape, pb.context_lens, {}, padded, 132); });
  const double unchecked = median_ns([] {}, [&] { (void)plan_paged_decode(shape, pb.context_lens, {}, {}, 132); });
  std::snprintf(what, sizeof(what), "  plan_paged_decode, tables checked (%zu entries)", padded.size());
  std::printf("  %-64s %10.2f us\n", what, checked / 1e3);
  std::printf("  %-64s %10.2f us\n", "  plan_paged_decode, lengths only", unchecked / 1e3);
}

void bench_radix(std::int32_t page) {
  std::printf("radix cache, page %d\n", page);
  std::mt19937 rng(3);
  auto m = manager(200000 / page + 1024, page, false);
  RadixCache tree(m);
  // 64 system prompts of 1024 tokens, each followed by 16 conversations of 1024 tokens.
  std::vector<std::vector<std::int32_t>> convs;
  SlotPlan plan;
  RequestId id = 0;
  for (int s = 0; s < 8; ++s) {
    auto sys = random_tokens(rng, 1024);
    for (int c = 0; c < 16; ++c) {
      auto t = sys;
      auto tail = random_tokens(rng, 1024);
      t.insert(t.end(), tail.begin(), tail.end());
      (void)m.allocate(id, t, plan);
      plan.clear();
      auto table = *m.block_table(id);
      (void)tree.insert(t, std::vector<std::int32_t>(table.begin(), table.end()));
      (void)m.free(id++);
      convs.push_back(std::move(t));
    }
  }
  const double blocks = 2048.0 / page;
  std::size_t k = 0;
  row("match_prefix of a cached 2048-token prompt, per block",
      median_ns([] {},
                [&] {
                  for (int i = 0; i < 100; ++i) (void)tree.match_prefix(convs[(k++ * 7) % convs.size()]);
                }) / (100 * blocks),
      "ns");
  std::printf("  (tree: %lld nodes, %lld blocks)\n", (long long)tree.stats().nodes, (long long)tree.stats().cached_blocks);
}

void bench_arena() {
  std::printf("arena\n");
  auto a = std::move(ArenaAllocator::create(std::uint64_t(80) << 30, 256, 1 << 16)).value();
  std::mt19937_64 rng(4);
  std::vector<std::uint64_t> sizes(4096);
  for (auto& s : sizes) s = 256 + rng() % (64ull << 20);
  std::vector<std::uint64_t> live;
  live.reserve(sizes.size());
  row("allocate + free, 4096 ranges of up to 64 MiB, per pair",
      median_ns([&] { live.clear(); },
                [&] {
                  for (auto s : sizes) live.push_back(*a.allocate(s));
                  for (std::size_t i = 0; i < live.size(); i += 2) (void)a.free(live[i]);
                  for (std::size_t i = 1; i < live.size(); i += 2) (void)a.free(live[i]);
                }) / double(sizes.size()),
      "ns");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--quick") == 0) g_repeats = 3;
  for (bool caching : {false, true}) bench_manager(16, caching);
  bench_manager(128, true);
  std::printf("decode planning\n");
  for (std::int32_t page : {16, 1})
    for (bool caching : {false, true}) bench_decode_plan(page, caching, 256, 2048);
  bench_decode_plan(16, true, 256, 8192);
  bench_radix(16);
  bench_radix(1);
  bench_arena();
  return 0;
}
