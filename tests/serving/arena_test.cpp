#include <gtest/gtest.h>

#include <map>
#include <random>

#include "kiln/arena.h"

namespace kiln {
namespace {

void expect_ok(const ArenaAllocator& a) {
  Status s = a.check_invariants();
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST(ArenaAllocator, CreateValidates) {
  EXPECT_EQ(ArenaAllocator::create(1024, 3).status().code(), Code::invalid_argument);
  EXPECT_EQ(ArenaAllocator::create(1024, 0).status().code(), Code::invalid_argument);
  EXPECT_EQ(ArenaAllocator::create(100, 256).status().code(), Code::invalid_argument);
  EXPECT_EQ(ArenaAllocator::create(1024, 256, 0).status().code(), Code::invalid_argument);
  auto a = ArenaAllocator::create(1000, 256);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->capacity(), 768u);  // rounded down to the alignment
}

TEST(ArenaAllocator, AllocateFreeMergeStats) {
  auto r = ArenaAllocator::create(4096, 256, 16);
  ASSERT_TRUE(r.ok());
  ArenaAllocator& a = *r;
  auto x = a.allocate(1);
  auto y = a.allocate(300);
  auto z = a.allocate(256);
  ASSERT_TRUE(x.ok() && y.ok() && z.ok());
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, 256u);
  EXPECT_EQ(*z, 768u);
  EXPECT_EQ(*a.size_of(*y), 512u);
  auto s = a.stats();
  EXPECT_EQ(s.in_use, 1024u);
  EXPECT_EQ(s.free, 3072u);
  EXPECT_EQ(s.largest_free, 3072u);
  EXPECT_EQ(s.allocations, 3);
  expect_ok(a);
  // Freeing the middle leaves a hole; the largest free run is still the tail.
  ASSERT_TRUE(a.free(*y).ok());
  s = a.stats();
  EXPECT_EQ(s.free_ranges, 2);
  EXPECT_EQ(s.largest_free, 3072u);
  expect_ok(a);
  // The hole is reused for a fitting request.
  auto w = a.allocate(512);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(*w, 256u);
  // Freeing everything merges back into one range.
  for (std::uint64_t o : {*x, *w, *z}) ASSERT_TRUE(a.free(o).ok());
  s = a.stats();
  EXPECT_EQ(s.free_ranges, 1);
  EXPECT_EQ(s.largest_free, 4096u);
  EXPECT_EQ(s.in_use, 0u);
  EXPECT_EQ(s.peak_in_use, 1024);
  expect_ok(a);
}

TEST(ArenaAllocator, Errors) {
  auto r = ArenaAllocator::create(4096, 256, 4);
  ArenaAllocator& a = *r;
  EXPECT_EQ(a.allocate(0).status().code(), Code::invalid_argument);
  EXPECT_EQ(a.allocate(8192).status().code(), Code::unavailable);
  auto x = a.allocate(256);
  ASSERT_TRUE(x.ok());
  // Freeing twice, an offset never handed out, an offset inside a range.
  ASSERT_TRUE(a.free(*x).ok());
  EXPECT_EQ(a.free(*x).code(), Code::not_found);
  EXPECT_EQ(a.free(12345).code(), Code::not_found);
  auto y = a.allocate(1024);
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(a.free(*y + 256).code(), Code::not_found);
  EXPECT_EQ(a.size_of(*y + 256).status().code(), Code::not_found);
  ASSERT_TRUE(a.free(*y).ok());
  // Fragmented: 3072 bytes free, in ranges of 512, 512 and 2048.
  std::uint64_t p[4];
  for (auto& o : p) o = *a.allocate(512);
  ASSERT_TRUE(a.free(p[0]).ok());
  ASSERT_TRUE(a.free(p[2]).ok());
  auto s = a.stats();
  EXPECT_EQ(s.free, 3072u);
  EXPECT_EQ(s.largest_free, 2048u);
  EXPECT_EQ(s.free_ranges, 3);
  EXPECT_EQ(a.allocate(2560).status().code(), Code::unavailable);
  // The allocation table is full (4 live ranges) though there is room.
  ASSERT_TRUE(a.allocate(256).ok());
  ASSERT_TRUE(a.allocate(256).ok());
  EXPECT_EQ(a.allocate(256).status().code(), Code::unavailable);
  EXPECT_EQ(a.stats().failed, 3);
  expect_ok(a);
}

TEST(ArenaAllocator, RandomizedAgainstModel) {
  std::mt19937_64 rng(1234);
  auto r = ArenaAllocator::create(std::uint64_t(1) << 30, 512, 2048);
  ArenaAllocator& a = *r;
  std::map<std::uint64_t, std::uint64_t> live;  // offset -> rounded size
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 100 < 55) {
      const std::uint64_t size = 1 + (rng() % 4 == 0 ? rng() % (64ull << 20) : rng() % (1ull << 20));
      auto o = a.allocate(size);
      if (!o.ok()) {
        ASSERT_EQ(o.status().code(), Code::unavailable);
        continue;
      }
      const std::uint64_t rounded = (size + 511) / 512 * 512;
      // No overlap with any live range.
      auto next = live.lower_bound(*o);
      if (next != live.end()) {
        ASSERT_LE(*o + rounded, next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, *o);
      }
      ASSERT_EQ(*o % 512, 0u);
      live[*o] = rounded;
    } else {
      auto it = live.begin();
      std::advance(it, std::ptrdiff_t(rng() % live.size()));
      ASSERT_TRUE(a.free(it->first).ok());
      live.erase(it);
    }
    if (step % 97 == 0) {
      expect_ok(a);
      std::uint64_t used = 0;
      for (auto& [o, s] : live) used += s;
      ASSERT_EQ(a.stats().in_use, used);
    }
  }
  for (auto& [o, s] : live) ASSERT_TRUE(a.free(o).ok());
  expect_ok(a);
  EXPECT_EQ(a.stats().largest_free, std::uint64_t(1) << 30);
}

}  // namespace
}  // namespace kiln
