// The LoRA families on the GPU, fresh random data every run:
//  - every catalog variant of lora_shrink and lora_gemm that runs on this device (all four paths
//    on sm_90a; mma.sync also runs there) against the family's CPU reference on the same inputs,
//    outputs poisoned (NaN bytes) first so an element never written fails: one adapter with rank
//    1 (B rows of 2 bytes: the elementwise tail loads), ragged sizes; three adapters with merged
//    QKV slices and a bias, at 300 rows and at 9 (the decode path's split-K with slices); sixteen
//    adapters over 16 decode rows with ranks up to 128 (the shrink's passes spread over blocks);
//    the core path's t with ragged sizes, slices and ranks of one and two 64-column chunks; the
//    shrink's t;
//  - lora_linear through the op against the fp64 reference of tests/lora_reference.h at ranks 1,
//    8, 64 and 128 for 1, 16 and 300 rows, k and n not multiples of any tile, scale 0;
//  - lora_linear_multi for a decode batch (unsorted rows, 16 adapters of ranks 8 to 128, rows
//    without an adapter) and a prefill batch (segments), with 1, 2 and 3 slices;
//  - the same call twice gives the same bits (the shrink's partial sums have a fixed order).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "families/lora/lora.h"
#include "families/lora/ops.h"
#include "families/lora/tests/lora_reference.h"
#include "jit/device_info.h"
#include "kiln/family.h"
#include "tests/gpu_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;
using testing::lora::Case;
using testing::lora::draw;
using testing::lora::rel_l2;
namespace l = families::lora;

const jit::Driver* drv() { return jit::Driver::get().value(); }

class LoraGpu : public testing::GpuFixture {
 protected:
  void SetUp() override {
    GpuFixture::SetUp();
    if (IsSkipped()) return;
    const jit::DeviceInfo* d = jit::device_info(0).value();
    cc_ = d->compute_capability;
    sms_ = d->sm_count;
    arch_ = GpuArch{cc_, cc_ == 90 ? 'a' : char(0)};
  }
  struct Dev {
    std::unique_ptr<DeviceBuffer> buf;
    std::size_t bytes;
    void* get() const { return buf->get(); }
  };
  Dev up(const void* data, std::size_t bytes) {
    Dev d{std::make_unique<DeviceBuffer>(std::max<std::size_t>(bytes, 16)), bytes};
    if (bytes) d.buf->upload(data);
    return d;
  }
  template <class T>
  Dev up(const std::vector<T>& v) {
    return up(v.data(), v.size() * sizeof(T));
  }
  Dev poisoned(std::size_t bytes) {
    Dev d{std::make_unique<DeviceBuffer>(bytes), bytes};
    d.buf->poison();
    return d;
  }
  std::vector<unsigned char> down(const Dev& d) {
    EXPECT_EQ(drv()->ctx_synchronize(), CUDA_SUCCESS);
    std::vector<unsigned char> out(d.bytes);
    d.buf->download(out.data());
    return out;
  }
  static TensorView gpu(const Dev& d, DType t, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(d.get(), t, shape, Device::cuda(0));
  }
  // Runs `params` of family `name` on device buffers and returns its output (the last buffer).
  std::vector<unsigned char> launch(const char* name, const Params& params, Problem p, std::vector<Dev>& bufs) {
    p.cc = std::uint8_t(cc_);
    p.sm_count = std::uint16_t(sms_);
    const Family& f = *Registry::global().find(name);
    const Status ok = f.check_problem(params, p);
    EXPECT_TRUE(ok.ok()) << params.canonical() << ": " << ok.to_string();
    if (!ok.ok()) return {};
    auto k = rt_->kernel(KernelSpec{name, params});
    EXPECT_TRUE(k.ok()) << k.status().to_string();
    if (!k.ok()) return {};
    std::vector<void*> ptrs;
    for (auto& b : bufs) ptrs.push_back(b.get());
    const Status s = rt_->launch(**k, p, ptrs, nullptr);
    EXPECT_TRUE(s.ok()) << s.to_string();
    return down(bufs.back());
  }
  // Every catalog variant of `name` that runs here, on problem p with the buffers the family
  // lists (random inputs; integer ones below their bound; the output poisoned), against the CPU
  // reference. `fix` may overwrite inputs (indices with -1) before the upload; `extra` variants
  // (outside the catalog) run too.
  template <class Fix>
  void every_variant(const char* name, const Problem& p, Fix fix, std::vector<Params> extra = {}) {
    const Family& f = *Registry::global().find(name);
    const auto specs = f.buffers(f.heuristic(p), p);
    std::vector<std::vector<unsigned char>> host;
    for (const auto& b : specs) {
      if (b.role == BufferRole::output) {
        host.emplace_back(std::size_t(b.elements) * dtype_size(b.dtype), 0xFF);
      } else if (is_floating(b.dtype)) {
        host.push_back(testing::random_bytes(b.dtype, b.elements, rng_, 0.5f));
      } else {
        std::vector<unsigned char> v(std::size_t(b.elements) * 4);
        std::uniform_int_distribution<std::int64_t> d(0, std::max<std::int64_t>(1, b.index_bound) - 1);
        for (std::int64_t i = 0; i < b.elements; ++i) store_from_double(v.data(), b.dtype, i, double(d(rng_)));
        host.push_back(std::move(v));
      }
    }
    fix(specs, host);
    std::vector<void*> hp;
    for (auto& h : host) hp.push_back(h.data());
    Problem hprob = p;
    ASSERT_TRUE(f.cpu_reference(f.heuristic(p), hprob, hp).ok());
    const auto& want = host.back();
    const DType ot = specs.back().dtype;
    const std::int64_t n_out = specs.back().elements;
    int ran = 0;
    std::vector<Params> variants = f.catalog();
    variants.insert(variants.end(), extra.begin(), extra.end());
    for (const Params& v : variants) {
      if (!f.runs_on(v, arch_)) continue;
      Problem pv = p;
      pv.cc = std::uint8_t(cc_);
      if (!f.check_problem(v, pv).ok()) continue;  // the other dtype
      std::vector<Dev> bufs;
      for (std::size_t i = 0; i + 1 < host.size(); ++i) bufs.push_back(up(host[i]));
      bufs.push_back(poisoned(host.back().size()));
      const auto got = launch(name, v, p, bufs);
      ASSERT_EQ(got.size(), want.size());
      double num = 0, den = 0;
      std::int64_t nan = 0;
      for (std::int64_t i = 0; i < n_out; ++i) {
        const double g = load_as_double(got.data(), ot, i), w = load_as_double(want.data(), ot, i);
        if (std::isnan(g)) {
          ++nan;
          continue;
        }
        num += (g - w) * (g - w);
        den += w * w;
      }
      const double err = std::sqrt(num / std::max(den, 1e-30));
      EXPECT_EQ(nan, 0) << name << " " << v.canonical() << " left elements unwritten (seed " << seed_ << ")";
      EXPECT_LT(err, ot == DType::f32 ? 1e-5 : testing::tolerance(ot))
          << name << " " << v.canonical() << " on " << f.signature(p) << " (seed " << seed_ << ")";
      ++ran;
    }
    EXPECT_GT(ran, 0) << name << ": no catalog variant runs on this device";
  }
  int cc_ = 0, sms_ = 0;
  GpuArch arch_;
};

// Sets the first buffer named `name` to -1 at every third element: rows without an adapter.
void some_without_adapter(const std::vector<BufferSpec>& specs, std::vector<std::vector<unsigned char>>& host) {
  for (std::size_t i = 0; i < specs.size(); ++i)
    if (specs[i].name == "idx" && specs[i].elements > 1)
      for (std::int64_t e = 0; e < specs[i].elements; e += 3) store_from_double(host[i].data(), DType::i32, e, -1.0);
}

TEST_F(LoraGpu, EveryGemmVariantMatchesTheReference) {
  for (DType t : {DType::bf16, DType::f16}) {
    every_variant("lora_gemm",
                  Problem::of(t, 16, l::LoraGemmProblem{.m = 37, .n = 136, .k = 392, .r = 1, .splits = 3, .scale = 2.0}),
                  some_without_adapter);
    every_variant("lora_gemm",
                  Problem::of(t, 16, l::LoraGemmProblem{.m = 300, .n = 200, .k = 264, .r = 24, .adapters = 3,
                                                        .slices = 3, .splits = 2, .multi = 1, .bias = 1, .n1 = 136,
                                                        .n2 = 168}),
                  some_without_adapter);
    every_variant("lora_gemm",
                  Problem::of(t, 16, l::LoraGemmProblem{.m = 16, .n = 520, .k = 1024, .r = 128, .adapters = 16,
                                                        .splits = 16, .multi = 1}),
                  some_without_adapter);
    // Decode-sized rows over merged QKV slices with a bias (the decode path's finishing rows).
    every_variant("lora_gemm",
                  Problem::of(t, 16, l::LoraGemmProblem{.m = 9, .n = 200, .k = 2056, .r = 20, .adapters = 5,
                                                        .slices = 3, .splits = 7, .multi = 1, .bias = 1, .n1 = 136,
                                                        .n2 = 168}),
                  some_without_adapter);
    // The core path (t given): ragged m, n and k with a bias; merged QKV slices on 128-column
    // boundaries with a rank of two chunks (the second past B's 144-byte rows); gate_up halves.
    every_variant("lora_gemm",
                  Problem::of(t, 16, l::LoraGemmProblem{.m = 300, .n = 392, .k = 520, .r = 24, .bias = 1, .t = 1}),
                  some_without_adapter);
    every_variant("lora_gemm",
                  Problem::of(t, 16, l::LoraGemmProblem{.m = 200, .n = 440, .k = 264, .r = 72, .slices = 3, .t = 1,
                                                        .n1 = 128, .n2 = 256}),
                  some_without_adapter);
    every_variant("lora_gemm",
                  Problem::of(t, 16, l::LoraGemmProblem{.m = 129, .n = 1024, .k = 4096, .r = 128, .slices = 2,
                                                        .bias = 1, .t = 1, .n1 = 512}),
                  some_without_adapter);
  }
}

TEST_F(LoraGpu, EveryShrinkVariantMatchesTheReference) {
  for (DType t : {DType::bf16, DType::f16}) {
    // Partial sums with stages of 2 and 4 k-steps too (the tuner's): a split's K range ends inside
    // a stage.
    std::vector<Params> ksub;
    for (std::int64_t k : {2, 4})
      ksub.push_back(Params{{"dtype", t == DType::bf16 ? "bf16" : "f16"}, {"bm", std::int64_t(k == 2 ? 32 : 64)},
                            {"stages", std::int64_t(3)}, {"output", "partials"}, {"ksub", k}, {"wm", std::int64_t(k == 2 ? 2 : 4)}});
    every_variant("lora_shrink", Problem::of(t, 16, l::LoraShrinkProblem{.m = 37, .k = 392, .r = 1, .splits = 3}),
                  some_without_adapter, ksub);
    every_variant("lora_shrink",
                  Problem::of(t, 16, l::LoraShrinkProblem{.m = 300, .k = 264, .r = 24, .adapters = 3, .slices = 3,
                                                          .splits = 2, .multi = 1}),
                  some_without_adapter, ksub);
    every_variant("lora_shrink",
                  Problem::of(t, 16, l::LoraShrinkProblem{.m = 16, .k = 1024, .r = 128, .adapters = 16, .splits = 16,
                                                          .multi = 1}),
                  some_without_adapter);
    // t: scaled, rounded, zeros past the rank in each slice's 64-column chunks.
    every_variant("lora_shrink",
                  Problem::of(t, 16, l::LoraShrinkProblem{.m = 300, .k = 264, .r = 24, .slices = 3, .t = 1, .scale = 0.5}),
                  some_without_adapter);
    every_variant("lora_shrink",
                  Problem::of(t, 16, l::LoraShrinkProblem{.m = 77, .k = 520, .r = 72, .t = 1, .scale = 2.0}),
                  some_without_adapter);
  }
}

TEST_F(LoraGpu, LinearMatchesFp64) {
  for (DType t : {DType::bf16, DType::f16})
    for (std::int64_t m : {1, 16, 300})
      for (std::int64_t r : {1, 8, 64, 128})
        for (double scale : {2.0, 0.0}) {
          Case c{.m = m, .n = 392, .k = 520, .r = r, .bias = m == 16};
          const auto hx = draw(c.x, std::size_t(m * c.k), t, 1.0, rng_);
          const auto hw = draw(c.w, std::size_t(c.n * c.k), t, 1.0 / std::sqrt(double(c.k)), rng_);
          const auto ha = draw(c.a, std::size_t(r * c.k), t, 1.0 / std::sqrt(double(c.k)), rng_);
          const auto hb = draw(c.b, std::size_t(c.n * r), t, 1.0 / std::sqrt(double(r)), rng_);
          std::vector<double> bias_v;
          const auto hbias = draw(bias_v, std::size_t(c.n), t, 1.0, rng_);
          c.bias_v = bias_v;
          c.scales = {float(scale)};
          Dev x = up(hx), w = up(hw), a = up(ha), b = up(hb), bias = up(hbias), out = poisoned(std::size_t(m * c.n) * 2);
          const TensorView bv = gpu(bias, t, {c.n});
          const Status s = lora_linear(gpu(x, t, {m, c.k}), gpu(w, t, {c.n, c.k}), gpu(a, t, {r, c.k}),
                                       gpu(b, t, {c.n, r}), c.bias ? &bv : nullptr, gpu(out, t, {m, c.n}), scale,
                                       0, 0, nullptr, rt_.get());
          ASSERT_TRUE(s.ok()) << s.to_string();
          const auto raw = down(out);
          std::vector<std::uint16_t> got(raw.size() / 2);
          std::memcpy(got.data(), raw.data(), raw.size());
          EXPECT_LT(rel_l2(got, c.reference(), t), t == DType::bf16 ? 8e-3 : 2e-3)
              << dtype_name(t) << " m " << m << " r " << r << " scale " << scale << " seed " << seed_;
        }
}

// Merged projections through lora_linear: slice ends on the 64-column grid (the core path at 300
// rows) and off it (the wgmma path's tail), 16 rows (decode), ranks of one and two chunks.
TEST_F(LoraGpu, SlicedLinearMatchesFp64) {
  const DType t = DType::bf16;
  struct S {
    std::int64_t slices, n, end0, end1;
  };
  for (const S sl : {S{2, 512, 256, 0}, S{3, 384, 256, 320}, S{3, 300, 100, 200}})
    for (std::int64_t m : {16, 300})
      for (std::int64_t r : {16, 72}) {
        Case c{.m = m, .n = sl.n, .k = 264, .r = r, .slices = sl.slices, .end0 = sl.end0, .end1 = sl.end1,
               .bias = true};
        if (sl.slices == 2 && sl.end0 == 0) c.end0 = c.n / 2;
        c.scales = {1.5f};
        const auto hx = draw(c.x, std::size_t(m * c.k), t, 1.0, rng_);
        const auto hw = draw(c.w, std::size_t(c.n * c.k), t, 1.0 / std::sqrt(double(c.k)), rng_);
        const auto ha = draw(c.a, std::size_t(sl.slices * r * c.k), t, 1.0 / std::sqrt(double(c.k)), rng_);
        const auto hb = draw(c.b, std::size_t(c.n * r), t, 1.0 / std::sqrt(double(r)), rng_);
        const auto hbias = draw(c.bias_v, std::size_t(c.n), t, 1.0, rng_);
        Dev x = up(hx), w = up(hw), a = up(ha), b = up(hb), bias = up(hbias), out = poisoned(std::size_t(m * c.n) * 2);
        const TensorView bv = gpu(bias, t, {c.n});
        const Status s = lora_linear(gpu(x, t, {m, c.k}), gpu(w, t, {c.n, c.k}), gpu(a, t, {sl.slices * r, c.k}),
                                     gpu(b, t, {c.n, r}), &bv, gpu(out, t, {m, c.n}), 1.5, sl.end0, sl.end1, nullptr,
                                     rt_.get());
        ASSERT_TRUE(s.ok()) << s.to_string();
        const auto raw = down(out);
        std::vector<std::uint16_t> got(raw.size() / 2);
        std::memcpy(got.data(), raw.data(), raw.size());
        EXPECT_LT(rel_l2(got, c.reference(), t), 8e-3)
            << "slices " << sl.slices << " ends " << sl.end0 << ", " << sl.end1 << " m " << m << " r " << r
            << " seed " << seed_;
      }
}

TEST_F(LoraGpu, MultiAdapterDecodeAndPrefillMatchFp64) {
  const DType t = DType::bf16;
  for (std::int64_t slices : {1, 2, 3})
    for (bool decode : {true, false}) {
      Case c{.m = decode ? 16 : 1000, .n = slices == 3 ? 384 : 264, .k = 520, .r = 128, .adapters = 16,
             .slices = slices, .bias = slices != 2};
      if (slices == 2) c.end0 = c.n / 2;
      if (slices == 3) {
        c.end0 = 256;
        c.end1 = 320;
      }
      std::uniform_int_distribution<int> rank_of(0, 4);
      const int rank_set[5] = {8, 16, 32, 64, 128};
      std::uniform_real_distribution<float> sc(0.25f, 2.0f);
      for (std::int64_t a = 0; a < c.adapters; ++a) {
        c.ranks.push_back(rank_set[rank_of(rng_)]);
        c.scales.push_back(sc(rng_));
      }
      c.idx.resize(std::size_t(c.m));
      if (decode) {
        std::uniform_int_distribution<int> pick(-1, int(c.adapters) - 1);
        for (auto& v : c.idx) v = pick(rng_);
      } else {
        // Segments of 1 to 200 rows, one adapter (or none) each.
        std::uniform_int_distribution<int> len(1, 200), pick(-1, int(c.adapters) - 1);
        for (std::int64_t i = 0; i < c.m;) {
          const int a = pick(rng_);
          for (int e = len(rng_); e > 0 && i < c.m; --e) c.idx[i++] = a;
        }
      }
      const auto hx = draw(c.x, std::size_t(c.m * c.k), t, 1.0, rng_);
      const auto hw = draw(c.w, std::size_t(c.n * c.k), t, 1.0 / std::sqrt(double(c.k)), rng_);
      const auto ha = draw(c.a, std::size_t(c.adapters * slices * c.r * c.k), t, 1.0 / std::sqrt(double(c.k)), rng_);
      const auto hb = draw(c.b, std::size_t(c.adapters * c.n * c.r), t, 0.1, rng_);
      const auto hbias = draw(c.bias_v, std::size_t(c.n), t, 1.0, rng_);
      Dev x = up(hx), w = up(hw), a = up(ha), b = up(hb), bias = up(hbias), idx = up(c.idx), ranks = up(c.ranks),
          scales = up(c.scales);
      auto run = [&]() {
        Dev out = poisoned(std::size_t(c.m * c.n) * 2);
        const TensorView bv = gpu(bias, t, {c.n});
        const Status s = lora_linear_multi(
            gpu(x, t, {c.m, c.k}), gpu(w, t, {c.n, c.k}), gpu(a, t, {c.adapters, slices * c.r, c.k}),
            gpu(b, t, {c.adapters, c.n, c.r}), gpu(idx, DType::i32, {c.m}), gpu(ranks, DType::i32, {c.adapters}),
            gpu(scales, DType::f32, {c.adapters}), c.bias ? &bv : nullptr, gpu(out, t, {c.m, c.n}),
            slices >= 2 ? c.end0 : 0, slices == 3 ? c.end1 : 0, nullptr, rt_.get());
        EXPECT_TRUE(s.ok()) << s.to_string();
        const auto raw = down(out);
        std::vector<std::uint16_t> got(raw.size() / 2);
        std::memcpy(got.data(), raw.data(), raw.size());
        return got;
      };
      const auto got = run();
      EXPECT_LT(rel_l2(got, c.reference(), t), 8e-3)
          << (decode ? "decode" : "prefill") << " slices " << slices << " seed " << seed_;
      EXPECT_EQ(run(), got) << "not deterministic";
    }
}

}  // namespace
}  // namespace kiln
