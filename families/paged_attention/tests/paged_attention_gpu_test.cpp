// The paged cache's kernels on the GPU against the host references (the same ops on host tensors,
// fp64) with fresh random data and poisoned outputs: reshape_and_cache (f16, bf16, fp8 e4m3, int32
// and int64 slots, skipped slots, rows at a stride), copy_blocks, swap_blocks (to pinned host
// memory and back, pairs on the GPU or pinned), merge_state (and in place),
// paged_decode over every page size, batch sizes 1 to 33, GQA groups 1, 4 and 8, odd context
// lengths (empty ones included), 1 to 16 queries with causal and window masks, chunked prefill
// (up to 200 causal queries over paged contexts), softcap, split
// counts forced and the heuristic's, a caller-given workspace or the stream's; repeated runs
// must give the same bytes; the contiguous decode path on the same keys; and the cascade (shared
// prefix once, own keys apart, merged; both the composition of ops and paged_cascade_decode)
// against the whole context.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "families/attention/ops.h"
#include "families/paged_attention/ops.h"
#include "families/paged_attention/paged_attention.h"
#include "jit/driver.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

class PagedAttentionGpu : public testing::GpuFixture {};

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

// A host array and its device copy.
struct Pair {
  DType t;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> host;
  std::unique_ptr<DeviceBuffer> dev;
  Pair(DType t_, std::vector<std::int64_t> s) : t(t_), shape(std::move(s)) {
    std::int64_t n = 1;
    for (auto x : shape) n *= x;
    host.assign(std::size_t(std::max<std::int64_t>(n, 1)) * dtype_size(t), 0);
    dev = std::make_unique<DeviceBuffer>(host.size());
  }
  std::int64_t numel() const { return std::int64_t(host.size() / dtype_size(t)); }
  void up() { dev->upload(host.data()); }
  std::vector<unsigned char> down() const {
    std::vector<unsigned char> out(host.size());
    dev->download(out.data());
    return out;
  }
  TensorView h() { return view(host.data(), t, shape, Device::cpu()); }
  TensorView d() const { return view(dev->get(), t, shape, Device::cuda(0)); }
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(host.data());
  }
};

void randomize(Pair& p, std::mt19937& rng, float scale = 1.0f) {
  p.host = testing::random_bytes(p.t, p.numel(), rng, scale);
}

double rel_l2(const std::vector<unsigned char>& got, const std::vector<unsigned char>& want, DType t) {
  double num = 0, den = 0;
  const std::int64_t n = std::int64_t(got.size() / dtype_size(t));
  for (std::int64_t i = 0; i < n; ++i) {
    const double g = load_as_double(got.data(), t, i), w = load_as_double(want.data(), t, i);
    if (std::isnan(g)) return INFINITY;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

void sync() { ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS); }

TEST_F(PagedAttentionGpu, ReshapeAndCacheMatchesTheHost) {
  for (DType t : {DType::f16, DType::bf16})
    for (bool fp8 : {false, true})
      for (DType index : {DType::i32, DType::i64})
        for (std::int64_t page : {1, 16, 128}) {
          SCOPED_TRACE(std::string(dtype_name(t)) + (fp8 ? " fp8" : "") + " " + dtype_name(index) + " page " +
                       std::to_string(page) + " seed " + std::to_string(seed_));
          const std::int64_t tokens = 37, hk = 4, d = 128, blocks = 64 * 128 / page + 1, width = 3 * hk * d;
          Pair qkv(t, {tokens, width}), slots(index, {tokens});
          randomize(qkv, rng_, 2.0f);
          std::vector<std::int64_t> all(std::size_t(blocks * page));
          std::iota(all.begin(), all.end(), 0);
          std::shuffle(all.begin(), all.end(), rng_);
          for (std::int64_t i = 0; i < tokens; ++i)
            store_from_double(slots.host.data(), index, i, i % 5 == 3 ? -1.0 : double(all[std::size_t(i)]));
          const DType ct = fp8 ? DType::u8 : t;
          Pair kc(ct, {blocks, page, hk, d}), vc(ct, {blocks, page, hk, d}), ks(DType::f32, {1}), vs(DType::f32, {1});
          ks.as<float>()[0] = 0.01f;
          vs.as<float>()[0] = 0.003f;
          for (Pair* p : {&qkv, &slots, &ks, &vs}) p->up();
          kc.dev->poison();
          vc.dev->poison();
          std::fill(kc.host.begin(), kc.host.end(), 0xFF);
          std::fill(vc.host.begin(), vc.host.end(), 0xFF);
          // k and v are column slices of the fused qkv rows.
          auto slice = [&](Pair& p, bool dev, std::int64_t col) {
            TensorView v = dev ? p.d() : p.h();
            v.rank = 3;
            v.shape[0] = tokens;
            v.shape[1] = hk;
            v.shape[2] = d;
            v.strides[0] = width;
            v.strides[1] = d;
            v.strides[2] = 1;
            v.data = static_cast<unsigned char*>(v.data) + col * std::int64_t(dtype_size(t));
            return v;
          };
          const TensorView ksd = ks.d(), vsd = vs.d(), ksh = ks.h(), vsh = vs.h();
          Status s = reshape_and_cache(slice(qkv, true, hk * d), slice(qkv, true, 2 * hk * d), slots.d(), kc.d(), vc.d(),
                                       fp8 ? &ksd : nullptr, fp8 ? &vsd : nullptr, nullptr, rt_.get());
          ASSERT_TRUE(s.ok()) << s.to_string();
          sync();
          s = reshape_and_cache(slice(qkv, false, hk * d), slice(qkv, false, 2 * hk * d), slots.h(), kc.h(), vc.h(),
                                fp8 ? &ksh : nullptr, fp8 ? &vsh : nullptr);
          ASSERT_TRUE(s.ok()) << s.to_string();
          EXPECT_TRUE(kc.down() == kc.host) << "key_cache differs from the host's";
          EXPECT_TRUE(vc.down() == vc.host) << "value_cache differs from the host's";
        }
}

TEST_F(PagedAttentionGpu, CopyBlocksMatchesTheHost) {
  for (std::int64_t page : {1, 16, 128}) {
    SCOPED_TRACE("page " + std::to_string(page) + " seed " + std::to_string(seed_));
    const std::int64_t blocks = 40;
    Pair kc(DType::bf16, {blocks, page, 2, 64}), vc(DType::bf16, {blocks, page, 2, 64}), pairs(DType::i64, {5, 2});
    randomize(kc, rng_);
    randomize(vc, rng_);
    const std::int64_t pr[10] = {0, 20, 3, 21, 7, 39, 8, 22, 19, 23};
    std::memcpy(pairs.host.data(), pr, sizeof(pr));
    for (Pair* p : {&kc, &vc, &pairs}) p->up();
    ASSERT_TRUE(copy_blocks(kc.d(), vc.d(), pairs.d(), nullptr, rt_.get()).ok());
    sync();
    ASSERT_TRUE(copy_blocks(kc.h(), vc.h(), pairs.h()).ok());
    EXPECT_TRUE(kc.down() == kc.host);
    EXPECT_TRUE(vc.down() == vc.host);
  }
}

// Page-locked host memory, mapped for the GPU (cuMemHostAlloc).
struct PinnedBuffer {
  void* p = nullptr;
  std::size_t bytes;
  explicit PinnedBuffer(std::size_t n) : bytes(n) {
    const jit::Driver* d = jit::Driver::get().value();
    EXPECT_EQ(d->mem_host_alloc(&p, n, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP), CUDA_SUCCESS);
  }
  ~PinnedBuffer() {
    if (p) jit::Driver::get().value()->mem_free_host(p);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
};

TEST_F(PagedAttentionGpu, SwapBlocksToPinnedHostMemoryAndBack) {
  for (std::int64_t page : {1, 16, 128}) {
    SCOPED_TRACE("page " + std::to_string(page) + " seed " + std::to_string(seed_));
    const std::int64_t blocks = 40, host_blocks = 24, heads = 2, d = 64;
    const std::size_t block_bytes = std::size_t(page * heads * d * 2);
    Pair kc(DType::bf16, {blocks, page, heads, d}), vc(DType::bf16, {blocks, page, heads, d});
    Pair kc2(DType::bf16, {blocks, page, heads, d}), vc2(DType::bf16, {blocks, page, heads, d});
    randomize(kc, rng_);
    randomize(vc, rng_);
    for (Pair* p : {&kc, &vc, &kc2, &vc2}) p->up();
    PinnedBuffer hk(host_blocks * block_bytes), hv(host_blocks * block_bytes), hpairs(64);
    ASSERT_TRUE(hk.p && hv.p && hpairs.p);
    std::memset(hk.p, 0xAB, hk.bytes);
    std::memset(hv.p, 0xAB, hv.bytes);
    const TensorView hkv = view(hk.p, DType::bf16, {host_blocks, page, heads, d}, Device::cpu());
    const TensorView hvv = view(hv.p, DType::bf16, {host_blocks, page, heads, d}, Device::cpu());
    // Out: device blocks -> host blocks, pairs in device memory.
    const std::int32_t out_pairs[8] = {0, 5, 17, 0, 39, 23, 8, 11};
    Pair pairs(DType::i32, {4, 2});
    std::memcpy(pairs.host.data(), out_pairs, sizeof(out_pairs));
    pairs.up();
    Status s = swap_blocks(kc.d(), vc.d(), hkv, hvv, pairs.d(), nullptr, rt_.get());
    ASSERT_TRUE(s.ok()) << s.to_string();
    sync();
    for (int i = 0; i < 4; ++i) {
      const std::size_t src = std::size_t(out_pairs[2 * i]), dst = std::size_t(out_pairs[2 * i + 1]);
      EXPECT_EQ(std::memcmp(static_cast<unsigned char*>(hk.p) + dst * block_bytes, kc.host.data() + src * block_bytes,
                            block_bytes), 0) << "key block " << src << " -> host " << dst;
      EXPECT_EQ(std::memcmp(static_cast<unsigned char*>(hv.p) + dst * block_bytes, vc.host.data() + src * block_bytes,
                            block_bytes), 0) << "value block " << src << " -> host " << dst;
    }
    EXPECT_EQ(static_cast<unsigned char*>(hk.p)[1 * block_bytes], 0xAB) << "host block 1 was not a destination";
    // In: host blocks -> another device pool, pairs in pinned host memory (checked on the host).
    const std::int32_t in_pairs[8] = {5, 30, 0, 2, 23, 3, 11, 39};
    std::memcpy(hpairs.p, in_pairs, sizeof(in_pairs));
    s = swap_blocks(hkv, hvv, kc2.d(), vc2.d(), view(hpairs.p, DType::i32, {4, 2}, Device::cpu()), nullptr, rt_.get());
    ASSERT_TRUE(s.ok()) << s.to_string();
    sync();
    const auto k2 = kc2.down(), v2 = vc2.down();
    for (int i = 0; i < 4; ++i) {
      const std::size_t orig = std::size_t(out_pairs[2 * i]), dst = std::size_t(in_pairs[2 * i + 1]);
      EXPECT_EQ(std::memcmp(k2.data() + dst * block_bytes, kc.host.data() + orig * block_bytes, block_bytes), 0)
          << "key block " << orig << " back as " << dst;
      EXPECT_EQ(std::memcmp(v2.data() + dst * block_bytes, vc.host.data() + orig * block_bytes, block_bytes), 0);
    }
    EXPECT_TRUE(std::equal(k2.begin(), k2.begin() + std::ptrdiff_t(block_bytes), kc2.host.begin()))
        << "device block 0 was not a destination";
    // Typed errors before any launch: pageable host memory, a host pair past its pool, a repeated
    // destination.
    std::vector<unsigned char> pageable(std::size_t(host_blocks) * block_bytes);
    const TensorView pv = view(pageable.data(), DType::bf16, {host_blocks, page, heads, d}, Device::cpu());
    EXPECT_EQ(swap_blocks(kc.d(), vc.d(), pv, pv, pairs.d(), nullptr, rt_.get()).code(), Code::invalid_argument);
    const std::int32_t bad[4] = {0, 24, 1, 2};
    std::memcpy(hpairs.p, bad, sizeof(bad));
    EXPECT_EQ(swap_blocks(kc.d(), vc.d(), hkv, hvv, view(hpairs.p, DType::i32, {2, 2}, Device::cpu()), nullptr, rt_.get())
                  .code(),
              Code::invalid_argument);
    const std::int32_t twice[4] = {0, 2, 1, 2};
    std::memcpy(hpairs.p, twice, sizeof(twice));
    EXPECT_EQ(swap_blocks(kc.d(), vc.d(), hkv, hvv, view(hpairs.p, DType::i32, {2, 2}, Device::cpu()), nullptr, rt_.get())
                  .code(),
              Code::invalid_argument);
  }
}

// What a swap costs: 256 blocks of 16 tokens x 8 heads x 128 (bf16, 32 KiB per block and cache)
// out to pinned memory and back, against the bus. Prints; asserts only that the copies landed.
TEST_F(PagedAttentionGpu, SwapBlocksBandwidth) {
  const std::int64_t blocks = 512, moved = 256, page = 16, heads = 8, d = 128;
  const std::size_t block_bytes = std::size_t(page * heads * d * 2);
  Pair kc(DType::bf16, {blocks, page, heads, d}), vc(DType::bf16, {blocks, page, heads, d});
  Pair out_pairs(DType::i32, {moved, 2}), in_pairs(DType::i32, {moved, 2});
  randomize(kc, rng_);
  randomize(vc, rng_);
  // Out: device block 2i -> host block i; in: host block i -> device block 2i.
  for (std::int64_t i = 0; i < moved; ++i) {
    out_pairs.as<std::int32_t>()[2 * i] = in_pairs.as<std::int32_t>()[2 * i + 1] = std::int32_t(2 * i);
    out_pairs.as<std::int32_t>()[2 * i + 1] = in_pairs.as<std::int32_t>()[2 * i] = std::int32_t(i);
  }
  for (Pair* p : {&kc, &vc, &out_pairs, &in_pairs}) p->up();
  PinnedBuffer hk(std::size_t(moved) * block_bytes), hv(std::size_t(moved) * block_bytes);
  const TensorView hkv = view(hk.p, DType::bf16, {moved, page, heads, d}, Device::cpu());
  const TensorView hvv = view(hv.p, DType::bf16, {moved, page, heads, d}, Device::cpu());
  const jit::Driver* drv = jit::Driver::get().value();
  CUevent e0, e1;
  ASSERT_EQ(drv->event_create(&e0, CU_EVENT_DEFAULT), CUDA_SUCCESS);
  ASSERT_EQ(drv->event_create(&e1, CU_EVENT_DEFAULT), CUDA_SUCCESS);
  for (int dir = 0; dir < 2; ++dir) {
    std::vector<float> ms;
    for (int rep = 0; rep < 6; ++rep) {
      drv->event_record(e0, nullptr);
      const Status s = dir == 0 ? swap_blocks(kc.d(), vc.d(), hkv, hvv, out_pairs.d(), nullptr, rt_.get())
                                : swap_blocks(hkv, hvv, kc.d(), vc.d(), in_pairs.d(), nullptr, rt_.get());
      ASSERT_TRUE(s.ok()) << s.to_string();
      drv->event_record(e1, nullptr);
      ASSERT_EQ(drv->event_synchronize(e1), CUDA_SUCCESS);
      float t = 0;
      drv->event_elapsed_time(&t, e0, e1);
      if (rep > 0) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double bytes = 2.0 * double(moved) * double(block_bytes);
    std::printf("swap_blocks %s: %lld blocks x 2 caches x %zu KiB = %.1f MiB in %.3f ms (median), %.1f GB/s\n",
                dir == 0 ? "GPU -> pinned host" : "pinned host -> GPU", static_cast<long long>(moved), block_bytes / 1024,
                bytes / 1048576.0, ms[ms.size() / 2], bytes / (ms[ms.size() / 2] * 1e-3) / 1e9);
  }
  // Out then in: block 2i was written back from host block i, which holds block 2i.
  const auto k = kc.down();
  EXPECT_TRUE(k == kc.host);
  drv->event_destroy(e0);
  drv->event_destroy(e1);
}

TEST_F(PagedAttentionGpu, MergeStateMatchesTheHost) {
  for (DType t : {DType::f16, DType::bf16})
    for (std::int64_t d : {64, 128, 256}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " d " + std::to_string(d) + " seed " + std::to_string(seed_));
      const std::int64_t tokens = 33, heads = 8;
      Pair va(t, {tokens, heads, d}), vb(t, {tokens, heads, d}), sa(DType::f32, {tokens, heads}),
          sb(DType::f32, {tokens, heads}), vo(t, {tokens, heads, d}), so(DType::f32, {tokens, heads});
      randomize(va, rng_);
      randomize(vb, rng_);
      randomize(sa, rng_, 3.0f);
      randomize(sb, rng_, 3.0f);
      sa.as<float>()[0] = -INFINITY;
      sb.as<float>()[1] = -INFINITY;
      sa.as<float>()[2] = sb.as<float>()[2] = -INFINITY;
      for (Pair* p : {&va, &vb, &sa, &sb}) p->up();
      vo.dev->poison();
      so.dev->poison();
      ASSERT_TRUE(merge_state(va.d(), sa.d(), vb.d(), sb.d(), vo.d(), so.d(), nullptr, rt_.get()).ok());
      sync();
      ASSERT_TRUE(merge_state(va.h(), sa.h(), vb.h(), sb.h(), vo.h(), so.h()).ok());
      EXPECT_LT(rel_l2(vo.down(), vo.host, t), testing::tolerance(t));
      const auto s_got = so.down();
      for (std::int64_t i = 0; i < tokens * heads; ++i) {
        const float g = reinterpret_cast<const float*>(s_got.data())[i], w = so.as<float>()[i];
        if (std::isinf(w)) EXPECT_EQ(g, w) << i;
        else EXPECT_NEAR(g, w, 1e-5 * (1 + std::abs(w))) << i;
      }
      ASSERT_TRUE(merge_state_in_place(va.d(), sa.d(), vb.d(), sb.d(), nullptr, rt_.get()).ok());
      sync();
      EXPECT_TRUE(va.down() == vo.down()) << "in place: the same bytes as out of place";
      EXPECT_TRUE(sa.down() == so.down());
    }
}

struct DecodeCase {
  DType dtype = DType::bf16;
  std::int64_t heads = 32, kv_heads = 8, d = 128, page = 16;
  std::vector<std::int64_t> lq, lk;
  bool causal = false;
  std::int64_t window_left = -1;
  double softcap = 0;
  std::int64_t splits = 0;
  bool workspace = true;
  std::string what() const {
    std::string s = std::string(dtype_name(dtype)) + " h" + std::to_string(heads) + "/" + std::to_string(kv_heads) +
                    " d" + std::to_string(d) + " page " + std::to_string(page) + " splits " + std::to_string(splits) +
                    (causal ? " causal" : "") + " window " + std::to_string(window_left) + " softcap " +
                    std::to_string(softcap) + (workspace ? "" : " stream workspace") + " lq";
    for (auto l : lq) s += " " + std::to_string(l);
    s += " lk";
    for (auto l : lk) s += " " + std::to_string(l);
    return s;
  }
};

// Runs c twice on the GPU (the second time into fresh poison: the same bytes) and once on the host.
void check_decode(Runtime* rt, const DecodeCase& c, std::mt19937& rng, unsigned seed) {
  SCOPED_TRACE(c.what() + " seed " + std::to_string(seed));
  const std::int64_t batch = std::int64_t(c.lk.size());
  std::int64_t max_blocks = 1, used = 0, total_q = 0, max_q = 1, max_k = 1;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t nb = (c.lk[std::size_t(b)] + c.page - 1) / c.page;
    max_blocks = std::max(max_blocks, nb);
    used += nb;
    total_q += c.lq[std::size_t(b)];
    max_q = std::max(max_q, c.lq[std::size_t(b)]);
    max_k = std::max(max_k, c.lk[std::size_t(b)]);
  }
  const std::int64_t num_blocks = used + 5;
  Pair q(c.dtype, {total_q, c.heads, c.d}), kc(c.dtype, {num_blocks, c.page, c.kv_heads, c.d}),
      vc(c.dtype, {num_blocks, c.page, c.kv_heads, c.d}), tables(DType::i32, {batch, max_blocks}),
      lens(DType::i32, {batch}), cu(DType::i32, {batch + 1});
  randomize(q, rng);
  randomize(kc, rng);
  randomize(vc, rng);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::size_t next = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t nb = (c.lk[std::size_t(b)] + c.page - 1) / c.page;
    for (std::int64_t j = 0; j < max_blocks; ++j) tables.as<std::int32_t>()[b * max_blocks + j] = j < nb ? ids[next++] : 0;
    lens.as<std::int32_t>()[b] = std::int32_t(c.lk[std::size_t(b)]);
    cu.as<std::int32_t>()[b + 1] = cu.as<std::int32_t>()[b] + std::int32_t(c.lq[std::size_t(b)]);
  }
  const bool one = total_q == batch && max_q == 1;
  PagedDecodeShape shape{.heads = c.heads, .kv_heads = c.kv_heads, .head_dim = c.d, .page_size = c.page,
                         .num_blocks = num_blocks, .max_blocks = max_blocks};
  auto lens_span = std::span<const std::int32_t>(lens.as<std::int32_t>(), std::size_t(batch));
  auto cu_span = one ? std::span<const std::int32_t>() : std::span<const std::int32_t>(cu.as<std::int32_t>(), std::size_t(batch + 1));
  auto tab_span = std::span<const std::int32_t>(tables.as<std::int32_t>(), std::size_t(batch * max_blocks));
  auto plan = plan_paged_decode(shape, lens_span, cu_span, tab_span, 0);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  PagedDecodeOptions o;
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.softcap = c.softcap;
  o = plan->options(o);
  if (c.splits) o.splits = c.splits;
  const std::int64_t ws_elems = families::paged_decode_workspace_elements(o.splits ? o.splits : 1024, total_q, c.heads, c.d);
  for (Pair* p : {&q, &kc, &vc, &tables, &lens, &cu}) p->up();
  Pair out(c.dtype, {total_q, c.heads, c.d}), lse(DType::f32, {total_q, c.heads}), ws(DType::f32, {ws_elems});
  const TensorView cud = cu.d(), lsed = lse.d(), wsd = ws.d();
  std::vector<unsigned char> first_out, first_lse;
  for (int run = 0; run < 2; ++run) {
    out.dev->poison();
    lse.dev->poison();
    ws.dev->poison();
    const Status s = paged_decode(q.d(), kc.d(), vc.d(), tables.d(), lens.d(), one ? nullptr : &cud, out.d(), &lsed,
                                  c.workspace ? &wsd : nullptr, o, nullptr, rt);
    ASSERT_TRUE(s.ok()) << s.to_string();
    sync();
    if (run == 0) {
      first_out = out.down();
      first_lse = lse.down();
    } else {
      EXPECT_TRUE(out.down() == first_out) << "a second run wrote other bytes";
      EXPECT_TRUE(lse.down() == first_lse);
    }
  }
  const TensorView cuh = cu.h(), lseh = lse.h();
  const Status s = paged_decode(q.h(), kc.h(), vc.h(), tables.h(), lens.h(), one ? nullptr : &cuh, out.h(), &lseh, nullptr, o);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_LT(rel_l2(first_out, out.host, c.dtype), testing::tolerance(c.dtype));
  for (std::int64_t i = 0; i < total_q * c.heads; ++i) {
    const float g = reinterpret_cast<const float*>(first_lse.data())[i], w = lse.as<float>()[i];
    if (std::isinf(w)) ASSERT_EQ(g, w) << "lse " << i;
    else ASSERT_NEAR(g, w, 2e-3 * (1 + std::abs(w))) << "lse " << i;
  }
}

TEST_F(PagedAttentionGpu, DecodeEveryPageSize) {
  for (std::int64_t page : {1, 8, 16, 32, 64, 128})
    for (std::int64_t splits : {0, 1, 3}) {
      DecodeCase c;
      c.page = page;
      c.splits = splits;
      c.lq = {1, 1, 1, 1};
      c.lk = {1, 100, 4097, 777};
      check_decode(rt_.get(), c, rng_, seed_);
    }
}

TEST_F(PagedAttentionGpu, DecodeBatchesGqaAndHeadDims) {
  for (std::int64_t batch : {1, 8, 33})
    for (auto [heads, kv] : {std::pair{8, 8}, std::pair{32, 8}, std::pair{64, 8}}) {
      DecodeCase c;
      c.heads = heads;
      c.kv_heads = kv;
      for (std::int64_t b = 0; b < batch; ++b) {
        c.lq.push_back(1);
        c.lk.push_back(1 + (b * 997 + 301) % 3000);
      }
      check_decode(rt_.get(), c, rng_, seed_);
    }
  for (DType t : {DType::f16, DType::bf16})
    for (std::int64_t d : {64, 96, 256}) {
      DecodeCase c;
      c.dtype = t;
      c.d = d;
      c.heads = 16;
      c.kv_heads = 4;
      c.page = 32;
      c.lq = {1, 1};
      c.lk = {2049, 63};
      check_decode(rt_.get(), c, rng_, seed_);
    }
}

TEST_F(PagedAttentionGpu, DecodeManyQueriesMasksAndSoftcap) {
  for (std::int64_t page : {8, 16, 64}) {
    DecodeCase c;
    c.page = page;
    c.lq = {1, 4, 16, 7, 0};
    c.lk = {50, 1000, 2500, 7, 30};
    check_decode(rt_.get(), c, rng_, seed_);
    c.causal = true;
    check_decode(rt_.get(), c, rng_, seed_);
    c.window_left = 100;
    c.splits = 5;
    check_decode(rt_.get(), c, rng_, seed_);
    c.causal = false;
    c.window_left = -1;
    c.softcap = 30.0;
    c.workspace = false;
    c.splits = 2;
    check_decode(rt_.get(), c, rng_, seed_);
  }
  DecodeCase empty;
  empty.lq = {1, 1};
  empty.lk = {0, 300};  // a request without keys: zeros and lse -inf
  check_decode(rt_.get(), empty, rng_, seed_);
}

// Chunked prefill through the same op: long causal query runs appended to paged contexts, a
// whole prompt (lq == lk), a decode request beside them.
TEST_F(PagedAttentionGpu, ChunkedPrefillOverPagedContext) {
  for (std::int64_t page : {1, 16, 128})
    for (std::int64_t splits : {0, 2}) {
      DecodeCase c;
      c.heads = 16;
      c.kv_heads = 4;
      c.page = page;
      c.splits = splits;
      c.causal = true;
      c.lq = {200, 64, 1, 129};
      c.lk = {1000, 64, 500, 129};
      check_decode(rt_.get(), c, rng_, seed_);
    }
}

// The paged decode against the contiguous decode path over the same keys (one request, the keys
// laid out in order in both): the same softmax, to rounding.
TEST_F(PagedAttentionGpu, DecodeMatchesTheContiguousPath) {
  const std::int64_t lk = 8192, h = 32, hk = 8, d = 128, page = 16, blocks = lk / page;
  const DType t = DType::bf16;
  Pair q(t, {1, h, d}), kc(t, {blocks, page, hk, d}), vc(t, {blocks, page, hk, d}), table(DType::i32, {1, blocks}),
      len(DType::i32, {1});
  randomize(q, rng_);
  randomize(kc, rng_);
  randomize(vc, rng_);
  for (std::int64_t j = 0; j < blocks; ++j) table.as<std::int32_t>()[j] = std::int32_t(j);
  len.as<std::int32_t>()[0] = std::int32_t(lk);
  for (Pair* p : {&q, &kc, &vc, &table, &len}) p->up();
  Pair out(t, {1, h, d}), ref(t, {1, 1, h, d});
  out.dev->poison();
  ref.dev->poison();
  ASSERT_TRUE(paged_decode(q.d(), kc.d(), vc.d(), table.d(), len.d(), nullptr, out.d(), nullptr, nullptr, {}, nullptr,
                           rt_.get())
                  .ok());
  ASSERT_TRUE(attention(view(q.dev->get(), t, {1, 1, h, d}, Device::cuda(0)),
                        view(kc.dev->get(), t, {1, lk, hk, d}, Device::cuda(0)),
                        view(vc.dev->get(), t, {1, lk, hk, d}, Device::cuda(0)), ref.d(), nullptr, {}, nullptr, rt_.get())
                  .ok());
  sync();
  EXPECT_LT(rel_l2(out.down(), ref.down(), t), 1e-2);
}

// Cascade on the GPU: the shared prefix as one request of `batch` queries, each request's own
// keys apart, merged in place; against the whole context per request.
TEST_F(PagedAttentionGpu, CascadeEqualsTheWholeContext) {
  for (std::int64_t page : {16, 128}) {
    SCOPED_TRACE("page " + std::to_string(page) + " seed " + std::to_string(seed_));
    const std::int64_t batch = 32, h = 32, hk = 8, d = 128, prefix = 4096, own = 256;
    const std::int64_t pb = prefix / page, ob = (own + page - 1) / page, blocks = pb + batch * ob;
    const DType t = DType::bf16;
    Pair q(t, {batch, h, d}), kc(t, {blocks, page, hk, d}), vc(t, {blocks, page, hk, d});
    Pair full(DType::i32, {batch, pb + ob}), full_len(DType::i32, {batch}), own_t(DType::i32, {batch, ob}),
        own_len(DType::i32, {batch}), pre_t(DType::i32, {1, pb}), pre_len(DType::i32, {1}), pre_cu(DType::i32, {2});
    randomize(q, rng_);
    randomize(kc, rng_);
    randomize(vc, rng_);
    for (std::int64_t j = 0; j < pb; ++j) pre_t.as<std::int32_t>()[j] = std::int32_t(j);
    pre_len.as<std::int32_t>()[0] = std::int32_t(prefix);
    pre_cu.as<std::int32_t>()[1] = std::int32_t(batch);
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t mine = own - b * 7;  // uneven own lengths
      for (std::int64_t j = 0; j < pb; ++j) full.as<std::int32_t>()[b * (pb + ob) + j] = std::int32_t(j);
      for (std::int64_t j = 0; j < ob; ++j) {
        const auto id = std::int32_t(pb + b * ob + j);
        full.as<std::int32_t>()[b * (pb + ob) + pb + j] = id;
        own_t.as<std::int32_t>()[b * ob + j] = id;
      }
      full_len.as<std::int32_t>()[b] = std::int32_t(prefix + mine);
      own_len.as<std::int32_t>()[b] = std::int32_t(mine);
    }
    for (Pair* p : {&q, &kc, &vc, &full, &full_len, &own_t, &own_len, &pre_t, &pre_len, &pre_cu}) p->up();
    Pair want(t, {batch, h, d}), got(t, {batch, h, d}), mine(t, {batch, h, d}), lse(DType::f32, {batch, h}),
        mine_lse(DType::f32, {batch, h});
    for (Pair* p : {&want, &got, &mine, &lse, &mine_lse}) p->dev->poison();
    ASSERT_TRUE(paged_decode(q.d(), kc.d(), vc.d(), full.d(), full_len.d(), nullptr, want.d(), nullptr, nullptr, {},
                             nullptr, rt_.get())
                    .ok());
    PagedDecodeOptions po;
    po.max_seqlen_q = batch;
    po.max_seq_len = prefix;
    const TensorView cud = pre_cu.d(), lsed = lse.d(), mine_lsed = mine_lse.d();
    ASSERT_TRUE(paged_decode(q.d(), kc.d(), vc.d(), pre_t.d(), pre_len.d(), &cud, got.d(), &lsed, nullptr, po, nullptr,
                             rt_.get())
                    .ok());
    PagedDecodeOptions oo;
    oo.max_seq_len = own;
    ASSERT_TRUE(paged_decode(q.d(), kc.d(), vc.d(), own_t.d(), own_len.d(), nullptr, mine.d(), &mine_lsed, nullptr, oo,
                             nullptr, rt_.get())
                    .ok());
    ASSERT_TRUE(merge_state_in_place(got.d(), lse.d(), mine.d(), mine_lse.d(), nullptr, rt_.get()).ok());
    sync();
    EXPECT_LT(rel_l2(got.down(), want.down(), t), 1e-2);
    // The cascade op (prefix and own partials merged by one combine), planned, on its workspace,
    // and with the split counts forced; its lse against the whole context's.
    Pair shared_flat(DType::i32, {pb}), whole_lse(DType::f32, {batch, h});
    std::memcpy(shared_flat.host.data(), pre_t.host.data(), pre_t.host.size());
    shared_flat.up();
    Pair want2(t, {batch, h, d});
    want2.dev->poison();
    whole_lse.dev->poison();
    const TensorView wl = whole_lse.d();
    ASSERT_TRUE(paged_decode(q.d(), kc.d(), vc.d(), full.d(), full_len.d(), nullptr, want2.d(), &wl, nullptr, {}, nullptr,
                             rt_.get())
                    .ok());
    const PagedDecodeShape shape{.heads = h, .kv_heads = hk, .head_dim = d, .page_size = page, .num_blocks = blocks,
                                 .max_blocks = ob};
    auto plan = plan_paged_cascade_decode(
        shape, std::span<const std::int32_t>(shared_flat.as<std::int32_t>(), std::size_t(pb)), prefix,
        std::span<const std::int32_t>(own_len.as<std::int32_t>(), std::size_t(batch)),
        std::span<const std::int32_t>(own_t.as<std::int32_t>(), std::size_t(batch * ob)), 0);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    for (auto [sp, so] : {std::pair<std::int64_t, std::int64_t>{0, 0}, {1, 1}, {5, 3}}) {
      SCOPED_TRACE("shared_splits " + std::to_string(sp) + " splits " + std::to_string(so));
      PagedCascadeOptions co = plan->options();
      if (sp) co.shared_splits = sp, co.splits = so;
      Pair ws(DType::f32, {(co.shared_splits + co.splits) * batch * h * (d + 1)}), cas_out(t, {batch, h, d}),
          clse(DType::f32, {batch, h});
      for (Pair* p : {&ws, &cas_out, &clse}) p->dev->poison();
      const TensorView wsd = ws.d(), clsed = clse.d();
      ASSERT_TRUE(paged_cascade_decode(q.d(), kc.d(), vc.d(), shared_flat.d(), pre_len.d(), own_t.d(), own_len.d(),
                                       cas_out.d(), &clsed, &wsd, co, nullptr, rt_.get())
                      .ok());
      sync();
      EXPECT_LT(rel_l2(cas_out.down(), want2.down(), t), 1e-2);
      const auto gl = clse.down(), wlh = whole_lse.down();
      for (std::int64_t i = 0; i < batch * h; ++i)
        ASSERT_NEAR(reinterpret_cast<const float*>(gl.data())[i], reinterpret_cast<const float*>(wlh.data())[i], 1e-3)
            << "lse " << i;
    }
  }
}

}  // namespace
}  // namespace kiln
