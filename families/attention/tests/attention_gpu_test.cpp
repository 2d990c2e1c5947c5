// Attention on the GPU against the CPU reference (the typed ops' host path, fp64): fresh random
// data each run, out and lse poisoned before each launch (an element never written fails), every
// head-dim pair and dtype, causal and not, windows, softcap, GQA ratios 1, 4 and 8, lq != lk,
// packed sequences of uneven lengths (empty ones included), rows that see no key; and the errors
// the GPU path gives before any launch.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "families/attention/attention.h"
#include "families/attention/ops.h"
#include "jit/driver.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

class AttentionGpu : public testing::GpuFixture {};

struct Case {
  DType dtype = DType::bf16;
  std::int64_t d = 128, dv = 128, heads = 4, kv_heads = 4;
  std::vector<std::int64_t> lq, lk;  // padded: one length each, every sequence
  std::int64_t batch = 1;            // padded only
  bool varlen = false;
  AttentionOptions opt;
  std::string what() const {
    std::string s = std::string(dtype_name(dtype)) + " d" + std::to_string(d) + "/" + std::to_string(dv) + " h" +
                    std::to_string(heads) + "/" + std::to_string(kv_heads) + (varlen ? " varlen" : " padded") +
                    (opt.causal ? " causal" : "") + " window(" + std::to_string(opt.window_left) + "," +
                    std::to_string(opt.window_right) + ") softcap " + std::to_string(opt.softcap) + " lq";
    for (auto l : lq) s += " " + std::to_string(l);
    s += " lk";
    for (auto l : lk) s += " " + std::to_string(l);
    return s;
  }
};

// Runs c on the GPU and on the host from the same inputs; compares out by relative L2 error and lse
// elementwise (-inf exactly where the reference has it).
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
  DeviceBuffer q(nq * es), k(nk * es), v(nv * es), o(no * es), lse(nl * 4), dcq(cq.size() * 4), dck(ck.size() * 4);
  q.upload(hq.data());
  k.upload(hk.data());
  v.upload(hv.data());
  dcq.upload(cq.data());
  dck.upload(ck.data());
  o.poison();
  lse.poison();
  std::vector<unsigned char> ho(no * es, 0xFF), hl(nl * 4, 0xFF);
  const Device gpu = Device::cuda(0), cpu = Device::cpu();
  auto view = [](void* p, DType t, std::vector<std::int64_t> shape, Device dev) {
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
  };
  // Both sides through the same typed op: the GPU from device buffers, the CPU reference from host ones.
  auto run = [&](void* pq, void* pk, void* pv, void* pcq, void* pck, void* po, void* pl, Device dev) {
    if (c.varlen) {
      auto lv = view(pl, DType::f32, {c.heads, tq}, dev);
      return attention_varlen(view(pq, c.dtype, {tq, c.heads, c.d}, dev), view(pk, c.dtype, {tk, c.kv_heads, c.d}, dev),
                              view(pv, c.dtype, {tk, c.kv_heads, c.dv}, dev),
                              view(pcq, DType::i32, {batch + 1}, dev), view(pck, DType::i32, {batch + 1}, dev),
                              view(po, c.dtype, {tq, c.heads, c.dv}, dev), &lv, sq, sk, c.opt, nullptr,
                              dev.kind == DeviceKind::cuda ? rt : nullptr);
    }
    auto lv = view(pl, DType::f32, {batch, c.heads, sq}, dev);
    return attention(view(pq, c.dtype, {batch, sq, c.heads, c.d}, dev),
                     view(pk, c.dtype, {batch, sk, c.kv_heads, c.d}, dev),
                     view(pv, c.dtype, {batch, sk, c.kv_heads, c.dv}, dev),
                     view(po, c.dtype, {batch, sq, c.heads, c.dv}, dev), &lv, c.opt, nullptr,
                     dev.kind == DeviceKind::cuda ? rt : nullptr);
  };
  Status s = run(q.get(), k.get(), v.get(), dcq.get(), dck.get(), o.get(), lse.get(), gpu);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
  std::vector<unsigned char> go(no * es), gl(nl * 4);
  o.download(go.data());
  lse.download(gl.data());
  s = run(hq.data(), hk.data(), hv.data(), cq.data(), ck.data(), ho.data(), hl.data(), cpu);
  ASSERT_TRUE(s.ok()) << s.to_string();

  std::vector<std::int64_t> idx(static_cast<std::size_t>(no));
  for (std::int64_t i = 0; i < no; ++i) idx[std::size_t(i)] = i;
  // P is rounded to the input dtype before P V, as FlashAttention does: bf16 needs more than one rounding's worth.
  const double tol = c.dtype == DType::bf16 ? 1e-2 : 2e-3;
  EXPECT_LE(testing::rel_l2(go.data(), ho.data(), c.dtype, idx), tol) << "out (NaN: an element never written)";
  const auto* g = reinterpret_cast<const float*>(gl.data());
  const auto* w = reinterpret_cast<const float*>(hl.data());
  int bad = 0, masked = 0;
  for (std::int64_t i = 0; i < nl && bad < 5; ++i) {
    if (std::isinf(w[i])) {
      ++masked;
      if (!(g[i] == w[i])) ++bad, ADD_FAILURE() << "lse[" << i << "] = " << g[i] << ", want " << w[i];
    } else if (!(std::abs(g[i] - w[i]) <= 1e-3f * std::max(1.0f, std::abs(w[i])))) {
      ++bad, ADD_FAILURE() << "lse[" << i << "] = " << g[i] << ", want " << w[i];
    }
  }
  std::printf("%s: %lld outputs, %d rows see no key\n", c.what().c_str(), static_cast<long long>(no), masked);
}

AttentionOptions opts(bool causal, std::int64_t wl = -1, std::int64_t wr = -1, double softcap = 0, double scale = 0) {
  AttentionOptions o;
  o.causal = causal;
  o.window_left = wl;
  o.window_right = wr;
  o.softcap = softcap;
  o.scale = scale;
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

Case packed(DType t, std::int64_t d, std::int64_t dv, std::int64_t h, std::int64_t hk, std::vector<std::int64_t> lq,
            std::vector<std::int64_t> lk, AttentionOptions o) {
  Case c = padded(t, d, dv, 1, h, hk, 0, 0, o);
  c.varlen = true;
  c.lq = std::move(lq);
  c.lk = std::move(lk);
  return c;
}

TEST_F(AttentionGpu, EveryHeadDimAndDtypeCausalAndNot) {
  for (DType t : {DType::bf16, DType::f16})
    for (const auto& [d, dv] : families::k_attention_head_dims)
      for (bool causal : {false, true}) check(rt_.get(), padded(t, d, dv, 2, 4, 2, 197, 197, opts(causal)), seed_++);
}

TEST_F(AttentionGpu, QueriesAndKeysOfDifferentLengths) {
  for (bool causal : {false, true}) {
    check(rt_.get(), padded(DType::bf16, 128, 128, 2, 4, 4, 77, 300, opts(causal)), seed_++);
    check(rt_.get(), padded(DType::bf16, 64, 64, 1, 4, 4, 1, 1000, opts(causal)), seed_++);
    check(rt_.get(), padded(DType::f16, 96, 96, 1, 2, 2, 15, 64, opts(causal)), seed_++);
  }
  // lq > lk, causal: the first lq - lk rows see no key (zeros, lse -inf).
  check(rt_.get(), padded(DType::bf16, 128, 128, 2, 4, 4, 300, 100, opts(true)), seed_++);
  check(rt_.get(), padded(DType::f16, 256, 256, 1, 2, 1, 150, 20, opts(true)), seed_++);
}

TEST_F(AttentionGpu, GqaRatiosOneFourEight) {
  for (std::int64_t ratio : {1, 4, 8})
    for (bool causal : {false, true}) {
      check(rt_.get(), padded(DType::bf16, 128, 128, 2, 8, 8 / ratio, 256, 256, opts(causal)), seed_++);
      check(rt_.get(), packed(DType::f16, 64, 64, 8, 8 / ratio, {100, 7, 260}, {130, 7, 300}, opts(causal)), seed_++);
    }
}

TEST_F(AttentionGpu, SlidingWindowsAndSoftcap) {
  for (DType t : {DType::bf16, DType::f16}) {
    check(rt_.get(), padded(t, 128, 128, 2, 4, 2, 500, 500, opts(false, 100, 0)), seed_++);
    check(rt_.get(), padded(t, 128, 128, 2, 4, 2, 500, 500, opts(true, 63)), seed_++);
    check(rt_.get(), padded(t, 64, 64, 1, 4, 4, 300, 300, opts(false, 32, 17)), seed_++);
    check(rt_.get(), padded(t, 64, 64, 1, 4, 4, 300, 300, opts(false, -1, 40)), seed_++);
    check(rt_.get(), padded(t, 64, 64, 1, 4, 4, 300, 300, opts(false, 40, -1)), seed_++);
    check(rt_.get(), padded(t, 192, 128, 1, 4, 4, 200, 333, opts(true, 50)), seed_++);
    // Windows that leave some rows nothing: window (0, 0) with more queries than keys.
    check(rt_.get(), padded(t, 128, 128, 1, 2, 2, 200, 50, opts(false, 0, 0)), seed_++);
    check(rt_.get(), padded(t, 128, 128, 2, 4, 4, 256, 256, opts(false, -1, -1, 5.0, 0.3)), seed_++);
    check(rt_.get(), padded(t, 256, 256, 1, 4, 4, 130, 260, opts(true, -1, -1, 30.0)), seed_++);
    check(rt_.get(), padded(t, 80, 80, 1, 4, 4, 100, 100, opts(false, -1, -1, 0, 0.01)), seed_++);
  }
}

TEST_F(AttentionGpu, PackedSequencesOfUnevenLengths) {
  for (DType t : {DType::bf16, DType::f16})
    for (const auto& [d, dv] : families::k_attention_head_dims) {
      check(rt_.get(), packed(t, d, dv, 4, 2, {1, 129, 0, 64, 300}, {1, 129, 5, 64, 300}, opts(true)), seed_++);
      check(rt_.get(), packed(t, d, dv, 4, 1, {17, 200, 3}, {250, 33, 0}, opts(false)), seed_++);
    }
  // lq != lk per sequence with causal (bottom-right aligned), windows and softcap.
  check(rt_.get(), packed(DType::bf16, 128, 128, 8, 2, {10, 300, 128, 50}, {300, 10, 128, 51}, opts(true)), seed_++);
  check(rt_.get(), packed(DType::bf16, 128, 128, 8, 2, {10, 300, 128}, {300, 10, 128}, opts(false, 20, 5, 10.0)),
        seed_++);
}

TEST_F(AttentionGpu, GpuLimitsAreTypedErrorsBeforeAnyLaunch) {
  DeviceBuffer q(1 << 20), k(1 << 20), v(1 << 20), o(1 << 20);
  o.poison();
  auto dv = [](const DeviceBuffer& b, DType t, std::initializer_list<std::int64_t> s) {
    return TensorView::contiguous(b.get(), t, s, Device::cuda(0));
  };
  auto call = [&](DType t, std::int64_t d, std::int64_t dvv, AttentionOptions opt = {}) {
    return attention(dv(q, t, {1, 16, 2, d}), dv(k, t, {1, 16, 2, d}), dv(v, t, {1, 16, 2, dvv}),
                     dv(o, t, {1, 16, 2, dvv}), nullptr, opt, nullptr, rt_.get())
        .code();
  };
  EXPECT_EQ(call(DType::f32, 128, 128), Code::unsupported_dtype);
  EXPECT_EQ(call(DType::bf16, 32, 32), Code::invalid_argument);
  EXPECT_EQ(call(DType::bf16, 128, 64), Code::invalid_argument);
  EXPECT_EQ(call(DType::bf16, 512, 512), Code::invalid_argument);
  EXPECT_EQ(call(DType::bf16, 128, 128, opts(true, -1, 3)), Code::invalid_argument);
  // A 16-byte-misaligned q.
  auto mis = TensorView::contiguous(static_cast<char*>(q.get()) + 8, DType::bf16, {1, 16, 2, 128}, Device::cuda(0));
  EXPECT_EQ(attention(mis, dv(k, DType::bf16, {1, 16, 2, 128}), dv(v, DType::bf16, {1, 16, 2, 128}),
                      dv(o, DType::bf16, {1, 16, 2, 128}), nullptr, {}, nullptr, rt_.get())
                .code(),
            Code::invalid_argument);
  ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
  std::vector<unsigned char> got(1 << 20);
  o.download(got.data());
  for (unsigned char b : got) ASSERT_EQ(b, 0xFF) << "an error wrote the output";
}

// Packed sequences whose keys are all empty (total_k 0) while max_seqlen_k stays that of an earlier
// call: the runtime remembers the earlier call's kernel by the problem's key fields, which token
// counts are not, and the wgmma kernel cannot map zero rows. The forward writes zeros and lse
// -inf, the backward zero dq, without a kernel.
TEST_F(AttentionGpu, NoKeyTokensNeedNoKernel) {
  const DType t = DType::bf16;
  const std::int64_t h = 4, hk = 2, d = 128, tq = 8, tk = 16;
  std::mt19937 rng(seed_);
  DeviceBuffer q(tq * h * d * 2), k(tk * hk * d * 2), v(tk * hk * d * 2), o(tq * h * d * 2), l(h * tq * 4),
      cu_q(12), cu_k(12), cu_k0(12), dq(tq * h * d * 2), dk(tk * hk * d * 2), dv(tk * hk * d * 2);
  for (DeviceBuffer* b : {&q, &k, &v}) {
    const auto x = testing::random_bytes(t, std::int64_t(b == &q ? tq * h * d : tk * hk * d), rng);
    b->upload(x.data());
  }
  const std::int32_t offs_q[3] = {0, 5, 8}, offs_k[3] = {0, 7, 16}, none[3] = {0, 0, 0};
  cu_q.upload(offs_q);
  cu_k.upload(offs_k);
  cu_k0.upload(none);
  auto dev = [](const DeviceBuffer& b, DType dt, std::initializer_list<std::int64_t> s) {
    return TensorView::contiguous(b.get(), dt, s, Device::cuda(0));
  };
  const TensorView lse = dev(l, DType::f32, {h, tq});
  ASSERT_TRUE(attention_varlen(dev(q, t, {tq, h, d}), dev(k, t, {tk, hk, d}), dev(v, t, {tk, hk, d}),
                               dev(cu_q, DType::i32, {3}), dev(cu_k, DType::i32, {3}), dev(o, t, {tq, h, d}), &lse, 5,
                               9, {}, nullptr, rt_.get())
                  .ok());
  o.poison();
  l.poison();
  ASSERT_TRUE(attention_varlen(dev(q, t, {tq, h, d}), dev(k, t, {0, hk, d}), dev(v, t, {0, hk, d}),
                               dev(cu_q, DType::i32, {3}), dev(cu_k0, DType::i32, {3}), dev(o, t, {tq, h, d}), &lse, 5,
                               9, {}, nullptr, rt_.get())
                  .ok());
  ASSERT_TRUE(jit::Driver::get().value()->ctx_synchronize() == CUDA_SUCCESS);
  std::vector<std::uint16_t> out(tq * h * d);
  std::vector<float> stats(h * tq);
  o.download(out.data());
  l.download(stats.data());
  for (std::uint16_t x : out) ASSERT_EQ(x, 0u) << "a row without keys is zeros";
  for (float x : stats) ASSERT_EQ(x, -std::numeric_limits<float>::infinity()) << "a row without keys has lse -inf";
  dq.poison();
  ASSERT_TRUE(attention_varlen_backward(dev(o, t, {tq, h, d}), dev(q, t, {tq, h, d}), dev(k, t, {0, hk, d}),
                                        dev(v, t, {0, hk, d}), dev(cu_q, DType::i32, {3}), dev(cu_k0, DType::i32, {3}),
                                        dev(o, t, {tq, h, d}), lse, dev(dq, t, {tq, h, d}), dev(dk, t, {0, hk, d}),
                                        dev(dv, t, {0, hk, d}), 5, 9, {}, false, nullptr, rt_.get())
                  .ok());
  ASSERT_TRUE(jit::Driver::get().value()->ctx_synchronize() == CUDA_SUCCESS);
  dq.download(out.data());
  for (std::uint16_t x : out) ASSERT_EQ(x, 0u) << "no key: no gradient for q";
}

}  // namespace
}  // namespace kiln
