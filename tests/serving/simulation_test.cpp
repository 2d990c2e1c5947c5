// Randomized serving simulations on the host: requests arrive (many sharing prefixes), grow, fork,
// finish and are evicted, against a shadow KV pool that replays every plan (copies, then slot
// writes). After every step: the manager's and the tree's invariants (no block leaked or freed
// twice, every reference count equal to the table and tree references), and each touched request's
// blocks hold exactly its tokens, so a prefix hit reads what a contiguous cache would hold.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "kiln/radix_cache.h"

namespace kiln {
namespace {

// What the kernels would have written: the token stored at each slot, -1 when none.
struct ShadowPool {
  std::int32_t page;
  std::vector<std::int64_t> slots;
  ShadowPool(std::int32_t blocks, std::int32_t page_size)
      : page(page_size), slots(std::size_t(blocks) * std::size_t(page_size), -1) {}
  // Replays a plan: copies first, then the new tokens into their slots.
  void apply(const SlotPlan& plan, std::span<const std::int32_t> written) {
    for (const BlockCopy& c : plan.copies)
      std::copy_n(slots.begin() + std::ptrdiff_t(c.src) * page, page, slots.begin() + std::ptrdiff_t(c.dst) * page);
    ASSERT_EQ(plan.slot_mapping.size(), written.size());
    for (std::size_t i = 0; i < written.size(); ++i) slots[std::size_t(plan.slot_mapping[i])] = written[i];
  }
};

// The request's blocks hold its tokens, position by position.
void expect_contents(const KVCacheManager& m, const ShadowPool& pool, RequestId id, const std::vector<std::int32_t>& tokens) {
  auto table = m.block_table(id);
  ASSERT_TRUE(table.ok());
  ASSERT_EQ(*m.num_tokens(id), std::int64_t(tokens.size()));
  ASSERT_TRUE(KVCacheManager::validate_block_table(*table, std::int64_t(tokens.size()), m.num_blocks(), m.page_size()).ok());
  for (std::size_t p = 0; p < tokens.size(); ++p) {
    const std::size_t slot = std::size_t((*table)[p / std::size_t(pool.page)]) * std::size_t(pool.page) + p % std::size_t(pool.page);
    ASSERT_EQ(pool.slots[slot], tokens[p]) << "request " << id << " position " << p;
  }
}

struct Prompts {
  std::vector<std::vector<std::int32_t>> prefixes;
  explicit Prompts(std::mt19937_64& rng, std::int32_t page) {
    for (int i = 0; i < 6; ++i) {
      std::vector<std::int32_t> p(std::size_t(rng() % std::uint64_t(4 * page + 3)));
      for (auto& t : p) t = std::int32_t(rng() % 50);
      prefixes.push_back(std::move(p));
    }
  }
  std::vector<std::int32_t> make(std::mt19937_64& rng, std::int32_t page) {
    std::vector<std::int32_t> t = prefixes[std::size_t(rng() % prefixes.size())];
    const std::size_t extra = 1 + std::size_t(rng() % std::uint64_t(2 * page + 2));
    for (std::size_t i = 0; i < extra; ++i) t.push_back(std::int32_t(rng() % 50));
    return t;
  }
};

class ManagerSimulation : public ::testing::TestWithParam<std::int32_t> {};

TEST_P(ManagerSimulation, PrefixCachingForkAndEviction) {
  const std::int32_t page = GetParam();
  std::mt19937_64 rng(42 + std::uint64_t(page));
  KVCacheConfig c;
  c.page_size = page;
  c.num_blocks = page >= 64 ? 24 : 96;
  c.enable_prefix_caching = true;
  auto mr = KVCacheManager::create(c);
  ASSERT_TRUE(mr.ok());
  KVCacheManager& m = *mr;
  ShadowPool pool(c.num_blocks, page);
  Prompts prompts(rng, page);
  std::map<RequestId, std::vector<std::int32_t>> live;
  std::vector<RequestId> finished;
  RequestId next_id = 0;
  std::int64_t arrived = 0, hits = 0, forks = 0, refused = 0;
  SlotPlan plan;
  auto pick = [&]() {
    auto it = live.begin();
    std::advance(it, std::ptrdiff_t(rng() % live.size()));
    return it->first;
  };
  for (int step = 0; step < 30000; ++step) {
    const int op = int(rng() % 100);
    plan.clear();
    RequestId touched = -1;
    if (live.empty() || op < 30) {
      const auto prompt = prompts.make(rng, page);
      const PrefixKey key{rng() % 4 == 0 ? "lora-1" : "", ""};
      const Admission a = m.can_allocate(prompt, key);
      auto r = m.allocate(next_id, prompt, plan, key);
      if (a == Admission::now) {
        ASSERT_TRUE(r.ok()) << r.status().to_string();
      } else {
        ASSERT_EQ(r.status().code(), Code::unavailable);
      }
      if (r.ok()) {
        ++arrived;
        hits += *r > 0;
        pool.apply(plan, std::span(prompt).subspan(std::size_t(*r)));
        live[next_id] = prompt;
        touched = next_id;
      } else {
        ++refused;
        // Preempt: finish a random running request.
        if (!live.empty()) {
          RequestId v = pick();
          ASSERT_TRUE(m.free(v).ok());
          live.erase(v);
          finished.push_back(v);
        }
      }
      ++next_id;
    } else if (op < 70) {
      const RequestId id = pick();
      std::vector<std::int32_t> toks(1 + rng() % 3);
      for (auto& t : toks) t = std::int32_t(rng() % 50);
      const Admission a = m.can_allocate(id, std::int64_t(toks.size()));
      Status s = m.append_slots(id, toks, plan);
      ASSERT_EQ(s.ok(), a == Admission::now) << s.to_string();
      if (s.ok()) {
        pool.apply(plan, toks);
        live[id].insert(live[id].end(), toks.begin(), toks.end());
        touched = id;
      } else {
        ASSERT_EQ(s.code(), Code::unavailable);
      }
    } else if (op < 80) {
      const RequestId parent = pick();
      ASSERT_TRUE(m.fork(parent, next_id).ok());
      live[next_id] = live[parent];
      touched = next_id++;
      ++forks;
    } else if (op < 97) {
      const RequestId id = pick();
      ASSERT_TRUE(m.free(id).ok());
      live.erase(id);
      finished.push_back(id);
    } else if (!finished.empty()) {
      // Misuse: a finished request is not_found, whatever the call.
      const RequestId id = finished[std::size_t(rng() % finished.size())];
      EXPECT_EQ(m.free(id).code(), Code::not_found);
      EXPECT_EQ(m.append_slots(id, std::vector<std::int32_t>{1}, plan).code(), Code::not_found);
      EXPECT_EQ(m.fork(id, next_id).code(), Code::not_found);
    }
    Status inv = m.check_invariants();
    ASSERT_TRUE(inv.ok()) << "step " << step << ": " << inv.to_string();
    if (touched >= 0) expect_contents(m, pool, touched, live[touched]);
    if (step % 200 == 0)
      for (auto& [id, toks] : live) expect_contents(m, pool, id, toks);
  }
  for (auto& [id, toks] : live) expect_contents(m, pool, id, toks);
  for (auto& [id, toks] : live) ASSERT_TRUE(m.free(id).ok());
  ASSERT_TRUE(m.check_invariants().ok());
  EXPECT_EQ(m.num_free_blocks(), c.num_blocks);
  const auto s = m.stats();
  EXPECT_GT(arrived, 2000);
  EXPECT_GT(hits, 100);
  EXPECT_GT(forks, 500);
  if (page > 1) {
    EXPECT_GT(s.cow_copies, 100);  // a page of 1 has no partly filled block to copy
  }
  EXPECT_GT(s.evictions, 100);
  EXPECT_GT(refused, 10);
}

INSTANTIATE_TEST_SUITE_P(PageSizes, ManagerSimulation, ::testing::Values(1, 8, 16, 64));

class RadixSimulation : public ::testing::TestWithParam<std::int32_t> {};

TEST_P(RadixSimulation, SharedPrefixesLocksAndEviction) {
  const std::int32_t page = GetParam();
  std::mt19937_64 rng(7 + std::uint64_t(page));
  KVCacheConfig c;
  c.page_size = page;
  c.num_blocks = page >= 32 ? 24 : 96;
  auto rr = RadixAttentionWithPagedKVCache::create(c);
  ASSERT_TRUE(rr.ok());
  RadixAttentionWithPagedKVCache& ra = **rr;
  const KVCacheManager& m = ra.manager();
  ShadowPool pool(c.num_blocks, page);
  Prompts prompts(rng, page);
  std::map<RequestId, std::vector<std::int32_t>> live;
  RequestId next_id = 0;
  std::int64_t arrived = 0, hit_tokens = 0, refused = 0;
  SlotPlan plan;
  auto pick = [&]() {
    auto it = live.begin();
    std::advance(it, std::ptrdiff_t(rng() % live.size()));
    return it->first;
  };
  auto check = [&](int step) {
    Status s = m.check_invariants();
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.to_string();
    s = ra.tree().check_invariants();
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.to_string();
    std::vector<std::int32_t> held(std::size_t(m.num_blocks()), 0);
    ra.tree().for_each_block([&](std::int32_t b) { ++held[std::size_t(b)]; });
    for (std::int32_t b = 0; b < m.num_blocks(); ++b)
      ASSERT_EQ(held[std::size_t(b)], m.external_refs(b)) << "step " << step << " block " << b;
  };
  for (int step = 0; step < 30000; ++step) {
    const int op = int(rng() % 100);
    plan.clear();
    RequestId touched = -1;
    if (live.empty() || op < 30) {
      const auto prompt = prompts.make(rng, page);
      const Admission a = ra.can_allocate(prompt);
      auto r = ra.add_request(next_id, prompt, plan);
      if (a == Admission::now) {
        ASSERT_TRUE(r.ok()) << "step " << step << ": " << r.status().to_string();
      }
      if (r.ok()) {
        ++arrived;
        hit_tokens += *r;
        pool.apply(plan, std::span(prompt).subspan(std::size_t(*r)));
        live[next_id] = prompt;
        touched = next_id;
      } else {
        ASSERT_EQ(r.status().code(), Code::unavailable);
        ++refused;
        if (!live.empty()) {
          RequestId v = pick();
          ASSERT_TRUE(ra.finish(v, rng() % 2 == 0).ok());
          live.erase(v);
        }
      }
      ++next_id;
    } else if (op < 70) {
      const RequestId id = pick();
      std::vector<std::int32_t> toks(1 + rng() % 3);
      for (auto& t : toks) t = std::int32_t(rng() % 50);
      Status s = ra.append(id, toks, plan);
      if (s.ok()) {
        pool.apply(plan, toks);
        live[id].insert(live[id].end(), toks.begin(), toks.end());
        touched = id;
      } else {
        ASSERT_EQ(s.code(), Code::unavailable);
      }
    } else if (op < 78) {
      const RequestId parent = pick();
      ASSERT_TRUE(ra.fork(parent, next_id).ok());
      live[next_id] = live[parent];
      touched = next_id++;
    } else if (op < 97) {
      const RequestId id = pick();
      ASSERT_TRUE(ra.finish(id, rng() % 4 != 0).ok());
      live.erase(id);
    } else {
      (void)ra.tree().evict(std::int64_t(rng() % 8));
    }
    check(step);
    if (touched >= 0) expect_contents(m, pool, touched, live[touched]);
    if (step % 200 == 0)
      for (auto& [id, toks] : live) expect_contents(m, pool, id, toks);
  }
  for (auto& [id, toks] : live) {
    expect_contents(m, pool, id, toks);
    ASSERT_TRUE(ra.finish(id).ok());
  }
  check(-1);
  EXPECT_EQ(ra.tree().stats().protected_blocks, 0);
  ra.tree().clear();
  EXPECT_EQ(m.num_free_blocks(), c.num_blocks);
  EXPECT_GT(arrived, 2000);
  EXPECT_GT(hit_tokens, 1000);
  EXPECT_GT(ra.tree().stats().evicted_blocks, 100);
}

INSTANTIATE_TEST_SUITE_P(PageSizes, RadixSimulation, ::testing::Values(1, 16, 32));

}  // namespace
}  // namespace kiln
