// Typed-op validation and the CPU fallback. None of these may compile or launch anything: they run
// on a machine without a GPU, and the runtime's counters prove nothing was resolved.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/half.h"
#include "kiln/kiln.h"
#include "kiln/ops.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

struct Bufs {
  std::vector<float> x, w, y;
  Bufs(std::int64_t rows, std::int64_t cols) : x(rows * cols), w(cols), y(rows * cols) {
    std::mt19937 rng(testing::fresh_seed());
    std::normal_distribution<float> n;
    for (auto& v : x) v = n(rng);
    for (auto& v : w) v = n(rng);
  }
};

class OpsErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    rt_ = Runtime::create(o).value();
  }
  void expect(const Status& s, Code c, const char* what) {
    EXPECT_EQ(s.code(), c) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
    RuntimeCounters k = rt_->counters();
    EXPECT_EQ(k.from_embedded + k.from_daemon + k.module_loads, 0) << what << " resolved a kernel";
  }
  std::shared_ptr<Runtime> rt_;
};

TEST_F(OpsErrors, ShapeMismatch) {
  Bufs b(4, 64);
  auto x = TensorView::contiguous(b.x.data(), DType::f32, {4, 64}, Device::cpu());
  auto w = TensorView::contiguous(b.w.data(), DType::f32, {64}, Device::cpu());
  auto y = TensorView::contiguous(b.y.data(), DType::f32, {4, 64}, Device::cpu());
  expect(rms_norm(x, TensorView::contiguous(b.w.data(), DType::f32, {32}, Device::cpu()), y, 1e-6, nullptr, rt_.get()),
         Code::shape_mismatch, "weight too short");
  expect(rms_norm(x, w, TensorView::contiguous(b.y.data(), DType::f32, {8, 32}, Device::cpu()), 1e-6, nullptr, rt_.get()),
         Code::shape_mismatch, "y shape");
  expect(rms_norm(x, TensorView::contiguous(b.w.data(), DType::f32, {1, 64}, Device::cpu()), y, 1e-6, nullptr, rt_.get()),
         Code::shape_mismatch, "weight rank");
  auto xt = x;  // transposed view: last dim not contiguous
  std::swap(xt.shape[0], xt.shape[1]);
  xt.strides[0] = 1;
  xt.strides[1] = 64;
  auto yt = TensorView::contiguous(b.y.data(), DType::f32, {64, 4}, Device::cpu());
  expect(rms_norm(xt, TensorView::contiguous(b.w.data(), DType::f32, {4}, Device::cpu()), yt, 1e-6, nullptr, rt_.get()),
         Code::shape_mismatch, "non-contiguous last dim");
}

TEST_F(OpsErrors, UnsupportedAndMismatchedDtypes) {
  Bufs b(4, 64);
  auto x = TensorView::contiguous(b.x.data(), DType::f32, {4, 64}, Device::cpu());
  auto w = TensorView::contiguous(b.w.data(), DType::f32, {64}, Device::cpu());
  auto y = TensorView::contiguous(b.y.data(), DType::f32, {4, 64}, Device::cpu());
  auto xi = x;
  xi.dtype = DType::i32;
  auto yi = y;
  yi.dtype = DType::i32;
  auto wi = w;
  wi.dtype = DType::i32;
  expect(rms_norm(xi, wi, yi, 1e-6, nullptr, rt_.get()), Code::unsupported_dtype, "int tensors");
  auto wh = w;
  wh.dtype = DType::bf16;
  expect(rms_norm(x, wh, y, 1e-6, nullptr, rt_.get()), Code::unsupported_dtype, "weight dtype differs");
}

TEST_F(OpsErrors, DevicesAndPointers) {
  Bufs b(4, 64);
  auto x = TensorView::contiguous(b.x.data(), DType::f32, {4, 64}, Device::cpu());
  auto w = TensorView::contiguous(b.w.data(), DType::f32, {64}, Device::cpu());
  auto y = TensorView::contiguous(b.y.data(), DType::f32, {4, 64}, Device::cpu());
  auto xg = x;
  xg.device = Device::cuda(0);  // a host pointer claimed to be on the GPU
  auto wg = w;
  wg.device = Device::cuda(0);
  auto yg = y;
  yg.device = Device::cuda(0);
  expect(rms_norm(xg, wg, yg, 1e-6, nullptr, rt_.get()), Code::device_error, "host pointers labelled cuda");
  expect(rms_norm(x, wg, y, 1e-6, nullptr, rt_.get()), Code::device_error, "mixed devices");
  auto xn = x;
  xn.data = nullptr;
  expect(rms_norm(xn, w, y, 1e-6, nullptr, rt_.get()), Code::invalid_argument, "null pointer");
  expect(rms_norm(x, w, y, -1.0, nullptr, rt_.get()), Code::invalid_argument, "negative eps");
  expect(rms_norm(x, w, y, NAN, nullptr, rt_.get()), Code::invalid_argument, "NaN eps");
}

double max_rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

TEST(OpsCpu, FallbackComputesRmsNormOnHostMemory) {
  for (std::int64_t cols : {1, 7, 64, 1000}) {
    const std::int64_t rows = 5;
    Bufs b(rows, cols);
    std::fill(b.y.begin(), b.y.end(), NAN);
    auto x = TensorView::contiguous(b.x.data(), DType::f32, {rows, cols}, Device::cpu());
    auto w = TensorView::contiguous(b.w.data(), DType::f32, {cols}, Device::cpu());
    auto y = TensorView::contiguous(b.y.data(), DType::f32, {rows, cols}, Device::cpu());
    ASSERT_TRUE(rms_norm(x, w, y, 1e-5).ok());
    std::vector<double> want(rows * cols);
    for (std::int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (std::int64_t c = 0; c < cols; ++c) ss += double(b.x[r * cols + c]) * b.x[r * cols + c];
      double s = 1 / std::sqrt(ss / cols + 1e-5);
      for (std::int64_t c = 0; c < cols; ++c) want[r * cols + c] = b.x[r * cols + c] * s * b.w[c];
    }
    EXPECT_LT(max_rel_err(b.y, want), 1e-6) << cols;
  }
}

TEST(OpsCpu, ThreeDimensionalInputIsFlattenedToRows) {
  Bufs b(6, 16);
  auto x = TensorView::contiguous(b.x.data(), DType::f32, {2, 3, 16}, Device::cpu());
  auto w = TensorView::contiguous(b.w.data(), DType::f32, {16}, Device::cpu());
  auto y = TensorView::contiguous(b.y.data(), DType::f32, {2, 3, 16}, Device::cpu());
  ASSERT_TRUE(rms_norm(x, w, y).ok());
  std::vector<float> y2(b.y.size());
  auto x2 = TensorView::contiguous(b.x.data(), DType::f32, {6, 16}, Device::cpu());
  auto y2v = TensorView::contiguous(y2.data(), DType::f32, {6, 16}, Device::cpu());
  ASSERT_TRUE(rms_norm(x2, w, y2v).ok());
  EXPECT_EQ(b.y, y2);
}

TEST(CAbi, ErrorsComeBackAsCodesWithMessages) {
  EXPECT_EQ(kiln_abi_version(), KILN_ABI_VERSION);
  kiln_runtime* rt = nullptr;
  EXPECT_EQ(kiln_runtime_create("bogus", &rt), KILN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kiln_last_error()).find("mode"), std::string::npos);
  ASSERT_EQ(kiln_runtime_create("embedded", &rt), KILN_OK);
  std::vector<float> x(32, 1.0f), w(8, 2.0f), y(32, 0.0f);
  int64_t xs[2] = {4, 8}, ws[1] = {8}, bad[1] = {7};
  kiln_tensor tx{x.data(), KILN_F32, 2, xs, nullptr, KILN_CPU, 0};
  kiln_tensor tw{w.data(), KILN_F32, 1, ws, nullptr, KILN_CPU, 0};
  kiln_tensor ty{y.data(), KILN_F32, 2, xs, nullptr, KILN_CPU, 0};
  kiln_tensor tbad{w.data(), KILN_F32, 1, bad, nullptr, KILN_CPU, 0};
  EXPECT_EQ(kiln_rms_norm(rt, &tx, &tbad, &ty, 1e-6, nullptr), KILN_SHAPE_MISMATCH);
  EXPECT_NE(std::string(kiln_last_error()).find("weight"), std::string::npos);
  EXPECT_EQ(kiln_rms_norm(rt, &tx, nullptr, &ty, 1e-6, nullptr), KILN_INVALID_ARGUMENT);
  kiln_tensor th = tx;
  th.dtype = 42;
  EXPECT_EQ(kiln_rms_norm(rt, &th, &tw, &ty, 1e-6, nullptr), KILN_UNSUPPORTED_DTYPE);
  ASSERT_EQ(kiln_rms_norm(rt, &tx, &tw, &ty, 0.0, nullptr), KILN_OK) << kiln_last_error();
  for (float v : y) EXPECT_FLOAT_EQ(v, 2.0f);  // x = 1 -> rms 1 -> y = w
  EXPECT_STREQ(kiln_code_name(KILN_DEVICE_ERROR), "device_error");
  kiln_runtime_destroy(rt);
}

}  // namespace
}  // namespace kiln
