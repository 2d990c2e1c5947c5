// Fused add + RMSNorm on the GPU against the CPU reference: fresh random data each run, outputs
// poisoned before each launch (out of place), every dtype, odd and wide rows, one and many rows,
// strided and misaligned views, in place (y = x, residual_out = residual), every catalog variant.
// residual_out must match the reference bit for bit: both round the same fp32-exact sum.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "families/add_rmsnorm/add_rmsnorm.h"
#include "kiln/ops.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

struct Case {
  DType dtype;
  std::int64_t rows, cols;
  std::int64_t xs = 0, rs = 0, ys = 0, hs = 0;  // row strides; 0: cols
  std::int64_t offset = 0;                      // elements added to every base pointer (misalignment)
  bool in_place = false;                        // y = x, residual_out = residual
  std::int64_t x_stride() const { return xs ? xs : cols; }
  std::int64_t r_stride() const { return rs ? rs : cols; }
  std::int64_t y_stride() const { return in_place ? x_stride() : ys ? ys : cols; }
  std::int64_t h_stride() const { return in_place ? r_stride() : hs ? hs : cols; }
  std::string describe() const {
    return std::string(dtype_name(dtype)) + " " + std::to_string(rows) + "x" + std::to_string(cols) + " strides " +
           std::to_string(x_stride()) + "/" + std::to_string(r_stride()) + "/" + std::to_string(y_stride()) + "/" +
           std::to_string(h_stride()) + " off " + std::to_string(offset) + (in_place ? " in place" : "");
  }
};

std::int64_t extent(const Case& c, std::int64_t stride) { return c.offset + (c.rows - 1) * stride + c.cols; }

// The case's problem, 16-byte aligned, eps 1e-5.
Problem problem_of(const Case& c) {
  return Problem::of(c.dtype, 16,
                     families::AddRmsNormProblem{.rows = c.rows, .cols = c.cols, .x_row_stride = c.x_stride(),
                                                 .residual_row_stride = c.r_stride(), .y_row_stride = c.y_stride(),
                                                 .residual_out_row_stride = c.h_stride(), .eps = 1e-5});
}

// Launches through `run(x, r, w, y, ro)` and compares both outputs with the reference.
template <class Launch>
void check_case(const Case& c, std::mt19937& rng, unsigned seed, Launch&& run) {
  SCOPED_TRACE(c.describe() + " seed " + std::to_string(seed));
  const auto es = dtype_size(c.dtype);
  auto hx = testing::random_bytes(c.dtype, extent(c, c.x_stride()), rng, 2.0f);
  auto hr = testing::random_bytes(c.dtype, extent(c, c.r_stride()), rng, 2.0f);
  auto hw = testing::random_bytes(c.dtype, c.offset + c.cols, rng);
  DeviceBuffer dx(hx.size()), dr(hr.size()), dw(hw.size());
  const std::size_t y_bytes = extent(c, c.y_stride()) * es, h_bytes = extent(c, c.h_stride()) * es;
  DeviceBuffer dy(y_bytes), dh(h_bytes);
  dx.upload(hx.data());
  dr.upload(hr.data());
  dw.upload(hw.data());
  dy.poison();
  dh.poison();
  auto at = [&](const DeviceBuffer& b) { return static_cast<unsigned char*>(b.get()) + c.offset * es; };
  Status s = run(at(dx), at(dr), at(dw), c.in_place ? at(dx) : at(dy), c.in_place ? at(dr) : at(dh));
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);

  std::vector<unsigned char> got_y(c.in_place ? hx.size() : y_bytes), got_h(c.in_place ? hr.size() : h_bytes);
  (c.in_place ? dx : dy).download(got_y.data());
  (c.in_place ? dr : dh).download(got_h.data());

  // The reference on host copies with the same strides and the same aliasing.
  std::vector<unsigned char> want_y = c.in_place ? hx : std::vector<unsigned char>(got_y.size(), 0xFF);
  std::vector<unsigned char> want_h = c.in_place ? hr : std::vector<unsigned char>(got_h.size(), 0xFF);
  const Problem p = problem_of(c);
  auto off = [&](std::vector<unsigned char>& v) { return static_cast<void*>(v.data() + c.offset * es); };
  void* bufs[5] = {c.in_place ? off(want_y) : off(hx), c.in_place ? off(want_h) : off(hr), off(hw), off(want_y),
                   off(want_h)};
  const Family& f = *Registry::global().find("add_rmsnorm");
  ASSERT_TRUE(f.cpu_reference(f.heuristic(p), p, bufs).ok());

  std::vector<std::int64_t> yi, hi;
  std::int64_t h_mismatches = 0;
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t col = 0; col < c.cols; ++col) {
      yi.push_back(c.offset + r * c.y_stride() + col);
      const std::int64_t h = c.offset + r * c.h_stride() + col;
      h_mismatches += std::memcmp(got_h.data() + h * es, want_h.data() + h * es, es) != 0;
    }
  EXPECT_EQ(h_mismatches, 0) << "residual_out differs from the reference's rounded sum";
  EXPECT_LT(testing::rel_l2(got_y.data(), want_y.data(), c.dtype, yi), testing::tolerance(c.dtype));
  // Padding between strided rows must be left alone (still poisoned).
  if (!c.in_place && c.rows > 1) {
    if (c.y_stride() > c.cols) {
      EXPECT_TRUE(std::isnan(load_as_double(got_y.data(), c.dtype, c.offset + c.cols))) << "y padding was written";
    }
    if (c.h_stride() > c.cols) {
      EXPECT_TRUE(std::isnan(load_as_double(got_h.data(), c.dtype, c.offset + c.cols))) << "residual_out padding";
    }
  }
}

Status run_op(const Case& c, void* x, void* r, void* w, void* y, void* h, Runtime* rt) {
  auto view = [&](void* p, std::int64_t stride) {
    TensorView v = TensorView::contiguous(p, c.dtype, {c.rows, c.cols}, Device::cuda(0));
    v.strides[0] = stride;
    return v;
  };
  return add_rms_norm(view(x, c.x_stride()), view(r, c.r_stride()),
                      TensorView::contiguous(w, c.dtype, {c.cols}, Device::cuda(0)), view(y, c.y_stride()),
                      view(h, c.h_stride()), 1e-5, nullptr, rt);
}

class AddRmsNormGpu : public testing::GpuFixture {
 protected:
  void check(const Case& c) {
    check_case(c, rng_, seed_, [&](void* x, void* r, void* w, void* y, void* h) {
      return run_op(c, x, r, w, y, h, rt_.get());
    });
  }
};

TEST_F(AddRmsNormGpu, MatchesReferenceForEveryDtypeAndRowLength) {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    for (std::int64_t cols : {1, 7, 64, 1000, 2048, 4095, 4096, 5120, 8191, 16384, 65536})
      for (std::int64_t rows : {1, 3, 37}) check({t, rows, cols});
    check({t, 2000, 4096});  // many rows: the grid-stride loop over rows
    check({t, 2048, 5120});  // from 2048 rows, 2.5 packs per thread: half a pack in shared memory
  }
  EXPECT_GT(rt_->counters().module_loads, 0);
}

TEST_F(AddRmsNormGpu, StridedMisalignedAndInPlace) {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    const std::vector<Case> cases = {
        {t, 9, 1024, 1032, 1040, 1048, 1056},       // padded rows, vectorizable
        {t, 5, 777, 800, 784, 777, 808},            // odd length in aligned strides
        {t, 6, 512, 0, 0, 0, 0, 1},                 // base pointers off by one element
        {t, 11, 4096, 0, 0, 0, 0, 0, true},         // in place
        {t, 7, 65536, 0, 0, 0, 0, 0, true},         // in place, wide rows (re-read from residual_out)
        {t, 3, 5000, 5008, 5008, 0, 0, 8, true},    // in place, strided, offset
        {t, 4, 3000, 3001, 3003, 3005, 3007},       // odd strides: scalar path
        {t, 1, 4096, 0, 0, 0, 0, 0, true},          // one row in place
    };
    for (const auto& c : cases) check(c);
  }
}

TEST_F(AddRmsNormGpu, EveryCatalogVariantMatchesOnItsOwnStream) {
  const Family& f = *Registry::global().find("add_rmsnorm");
  const jit::Driver* d = jit::Driver::get().value();
  CUstream stream = nullptr;
  ASSERT_EQ(d->stream_create(&stream, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  for (const Params& params : f.catalog()) {
    SCOPED_TRACE(params.canonical());
    const DType t = *parse_dtype(*params.get_str("dtype"));
    const std::int64_t vec = *params.get_int("vec"), row = *params.get_int("row");
    const std::int64_t widest = *params.get_int("block") * row * vec;
    // General kernel: tail elements, several packs per thread, and past the register cache for
    // small blocks; then rows that also overflow the shared-memory cache for the narrower variants.
    // One-row kernel: the widest row it holds in padded strides, in place; a row a few packs short
    // of every thread's last pack; a row of one pack.
    std::vector<Case> cases;
    if (row == 0) {
      for (auto [in_place, n] : {std::pair{false, 1200}, std::pair{true, 1200}, std::pair{true, 4000}})
        cases.push_back(Case{t, n > 2000 ? 3 : 13, 8 * n + 3, 8 * n + 8, 8 * n + 16, 8 * n + 8, 8 * n + 24, 0,
                             in_place});
    } else {
      cases = {Case{t, 13, widest, widest + vec, widest + 2 * vec, widest + vec, widest + 3 * vec, 0, true},
               Case{t, 5, widest - 3 * vec, 0, 0, 0, 0, 0, false}, Case{t, 1, vec, 0, 0, 0, 0, 0, false}};
    }
    for (const Case& c : cases) {
      auto k = rt_->kernel(KernelSpec{"add_rmsnorm", params});
      ASSERT_TRUE(k.ok()) << k.status().to_string();
      check_case(c, rng_, seed_, [&](void* x, void* r, void* w, void* y, void* h) {
        const Problem p = problem_of(c);
        void* b[5] = {x, r, w, y, h};
        Status s = rt_->launch(**k, p, b, stream);
        if (s.ok()) {
          EXPECT_EQ(d->stream_synchronize(stream), CUDA_SUCCESS);
        }
        return s;
      });
    }
  }
  d->stream_destroy(stream);
}

}  // namespace
}  // namespace kiln
