// DeviceArena on a real GPU: ranges inside the one reservation, aligned and disjoint; a free is
// taken back at once by its own stream and by another stream only after (or by waiting for) the
// work queued before it, which the data shows; typed errors; many threads on their own streams.
// The refusal under CUDA graph capture is not exercised here (the driver table has no capture
// calls).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "jit/driver.h"
#include "kiln/device_arena.h"
#include "tests/gpu_util.h"

namespace kiln {
namespace {

using testing::GpuFixture;

class DeviceArenaGpu : public GpuFixture {
 protected:
  const jit::Driver* d() const { return jit::Driver::get().value(); }
  CUstream new_stream() {
    CUstream s = nullptr;
    EXPECT_EQ(d()->stream_create(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    streams_.push_back(s);
    return s;
  }
  void TearDown() override {
    for (CUstream s : streams_) {
      d()->stream_synchronize(s);
      d()->stream_destroy(s);
    }
    GpuFixture::TearDown();
  }
  std::vector<std::uint32_t> read(void* p, std::size_t words) {
    std::vector<std::uint32_t> out(words);
    EXPECT_EQ(d()->ctx_synchronize(), CUDA_SUCCESS);
    EXPECT_EQ(d()->memcpy_dtoh(out.data(), CUdeviceptr(p), words * 4), CUDA_SUCCESS);
    return out;
  }
  std::vector<CUstream> streams_;
};

TEST_F(DeviceArenaGpu, RangesLieInTheReservationAlignedAndDisjoint) {
  auto arena = DeviceArena::create(64 << 20, 512);
  ASSERT_TRUE(arena.ok()) << arena.status().to_string();
  DeviceArena& a = **arena;
  EXPECT_EQ(a.capacity(), std::uint64_t(64) << 20);
  const auto base = reinterpret_cast<std::uintptr_t>(a.base());
  std::mt19937 rng(seed_);
  std::vector<std::pair<void*, std::uint64_t>> live;
  for (int i = 0; i < 200; ++i) {
    const std::uint64_t size = 1 + rng() % (200 << 10);
    auto p = a.allocate(size);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    const auto at = reinterpret_cast<std::uintptr_t>(*p);
    EXPECT_EQ(at % 512, 0u);
    EXPECT_GE(at, base);
    EXPECT_LE(at + size, base + a.capacity());
    live.push_back({*p, size});
  }
  std::sort(live.begin(), live.end());
  for (std::size_t i = 1; i < live.size(); ++i)
    EXPECT_LE(reinterpret_cast<std::uintptr_t>(live[i - 1].first) + live[i - 1].second,
              reinterpret_cast<std::uintptr_t>(live[i].first));
  // Every range is usable memory: fill each with its index, read them all back.
  for (std::size_t i = 0; i < live.size(); ++i)
    ASSERT_EQ(d()->memset_d32_async(CUdeviceptr(live[i].first), std::uint32_t(i), live[i].second / 4, nullptr),
              CUDA_SUCCESS);
  for (std::size_t i = 0; i < live.size(); ++i)
    for (std::uint32_t w : read(live[i].first, live[i].second / 4)) ASSERT_EQ(w, std::uint32_t(i));
  const DeviceArenaStats s = a.stats();
  EXPECT_EQ(s.ranges.allocations, 200);
  EXPECT_GT(s.ranges.in_use, 0u);
  for (const auto& [p, size] : live) ASSERT_TRUE(a.free(p).ok());
  EXPECT_EQ(a.stats().pending_frees, 200);
  // The next allocate on the same (default) stream takes them all back.
  auto p = a.allocate(256);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(a.stats().pending_frees, 0);
  EXPECT_EQ(a.stats().ranges.allocations, 1);
  ASSERT_TRUE(a.free(*p).ok());
}

// A free on stream 1 whose work is still queued: an allocate on stream 2 that needs the range must
// wait for that work. Stream 1 is held back by a long run of copies before it writes 1 into the
// range; stream 2 writes 2 into its allocation. Without the wait, stream 1's late write would land
// last.
TEST_F(DeviceArenaGpu, AnotherStreamReusesAFreeOnlyAfterItsWork) {
  const std::uint64_t size = 1 << 20;
  auto arena = DeviceArena::create(size, 256);
  ASSERT_TRUE(arena.ok()) << arena.status().to_string();
  DeviceArena& a = **arena;
  CUstream s1 = new_stream(), s2 = new_stream();
  CUdeviceptr big_a = 0, big_b = 0;
  const std::size_t big = std::size_t(256) << 20;
  ASSERT_EQ(d()->mem_alloc(&big_a, big), CUDA_SUCCESS);
  ASSERT_EQ(d()->mem_alloc(&big_b, big), CUDA_SUCCESS);
  for (int round = 0; round < 3; ++round) {
    auto p1 = a.allocate(size, s1);
    ASSERT_TRUE(p1.ok()) << p1.status().to_string();
    for (int i = 0; i < 40; ++i) ASSERT_EQ(d()->memcpy_dtod_async(big_b, big_a, big, s1), CUDA_SUCCESS);
    ASSERT_EQ(d()->memset_d32_async(CUdeviceptr(*p1), 1u, size / 4, s1), CUDA_SUCCESS);
    ASSERT_TRUE(a.free(*p1, s1).ok());
    auto p2 = a.allocate(size, s2);
    ASSERT_TRUE(p2.ok()) << p2.status().to_string();
    EXPECT_EQ(*p2, *p1) << "the arena holds one range of this size";
    ASSERT_EQ(d()->memset_d32_async(CUdeviceptr(*p2), 2u, size / 4, s2), CUDA_SUCCESS);
    for (std::uint32_t w : read(*p2, size / 4)) ASSERT_EQ(w, 2u) << "stream 2 wrote before stream 1's work ended";
    ASSERT_TRUE(a.free(*p2, s2).ok());
  }
  EXPECT_EQ(a.stats().cross_stream_waits, 3);
  d()->mem_free(big_a);
  d()->mem_free(big_b);
}

// The same stream takes its own free back at once (stream order covers it), without a wait.
TEST_F(DeviceArenaGpu, TheSameStreamReusesItsFreeAtOnce) {
  const std::uint64_t size = 1 << 20;
  auto arena = DeviceArena::create(size, 256);
  ASSERT_TRUE(arena.ok());
  DeviceArena& a = **arena;
  CUstream s = new_stream();
  auto p1 = a.allocate(size, s);
  ASSERT_TRUE(p1.ok());
  ASSERT_EQ(d()->memset_d32_async(CUdeviceptr(*p1), 1u, size / 4, s), CUDA_SUCCESS);
  ASSERT_TRUE(a.free(*p1, s).ok());
  auto p2 = a.allocate(size, s);
  ASSERT_TRUE(p2.ok()) << p2.status().to_string();
  EXPECT_EQ(*p2, *p1);
  ASSERT_EQ(d()->memset_d32_async(CUdeviceptr(*p2), 2u, size / 4, s), CUDA_SUCCESS);
  for (std::uint32_t w : read(*p2, size / 4)) ASSERT_EQ(w, 2u);
  EXPECT_EQ(a.stats().same_stream_reuses, 1);
  EXPECT_EQ(a.stats().cross_stream_waits, 0);
  ASSERT_TRUE(a.free(*p2, s).ok());
}

TEST_F(DeviceArenaGpu, BadCallsAreTypedErrors) {
  EXPECT_EQ(DeviceArena::create(0).status().code(), Code::invalid_argument);
  EXPECT_EQ(DeviceArena::create(1 << 20, 3).status().code(), Code::invalid_argument);
  auto arena = DeviceArena::create(1 << 20, 256, 4);
  ASSERT_TRUE(arena.ok());
  DeviceArena& a = **arena;
  EXPECT_EQ(a.allocate(0).status().code(), Code::invalid_argument);
  EXPECT_EQ(a.allocate((1 << 20) + 1).status().code(), Code::unavailable);
  int host = 0;
  EXPECT_EQ(a.free(&host).code(), Code::invalid_argument);
  auto p = a.allocate(1000);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(a.free(static_cast<char*>(*p) + 256).code(), Code::not_found);
  ASSERT_TRUE(a.free(*p).ok());
  EXPECT_EQ(a.free(*p).code(), Code::not_found) << "a second free of the same range";
  // max_allocations 4: the fifth live range is refused.
  std::vector<void*> live;
  for (int i = 0; i < 4; ++i) live.push_back(a.allocate(1000).value());
  EXPECT_EQ(a.allocate(1000).status().code(), Code::unavailable);
  for (void* q : live) ASSERT_TRUE(a.free(q).ok());
}

// Eight threads, each on its own stream, allocate, write, check and free ranges of random sizes;
// at the end every range is back.
TEST_F(DeviceArenaGpu, ThreadsOnTheirOwnStreams) {
  auto arena = DeviceArena::create(32 << 20, 256);
  ASSERT_TRUE(arena.ok());
  DeviceArena& a = **arena;
  std::vector<CUstream> streams;
  for (int t = 0; t < 8; ++t) streams.push_back(new_stream());
  CUcontext ctx = nullptr;
  ASSERT_EQ(d()->ctx_get_current(&ctx), CUDA_SUCCESS);
  std::vector<int> bad(8, 0), failed(8, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      d()->ctx_set_current(ctx);
      std::mt19937 rng(seed_ + unsigned(t));
      for (int i = 0; i < 300; ++i) {
        const std::uint64_t size = 4 * (1 + rng() % (64 << 10));
        auto p = a.allocate(size, streams[t]);
        if (!p.ok()) {
          ++failed[t];
          continue;
        }
        const std::uint32_t tag = std::uint32_t(t << 16 | i);
        d()->memset_d32_async(CUdeviceptr(*p), tag, size / 4, streams[t]);
        d()->stream_synchronize(streams[t]);
        std::uint32_t first = 0, last = 0;
        d()->memcpy_dtoh(&first, CUdeviceptr(*p), 4);
        d()->memcpy_dtoh(&last, CUdeviceptr(*p) + size - 4, 4);
        if (first != tag || last != tag) ++bad[t];
        if (!a.free(*p, streams[t]).ok()) ++bad[t];
      }
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) {
    EXPECT_EQ(bad[t], 0) << "thread " << t;
    EXPECT_EQ(failed[t], 0) << "thread " << t;
  }
  ASSERT_EQ(d()->ctx_synchronize(), CUDA_SUCCESS);
  auto p = a.allocate(256);  // takes back every completed free
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(a.stats().pending_frees, 0);
  EXPECT_EQ(a.stats().ranges.allocations, 1);
  EXPECT_TRUE(a.free(*p).ok());
}

}  // namespace
}  // namespace kiln
