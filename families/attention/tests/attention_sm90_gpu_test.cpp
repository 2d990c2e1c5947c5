// The sm_90a attention kernel (path wgmma, attention_fwd_sm90.cuh) on the GPU against the CPU
// reference (fp64), each variant launched explicitly by its params (the heuristic's choice, which
// must be wgmma, or another key tile or schedule set on it): every head-dim pair it has, f16 and
// bf16, both key tiles, the three schedules (overlap, the heuristic's; serial; overlap with
// pingpong), two and three consumer warpgroups, persistent blocks that walk many tiles, causal and
// not, windows, softcap, GQA 1/4/8, lq != lk, packed sequences of uneven
// lengths (empty ones included; TMA boxes that cross a sequence's end read the next sequence's
// tokens), rows that see no key, key counts that wrap the stage ring several times. Out and lse
// are poisoned before each launch. Skipped on devices other than compute capability 9.0.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "families/attention/attention.h"
#include "jit/device_info.h"
#include "tests/gpu_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

struct Case {
  DType dtype = DType::bf16;
  std::int64_t d = 128, dv = 128, heads = 4, kv_heads = 4;
  std::vector<std::int64_t> lq, lk;  // padded: one length each, every sequence
  std::int64_t batch = 1;            // padded only
  bool varlen = false, causal = false;
  std::int64_t window_left = -1, window_right = -1;
  double softcap = 0, scale = 0;
  std::string what() const {
    std::string s = std::string(dtype_name(dtype)) + " d" + std::to_string(d) + "/" + std::to_string(dv) + " h" +
                    std::to_string(heads) + "/" + std::to_string(kv_heads) + (varlen ? " varlen" : " padded") +
                    (causal ? " causal" : "") + " window(" + std::to_string(window_left) + "," +
                    std::to_string(window_right) + ") softcap " + std::to_string(softcap) + " lq";
    for (auto l : lq) s += " " + std::to_string(l);
    s += " lk";
    for (auto l : lk) s += " " + std::to_string(l);
    return s;
  }
};

Case padded(DType t, std::int64_t d, std::int64_t dv, std::int64_t batch, std::int64_t h, std::int64_t hk,
            std::int64_t lq, std::int64_t lk, bool causal, std::int64_t wl = -1, std::int64_t wr = -1,
            double softcap = 0, double scale = 0) {
  Case c;
  c.dtype = t;
  c.d = d;
  c.dv = dv;
  c.batch = batch;
  c.heads = h;
  c.kv_heads = hk;
  c.lq = {lq};
  c.lk = {lk};
  c.causal = causal;
  c.window_left = wl;
  c.window_right = causal ? 0 : wr;
  c.softcap = softcap;
  c.scale = scale;
  return c;
}

Case packed(DType t, std::int64_t d, std::int64_t dv, std::int64_t h, std::int64_t hk, std::vector<std::int64_t> lq,
            std::vector<std::int64_t> lk, bool causal, std::int64_t wl = -1, std::int64_t wr = -1, double softcap = 0) {
  Case c = padded(t, d, dv, 1, h, hk, 0, 0, causal, wl, wr, softcap);
  c.varlen = true;
  c.lq = std::move(lq);
  c.lk = std::move(lk);
  return c;
}

class AttentionSm90Gpu : public testing::GpuFixture {
 protected:
  void SetUp() override {
    GpuFixture::SetUp();
    if (IsSkipped()) return;
    const auto* info = jit::device_info(0).value();
    cc_ = info->compute_capability;
    sms_ = info->sm_count;
    if (cc_ != 90)
      GTEST_SKIP() << "the sm_90a attention kernel (path wgmma) runs on compute capability 9.0 only; this GPU is "
                   << cc_ / 10 << "." << cc_ % 10;
  }
  void check(const Case& c, int block_n = 0, int overlap = -1, int pingpong = -1, int warps = 0, int persistent = -1,
             int sm_count = 0);
  int cc_ = 0, sms_ = 0;
};

// Launches the wgmma variant (block_n and warps 0, overlap, pingpong and persistent -1: the
// heuristic's; sm_count > 0 stands in for the device's, so that persistent blocks walk many tiles)
// and the CPU reference on the same inputs; compares out by relative L2 error and lse elementwise
// (-inf exactly where the reference has it).
void AttentionSm90Gpu::check(const Case& c, int block_n, int overlap, int pingpong, int warps, int persistent,
                             int sm_count) {
  SCOPED_TRACE(c.what() + " block_n " + std::to_string(block_n) + " overlap " + std::to_string(overlap) +
               " pingpong " + std::to_string(pingpong) + " warps " + std::to_string(warps) + " persistent " +
               std::to_string(persistent) + " sm_count " + std::to_string(sm_count) + " seed " +
               std::to_string(seed_));
  const Family* f = Registry::global().find("attention");
  ASSERT_NE(f, nullptr);
  std::mt19937 rng(seed_++);
  families::AttentionProblem a;
  a.batch = c.varlen ? std::int64_t(c.lq.size()) : c.batch;
  std::vector<std::int32_t> cq{0}, ck{0};
  for (std::size_t b = 0; b < c.lq.size(); ++b) {
    a.seqlen_q = std::max(a.seqlen_q, c.lq[b]);
    a.seqlen_k = std::max(a.seqlen_k, c.lk[b]);
    cq.push_back(cq.back() + std::int32_t(c.lq[b]));
    ck.push_back(ck.back() + std::int32_t(c.lk[b]));
  }
  if (!c.varlen) cq.assign(std::size_t(a.batch + 1), 0), ck.assign(std::size_t(a.batch + 1), 0);
  a.total_q = c.varlen ? cq.back() : a.batch * a.seqlen_q;
  a.total_k = c.varlen ? ck.back() : a.batch * a.seqlen_k;
  a.heads = c.heads;
  a.kv_heads = c.kv_heads;
  a.head_dim = c.d;
  a.head_dim_v = c.dv;
  a.causal = c.causal;
  a.varlen = c.varlen;
  a.window_left = c.window_left;
  a.window_right = c.window_right;
  a.scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(c.d));
  a.softcap = c.softcap;
  Problem p = Problem::of(c.dtype, 16, a);
  p.cc = std::uint8_t(cc_);
  p.sm_count = std::uint16_t(sm_count > 0 ? sm_count : sms_);

  Params params = f->heuristic(p);
  ASSERT_EQ(params.get_str("path").value_or(""), "wgmma") << params.canonical();
  if (block_n) params.set("block_n", std::int64_t(block_n));
  if (overlap >= 0) params.set("overlap", std::int64_t(overlap));
  if (pingpong >= 0) params.set("pingpong", std::int64_t(pingpong));
  if (warps) params.set("warps", std::int64_t(warps));
  if (persistent >= 0) params.set("persistent", std::int64_t(persistent));
  ASSERT_TRUE(f->validate(params).ok()) << f->validate(params).to_string();
  ASSERT_TRUE(f->check_problem(params, p).ok()) << f->check_problem(params, p).to_string();

  const auto specs = f->buffers(params, p);
  ASSERT_EQ(specs.size(), 7u);
  std::vector<std::vector<unsigned char>> host(specs.size());
  std::vector<std::unique_ptr<DeviceBuffer>> dev;
  std::vector<void*> dptr, hptr;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto n = specs[i].elements;
    if (i < 3) host[i] = testing::random_bytes(c.dtype, n, rng);
    else if (i == 3 || i == 4) {
      const auto& cu = i == 3 ? cq : ck;
      host[i].resize(cu.size() * 4);
      std::memcpy(host[i].data(), cu.data(), host[i].size());
    } else {
      host[i].assign(std::size_t(n) * dtype_size(specs[i].dtype), 0xFF);
    }
    dev.push_back(std::make_unique<DeviceBuffer>(host[i].size()));
    if (i < 5) dev.back()->upload(host[i].data());
    else dev.back()->poison();
    dptr.push_back(dev.back()->get());
    hptr.push_back(host[i].data());
  }
  auto k = rt_->kernel(KernelSpec{"attention", params});
  ASSERT_TRUE(k.ok()) << k.status().to_string();
  Status s = rt_->launch(**k, p, dptr, nullptr);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
  std::vector<unsigned char> go(host[5].size()), gl(host[6].size());
  dev[5]->download(go.data());
  dev[6]->download(gl.data());
  s = f->cpu_reference(params, p, hptr);
  ASSERT_TRUE(s.ok()) << s.to_string();

  const std::int64_t no = specs[5].elements, nl = specs[6].elements;
  std::vector<std::int64_t> idx(static_cast<std::size_t>(no));
  for (std::int64_t i = 0; i < no; ++i) idx[std::size_t(i)] = i;
  // P is rounded to the input dtype before P V: bf16 needs more than one rounding's worth.
  const double tol = c.dtype == DType::bf16 ? 1e-2 : 2e-3;
  EXPECT_LE(testing::rel_l2(go.data(), host[5].data(), c.dtype, idx), tol) << "out (NaN: an element never written)";
  const auto* g = reinterpret_cast<const float*>(gl.data());
  const auto* w = reinterpret_cast<const float*>(host[6].data());
  int bad = 0, masked = 0;
  for (std::int64_t i = 0; i < nl && bad < 5; ++i) {
    if (std::isinf(w[i])) {
      ++masked;
      if (!(g[i] == w[i])) ++bad, ADD_FAILURE() << "lse[" << i << "] = " << g[i] << ", want " << w[i];
    } else if (!(std::abs(g[i] - w[i]) <= 1e-3f * std::max(1.0f, std::abs(w[i])))) {
      ++bad, ADD_FAILURE() << "lse[" << i << "] = " << g[i] << ", want " << w[i];
    }
  }
  std::printf("%s (%s): %lld outputs, %d rows see no key\n", c.what().c_str(), params.canonical().c_str(),
              static_cast<long long>(no), masked);
}

// The other key tile the tuning space offers for a head-dim pair (64 where the heuristic takes
// 128), or 0 when none fits.
int other_block_n(std::int64_t d, std::int64_t dv) { return families::attention_sm90_block_n(d, dv) == 128 ? 64 : 0; }

// The widest key tile three consumer warpgroups (warps 12) take at a head-dim pair in a schedule,
// 0 for none.
int three_consumer_block_n(std::int64_t d, std::int64_t dv, bool overlap) {
  for (int bn : {128, 64})
    if (families::attention_sm90_three_consumers_fit(dv, bn, overlap) &&
        families::attention_sm90_smem_bytes(d, dv, 12, bn, families::attention_sm90_stages(d, dv, 12, bn)) <=
            227 * 1024)
      return bn;
  return 0;
}

TEST_F(AttentionSm90Gpu, EveryHeadDimAndDtypeCausalAndNot) {
  for (DType t : {DType::bf16, DType::f16})
    for (const auto& [d, dv] : families::k_attention_sm90_head_dims)
      for (bool causal : {false, true}) {
        check(padded(t, d, dv, 2, 4, 2, 197, 197, causal));
        // The serial schedule and pingpong, on two consumers (three hold 128-key tiles only serially).
        check(padded(t, d, dv, 2, 4, 2, 197, 197, causal), 0, 0, 0, 8);
        check(padded(t, d, dv, 2, 4, 2, 197, 197, causal), 0, 1, 1, 8);
        if (other_block_n(d, dv)) check(padded(t, d, dv, 2, 4, 2, 197, 197, causal), other_block_n(d, dv), 1, 0, 8);
        // Persistent blocks, each walking several tiles (7 blocks for 2 x 2 x 4 tiles).
        check(padded(t, d, dv, 2, 4, 2, 197, 197, causal), 0, -1, -1, 0, 1, 7);
        check(padded(t, d, dv, 2, 4, 2, 197, 197, causal), 0, 1, 1, 8, 1, 7);
        check(padded(t, d, dv, 2, 4, 2, 197, 197, causal), 0, 0, 0, 8, 1, 7);
        // Three consumers (192 query rows a block) in each schedule, alone and persistent.
        if (const int bn = three_consumer_block_n(d, dv, true)) {
          check(padded(t, d, dv, 2, 4, 2, 197, 197, causal), bn, 1, 0, 12);
          check(padded(t, d, dv, 2, 4, 2, 197, 197, causal), bn, 1, 1, 12);
          check(padded(t, d, dv, 2, 4, 2, 450, 450, causal), bn, 1, 1, 12, 1, 5);
        }
        if (const int bn = three_consumer_block_n(d, dv, false)) {
          check(padded(t, d, dv, 2, 4, 2, 197, 197, causal), bn, 0, 0, 12);
          check(padded(t, d, dv, 2, 4, 2, 450, 450, causal), bn, 0, 0, 12, 1, 5);
        }
      }
}

TEST_F(AttentionSm90Gpu, QueriesAndKeysOfDifferentLengths) {
  for (bool causal : {false, true}) {
    check(padded(DType::bf16, 128, 128, 2, 4, 4, 77, 300, causal));
    check(padded(DType::bf16, 64, 64, 1, 4, 4, 1, 1000, causal));
    check(padded(DType::f16, 192, 128, 1, 2, 2, 15, 64, causal));
    // Many more keys than stages: the ring wraps several times.
    check(padded(DType::bf16, 128, 128, 1, 2, 2, 300, 3000, causal));
    check(padded(DType::bf16, 128, 128, 1, 2, 2, 300, 3000, causal), 0, 0, 0);
    check(padded(DType::bf16, 128, 128, 1, 2, 2, 300, 3000, causal), 0, 1, 1);
    check(padded(DType::f16, 64, 64, 2, 2, 1, 1000, 1000, causal), 64, 1, 1);
    check(padded(DType::f16, 256, 256, 1, 2, 2, 130, 1100, causal));
    // The ring's position runs on from tile to tile of a persistent block.
    check(padded(DType::bf16, 128, 128, 1, 2, 2, 300, 3000, causal), 0, -1, -1, 0, 1, 3);
    check(padded(DType::bf16, 64, 64, 2, 2, 1, 1000, 1000, causal), 64, 1, 1, 12, 1, 5);
    check(padded(DType::bf16, 64, 64, 2, 2, 1, 1000, 1000, causal), 128, 0, 0, 12, 1, 5);
  }
  // lq > lk, causal: the first lq - lk rows see no key (zeros, lse -inf).
  check(padded(DType::bf16, 128, 128, 2, 4, 4, 300, 100, true));
  check(padded(DType::f16, 256, 256, 1, 2, 1, 150, 20, true));
  check(padded(DType::bf16, 64, 64, 1, 2, 1, 257, 3, true));
}

TEST_F(AttentionSm90Gpu, GqaRatiosOneFourEight) {
  for (std::int64_t ratio : {1, 4, 8})
    for (bool causal : {false, true}) {
      check(padded(DType::bf16, 128, 128, 2, 8, 8 / ratio, 256, 256, causal));
      check(packed(DType::f16, 64, 64, 8, 8 / ratio, {100, 7, 260}, {130, 7, 300}, causal));
      check(padded(DType::bf16, 192, 192, 1, 8, 8 / ratio, 200, 200, causal));
    }
}

TEST_F(AttentionSm90Gpu, SlidingWindowsAndSoftcap) {
  for (DType t : {DType::bf16, DType::f16}) {
    check(padded(t, 128, 128, 2, 4, 2, 500, 500, false, 100, 0));
    check(padded(t, 128, 128, 2, 4, 2, 500, 500, true, 63));
    check(padded(t, 64, 64, 1, 4, 4, 300, 300, false, 32, 17));
    check(padded(t, 64, 64, 1, 4, 4, 300, 300, false, -1, 40));
    check(padded(t, 64, 64, 1, 4, 4, 300, 300, false, 40, -1));
    check(padded(t, 64, 64, 1, 4, 4, 300, 300, false, 32, 17), 64);
    check(padded(t, 128, 128, 2, 4, 2, 500, 500, true, 63), 0, 1, 1, 8);
    check(padded(t, 192, 128, 1, 4, 4, 200, 333, true, 50));
    check(padded(t, 192, 192, 1, 4, 4, 200, 333, false, 70, 10));
    // Windows that leave some rows nothing: window (0, 0) with more queries than keys.
    check(padded(t, 128, 128, 1, 2, 2, 200, 50, false, 0, 0));
    // The same with persistent blocks: tiles without a visible key between tiles with them.
    check(padded(t, 128, 128, 2, 2, 2, 600, 50, false, 0, 0), 0, -1, -1, 0, 1, 3);
    check(padded(t, 64, 64, 1, 4, 4, 700, 700, false, 32, 17), 64, 1, 1, 12, 1, 4);
    // The serial schedule: each warpgroup computes only the key tiles its rows see and hands the
    // others' stages back, alone and on persistent blocks.
    check(padded(t, 64, 64, 1, 4, 4, 700, 700, true, 127), 64, 0, 0, 12, 1, 4);
    check(padded(t, 64, 64, 1, 4, 4, 700, 700, false, 32, 17), 64, 0, 0, 12);
    check(padded(t, 128, 128, 2, 4, 2, 500, 500, true, 100), 64, 0, 0, 8);
    check(padded(t, 128, 128, 2, 2, 2, 600, 50, false, 0, 0), 64, 0, 0, 8, 1, 3);
    check(padded(t, 128, 128, 2, 4, 4, 256, 256, false, -1, -1, 5.0, 0.3));
    check(padded(t, 256, 256, 1, 4, 4, 130, 260, true, -1, -1, 30.0));
    check(padded(t, 64, 64, 1, 4, 4, 100, 100, false, -1, -1, 0, 0.01));
  }
}

TEST_F(AttentionSm90Gpu, PackedSequencesOfUnevenLengths) {
  for (DType t : {DType::bf16, DType::f16})
    for (const auto& [d, dv] : families::k_attention_sm90_head_dims) {
      check(packed(t, d, dv, 4, 2, {1, 129, 0, 64, 300}, {1, 129, 5, 64, 300}, true));
      check(packed(t, d, dv, 4, 1, {17, 200, 3}, {250, 33, 0}, false));
    }
  // lq != lk per sequence with causal (bottom-right aligned), windows and softcap.
  check(packed(DType::bf16, 128, 128, 8, 2, {10, 300, 128, 50}, {300, 10, 128, 51}, true));
  check(packed(DType::bf16, 128, 128, 8, 2, {10, 300, 128}, {300, 10, 128}, false, 20, 5, 10.0));
  check(packed(DType::bf16, 128, 128, 8, 2, {10, 300, 128}, {300, 10, 128}, false, 20, 5, 10.0), 64);
  // Short sequences side by side: every K/V box crosses into the next sequence's tokens.
  check(packed(DType::f16, 64, 64, 4, 4, {3, 5, 7, 9, 11, 13}, {5, 3, 9, 7, 13, 11}, false));
  check(packed(DType::f16, 256, 256, 4, 2, {3, 5, 7, 9, 11, 13}, {5, 3, 9, 7, 13, 11}, true));
  check(packed(DType::bf16, 128, 128, 4, 2, {1, 129, 0, 64, 300}, {1, 129, 5, 64, 300}, true), 0, 0, 0);
  check(packed(DType::bf16, 128, 128, 4, 2, {1, 129, 0, 64, 300}, {1, 129, 5, 64, 300}, true), 0, 1, 1);
  check(packed(DType::f16, 256, 256, 4, 2, {1, 129, 0, 64, 300}, {1, 129, 5, 64, 300}, false, 40, 3, 20.0), 0, 1, 1);
  // Persistent blocks over packed sequences: tiles past a short sequence's end have no rows.
  check(packed(DType::bf16, 128, 128, 4, 2, {1, 129, 0, 64, 300}, {1, 129, 5, 64, 300}, true), 0, -1, -1, 0, 1, 3);
  check(packed(DType::bf16, 128, 128, 4, 2, {1, 129, 0, 64, 300}, {1, 129, 5, 64, 300}, true), 0, 1, 1, 0, 1, 3);
  check(packed(DType::f16, 64, 64, 4, 4, {3, 5, 7, 9, 11, 13, 400}, {5, 3, 9, 7, 13, 11, 450}, true), 64, 1, 1, 12, 1,
        2);
  check(packed(DType::f16, 256, 256, 4, 2, {1, 129, 0, 64, 300}, {1, 129, 5, 64, 300}, false, 40, 3, 20.0), 0, 0, 0,
        0, 1, 2);
}

}  // namespace
}  // namespace kiln
