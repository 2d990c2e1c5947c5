// RMSNorm backward on the GPU against the fp64 CPU reference: fresh random data each run, dx and
// dw poisoned before each launch, every dtype, odd and wide rows, one row and many, strided,
// misaligned and in-place views, a caller's workspace, and every catalog variant of both stages;
// the same for add_rms_norm_backward (inv_rms recomputed, dh added or absent), and every option
// combination on every kernel.
#include <gtest/gtest.h>

#include <cmath>

#include "families/rmsnorm_bwd/ops.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd_reduce.h"
#include "jit/device_info.h"
#include "kiln/ops.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

constexpr double k_eps = 1e-5;

struct Case {
  DType dtype;
  std::int64_t rows, cols, stride;  // dy, x and dx share the row stride
  std::int64_t offset = 0;          // elements added to every base pointer (misalignment)
  bool in_place = false;            // dx = dy
  // The options: inv_rms recomputed from x (not read), and dh in rows of dh_stride (0: no dh).
  bool recompute = false;
  std::int64_t dh_stride = 0;
  bool dx_is_dh = false;  // dx = dh (dh_stride must be the stride)
};

// Host inputs for a case and the reference outputs (fp64 accumulation, one slab).
struct Data {
  std::vector<unsigned char> dy, x, w, dh, want_dx, want_dw;
  std::vector<float> inv_rms;
};

std::int64_t extent(const Case& c, std::int64_t stride) { return c.offset + (c.rows - 1) * stride + c.cols; }

Data make_data(const Case& c, std::mt19937& rng) {
  const std::int64_t elems = extent(c, c.stride);
  Data d;
  d.dy = testing::random_bytes(c.dtype, elems, rng);
  d.x = testing::random_bytes(c.dtype, elems, rng, 2.0f);
  d.w = testing::random_bytes(c.dtype, c.offset + c.cols, rng);
  d.dh = testing::random_bytes(c.dtype, c.dh_stride ? extent(c, c.dh_stride) : 1, rng);
  d.inv_rms.resize(std::size_t(c.rows));
  for (std::int64_t r = 0; r < c.rows; ++r) {
    double ss = 0;
    for (std::int64_t j = 0; j < c.cols; ++j) {
      const double v = load_as_double(d.x.data(), c.dtype, c.offset + r * c.stride + j);
      ss += v * v;
    }
    d.inv_rms[std::size_t(r)] = float(1 / std::sqrt(ss / double(c.cols) + k_eps));
  }
  const auto es = dtype_size(c.dtype);
  d.want_dx.assign(std::size_t(elems) * es, 0xFF);
  d.want_dw.assign(std::size_t(c.cols) * es, 0xFF);
  const Problem p = Problem::of(c.dtype, 16,
                                families::RmsNormBwdProblem{.rows = c.rows,
                                                            .cols = c.cols,
                                                            .dy_row_stride = c.stride,
                                                            .x_row_stride = c.stride,
                                                            .dx_row_stride = c.stride,
                                                            .slabs = 1,
                                                            .max_cluster = 1,
                                                            .dh_row_stride = c.dh_stride,
                                                            .recompute = c.recompute ? 1 : 0,
                                                            .eps = k_eps});
  std::vector<float> partial(std::size_t(c.cols));
  void* b[7] = {d.dy.data() + c.offset * es, d.x.data() + c.offset * es, d.w.data() + c.offset * es,
                d.inv_rms.data(), d.want_dx.data() + c.offset * es, partial.data(),
                c.dh_stride ? d.dh.data() + c.offset * es : nullptr};
  const Family& bwd = *Registry::global().find("rmsnorm_bwd");
  EXPECT_TRUE(bwd.cpu_reference(bwd.heuristic(p), p, b).ok());
  const Problem pr = Problem::of(c.dtype, 16, families::RmsNormBwdReduceProblem{.slabs = 1, .cols = c.cols});
  void* r[2] = {partial.data(), d.want_dw.data()};
  const Family& red = *Registry::global().find("rmsnorm_bwd_reduce");
  EXPECT_TRUE(red.cpu_reference(red.heuristic(pr), pr, r).ok());
  return d;
}

struct Errors {
  double dx = NAN, dw = NAN;
  // The largest |got - want| of a dw element over what its rounding allows: the dtype's tolerance
  // of |want|, plus 1e-5 of the sum of the magnitudes of the terms it adds (|dy x inv_rms| over
  // rows) for the fp32 accumulation, whose error follows the terms, not their (cancelling) sum.
  // Below 1 passes; a dropped or doubled row is off by a whole term.
  double dw_vs_allowed = NAN;
};

// Uploads the case, poisons dx and dw, calls `run(dy, x, w, inv_rms, dx, dw, dh)` (device pointers
// at the case's offset; dh null without one), and returns the relative errors against the
// reference.
template <class Launch>
Errors check_case(const Case& c, std::mt19937& rng, Launch&& run) {
  const Data d = make_data(c, rng);
  const auto es = dtype_size(c.dtype);
  DeviceBuffer ddy(d.dy.size()), dx_buf(d.x.size()), dw_in(d.w.size()), dinv(d.inv_rms.size() * 4),
      ddx(d.want_dx.size()), ddw(d.want_dw.size()), ddh(d.dh.size());
  ddy.upload(d.dy.data());
  dx_buf.upload(d.x.data());
  dw_in.upload(d.w.data());
  dinv.upload(d.inv_rms.data());
  ddh.upload(d.dh.data());
  ddx.poison();
  ddw.poison();
  auto at = [&](const DeviceBuffer& b) { return static_cast<unsigned char*>(b.get()) + c.offset * es; };
  const DeviceBuffer& dx_home = c.in_place ? ddy : c.dx_is_dh ? ddh : ddx;
  Status s = run(at(ddy), at(dx_buf), at(dw_in), dinv.get(), at(dx_home), ddw.get(), c.dh_stride ? at(ddh) : nullptr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);

  std::vector<unsigned char> got_dx(d.want_dx.size()), got_dw(d.want_dw.size());
  dx_home.download(got_dx.data());
  ddw.download(got_dw.data());
  std::vector<std::int64_t> idx, widx;
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t j = 0; j < c.cols; ++j) idx.push_back(c.offset + r * c.stride + j);
  for (std::int64_t j = 0; j < c.cols; ++j) widx.push_back(j);
  Errors e;
  e.dx = testing::rel_l2(got_dx.data(), d.want_dx.data(), c.dtype, idx);
  e.dw = testing::rel_l2(got_dw.data(), d.want_dw.data(), c.dtype, widx);
  e.dw_vs_allowed = 0;
  for (std::int64_t j = 0; j < c.cols && !std::isnan(e.dw_vs_allowed); ++j) {
    double terms = 0;
    for (std::int64_t r = 0; r < c.rows; ++r) {
      const std::int64_t i = c.offset + r * c.stride + j;
      terms += std::abs(load_as_double(d.dy.data(), c.dtype, i) * load_as_double(d.x.data(), c.dtype, i) *
                        d.inv_rms[std::size_t(r)]);
    }
    const double want = load_as_double(d.want_dw.data(), c.dtype, j);
    const double diff = std::abs(load_as_double(got_dw.data(), c.dtype, j) - want);
    const double allowed = testing::tolerance(c.dtype) * std::abs(want) + 1e-5 * terms;
    e.dw_vs_allowed = std::isnan(diff) ? NAN : std::max(e.dw_vs_allowed, allowed > 0 ? diff / allowed : diff);
  }
  // Padding between strided rows must be left alone (still poisoned).
  if (!c.in_place && !c.dx_is_dh && c.stride > c.cols && c.rows > 1) {
    EXPECT_TRUE(std::isnan(load_as_double(got_dx.data(), c.dtype, c.offset + c.cols))) << "padding was written";
  }
  return e;
}

TensorView rows_view(void* p, const Case& c) {
  TensorView v = TensorView::contiguous(p, c.dtype, {c.rows, c.cols}, Device::cuda(0));
  v.strides[0] = c.stride;
  return v;
}

Status run_op(const Case& c, Runtime* rt, void* dy, void* x, void* w, void* inv, void* dx, void* dw,
              const TensorView* workspace = nullptr) {
  return rms_norm_backward(rows_view(dy, c), rows_view(x, c), TensorView::contiguous(w, c.dtype, {c.cols}, Device::cuda(0)),
                           TensorView::contiguous(inv, DType::f32, {c.rows}, Device::cuda(0)), rows_view(dx, c),
                           TensorView::contiguous(dw, c.dtype, {c.cols}, Device::cuda(0)), nullptr, rt, workspace);
}

// add_rms_norm_backward on a case with recompute (x is h), with dh when the case has one.
Status run_add_op(const Case& c, Runtime* rt, void* dy, void* x, void* w, void* dx, void* dw, void* dh,
                  const TensorView* workspace = nullptr) {
  TensorView dhv = rows_view(dh, c);
  dhv.strides[0] = c.dh_stride;
  TensorView dxv = rows_view(dx, c);
  if (c.dx_is_dh) dxv.strides[0] = c.dh_stride;
  return add_rms_norm_backward(rows_view(dy, c), dh ? &dhv : nullptr, rows_view(x, c),
                               TensorView::contiguous(w, c.dtype, {c.cols}, Device::cuda(0)), dxv,
                               TensorView::contiguous(dw, c.dtype, {c.cols}, Device::cuda(0)), k_eps, nullptr, rt,
                               workspace);
}

int max_cluster() {
  const jit::Driver* d = jit::Driver::get().value();
  CUdevice dev;
  int major = 0;
  d->device_get(&dev, 0);
  d->device_get_attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  return major >= 9 ? 8 : 1;
}

class RmsNormBwdGpu : public testing::GpuFixture {
 protected:
  void expect_close(const Errors& e, DType t, const std::string& what) {
    EXPECT_LT(e.dx, testing::tolerance(t)) << "dx " << dtype_name(t) << " " << what << " seed " << seed_;
    EXPECT_LT(e.dw, testing::tolerance(t)) << "dw " << dtype_name(t) << " " << what << " seed " << seed_;
  }
};

TEST_F(RmsNormBwdGpu, MatchesReferenceForEveryDtypeAndRowLength) {
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (std::int64_t cols : {1, 7, 64, 1000, 2048, 4095, 4096, 5120, 8191, 16384, 65536})
      for (std::int64_t rows : {1, 3, 37, 300}) {
        const Case c{t, rows, cols, cols};
        auto e = check_case(c, rng_, [&](void* dy, void* x, void* w, void* inv, void* dx, void* dw, void*) {
          return run_op(c, rt_.get(), dy, x, w, inv, dx, dw);
        });
        if (cols == 1) {
          // dx = s * dy * w * (1 - s^2 x^2) with s^2 x^2 = x^2 / (x^2 + eps): all cancellation. fp32
          // rounding of the ~1 term leaves a relative error of about 1e-7 * x^2 / eps in dx (0.09
          // seen on an H100 for f32, x ~ 3), so only gross errors (a dropped term is off by
          // x^2/eps, i.e. 1e5 or more) are caught here. dw = sum of dy sign(x) over rows: terms of
          // either sign whose sum may cancel, so its error is bounded against the terms' magnitudes
          // (Errors::dw_vs_allowed).
          EXPECT_LT(e.dx, 0.5) << dtype_name(t) << " " << rows << "x1 seed " << seed_;
          EXPECT_LT(e.dw_vs_allowed, 1.0) << dtype_name(t) << " " << rows << "x1 seed " << seed_;
        } else {
          expect_close(e, t, std::to_string(rows) + "x" + std::to_string(cols));
        }
      }
  EXPECT_GT(rt_->counters().module_loads, 0);
}

TEST_F(RmsNormBwdGpu, ManyRows) {
  for (DType t : {DType::f32, DType::bf16})
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{32768, 256}, {8192, 2048}, {4096, 4096}, {1031, 16384}}) {
      const Case c{t, rows, cols, cols};
      auto e = check_case(c, rng_, [&](void* dy, void* x, void* w, void* inv, void* dx, void* dw, void*) {
        return run_op(c, rt_.get(), dy, x, w, inv, dx, dw);
      });
      expect_close(e, t, std::to_string(rows) + "x" + std::to_string(cols));
    }
}

TEST_F(RmsNormBwdGpu, StridedMisalignedAndInPlace) {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    const std::vector<Case> cases = {
        {t, 9, 1024, 1032},            // padded rows, vectorizable
        {t, 5, 777, 800},              // odd length in aligned strides
        {t, 6, 512, 512, 1},           // base pointers off by one element
        {t, 11, 4096, 4096, 0, true},  // dx = dy
        {t, 4, 3000, 3001},            // odd stride: scalar accesses
        {t, 5, 20000, 20008},          // sm_90: clustered bulk kernel, padded rows, last block short
        {t, 3, 32768, 32768, 0, true}, // sm_90: clustered bulk kernel (clusters of 2 or 4), dx = dy
        {t, 7, 1024, 1040},            // a few rows: one launch (rmsnorm_bwd_rows), padded rows
        {t, 2, 4096, 4096, 0, true},   // a few rows in one launch, dx = dy
        {t, 16, 896, 896},             // 9 to 16 rows in one launch: two rows a block
        {t, 13, 2880, 2944},           // an odd count past 8: one block holds one row
    };
    for (const auto& c : cases) {
      auto e = check_case(c, rng_, [&](void* dy, void* x, void* w, void* inv, void* dx, void* dw, void*) {
        return run_op(c, rt_.get(), dy, x, w, inv, dx, dw);
      });
      expect_close(e, t, std::to_string(c.rows) + "x" + std::to_string(c.cols) + " stride " + std::to_string(c.stride) +
                             " off " + std::to_string(c.offset) + (c.in_place ? " in place" : ""));
    }
  }
}

// Calls queued back to back on one stream, no synchronization between them, every call with its
// own inputs and dw but all sharing the op's cached workspace of partial rows. On sm_90 each
// reduce is a programmatic dependent of its first stage: were it to read the partial rows before
// that stage finished, or a first stage to overwrite them while the previous reduce still read,
// some dw would carry another call's rows.
TEST_F(RmsNormBwdGpu, BackToBackCallsShareTheWorkspace) {
  const jit::Driver* d = jit::Driver::get().value();
  const std::vector<Case> shapes = {{DType::bf16, 2048, 2048, 2048},   // bulk kernel (sm_90), many slabs
                                    {DType::f32, 96, 65536, 65536},    // register kernel, clusters
                                    {DType::bf16, 96, 65536, 65536},   // clustered bulk kernel (sm_90)
                                    {DType::f16, 300, 1000, 1000}};    // register kernel, narrow rows
  for (const Case& c : shapes) {
    constexpr int k_calls = 6;
    const auto es = dtype_size(c.dtype);
    std::vector<Data> data;
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;  // per call: dy, x, w, inv, dx, dw
    for (int i = 0; i < k_calls; ++i) {
      data.push_back(make_data(c, rng_));
      const Data& h = data.back();
      for (const auto* v : {&h.dy, &h.x, &h.w}) {
        bufs.push_back(std::make_unique<DeviceBuffer>(v->size()));
        bufs.back()->upload(v->data());
      }
      bufs.push_back(std::make_unique<DeviceBuffer>(h.inv_rms.size() * 4));
      bufs.back()->upload(h.inv_rms.data());
      bufs.push_back(std::make_unique<DeviceBuffer>(h.want_dx.size()));
      bufs.back()->poison();
      bufs.push_back(std::make_unique<DeviceBuffer>(h.want_dw.size()));
      bufs.back()->poison();
    }
    for (int i = 0; i < k_calls; ++i) {
      auto b = [&](int j) { return bufs[std::size_t(6 * i + j)]->get(); };
      Status s = run_op(c, rt_.get(), b(0), b(1), b(2), b(3), b(4), b(5));
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    ASSERT_EQ(d->ctx_synchronize(), CUDA_SUCCESS);
    std::vector<std::int64_t> widx(std::size_t(c.cols)), idx(std::size_t(c.rows * c.cols));
    for (std::int64_t j = 0; j < c.cols; ++j) widx[std::size_t(j)] = j;
    for (std::int64_t j = 0; j < c.rows * c.cols; ++j) idx[std::size_t(j)] = j;
    for (int i = 0; i < k_calls; ++i) {
      std::vector<unsigned char> got_dx(data[std::size_t(i)].want_dx.size()), got_dw(std::size_t(c.cols) * es);
      bufs[std::size_t(6 * i + 4)]->download(got_dx.data());
      bufs[std::size_t(6 * i + 5)]->download(got_dw.data());
      Errors e;
      e.dx = testing::rel_l2(got_dx.data(), data[std::size_t(i)].want_dx.data(), c.dtype, idx);
      e.dw = testing::rel_l2(got_dw.data(), data[std::size_t(i)].want_dw.data(), c.dtype, widx);
      expect_close(e, c.dtype, std::to_string(c.rows) + "x" + std::to_string(c.cols) + " call " + std::to_string(i));
    }
  }
  // The reduce did launch as a programmatic dependent here on sm_90 and later (the runtime decides
  // from the device's compute capability), and the first stage, which asks for none, did not.
  const int cc = jit::device_info(0).value()->compute_capability;
  for (const char* name : {"rmsnorm_bwd_reduce", "rmsnorm_bwd"}) {
    const Family& f = *Registry::global().find(name);
    auto k = rt_->kernel(KernelSpec{name, f.catalog().front()});
    ASSERT_TRUE(k.ok()) << k.status().to_string();
    EXPECT_EQ((*k)->dependent_launch, f.programmatic_launch() && cc >= 90) << name;
  }
  EXPECT_TRUE(Registry::global().find("rmsnorm_bwd_reduce")->programmatic_launch());
}

TEST_F(RmsNormBwdGpu, CallersWorkspace) {
  const Case c{DType::bf16, 300, 4096, 4096};
  auto need = rms_norm_backward_workspace_elements(
      TensorView::contiguous(reinterpret_cast<void*>(16), c.dtype, {c.rows, c.cols}, Device::cuda(0)));
  ASSERT_TRUE(need.ok()) << need.status().to_string();
  ASSERT_GT(*need, 0);
  DeviceBuffer ws(std::size_t(*need) * 4);
  ws.poison();
  auto wv = TensorView::contiguous(ws.get(), DType::f32, {*need}, Device::cuda(0));
  auto e = check_case(c, rng_, [&](void* dy, void* x, void* w, void* inv, void* dx, void* dw, void*) {
    return run_op(c, rt_.get(), dy, x, w, inv, dx, dw, &wv);
  });
  expect_close(e, c.dtype, "caller's workspace");
  auto small = TensorView::contiguous(ws.get(), DType::f32, {c.cols}, Device::cuda(0));
  check_case(c, rng_, [&](void* dy, void* x, void* w, void* inv, void* dx, void* dw, void*) {
    Status s = run_op(c, rt_.get(), dy, x, w, inv, dx, dw, &small);
    EXPECT_EQ(s.code(), Code::invalid_argument) << s.to_string();
    return Status();
  });
}

// Launches the variant `k` of rmsnorm_bwd on the case's buffers in 5 slabs (the options the
// case's), then the reduction.
Status launch_variant(Runtime& rt, const Kernel& k, const Case& c, int clusters, void* dy, void* x, void* w, void* inv,
                      void* dx, void* dw, void* dh) {
  const std::int64_t slabs = std::min<std::int64_t>(5, c.rows);
  DeviceBuffer ws(std::size_t(slabs * c.cols) * 4);
  const Problem p = Problem::of(c.dtype, 16,
                                families::RmsNormBwdProblem{.rows = c.rows,
                                                            .cols = c.cols,
                                                            .dy_row_stride = c.stride,
                                                            .x_row_stride = c.stride,
                                                            .dx_row_stride = c.dx_is_dh ? c.dh_stride : c.stride,
                                                            .slabs = slabs,
                                                            .max_cluster = clusters,
                                                            .dh_row_stride = c.dh_stride,
                                                            .recompute = c.recompute ? 1 : 0,
                                                            .eps = k_eps});
  void* b[7] = {dy, x, w, c.recompute ? nullptr : inv, dx, ws.get(), dh};
  KILN_TRY(rt.launch(k, p, b, nullptr));
  const Family& red = *Registry::global().find("rmsnorm_bwd_reduce");
  const Problem pr = Problem::of(c.dtype, 16, families::RmsNormBwdReduceProblem{.slabs = slabs, .cols = c.cols});
  auto rk = rt.kernel(KernelSpec{"rmsnorm_bwd_reduce", red.heuristic(pr)});
  KILN_TRY(rk.status());
  void* r[2] = {ws.get(), dw};
  KILN_TRY(rt.launch(**rk, pr, r, nullptr));
  EXPECT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
  return Status();
}

TEST_F(RmsNormBwdGpu, EveryCatalogVariantMatches) {
  const Family& bwd = *Registry::global().find("rmsnorm_bwd");
  const Family& red = *Registry::global().find("rmsnorm_bwd_reduce");
  const jit::Driver* d = jit::Driver::get().value();
  const int clusters = max_cluster();
  for (const Params& params : bwd.catalog()) {
    const auto cluster = *params.get_int("cluster"), group = *params.get_int("group"), vec = *params.get_int("vec"),
               packs = *params.get_int("packs"), rows_per_block = *params.get_int("rows");
    const bool bulk = *params.get_int("stages") > 0;
    if (cluster > clusters || (bulk && clusters <= 1)) continue;  // bulk copies: sm_90 (clusters) only
    const DType t = *parse_dtype(*params.get_str("dtype"));
    auto k = rt_->kernel(KernelSpec{"rmsnorm_bwd", params});
    ASSERT_TRUE(k.ok()) << k.status().to_string();
    // A row that nearly fills the register cache, plus a tail; with one row per block also one
    // that overflows it (the re-read path). Bulk copies take whole 16-byte packs and no overflow:
    // a row 3 packs short of the buffers (of the cluster's blocks), and a row of one pack.
    std::vector<std::int64_t> lengths = {vec * (group * packs * cluster - 3) + (vec - 1)};
    if (bulk) lengths = {vec * (group * packs * cluster - 3), vec};
    else if (rows_per_block == 1) lengths.push_back(vec * (3 * group * packs * cluster + 5) + (vec - 1));
    for (std::int64_t cols : lengths) {
      const std::int64_t stride = (cols + 7) / 8 * 8;
      // The options as the variant has them: dh in rows of its own stride.
      Case c{t, 37, cols, stride};
      c.recompute = *params.get_int("recompute") == 1;
      c.dh_stride = *params.get_int("dh") == 1 ? stride + 8 : 0;
      auto e = check_case(c, rng_, [&](void* dy, void* x, void* w, void* inv, void* dx, void* dw, void* dh) {
        return launch_variant(*rt_, **k, c, clusters, dy, x, w, inv, dx, dw, dh);
      });
      expect_close(e, t, params.canonical() + " cols " + std::to_string(cols));
    }
  }
  for (const Params& params : red.catalog()) {
    const DType t = *parse_dtype(*params.get_str("dtype"));
    auto k = rt_->kernel(KernelSpec{"rmsnorm_bwd_reduce", params});
    ASSERT_TRUE(k.ok()) << k.status().to_string();
    for (std::int64_t slabs : {0, 1, 7, 300}) {
      const std::int64_t cols = 1000;
      auto hp = testing::random_bytes(DType::f32, std::max<std::int64_t>(slabs, 1) * cols, rng_);
      DeviceBuffer dp(hp.size()), ddw(std::size_t(cols) * dtype_size(t));
      dp.upload(hp.data());
      ddw.poison();
      const Problem pr = Problem::of(t, 16, families::RmsNormBwdReduceProblem{.slabs = slabs, .cols = cols});
      void* r[2] = {dp.get(), ddw.get()};
      ASSERT_TRUE(rt_->launch(**k, pr, r, nullptr).ok());
      ASSERT_EQ(d->ctx_synchronize(), CUDA_SUCCESS);
      std::vector<unsigned char> got(std::size_t(cols) * dtype_size(t)), want(got.size());
      ddw.download(got.data());
      void* h[2] = {hp.data(), want.data()};
      ASSERT_TRUE(red.cpu_reference(params, pr, h).ok());
      std::vector<std::int64_t> idx(cols);
      for (std::int64_t j = 0; j < cols; ++j) idx[std::size_t(j)] = j;
      const double err = testing::rel_l2(got.data(), want.data(), t, idx);
      if (slabs == 0) {
        EXPECT_EQ(err, 0) << params.canonical();
      } else {
        EXPECT_LT(err, testing::tolerance(t)) << params.canonical() << " slabs " << slabs << " seed " << seed_;
      }
    }
  }
}

// Every option combination (inv_rms saved or recomputed, dh or not) on every kernel: the
// heuristic's variant for shapes that reach the register kernel (several rows per block, one,
// clustered, re-reading), the bulk-copy kernel and the clustered one, launched directly, on an odd
// row count with strided rows and dh in rows of its own stride.
TEST_F(RmsNormBwdGpu, EveryOptionOnEveryKernel) {
  const Family& bwd = *Registry::global().find("rmsnorm_bwd");
  const int clusters = max_cluster();
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (std::int64_t cols : {200, 1000, 4096, 5120, 8200, 16384, 20000, 65536})
      for (bool recompute : {false, true})
        for (bool dh : {false, true}) {
          const std::int64_t stride = cols + 16;
          Case c{t, 37, cols, stride};
          c.recompute = recompute;
          c.dh_stride = dh ? cols + 24 : 0;
          const Problem p = Problem::of(t, 16,
                                        families::RmsNormBwdProblem{.rows = c.rows,
                                                                    .cols = cols,
                                                                    .dy_row_stride = stride,
                                                                    .x_row_stride = stride,
                                                                    .dx_row_stride = stride,
                                                                    .max_cluster = clusters,
                                                                    .dh_row_stride = c.dh_stride,
                                                                    .recompute = recompute ? 1 : 0,
                                                                    .eps = k_eps});
          const Params params = bwd.heuristic(p);
          auto k = rt_->kernel(KernelSpec{"rmsnorm_bwd", params});
          ASSERT_TRUE(k.ok()) << k.status().to_string();
          auto e = check_case(c, rng_, [&](void* dy, void* x, void* w, void* inv, void* dx, void* dw, void* dhp) {
            return launch_variant(*rt_, **k, c, clusters, dy, x, w, inv, dx, dw, dhp);
          });
          expect_close(e, t, params.canonical() + " cols " + std::to_string(cols));
        }
}

// add_rms_norm_backward through the typed op, against the reference with inv_rms recomputed.
class AddRmsNormBwdGpu : public RmsNormBwdGpu {
 protected:
  void check_op(const Case& c, const TensorView* workspace = nullptr) {
    auto e = check_case(c, rng_, [&](void* dy, void* x, void* w, void*, void* dx, void* dw, void* dh) {
      return run_add_op(c, rt_.get(), dy, x, w, dx, dw, dh, workspace);
    });
    const std::string what = std::to_string(c.rows) + "x" + std::to_string(c.cols) + " stride " +
                             std::to_string(c.stride) + " dh stride " + std::to_string(c.dh_stride) + " off " +
                             std::to_string(c.offset) + (c.in_place ? " dx = dy" : "") + (c.dx_is_dh ? " dx = dh" : "");
    if (c.cols == 1) {
      // All cancellation (see RmsNormBwdGpu.MatchesReferenceForEveryDtypeAndRowLength), and dh
      // may be small.
      EXPECT_LT(e.dx, 0.5) << dtype_name(c.dtype) << " " << what << " seed " << seed_;
      EXPECT_LT(e.dw_vs_allowed, 1.0) << dtype_name(c.dtype) << " " << what << " seed " << seed_;
    } else {
      expect_close(e, c.dtype, what);
    }
  }
};

TEST_F(AddRmsNormBwdGpu, MatchesReferenceForEveryDtypeAndRowLength) {
  // Row lengths that reach every kernel on sm_90: registers (short, odd), bulk copies (2048 to
  // 8192 bf16), clusters (8200 and 16384 f16/bf16 with dh, 20000, 65536).
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (std::int64_t cols : {1, 7, 64, 1000, 2048, 4095, 4096, 5120, 8191, 8200, 16384, 20000, 65536})
      for (std::int64_t rows : {1, 3, 37, 300})
        for (bool dh : {false, true}) {
          Case c{t, rows, cols, cols};
          c.recompute = true;
          c.dh_stride = dh ? cols : 0;
          check_op(c);
        }
  EXPECT_GT(rt_->counters().module_loads, 0);
}

TEST_F(AddRmsNormBwdGpu, ManyRows) {
  for (DType t : {DType::f32, DType::bf16})
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{32768, 256}, {8192, 2048}, {4096, 4096},
                              {1031, 16384}, {4097, 8192}}) {
      Case c{t, rows, cols, cols};
      c.recompute = true;
      c.dh_stride = cols;
      check_op(c);
    }
}

TEST_F(AddRmsNormBwdGpu, StridedMisalignedAndInPlace) {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    std::vector<Case> cases = {
        {t, 9, 1024, 1032},      // padded rows, vectorizable
        {t, 5, 777, 800},        // odd length in aligned strides
        {t, 6, 512, 512, 1},     // base pointers off by one element
        {t, 4, 3000, 3001},      // odd stride: scalar accesses
        {t, 7, 4096, 4104},      // bulk copies (sm_90), padded rows
        {t, 5, 20000, 20008},    // clustered bulk kernel, last block short
        {t, 3, 16384, 16392},    // f16/bf16 with dh: clusters of 2
        {t, 16, 896, 904},       // one launch of rmsnorm_bwd_rows with dh, two rows a block
        {t, 11, 4096, 4096},
    };
    for (Case c : cases) {
      c.recompute = true;
      for (std::int64_t dh_pad : {-1, 0, 8, 1}) {  // -1: no dh
        c.dh_stride = dh_pad < 0 ? 0 : c.cols + dh_pad;
        check_op(c);
      }
      c.dh_stride = c.stride;
      c.in_place = true;
      check_op(c);
      c.in_place = false;
      c.dx_is_dh = true;
      check_op(c);
    }
  }
}

// rms_norm_backward_workspace_elements(h) is enough for add_rms_norm_backward, also where dh
// sends f16/bf16 rows to the clustered kernel, whose slab count the driver gives (clusters
// resident at once: smaller blocks than the other clustered variants may fit several to an SM).
TEST_F(AddRmsNormBwdGpu, CallersWorkspace) {
  for (DType t : {DType::f16, DType::bf16})
    for (std::int64_t cols : {8200, 12288, 16384, 4096}) {
      Case c{t, 400, cols, cols};  // more rows than clusters fit at once
      c.recompute = true;
      c.dh_stride = c.cols;
      auto need = rms_norm_backward_workspace_elements(
          TensorView::contiguous(reinterpret_cast<void*>(16), c.dtype, {c.rows, c.cols}, Device::cuda(0)));
      ASSERT_TRUE(need.ok()) << need.status().to_string();
      DeviceBuffer ws(std::size_t(*need) * 4);
      ws.poison();
      const auto wv = TensorView::contiguous(ws.get(), DType::f32, {*need}, Device::cuda(0));
      check_op(c, &wv);
    }
  Case c{DType::bf16, 300, 16384, 16384};
  c.recompute = true;
  c.dh_stride = c.cols;
  DeviceBuffer ws(std::size_t(c.cols) * 4);
  const auto small = TensorView::contiguous(ws.get(), DType::f32, {c.cols}, Device::cuda(0));
  check_case(c, rng_, [&](void* dy, void* x, void* w, void*, void* dx, void* dw, void* dh) {
    Status s = run_add_op(c, rt_.get(), dy, x, w, dx, dw, dh, &small);
    EXPECT_EQ(s.code(), Code::invalid_argument) << s.to_string();
    return Status();
  });
}

}  // namespace
}  // namespace kiln
