// rms_norm_rope on the GPU against the CPU reference: fresh random data each run, outputs poisoned
// before each launch, every dtype with f32 and same-dtype cos/sin, every head_dim, both cos/sin
// shapes, explicit and inferred num_heads, in place, misaligned bases, every catalog variant.
#include <gtest/gtest.h>

#include <cmath>

#include "families/rmsnorm_rope/rmsnorm_rope.h"
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
  bool cos_4d = false;
  std::int64_t offset = 0;  // elements added to every base pointer
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dtype)) + "/" + dtype_name(c.cos_dtype) + " " + std::to_string(c.batch) + "x" +
         std::to_string(c.seq) + " heads " + std::to_string(c.heads) + " d" + std::to_string(c.d) +
         (c.in_place ? " in-place" : "") + (c.cos_4d ? " 4d-cos" : "") + " off " + std::to_string(c.offset);
}

// The case's problem, 16-byte aligned, eps 1e-5.
Problem problem_of(const Case& c) {
  return Problem::of(c.dtype, 16,
                     families::RmsNormRopeProblem{.rows = c.batch * c.seq, .hidden = c.heads * c.d, .head_dim = c.d,
                                                  .seq = c.seq, .num_heads = c.heads,
                                                  .cos_dtype = std::int64_t(c.cos_dtype), .eps = 1e-5});
}

template <class Launch>
double check_case(const Case& c, std::mt19937& rng, Launch&& launch) {
  const auto es = std::int64_t(dtype_size(c.dtype)), cs = std::int64_t(dtype_size(c.cos_dtype));
  const std::int64_t hidden = c.heads * c.d, n = c.batch * c.seq * hidden;
  auto hx = testing::random_bytes(c.dtype, c.offset + n, rng, 2.0f);
  auto hw = testing::random_bytes(c.dtype, c.offset + hidden, rng);
  std::vector<unsigned char> hcos((c.offset + c.seq * c.d) * cs), hsin(hcos.size());
  std::uniform_real_distribution<double> angle(-3.14159, 3.14159);
  for (std::int64_t i = 0; i < c.seq * c.d; ++i) {
    const double a = angle(rng);
    store_from_double(hcos.data(), c.cos_dtype, c.offset + i, std::cos(a));
    store_from_double(hsin.data(), c.cos_dtype, c.offset + i, std::sin(a));
  }
  DeviceBuffer dx(hx.size()), dw(hw.size()), dc(hcos.size()), ds(hsin.size()), dy((c.offset + n) * es);
  dx.upload(hx.data());
  dw.upload(hw.data());
  dc.upload(hcos.data());
  ds.upload(hsin.data());
  dy.poison();
  auto at = [&](const DeviceBuffer& b, std::int64_t size) {
    return static_cast<void*>(static_cast<unsigned char*>(b.get()) + c.offset * size);
  };
  void* ptrs[5] = {at(dx, es), at(dw, es), at(dc, cs), at(ds, cs), c.in_place ? at(dx, es) : at(dy, es)};
  Status s = launch(c, ptrs);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
  std::vector<unsigned char> got(hx.size());
  (c.in_place ? dx : dy).download(got.data());

  std::vector<unsigned char> want(got.size(), 0xFF);
  const Problem p = problem_of(c);
  void* ref[5] = {hx.data() + c.offset * es, hw.data() + c.offset * es, hcos.data() + c.offset * cs,
                  hsin.data() + c.offset * cs, want.data() + c.offset * es};
  const Family& f = *Registry::global().find("rmsnorm_rope");
  EXPECT_TRUE(f.cpu_reference(f.heuristic(p), p, ref).ok());
  std::vector<std::int64_t> idx(n);
  for (std::int64_t i = 0; i < n; ++i) idx[i] = c.offset + i;
  return testing::rel_l2(got.data(), want.data(), c.dtype, idx);
}

Status run_op(const Case& c, void* const* b, Runtime* rt, std::int64_t num_heads = 0) {
  const Device dev = Device::cuda(0);
  const std::int64_t hidden = c.heads * c.d;
  const TensorView x = TensorView::contiguous(b[0], c.dtype, {c.batch, c.seq, hidden}, dev);
  const TensorView w = TensorView::contiguous(b[1], c.dtype, {hidden}, dev);
  const TensorView cos = c.cos_4d ? TensorView::contiguous(b[2], c.cos_dtype, {1, c.seq, 1, c.d}, dev)
                                  : TensorView::contiguous(b[2], c.cos_dtype, {c.seq, c.d}, dev);
  const TensorView sin = c.cos_4d ? TensorView::contiguous(b[3], c.cos_dtype, {1, c.seq, 1, c.d}, dev)
                                  : TensorView::contiguous(b[3], c.cos_dtype, {c.seq, c.d}, dev);
  const TensorView y = TensorView::contiguous(b[4], c.dtype, {c.batch, c.seq, hidden}, dev);
  return rms_norm_rope(x, w, cos, sin, y, 1e-5, num_heads, nullptr, rt);
}

class RmsNormRopeGpu : public testing::GpuFixture {
 protected:
  double run(const Case& c, std::int64_t num_heads = 0) {
    return check_case(c, rng_, [&](const Case& cc, void* const* b) { return run_op(cc, b, rt_.get(), num_heads); });
  }
};

TEST_F(RmsNormRopeGpu, EveryDtypeCosDtypeAndHeadDim) {
  const std::int64_t shapes[][3] = {{1, 1, 32}, {2, 37, 8}, {1, 5, 1}, {3, 4, 64}};  // batch, seq, heads
  int n = 0;
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (DType cd : t == DType::f32 ? std::vector<DType>{DType::f32} : std::vector<DType>{DType::f32, t})
      for (std::int64_t d : {64, 80, 96, 128, 256}) {
        const auto* sh = shapes[n++ % 4];
        Case c{t, cd, sh[0], sh[1], sh[2], d};
        EXPECT_LT(run(c), testing::tolerance(t)) << describe(c) << " seed " << seed_;
      }
  EXPECT_EQ(rt_->resolver(), "embedded");
}

TEST_F(RmsNormRopeGpu, LlmShapesInPlaceFourDimCosAndExplicitHeads) {
  for (DType t : {DType::f16, DType::bf16}) {
    Case c{t, t, 1, 512, 32, 128};
    EXPECT_LT(run(c, 32), testing::tolerance(t)) << describe(c) << " seed " << seed_;
    c.cos_4d = true;
    EXPECT_LT(run(c), testing::tolerance(t)) << describe(c) << " seed " << seed_;
    c.in_place = true;
    EXPECT_LT(run(c), testing::tolerance(t)) << describe(c) << " seed " << seed_;
    Case wide{t, DType::f32, 1, 3, 512, 128};  // hidden 65536: rows longer than the register cache
    EXPECT_LT(run(wide), testing::tolerance(t)) << describe(wide) << " seed " << seed_;
    wide.in_place = true;
    EXPECT_LT(run(wide), testing::tolerance(t)) << describe(wide) << " seed " << seed_;
  }
}

TEST_F(RmsNormRopeGpu, MisalignedBasesTakeNarrowerAccesses) {
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (DType cd : t == DType::f32 ? std::vector<DType>{DType::f32} : std::vector<DType>{DType::f32, t}) {
      Case c{t, cd, 2, 7, 6, 80, false, false, 1};
      EXPECT_LT(run(c), testing::tolerance(t)) << describe(c) << " seed " << seed_;
      c.offset = 2;
      c.in_place = true;
      EXPECT_LT(run(c), testing::tolerance(t)) << describe(c) << " seed " << seed_;
    }
}

TEST_F(RmsNormRopeGpu, EveryCatalogVariantMatches) {
  const Family& f = *Registry::global().find("rmsnorm_rope");
  for (const Params& params : f.catalog()) {
    const DType t = *parse_dtype(*params.get_str("dtype")), cd = *parse_dtype(*params.get_str("cos_dtype"));
    const auto d = *params.get_int("head_dim");
    const auto block = *params.get_int("block");
    auto k = rt_->kernel(KernelSpec{"rmsnorm_rope", params});
    ASSERT_TRUE(k.ok()) << k.status().to_string();
    // Enough heads for more items than the register cache holds, plus a partial pass.
    const std::int64_t items_per_head = d / 2 / *params.get_int("vec");
    const std::int64_t heads = (3 * block) / items_per_head + 1;
    Case c{t, cd, 2, 3, heads, d};
    const double err = check_case(c, rng_, [&](const Case& cc, void* const* b) {
      return rt_->launch(**k, problem_of(cc), std::span<void* const>(b, 5), nullptr);
    });
    EXPECT_LT(err, testing::tolerance(t)) << params.canonical() << " seed " << seed_;
  }
}

}  // namespace
}  // namespace kiln
