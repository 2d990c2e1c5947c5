// LayerNorm on the CPU: the typed ops against a plain fp64 LayerNorm written here (forward, and the
// backward against central differences of the forward's loss), errors before any launch, strided
// rows against contiguous ones, the heuristic's choices and row-length limits, the catalog, and the
// op declarations the bindings are generated from.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "families/layernorm/layernorm.h"
#include "families/layernorm/ops.h"
#include "kiln/family.h"
#include "kiln/op.h"

namespace kiln {
namespace {

TensorView host(std::vector<float>& v, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(v.data(), DType::f32, shape, Device::cpu());
}

// y = (x - mean) / sqrt(var + eps) * w + b per row, in fp64.
std::vector<double> layer_norm_f64(const std::vector<double>& x, const std::vector<double>& w,
                                   const std::vector<double>& b, std::int64_t rows, std::int64_t cols, double eps) {
  std::vector<double> y(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (std::int64_t c = 0; c < cols; ++c) mean += x[r * cols + c];
    mean /= double(cols);
    for (std::int64_t c = 0; c < cols; ++c) var += (x[r * cols + c] - mean) * (x[r * cols + c] - mean);
    var /= double(cols);
    for (std::int64_t c = 0; c < cols; ++c)
      y[r * cols + c] = (x[r * cols + c] - mean) / std::sqrt(var + eps) * w[c] + (b.empty() ? 0.0 : b[c]);
  }
  return y;
}

struct Data {
  std::int64_t rows, cols;
  std::vector<float> x, w, b, dy;
  Data(std::int64_t r, std::int64_t c, unsigned seed) : rows(r), cols(c) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.f, 1.f);
    for (std::int64_t i = 0; i < r * c; ++i) x.push_back(n(rng) + 3.f);  // a large mean: two-pass statistics
    for (std::int64_t i = 0; i < c; ++i) w.push_back(1.f + 0.5f * n(rng)), b.push_back(n(rng));
    for (std::int64_t i = 0; i < r * c; ++i) dy.push_back(n(rng));
  }
};

std::vector<double> as_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

TEST(LayerNormCpu, ForwardMatchesFp64WithAndWithoutBias) {
  for (bool with_bias : {true, false}) {
    Data d(5, 37, 1);
    std::vector<float> y(d.x.size()), mean(5), rstd(5);
    auto xv = host(d.x, {5, 37}), wv = host(d.w, {37}), bv = host(d.b, {37}), yv = host(y, {5, 37});
    auto mv = host(mean, {5}), rv = host(rstd, {5});
    ASSERT_TRUE(layer_norm(xv, wv, with_bias ? &bv : nullptr, yv, &mv, &rv, 1e-5).ok());
    const auto want = layer_norm_f64(as_double(d.x), as_double(d.w), with_bias ? as_double(d.b) : std::vector<double>{},
                                     5, 37, 1e-5);
    for (std::size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], want[i], 1e-5) << i;
    for (int r = 0; r < 5; ++r) {
      double m = 0;
      for (int c = 0; c < 37; ++c) m += d.x[r * 37 + c];
      EXPECT_NEAR(mean[r], m / 37, 1e-5);
      EXPECT_GT(rstd[r], 0.f);
    }
  }
}

TEST(LayerNormCpu, BackwardMatchesCentralDifferences) {
  // loss = sum(dy * layer_norm(x, w, b)); its gradients by central differences in fp64.
  Data d(3, 11, 2);
  const double eps = 1e-5, h = 1e-6;
  auto loss = [&](const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b) {
    const auto y = layer_norm_f64(x, w, b, d.rows, d.cols, eps);
    double s = 0;
    for (std::size_t i = 0; i < y.size(); ++i) s += d.dy[i] * y[i];
    return s;
  };
  auto numeric = [&](std::vector<double> v, int which) {
    std::vector<double> g(v.size());
    auto x = as_double(d.x), w = as_double(d.w), b = as_double(d.b);
    for (std::size_t i = 0; i < v.size(); ++i) {
      std::vector<double>* t = which == 0 ? &x : which == 1 ? &w : &b;
      const double keep = (*t)[i];
      (*t)[i] = keep + h;
      const double up = loss(x, w, b);
      (*t)[i] = keep - h;
      g[i] = (up - loss(x, w, b)) / (2 * h);
      (*t)[i] = keep;
    }
    return g;
  };
  std::vector<float> y(d.x.size()), mean(3), rstd(3), dx(d.x.size()), dw(11), db(11);
  auto xv = host(d.x, {3, 11}), wv = host(d.w, {11}), bv = host(d.b, {11}), yv = host(y, {3, 11});
  auto mv = host(mean, {3}), rv = host(rstd, {3}), dyv = host(d.dy, {3, 11}), dxv = host(dx, {3, 11});
  auto dwv = host(dw, {11}), dbv = host(db, {11});
  ASSERT_TRUE(layer_norm(xv, wv, &bv, yv, &mv, &rv, eps).ok());
  ASSERT_TRUE(layer_norm_backward(dyv, xv, wv, mv, rv, dxv, dwv, &dbv).ok());
  const auto gx = numeric(as_double(d.x), 0), gw = numeric(as_double(d.w), 1), gb = numeric(as_double(d.b), 2);
  for (std::size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx[i], gx[i], 1e-4) << "dx " << i;
  for (std::size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw[i], gw[i], 1e-4) << "dw " << i;
  for (std::size_t i = 0; i < db.size(); ++i) EXPECT_NEAR(db[i], gb[i], 1e-4) << "db " << i;
}

TEST(LayerNormCpu, BadInputIsATypedErrorAndWritesNothing) {
  Data d(2, 8, 3);
  std::vector<float> y(16, 7.f), short_w(7);
  auto xv = host(d.x, {2, 8}), wv = host(d.w, {8}), yv = host(y, {2, 8}), sw = host(short_w, {7});
  EXPECT_EQ(layer_norm(xv, sw, nullptr, yv, nullptr, nullptr).code(), Code::shape_mismatch);
  EXPECT_EQ(layer_norm(xv, wv, nullptr, yv, nullptr, nullptr, -1.0).code(), Code::invalid_argument);
  EXPECT_EQ(layer_norm(xv, wv, nullptr, yv, nullptr, nullptr, NAN).code(), Code::invalid_argument);
  std::vector<std::uint16_t> half(8);
  auto hw = TensorView::contiguous(half.data(), DType::bf16, {8}, Device::cpu());
  EXPECT_EQ(layer_norm(xv, hw, nullptr, yv, nullptr, nullptr).code(), Code::unsupported_dtype);
  std::vector<float> bad_mean(3);
  auto bm = host(bad_mean, {3});
  EXPECT_EQ(layer_norm(xv, wv, nullptr, yv, &bm, nullptr).code(), Code::shape_mismatch);
  auto strided = xv;  // the last dimension not contiguous
  strided.strides[1] = 2;
  strided.shape[1] = 4;
  EXPECT_EQ(layer_norm(strided, wv, nullptr, yv, nullptr, nullptr).code(), Code::shape_mismatch);
  auto overlapping = xv;  // rows closer than a row length
  overlapping.strides[0] = 4;
  EXPECT_EQ(layer_norm(xv, wv, nullptr, overlapping, nullptr, nullptr).code(), Code::shape_mismatch);
  // A host pointer claimed to be on a GPU: device_error (no driver here, or not device memory).
  auto on_gpu = xv;
  on_gpu.device = Device::cuda(0);
  EXPECT_EQ(layer_norm(on_gpu, wv, nullptr, yv, nullptr, nullptr).code(), Code::device_error);
  for (float v : y) EXPECT_EQ(v, 7.f);
}

TEST(LayerNormCpu, StridedRowsMatchContiguousOnesAndLeaveThePaddingAlone) {
  // 3 rows of 37 in buffers with rows 40 apart (x, y, dy, dx), against the contiguous ops.
  const std::int64_t rows = 3, cols = 37, stride = 40;
  Data d(rows, cols, 4);
  auto widen = [&](const std::vector<float>& v, float pad) {
    std::vector<float> out(std::size_t(rows * stride), pad);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) out[std::size_t(r * stride + c)] = v[std::size_t(r * cols + c)];
    return out;
  };
  auto strided = [&](std::vector<float>& v) {
    TensorView t = TensorView::contiguous(v.data(), DType::f32, {rows, cols}, Device::cpu());
    t.strides[0] = stride;
    return t;
  };
  std::vector<float> y(rows * cols), mean(rows), rstd(rows), dx(rows * cols), dw(cols), db(cols);
  auto xv = host(d.x, {rows, cols}), wv = host(d.w, {cols}), bv = host(d.b, {cols}), yv = host(y, {rows, cols});
  auto mv = host(mean, {rows}), rv = host(rstd, {rows}), dyv = host(d.dy, {rows, cols}), dxv = host(dx, {rows, cols});
  auto dwv = host(dw, {cols}), dbv = host(db, {cols});
  ASSERT_TRUE(layer_norm(xv, wv, &bv, yv, &mv, &rv).ok());
  ASSERT_TRUE(layer_norm_backward(dyv, xv, wv, mv, rv, dxv, dwv, &dbv).ok());

  auto sx = widen(d.x, 1e3f), sdy = widen(d.dy, -1e3f), sy = widen(std::vector<float>(rows * cols), 7.f),
       sdx = widen(std::vector<float>(rows * cols), 9.f);
  std::vector<float> mean2(rows), rstd2(rows), dw2(cols), db2(cols);
  auto mv2 = host(mean2, {rows}), rv2 = host(rstd2, {rows}), dwv2 = host(dw2, {cols}), dbv2 = host(db2, {cols});
  ASSERT_TRUE(layer_norm(strided(sx), wv, &bv, strided(sy), &mv2, &rv2).ok());
  ASSERT_TRUE(layer_norm_backward(strided(sdy), strided(sx), wv, mv2, rv2, strided(sdx), dwv2, &dbv2).ok());
  for (std::int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(mean2[r], mean[r]);
    EXPECT_EQ(rstd2[r], rstd[r]);
    for (std::int64_t c = 0; c < stride; ++c) {
      const std::size_t i = std::size_t(r * stride + c), j = std::size_t(r * cols + c);
      EXPECT_EQ(sy[i], c < cols ? y[j] : 7.f) << r << "," << c;
      EXPECT_EQ(sdx[i], c < cols ? dx[j] : 9.f) << r << "," << c;
    }
  }
  EXPECT_EQ(dw2, dw);
  EXPECT_EQ(db2, db);
}

TEST(LayerNormCpu, HeuristicFollowsTheRowCountAndHoldsRowsUpToTheLimit) {
  auto fwd_problem = [](DType t, std::int64_t rows, std::int64_t cols, std::uint32_t align = 16) {
    return Problem::of(t, align, families::LayerNormProblem{.rows = rows, .cols = cols, .x_row_stride = cols,
                                                            .y_row_stride = cols, .eps = 1e-5});
  };
  auto bwd_problem = [](DType t, std::int64_t rows, std::int64_t cols, std::int64_t stride = 0) {
    const std::int64_t s = stride ? stride : cols;
    return Problem::of(t, 16, families::LayerNormBwdProblem{.rows = rows, .cols = cols, .dy_row_stride = s,
                                                            .x_row_stride = s, .dx_row_stride = s, .slabs = 1});
  };
  auto shape = [](const Params& p) {
    return std::vector<std::int64_t>{*p.get_int("group"), *p.get_int("rows"), *p.get_int("vec"), *p.get_int("packs")};
  };
  using V = std::vector<std::int64_t>;
  // Up to 1024 rows of up to 8 KiB, 512 of longer ones: 16-byte accesses, two packs a thread, one
  // row a block (no staging: the lean path).
  EXPECT_EQ(shape(*families::layernorm_choice(fwd_problem(DType::bf16, 16, 4096), false)), (V{256, 1, 8, 2}));
  EXPECT_EQ(shape(*families::layernorm_choice(fwd_problem(DType::bf16, 16, 2880), false)), (V{256, 1, 8, 2}));
  EXPECT_EQ(shape(*families::layernorm_choice(fwd_problem(DType::bf16, 1, 896), false)), (V{64, 1, 8, 2}));
  EXPECT_EQ(shape(*families::layernorm_choice(fwd_problem(DType::bf16, 77, 4096), false)), (V{256, 1, 8, 2}));
  {
    const Problem p = fwd_problem(DType::bf16, 512, 4096);
    const auto c = families::layernorm_choice(p, false);
    EXPECT_EQ(shape(*c), (V{256, 1, 8, 2}));
    EXPECT_EQ(families::layernorm_fwd_smem(*c, p), 0);
    // Past 1024 rows the same variant stages the weight and bias.
    EXPECT_EQ(families::layernorm_fwd_smem(*c, fwd_problem(DType::bf16, 1025, 4096)), 2 * 4096 * 2);
  }
  EXPECT_EQ(shape(*families::layernorm_choice(fwd_problem(DType::bf16, 1000, 4096), false)), (V{256, 1, 8, 2}));
  // Other rows under 2048: 4-byte accesses, 16 packs; from 2048, 8-byte ones, eight packs, and a
  // warp per row for short rows, four rows a block.
  EXPECT_EQ(shape(*families::layernorm_choice(fwd_problem(DType::bf16, 1000, 5120), false)), (V{256, 1, 2, 16}));
  EXPECT_EQ(shape(*families::layernorm_choice(fwd_problem(DType::bf16, 1100, 4096), false)), (V{128, 1, 2, 16}));
  EXPECT_EQ(shape(*families::layernorm_choice(fwd_problem(DType::bf16, 4096, 4096), false)), (V{128, 1, 4, 8}));
  EXPECT_EQ(shape(*families::layernorm_choice(fwd_problem(DType::bf16, 16384, 896), false)), (V{32, 4, 4, 8}));
  // 10-32 KiB f16/bf16 rows under 16384 rows: 16-byte accesses, four packs.
  EXPECT_EQ(shape(*families::layernorm_choice(fwd_problem(DType::bf16, 8188, 8192), false)), (V{256, 1, 8, 4}));
  // Odd rows: one element an access.
  EXPECT_EQ(*families::layernorm_choice(fwd_problem(DType::bf16, 16, 2047), false)->get_int("vec"), 1);
  // The longest rows: 32768 elements, 16384 odd ones.
  for (DType t : {DType::f32, DType::bf16}) {
    EXPECT_TRUE(families::layernorm_choice(fwd_problem(t, 4096, 32768), false).ok());
    EXPECT_TRUE(families::layernorm_choice(fwd_problem(t, 1, 32768), false).ok());
    EXPECT_TRUE(families::layernorm_choice(fwd_problem(t, 4096, 16383, 4), false).ok());
    EXPECT_EQ(families::layernorm_choice(fwd_problem(t, 4096, 32776), false).status().code(), Code::invalid_argument);
    EXPECT_EQ(families::layernorm_choice(fwd_problem(t, 4096, 16385, 4), false).status().code(),
              Code::invalid_argument);
  }

  // The backward: 16-byte accesses at any row stride that allows them, two packs a thread, rows
  // a block up to 512 threads, one slab per block the GPU holds.
  const auto strided = families::layernorm_choice(bwd_problem(DType::bf16, 16384, 8192, 8256), true);
  ASSERT_TRUE(strided.ok());
  EXPECT_EQ(shape(*strided), (V{512, 1, 8, 2}));
  EXPECT_EQ(families::layernorm_bwd_slabs(*strided, 16384, 132), 264);
  const auto narrow = families::layernorm_choice(bwd_problem(DType::bf16, 4096, 896), true);
  ASSERT_TRUE(narrow.ok());
  EXPECT_EQ(shape(*narrow), (V{64, 8, 8, 2}));
  EXPECT_EQ(families::layernorm_bwd_slabs(*narrow, 4096, 132), 264);
  const auto three = families::layernorm_choice(bwd_problem(DType::bf16, 3, 4096), true);
  ASSERT_TRUE(three.ok());
  EXPECT_EQ(*three->get_int("rows"), 2);
  EXPECT_EQ(families::layernorm_bwd_slabs(*three, 3, 132), 2);
  EXPECT_EQ(*families::layernorm_choice(bwd_problem(DType::bf16, 4096, 4096, 4100), true)->get_int("vec"), 4);
  EXPECT_TRUE(families::layernorm_choice(bwd_problem(DType::bf16, 4096, 8192), true).ok());
  EXPECT_TRUE(families::layernorm_choice(bwd_problem(DType::f32, 4096, 8192), true).ok());
  EXPECT_EQ(families::layernorm_choice(bwd_problem(DType::bf16, 4096, 8200), true).status().code(),
            Code::invalid_argument);
  const auto odd = families::layernorm_choice(bwd_problem(DType::bf16, 4096, 2047), true);  // 1-element accesses
  ASSERT_TRUE(odd.ok());
  EXPECT_EQ(odd->get_int("vec"), 1);
  const Family* f = Registry::global().find("layernorm_bwd");
  ASSERT_NE(f, nullptr);
  EXPECT_TRUE(f->check_problem(*odd, bwd_problem(DType::bf16, 4096, 2047)).ok());
}

TEST(LayerNormCpu, CatalogHoldsTheHeuristicsChoicesForTheSweepShapes) {
  for (const char* name : {"layernorm", "layernorm_bwd"}) {
    const Family* f = Registry::global().find(name);
    ASSERT_NE(f, nullptr);
    std::set<std::string> catalog;
    for (const auto& c : f->catalog()) {
      EXPECT_TRUE(f->validate(c).ok()) << c.canonical();
      catalog.insert(c.canonical());
    }
    for (DType t : {DType::f32, DType::f16, DType::bf16})
      for (std::int64_t rows : {1, 3, 16, 77, 1000, 4095, 8188, 16384})
        for (std::int64_t cols : {896, 2880, 3072, 3584, 4096, 5120, 7168, 8192}) {
          auto p = f->problem_from_shape(t, {{"rows", rows}, {"cols", cols}});
          ASSERT_TRUE(p.ok());
          const Params h = f->heuristic(*p);
          EXPECT_TRUE(f->check_problem(h, *p).ok()) << name << " " << rows << "x" << cols;
          EXPECT_TRUE(catalog.count(h.canonical())) << name << " " << rows << "x" << cols << ": " << h.canonical();
        }
  }
}

TEST(LayerNormCpu, DeclaresItsOpsAndTheirGradients) {
  const OpDecl* fwd = Registry::global().find_op("layer_norm");
  const OpDecl* bwd = Registry::global().find_op("layer_norm_backward");
  ASSERT_NE(fwd, nullptr);
  ASSERT_NE(bwd, nullptr);
  EXPECT_EQ(fwd->backward, "layer_norm_backward");
  const auto j = nlohmann::json::parse(bwd->describe());
  int grads = 0;
  for (const auto& t : j["tensors"])
    if (!t["grad_of"].get<std::string>().empty()) {
      ++grads;
      EXPECT_LT(fwd->tensor_index(t["grad_of"].get<std::string>()), fwd->tensors.size()) << t.dump();
    }
  EXPECT_EQ(grads, 4);  // dy, and dx, dweight, dbias
  // The [..., cols] tensors take strided rows: the bindings pass slices as they are.
  for (const OpDecl* op : {fwd, bwd})
    for (const auto& t : op->tensors) EXPECT_EQ(t.strided_rows, t.shape == "[..., cols]") << op->name << " " << t.name;
}

}  // namespace
}  // namespace kiln
