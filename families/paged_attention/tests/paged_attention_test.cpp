// The paged cache's ops on host tensors (their fp64 references) against independent computations
// written here: reshape_and_cache against a slot-by-slot copy (fp8 codes against common/fp8.h),
// copy_blocks against memcpy, merge_state against the merge of two halves of a softmax computed
// in full, paged_decode against attention_varlen over the keys gathered from the pages (every
// page size, GQA, several queries with causal and window masks, softcap, chunked prefill), the
// paged_decode family's split reference merged by attention_combine against the op, the cascade
// (its composition and its op) against the whole context, KVCacheManager's slots, copies and
// tables driving the ops through a fork, the plans, every typed error before launch, and the
// declarations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/fp8.h"
#include "common/half.h"
#include "families/attention/attention_splitkv.h"
#include "families/attention/ops.h"
#include "families/paged_attention/ops.h"
#include "families/paged_attention/paged_attention.h"
#include "kiln/family.h"
#include "kiln/kv_cache.h"
#include "kiln/op.h"

namespace kiln {
namespace {

struct HostTensor {
  std::vector<unsigned char> bytes;
  TensorView view;
  HostTensor(DType t, std::vector<std::int64_t> shape) {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    bytes.assign(std::size_t(std::max<std::int64_t>(n, 1)) * dtype_size(t), 0);
    view.data = bytes.data();
    view.dtype = t;
    view.rank = int(shape.size());
    std::int64_t stride = 1;
    for (int i = view.rank - 1; i >= 0; --i) {
      view.shape[i] = shape[std::size_t(i)];
      view.strides[i] = stride;
      stride *= shape[std::size_t(i)];
    }
    view.device = Device::cpu();
  }
  double at(std::int64_t i) const { return load_as_double(bytes.data(), view.dtype, i); }
  void set(std::int64_t i, double v) { store_from_double(bytes.data(), view.dtype, i, v); }
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(bytes.data());
  }
  std::int64_t numel() const { return view.numel(); }
};

void fill_random(HostTensor& t, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, d(rng));
}

// ---- reshape_and_cache ----

TEST(ReshapeAndCache, WritesEachTokenToItsSlotAndSkipsNegativeSlots) {
  std::mt19937 rng(1);
  for (DType t : {DType::f32, DType::bf16}) {
    for (DType index : {DType::i32, DType::i64}) {
      const std::int64_t tokens = 7, hk = 2, d = 16, blocks = 5, page = 8;
      // key is a slice of a wider [tokens, 3 * hk * d] buffer (fused qkv): rows at a stride.
      HostTensor wide(t, {tokens, 3 * hk * d}), value(t, {tokens, hk, d});
      fill_random(wide, rng);
      fill_random(value, rng);
      TensorView key = wide.view;
      key.rank = 3;
      key.shape[0] = tokens;
      key.shape[1] = hk;
      key.shape[2] = d;
      key.strides[0] = 3 * hk * d;
      key.strides[1] = d;
      key.strides[2] = 1;
      key.data = wide.bytes.data() + std::size_t(hk * d) * dtype_size(t);  // the k columns
      HostTensor slots(index, {tokens}), kc(t, {blocks, page, hk, d}), vc(t, {blocks, page, hk, d});
      const std::int64_t slot_of[tokens] = {3, 39, -1, 0, 17, 8, 22};
      for (std::int64_t i = 0; i < tokens; ++i) slots.set(i, double(slot_of[i]));
      for (std::int64_t i = 0; i < kc.numel(); ++i) kc.set(i, 1024.0), vc.set(i, 1024.0);
      ASSERT_TRUE(reshape_and_cache(key, value.view, slots.view, kc.view, vc.view).ok());
      std::vector<char> written(std::size_t(blocks * page), 0);
      for (std::int64_t i = 0; i < tokens; ++i) {
        if (slot_of[i] < 0) continue;
        written[std::size_t(slot_of[i])] = 1;
        for (std::int64_t c = 0; c < hk * d; ++c) {
          EXPECT_EQ(kc.at(slot_of[i] * hk * d + c), wide.at(i * 3 * hk * d + hk * d + c));
          EXPECT_EQ(vc.at(slot_of[i] * hk * d + c), value.at(i * hk * d + c));
        }
      }
      for (std::int64_t s = 0; s < blocks * page; ++s) {
        if (!written[std::size_t(s)]) {
          EXPECT_EQ(kc.at(s * hk * d), 1024.0) << "slot " << s << " was not written to";
        }
      }
    }
  }
}

TEST(ReshapeAndCache, Fp8CachesHoldE4m3OfValueOverScale) {
  std::mt19937 rng(2);
  const std::int64_t tokens = 5, hk = 2, d = 32, blocks = 4, page = 16;
  HostTensor key(DType::bf16, {tokens, hk, d}), value(DType::bf16, {tokens, hk, d}), slots(DType::i64, {tokens});
  fill_random(key, rng, 3.0);
  fill_random(value, rng, 500.0);  // past 448 * scale: saturates
  for (std::int64_t i = 0; i < tokens; ++i) slots.set(i, double(i * 13));
  HostTensor kc(DType::u8, {blocks, page, hk, d}), vc(DType::u8, {blocks, page, hk, d});
  HostTensor ks(DType::f32, {1}), vs(DType::f32, {1});
  ks.set(0, 0.05);  // keys within +-22.4: no saturation
  vs.set(0, 0.5);
  ASSERT_TRUE(reshape_and_cache(key.view, value.view, slots.view, kc.view, vc.view, &ks.view, &vs.view).ok());
  for (std::int64_t i = 0; i < tokens; ++i)
    for (std::int64_t c = 0; c < hk * d; ++c) {
      const std::int64_t at = i * 13 * hk * d + c;
      EXPECT_EQ(kc.as<std::uint8_t>()[at], float_to_e4m3(float(key.at(i * hk * d + c)) / 0.05f));
      EXPECT_EQ(vc.as<std::uint8_t>()[at], float_to_e4m3(float(value.at(i * hk * d + c)) / 0.5f));
      const double back = e4m3_to_float(kc.as<std::uint8_t>()[at]) * 0.05;
      EXPECT_NEAR(back, key.at(i * hk * d + c), std::abs(key.at(i * hk * d + c)) / 16 + 0.05 / 512);
    }
}

TEST(ReshapeAndCache, TypedErrors) {
  HostTensor key(DType::bf16, {3, 2, 16}), value(DType::bf16, {3, 2, 16}), slots(DType::i32, {3});
  HostTensor kc(DType::bf16, {2, 8, 2, 16}), vc(DType::bf16, {2, 8, 2, 16});
  slots.set(0, 0), slots.set(1, 1), slots.set(2, 16);  // 16 slots: 16 is past the cache
  EXPECT_EQ(reshape_and_cache(key.view, value.view, slots.view, kc.view, vc.view).code(), Code::invalid_argument);
  slots.set(2, 15);
  EXPECT_TRUE(reshape_and_cache(key.view, value.view, slots.view, kc.view, vc.view).ok());
  HostTensor f16c(DType::f16, {2, 8, 2, 16});
  EXPECT_EQ(reshape_and_cache(key.view, value.view, slots.view, f16c.view, f16c.view).code(), Code::unsupported_dtype);
  HostTensor u8c(DType::u8, {2, 8, 2, 16}), u8v(DType::u8, {2, 8, 2, 16});
  EXPECT_EQ(reshape_and_cache(key.view, value.view, slots.view, u8c.view, u8v.view).code(), Code::invalid_argument)
      << "an fp8 cache needs its scales";
  HostTensor odd(DType::bf16, {2, 7, 2, 16}), odd_v(DType::bf16, {2, 7, 2, 16});
  EXPECT_EQ(reshape_and_cache(key.view, value.view, slots.view, odd.view, odd_v.view).code(), Code::invalid_argument)
      << "page size 7";
  HostTensor wrong_heads(DType::bf16, {2, 8, 4, 16}), wrong_heads_v(DType::bf16, {2, 8, 4, 16});
  EXPECT_EQ(reshape_and_cache(key.view, value.view, slots.view, wrong_heads.view, wrong_heads_v.view).code(),
            Code::shape_mismatch);
  HostTensor short_slots(DType::i32, {2});
  EXPECT_EQ(reshape_and_cache(key.view, value.view, short_slots.view, kc.view, vc.view).code(), Code::shape_mismatch);
  HostTensor float_slots(DType::f32, {3});
  EXPECT_EQ(reshape_and_cache(key.view, value.view, float_slots.view, kc.view, vc.view).code(), Code::unsupported_dtype);
}

// ---- copy_blocks ----

TEST(CopyBlocks, CopiesBothCachesAndChecksThePairs) {
  std::mt19937 rng(3);
  for (DType index : {DType::i32, DType::i64}) {
    HostTensor kc(DType::f16, {6, 8, 2, 16}), vc(DType::f16, {6, 8, 2, 16});
    fill_random(kc, rng);
    fill_random(vc, rng);
    const auto k0 = kc.bytes, v0 = vc.bytes;
    HostTensor pairs(index, {2, 2});
    pairs.set(0, 1), pairs.set(1, 4), pairs.set(2, 2), pairs.set(3, 5);
    ASSERT_TRUE(copy_blocks(kc.view, vc.view, pairs.view).ok());
    const std::size_t block = 8 * 2 * 16 * 2;
    for (auto [s, d] : {std::pair{1, 4}, std::pair{2, 5}}) {
      EXPECT_EQ(0, std::memcmp(kc.bytes.data() + d * block, k0.data() + s * block, block));
      EXPECT_EQ(0, std::memcmp(vc.bytes.data() + d * block, v0.data() + s * block, block));
    }
    EXPECT_EQ(0, std::memcmp(kc.bytes.data(), k0.data(), 4 * block)) << "blocks 0-3 unchanged";
    pairs.set(3, 6);
    EXPECT_EQ(copy_blocks(kc.view, vc.view, pairs.view).code(), Code::invalid_argument) << "block 6 is past the pool";
    pairs.set(3, 4);
    EXPECT_EQ(copy_blocks(kc.view, vc.view, pairs.view).code(), Code::invalid_argument) << "dst 4 twice";
    pairs.set(3, 1);
    EXPECT_EQ(copy_blocks(kc.view, vc.view, pairs.view).code(), Code::invalid_argument) << "1 -> 4 and 2 -> 1 chain";
    HostTensor flat(index, {4});
    EXPECT_EQ(copy_blocks(kc.view, vc.view, flat.view).code(), Code::shape_mismatch);
  }
}

// ---- merge_state ----

// Softmax attention of one query row over n keys in fp64 (scores and values given): out and lse.
double attend(const std::vector<double>& s, const std::vector<std::vector<double>>& v, std::size_t lo, std::size_t hi,
              std::vector<double>& out) {
  out.assign(v.empty() ? 0 : v[0].size(), 0.0);
  if (lo >= hi) return -std::numeric_limits<double>::infinity();
  double mx = -std::numeric_limits<double>::infinity(), sum = 0;
  for (std::size_t j = lo; j < hi; ++j) mx = std::max(mx, s[j]);
  for (std::size_t j = lo; j < hi; ++j) {
    const double w = std::exp(s[j] - mx);
    sum += w;
    for (std::size_t c = 0; c < out.size(); ++c) out[c] += w * v[j][c];
  }
  for (double& x : out) x /= sum;
  return mx + std::log(sum);
}

TEST(MergeState, TwoHalvesMergeIntoTheWholeSoftmax) {
  std::mt19937 rng(4);
  std::normal_distribution<double> nd(0, 2);
  const std::int64_t tokens = 3, heads = 4, d = 16, keys = 20;
  HostTensor va(DType::f32, {tokens, heads, d}), vb(DType::f32, {tokens, heads, d}), vo(DType::f32, {tokens, heads, d});
  HostTensor sa(DType::f32, {tokens, heads}), sb(DType::f32, {tokens, heads}), so(DType::f32, {tokens, heads});
  std::vector<std::vector<double>> whole(std::size_t(tokens * heads));
  for (std::int64_t r = 0; r < tokens * heads; ++r) {
    std::vector<double> s(keys);
    std::vector<std::vector<double>> v(keys, std::vector<double>(d));
    for (auto& x : s) x = nd(rng);
    for (auto& row : v)
      for (auto& x : row) x = nd(rng);
    // Row 0 splits nothing off to b (b empty), row 1 nothing to a, the rest at a row-dependent key.
    const std::size_t cut = r == 0 ? keys : r == 1 ? 0 : std::size_t(3 + r % 11);
    std::vector<double> oa, ob;
    const double la = attend(s, v, 0, cut, oa), lb = attend(s, v, cut, keys, ob);
    attend(s, v, 0, keys, whole[std::size_t(r)]);
    for (std::int64_t c = 0; c < d; ++c) va.set(r * d + c, oa[std::size_t(c)]), vb.set(r * d + c, ob[std::size_t(c)]);
    sa.set(r, la);
    sb.set(r, lb);
  }
  ASSERT_TRUE(merge_state(va.view, sa.view, vb.view, sb.view, vo.view, so.view).ok());
  for (std::int64_t r = 0; r < tokens * heads; ++r)
    for (std::int64_t c = 0; c < d; ++c) EXPECT_NEAR(vo.at(r * d + c), whole[std::size_t(r)][std::size_t(c)], 1e-5);
  // In place: (va, sa) becomes the same merge.
  ASSERT_TRUE(merge_state_in_place(va.view, sa.view, vb.view, sb.view).ok());
  EXPECT_EQ(va.bytes, vo.bytes);
  EXPECT_EQ(sa.bytes, so.bytes);
  // Both empty: zeros and -inf.
  sa.set(0, -INFINITY);
  sb.set(0, -INFINITY);
  ASSERT_TRUE(merge_state(va.view, sa.view, vb.view, sb.view, vo.view, so.view).ok());
  EXPECT_EQ(so.at(0), -INFINITY);
  EXPECT_EQ(vo.at(0), 0.0);
}

TEST(MergeState, TypedErrors) {
  HostTensor v(DType::bf16, {2, 4, 16}), s(DType::f32, {2, 4}), v3(DType::bf16, {3, 4, 16}), s16(DType::bf16, {2, 4});
  EXPECT_EQ(merge_state(v.view, s.view, v3.view, s.view, v.view, s.view).code(), Code::shape_mismatch);
  EXPECT_EQ(merge_state(v.view, s16.view, v.view, s.view, v.view, s.view).code(), Code::unsupported_dtype);
  HostTensor vf(DType::f16, {2, 4, 16});
  EXPECT_EQ(merge_state(v.view, s.view, vf.view, s.view, v.view, s.view).code(), Code::unsupported_dtype);
}

// ---- paged_decode ----

struct PagedCase {
  DType dtype = DType::f32;
  std::int64_t heads = 8, kv_heads = 2, d = 32, page = 16;
  std::vector<std::int64_t> lq, lk;  // per request
  bool causal = false;
  std::int64_t window_left = -1;
  double softcap = 0;
};

// A random pool with each request's blocks scattered through it (shuffled ids), a padded table.
struct PagedData {
  HostTensor q, kc, vc, tables, lens, cu_q;
  std::int64_t batch, max_blocks, num_blocks, total_q;
  PagedData(const PagedCase& c, std::mt19937& rng)
      : q(c.dtype, {1}), kc(c.dtype, {1}), vc(c.dtype, {1}), tables(DType::i32, {1}), lens(DType::i32, {1}),
        cu_q(DType::i32, {1}) {
    batch = std::int64_t(c.lq.size());
    max_blocks = 1;
    total_q = 0;
    std::int64_t used = 0;
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t nb = (c.lk[std::size_t(b)] + c.page - 1) / c.page;
      max_blocks = std::max(max_blocks, nb + 1);  // a spare column of padding
      used += nb;
      total_q += c.lq[std::size_t(b)];
    }
    num_blocks = used + 3;
    q = HostTensor(c.dtype, {total_q, c.heads, c.d});
    kc = HostTensor(c.dtype, {num_blocks, c.page, c.kv_heads, c.d});
    vc = HostTensor(c.dtype, {num_blocks, c.page, c.kv_heads, c.d});
    tables = HostTensor(DType::i32, {batch, max_blocks});
    lens = HostTensor(DType::i32, {batch});
    cu_q = HostTensor(DType::i32, {batch + 1});
    fill_random(q, rng);
    fill_random(kc, rng);
    fill_random(vc, rng);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::size_t next = 0;
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t nb = (c.lk[std::size_t(b)] + c.page - 1) / c.page;
      for (std::int64_t j = 0; j < max_blocks; ++j)
        tables.as<std::int32_t>()[b * max_blocks + j] = j < nb ? ids[next++] : -7;  // padding past the context
      lens.as<std::int32_t>()[b] = std::int32_t(c.lk[std::size_t(b)]);
      cu_q.as<std::int32_t>()[b + 1] = cu_q.as<std::int32_t>()[b] + std::int32_t(c.lq[std::size_t(b)]);
    }
  }
};

// paged_decode on the host against attention_varlen over the gathered keys (lse transposed).
void check_against_varlen(const PagedCase& c, unsigned seed) {
  SCOPED_TRACE("page " + std::to_string(c.page) + " heads " + std::to_string(c.heads) + "/" +
               std::to_string(c.kv_heads) + " causal " + std::to_string(c.causal) + " window " +
               std::to_string(c.window_left) + " softcap " + std::to_string(c.softcap));
  std::mt19937 rng(seed);
  PagedData p(c, rng);
  const std::int64_t row = c.kv_heads * c.d;
  std::int64_t total_k = 0;
  for (auto l : c.lk) total_k += l;
  HostTensor k(c.dtype, {total_k, c.kv_heads, c.d}), v(c.dtype, {total_k, c.kv_heads, c.d}), cu_k(DType::i32, {p.batch + 1});
  const std::size_t es = dtype_size(c.dtype);
  std::int64_t at = 0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t j = 0; j < c.lk[std::size_t(b)]; ++j, ++at) {
      const std::int64_t slot = std::int64_t(p.tables.as<std::int32_t>()[b * p.max_blocks + j / c.page]) * c.page + j % c.page;
      std::memcpy(k.bytes.data() + at * row * es, p.kc.bytes.data() + slot * row * es, row * es);
      std::memcpy(v.bytes.data() + at * row * es, p.vc.bytes.data() + slot * row * es, row * es);
    }
    cu_k.as<std::int32_t>()[b + 1] = std::int32_t(at);
  }
  const bool one_query = std::all_of(c.lq.begin(), c.lq.end(), [](auto l) { return l == 1; });
  HostTensor out(c.dtype, {p.total_q, c.heads, c.d}), lse(DType::f32, {p.total_q, c.heads});
  HostTensor want(c.dtype, {p.total_q, c.heads, c.d}), want_lse(DType::f32, {c.heads, p.total_q});
  PagedDecodeOptions o;
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.softcap = c.softcap;
  o.max_seqlen_q = *std::max_element(c.lq.begin(), c.lq.end());
  const Status s = paged_decode(p.q.view, p.kc.view, p.vc.view, p.tables.view, p.lens.view, one_query ? nullptr : &p.cu_q.view,
                                out.view, &lse.view, nullptr, o);
  ASSERT_TRUE(s.ok()) << s.to_string();
  AttentionOptions ao;
  ao.causal = c.causal;
  ao.window_left = c.window_left;
  ao.softcap = c.softcap;
  const Status w = attention_varlen(p.q.view, k.view, v.view, p.cu_q.view, cu_k.view, want.view, &want_lse.view,
                                    o.max_seqlen_q, *std::max_element(c.lk.begin(), c.lk.end()), ao);
  ASSERT_TRUE(w.ok()) << w.to_string();
  const double tol = c.dtype == DType::f32 ? 1e-5 : 1e-2;
  for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_NEAR(out.at(i), want.at(i), tol) << "element " << i;
  for (std::int64_t t = 0; t < p.total_q; ++t)
    for (std::int64_t h = 0; h < c.heads; ++h) {
      const double g = lse.at(t * c.heads + h), e = want_lse.at(h * p.total_q + t);
      if (std::isinf(e)) EXPECT_EQ(g, e);
      else EXPECT_NEAR(g, e, 1e-4);
    }
}

TEST(PagedDecode, MatchesAttentionOverTheGatheredKeysAtEveryPageSize) {
  unsigned seed = 10;
  for (std::int64_t page : {1, 8, 16, 32, 64, 128}) {
    PagedCase c;
    c.page = page;
    c.lq = {1, 1, 1};
    c.lk = {1, 37, 130};
    check_against_varlen(c, seed++);
  }
}

TEST(PagedDecode, GqaMultiQueryMasksAndSoftcap) {
  unsigned seed = 20;
  for (auto [heads, kv] : {std::pair{4, 4}, std::pair{8, 2}, std::pair{8, 1}}) {
    PagedCase c;
    c.heads = heads;
    c.kv_heads = kv;
    c.page = 8;
    c.lq = {3, 1, 16, 2};
    c.lk = {20, 9, 40, 2};
    c.causal = true;
    check_against_varlen(c, seed++);
    c.window_left = 5;
    check_against_varlen(c, seed++);
    c.causal = false;
    c.window_left = -1;
    c.softcap = 3.0;
    check_against_varlen(c, seed++);
  }
  PagedCase c;
  c.dtype = DType::bf16;
  c.lq = {2, 4};
  c.lk = {0, 33};  // an empty context: zeros and lse -inf
  check_against_varlen(c, seed++);
}

// Chunked prefill: long query runs appended to a paged context (and a whole prompt, lq == lk),
// causal with respect to each request's keys.
TEST(PagedDecode, ChunkedPrefillOverPagedContext) {
  unsigned seed = 60;
  for (std::int64_t page : {1, 16, 128}) {
    PagedCase c;
    c.page = page;
    c.lq = {100, 37, 1};
    c.lk = {300, 37, 50};
    c.causal = true;
    check_against_varlen(c, seed++);
  }
}

// The GPU's reference: the paged_decode family's partials (the split kernel's row blocks and key
// ranges over the pages) merged by attention_combine's reference equal the op.
TEST(PagedDecode, FamilyReferenceMergedEqualsTheOp) {
  std::mt19937 rng(30);
  PagedCase c;
  c.dtype = DType::bf16;
  c.d = 64;
  c.page = 16;
  c.lq = {1, 1, 1};
  c.lk = {300, 5, 129};
  PagedData p(c, rng);
  const Family* f = Registry::global().find("paged_decode");
  const Family* comb = Registry::global().find("attention_combine");
  ASSERT_TRUE(f && comb);
  for (std::int64_t splits : {1, 3, 7}) {
    families::PagedDecodeProblem a;
    a.batch = p.batch;
    a.seqlen_q = 1;
    a.max_seq_len = 300;
    a.total_q = p.total_q;
    a.heads = c.heads;
    a.kv_heads = c.kv_heads;
    a.head_dim = c.d;
    a.num_blocks = p.num_blocks;
    a.page_size = c.page;
    a.max_blocks = p.max_blocks;
    a.splits = splits;
    a.scale = 1.0 / std::sqrt(double(c.d));
    const Problem prob = Problem::of(c.dtype, 16, a);
    const Params v = f->heuristic(prob);
    ASSERT_TRUE(f->check_problem(v, prob).ok());
    std::vector<float> o_part(std::size_t(splits * p.total_q * c.heads * c.d)), l_part(std::size_t(splits * p.total_q * c.heads));
    void* b[8] = {p.q.bytes.data(), p.kc.bytes.data(), p.vc.bytes.data(), p.cu_q.bytes.data(), p.tables.bytes.data(),
                  p.lens.bytes.data(), o_part.data(), l_part.data()};
    ASSERT_TRUE(f->cpu_reference(v, prob, b).ok());
    HostTensor out(c.dtype, {p.total_q, c.heads, c.d}), lse(DType::f32, {p.total_q, c.heads});
    const Problem pc = Problem::of(c.dtype, 16,
                                   families::AttentionCombineProblem{.batch = p.batch,
                                                                     .seqlen_q = 1,
                                                                     .total_q = p.total_q,
                                                                     .heads = c.heads,
                                                                     .head_dim_v = c.d,
                                                                     .varlen = 0,
                                                                     .splits = splits,
                                                                     .lse_token_major = 1});
    void* cb[5] = {o_part.data(), l_part.data(), nullptr, out.bytes.data(), lse.bytes.data()};
    ASSERT_TRUE(comb->cpu_reference(comb->heuristic(pc), pc, cb).ok());
    HostTensor want(c.dtype, {p.total_q, c.heads, c.d}), want_lse(DType::f32, {p.total_q, c.heads});
    ASSERT_TRUE(paged_decode(p.q.view, p.kc.view, p.vc.view, p.tables.view, p.lens.view, nullptr, want.view,
                             &want_lse.view, nullptr)
                    .ok());
    for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_NEAR(out.at(i), want.at(i), 1e-2) << "splits " << splits;
    for (std::int64_t i = 0; i < lse.numel(); ++i) ASSERT_NEAR(lse.at(i), want_lse.at(i), 1e-4) << "splits " << splits;
  }
}

// Cascade: a shared prefix attended once as one multi-query sequence (every request's query over
// the prefix's blocks), each request's own keys apart, merged by lse: the same as attending the
// prefix and the own keys together.
TEST(PagedDecode, SharedPrefixMergedWithOwnKeysEqualsTheWholeContext) {
  std::mt19937 rng(40);
  const std::int64_t batch = 5, heads = 8, hk = 2, d = 32, page = 8, prefix = 24, own[batch] = {1, 9, 16, 3, 30};
  const DType t = DType::f32;
  const std::int64_t own_blocks = 4, prefix_blocks = prefix / page, num_blocks = prefix_blocks + batch * own_blocks;
  HostTensor kc(t, {num_blocks, page, hk, d}), vc(t, {num_blocks, page, hk, d}), q(t, {batch, heads, d});
  fill_random(kc, rng);
  fill_random(vc, rng);
  fill_random(q, rng);
  // Full tables: the prefix's blocks then the request's own.
  const std::int64_t full_cols = prefix_blocks + own_blocks;
  HostTensor full(DType::i32, {batch, full_cols}), full_lens(DType::i32, {batch});
  HostTensor own_t(DType::i32, {batch, own_blocks}), own_lens(DType::i32, {batch});
  HostTensor pre_t(DType::i32, {1, prefix_blocks}), pre_len(DType::i32, {1}), pre_cu(DType::i32, {2});
  for (std::int64_t j = 0; j < prefix_blocks; ++j) pre_t.as<std::int32_t>()[j] = std::int32_t(j);
  pre_len.as<std::int32_t>()[0] = prefix;
  pre_cu.as<std::int32_t>()[1] = batch;
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t j = 0; j < prefix_blocks; ++j) full.as<std::int32_t>()[b * full_cols + j] = std::int32_t(j);
    for (std::int64_t j = 0; j < own_blocks; ++j) {
      const auto id = std::int32_t(prefix_blocks + b * own_blocks + j);
      full.as<std::int32_t>()[b * full_cols + prefix_blocks + j] = id;
      own_t.as<std::int32_t>()[b * own_blocks + j] = id;
    }
    full_lens.as<std::int32_t>()[b] = std::int32_t(prefix + own[b]);
    own_lens.as<std::int32_t>()[b] = std::int32_t(own[b]);
  }
  HostTensor want(t, {batch, heads, d}), got(t, {batch, heads, d}), own_out(t, {batch, heads, d});
  HostTensor lse(DType::f32, {batch, heads}), own_lse(DType::f32, {batch, heads});
  ASSERT_TRUE(paged_decode(q.view, kc.view, vc.view, full.view, full_lens.view, nullptr, want.view, nullptr, nullptr).ok());
  // The prefix: one request whose `batch` queries are every request's query, no mask.
  PagedDecodeOptions po;
  po.max_seqlen_q = batch;
  ASSERT_TRUE(paged_decode(q.view, kc.view, vc.view, pre_t.view, pre_len.view, &pre_cu.view, got.view, &lse.view, nullptr, po).ok());
  ASSERT_TRUE(paged_decode(q.view, kc.view, vc.view, own_t.view, own_lens.view, nullptr, own_out.view, &own_lse.view, nullptr).ok());
  ASSERT_TRUE(merge_state_in_place(got.view, lse.view, own_out.view, own_lse.view).ok());
  for (std::int64_t i = 0; i < want.numel(); ++i) ASSERT_NEAR(got.at(i), want.at(i), 1e-5);
  // The cascade op's host reference: the same.
  HostTensor pre_flat(DType::i32, {prefix_blocks}), cascade(t, {batch, heads, d}), cascade_lse(DType::f32, {batch, heads});
  std::memcpy(pre_flat.bytes.data(), pre_t.bytes.data(), pre_t.bytes.size());
  ASSERT_TRUE(paged_cascade_decode(q.view, kc.view, vc.view, pre_flat.view, pre_len.view, own_t.view, own_lens.view,
                                   cascade.view, &cascade_lse.view, nullptr)
                  .ok());
  for (std::int64_t i = 0; i < want.numel(); ++i) ASSERT_NEAR(cascade.at(i), want.at(i), 1e-5);
  for (std::int64_t i = 0; i < lse.numel(); ++i) ASSERT_NEAR(cascade_lse.at(i), lse.at(i), 1e-5);
}

// A prefix that ends inside a block: the own keys start a fresh table, so the cascade's context is
// the prefix's 21 keys then the request's own; against attention_varlen over those keys gathered.
TEST(PagedCascadeDecode, PrefixEndingInsideABlock) {
  std::mt19937 rng(41);
  const std::int64_t batch = 3, heads = 4, hk = 2, d = 16, page = 8, prefix = 21, blocks = 3 + batch * 2;
  const DType t = DType::f32;
  HostTensor kc(t, {blocks, page, hk, d}), vc(t, {blocks, page, hk, d}), q(t, {batch, heads, d});
  fill_random(kc, rng);
  fill_random(vc, rng);
  fill_random(q, rng);
  HostTensor shared(DType::i32, {3}), shared_len(DType::i32, {1}), tables(DType::i32, {batch, 2}), lens(DType::i32, {batch});
  const std::int32_t shared_ids[3] = {7, 2, 5};
  std::memcpy(shared.bytes.data(), shared_ids, sizeof(shared_ids));
  shared_len.as<std::int32_t>()[0] = std::int32_t(prefix);
  const std::int32_t own_ids[batch * 2] = {0, 1, 3, 4, 6, 8}, own_lens[batch] = {9, 1, 16};
  std::memcpy(tables.bytes.data(), own_ids, sizeof(own_ids));
  std::memcpy(lens.bytes.data(), own_lens, sizeof(own_lens));
  HostTensor got(t, {batch, heads, d});
  ASSERT_TRUE(paged_cascade_decode(q.view, kc.view, vc.view, shared.view, shared_len.view, tables.view, lens.view,
                                   got.view, nullptr, nullptr)
                  .ok());
  const std::int64_t row = hk * d;
  for (std::int64_t b = 0; b < batch; ++b) {
    std::vector<std::int64_t> slots;
    for (std::int64_t j = 0; j < prefix; ++j) slots.push_back(shared_ids[j / page] * page + j % page);
    for (std::int64_t j = 0; j < own_lens[b]; ++j) slots.push_back(own_ids[b * 2 + j / page] * page + j % page);
    const std::int64_t lk = std::int64_t(slots.size());
    HostTensor k(t, {lk, hk, d}), v(t, {lk, hk, d}), cq(DType::i32, {2}), ck(DType::i32, {2}), want(t, {1, heads, d});
    for (std::int64_t j = 0; j < lk; ++j) {
      std::memcpy(k.bytes.data() + j * row * 4, kc.bytes.data() + slots[std::size_t(j)] * row * 4, row * 4);
      std::memcpy(v.bytes.data() + j * row * 4, vc.bytes.data() + slots[std::size_t(j)] * row * 4, row * 4);
    }
    cq.as<std::int32_t>()[1] = 1;
    ck.as<std::int32_t>()[1] = std::int32_t(lk);
    TensorView qb = q.view;
    qb.shape[0] = 1;
    qb.data = q.bytes.data() + b * heads * d * 4;
    ASSERT_TRUE(attention_varlen(qb, k.view, v.view, cq.view, ck.view, want.view, nullptr, 1, lk).ok());
    for (std::int64_t i = 0; i < heads * d; ++i) ASSERT_NEAR(got.at(b * heads * d + i), want.at(i), 1e-5) << b;
  }
  // Typed errors: the prefix's table past the pool, the prefix past its table.
  shared.as<std::int32_t>()[2] = std::int32_t(blocks);
  EXPECT_EQ(paged_cascade_decode(q.view, kc.view, vc.view, shared.view, shared_len.view, tables.view, lens.view,
                                 got.view, nullptr, nullptr)
                .code(),
            Code::invalid_argument);
  shared.as<std::int32_t>()[2] = 5;
  shared_len.as<std::int32_t>()[0] = 25;
  EXPECT_EQ(paged_cascade_decode(q.view, kc.view, vc.view, shared.view, shared_len.view, tables.view, lens.view,
                                 got.view, nullptr, nullptr)
                .code(),
            Code::shape_mismatch);
  PagedCascadeOptions o;
  o.max_shared_len = 25;  // past the shared table's 24 keys
  shared_len.as<std::int32_t>()[0] = std::int32_t(prefix);
  EXPECT_EQ(paged_cascade_decode(q.view, kc.view, vc.view, shared.view, shared_len.view, tables.view, lens.view,
                                 got.view, nullptr, nullptr, o)
                .code(),
            Code::shape_mismatch);
}

TEST(PagedCascadeDecode, Plan) {
  PagedDecodeShape s{.heads = 32, .kv_heads = 8, .head_dim = 128, .page_size = 16, .num_blocks = 1000, .max_blocks = 16};
  std::vector<std::int32_t> shared(256), lens(32, 256), tables(32 * 16);
  std::iota(shared.begin(), shared.end(), 0);
  std::iota(tables.begin(), tables.end(), 256);
  auto p = plan_paged_cascade_decode(s, shared, 4096, lens, tables, 132);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->shared_splits, 16) << "8 blocks of 128 rows; 64 tiles of 64 keys, 4 a split";
  EXPECT_EQ(p->splits, 1) << "256 blocks fill the GPU";
  EXPECT_EQ(p->workspace_elements, 17 * 32 * 32 * 129);
  tables[5] = 1000;
  EXPECT_EQ(plan_paged_cascade_decode(s, shared, 4096, lens, tables, 132).status().code(), Code::invalid_argument);
  tables[5] = 5;
  EXPECT_EQ(plan_paged_cascade_decode(s, shared, 4097, lens, tables, 132).status().code(), Code::shape_mismatch);
}

TEST(PagedDecode, TypedErrorsBeforeLaunch) {
  std::mt19937 rng(50);
  PagedCase c;
  c.lq = {1, 1};
  c.lk = {20, 17};
  PagedData p(c, rng);
  HostTensor out(c.dtype, {2, c.heads, c.d});
  auto run = [&](const PagedDecodeOptions& o = {}) {
    return paged_decode(p.q.view, p.kc.view, p.vc.view, p.tables.view, p.lens.view, nullptr, out.view, nullptr, nullptr, o)
        .code();
  };
  EXPECT_EQ(run(), Code::ok);
  const std::int32_t saved = p.tables.as<std::int32_t>()[1];
  p.tables.as<std::int32_t>()[1] = std::int32_t(p.num_blocks);  // a used entry past the pool
  EXPECT_EQ(run(), Code::invalid_argument);
  p.tables.as<std::int32_t>()[1] = saved;
  p.lens.as<std::int32_t>()[0] = std::int32_t(p.max_blocks * c.page + 1);  // keys past the table
  EXPECT_EQ(run(), Code::shape_mismatch);
  p.lens.as<std::int32_t>()[0] = 20;
  PagedDecodeOptions o;
  o.max_seq_len = p.max_blocks * c.page + 1;  // the bound a CUDA call is checked by
  EXPECT_EQ(run(o), Code::shape_mismatch);
  o.max_seq_len = 10;  // a request longer than the bound given
  EXPECT_EQ(run(o), Code::shape_mismatch);
  o = {};
  o.window_left = -2;
  EXPECT_EQ(run(o), Code::invalid_argument);
  HostTensor q3(c.dtype, {3, c.heads, c.d});
  EXPECT_EQ(paged_decode(q3.view, p.kc.view, p.vc.view, p.tables.view, p.lens.view, nullptr, out.view, nullptr, nullptr).code(),
            Code::shape_mismatch)
      << "one query per request without cu_seqlens_q";
  HostTensor kc7(c.dtype, {4, 7, c.kv_heads, c.d});
  EXPECT_EQ(paged_decode(p.q.view, kc7.view, kc7.view, p.tables.view, p.lens.view, nullptr, out.view, nullptr, nullptr).code(),
            Code::invalid_argument)
      << "page size 7";
  HostTensor kc_heads(c.dtype, {p.num_blocks, c.page, 3, c.d});
  EXPECT_EQ(paged_decode(p.q.view, kc_heads.view, kc_heads.view, p.tables.view, p.lens.view, nullptr, out.view, nullptr,
                         nullptr)
                .code(),
            Code::shape_mismatch)
      << "8 heads over 3 KV heads";
  HostTensor t64(DType::i64, {2, p.max_blocks});
  EXPECT_EQ(paged_decode(p.q.view, p.kc.view, p.vc.view, t64.view, p.lens.view, nullptr, out.view, nullptr, nullptr).code(),
            Code::unsupported_dtype);
}

// The host side and the kernels' ops together: KVCacheManager's slot mappings written by
// reshape_and_cache, a fork whose first append copies the shared last block (copy_blocks before
// the write), then paged_decode over the manager's tables against attention over each request's
// own keys kept contiguously here.
TEST(PagedCacheWithManager, ForkCopyOnWriteAndDecode) {
  std::mt19937 rng(70);
  const std::int64_t hk = 2, d = 16, heads = 4, page = 8, blocks = 32, row = hk * d;
  KVCacheConfig cfg;
  cfg.num_blocks = std::int32_t(blocks);
  cfg.page_size = std::int32_t(page);
  cfg.dtype = KVDType::f16;
  cfg.num_kv_heads = std::int32_t(hk);
  cfg.head_dim = std::int32_t(d);
  cfg.enable_prefix_caching = false;
  auto m = std::move(KVCacheManager::create(cfg)).value();
  HostTensor kc(DType::f32, {blocks, page, hk, d}), vc(DType::f32, {blocks, page, hk, d});
  std::vector<std::vector<float>> keys(3), values(3);  // per request: its tokens' rows, in order
  std::normal_distribution<float> nd(0, 1);
  // Writes the new tokens of `request` (their rows appended to its own copy) through the plan.
  auto write = [&](RequestId request, std::int64_t tokens, SlotPlan& plan) {
    if (!plan.copies.empty()) {
      HostTensor pairs(DType::i32, {std::int64_t(plan.copies.size()), 2});
      std::memcpy(pairs.bytes.data(), plan.copies.data(), plan.copies.size() * sizeof(BlockCopy));
      ASSERT_TRUE(copy_blocks(kc.view, vc.view, pairs.view).ok());
    }
    HostTensor k(DType::f32, {tokens, hk, d}), v(DType::f32, {tokens, hk, d}), slots(DType::i64, {tokens});
    for (std::int64_t i = 0; i < tokens * row; ++i) {
      k.as<float>()[i] = nd(rng);
      v.as<float>()[i] = nd(rng);
    }
    std::memcpy(slots.bytes.data(), plan.slot_mapping.data(), std::size_t(tokens) * 8);
    ASSERT_TRUE(reshape_and_cache(k.view, v.view, slots.view, kc.view, vc.view).ok());
    keys[std::size_t(request)].insert(keys[std::size_t(request)].end(), k.as<float>(), k.as<float>() + tokens * row);
    values[std::size_t(request)].insert(values[std::size_t(request)].end(), v.as<float>(), v.as<float>() + tokens * row);
    plan.clear();
  };
  SlotPlan plan;
  std::vector<std::int32_t> prompt(13, 7);
  ASSERT_TRUE(m.allocate(1, prompt, plan).ok());
  write(1, 13, plan);
  ASSERT_TRUE(m.fork(1, 2).ok());
  keys[2] = keys[1];
  values[2] = values[1];
  std::vector<std::int32_t> tok{5};
  ASSERT_TRUE(m.append_slots(2, tok, plan).ok());
  ASSERT_EQ(plan.copies.size(), 1u) << "the shared, partly filled last block is copied first";
  write(2, 1, plan);
  ASSERT_TRUE(m.append_slots(1, tok, plan).ok());
  EXPECT_TRUE(plan.copies.empty());
  write(1, 1, plan);
  for (int step = 0; step < 5; ++step) {  // request 2 fills its block and takes another
    ASSERT_TRUE(m.append_slots(2, tok, plan).ok());
    write(2, 1, plan);
  }
  ASSERT_TRUE(m.check_invariants().ok());
  // Decode both against their own keys.
  const std::vector<RequestId> ids = {1, 2};
  std::int64_t max_blocks = 0;
  for (RequestId id : ids) max_blocks = std::max<std::int64_t>(max_blocks, std::int64_t(m.block_table(id)->size()));
  HostTensor tables(DType::i32, {2, max_blocks}), lens(DType::i32, {2}), q(DType::f32, {2, heads, d}), out(DType::f32, {2, heads, d});
  fill_random(q, rng);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto t = *m.block_table(ids[i]);
    std::copy(t.begin(), t.end(), tables.as<std::int32_t>() + i * max_blocks);
    lens.as<std::int32_t>()[i] = std::int32_t(*m.num_tokens(ids[i]));
  }
  ASSERT_TRUE(paged_decode(q.view, kc.view, vc.view, tables.view, lens.view, nullptr, out.view, nullptr, nullptr).ok());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int64_t lk = lens.as<std::int32_t>()[i];
    ASSERT_EQ(std::int64_t(keys[std::size_t(ids[i])].size()), lk * row);
    HostTensor k(DType::f32, {lk, hk, d}), v(DType::f32, {lk, hk, d}), cq(DType::i32, {2}), ck(DType::i32, {2}),
        want(DType::f32, {1, heads, d});
    std::memcpy(k.bytes.data(), keys[std::size_t(ids[i])].data(), std::size_t(lk * row) * 4);
    std::memcpy(v.bytes.data(), values[std::size_t(ids[i])].data(), std::size_t(lk * row) * 4);
    cq.as<std::int32_t>()[1] = 1;
    ck.as<std::int32_t>()[1] = std::int32_t(lk);
    TensorView qi = q.view;
    qi.shape[0] = 1;
    qi.data = q.bytes.data() + i * heads * d * 4;
    ASSERT_TRUE(attention_varlen(qi, k.view, v.view, cq.view, ck.view, want.view, nullptr, 1, lk).ok());
    for (std::int64_t j = 0; j < heads * d; ++j)
      ASSERT_NEAR(out.at(std::int64_t(i) * heads * d + j), want.at(j), 1e-5) << "request " << ids[i];
  }
}

TEST(PagedDecodePlan, SplitsValidationAndWorkspace) {
  PagedDecodeShape s{.heads = 32, .kv_heads = 8, .head_dim = 128, .page_size = 16, .num_blocks = 4096, .max_blocks = 2048};
  std::vector<std::int32_t> lens = {32768};
  auto p = plan_paged_decode(s, lens, {}, {}, 132);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->splits, 47) << "8 blocks for 396 slots: 376 blocks of 11 tiles, one wave";
  EXPECT_EQ(p->max_seq_len, 32768);
  EXPECT_EQ(p->max_seqlen_q, 1);
  EXPECT_EQ(p->workspace_elements, 47 * 32 * 129);
  lens.assign(64, 8192);
  p = plan_paged_decode(s, lens, {}, {}, 132);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->splits, 3) << "512 blocks are 1.3 waves; 1536 are 3.9";
  lens.assign(1, 100);
  EXPECT_EQ(plan_paged_decode(s, lens, {}, {}, 132)->splits, 1) << "short keys: too few tiles to split";
  // The tables: an entry past the pool, keys past the table.
  PagedDecodeShape small{.heads = 4, .kv_heads = 2, .head_dim = 64, .page_size = 8, .num_blocks = 10, .max_blocks = 3};
  std::vector<std::int32_t> tables = {0, 1, 2, 3, 9, -1}, l2 = {24, 9}, cu = {0, 2, 5};
  p = plan_paged_decode(small, l2, cu, tables, 0);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->max_seqlen_q, 3);
  EXPECT_EQ(p->total_q, 5);
  tables[4] = 10;
  EXPECT_EQ(plan_paged_decode(small, l2, cu, tables, 0).status().code(), Code::invalid_argument);
  tables[4] = 9;
  l2[1] = 25;
  EXPECT_EQ(plan_paged_decode(small, l2, cu, tables, 0).status().code(), Code::shape_mismatch);
  l2[1] = 9;
  cu[2] = 1;
  EXPECT_EQ(plan_paged_decode(small, l2, cu, tables, 0).status().code(), Code::shape_mismatch);
  small.page_size = 4;
  EXPECT_EQ(plan_paged_decode(small, l2, {}, {}, 0).status().code(), Code::invalid_argument);
}

TEST(PagedDecodeFamily, PageSizesAndCatalog) {
  for (std::int64_t ps : {1, 8, 16, 32, 64, 128}) EXPECT_TRUE(families::paged_page_size_supported(ps));
  for (std::int64_t ps : {0, 2, 4, 256, 12}) EXPECT_FALSE(families::paged_page_size_supported(ps));
  const Family* f = Registry::global().find("paged_decode");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->catalog().size(), 24u);
  families::PagedDecodeProblem a;
  a.batch = 1;
  a.seqlen_q = 1;
  a.max_seq_len = 100;
  a.total_q = 1;
  a.heads = 32;
  a.kv_heads = 8;
  a.head_dim = 128;
  a.num_blocks = 10;
  a.page_size = 16;
  a.max_blocks = 6;  // 96 keys < 100
  a.scale = 0.1;
  const Problem p = Problem::of(DType::bf16, 16, a);
  EXPECT_EQ(f->check_problem(f->heuristic(p), p).code(), Code::shape_mismatch);
}

TEST(PagedAttentionOps, Declared) {
  for (const char* name :
       {"reshape_and_cache", "copy_blocks", "merge_state", "merge_state_in_place", "paged_decode", "paged_cascade_decode"}) {
    const OpDecl* op = Registry::global().find_op(name);
    ASSERT_NE(op, nullptr) << name;
    EXPECT_TRUE(op->check().ok()) << name << ": " << op->check().to_string();
  }
}

}  // namespace
}  // namespace kiln
