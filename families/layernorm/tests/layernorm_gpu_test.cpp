// LayerNorm on the GPU against the CPU reference: fresh random data each run, outputs poisoned
// before each launch, every dtype, one and many rows, row lengths from odd to the kernels' limits,
// with and without bias, contiguous and strided rows (the padding between rows untouched); the
// backward's dx, dweight and dbias, and its determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "families/layernorm/ops.h"
#include "jit/driver.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

class LayerNormGpu : public testing::GpuFixture {};

std::vector<std::int64_t> all(std::int64_t n) {
  std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) idx[std::size_t(i)] = i;
  return idx;
}

TensorView dev(const DeviceBuffer& b, DType t, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(b.get(), t, shape, Device::cuda(0));
}
TensorView hostv(std::vector<unsigned char>& b, DType t, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(b.data(), t, shape, Device::cpu());
}

struct Case {
  DType dtype;
  std::int64_t rows, cols;
  bool bias;
  std::int64_t stride = 0;  // elements between rows of x, y, dy and dx on the GPU; 0: cols
  bool backward = true;     // false: the forward only (rows longer than the backward takes)
};

// A [rows, cols] view of b with rows `stride` elements apart.
TensorView dev_rows(const DeviceBuffer& b, DType t, std::int64_t rows, std::int64_t cols, std::int64_t stride) {
  TensorView v = TensorView::contiguous(b.get(), t, {rows, cols}, Device::cuda(0));
  v.strides[0] = stride;
  return v;
}

// Host rows of `cols` elements, `stride` apart in `wide` (the padding left as it is), from or to
// contiguous ones.
void spread(const std::vector<unsigned char>& rows_in, std::vector<unsigned char>& wide, std::int64_t rows,
            std::int64_t cols, std::int64_t stride, std::size_t es) {
  for (std::int64_t r = 0; r < rows; ++r)
    std::copy_n(rows_in.data() + r * cols * es, cols * es, wide.data() + r * stride * es);
}
std::vector<unsigned char> gather(const std::vector<unsigned char>& wide, std::int64_t rows, std::int64_t cols,
                                  std::int64_t stride, std::size_t es) {
  std::vector<unsigned char> out(rows * cols * es);
  for (std::int64_t r = 0; r < rows; ++r)
    std::copy_n(wide.data() + r * stride * es, cols * es, out.data() + r * cols * es);
  return out;
}
// Whether the padding between rows of `wide` (the bytes past each row's cols) still holds `fill`.
bool padding_holds(const std::vector<unsigned char>& wide, std::int64_t rows, std::int64_t cols, std::int64_t stride,
                   std::size_t es, unsigned char fill) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::size_t b = cols * es; b < stride * es; ++b)
      if (r * stride * es + b < wide.size() && wide[r * stride * es + b] != fill) return false;
  return true;
}

// Forward and backward of one case on the GPU and on the CPU (the typed ops' host path, which
// runs the families' fp64 references), compared by relative L2 error. With a row stride, x and dy
// sit in padded rows whose padding is poisoned, y and dx are written into padded rows whose
// padding must stay as it was.
void check(Runtime* rt, const Case& c, unsigned seed) {
  const std::int64_t stride = c.stride ? c.stride : c.cols;
  SCOPED_TRACE(std::string(dtype_name(c.dtype)) + " " + std::to_string(c.rows) + "x" + std::to_string(c.cols) +
               (c.bias ? " bias" : "") + " stride " + std::to_string(stride) + " seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const auto es = dtype_size(c.dtype);
  const std::int64_t n = c.rows * c.cols, wide_n = c.rows * stride;
  auto hx = testing::random_bytes(c.dtype, n, rng, 2.0f), hw = testing::random_bytes(c.dtype, c.cols, rng),
       hb = testing::random_bytes(c.dtype, c.cols, rng), hdy = testing::random_bytes(c.dtype, n, rng);
  // Inputs with NaN padding (0xFF bytes): a kernel reading past a row poisons its statistics.
  std::vector<unsigned char> wx(wide_n * es, 0xFF), wdy(wide_n * es, 0xFF);
  spread(hx, wx, c.rows, c.cols, stride, es);
  spread(hdy, wdy, c.rows, c.cols, stride, es);
  DeviceBuffer x(wide_n * es), w(c.cols * es), b(c.cols * es), y(wide_n * es), mean(c.rows * 4), rstd(c.rows * 4),
      dy(wide_n * es), dx(wide_n * es), dw(c.cols * es), db(c.cols * es);
  x.upload(wx.data());
  w.upload(hw.data());
  b.upload(hb.data());
  dy.upload(wdy.data());
  for (DeviceBuffer* p : {&y, &mean, &rstd, &dx, &dw, &db}) p->poison();
  auto bv = dev(b, c.dtype, {c.cols});
  auto mv = dev(mean, DType::f32, {c.rows}), rv = dev(rstd, DType::f32, {c.rows});
  Status s = layer_norm(dev_rows(x, c.dtype, c.rows, c.cols, stride), dev(w, c.dtype, {c.cols}),
                        c.bias ? &bv : nullptr, dev_rows(y, c.dtype, c.rows, c.cols, stride), &mv, &rv, 1e-5, nullptr,
                        rt);
  ASSERT_TRUE(s.ok()) << s.to_string();
  auto dbv = dev(db, c.dtype, {c.cols});
  if (c.backward)
    s = layer_norm_backward(dev_rows(dy, c.dtype, c.rows, c.cols, stride),
                            dev_rows(x, c.dtype, c.rows, c.cols, stride), dev(w, c.dtype, {c.cols}), mv, rv,
                            dev_rows(dx, c.dtype, c.rows, c.cols, stride), dev(dw, c.dtype, {c.cols}),
                            c.bias ? &dbv : nullptr, nullptr, rt);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);

  std::vector<unsigned char> wide_y(wide_n * es), gmean(c.rows * 4), grstd(c.rows * 4), wide_dx(wide_n * es),
      gdw(c.cols * es), gdb(c.cols * es);
  y.download(wide_y.data());
  mean.download(gmean.data());
  rstd.download(grstd.data());
  dx.download(wide_dx.data());
  dw.download(gdw.data());
  db.download(gdb.data());
  EXPECT_TRUE(padding_holds(wide_y, c.rows, c.cols, stride, es, 0xFF)) << "y's padding was written";
  EXPECT_TRUE(padding_holds(wide_dx, c.rows, c.cols, stride, es, 0xFF)) << "dx's padding was written";
  const auto gy = gather(wide_y, c.rows, c.cols, stride, es), gdx = gather(wide_dx, c.rows, c.cols, stride, es);

  std::vector<unsigned char> wy(n * es), wmean(c.rows * 4), wrstd(c.rows * 4), wdx(n * es), wdw(c.cols * es),
      wdb(c.cols * es);
  auto hbv = hostv(hb, c.dtype, {c.cols});
  auto hmv = hostv(wmean, DType::f32, {c.rows}), hrv = hostv(wrstd, DType::f32, {c.rows});
  ASSERT_TRUE(layer_norm(hostv(hx, c.dtype, {c.rows, c.cols}), hostv(hw, c.dtype, {c.cols}), c.bias ? &hbv : nullptr,
                         hostv(wy, c.dtype, {c.rows, c.cols}), &hmv, &hrv, 1e-5)
                  .ok());
  auto hdbv = hostv(wdb, c.dtype, {c.cols});
  // The CPU backward from the GPU's statistics, so the comparison isolates the backward.
  auto gmv = hostv(gmean, DType::f32, {c.rows}), grv = hostv(grstd, DType::f32, {c.rows});
  if (c.backward) {
    ASSERT_TRUE(layer_norm_backward(hostv(hdy, c.dtype, {c.rows, c.cols}), hostv(hx, c.dtype, {c.rows, c.cols}),
                                    hostv(hw, c.dtype, {c.cols}), gmv, grv, hostv(wdx, c.dtype, {c.rows, c.cols}),
                                    hostv(wdw, c.dtype, {c.cols}), c.bias ? &hdbv : nullptr)
                    .ok());
  }
  const double tol = testing::tolerance(c.dtype);
  EXPECT_LE(testing::rel_l2(gy.data(), wy.data(), c.dtype, all(n)), tol) << "y";
  EXPECT_LE(testing::rel_l2(gmean.data(), wmean.data(), DType::f32, all(c.rows)), 1e-5) << "mean";
  EXPECT_LE(testing::rel_l2(grstd.data(), wrstd.data(), DType::f32, all(c.rows)), 1e-5) << "rstd";
  if (!c.backward) return;
  EXPECT_LE(testing::rel_l2(gdx.data(), wdx.data(), c.dtype, all(n)), tol) << "dx";
  // dweight and dbias sum rows in fp32 on the GPU: a little more error than one row's.
  EXPECT_LE(testing::rel_l2(gdw.data(), wdw.data(), c.dtype, all(c.cols)), 2 * tol) << "dweight";
  if (c.bias) {
    EXPECT_LE(testing::rel_l2(gdb.data(), wdb.data(), c.dtype, all(c.cols)), 2 * tol) << "dbias";
  }
}

TEST_F(LayerNormGpu, MatchesTheReferenceForEveryDtypeAndRowLength) {
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (std::int64_t cols : {1, 8, 768, 1023, 4096})
      for (std::int64_t rows : {1, 3, 300}) check(rt_.get(), {t, rows, cols, cols % 2 == 0}, seed_ + unsigned(cols + rows));
}

TEST_F(LayerNormGpu, RowsAtTheKernelsLimits) {
  check(rt_.get(), {DType::bf16, 64, 8192, true}, seed_);
  check(rt_.get(), {DType::f32, 16, 8192, false}, seed_ + 1);
  check(rt_.get(), {DType::f16, 2, 2047, true}, seed_ + 2);  // odd: 1-element accesses
  // The forward's longest rows: 32768 elements, 16384 odd ones (one element an access).
  check(rt_.get(), {DType::bf16, 3, 32768, true, 0, false}, seed_ + 3);
  check(rt_.get(), {DType::f32, 256, 32768, true, 0, false}, seed_ + 4);
  check(rt_.get(), {DType::bf16, 5, 16383, true, 0, false}, seed_ + 5);
}

TEST_F(LayerNormGpu, TheHeuristicsShapesMatchTheReference) {
  // Decode (16-byte accesses, two packs a thread over up to 1024 threads), 4-byte accesses with 16
  // packs, a warp per row with several rows a block, 16-byte accesses with four packs, odd rows.
  unsigned k = 0;
  for (std::int64_t rows : {1, 16, 77})
    for (std::int64_t cols : {896, 2880, 3072, 3584, 4096, 5120, 7168, 8192, 2047})
      check(rt_.get(), {DType::bf16, rows, cols, true}, seed_ + k++);
  for (DType t : {DType::f32, DType::f16})
    for (std::int64_t cols : {896, 4096, 2047}) check(rt_.get(), {t, 16, cols, cols % 2 == 0}, seed_ + k++);
  check(rt_.get(), {DType::bf16, 1000, 896, true}, seed_ + k++);   // a warp per row, 2 rows a block
  check(rt_.get(), {DType::bf16, 4096, 896, true}, seed_ + k++);   // a warp per row, 4 rows a block
  check(rt_.get(), {DType::bf16, 4095, 2880, false}, seed_ + k++);
  check(rt_.get(), {DType::bf16, 2048, 5120, true}, seed_ + k++);  // 16-byte accesses, four packs
  check(rt_.get(), {DType::f32, 2048, 896, true}, seed_ + k++);
  // A few rows: the backward in one launch (layernorm_bwd_rows), with and without a bias.
  check(rt_.get(), {DType::bf16, 2, 4096, false}, seed_ + k++);
  check(rt_.get(), {DType::f16, 8, 8192, true}, seed_ + k++);
  check(rt_.get(), {DType::f32, 5, 2048, false}, seed_ + k++);
  check(rt_.get(), {DType::bf16, 13, 3072, true}, seed_ + k++);  // past 8 rows: two rows a block
}

TEST_F(LayerNormGpu, StridedRowsMatchTheReferenceAndLeaveThePaddingAlone) {
  // Rows of a wider tensor (a slice of the last dimension), every dtype; strides that keep
  // 16-byte accesses and ones that narrow them.
  unsigned k = 0;
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    check(rt_.get(), {t, 300, 768, true, 768 + 64}, seed_ + k++);
    check(rt_.get(), {t, 16, 4096, true, 4096 + 8}, seed_ + k++);
    check(rt_.get(), {t, 77, 1024, false, 1024 + 1}, seed_ + k++);  // odd: 1-element accesses
    check(rt_.get(), {t, 3, 2880, true, 5760}, seed_ + k++);
  }
  // The strided shape of the backward's sweep, fewer rows.
  check(rt_.get(), {DType::bf16, 512, 8192, true, 8256}, seed_ + k++);
}

TEST_F(LayerNormGpu, BackwardIsDeterministic) {
  std::mt19937& rng = rng_;
  const std::int64_t rows = 4096, cols = 1024, n = rows * cols;
  const DType t = DType::bf16;
  auto hx = testing::random_bytes(t, n, rng), hw = testing::random_bytes(t, cols, rng),
       hdy = testing::random_bytes(t, n, rng);
  DeviceBuffer x(n * 2), w(cols * 2), y(n * 2), mean(rows * 4), rstd(rows * 4), dy(n * 2), dx(n * 2), dw(cols * 2),
      db(cols * 2);
  x.upload(hx.data());
  w.upload(hw.data());
  dy.upload(hdy.data());
  auto mv = dev(mean, DType::f32, {rows}), rv = dev(rstd, DType::f32, {rows});
  ASSERT_TRUE(layer_norm(dev(x, t, {rows, cols}), dev(w, t, {cols}), nullptr, dev(y, t, {rows, cols}), &mv, &rv, 1e-5, nullptr,
                         rt_.get())
                  .ok());
  std::vector<unsigned char> first, got(cols * 4);
  for (int run = 0; run < 3; ++run) {
    auto dbv = dev(db, t, {cols});
    ASSERT_TRUE(layer_norm_backward(dev(dy, t, {rows, cols}), dev(x, t, {rows, cols}), dev(w, t, {cols}), mv, rv,
                                    dev(dx, t, {rows, cols}), dev(dw, t, {cols}), &dbv, nullptr, rt_.get())
                    .ok());
    ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
    dw.download(got.data());
    db.download(got.data() + cols * 2);
    if (run == 0) first = got;
    else EXPECT_EQ(got, first) << "run " << run;
  }
}

}  // namespace
}  // namespace kiln
