// The attention backward on the GPU against the CPU reference (the typed ops' host path, fp64):
// fresh random q, k, v, dout each run, out and lse from the host forward (the same inputs on both
// sides), dq, dk, dv poisoned before each launch (an element never written fails), every head dim
// and dtype, causal and not, windows, softcap, GQA ratios 1, 2, 4 and 8, lq != lk, packed sequences
// of uneven and empty lengths, rows that see no key (zeros, no NaN), both modes; the deterministic
// mode bitwise identical over 10 runs; and the errors the GPU path gives before any launch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "families/attention/attention_bwd.h"
#include "families/attention/ops.h"
#include "jit/driver.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

class AttentionBwdGpu : public testing::GpuFixture {};

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

// The gradients of one case: the GPU's (runs times, deterministic or not) and the host's.
struct Result3 {
  std::vector<unsigned char> dq, dk, dv;
};

// Runs c's backward on the GPU `runs` times (each from poisoned gradients) and once on the host
// from the same inputs; compares each GPU run with the host by relative L2 error; with
// `deterministic`, every run must match the first bit for bit. Returns the first GPU run.
Result3 check(Runtime* rt, const Case& c, unsigned seed, bool deterministic = false, int runs = 1) {
  SCOPED_TRACE(c.what() + (deterministic ? " deterministic" : " fast") + " seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const std::int64_t batch = c.varlen ? std::int64_t(c.lq.size()) : c.batch;
  std::int64_t sq = 0, sk = 0;
  std::vector<std::int32_t> cq{0}, ck{0};
  for (std::size_t b = 0; b < c.lq.size(); ++b) {
    sq = std::max(sq, c.lq[b]);
    sk = std::max(sk, c.lk[b]);
    cq.push_back(cq.back() + std::int32_t(c.lq[b]));
    ck.push_back(ck.back() + std::int32_t(c.lk[b]));
  }
  const std::int64_t tq = c.varlen ? cq.back() : batch * sq, tk = c.varlen ? ck.back() : batch * sk;
  const std::size_t es = dtype_size(c.dtype);
  const std::int64_t nq = tq * c.heads * c.d, nk = tk * c.kv_heads * c.d, nv = tk * c.kv_heads * c.dv,
                     no = tq * c.heads * c.dv, nl = tq * c.heads;
  auto hq = testing::random_bytes(c.dtype, nq, rng), hk = testing::random_bytes(c.dtype, nk, rng),
       hv = testing::random_bytes(c.dtype, nv, rng), hg = testing::random_bytes(c.dtype, no, rng);
  std::vector<unsigned char> ho(std::size_t(no) * es), hl(std::size_t(nl) * 4);
  const Device gpu = Device::cuda(0), cpu = Device::cpu();
  // out and lse from the host forward.
  {
    Status s;
    if (c.varlen) {
      auto lv = view(hl.data(), DType::f32, {c.heads, tq}, cpu);
      s = attention_varlen(view(hq.data(), c.dtype, {tq, c.heads, c.d}, cpu),
                           view(hk.data(), c.dtype, {tk, c.kv_heads, c.d}, cpu),
                           view(hv.data(), c.dtype, {tk, c.kv_heads, c.dv}, cpu),
                           view(cq.data(), DType::i32, {batch + 1}, cpu), view(ck.data(), DType::i32, {batch + 1}, cpu),
                           view(ho.data(), c.dtype, {tq, c.heads, c.dv}, cpu), &lv, sq, sk, c.opt);
    } else {
      auto lv = view(hl.data(), DType::f32, {batch, c.heads, sq}, cpu);
      s = attention(view(hq.data(), c.dtype, {batch, sq, c.heads, c.d}, cpu),
                    view(hk.data(), c.dtype, {batch, sk, c.kv_heads, c.d}, cpu),
                    view(hv.data(), c.dtype, {batch, sk, c.kv_heads, c.dv}, cpu),
                    view(ho.data(), c.dtype, {batch, sq, c.heads, c.dv}, cpu), &lv, c.opt);
    }
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  DeviceBuffer q(nq * es), k(nk * es), v(nv * es), o(no * es), g(no * es), lse(nl * 4), dcq(cq.size() * 4),
      dck(ck.size() * 4), dq(nq * es), dk(nk * es), dv(nv * es);
  q.upload(hq.data());
  k.upload(hk.data());
  v.upload(hv.data());
  o.upload(ho.data());
  g.upload(hg.data());
  lse.upload(hl.data());
  dcq.upload(cq.data());
  dck.upload(ck.data());
  auto run = [&](void* pg, void* pq, void* pk, void* pv, void* pcq, void* pck, void* po, void* pl, void* pdq,
                 void* pdk, void* pdv, Device dev) {
    Runtime* r = dev.kind == DeviceKind::cuda ? rt : nullptr;
    if (c.varlen)
      return attention_varlen_backward(
          view(pg, c.dtype, {tq, c.heads, c.dv}, dev), view(pq, c.dtype, {tq, c.heads, c.d}, dev),
          view(pk, c.dtype, {tk, c.kv_heads, c.d}, dev), view(pv, c.dtype, {tk, c.kv_heads, c.dv}, dev),
          view(pcq, DType::i32, {batch + 1}, dev), view(pck, DType::i32, {batch + 1}, dev),
          view(po, c.dtype, {tq, c.heads, c.dv}, dev), view(pl, DType::f32, {c.heads, tq}, dev),
          view(pdq, c.dtype, {tq, c.heads, c.d}, dev), view(pdk, c.dtype, {tk, c.kv_heads, c.d}, dev),
          view(pdv, c.dtype, {tk, c.kv_heads, c.dv}, dev), sq, sk, c.opt, deterministic, nullptr, r);
    return attention_backward(
        view(pg, c.dtype, {batch, sq, c.heads, c.dv}, dev), view(pq, c.dtype, {batch, sq, c.heads, c.d}, dev),
        view(pk, c.dtype, {batch, sk, c.kv_heads, c.d}, dev), view(pv, c.dtype, {batch, sk, c.kv_heads, c.dv}, dev),
        view(po, c.dtype, {batch, sq, c.heads, c.dv}, dev), view(pl, DType::f32, {batch, c.heads, sq}, dev),
        view(pdq, c.dtype, {batch, sq, c.heads, c.d}, dev), view(pdk, c.dtype, {batch, sk, c.kv_heads, c.d}, dev),
        view(pdv, c.dtype, {batch, sk, c.kv_heads, c.dv}, dev), c.opt, deterministic, nullptr, r);
  };
  Result3 want{std::vector<unsigned char>(std::size_t(nq) * es, 0xFF),
               std::vector<unsigned char>(std::size_t(nk) * es, 0xFF),
               std::vector<unsigned char>(std::size_t(nv) * es, 0xFF)};
  Status s = run(hg.data(), hq.data(), hk.data(), hv.data(), cq.data(), ck.data(), ho.data(), hl.data(),
                 want.dq.data(), want.dk.data(), want.dv.data(), cpu);
  EXPECT_TRUE(s.ok()) << s.to_string();

  auto indices = [](std::int64_t n) {
    std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) idx[std::size_t(i)] = i;
    return idx;
  };
  const auto iq = indices(nq), ik = indices(nk), iv = indices(nv);
  // P and dS are rounded to the input dtype before their products, as FlashAttention does.
  const double tol = c.dtype == DType::bf16 ? 2e-2 : 4e-3;
  Result3 first;
  for (int r = 0; r < runs; ++r) {
    dq.poison();
    dk.poison();
    dv.poison();
    s = run(g.get(), q.get(), k.get(), v.get(), dcq.get(), dck.get(), o.get(), lse.get(), dq.get(), dk.get(), dv.get(),
            gpu);
    EXPECT_TRUE(s.ok()) << s.to_string();
    if (!s.ok()) return first;
    EXPECT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
    Result3 got{std::vector<unsigned char>(std::size_t(nq) * es), std::vector<unsigned char>(std::size_t(nk) * es),
                std::vector<unsigned char>(std::size_t(nv) * es)};
    dq.download(got.dq.data());
    dk.download(got.dk.data());
    dv.download(got.dv.data());
    EXPECT_LE(testing::rel_l2(got.dq.data(), want.dq.data(), c.dtype, iq), tol) << "dq (NaN: never written) run " << r;
    EXPECT_LE(testing::rel_l2(got.dk.data(), want.dk.data(), c.dtype, ik), tol) << "dk (NaN: never written) run " << r;
    EXPECT_LE(testing::rel_l2(got.dv.data(), want.dv.data(), c.dtype, iv), tol) << "dv (NaN: never written) run " << r;
    // Rows that see no key (the forward's lse is -inf) get exactly zero dq. Rows whose reference dq
    // is zero for other reasons (a row seeing one key has dS = 0) only need the tolerance above.
    int zeros = 0, bad = 0;
    const float* row_lse = reinterpret_cast<const float*>(hl.data());
    for (std::int64_t i = 0; i < nq && bad < 5; ++i) {
      const std::int64_t t = i / (c.heads * c.d), h = (i / c.d) % c.heads;
      const std::int64_t at = c.varlen ? h * tq + t : ((t / sq) * c.heads + h) * sq + t % sq;
      if (!std::isinf(row_lse[at])) continue;
      ++zeros;
      const double x = load_as_double(got.dq.data(), c.dtype, i);
      if (x != 0.0) ++bad, ADD_FAILURE() << "dq[" << i << "] = " << x << ", want 0 (the row sees no key)";
    }
    if (r == 0) {
      first = got;
      std::printf("%s%s: dq %lld, dk %lld, dv %lld elements, %d dq elements of rows that see no key\n", c.what().c_str(),
                  deterministic ? " deterministic" : "", static_cast<long long>(nq), static_cast<long long>(nk),
                  static_cast<long long>(nv), zeros);
    } else if (deterministic) {
      EXPECT_EQ(got.dq, first.dq) << "dq differs in run " << r;
      EXPECT_EQ(got.dk, first.dk) << "dk differs in run " << r;
      EXPECT_EQ(got.dv, first.dv) << "dv differs in run " << r;
    }
  }
  return first;
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

Case padded(DType t, std::int64_t d, std::int64_t batch, std::int64_t h, std::int64_t hk, std::int64_t lq,
            std::int64_t lk, AttentionOptions o) {
  Case c;
  c.dtype = t;
  c.d = c.dv = d;
  c.batch = batch;
  c.heads = h;
  c.kv_heads = hk;
  c.lq = {lq};
  c.lk = {lk};
  c.opt = o;
  return c;
}

Case packed(DType t, std::int64_t d, std::int64_t h, std::int64_t hk, std::vector<std::int64_t> lq,
            std::vector<std::int64_t> lk, AttentionOptions o) {
  Case c = padded(t, d, 1, h, hk, 0, 0, o);
  c.varlen = true;
  c.lq = std::move(lq);
  c.lk = std::move(lk);
  return c;
}

TEST_F(AttentionBwdGpu, EveryHeadDimAndDtypeCausalAndNot) {
  for (DType t : {DType::bf16, DType::f16})
    for (const auto& [d, dv] : families::k_attention_bwd_head_dims)
      for (bool causal : {false, true})
        for (bool det : {false, true}) check(rt_.get(), padded(t, d, 2, 4, 2, 197, 197, opts(causal)), seed_++, det);
}

TEST_F(AttentionBwdGpu, QueriesAndKeysOfDifferentLengths) {
  for (bool causal : {false, true})
    for (bool det : {false, true}) {
      check(rt_.get(), padded(DType::bf16, 128, 2, 4, 4, 77, 300, opts(causal)), seed_++, det);
      check(rt_.get(), padded(DType::bf16, 64, 1, 4, 4, 1, 1000, opts(causal)), seed_++, det);
      check(rt_.get(), padded(DType::f16, 96, 1, 2, 2, 15, 64, opts(causal)), seed_++, det);
    }
}

TEST_F(AttentionBwdGpu, OddHeadTokenCounts) {
  // heads * total_q odd: Dsum's words in the workspace are padded so that the dQ accumulator after
  // them stays aligned for the vector reductions.
  for (bool causal : {false, true})
    for (bool det : {false, true}) {
      check(rt_.get(), padded(DType::bf16, 128, 1, 1, 1, 301, 301, opts(causal)), seed_++, det);
      check(rt_.get(), padded(DType::f16, 64, 3, 1, 1, 77, 77, opts(causal)), seed_++, det);
      check(rt_.get(), packed(DType::bf16, 64, 1, 1, {33, 100}, {33, 100}, opts(causal)), seed_++, det);
    }
}

TEST_F(AttentionBwdGpu, FullyMaskedRowsGiveZerosNotNaN) {
  for (bool det : {false, true}) {
    // Causal with more queries than keys: the first lq - lk rows see nothing.
    check(rt_.get(), padded(DType::bf16, 128, 2, 4, 4, 300, 100, opts(true)), seed_++, det);
    check(rt_.get(), padded(DType::f16, 64, 1, 4, 1, 150, 20, opts(true)), seed_++, det);
    // Window (0, 0) with more queries than keys; a window right of every key.
    check(rt_.get(), padded(DType::bf16, 128, 1, 2, 2, 200, 50, opts(false, 0, 0)), seed_++, det);
    // Packed sequences without keys or without queries.
    check(rt_.get(), packed(DType::bf16, 64, 4, 2, {30, 0, 70, 5}, {0, 40, 70, 0}, opts(false)), seed_++, det);
  }
}

TEST_F(AttentionBwdGpu, GqaRatiosOneTwoFourEight) {
  for (std::int64_t ratio : {1, 2, 4, 8})
    for (bool causal : {false, true}) {
      check(rt_.get(), padded(DType::bf16, 128, 2, 8, 8 / ratio, 256, 256, opts(causal)), seed_++, causal);
      check(rt_.get(), packed(DType::f16, 64, 8, 8 / ratio, {100, 7, 260}, {130, 7, 300}, opts(causal)), seed_++,
            !causal);
    }
}

TEST_F(AttentionBwdGpu, SlidingWindowsAndSoftcap) {
  for (DType t : {DType::bf16, DType::f16})
    for (bool det : {false, true}) {
      check(rt_.get(), padded(t, 128, 2, 4, 2, 500, 500, opts(false, 100, 0)), seed_++, det);
      check(rt_.get(), padded(t, 128, 2, 4, 2, 500, 500, opts(true, 63)), seed_++, det);
      check(rt_.get(), padded(t, 64, 1, 4, 4, 300, 300, opts(false, 32, 17)), seed_++, det);
      check(rt_.get(), padded(t, 64, 1, 4, 4, 300, 300, opts(false, -1, 40)), seed_++, det);
      check(rt_.get(), padded(t, 96, 1, 4, 4, 300, 300, opts(false, 40, -1)), seed_++, det);
      check(rt_.get(), padded(t, 128, 2, 4, 4, 256, 256, opts(false, -1, -1, 5.0, 0.3)), seed_++, det);
      check(rt_.get(), padded(t, 80, 1, 4, 4, 130, 260, opts(true, -1, -1, 30.0)), seed_++, det);
    }
}

TEST_F(AttentionBwdGpu, PackedSequencesOfUnevenLengths) {
  for (DType t : {DType::bf16, DType::f16})
    for (const auto& [d, dv] : families::k_attention_bwd_head_dims) {
      check(rt_.get(), packed(t, d, 4, 2, {1, 129, 0, 64, 300}, {1, 129, 5, 64, 300}, opts(true)), seed_++, false);
      check(rt_.get(), packed(t, d, 4, 1, {17, 200, 3}, {250, 33, 0}, opts(false)), seed_++, true);
    }
  check(rt_.get(), packed(DType::bf16, 128, 8, 2, {10, 300, 128, 50}, {300, 10, 128, 51}, opts(true)), seed_++);
  check(rt_.get(), packed(DType::bf16, 128, 8, 2, {10, 300, 128}, {300, 10, 128}, opts(false, 20, 5, 10.0)), seed_++,
        true);
}

TEST_F(AttentionBwdGpu, DeterministicModeIsBitwiseIdenticalOverTenRuns) {
  // Many key tiles add into each query tile (long keys, GQA, packed), where atomics would reorder.
  check(rt_.get(), padded(DType::bf16, 128, 2, 8, 2, 512, 2048, opts(false)), seed_++, true, 10);
  check(rt_.get(), padded(DType::f16, 64, 1, 16, 16, 1024, 1024, opts(true)), seed_++, true, 10);
  check(rt_.get(), packed(DType::bf16, 96, 4, 1, {700, 33, 1200}, {900, 2000, 1200}, opts(false, 300, 40, 8.0)),
        seed_++, true, 10);
  // Head dims of the sm_90a kernel (used where the device has it): 32 key blocks a query tile, a
  // causal window with softcap, and packed sequences of uneven lengths.
  check(rt_.get(), padded(DType::bf16, 128, 1, 4, 2, 1000, 4096, opts(false)), seed_++, true, 10);
  check(rt_.get(), padded(DType::f16, 64, 2, 4, 4, 1500, 1500, opts(false, 300, 0, 8.0)), seed_++, true, 10);
  check(rt_.get(), packed(DType::bf16, 128, 4, 4, {700, 1, 1200}, {900, 2000, 1200}, opts(true)), seed_++, true, 10);
}

TEST_F(AttentionBwdGpu, GpuLimitsAreTypedErrorsBeforeAnyLaunch) {
  DeviceBuffer buf(1 << 23);
  buf.poison();
  auto at = [&](int slot) { return static_cast<char*>(buf.get()) + slot * (1 << 19); };
  auto call = [&](DType t, std::int64_t d, std::int64_t dv) {
    auto v4 = [&](int slot, std::int64_t last) {
      return TensorView::contiguous(at(slot), t, {1, 16, 2, last}, Device::cuda(0));
    };
    auto lse = TensorView::contiguous(at(5), DType::f32, {1, 2, 16}, Device::cuda(0));
    return attention_backward(v4(0, dv), v4(1, d), v4(2, d), v4(3, dv), v4(4, dv), lse, v4(6, d), v4(7, d), v4(8, dv),
                              {}, false, nullptr, rt_.get())
        .code();
  };
  EXPECT_EQ(call(DType::f32, 128, 128), Code::unsupported_dtype);
  EXPECT_EQ(call(DType::bf16, 32, 32), Code::invalid_argument);
  EXPECT_EQ(call(DType::bf16, 192, 128), Code::invalid_argument);
  EXPECT_EQ(call(DType::bf16, 256, 256), Code::invalid_argument);
  ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
  std::vector<unsigned char> got(1 << 23);
  buf.download(got.data());
  for (unsigned char b : got) ASSERT_EQ(b, 0xFF) << "an error wrote a buffer";
}

}  // namespace
}  // namespace kiln
