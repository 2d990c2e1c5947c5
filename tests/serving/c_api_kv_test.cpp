// The KV cache's C ABI (kiln.h, version 6): the calls, their codes and kiln_last_error.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kiln/kiln.h"

namespace {

TEST(CApiKV, Version) { EXPECT_GE(kiln_abi_version(), 6); }

TEST(CApiKV, ManagerLifeCycleAndErrors) {
  kiln_kv_config cfg{8, 16, KILN_KV_BF16, 2, 8, 128, 1};
  kiln_kv_manager* m = nullptr;
  ASSERT_EQ(kiln_kv_manager_create(&cfg, &m), KILN_OK) << kiln_last_error();
  kiln_kv_plan* plan = nullptr;
  ASSERT_EQ(kiln_kv_plan_create(&plan), KILN_OK);

  std::vector<int32_t> prompt(40);
  for (int i = 0; i < 40; ++i) prompt[std::size_t(i)] = i;
  int32_t adm = -1;
  ASSERT_EQ(kiln_kv_can_allocate_prompt(m, prompt.data(), 40, nullptr, nullptr, &adm), KILN_OK);
  EXPECT_EQ(adm, KILN_KV_NOW);
  int64_t cached = -1;
  ASSERT_EQ(kiln_kv_allocate(m, 1, prompt.data(), 40, nullptr, nullptr, nullptr, 0, plan, &cached), KILN_OK);
  EXPECT_EQ(cached, 0);
  ASSERT_EQ(kiln_kv_allocate(m, 2, prompt.data(), 40, "", nullptr, nullptr, 0, plan, &cached), KILN_OK);
  EXPECT_EQ(cached, 32);
  const int64_t* slots = nullptr;
  const int32_t* copies = nullptr;
  int64_t ns = 0, nc = 0;
  ASSERT_EQ(kiln_kv_plan_get(plan, &slots, &ns, &copies, &nc), KILN_OK);
  EXPECT_EQ(ns, 40 + 8);
  EXPECT_EQ(nc, 0);

  const int32_t* table = nullptr;
  int64_t nb = 0, nt = 0;
  ASSERT_EQ(kiln_kv_block_table(m, 2, &table, &nb, &nt), KILN_OK);
  EXPECT_EQ(nb, 3);
  EXPECT_EQ(nt, 40);
  int32_t rc = 0, ext = 0, is_cached = 0;
  ASSERT_EQ(kiln_kv_block_info(m, table[0], &rc, &ext, &is_cached), KILN_OK);
  EXPECT_EQ(rc, 2);
  EXPECT_EQ(ext, 0);
  EXPECT_EQ(is_cached, 1);

  // Fork, then copy-on-write of the shared partial block.
  ASSERT_EQ(kiln_kv_fork(m, 2, 3), KILN_OK);
  kiln_kv_plan_clear(plan);
  int32_t tok = 7;
  ASSERT_EQ(kiln_kv_append_slots(m, 3, &tok, 1, plan), KILN_OK);
  ASSERT_EQ(kiln_kv_plan_get(plan, &slots, &ns, &copies, &nc), KILN_OK);
  ASSERT_EQ(nc, 1);
  EXPECT_EQ(copies[0], table[2]);

  // Typed errors with a message.
  EXPECT_EQ(kiln_kv_allocate(m, 1, prompt.data(), 4, nullptr, nullptr, nullptr, 0, plan, &cached), KILN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kiln_last_error()).find("already allocated"), std::string::npos);
  ASSERT_EQ(kiln_kv_free(m, 1), KILN_OK);
  EXPECT_EQ(kiln_kv_free(m, 1), KILN_NOT_FOUND);
  EXPECT_EQ(kiln_kv_append_slots(m, 1, &tok, 1, plan), KILN_NOT_FOUND);
  EXPECT_EQ(kiln_kv_fork(m, 1, 9), KILN_NOT_FOUND);
  EXPECT_EQ(kiln_kv_allocate(m, 4, nullptr, 5, nullptr, nullptr, nullptr, 0, plan, &cached), KILN_INVALID_ARGUMENT);
  std::vector<int32_t> big(200, 1);
  EXPECT_EQ(kiln_kv_allocate(m, 4, big.data(), 200, nullptr, nullptr, nullptr, 0, plan, &cached), KILN_UNAVAILABLE);
  int32_t past = 8;
  EXPECT_EQ(kiln_kv_retain(m, &past, 1), KILN_INVALID_ARGUMENT);
  EXPECT_EQ(kiln_kv_block_info(m, 8, &rc, &ext, &is_cached), KILN_INVALID_ARGUMENT);
  EXPECT_EQ(kiln_kv_can_allocate(m, 9, 16 * 9, &adm), KILN_OK);
  EXPECT_EQ(adm, KILN_KV_NEVER);
  EXPECT_EQ(kiln_kv_validate_block_table(table, 3, 49, 8, 16), KILN_SHAPE_MISMATCH);
  EXPECT_EQ(kiln_kv_validate_block_table(&past, 1, 1, 8, 16), KILN_INVALID_ARGUMENT);
  kiln_kv_config bad = cfg;
  bad.page_size = 4;
  kiln_kv_manager* m2 = nullptr;
  EXPECT_EQ(kiln_kv_manager_create(&bad, &m2), KILN_INVALID_ARGUMENT);
  EXPECT_EQ(m2, nullptr);
  EXPECT_EQ(kiln_kv_check(m), KILN_OK);

  kiln_kv_stats st{};
  ASSERT_EQ(kiln_kv_get_stats(m, &st), KILN_OK);
  EXPECT_EQ(st.num_requests, 2);
  EXPECT_EQ(st.prefix_hit_tokens, 32);
  EXPECT_EQ(st.cow_copies, 1);
  EXPECT_EQ(st.bytes_per_block, 2ull * 2 * 8 * 128 * 16 * 2);

  kiln_kv_plan_destroy(plan);
  kiln_kv_manager_destroy(m);
}

TEST(CApiKV, Swap) {
  EXPECT_GE(kiln_abi_version(), 8);
  kiln_kv_config cfg{8, 16, KILN_KV_BF16, 2, 8, 128, 0};
  kiln_kv_manager* m = nullptr;
  ASSERT_EQ(kiln_kv_manager_create(&cfg, &m), KILN_OK) << kiln_last_error();
  kiln_kv_plan* plan = nullptr;
  ASSERT_EQ(kiln_kv_plan_create(&plan), KILN_OK);
  std::vector<int32_t> prompt(40, 7);
  int64_t cached = -1;
  ASSERT_EQ(kiln_kv_allocate(m, 1, prompt.data(), 40, nullptr, nullptr, nullptr, 0, plan, &cached), KILN_OK);
  int32_t pairs[8] = {};
  int64_t n = -1;
  EXPECT_EQ(kiln_kv_swap_out(m, 1, pairs, 3, &n), KILN_INVALID_ARGUMENT) << "no host pool yet";
  ASSERT_EQ(kiln_kv_enable_swap(m, 4), KILN_OK);
  EXPECT_EQ(kiln_kv_swap_out(m, 1, pairs, 2, &n), KILN_INVALID_ARGUMENT) << "room for 2 pairs, 3 blocks";
  int32_t swapped = -1, host = -1, host_free = -1;
  ASSERT_EQ(kiln_kv_swap_state(m, 1, &swapped, &host, &host_free), KILN_OK);
  EXPECT_EQ(swapped, 0);
  EXPECT_EQ(host_free, 4) << "the refused call changed nothing";
  ASSERT_EQ(kiln_kv_swap_out(m, 1, pairs, 4, &n), KILN_OK) << kiln_last_error();
  EXPECT_EQ(n, 3);
  ASSERT_EQ(kiln_kv_swap_state(m, 1, &swapped, &host, &host_free), KILN_OK);
  EXPECT_EQ(swapped, 1);
  EXPECT_EQ(host, 4);
  EXPECT_EQ(host_free, 1);
  const int32_t* table = nullptr;
  int64_t nb = 0, nt = 0;
  ASSERT_EQ(kiln_kv_block_table(m, 1, &table, &nb, &nt), KILN_OK);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(table[i], pairs[2 * i + 1]);
  int32_t adm = -1;
  ASSERT_EQ(kiln_kv_can_swap_in(m, 1, &adm), KILN_OK);
  EXPECT_EQ(adm, KILN_KV_NOW);
  ASSERT_EQ(kiln_kv_swap_in(m, 1, pairs, 4, &n), KILN_OK) << kiln_last_error();
  EXPECT_EQ(n, 3);
  EXPECT_EQ(kiln_kv_can_swap_in(m, 1, &adm), KILN_INVALID_ARGUMENT);
  EXPECT_EQ(kiln_kv_swap_in(m, 42, pairs, 4, &n), KILN_NOT_FOUND);
  EXPECT_EQ(kiln_kv_check(m), KILN_OK);
  kiln_kv_plan_destroy(plan);
  kiln_kv_manager_destroy(m);
}

TEST(CApiKV, Radix) {
  kiln_kv_config cfg{16, 1, KILN_KV_F16, 1, 1, 64, 0};
  kiln_kv_manager* m = nullptr;
  ASSERT_EQ(kiln_kv_manager_create(&cfg, &m), KILN_OK);
  kiln_kv_plan* plan = nullptr;
  ASSERT_EQ(kiln_kv_plan_create(&plan), KILN_OK);
  kiln_radix* r = nullptr;
  ASSERT_EQ(kiln_radix_create(m, &r), KILN_OK);
  int32_t toks[4] = {5, 6, 7, 8};
  ASSERT_EQ(kiln_kv_allocate(m, 1, toks, 4, nullptr, nullptr, nullptr, 0, plan, nullptr), KILN_OK);
  const int32_t* table = nullptr;
  int64_t nb = 0;
  ASSERT_EQ(kiln_kv_block_table(m, 1, &table, &nb, nullptr), KILN_OK);
  int64_t node = -1, cached = -1;
  ASSERT_EQ(kiln_radix_insert(r, toks, 4, table, nb, &node, &cached), KILN_OK);
  EXPECT_EQ(cached, 0);
  int32_t out[4];
  int64_t count = 0;
  EXPECT_EQ(kiln_radix_match(r, toks, 4, out, 2, &count, &node), KILN_INVALID_ARGUMENT);  // too small
  ASSERT_EQ(kiln_radix_match(r, toks, 3, out, 3, &count, &node), KILN_OK);
  EXPECT_EQ(count, 3);
  ASSERT_EQ(kiln_radix_lock(r, node), KILN_OK);
  ASSERT_EQ(kiln_kv_free(m, 1), KILN_OK);
  int64_t freed = -1;
  ASSERT_EQ(kiln_radix_evict(r, 100, &freed), KILN_OK);
  EXPECT_EQ(freed, 1);
  kiln_radix_stats rs{};
  ASSERT_EQ(kiln_radix_get_stats(r, &rs), KILN_OK);
  EXPECT_EQ(rs.protected_blocks, 3);
  EXPECT_EQ(rs.reclaimable_blocks, 0);
  ASSERT_EQ(kiln_radix_unlock(r, node), KILN_OK);
  EXPECT_EQ(kiln_radix_unlock(r, node), KILN_INVALID_ARGUMENT);
  EXPECT_EQ(kiln_radix_lock(r, 12345), KILN_NOT_FOUND);
  EXPECT_EQ(kiln_radix_check(r), KILN_OK);
  kiln_radix_destroy(r);
  kiln_kv_stats st{};
  ASSERT_EQ(kiln_kv_get_stats(m, &st), KILN_OK);
  EXPECT_EQ(st.free_blocks, 16);  // the tree's references went with it
  kiln_kv_plan_destroy(plan);
  kiln_kv_manager_destroy(m);
}

}  // namespace
