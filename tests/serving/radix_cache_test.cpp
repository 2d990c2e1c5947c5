#include <gtest/gtest.h>

#include <numeric>

#include "kiln/radix_cache.h"

namespace kiln {
namespace {

KVCacheManager make(std::int32_t blocks, std::int32_t page) {
  KVCacheConfig c;
  c.num_blocks = blocks;
  c.page_size = page;
  c.enable_prefix_caching = false;
  return std::move(KVCacheManager::create(c)).value();
}

std::vector<std::int32_t> seq(std::initializer_list<std::int32_t> v) { return v; }

std::vector<std::int32_t> iota_tokens(std::int32_t n, std::int32_t start = 0) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

void expect_ok(const KVCacheManager& m, const RadixCache& t) {
  Status s = m.check_invariants();
  EXPECT_TRUE(s.ok()) << s.to_string();
  s = t.check_invariants();
  EXPECT_TRUE(s.ok()) << s.to_string();
  // Every external reference in the manager is the tree's.
  std::vector<std::int32_t> held(std::size_t(m.num_blocks()), 0);
  t.for_each_block([&](std::int32_t b) { ++held[std::size_t(b)]; });
  for (std::int32_t b = 0; b < m.num_blocks(); ++b) EXPECT_EQ(held[std::size_t(b)], m.external_refs(b)) << b;
}

// Blocks of a request holding `tokens`, allocated in the manager.
std::vector<std::int32_t> blocks_for(KVCacheManager& m, RequestId id, const std::vector<std::int32_t>& tokens) {
  SlotPlan plan;
  EXPECT_TRUE(m.allocate(id, tokens, plan).ok());
  auto t = *m.block_table(id);
  return {t.begin(), t.end()};
}

TEST(RadixCache, TokenLevelInsertMatchSplit) {
  auto m = make(32, 1);
  RadixCache tree(m);
  auto a = seq({1, 2, 3, 4, 5});
  auto ba = blocks_for(m, 1, a);
  auto r = tree.insert(a, ba);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->cached_tokens, 0);
  EXPECT_EQ(tree.stats().cached_tokens, 5);
  // A longer query matches all of a; a diverging one splits the node.
  auto m1 = tree.match_prefix(seq({1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(m1.num_tokens, 5);
  EXPECT_EQ(m1.blocks, ba);
  auto m2 = tree.match_prefix(seq({1, 2, 3, 9}));
  EXPECT_EQ(m2.num_tokens, 3);
  EXPECT_EQ(m2.blocks, std::vector<std::int32_t>(ba.begin(), ba.begin() + 3));
  EXPECT_EQ(tree.stats().nodes, 2);
  expect_ok(m, tree);
  // Insert a sibling branch: 1 2 3 7 8; the shared 3 tokens keep the tree's blocks.
  auto b = seq({1, 2, 3, 7, 8});
  auto bb = blocks_for(m, 2, b);
  r = tree.insert(b, bb);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->cached_tokens, 3);
  EXPECT_EQ(tree.stats().cached_tokens, 7);
  EXPECT_EQ(tree.stats().nodes, 3);
  auto m3 = tree.match_prefix(b);
  EXPECT_EQ(m3.blocks, (std::vector<std::int32_t>{ba[0], ba[1], ba[2], bb[3], bb[4]}));
  expect_ok(m, tree);
  // No match at all.
  EXPECT_EQ(tree.match_prefix(seq({9, 9})).num_tokens, 0);
  EXPECT_EQ(tree.match_prefix(seq({9, 9})).node, 0);
  ASSERT_TRUE(m.free(1).ok());
  ASSERT_TRUE(m.free(2).ok());
  expect_ok(m, tree);
  // The tree holds a's 5 blocks and b's last 2: 7 used.
  EXPECT_EQ(m.stats().used_blocks, 7);
  tree.clear();
  EXPECT_EQ(m.stats().used_blocks, 0);
  expect_ok(m, tree);
}

TEST(RadixCache, PagesMatchAndSplitOnPageBoundaries) {
  auto m = make(32, 8);
  RadixCache tree(m);
  auto a = iota_tokens(28);  // 3 full pages + 4
  auto ba = blocks_for(m, 1, a);
  auto r = tree.insert(std::span(a).first(24), std::span(ba).first(3));
  ASSERT_TRUE(r.ok());
  // Diverging inside the second page: only the first page matches.
  auto q = iota_tokens(28);
  q[12] = 99;
  auto mt = tree.match_prefix(q);
  EXPECT_EQ(mt.num_tokens, 8);
  EXPECT_EQ(mt.blocks, std::vector<std::int32_t>{ba[0]});
  // A query shorter than a page matches nothing; one that diverges in the first page neither.
  EXPECT_EQ(tree.match_prefix(iota_tokens(7)).num_tokens, 0);
  EXPECT_EQ(tree.match_prefix(seq({0, 1, 2, 3, 4, 5, 6, 9, 8})).num_tokens, 0);
  // Two children whose first pages share their first tokens are told apart.
  auto c = seq({0, 1, 2, 3, 4, 5, 6, 50, 51, 52, 53, 54, 55, 56, 57, 58});
  auto bc = blocks_for(m, 2, c);
  ASSERT_TRUE(tree.insert(c, bc).ok());
  EXPECT_EQ(tree.match_prefix(c).blocks, bc);
  EXPECT_EQ(tree.match_prefix(a).num_tokens, 24);
  // Blocks covering more tokens than given.
  EXPECT_EQ(tree.insert(seq({1, 2, 3}), std::span(bc).first(1)).status().code(), Code::invalid_argument);
  expect_ok(m, tree);
}

TEST(RadixCache, LockProtectsAndEvictionIsLru) {
  auto m = make(12, 1);
  RadixCache tree(m);
  auto a = seq({1, 2}), b = seq({3, 4}), c = seq({1, 5});
  for (auto [id, t] : {std::pair{1, a}, std::pair{2, b}, std::pair{3, c}}) {
    auto bl = blocks_for(m, id, t);
    ASSERT_TRUE(tree.insert(t, bl).ok());
    ASSERT_TRUE(m.free(id).ok());
  }
  // Nodes: [1] -> {[2], [5]}, [3 4]; 5 blocks (c's first token is a's block), held by the tree
  // only.
  EXPECT_EQ(tree.stats().cached_blocks, 5);
  EXPECT_EQ(m.stats().used_blocks, 5);
  // Touch b, then a; lock c's path.
  (void)tree.match_prefix(b);
  (void)tree.match_prefix(a);
  auto mc = tree.match_prefix(c);
  ASSERT_TRUE(tree.lock(mc.node).ok());
  EXPECT_EQ(tree.stats().protected_blocks, 2);
  expect_ok(m, tree);
  // Evicting 1 block takes b's node (the least recent leaf, 2 blocks), the next call a's [2];
  // [1] and [5] stay.
  EXPECT_EQ(tree.evict(1), 2);
  EXPECT_EQ(tree.match_prefix(b).num_tokens, 0);
  EXPECT_EQ(tree.match_prefix(a).num_tokens, 2);
  EXPECT_EQ(tree.evict(1), 1);
  EXPECT_EQ(tree.match_prefix(a).num_tokens, 1);
  EXPECT_EQ(tree.evict(100), 0);  // all that is left is locked
  EXPECT_EQ(tree.match_prefix(c).num_tokens, 2);
  expect_ok(m, tree);
  ASSERT_TRUE(tree.unlock(mc.node).ok());
  EXPECT_EQ(tree.unlock(mc.node).code(), Code::invalid_argument);  // not locked any more
  EXPECT_EQ(tree.evict(100), 2);
  EXPECT_EQ(m.stats().used_blocks, 0);
  // Handles of evicted nodes are gone.
  EXPECT_EQ(tree.lock(mc.node).code(), Code::not_found);
  EXPECT_EQ(tree.unlock(987654).code(), Code::not_found);
  expect_ok(m, tree);
}

TEST(RadixCache, BlocksHeldByRequestsAreNotFreedByEviction) {
  auto m = make(8, 1);
  RadixCache tree(m);
  auto a = seq({1, 2, 3});
  auto ba = blocks_for(m, 1, a);
  ASSERT_TRUE(tree.insert(a, ba).ok());
  EXPECT_EQ(tree.evict(3), 0);  // the request still holds them
  EXPECT_EQ(tree.stats().cached_blocks, 0);
  EXPECT_EQ(m.stats().used_blocks, 3);
  ASSERT_TRUE(m.free(1).ok());
  EXPECT_EQ(m.stats().used_blocks, 0);
  expect_ok(m, tree);
}

TEST(RadixCache, InsertRejectsBadBlocks) {
  auto m = make(8, 1);
  RadixCache tree(m);
  EXPECT_EQ(tree.insert(seq({1}), seq({8})).status().code(), Code::invalid_argument);
  EXPECT_EQ(tree.insert(seq({1}), seq({0})).status().code(), Code::invalid_argument);  // free block
  expect_ok(m, tree);
}

TEST(RadixCache, SplitKeepsLocksOnThePathEnd) {
  auto m = make(16, 1);
  RadixCache tree(m);
  auto a = seq({1, 2, 3, 4});
  auto ba = blocks_for(m, 1, a);
  auto r = tree.insert(a, ba);
  ASSERT_TRUE(tree.lock(r->node).ok());
  (void)tree.match_prefix(seq({1, 2, 9}));  // splits the locked node after 2 tokens
  expect_ok(m, tree);
  EXPECT_EQ(tree.stats().protected_blocks, 4);
  ASSERT_TRUE(tree.unlock(r->node).ok());
  EXPECT_EQ(tree.stats().protected_blocks, 0);
  expect_ok(m, tree);
}

TEST(RadixAttentionWithPagedKVCache, RequestLifeCycle) {
  KVCacheConfig c;
  c.num_blocks = 10;
  c.page_size = 8;
  auto ra = RadixAttentionWithPagedKVCache::create(c);
  ASSERT_TRUE(ra.ok()) << ra.status().to_string();
  auto& s = **ra;
  EXPECT_FALSE(s.manager().config().enable_prefix_caching);
  SlotPlan plan;
  auto p = iota_tokens(20);
  ASSERT_EQ(*s.add_request(1, p, plan), 0);
  ASSERT_TRUE(s.append(1, seq({50, 51}), plan).ok());
  ASSERT_TRUE(s.finish(1).ok());  // caches 16 of its 22 tokens: 2 pages
  EXPECT_EQ(s.tree().stats().cached_tokens, 16);
  // The same prompt again: 2 pages from the tree (the full pages before its last token).
  plan.clear();
  ASSERT_EQ(*s.add_request(2, p, plan), 16);
  EXPECT_EQ(plan.slot_mapping.size(), 4u);
  EXPECT_EQ(s.add_request(2, p, plan).status().code(), Code::invalid_argument);
  ASSERT_TRUE(s.fork(2, 3).ok());
  EXPECT_EQ(s.fork(2, 3).code(), Code::invalid_argument);
  EXPECT_EQ(s.fork(9, 4).code(), Code::not_found);
  plan.clear();
  ASSERT_TRUE(s.append(3, seq({70}), plan).ok());
  EXPECT_EQ(plan.copies.size(), 1u);  // the shared partial page
  ASSERT_TRUE(s.finish(2).ok());
  ASSERT_TRUE(s.finish(3, false).ok());
  EXPECT_EQ(s.finish(3).code(), Code::not_found);
  EXPECT_EQ(s.append(3, seq({1}), plan).code(), Code::not_found);
  expect_ok(s.manager(), s.tree());
  // A request needing more blocks than are free evicts the tree's unlocked pages.
  plan.clear();
  const auto big = iota_tokens(80, 1000);
  EXPECT_EQ(s.can_allocate(big), Admission::now);
  ASSERT_EQ(*s.add_request(4, big, plan), 0);
  EXPECT_EQ(s.manager().num_free_blocks(), 0);
  EXPECT_EQ(s.can_allocate(iota_tokens(5, 7)), Admission::later);
  EXPECT_EQ(s.can_allocate(iota_tokens(81, 7)), Admission::never);
  EXPECT_EQ(s.add_request(5, iota_tokens(5, 7), plan).status().code(), Code::unavailable);
  ASSERT_TRUE(s.finish(4).ok());
  expect_ok(s.manager(), s.tree());
}

}  // namespace
}  // namespace kiln
