// The attention decode path (split-KV with GQA packing) on the GPU against the CPU reference (the
// typed ops' host path, fp64): fresh random data each run, out and lse poisoned before each launch,
// split counts forced to 1, 2, 3 and 7 (AttentionOptions::decode_splits), the heuristic's choice
// and the one-pass kernel, over 1, 4 and 16 queries against 1, 100, 4097 and 32768 keys, GQA
// groups 1, 4 and 8, every head-dim pair and dtype, causal and window masks that empty whole
// splits, softcap, packed sequences of uneven lengths (empty ones included), rows that see no
// key, lse requested or not; and that repeated runs give the same bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "families/attention/attention.h"
#include "families/attention/attention_splitkv.h"
#include "families/attention/ops.h"
#include "jit/driver.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

class AttentionSplitKvGpu : public testing::GpuFixture {};

struct Case {
  DType dtype = DType::bf16;
  std::int64_t d = 128, dv = 128, heads = 8, kv_heads = 2;
  std::vector<std::int64_t> lq, lk;  // padded: one length each, every sequence
  std::int64_t batch = 1;            // padded only
  bool varlen = false;
  bool with_lse = true;
  AttentionOptions opt;
  std::string what() const {
    std::string s = std::string(dtype_name(dtype)) + " d" + std::to_string(d) + "/" + std::to_string(dv) + " h" +
                    std::to_string(heads) + "/" + std::to_string(kv_heads) + (varlen ? " varlen" : " padded B") +
                    (varlen ? "" : std::to_string(batch)) + (opt.causal ? " causal" : "") + " window(" +
                    std::to_string(opt.window_left) + "," + std::to_string(opt.window_right) + ") softcap " +
                    std::to_string(opt.softcap) + " splits " + std::to_string(opt.decode_splits) +
                    (with_lse ? "" : " no lse") + " lq";
    for (auto l : lq) s += " " + std::to_string(l);
    s += " lk";
    for (auto l : lk) s += " " + std::to_string(l);
    return s;
  }
};

TensorView view(void* p, DType t, std::vector<std::int64_t> shape, Device dev) {
  TensorView tv;
  tv.data = p;
  tv.dtype = t;
  tv.rank = int(shape.size());
  std::int64_t stride = 1;
  for (int i = tv.rank - 1; i >= 0; --i) {
    tv.shape[i] = shape[std::size_t(i)];
    tv.strides[i] = stride;
    stride *= shape[std::size_t(i)];
  }
  tv.device = dev;
  return tv;
}

// Runs c on the GPU (twice, the second time into freshly poisoned outputs, which must come back
// byte for byte the same) and on the host from the same inputs; compares out by relative L2 error
// and lse elementwise (-inf exactly where the reference has it).
void check(Runtime* rt, const Case& c, unsigned seed) {
  SCOPED_TRACE(c.what() + " seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const std::int64_t batch = c.varlen ? std::int64_t(c.lq.size()) : c.batch;
  std::int64_t tq = 0, tk = 0, sq = 0, sk = 0;
  std::vector<std::int32_t> cq{0}, ck{0};
  for (std::size_t b = 0; b < c.lq.size(); ++b) {
    sq = std::max(sq, c.lq[b]);
    sk = std::max(sk, c.lk[b]);
    cq.push_back(cq.back() + std::int32_t(c.lq[b]));
    ck.push_back(ck.back() + std::int32_t(c.lk[b]));
  }
  tq = c.varlen ? cq.back() : batch * sq;
  tk = c.varlen ? ck.back() : batch * sk;
  const std::size_t es = dtype_size(c.dtype);
  const std::int64_t nq = tq * c.heads * c.d, nk = tk * c.kv_heads * c.d, nv = tk * c.kv_heads * c.dv,
                     no = tq * c.heads * c.dv, nl = tq * c.heads;
  auto hq = testing::random_bytes(c.dtype, nq, rng), hk = testing::random_bytes(c.dtype, nk, rng),
       hv = testing::random_bytes(c.dtype, nv, rng);
  DeviceBuffer q(std::max<std::int64_t>(nq, 1) * es), k(std::max<std::int64_t>(nk, 1) * es),
      v(std::max<std::int64_t>(nv, 1) * es), o(std::max<std::int64_t>(no, 1) * es), lse(std::max<std::int64_t>(nl, 1) * 4),
      dcq(cq.size() * 4), dck(ck.size() * 4);
  q.upload(hq.data());
  k.upload(hk.data());
  v.upload(hv.data());
  dcq.upload(cq.data());
  dck.upload(ck.data());
  std::vector<unsigned char> ho(no * es, 0xFF), hl(nl * 4, 0xFF);
  const Device gpu = Device::cuda(0), cpu = Device::cpu();
  auto run = [&](void* pq, void* pk, void* pv, void* pcq, void* pck, void* po, void* pl, Device dev) {
    const bool on_gpu = dev.kind == DeviceKind::cuda;
    // The host always writes lse (the reference); the GPU only when the case asks.
    const bool want_lse = !on_gpu || c.with_lse;
    if (c.varlen) {
      auto lv = view(pl, DType::f32, {c.heads, tq}, dev);
      return attention_varlen(view(pq, c.dtype, {tq, c.heads, c.d}, dev), view(pk, c.dtype, {tk, c.kv_heads, c.d}, dev),
                              view(pv, c.dtype, {tk, c.kv_heads, c.dv}, dev), view(pcq, DType::i32, {batch + 1}, dev),
                              view(pck, DType::i32, {batch + 1}, dev), view(po, c.dtype, {tq, c.heads, c.dv}, dev),
                              want_lse ? &lv : nullptr, sq, sk, c.opt, nullptr, on_gpu ? rt : nullptr);
    }
    auto lv = view(pl, DType::f32, {batch, c.heads, sq}, dev);
    return attention(view(pq, c.dtype, {batch, sq, c.heads, c.d}, dev),
                     view(pk, c.dtype, {batch, sk, c.kv_heads, c.d}, dev),
                     view(pv, c.dtype, {batch, sk, c.kv_heads, c.dv}, dev),
                     view(po, c.dtype, {batch, sq, c.heads, c.dv}, dev), want_lse ? &lv : nullptr, c.opt, nullptr,
                     on_gpu ? rt : nullptr);
  };
  std::vector<unsigned char> go(no * es), gl(nl * 4), go2(no * es), gl2(nl * 4);
  for (int pass = 0; pass < 2; ++pass) {
    o.poison();
    lse.poison();
    Status s = run(q.get(), k.get(), v.get(), dcq.get(), dck.get(), o.get(), lse.get(), gpu);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
    o.download(pass == 0 ? go.data() : go2.data());
    lse.download(pass == 0 ? gl.data() : gl2.data());
  }
  EXPECT_TRUE(go == go2 && gl == gl2) << "two runs gave different bytes";
  Status s = run(hq.data(), hk.data(), hv.data(), cq.data(), ck.data(), ho.data(), hl.data(), cpu);
  ASSERT_TRUE(s.ok()) << s.to_string();

  std::vector<std::int64_t> idx(static_cast<std::size_t>(no));
  for (std::int64_t i = 0; i < no; ++i) idx[std::size_t(i)] = i;
  const double tol = c.dtype == DType::bf16 ? 1e-2 : 2e-3;
  if (no > 0) {
    EXPECT_LE(testing::rel_l2(go.data(), ho.data(), c.dtype, idx), tol) << "out (NaN: an element never written)";
  }
  const auto* g = reinterpret_cast<const float*>(gl.data());
  const auto* w = reinterpret_cast<const float*>(hl.data());
  int bad = 0, masked = 0;
  for (std::int64_t i = 0; i < nl && bad < 5; ++i) {
    std::uint32_t gbits;
    std::memcpy(&gbits, &g[i], 4);
    if (!c.with_lse) {
      if (gbits != 0xFFFFFFFFu) ++bad, ADD_FAILURE() << "lse[" << i << "] written without lse";
    } else if (std::isinf(w[i])) {
      ++masked;
      if (!(g[i] == w[i])) ++bad, ADD_FAILURE() << "lse[" << i << "] = " << g[i] << ", want " << w[i];
    } else if (!(std::abs(g[i] - w[i]) <= 1e-3f * std::max(1.0f, std::abs(w[i])))) {
      ++bad, ADD_FAILURE() << "lse[" << i << "] = " << g[i] << ", want " << w[i];
    }
  }
  std::printf("%s: %lld outputs, %d rows see no key\n", c.what().c_str(), static_cast<long long>(no), masked);
}

AttentionOptions opts(std::int64_t splits, bool causal = false, std::int64_t wl = -1, std::int64_t wr = -1,
                      double softcap = 0) {
  AttentionOptions o;
  o.decode_splits = splits;
  o.causal = causal;
  o.window_left = wl;
  o.window_right = wr;
  o.softcap = softcap;
  return o;
}

Case padded(DType t, std::int64_t d, std::int64_t dv, std::int64_t batch, std::int64_t h, std::int64_t hk,
            std::int64_t lq, std::int64_t lk, AttentionOptions o) {
  Case c;
  c.dtype = t;
  c.d = d;
  c.dv = dv;
  c.batch = batch;
  c.heads = h;
  c.kv_heads = hk;
  c.lq = {lq};
  c.lk = {lk};
  c.opt = o;
  return c;
}

Case packed(DType t, std::int64_t h, std::int64_t hk, std::vector<std::int64_t> lq, std::vector<std::int64_t> lk,
            AttentionOptions o) {
  Case c = padded(t, 128, 128, 1, h, hk, 0, 0, o);
  c.varlen = true;
  c.lq = std::move(lq);
  c.lk = std::move(lk);
  return c;
}

// -1: the one-pass kernel; 0: the heuristic's choice; the rest forced.
constexpr std::int64_t k_splits[] = {1, 2, 3, 7, 0, -1};

TEST_F(AttentionSplitKvGpu, SplitCountsQueryAndKeyLengthsGqaGroups) {
  for (std::int64_t splits : k_splits)
    for (std::int64_t group : {1, 4, 8})
      for (std::int64_t lq : {1, 4, 16})
        for (std::int64_t lk : {1, 100, 4097, 32768}) {
          const DType t = (lq + lk + group) % 2 ? DType::bf16 : DType::f16;
          const std::int64_t batch = lk > 5000 ? 1 : 2;
          check(rt_.get(), padded(t, 128, 128, batch, 8, 8 / group, lq, lk, opts(splits)), seed_++);
        }
}

TEST_F(AttentionSplitKvGpu, EveryHeadDimAndDtype) {
  for (DType t : {DType::bf16, DType::f16})
    for (const auto& [d, dv] : families::k_attention_head_dims)
      for (std::int64_t splits : {3, 0}) {
        check(rt_.get(), padded(t, d, dv, 2, 8, 2, 4, 4097, opts(splits)), seed_++);
        check(rt_.get(), padded(t, d, dv, 1, 16, 2, 16, 1000, opts(splits, true)), seed_++);  // 128 packed rows
      }
}

TEST_F(AttentionSplitKvGpu, MasksThatEmptyWholeSplits) {
  for (std::int64_t splits : {2, 3, 7, 0})
    for (DType t : {DType::bf16, DType::f16}) {
      // Causal, 16 queries: the last split holds keys only the later queries see.
      check(rt_.get(), padded(t, 128, 128, 2, 8, 1, 16, 4097, opts(splits, true)), seed_++);
      // A window of 100 keys: every split but the last sees nothing.
      check(rt_.get(), padded(t, 128, 128, 1, 8, 2, 4, 4097, opts(splits, false, 100, 0)), seed_++);
      // A window in the middle of the keys, softcap.
      check(rt_.get(), padded(t, 64, 64, 1, 32, 8, 1, 32768, opts(splits, false, 3000, -1, 30.0)), seed_++);
      check(rt_.get(), padded(t, 128, 128, 1, 8, 8, 16, 8192, opts(splits, false, 20, 5, 10.0)), seed_++);
      // Rows that see no key: causal and window (0, 0) with more queries than keys.
      check(rt_.get(), padded(t, 128, 128, 2, 8, 2, 16, 10, opts(splits, true)), seed_++);
      check(rt_.get(), padded(t, 128, 128, 1, 4, 4, 16, 8, opts(splits, false, 0, 0)), seed_++);
    }
}

TEST_F(AttentionSplitKvGpu, PackedSequencesOfUnevenLengths) {
  for (std::int64_t splits : k_splits)
    for (std::int64_t group : {1, 4, 8}) {
      const std::int64_t h = 8, hk = 8 / group;
      check(rt_.get(), packed(DType::bf16, h, hk, {1, 16, 0, 4, 3, 1}, {4097, 17, 5, 0, 300, 32768}, opts(splits)),
            seed_++);
      check(rt_.get(), packed(DType::f16, h, hk, {1, 16, 0, 4, 3}, {4097, 17, 5, 0, 300}, opts(splits, true)),
            seed_++);
      check(rt_.get(), packed(DType::bf16, h, hk, {16, 2, 9}, {5000, 2, 700}, opts(splits, false, 64, 0)), seed_++);
    }
}

TEST_F(AttentionSplitKvGpu, WithoutLse) {
  for (std::int64_t splits : {1, 7, 0}) {
    Case c = padded(DType::bf16, 128, 128, 2, 32, 8, 1, 8192, opts(splits));
    c.with_lse = false;
    check(rt_.get(), c, seed_++);
    c = packed(DType::f16, 8, 2, {3, 16}, {1000, 4097}, opts(splits, true));
    c.with_lse = false;
    check(rt_.get(), c, seed_++);
  }
}

TEST_F(AttentionSplitKvGpu, DecodeSplitsOutOfRangeIsAnError) {
  DeviceBuffer q(1 << 16), k(1 << 16), v(1 << 16), o(1 << 16);
  auto dv = [](const DeviceBuffer& b, std::initializer_list<std::int64_t> s) {
    return TensorView::contiguous(b.get(), DType::bf16, s, Device::cuda(0));
  };
  for (std::int64_t bad : {-2, 1025})
    EXPECT_EQ(attention(dv(q, {1, 1, 2, 128}), dv(k, {1, 64, 2, 128}), dv(v, {1, 64, 2, 128}), dv(o, {1, 1, 2, 128}),
                        nullptr, opts(bad), nullptr, rt_.get())
                  .code(),
              Code::invalid_argument);
}

}  // namespace
}  // namespace kiln
