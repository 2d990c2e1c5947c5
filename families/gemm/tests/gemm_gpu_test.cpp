// The tensor-core families on the GPU against their CPU references (fp64 accumulation): fresh
// random data every run (never zeros), outputs poisoned before each launch, sizes that are not
// multiples of any tile (M, N odd; K a multiple of 16 but not of 128), persistent grids smaller
// than the tile count (each CTA walks several tiles), both arch paths where the device allows (the
// mma.sync path runs on sm_90 too), per-tensor and block scales, f16 and bf16.
// quantize_fp8 must match its reference bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "common/fp8.h"
#include "families/common/gemm/gemm_util.h"
#include "families/gemm/fp8_gemm.h"
#include "families/gemm/gated_mlp.h"
#include "families/gemm/quantize_fp8.h"
#include "jit/device_info.h"
#include "jit/tune_launch.h"
#include "kiln/ops.h"
#include "tests/gpu_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;
namespace g = families::gemm;

const jit::Driver* drv() { return jit::Driver::get().value(); }

class GemmGpu : public testing::GpuFixture {
 protected:
  void SetUp() override {
    GpuFixture::SetUp();
    if (IsSkipped()) return;
    cc_ = jit::device_info(0).value()->compute_capability;
    sms_ = jit::device_info(0).value()->sm_count;
  }
  // The arch paths this device runs.
  std::vector<std::string> paths() const {
    std::vector<std::string> p = {"mma"};
    if (cc_ == 90) p.push_back("wgmma");
    return p;
  }
  // sms > 0 bounds the wgmma path's persistent grid below the device's SM count, so each CTA walks
  // several tiles and its stage ring runs on across them (the large benchmark shapes do the same).
  Problem gemm_problem(DType t, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t mode,
                       std::int64_t sms = 0) const {
    Problem p = Problem::of(t, 16, g::GemmProblem{.m = m, .n = n, .k = k, .mode = mode});
    p.sm_count = std::uint16_t(sms > 0 ? sms : sms_);
    p.cc = std::uint8_t(cc_);
    return p;
  }
  // Launches `params` of `family` explicitly (not the heuristic) and returns the output bytes. The
  // runtime launches on the device's facts; a problem whose sm_count bounds the grid below the
  // device's is launched as given, through the tuner's launch.
  std::vector<unsigned char> launch(const char* family, const Params& params, const Problem& p,
                                    const std::vector<std::vector<unsigned char>>& inputs) {
    const Family& f = *Registry::global().find(family);
    auto specs = f.buffers(params, p);
    std::vector<std::unique_ptr<DeviceBuffer>> dev;
    std::vector<void*> ptrs;
    std::size_t in = 0, out_index = 0;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const std::size_t bytes = std::size_t(specs[i].elements) * dtype_size(specs[i].dtype);
      dev.push_back(std::make_unique<DeviceBuffer>(bytes));
      if (specs[i].role == BufferRole::input) {
        EXPECT_EQ(inputs[in].size(), bytes) << specs[i].name;
        dev.back()->upload(inputs[in++].data());
      } else {
        dev.back()->poison();
        out_index = i;
      }
      ptrs.push_back(dev.back()->get());
    }
    auto k = rt_->kernel(KernelSpec{family, params});
    EXPECT_TRUE(k.ok()) << k.status().to_string();
    if (!k.ok()) return {};
    Status s = p.sm_count == sms_ ? rt_->launch(**k, p, ptrs, nullptr)
                                  : jit::launch_candidate(f, params, p, static_cast<CUfunction>((*k)->function), ptrs);
    EXPECT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(drv()->ctx_synchronize(), CUDA_SUCCESS);
    std::vector<unsigned char> got(std::size_t(specs[out_index].elements) * dtype_size(specs[out_index].dtype));
    dev[out_index]->download(got.data());
    return got;
  }
  int cc_ = 0, sms_ = 0;
};

// Random e4m3 codes from normally distributed values (never all zeros; NaN codes excluded).
std::vector<unsigned char> random_e4m3(std::int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<unsigned char> out(static_cast<std::size_t>(n));
  for (auto& v : out) v = float_to_e4m3(d(rng));
  return out;
}

std::vector<unsigned char> random_scales(std::int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(0.25f, 2.0f);
  std::vector<unsigned char> out(std::size_t(n) * 4);
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = d(rng) / 64.0f;
    std::memcpy(out.data() + 4 * i, &v, 4);
  }
  return out;
}

Params gemm_params(const std::string& path, int bm, int bn, int stages, std::initializer_list<std::pair<const char*, const char*>> rest,
                   int cluster = 1, int split = 1) {
  Params p{{"path", path},     {"bm", std::int64_t(bm)},   {"bn", std::int64_t(bn)}, {"stages", std::int64_t(stages)},
           {"group", std::int64_t(8)}, {"cluster", std::int64_t(cluster)}, {"split", std::int64_t(split)}};
  for (auto [k, v] : rest) p.set(k, v);
  return p;
}

struct Shape {
  std::int64_t m, n, k;
  std::int64_t sms = 0;  // 0: the device's
};
const Shape k_shapes[] = {{200, 328, 528},   {1, 77, 144}, {257, 130, 1040}, {64, 256, 256}, {300, 520, 784, 3},
                          {13, 330, 1168}};

TEST_F(GemmGpu, Fp8GemmMatchesReferenceOnEveryPathScalingAndOutput) {
  const Family& f = *Registry::global().find("fp8_gemm");
  for (const auto& path : paths())
    for (const char* scaling : {"tensor", "block"})
      for (DType out : {DType::f16, DType::bf16})
        for (auto [bm, bn] : {std::pair{128, 128}, {64, 64}, {64, 128}, {128, 256}, {128, 192}, {64, 32}, {128, 176}, {128, 56},
                              {16, 64}, {16, 128}, {32, 64}, {32, 128}})
          // Clusters of 2 (A multicast; column tiles padded to whole clusters when their count is
          // odd, as with bn 128 at n 328 or bn 32 at n 77) and split-K over 2, 3 or 4 CTAs (k of
          // 144 and 256 is 2 k-steps: some CTAs of a 3- or 4-way split get none; k 784 with 3
          // SMs walks many tiles per cluster) on the wgmma path, bf16 output.
          for (auto [cluster, split] : {std::pair{1, 1}, {2, 1}, {1, 2}, {1, 3}, {1, 4}})
          for (const Shape& s : k_shapes) {
            if (bn > 128 && (path == "mma" || (std::string(scaling) == "block" && bn != 192 && bn != 256))) continue;
            if ((bn == 56 || bn == 176) && (path == "mma" || std::string(scaling) == "block")) continue;
            if ((cluster > 1 || split > 1) && (path == "mma" || out != DType::bf16)) continue;
            // Swapped tiles (bm 16, 32): wgmma only, no A multicast; m 200, 257 and 300 take
            // several rows of them.
            if (bm < 64 && (path == "mma" || cluster > 1)) continue;
            if (split == 3 && bm != 128) continue;
            if (split > 1 && bn == 256) continue;  // the partial tile does not fit beside the stages
            // wgmma without clusters: the heuristic's depth for the tile (small tiles fill shared
            // memory, up to 16 stages, so the ring wraps within a tile only where k is long; the
            // 3-SM shape walks many tiles per CTA and wraps it across tiles).
            const bool block = std::string(scaling) == "block";
            const int stages =
                path == "mma" ? 3
                : split > 1 && bn >= 176 ? 3
                : cluster == 1 && split == 1
                    ? g::default_stages(block ? g::k_fp8_block : g::k_fp8_tensor, g::Tile{true, bm, bn, 4, 8}, 90)
                    : 4;
            const Params params = gemm_params(path, bm, bn, stages,
                                              {{"out", dtype_name(out)}, {"scaling", scaling}}, cluster, split);
            const Problem p =
                gemm_problem(out, s.m, s.n, s.k, block ? families::k_fp8_blockwise : families::k_fp8_per_tensor, s.sms);
            SCOPED_TRACE(params.canonical() + " " + std::to_string(s.m) + "x" + std::to_string(s.n) + "x" +
                         std::to_string(s.k) + " seed " + std::to_string(seed_));
            ASSERT_TRUE(f.check_problem(params, p).ok()) << f.check_problem(params, p).to_string();
            const auto kb = (s.k + 127) / 128;
            std::vector<std::vector<unsigned char>> in = {
                random_e4m3(s.m * s.k, rng_), random_e4m3(s.n * s.k, rng_),
                random_scales(block ? s.m * kb : 1, rng_), random_scales(block ? ((s.n + 127) / 128) * kb : 1, rng_)};
            auto got = launch("fp8_gemm", params, p, in);
            ASSERT_EQ(got.size(), std::size_t(s.m * s.n * 2));
            std::vector<unsigned char> want(got.size());
            void* bufs[5] = {in[0].data(), in[1].data(), in[2].data(), in[3].data(), want.data()};
            ASSERT_TRUE(f.cpu_reference(params, p, bufs).ok());
            std::vector<std::int64_t> idx(std::size_t(s.m * s.n));
            for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = std::int64_t(i);
            EXPECT_LT(testing::rel_l2(got.data(), want.data(), out, idx), testing::tolerance(out));
          }
}

TEST_F(GemmGpu, GatedMlpMatchesReferenceOnEveryPathDtypeAndActivation) {
  const Family& f = *Registry::global().find("gated_mlp");
  for (const auto& path : paths())
    for (const char* act : {"silu", "gelu"})
      for (DType t : {DType::f16, DType::bf16})
        for (auto [bm, bn] : {std::pair{128, 64}, {64, 64}, {128, 128}, {64, 32}, {16, 64}, {16, 128}, {32, 64}})
          for (int cluster : {1, 2})
          for (const Shape& s : {Shape{133, 200, 264}, Shape{5, 72, 64}, Shape{300, 136, 520}, Shape{330, 400, 136, 2},
                                 Shape{13, 330, 1160}}) {
            if (path == "mma" && bn == 128) continue;
            // Swapped tiles (bm 16, 32): wgmma only, no A multicast.
            if (bm < 64 && (path == "mma" || cluster > 1)) continue;
            // Clusters (in the tuning space, not the heuristic's): wgmma, bf16, silu.
            if (cluster > 1 && (path == "mma" || t != DType::bf16 || std::string(act) != "silu")) continue;
            const Params params =
                gemm_params(path, bm, bn, path == "wgmma" ? 4 : 3, {{"dtype", dtype_name(t)}, {"act", act}}, cluster);
            const Problem p =
                gemm_problem(t, s.m, s.n, s.k, std::string(act) == "gelu" ? families::k_gated_gelu : families::k_gated_silu,
                             s.sms);
            SCOPED_TRACE(params.canonical() + " " + std::to_string(s.m) + "x" + std::to_string(s.n) + "x" +
                         std::to_string(s.k) + " seed " + std::to_string(seed_));
            ASSERT_TRUE(f.check_problem(params, p).ok()) << f.check_problem(params, p).to_string();
            const float wscale = 1.0f / std::sqrt(float(s.k));
            std::vector<std::vector<unsigned char>> in = {testing::random_bytes(t, s.m * s.k, rng_),
                                                          testing::random_bytes(t, s.n * s.k, rng_, 2 * wscale),
                                                          testing::random_bytes(t, s.n * s.k, rng_, 2 * wscale)};
            auto got = launch("gated_mlp", params, p, in);
            ASSERT_EQ(got.size(), std::size_t(s.m * s.n * 2));
            std::vector<unsigned char> want(got.size());
            void* bufs[4] = {in[0].data(), in[1].data(), in[2].data(), want.data()};
            ASSERT_TRUE(f.cpu_reference(params, p, bufs).ok());
            std::vector<std::int64_t> idx(std::size_t(s.m * s.n));
            for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = std::int64_t(i);
            EXPECT_LT(testing::rel_l2(got.data(), want.data(), t, idx), testing::tolerance(t));
          }
}

// The typed ops end to end: quantize (GPU) must equal the CPU rule bit for bit, then the GEMM on
// the quantized operands is checked against its reference, and against the unquantized product
// within fp8's precision.
TEST_F(GemmGpu, QuantizeIsBitExactAndFeedsTheGemm) {
  auto* d = drv();
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (auto gran : {Fp8Granularity::tensor, Fp8Granularity::row_1x128, Fp8Granularity::tile_128})
      for (bool tr : {false, true}) {
        if (tr && gran == Fp8Granularity::row_1x128) continue;
        const std::int64_t rows = 300, cols = 260;
        SCOPED_TRACE(std::string(dtype_name(t)) + " gran " + std::to_string(int(gran)) + " tr " + std::to_string(tr) +
                     " seed " + std::to_string(seed_));
        auto hx = testing::random_bytes(t, rows * cols, rng_, 3.0f);
        const std::int64_t ns = gran == Fp8Granularity::tensor      ? 1
                                : gran == Fp8Granularity::row_1x128 ? rows * 3
                                                                    : 3 * 3;
        DeviceBuffer dx(hx.size()), dq(rows * cols), ds(ns * 4);
        dx.upload(hx.data());
        dq.poison();
        ds.poison();
        auto xv = TensorView::contiguous(dx.get(), t, {rows, cols}, Device::cuda(0));
        auto qv = TensorView::contiguous(dq.get(), DType::u8, {tr ? cols : rows, tr ? rows : cols}, Device::cuda(0));
        auto sv = gran == Fp8Granularity::tensor ? TensorView::contiguous(ds.get(), DType::f32, {1}, Device::cuda(0))
                  : gran == Fp8Granularity::row_1x128 ? TensorView::contiguous(ds.get(), DType::f32, {rows, 3}, Device::cuda(0))
                                                      : TensorView::contiguous(ds.get(), DType::f32, {3, 3}, Device::cuda(0));
        Status s = quantize_fp8(xv, qv, sv, gran, tr, nullptr, rt_.get());
        ASSERT_TRUE(s.ok()) << s.to_string();
        ASSERT_EQ(d->ctx_synchronize(), CUDA_SUCCESS);
        std::vector<unsigned char> gq(rows * cols), gs(ns * 4), wq(rows * cols, 0xAA), ws(ns * 4, 0);
        dq.download(gq.data());
        ds.download(gs.data());
        auto hxv = TensorView::contiguous(hx.data(), t, {rows, cols}, Device::cpu());
        auto hqv = TensorView::contiguous(wq.data(), DType::u8, {tr ? cols : rows, tr ? rows : cols}, Device::cpu());
        auto hsv = sv;
        hsv.data = ws.data();
        hsv.device = Device::cpu();
        ASSERT_TRUE(quantize_fp8(hxv, hqv, hsv, gran, tr, nullptr, rt_.get()).ok());
        std::int64_t diff = 0;
        for (std::size_t i = 0; i < gq.size(); ++i) diff += gq[i] != wq[i];
        EXPECT_EQ(diff, 0) << "codes differ from the CPU rule";
        EXPECT_EQ(std::memcmp(gs.data(), ws.data(), gs.size()), 0) << "scales differ from the CPU rule";
      }

  // a [M, K] row-quantized (1x128), b a row-major [K, N] weight quantized transposed (128x128).
  const std::int64_t m = 190, n = 200, k = 400, kb = 4;
  for (DType out : {DType::bf16, DType::f16}) {
    auto ha = testing::random_bytes(DType::f32, m * k, rng_), hb = testing::random_bytes(DType::f32, k * n, rng_);
    DeviceBuffer da(ha.size()), db(hb.size()), qa(m * k), qb(n * k), sa(m * kb * 4), sb(2 * kb * 4), dout(m * n * 2);
    da.upload(ha.data());
    db.upload(hb.data());
    dout.poison();
    auto cuda = Device::cuda(0);
    ASSERT_TRUE(quantize_fp8(TensorView::contiguous(da.get(), DType::f32, {m, k}, cuda),
                             TensorView::contiguous(qa.get(), DType::u8, {m, k}, cuda),
                             TensorView::contiguous(sa.get(), DType::f32, {m, kb}, cuda), Fp8Granularity::row_1x128,
                             false, nullptr, rt_.get())
                    .ok());
    ASSERT_TRUE(quantize_fp8(TensorView::contiguous(db.get(), DType::f32, {k, n}, cuda),
                             TensorView::contiguous(qb.get(), DType::u8, {n, k}, cuda),
                             TensorView::contiguous(sb.get(), DType::f32, {2, kb}, cuda), Fp8Granularity::tile_128, true,
                             nullptr, rt_.get())
                    .ok());
    // The scale grid of a [K, N] weight quantized transposed is [ceil(N/128), ceil(K/128)] =
    // [2, 4]: the same bytes viewed with the shape fp8_gemm asks for.
    TensorView bt = TensorView::contiguous(qb.get(), DType::u8, {n, k}, cuda);
    std::swap(bt.shape[0], bt.shape[1]);
    std::swap(bt.strides[0], bt.strides[1]);
    Status s = fp8_gemm(TensorView::contiguous(qa.get(), DType::u8, {m, k}, cuda), bt,
                        TensorView::contiguous(sa.get(), DType::f32, {m, kb}, cuda),
                        TensorView::contiguous(sb.get(), DType::f32, {2, kb}, cuda),
                        TensorView::contiguous(dout.get(), out, {m, n}, cuda), nullptr, rt_.get());
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(d->ctx_synchronize(), CUDA_SUCCESS);
    std::vector<unsigned char> got(m * n * 2);
    dout.download(got.data());
    std::vector<double> exact(m * n);
    double num = 0, den = 0;
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (std::int64_t q = 0; q < k; ++q)
          acc += load_as_double(ha.data(), DType::f32, i * k + q) * load_as_double(hb.data(), DType::f32, q * n + j);
        const double gv = load_as_double(got.data(), out, i * n + j);
        ASSERT_FALSE(std::isnan(gv)) << "unwritten output at " << i << ", " << j;
        num += (gv - acc) * (gv - acc);
        den += acc * acc;
      }
    // e4m3 keeps 3 mantissa bits: about 2.5% relative error per element, averaged down over K.
    EXPECT_LT(std::sqrt(num / den), 0.05) << "seed " << seed_;
  }
}

}  // namespace
}  // namespace kiln
