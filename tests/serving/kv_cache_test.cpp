#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <random>
#include <numeric>
#include <thread>

#include "common/sha256.h"
#include "kiln/kv_cache.h"

namespace kiln {
namespace {

KVCacheConfig config(std::int32_t blocks, std::int32_t page, bool caching = true) {
  KVCacheConfig c;
  c.num_blocks = blocks;
  c.page_size = page;
  c.dtype = KVDType::bf16;
  c.num_layers = 2;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.enable_prefix_caching = caching;
  return c;
}

KVCacheManager make(std::int32_t blocks, std::int32_t page, bool caching = true) {
  auto m = KVCacheManager::create(config(blocks, page, caching));
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return std::move(m).value();
}

std::vector<std::int32_t> iota_tokens(std::int32_t n, std::int32_t start = 0) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

void expect_ok(const KVCacheManager& m) {
  Status s = m.check_invariants();
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST(KVCacheConfig, SizesAndValidation) {
  KVCacheConfig c = config(10, 16);
  EXPECT_EQ(c.bytes_per_block(), 2ull * 2 * 8 * 128 * 16 * 2);
  c.dtype = KVDType::fp8_e4m3;
  EXPECT_EQ(c.bytes_per_block(), 2ull * 2 * 8 * 128 * 16);
  EXPECT_EQ(kv_blocks_for_bytes(c, 10 * c.bytes_per_block() + 5), 10);
  EXPECT_STREQ(kv_dtype_name(KVDType::fp8_e5m2), "fp8_e5m2");
  for (std::int32_t page : {1, 8, 16, 32, 64, 128}) EXPECT_TRUE(config(4, page).validate().ok()) << page;
  for (std::int32_t page : {0, 2, 4, 12, 256, -16}) {
    auto m = KVCacheManager::create(config(4, page));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), Code::invalid_argument) << page;
  }
  EXPECT_EQ(KVCacheManager::create(config(0, 16)).status().code(), Code::invalid_argument);
  KVCacheConfig bad = config(4, 16);
  bad.head_dim = 0;
  EXPECT_EQ(bad.validate().code(), Code::invalid_argument);
  bad = config(4, 16);
  bad.dtype = KVDType(9);
  EXPECT_EQ(bad.validate().code(), Code::invalid_argument);
}

TEST(KVCacheHash, RealSha256Chain) {
  // The chain is SHA-256 over the documented bytes.
  BlockHash root = prefix_root_hash({});
  Sha256 h;
  h.update("kiln kv prefix v1");
  std::uint8_t zeros[16] = {};
  h.update(zeros, 16);
  EXPECT_EQ(root, h.finish());
  std::vector<std::int32_t> tokens{1, 2, 0x01020304};
  Sha256 h2;
  h2.update(root.data(), 32);
  const std::uint8_t bytes[] = {3, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 4, 3, 2, 1};
  h2.update(bytes, sizeof(bytes));
  EXPECT_EQ(block_hash(root, tokens), h2.finish());
  // Extra keys separate chains; "ab"+"" differs from "a"+"b".
  EXPECT_NE(prefix_root_hash({"ab", ""}), prefix_root_hash({"a", "b"}));
  EXPECT_NE(prefix_root_hash({"lora1", ""}), root);
  // 128 tokens (more than the staging buffer's worth of bytes in one go) hash like the parts.
  auto t = iota_tokens(128);
  BlockHash a = block_hash(root, t);
  Sha256 h3;
  h3.update(root.data(), 32);
  std::uint8_t cnt[4] = {128, 0, 0, 0};
  h3.update(cnt, 4);
  for (std::int32_t v : t) {
    std::uint8_t b[4] = {std::uint8_t(v), std::uint8_t(v >> 8), std::uint8_t(v >> 16), std::uint8_t(v >> 24)};
    h3.update(b, 4);
  }
  EXPECT_EQ(a, h3.finish());
}

TEST(KVCacheManager, AllocateAppendFreeSlots) {
  for (std::int32_t page : {1, 8, 16, 32, 64, 128}) {
    SCOPED_TRACE(page);
    auto m = make(64, page);
    SlotPlan plan;
    auto prompt = iota_tokens(page * 2 + 3);
    auto cached = m.allocate(7, prompt, plan);
    ASSERT_TRUE(cached.ok()) << cached.status().to_string();
    EXPECT_EQ(*cached, 0);
    auto table = m.block_table(7);
    ASSERT_TRUE(table.ok());
    const std::size_t blocks = std::size_t((page * 2 + 3 + page - 1) / page);
    ASSERT_EQ(table->size(), blocks);
    ASSERT_EQ(plan.slot_mapping.size(), prompt.size());
    for (std::size_t i = 0; i < prompt.size(); ++i)
      EXPECT_EQ(plan.slot_mapping[i], std::int64_t((*table)[i / std::size_t(page)]) * page + std::int64_t(i % std::size_t(page)));
    EXPECT_TRUE(plan.copies.empty());
    plan.clear();
    // Decode: one token at a time.
    for (int step = 0; step < page + 1; ++step) {
      ASSERT_TRUE(m.append_slots(7, std::vector<std::int32_t>{1000 + step}, plan).ok());
      expect_ok(m);
    }
    EXPECT_EQ(*m.num_tokens(7), page * 3 + 4);
    EXPECT_EQ(plan.slot_mapping.size(), std::size_t(page + 1));
    table = m.block_table(7);
    const std::int64_t first = page * 2 + 3;
    for (std::size_t i = 0; i < plan.slot_mapping.size(); ++i) {
      const std::int64_t pos = first + std::int64_t(i);
      EXPECT_EQ(plan.slot_mapping[i], std::int64_t((*table)[std::size_t(pos / page)]) * page + pos % page);
    }
    EXPECT_EQ(m.num_free_blocks(), 64 - std::int32_t(table->size()));
    ASSERT_TRUE(m.free(7).ok());
    EXPECT_EQ(m.num_free_blocks(), 64);
    expect_ok(m);
  }
}

TEST(KVCacheManager, TypedErrors) {
  auto m = make(4, 16);
  SlotPlan plan;
  auto prompt = iota_tokens(20);
  ASSERT_TRUE(m.allocate(1, prompt, plan).ok());
  // A request id in use.
  EXPECT_EQ(m.allocate(1, prompt, plan).status().code(), Code::invalid_argument);
  // Freeing twice, appending to / forking / reading a finished or unknown request.
  ASSERT_TRUE(m.free(1).ok());
  EXPECT_EQ(m.free(1).code(), Code::not_found);
  EXPECT_EQ(m.append_slots(1, prompt, plan).code(), Code::not_found);
  EXPECT_EQ(m.fork(1, 2).code(), Code::not_found);
  EXPECT_EQ(m.fork(99, 2).code(), Code::not_found);
  EXPECT_EQ(m.block_table(1).status().code(), Code::not_found);
  EXPECT_EQ(m.num_tokens(1).status().code(), Code::not_found);
  // Forking onto a live request.
  ASSERT_TRUE(m.allocate(3, prompt, plan).ok());
  ASSERT_TRUE(m.allocate(4, iota_tokens(5, 900), plan).ok());
  EXPECT_EQ(m.fork(3, 4).code(), Code::invalid_argument);
  // Out of blocks: unavailable, nothing changed.
  plan.clear();
  const auto before = m.stats();
  EXPECT_EQ(m.allocate(5, iota_tokens(40, 5000), plan).status().code(), Code::unavailable);
  EXPECT_EQ(m.append_slots(4, iota_tokens(40, 5000), plan).code(), Code::unavailable);
  EXPECT_TRUE(plan.slot_mapping.empty());
  EXPECT_FALSE(m.contains(5));
  EXPECT_EQ(m.stats().free_blocks, before.free_blocks);
  EXPECT_EQ(*m.num_tokens(4), 5);
  // Prefix blocks outside the pool, free, or covering more than the prompt.
  std::vector<std::int32_t> past{4};
  EXPECT_EQ(m.allocate(6, prompt, plan, {}, past).status().code(), Code::invalid_argument);
  std::vector<std::int32_t> neg{-1};
  EXPECT_EQ(m.allocate(6, prompt, plan, {}, neg).status().code(), Code::invalid_argument);
  const std::int32_t free_block = [&] {
    for (std::int32_t b = 0; b < 4; ++b)
      if (m.block(b).ref_count == 0) return b;
    return -1;
  }();
  ASSERT_GE(free_block, 0);
  std::vector<std::int32_t> freed{free_block};
  EXPECT_EQ(m.allocate(6, prompt, plan, {}, freed).status().code(), Code::invalid_argument);
  auto t3 = *m.block_table(3);
  std::vector<std::int32_t> two{t3[0], t3[1]};
  EXPECT_EQ(m.allocate(6, prompt, plan, {}, two).status().code(), Code::invalid_argument);  // 32 tokens > 20
  // retain / release: outside the pool, free block, released twice.
  EXPECT_EQ(m.retain(past).code(), Code::invalid_argument);
  EXPECT_EQ(m.retain(freed).code(), Code::invalid_argument);
  std::vector<std::int32_t> one{t3[0]};
  EXPECT_EQ(m.release(one).code(), Code::invalid_argument);  // held by a table, not externally
  ASSERT_TRUE(m.retain(one).ok());
  std::vector<std::int32_t> dup{t3[0], t3[0]};
  EXPECT_EQ(m.release(dup).code(), Code::invalid_argument);  // one external reference, released twice
  EXPECT_EQ(m.external_refs(t3[0]), 1);
  ASSERT_TRUE(m.release(one).ok());
  EXPECT_EQ(m.release(one).code(), Code::invalid_argument);
  expect_ok(m);
  // build_batch of an unknown request.
  PagedBatch batch;
  std::vector<RequestId> ids{3, 42};
  EXPECT_EQ(m.build_batch(ids, batch).code(), Code::not_found);
}

TEST(KVCacheManager, ValidateBlockTable) {
  std::vector<std::int32_t> table{0, 3, 7};
  EXPECT_TRUE(KVCacheManager::validate_block_table(table, 48, 8, 16).ok());
  EXPECT_TRUE(KVCacheManager::validate_block_table(table, 33, 8, 16).ok());
  EXPECT_EQ(KVCacheManager::validate_block_table(table, 49, 8, 16).code(), Code::shape_mismatch);
  EXPECT_EQ(KVCacheManager::validate_block_table(table, -1, 8, 16).code(), Code::shape_mismatch);
  EXPECT_EQ(KVCacheManager::validate_block_table(table, 48, 7, 16).code(), Code::invalid_argument);
  // Entries past the context are not read.
  EXPECT_TRUE(KVCacheManager::validate_block_table(table, 32, 7, 16).ok());
  std::vector<std::int32_t> neg{0, -2};
  EXPECT_EQ(KVCacheManager::validate_block_table(neg, 20, 8, 16).code(), Code::invalid_argument);
}

TEST(KVCacheManager, CanAllocateNowLaterNever) {
  auto m = make(8, 16, false);
  EXPECT_EQ(m.can_allocate(1, 128), Admission::now);
  EXPECT_EQ(m.can_allocate(1, 129), Admission::never);
  SlotPlan plan;
  ASSERT_TRUE(m.allocate(1, iota_tokens(100), plan).ok());  // 7 blocks, 12 tokens of room in the last
  EXPECT_EQ(m.can_allocate(1, 12), Admission::now);
  EXPECT_EQ(m.can_allocate(1, 28), Admission::now);   // one more block
  EXPECT_EQ(m.can_allocate(1, 29), Admission::later);  // two more: not now, the pool has 8 blocks
  EXPECT_EQ(m.blocks_short(1, 29), 1);
  EXPECT_EQ(m.can_allocate(2, 17), Admission::later);   // a new request of 2 blocks
  EXPECT_EQ(m.can_allocate(2, 16 * 9), Admission::never);
  EXPECT_EQ(m.can_allocate(1, std::numeric_limits<std::int64_t>::max()), Admission::never);
  EXPECT_EQ(m.can_allocate(iota_tokens(16)), Admission::now);
  EXPECT_EQ(m.can_allocate(iota_tokens(17)), Admission::later);
  EXPECT_EQ(m.can_allocate(iota_tokens(16 * 8 + 1)), Admission::never);
  EXPECT_STREQ(admission_name(Admission::later), "later");
  // Forked with a partly filled last block: the first append needs a copy too.
  ASSERT_TRUE(m.fork(1, 2).ok());
  EXPECT_EQ(m.can_allocate(2, 1), Admission::now);
  EXPECT_EQ(m.blocks_short(2, 13), 1);  // copy + a new block, one free
}

TEST(KVCacheManager, ForkCopyOnWrite) {
  auto m = make(16, 8, false);
  SlotPlan plan;
  ASSERT_TRUE(m.allocate(1, iota_tokens(13), plan).ok());  // blocks a (full), b (5 of 8)
  const auto parent = std::vector<std::int32_t>(m.block_table(1)->begin(), m.block_table(1)->end());
  ASSERT_TRUE(m.fork(1, 2).ok());
  ASSERT_TRUE(m.fork(1, 3).ok());
  EXPECT_EQ(m.block(parent[0]).ref_count, 3);
  EXPECT_EQ(m.block(parent[1]).ref_count, 3);
  expect_ok(m);
  // The child's first append copies the shared partial block.
  plan.clear();
  ASSERT_TRUE(m.append_slots(2, std::vector<std::int32_t>{50}, plan).ok());
  ASSERT_EQ(plan.copies.size(), 1u);
  const auto child = *m.block_table(2);
  EXPECT_EQ(plan.copies[0], (BlockCopy{parent[1], child[1]}));
  EXPECT_EQ(child[0], parent[0]);
  EXPECT_NE(child[1], parent[1]);
  EXPECT_EQ(plan.slot_mapping, std::vector<std::int64_t>{std::int64_t(child[1]) * 8 + 5});
  EXPECT_EQ(m.block(parent[1]).ref_count, 2);
  // A second append of the same child writes in place.
  plan.clear();
  ASSERT_TRUE(m.append_slots(2, std::vector<std::int32_t>{51}, plan).ok());
  EXPECT_TRUE(plan.copies.empty());
  // The other child copies; then the parent is the last holder and writes in place.
  ASSERT_TRUE(m.append_slots(3, std::vector<std::int32_t>{60}, plan).ok());
  EXPECT_EQ(plan.copies.size(), 1u);
  plan.clear();
  ASSERT_TRUE(m.append_slots(1, std::vector<std::int32_t>{70}, plan).ok());
  EXPECT_TRUE(plan.copies.empty());
  EXPECT_EQ(plan.slot_mapping[0], std::int64_t(parent[1]) * 8 + 5);
  EXPECT_EQ(m.stats().cow_copies, 2);
  expect_ok(m);
  // Full shared blocks are never copied: fork at a block boundary.
  ASSERT_TRUE(m.append_slots(1, std::vector<std::int32_t>{71, 72}, plan).ok());  // 16 tokens: 2 full blocks
  ASSERT_TRUE(m.fork(1, 4).ok());
  plan.clear();
  ASSERT_TRUE(m.append_slots(4, std::vector<std::int32_t>{80}, plan).ok());
  EXPECT_TRUE(plan.copies.empty());
  for (RequestId r : {1, 2, 3, 4}) ASSERT_TRUE(m.free(r).ok());
  EXPECT_EQ(m.num_free_blocks(), 16);
  expect_ok(m);
}

TEST(KVCacheManager, PrefixCachingSharesAndEvictsLru) {
  auto m = make(8, 8);
  SlotPlan plan;
  auto a = iota_tokens(20);  // 2 full blocks + 4 tokens
  ASSERT_EQ(*m.allocate(1, a, plan), 0);
  EXPECT_EQ(m.stats().cached_blocks, 2);
  // The same prompt: 2 full blocks shared, the rest new.
  plan.clear();
  ASSERT_EQ(*m.allocate(2, a, plan), 16);
  EXPECT_EQ(plan.slot_mapping.size(), 4u);
  auto t1 = *m.block_table(1);
  auto t2 = *m.block_table(2);
  EXPECT_EQ(t1[0], t2[0]);
  EXPECT_EQ(t1[1], t2[1]);
  EXPECT_NE(t1[2], t2[2]);
  EXPECT_EQ(m.block(t1[0]).ref_count, 2);
  // A prompt of exactly 2 blocks reuses only the first: its last token is always computed.
  plan.clear();
  ASSERT_EQ(*m.allocate(3, iota_tokens(16), plan), 8);
  EXPECT_EQ(plan.slot_mapping.size(), 8u);
  // Another adapter shares nothing.
  plan.clear();
  ASSERT_EQ(*m.allocate(4, a, plan, PrefixKey{"lora-7", ""}), 0);
  auto s = m.stats();
  EXPECT_EQ(s.prefix_hit_tokens, 24);
  EXPECT_EQ(s.prefix_queried_tokens, 20 + 20 + 16 + 20);
  expect_ok(m);
  for (RequestId r : {1, 2, 3, 4}) ASSERT_TRUE(m.free(r).ok());
  expect_ok(m);
  s = m.stats();
  EXPECT_EQ(s.free_blocks, 8);
  EXPECT_GT(s.cached_free_blocks, 0);
  // A freed prefix is still a hit, and taking it back out of the free pool counts.
  plan.clear();
  EXPECT_EQ(m.can_allocate(a), Admission::now);
  ASSERT_EQ(*m.allocate(5, a, plan), 16);
  expect_ok(m);
  ASSERT_TRUE(m.free(5).ok());
  // Filling the pool with other content evicts the cached blocks.
  plan.clear();
  const auto evictions_before = m.stats().evictions;
  ASSERT_TRUE(m.allocate(6, iota_tokens(64, 1000), plan).ok());
  EXPECT_EQ(m.stats().cached_free_blocks, 0);
  EXPECT_GT(m.stats().evictions, evictions_before);
  ASSERT_TRUE(m.free(6).ok());
  plan.clear();
  // 1000.. was registered; a is gone.
  ASSERT_EQ(*m.allocate(7, a, plan), 0);
  expect_ok(m);
}

TEST(KVCacheManager, LruOrderAmongCachedBlocks) {
  // Two cached prefixes, freed in order: the older one goes first.
  auto m = make(6, 8);
  SlotPlan plan;
  auto a = iota_tokens(18, 0), b = iota_tokens(18, 100);  // 3 blocks each (2 full)
  ASSERT_TRUE(m.allocate(1, a, plan).ok());
  ASSERT_TRUE(m.allocate(2, b, plan).ok());
  ASSERT_TRUE(m.free(1).ok());
  ASSERT_TRUE(m.free(2).ok());
  // 2 uncached free blocks, then a's 2, then b's 2: a 4-block request evicts a and keeps b.
  ASSERT_TRUE(m.allocate(3, iota_tokens(32, 500), plan).ok());
  ASSERT_TRUE(m.free(3).ok());
  plan.clear();
  EXPECT_EQ(*m.allocate(4, b, plan), 16);
  plan.clear();
  EXPECT_EQ(*m.allocate(5, a, plan), 0);
  expect_ok(m);
  m.reset_prefix_cache();
  expect_ok(m);
}

TEST(KVCacheManager, PrefixBlocksFromTheCaller) {
  auto m = make(8, 8, false);
  SlotPlan plan;
  auto a = iota_tokens(20);
  ASSERT_TRUE(m.allocate(1, a, plan).ok());
  auto t1 = std::vector<std::int32_t>(m.block_table(1)->begin(), m.block_table(1)->end());
  std::vector<std::int32_t> prefix{t1[0], t1[1]};
  plan.clear();
  ASSERT_EQ(*m.allocate(2, a, plan, {}, prefix), 16);
  EXPECT_EQ(plan.slot_mapping.size(), 4u);
  EXPECT_EQ(m.block(t1[0]).ref_count, 2);
  expect_ok(m);
}

TEST(KVCacheManager, BuildBatch) {
  auto m = make(16, 8);
  SlotPlan plan;
  ASSERT_TRUE(m.allocate(10, iota_tokens(8), plan).ok());
  ASSERT_TRUE(m.allocate(11, iota_tokens(19, 100), plan).ok());
  PagedBatch batch;
  std::vector<RequestId> ids{11, 10};
  ASSERT_TRUE(m.build_batch(ids, batch).ok());
  EXPECT_EQ(batch.indptr, (std::vector<std::int32_t>{0, 3, 4}));
  EXPECT_EQ(batch.last_page_len, (std::vector<std::int32_t>{3, 8}));
  EXPECT_EQ(batch.context_lens, (std::vector<std::int32_t>{19, 8}));
  auto t11 = *m.block_table(11);
  EXPECT_EQ(batch.indices[0], t11[0]);
  EXPECT_EQ(batch.indices[3], (*m.block_table(10))[0]);
  for (std::size_t i = 0; i < ids.size(); ++i)
    EXPECT_TRUE(KVCacheManager::validate_block_table(
                    std::span(batch.indices).subspan(std::size_t(batch.indptr[i]), std::size_t(batch.indptr[i + 1] - batch.indptr[i])),
                    batch.context_lens[i], m.num_blocks(), m.page_size())
                    .ok());
}

TEST(KVCacheManager, EmptyPromptThenAppend) {
  auto m = make(4, 16);
  SlotPlan plan;
  ASSERT_EQ(*m.allocate(1, {}, plan), 0);
  EXPECT_EQ(m.block_table(1)->size(), 0u);
  ASSERT_TRUE(m.append_slots(1, iota_tokens(17), plan).ok());
  EXPECT_EQ(m.block_table(1)->size(), 2u);
  ASSERT_TRUE(m.append_slots(1, {}, plan).ok());
  expect_ok(m);
}

TEST(KVCacheManager, SwapOutAndInTypedErrors) {
  auto m = make(8, 16, false);
  SlotPlan plan;
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(m.allocate(1, iota_tokens(40), plan).ok());  // 3 blocks
  EXPECT_EQ(m.swap_out(1, copies).code(), Code::invalid_argument) << "no host pool";
  ASSERT_TRUE(m.enable_swap(4).ok());
  EXPECT_EQ(m.swap_out(9, copies).code(), Code::not_found);
  EXPECT_EQ(m.swap_in(1, copies).code(), Code::invalid_argument) << "not swapped out";
  EXPECT_EQ(m.can_swap_in(1).status().code(), Code::invalid_argument);
  const auto before = std::vector<std::int32_t>(m.block_table(1)->begin(), m.block_table(1)->end());
  ASSERT_TRUE(m.swap_out(1, copies).ok());
  ASSERT_EQ(copies.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(copies[i].src, before[i]);
    EXPECT_EQ(copies[i].dst, (*m.block_table(1))[i]) << "the table holds the host blocks";
  }
  EXPECT_TRUE(m.is_swapped(1));
  EXPECT_EQ(m.num_free_blocks(), 8);
  EXPECT_EQ(m.num_free_host_blocks(), 1);
  expect_ok(m);
  EXPECT_EQ(m.swap_out(1, copies).code(), Code::invalid_argument) << "already swapped out";
  EXPECT_EQ(m.append_slots(1, iota_tokens(1), plan).code(), Code::invalid_argument);
  EXPECT_EQ(m.fork(1, 2).code(), Code::invalid_argument);
  PagedBatch batch;
  const RequestId one[] = {1};
  EXPECT_EQ(m.build_batch(one, batch).code(), Code::invalid_argument);
  EXPECT_EQ(m.enable_swap(8).code(), Code::invalid_argument) << "the host pool cannot change under a swapped request";
  // Another request too large for the host pool's free blocks: unavailable, nothing changes.
  ASSERT_TRUE(m.allocate(2, iota_tokens(20), plan).ok());  // 2 blocks, 1 host block free
  copies.clear();
  EXPECT_EQ(m.swap_out(2, copies).code(), Code::unavailable);
  EXPECT_TRUE(copies.empty());
  EXPECT_FALSE(m.is_swapped(2));
  // Swap in needs 3 free device blocks: fill the pool so it must wait.
  ASSERT_TRUE(m.allocate(3, iota_tokens(16 * 5), plan).ok());  // 5 blocks: 1 left
  EXPECT_EQ(*m.can_swap_in(1), Admission::later);
  EXPECT_EQ(m.swap_in(1, copies).code(), Code::unavailable);
  EXPECT_EQ(m.can_allocate(1, 1), Admission::later) << "a swapped request's growth counts its blocks coming back";
  ASSERT_TRUE(m.free(3).ok());
  EXPECT_EQ(*m.can_swap_in(1), Admission::now);
  copies.clear();
  ASSERT_TRUE(m.swap_in(1, copies).ok());
  ASSERT_EQ(copies.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(copies[i].dst, (*m.block_table(1))[i]);
  EXPECT_FALSE(m.is_swapped(1));
  EXPECT_EQ(m.num_free_host_blocks(), 4);
  ASSERT_TRUE(m.append_slots(1, iota_tokens(9), plan).ok());
  EXPECT_EQ(*m.num_tokens(1), 49);
  expect_ok(m);
  // Freeing a swapped-out request returns its host blocks.
  copies.clear();
  ASSERT_TRUE(m.swap_out(2, copies).ok());
  ASSERT_TRUE(m.free(2).ok());
  EXPECT_EQ(m.num_free_host_blocks(), 4);
  expect_ok(m);
}

std::vector<RequestId> live_all(const std::map<RequestId, std::vector<std::int32_t>>& want) {
  std::vector<RequestId> ids;
  for (auto& [id, t] : want) ids.push_back(id);
  return ids;
}

// Swapping against a model of the memory: a device pool and a host pool of token ids, written at
// each plan's slots (after its copy-on-write copies) and copied by the swap pairs in call order.
// Under random allocations (with prefix caching), appends, forks, swaps and frees, every live
// request's table must read back exactly its tokens.
TEST(KVCacheManager, SwappedRequestsKeepTheirTokens) {
  for (std::int32_t page : {1, 16}) {
    SCOPED_TRACE(page);
    KVCacheConfig c = config(48, page, true);
    c.num_host_blocks = 40;
    auto made = KVCacheManager::create(c);
    ASSERT_TRUE(made.ok());
    KVCacheManager m = std::move(made).value();
    std::vector<std::int32_t> dev(std::size_t(48 * page), -1), host(std::size_t(40 * page), -1);
    std::map<RequestId, std::vector<std::int32_t>> want;
    std::mt19937 rng(1234 + page);
    auto write = [&](const SlotPlan& plan, const std::vector<std::int32_t>& tokens) {
      for (const BlockCopy& cp : plan.copies)
        std::copy_n(dev.begin() + std::ptrdiff_t(cp.src) * page, page, dev.begin() + std::ptrdiff_t(cp.dst) * page);
      ASSERT_EQ(plan.slot_mapping.size(), tokens.size());
      for (std::size_t i = 0; i < tokens.size(); ++i) dev[std::size_t(plan.slot_mapping[i])] = tokens[i];
    };
    auto copy = [&](const std::vector<BlockCopy>& pairs, const std::vector<std::int32_t>& from, std::vector<std::int32_t>& to) {
      for (const BlockCopy& cp : pairs)
        std::copy_n(from.begin() + std::ptrdiff_t(cp.src) * page, page, to.begin() + std::ptrdiff_t(cp.dst) * page);
    };
    RequestId next = 1;
    int swaps = 0, swap_ins = 0;
    for (int step = 0; step < 3000; ++step) {
      const int what = int(rng() % 6);
      std::vector<RequestId> resident, swapped_out;
      for (auto& [id, t] : want) (m.is_swapped(id) ? swapped_out : resident).push_back(id);
      // Swap-ins and frees pick from the requests they apply to; the rest from the resident ones.
      const std::vector<RequestId>& from = what == 4 ? swapped_out : what == 5 ? live_all(want) : resident;
      const RequestId pick = from.empty() ? -1 : from[rng() % from.size()];
      SlotPlan plan;
      if (what == 0 || pick < 0) {
        // Prompts from a few shared prefixes, so the prefix cache hits.
        std::vector<std::int32_t> prompt = iota_tokens(std::int32_t(rng() % (3 * page) + page), 100 * std::int32_t(rng() % 3));
        for (int i = 0; i < int(rng() % 5); ++i) prompt.push_back(std::int32_t(rng() % 1000));
        if (m.can_allocate(prompt) != Admission::now) {
          // Full: the oldest request finishes.
          if (!want.empty()) {
            ASSERT_TRUE(m.free(want.begin()->first).ok());
            want.erase(want.begin());
          }
          continue;
        }
        auto cached = m.allocate(next, prompt, plan);
        ASSERT_TRUE(cached.ok()) << cached.status().to_string();
        write(plan, std::vector<std::int32_t>(prompt.begin() + *cached, prompt.end()));
        want[next++] = prompt;
      } else if (what == 1) {
        std::vector<std::int32_t> more{std::int32_t(rng() % 1000), std::int32_t(rng() % 1000)};
        if (m.can_allocate(pick, 2) != Admission::now) continue;
        ASSERT_TRUE(m.append_slots(pick, more, plan).ok());
        write(plan, more);
        want[pick].insert(want[pick].end(), more.begin(), more.end());
      } else if (what == 2) {
        ASSERT_TRUE(m.fork(pick, next).ok());
        want[next++] = want[pick];
      } else if (what == 3) {
        std::vector<BlockCopy> pairs;
        if (m.swap_out(pick, pairs).ok()) {
          copy(pairs, dev, host);
          ++swaps;
        }
      } else if (what == 4) {
        std::vector<BlockCopy> pairs;
        if (*m.can_swap_in(pick) != Admission::now) continue;
        ASSERT_TRUE(m.swap_in(pick, pairs).ok());
        copy(pairs, host, dev);
        ++swap_ins;
      } else if (what == 5 && rng() % 2 == 0) {
        ASSERT_TRUE(m.free(pick).ok());
        want.erase(pick);
      }
      for (auto& [id, tokens] : want) {
        const auto table = *m.block_table(id);
        const std::vector<std::int32_t>& pool = m.is_swapped(id) ? host : dev;
        ASSERT_EQ(*m.num_tokens(id), std::int64_t(tokens.size()));
        for (std::size_t i = 0; i < tokens.size(); ++i)
          ASSERT_EQ(pool[std::size_t(table[i / std::size_t(page)]) * std::size_t(page) + i % std::size_t(page)], tokens[i])
              << "request " << id << " token " << i << " at step " << step;
      }
      ASSERT_TRUE(m.check_invariants().ok()) << m.check_invariants().to_string();
    }
    // The mix did exercise both directions many times.
    EXPECT_GT(swaps, 30);
    EXPECT_GT(swap_ins, 20);
  }
}

// The manager is not thread-safe: it keeps no global state, so managers on different threads are
// independent.
TEST(KVCacheManager, IndependentManagersOnThreads) {
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t, &ok] {
      auto m = make(64, 16);
      SlotPlan plan;
      for (int i = 0; i < 2000; ++i) {
        RequestId id = i;
        if (!m.allocate(id, iota_tokens(40, i % 7), plan).ok()) return;
        if (!m.append_slots(id, iota_tokens(3), plan).ok()) return;
        if (!m.free(id).ok()) return;
        plan.clear();
      }
      ok[std::size_t(t)] = m.check_invariants().ok() && m.num_free_blocks() == 64;
    });
  for (auto& th : threads) th.join();
  for (int v : ok) EXPECT_EQ(v, 1);
}

}  // namespace
}  // namespace kiln
