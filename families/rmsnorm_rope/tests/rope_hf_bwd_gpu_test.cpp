// rms_norm_rope_backward and rope_hf_bwd on the GPU against fp64: fresh random data each run,
// outputs poisoned before each launch, every dtype with f32 and same-dtype cos/sin, head_dim 64 to
// 256, 14 to 32 heads, odd seq, in place (dx = dout), misaligned bases, every catalog variant.
#include <gtest/gtest.h>

#include <cmath>

#include "families/rmsnorm_rope/ops.h"
#include "families/rmsnorm_rope/rope_hf_bwd.h"
#include "families/rmsnorm_rope/tests/rope_bwd_ref.h"
#include "kiln/ops.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

struct Case {
  DType dtype, cos_dtype;
  std::int64_t batch, seq, heads, d;
  bool in_place = false;
  std::int64_t offset = 0;  // elements added to every base pointer
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dtype)) + "/" + dtype_name(c.cos_dtype) + " " + std::to_string(c.batch) + "x" +
         std::to_string(c.seq) + " heads " + std::to_string(c.heads) + " d" + std::to_string(c.d) +
         (c.in_place ? " in-place" : "") + " off " + std::to_string(c.offset);
}

// Host data of a case: raw bytes at `offset`, and the same values (as rounded) in fp64.
struct Data {
  std::vector<unsigned char> x, w, cos, sin, dout;
  std::vector<double> xd, wd, cd, sd, gd;
};

std::vector<double> values(const std::vector<unsigned char>& b, DType t, std::int64_t offset, std::int64_t n) {
  std::vector<double> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) out[std::size_t(i)] = load_as_double(b.data(), t, offset + i);
  return out;
}

Data make_data(const Case& c, std::mt19937& rng) {
  const std::int64_t hidden = c.heads * c.d, n = c.batch * c.seq * hidden;
  Data d;
  d.x = testing::random_bytes(c.dtype, c.offset + n, rng, 2.0f);
  d.dout = testing::random_bytes(c.dtype, c.offset + n, rng);
  d.w = testing::random_bytes(c.dtype, c.offset + hidden, rng);
  d.cos.resize(std::size_t((c.offset + c.seq * c.d) * dtype_size(c.cos_dtype)));
  d.sin.resize(d.cos.size());
  std::uniform_real_distribution<double> angle(-3.14159, 3.14159);
  for (std::int64_t i = 0; i < c.seq * c.d; ++i) {
    const double a = angle(rng);
    store_from_double(d.cos.data(), c.cos_dtype, c.offset + i, std::cos(a));
    store_from_double(d.sin.data(), c.cos_dtype, c.offset + i, std::sin(a));
  }
  d.xd = values(d.x, c.dtype, c.offset, n);
  d.gd = values(d.dout, c.dtype, c.offset, n);
  d.wd = values(d.w, c.dtype, c.offset, hidden);
  d.cd = values(d.cos, c.cos_dtype, c.offset, c.seq * c.d);
  d.sd = values(d.sin, c.cos_dtype, c.offset, c.seq * c.d);
  return d;
}

// Relative L2 error of got (dtype t, from `offset`) against want.
double rel_l2(const std::vector<unsigned char>& got, DType t, std::int64_t offset, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = load_as_double(got.data(), t, offset + std::int64_t(i));
    if (!std::isfinite(g)) return INFINITY;
    diff += (g - want[i]) * (g - want[i]);
    norm += want[i] * want[i];
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

class RmsNormRopeBackwardGpu : public testing::GpuFixture {
 protected:
  // The op's (dx, dw) relative errors against the fp64 chain rule.
  std::pair<double, double> run(const Case& c, std::int64_t num_heads = 0) {
    const auto es = std::int64_t(dtype_size(c.dtype)), cs = std::int64_t(dtype_size(c.cos_dtype));
    const std::int64_t hidden = c.heads * c.d;
    Data h = make_data(c, rng_);
    DeviceBuffer dx(h.x.size()), dw(h.w.size()), dc(h.cos.size()), ds(h.sin.size()), dg(h.dout.size()),
        ddx(h.x.size()), ddw(h.w.size());
    dx.upload(h.x.data());
    dw.upload(h.w.data());
    dc.upload(h.cos.data());
    ds.upload(h.sin.data());
    dg.upload(h.dout.data());
    ddx.poison();
    ddw.poison();
    auto at = [&](const DeviceBuffer& b, std::int64_t size) {
      return static_cast<void*>(static_cast<unsigned char*>(b.get()) + c.offset * size);
    };
    const Device dev = Device::cuda(0);
    const TensorView dout = TensorView::contiguous(at(dg, es), c.dtype, {c.batch, c.seq, hidden}, dev);
    const TensorView x = TensorView::contiguous(at(dx, es), c.dtype, {c.batch, c.seq, hidden}, dev);
    const TensorView w = TensorView::contiguous(at(dw, es), c.dtype, {hidden}, dev);
    const TensorView cos = TensorView::contiguous(at(dc, cs), c.cos_dtype, {c.seq, c.d}, dev);
    const TensorView sin = TensorView::contiguous(at(ds, cs), c.cos_dtype, {c.seq, c.d}, dev);
    const TensorView gx =
        TensorView::contiguous(c.in_place ? at(dg, es) : at(ddx, es), c.dtype, {c.batch, c.seq, hidden}, dev);
    const TensorView gw = TensorView::contiguous(at(ddw, es), c.dtype, {hidden}, dev);
    const Status s = rms_norm_rope_backward(dout, x, w, cos, sin, 1e-5, num_heads, gx, gw, nullptr, rt_.get());
    EXPECT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
    std::vector<unsigned char> got_dx(h.x.size()), got_dw(h.w.size());
    (c.in_place ? dg : ddx).download(got_dx.data());
    ddw.download(got_dw.data());
    std::vector<double> want_dx, want_dw;
    testing::rms_norm_rope_bwd({c.batch * c.seq, c.seq, c.heads, c.d, 1e-5}, h.gd, h.xd, h.wd, h.cd, h.sd, want_dx,
                               want_dw);
    return {rel_l2(got_dx, c.dtype, c.offset, want_dx), rel_l2(got_dw, c.dtype, c.offset, want_dw)};
  }
  void check(const Case& c, std::int64_t num_heads = 0) {
    const auto [ex, ew] = run(c, num_heads);
    EXPECT_LT(ex, testing::tolerance(c.dtype)) << "dx " << describe(c) << " seed " << seed_;
    EXPECT_LT(ew, testing::tolerance(c.dtype)) << "dw " << describe(c) << " seed " << seed_;
  }
};

TEST_F(RmsNormRopeBackwardGpu, EveryDtypeCosDtypeHeadDimAndHeadCount) {
  const std::int64_t shapes[][3] = {{2, 37, 14}, {1, 7, 28}, {3, 5, 32}, {1, 1, 32}};  // batch, seq, heads
  int n = 0;
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (DType cd : t == DType::f32 ? std::vector<DType>{DType::f32} : std::vector<DType>{DType::f32, t})
      for (std::int64_t d : {64, 80, 96, 128, 256}) {
        const auto* sh = shapes[n++ % 4];
        check(Case{t, cd, sh[0], sh[1], sh[2], d});
      }
  EXPECT_EQ(rt_->resolver(), "embedded");
}

TEST_F(RmsNormRopeBackwardGpu, LlmShapesInPlaceAndExplicitHeads) {
  for (DType t : {DType::f16, DType::bf16}) {
    Case c{t, t, 2, 511, 32, 128};
    check(c, 32);
    c.in_place = true;
    check(c);
    check(Case{t, DType::f32, 1, 129, 28, 128});
    check(Case{t, DType::f32, 4, 33, 14, 64});
  }
}

TEST_F(RmsNormRopeBackwardGpu, MisalignedBasesTakeNarrowerAccesses) {
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (DType cd : t == DType::f32 ? std::vector<DType>{DType::f32} : std::vector<DType>{DType::f32, t}) {
      Case c{t, cd, 2, 7, 6, 96, false, 1};
      check(c);
      c.offset = 2;
      c.in_place = true;
      check(c);
    }
}

TEST_F(RmsNormRopeBackwardGpu, EveryCatalogVariantOfTheRotationMatches) {
  const Family& f = *Registry::global().find("rope_hf_bwd");
  for (const Params& params : f.catalog()) {
    const DType t = *parse_dtype(*params.get_str("dtype")), cd = *parse_dtype(*params.get_str("cos_dtype"));
    const auto d = *params.get_int("head_dim");
    auto k = rt_->kernel(KernelSpec{"rope_hf_bwd", params});
    ASSERT_TRUE(k.ok()) << k.status().to_string();
    const Case c{t, cd, 2, 9, 14, d};
    Data h = make_data(c, rng_);
    const std::int64_t n = c.batch * c.seq * c.heads * d;
    DeviceBuffer dg(h.dout.size()), dc(h.cos.size()), ds(h.sin.size()), dn(h.dout.size());
    dg.upload(h.dout.data());
    dc.upload(h.cos.data());
    ds.upload(h.sin.data());
    dn.poison();
    const Problem p = Problem::of(t, 16,
                                  families::RopeHfBwdProblem{.rows = c.batch * c.seq, .hidden = c.heads * d,
                                                             .head_dim = d, .seq = c.seq, .num_heads = c.heads,
                                                             .cos_dtype = std::int64_t(cd)});
    void* b[4] = {dg.get(), dc.get(), ds.get(), dn.get()};
    const Status s = rt_->launch(**k, p, std::span<void* const>(b, 4), nullptr);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
    std::vector<unsigned char> got(h.dout.size());
    dn.download(got.data());
    std::vector<double> want(static_cast<std::size_t>(n));
    for (std::int64_t r = 0; r < c.batch * c.seq; ++r)
      for (std::int64_t h0 = 0; h0 < c.heads * d; h0 += d)
        for (std::int64_t j = 0; j < d / 2; ++j) {
          const std::int64_t i = r * c.heads * d + h0 + j, tb = (r % c.seq) * d + j;
          const double g1 = h.gd[std::size_t(i)], g2 = h.gd[std::size_t(i + d / 2)];
          want[std::size_t(i)] = g1 * h.cd[std::size_t(tb)] + g2 * h.sd[std::size_t(tb + d / 2)];
          want[std::size_t(i + d / 2)] = g2 * h.cd[std::size_t(tb + d / 2)] - g1 * h.sd[std::size_t(tb)];
        }
    EXPECT_LT(rel_l2(got, t, 0, want), testing::tolerance(t)) << params.canonical() << " seed " << seed_;
  }
}

}  // namespace
}  // namespace kiln
