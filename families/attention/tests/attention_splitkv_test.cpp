// The attention decode path on the CPU: the heuristic's split counts and the workspace size; the
// attention_splitkv and attention_combine families' geometry; their CPU references chained (every
// split's partial, then the merge) against the one-pass attention family's reference for forced
// split counts, GQA packing, causal and window masks that empty whole splits, softcap, packed
// sequences of uneven lengths and rows that see no key; the benchmark problems leave no split empty.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "families/attention/attention.h"
#include "families/attention/attention_splitkv.h"
#include "kiln/family.h"

namespace kiln {
namespace {

using families::AttentionProblem;

AttentionProblem decode(std::int64_t batch, std::int64_t heads, std::int64_t kv_heads, std::int64_t lq,
                        std::int64_t lk, std::int64_t d = 128, std::int64_t dv = 128) {
  AttentionProblem a;
  a.batch = batch;
  a.seqlen_q = lq;
  a.seqlen_k = lk;
  a.total_q = batch * lq;
  a.total_k = batch * lk;
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = d;
  a.head_dim_v = dv;
  a.scale = 1.0 / std::sqrt(double(d));
  return a;
}

TEST(AttentionDecodeHeuristic, BlocksPerSmFollowSharedMemoryThreadsAndRegisters) {
  using families::attention_splitkv_blocks_per_sm;
  // D128, one warp, 64-key tiles: 74,240 bytes of tiles, 512 of slot ring, 1 KiB reserve.
  EXPECT_EQ(attention_splitkv_blocks_per_sm(128, 128, 1, 64, 90), 3);
  EXPECT_EQ(attention_splitkv_blocks_per_sm(128, 128, 1, 64, 0), 3);   // 0: as 9.0
  EXPECT_EQ(attention_splitkv_blocks_per_sm(128, 128, 1, 64, 80), 2);  // 164 KiB
  EXPECT_EQ(attention_splitkv_blocks_per_sm(128, 128, 1, 64, 89), 1);  // 100 KiB
  EXPECT_EQ(attention_splitkv_blocks_per_sm(64, 64, 1, 64, 90), 5);
  // Eight warps at 255 registers a thread take the whole register file.
  EXPECT_EQ(attention_splitkv_blocks_per_sm(128, 128, 8, 64, 90), 1);
  EXPECT_EQ(attention_splitkv_blocks_per_sm(64, 64, 4, 64, 90), 2);
  // Key warps: two keep three blocks of D128; four are bound by registers to two.
  EXPECT_EQ(attention_splitkv_blocks_per_sm(128, 128, 1, 64, 90, 2), 3);
  EXPECT_EQ(attention_splitkv_blocks_per_sm(128, 128, 1, 64, 90, 4), 2);
}

TEST(AttentionDecodeHeuristic, SplitsBalanceWavesAgainstTilesPerBlock) {
  using families::attention_decode_splits;
  // B1 H32/KV8 lq 1: 8 one-warp blocks, 3 a SM, 396 slots; 128 key tiles of 64. 43 splits give
  // 344 blocks of 3 tiles in one wave.
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 8, 1, 8192), 132), 43);
  // B8: 64 blocks; 6 splits are 384 blocks of 22 tiles in one wave.
  EXPECT_EQ(attention_decode_splits(decode(8, 32, 8, 1, 8192), 132), 6);
  EXPECT_EQ(attention_decode_splits(decode(8, 32, 8, 1, 32768), 132), 6);
  // B64: 512 blocks are 1.3 waves unsplit; 3 splits are 1536 blocks, 3.9 waves of 43 tiles.
  EXPECT_EQ(attention_decode_splits(decode(64, 32, 8, 1, 8192), 132), 3);
  // B256 at 8k keys: 2048 blocks, 5.2 waves unsplit; 4 splits fill 20.7 of 21 waves.
  EXPECT_EQ(attention_decode_splits(decode(256, 32, 8, 1, 8192), 132), 4);
  // No GQA, 4 queries: 32 blocks.
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 32, 4, 32768), 132), 12);
  // 16 queries x 8 heads = 128 packed rows: one 8-warp block per KV head, one a SM.
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 4, 16, 32768), 132), 32);
  // 511 keys are 8 tiles of 64: a tile a split.
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 8, 1, 511), 132), 8);
  // Head dim 256 takes 32-key tiles: 1000 keys are 32 tiles.
  EXPECT_EQ(attention_decode_splits(decode(1, 8, 8, 1, 1000, 256, 256), 132), 32);
  // The most splits.
  EXPECT_EQ(attention_decode_splits(decode(1, 1, 1, 1, 1 << 20), 132), families::k_attention_max_splits);
  // Unknown SM count: as an H100's 132.
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 8, 1, 8192), 0), 43);
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 8, 1, 8192), 16), 6);
}

TEST(AttentionDecodeHeuristic, OnePassOutsideShortQueriesAgainstLongKeys) {
  using families::attention_decode_splits;
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 8, 17, 8192), 132), 0);     // more than 16 queries
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 8, 4096, 4096), 132), 0);  // prefill
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 8, 1, 100), 132), 0);      // short keys
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 8, 1, 448), 132), 0);      // 7 tiles
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 8, 0, 8192), 132), 0);     // no query
  EXPECT_EQ(attention_decode_splits(decode(1, 32, 8, 1, 8192, 32, 32), 132), 0);  // no kernel
}

// No other split count gives fewer waves without more tiles a block, or fewer tiles a block
// without more waves: the choice is never beaten on both counts.
TEST(AttentionDecodeHeuristic, NoOtherSplitCountIsBetterOnWavesAndTilesAlike) {
  for (std::int64_t batch : {1, 2, 3, 8, 17, 64, 256})
    for (std::int64_t kv : {1, 2, 8, 32})
      for (std::int64_t group : {1, 4, 8})
        for (std::int64_t lq : {1, 4, 16})
          for (std::int64_t lk : {512, 4097, 32768, 131072})
            for (std::int64_t sms : {16, 108, 132}) {
              const auto a = decode(batch, kv * group, kv, lq, lk);
              const std::int64_t s = families::attention_decode_splits(a, sms, 90);
              SCOPED_TRACE(::testing::Message() << "B" << batch << " H" << kv * group << "/" << kv << " lq " << lq
                                                << " lk " << lk << " sms " << sms);
              const std::int64_t tiles = (lk + 63) / 64, rows = lq * group;
              const int warps = families::attention_splitkv_warps(rows);
              ASSERT_GE(s, 1);
              ASSERT_LE(s, std::min(tiles, families::k_attention_max_splits));
              const std::int64_t blocks = batch * kv * ((rows + 16 * warps - 1) / (16 * warps));
              const std::int64_t slots =
                  sms * families::attention_splitkv_blocks_per_sm(128, 128, warps, 64, 90,
                                                                  families::attention_splitkv_key_warps(warps, 64));
              auto waves = [&](std::int64_t n) { return (blocks * n + slots - 1) / slots; };
              auto per = [&](std::int64_t n) { return (tiles + n - 1) / n; };
              for (std::int64_t o = 1; o <= std::min(tiles, families::k_attention_max_splits); ++o) {
                const bool no_worse = waves(o) <= waves(s) && per(o) <= per(s);
                const bool better = waves(o) < waves(s) || per(o) < per(s);
                EXPECT_FALSE(no_worse && better) << o << " splits beat " << s;
              }
              if (blocks % slots == 0) {
                EXPECT_EQ(s, 1) << "whole waves unsplit";
              }
            }
}

TEST(AttentionDecodeHeuristic, WorkspaceAndWarps) {
  auto a = decode(8, 32, 8, 4, 8192, 192, 128);
  EXPECT_EQ(families::attention_splitkv_workspace_elements(a, 5), 5 * 32 * 32 * 129);
  a.varlen = 1;
  a.total_q = 19;  // packed: every query token, whatever the longest sequence
  EXPECT_EQ(families::attention_splitkv_workspace_elements(a, 3), 3 * 19 * 32 * 129);
  EXPECT_EQ(families::attention_splitkv_warps(1), 1);
  EXPECT_EQ(families::attention_splitkv_warps(16), 1);
  EXPECT_EQ(families::attention_splitkv_warps(17), 2);
  EXPECT_EQ(families::attention_splitkv_warps(64), 4);
  EXPECT_EQ(families::attention_splitkv_warps(65), 8);
  EXPECT_EQ(families::attention_splitkv_warps(1000), 8);
}

TEST(AttentionDecodeFamilies, GeometryAndHeuristicVariant) {
  const Family* split = Registry::global().find("attention_splitkv");
  const Family* combine = Registry::global().find("attention_combine");
  ASSERT_NE(split, nullptr);
  ASSERT_NE(combine, nullptr);
  const auto a = decode(3, 32, 8, 2, 8192);
  const Problem ps = Problem::of(DType::bf16, 16, families::attention_splitkv_problem(a, 7));
  const Params v = split->heuristic(ps);
  EXPECT_EQ(*v.get_int("warps"), 1);  // 2 queries x 4 heads
  EXPECT_EQ(*v.get_int("block_n"), 64);
  ASSERT_TRUE(split->check_problem(v, ps).ok());
  const LaunchGeometry g = split->geometry(v, ps);
  EXPECT_EQ(g.grid.x, 7u);
  EXPECT_EQ(g.grid.y, 8u);
  EXPECT_EQ(g.grid.z, 3u);
  EXPECT_EQ(g.block.x, 64u);  // one row warp, two key warps
  EXPECT_EQ(*v.get_int("key_warps"), 2);
  // 16 queries x 8 heads: 8 warps, one row block.
  const Problem p16 = Problem::of(DType::f16, 16, families::attention_splitkv_problem(decode(1, 64, 8, 16, 4096), 3));
  EXPECT_EQ(*split->heuristic(p16).get_int("warps"), 8);
  EXPECT_EQ(split->geometry(split->heuristic(p16), p16).grid.x, 3u);
  EXPECT_EQ(*split->heuristic(p16).get_int("key_warps"), 1);
  EXPECT_EQ(split->geometry(split->heuristic(p16), p16).block.x, 256u);
  // Key warps must split a tile into whole 16-key steps, and a block has at most 8 warps.
  EXPECT_EQ(split->validate(Params(v).set("block_n", std::int64_t(32)).set("key_warps", std::int64_t(4))).code(),
            Code::invalid_argument);
  EXPECT_EQ(split->validate(Params(v).set("warps", std::int64_t(8)).set("key_warps", std::int64_t(2))).code(),
            Code::invalid_argument);
  EXPECT_TRUE(split->validate(Params(v).set("key_warps", std::int64_t(4))).ok());
  // Forced 4 warps over 128 rows: two row blocks.
  Params w4 = split->heuristic(p16);
  w4.set("warps", std::int64_t(4));
  EXPECT_EQ(split->geometry(w4, p16).grid.x, 6u);
  const Problem pc = Problem::of(DType::bf16, 16, families::attention_combine_problem(a, 7));
  EXPECT_EQ(combine->geometry(combine->heuristic(pc), pc).grid.x, 3u * 2 * 32 / 4);
  EXPECT_EQ(combine->check_problem(combine->heuristic(pc), pc).code(), Code::ok);
  auto bad = families::attention_splitkv_problem(a, 0);
  EXPECT_EQ(split->check_problem(v, Problem::of(DType::bf16, 16, bad)).code(), Code::invalid_argument);
}

// A case for the chained references: per-sequence lengths (padded when one each and !varlen).
struct Chain {
  std::vector<std::int64_t> lq, lk;
  bool varlen = false;
  std::int64_t heads = 8, kv_heads = 2, d = 64, dv = 64;
  std::int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  std::int64_t warps = 1, block_n = 32;
};

// split's reference then combine's against attention's reference, all on f32 host buffers.
void check_chain(const Chain& c, std::int64_t splits) {
  SCOPED_TRACE(::testing::Message() << "splits " << splits << " warps " << c.warps << " block_n " << c.block_n
                                    << " window " << c.window_left << "," << c.window_right << " varlen "
                                    << c.varlen);
  const Family* one = Registry::global().find("attention");
  const Family* split = Registry::global().find("attention_splitkv");
  const Family* combine = Registry::global().find("attention_combine");
  ASSERT_TRUE(one && split && combine);
  AttentionProblem a;
  a.batch = std::int64_t(c.lq.size());
  std::vector<std::int32_t> cq{0}, ck{0};
  for (std::size_t b = 0; b < c.lq.size(); ++b) {
    a.seqlen_q = std::max(a.seqlen_q, c.lq[b]);
    a.seqlen_k = std::max(a.seqlen_k, c.lk[b]);
    cq.push_back(cq.back() + std::int32_t(c.lq[b]));
    ck.push_back(ck.back() + std::int32_t(c.lk[b]));
  }
  a.varlen = c.varlen;
  a.total_q = c.varlen ? cq.back() : a.batch * a.seqlen_q;
  a.total_k = c.varlen ? ck.back() : a.batch * a.seqlen_k;
  a.heads = c.heads;
  a.kv_heads = c.kv_heads;
  a.head_dim = c.d;
  a.head_dim_v = c.dv;
  a.window_left = c.window_left;
  a.window_right = c.window_right;
  a.causal = c.window_right == 0;
  a.softcap = c.softcap;
  a.scale = 1.0 / std::sqrt(double(c.d));
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.f, 1.f);
  auto rnd = [&](std::int64_t count) {
    std::vector<float> x(static_cast<std::size_t>(count));
    for (float& f : x) f = n(rng);
    return x;
  };
  const std::int64_t rows = a.total_q * a.heads, nan_bits = 0x7fc00000;
  auto q = rnd(rows * c.d), k = rnd(a.total_k * a.kv_heads * c.d), v = rnd(a.total_k * a.kv_heads * c.dv);
  auto poisoned = [&](std::int64_t count) {
    std::vector<float> x(static_cast<std::size_t>(count));
    for (float& f : x) std::memcpy(&f, &nan_bits, 4);
    return x;
  };
  std::vector<float> want = poisoned(rows * c.dv), want_lse = poisoned(rows);
  {
    const Problem p = Problem::of(DType::f32, 16, a);
    void* b[7] = {q.data(), k.data(), v.data(), cq.data(), ck.data(), want.data(), want_lse.data()};
    ASSERT_TRUE(one->cpu_reference(one->heuristic(p), p, b).ok());
  }
  std::vector<float> o_part = poisoned(splits * rows * c.dv), lse_part = poisoned(splits * rows);
  std::vector<float> got = poisoned(rows * c.dv), got_lse = poisoned(rows);
  const Problem ps = Problem::of(DType::f32, 16, families::attention_splitkv_problem(a, splits));
  const Params sv = Params{{"dtype", std::string("bf16")}, {"head_dim", c.d}, {"head_dim_v", c.dv},
                           {"warps", c.warps}, {"block_n", c.block_n}, {"key_warps", 1}};
  void* sb[7] = {q.data(), k.data(), v.data(), cq.data(), ck.data(), o_part.data(), lse_part.data()};
  ASSERT_TRUE(split->cpu_reference(sv, ps, sb).ok());
  const Problem pc = Problem::of(DType::f32, 16, families::attention_combine_problem(a, splits));
  void* cb[5] = {o_part.data(), lse_part.data(), cq.data(), got.data(), got_lse.data()};
  ASSERT_TRUE(combine->cpu_reference(combine->heuristic(pc), pc, cb).ok());
  // Every token of a sequence is written, the same elements on both sides.
  int bad = 0;
  for (std::int64_t i = 0; i < rows * c.dv && bad < 5; ++i) {
    const float g = got[std::size_t(i)], w = want[std::size_t(i)];
    if (std::isnan(g) != std::isnan(w) || (!std::isnan(w) && std::abs(g - w) > 2e-5f * std::max(1.0f, std::abs(w))))
      ++bad, ADD_FAILURE() << "out[" << i << "] = " << g << ", want " << w;
  }
  int masked = 0;
  for (std::int64_t i = 0; i < rows && bad < 5; ++i) {
    const float g = got_lse[std::size_t(i)], w = want_lse[std::size_t(i)];
    if (std::isinf(w)) ++masked;
    const bool same = std::isnan(w) ? std::isnan(g) : std::isinf(w) ? g == w : std::abs(g - w) <= 2e-5f * std::max(1.0f, std::abs(w));
    if (!same) ++bad, ADD_FAILURE() << "lse[" << i << "] = " << g << ", want " << w;
  }
  // An empty split writes zeros and -inf for its rows.
  for (std::int64_t i = 0; i < splits * rows; ++i) {
    if (!std::isinf(lse_part[std::size_t(i)])) continue;
    for (std::int64_t e = 0; e < c.dv; ++e) ASSERT_EQ(o_part[std::size_t(i * c.dv + e)], 0.0f);
  }
  (void)masked;
}

Chain padded(std::int64_t batch, std::int64_t heads, std::int64_t kv, std::int64_t lq, std::int64_t lk) {
  Chain c;
  c.lq.assign(std::size_t(batch), lq);
  c.lk.assign(std::size_t(batch), lk);
  c.heads = heads;
  c.kv_heads = kv;
  return c;
}

TEST(AttentionDecodeReference, SplitsMergeToTheOnePassResult) {
  for (std::int64_t splits : {1, 2, 3, 7})
    for (std::int64_t group : {1, 4, 8})
      for (std::int64_t lq : {1, 4, 16})
        for (std::int64_t lk : {1, 100, 301}) {
          Chain c = padded(2, 2 * group, 2, lq, lk);
          c.warps = families::attention_splitkv_warps(lq * group);
          check_chain(c, splits);
        }
}

TEST(AttentionDecodeReference, MasksThatEmptyWholeSplits) {
  for (std::int64_t splits : {2, 3, 7}) {
    // Causal with more queries than keys: the first rows see nothing.
    Chain c = padded(1, 8, 2, 16, 10);
    c.window_right = 0;
    c.warps = 2;
    check_chain(c, splits);
    // Causal decode: row blocks whose last rows see more keys than their first.
    c = padded(2, 8, 1, 16, 300);
    c.window_right = 0;
    c.warps = 4;  // 128 packed rows over two row blocks
    check_chain(c, splits);
    // A narrow window: splits far from the diagonal see nothing; the left edge inside a split.
    c = padded(1, 8, 2, 4, 400);
    c.window_left = 40;
    c.window_right = 0;
    c.warps = 1;
    check_chain(c, splits);
    c.window_left = 3;
    c.window_right = 5;
    c.softcap = 7.5;
    check_chain(c, splits);
    // Window (0, 0) with more queries than keys.
    c = padded(1, 4, 4, 16, 8);
    c.window_left = c.window_right = 0;
    check_chain(c, splits);
    // block_n 64 and 128.
    c = padded(1, 8, 2, 3, 700);
    c.window_left = 100;
    c.block_n = 64;
    check_chain(c, splits);
    c.block_n = 128;
    c.window_right = 0;
    check_chain(c, splits);
  }
}

TEST(AttentionDecodeReference, PackedSequencesOfUnevenLengths) {
  for (std::int64_t splits : {1, 2, 3, 7}) {
    Chain c;
    c.varlen = true;
    c.lq = {1, 16, 0, 4, 3};
    c.lk = {300, 17, 5, 0, 129};
    c.heads = 8;
    c.kv_heads = 2;
    c.warps = 4;
    check_chain(c, splits);
    c.window_right = 0;
    check_chain(c, splits);
    c.window_left = 20;
    check_chain(c, splits);
  }
}

TEST(AttentionDecodeFamilies, BenchmarkProblemsLeaveNoSplitEmpty) {
  const Family* split = Registry::global().find("attention_splitkv");
  ASSERT_NE(split, nullptr);
  for (DType t : {DType::bf16, DType::f16})
    for (const Problem& p : split->benchmark_problems(t)) {
      const auto a = p.as<families::AttentionSplitKvProblem>();
      const Params v = split->heuristic(p);
      const std::int64_t bn = *v.get_int("block_n"), tiles = (a.seqlen_k + bn - 1) / bn;
      const std::int64_t per = (tiles + a.splits - 1) / a.splits;
      EXPECT_LT((a.splits - 1) * per, tiles) << split->signature(p);
      EXPECT_EQ(a.window_left, -1);
      EXPECT_EQ(a.window_right, -1);
    }
}

}  // namespace
}  // namespace kiln
