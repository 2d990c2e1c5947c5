// RMSNorm on the GPU against the CPU reference: fresh random data each run, outputs poisoned
// before each launch, every dtype, odd and wide rows, strided and misaligned views, in place, every
// catalog variant, and the daemon path with a real kilnd.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <tuple>

#include "cache/store.h"
#include "families/rmsnorm/rmsnorm.h"
#include "kiln/ops.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

struct Case {
  DType dtype;
  std::int64_t rows, cols, x_stride, y_stride;
  std::int64_t offset = 0;  // elements added to every base pointer (misalignment)
  bool in_place = false;
};

// Runs one case through `run` (which launches) and checks against the reference. Returns the error.
template <class Launch>
double check_case(const Case& c, std::mt19937& rng, Launch&& run) {
  const auto es = dtype_size(c.dtype);
  const std::int64_t x_elems = c.offset + (c.rows - 1) * c.x_stride + c.cols;
  const std::int64_t y_elems = c.offset + (c.rows - 1) * c.y_stride + c.cols;
  auto hx = testing::random_bytes(c.dtype, x_elems, rng, 2.0f);
  auto hw = testing::random_bytes(c.dtype, c.offset + c.cols, rng);
  DeviceBuffer dx(hx.size()), dw(hw.size()), dy(y_elems * es);
  dx.upload(hx.data());
  dw.upload(hw.data());
  dy.poison();
  unsigned char* xp = static_cast<unsigned char*>(dx.get()) + c.offset * es;
  unsigned char* wp = static_cast<unsigned char*>(dw.get()) + c.offset * es;
  unsigned char* yp = c.in_place ? xp : static_cast<unsigned char*>(dy.get()) + c.offset * es;

  Status s = run(xp, wp, yp);
  EXPECT_TRUE(s.ok()) << s.to_string();
  const jit::Driver* d = jit::Driver::get().value();
  EXPECT_EQ(d->ctx_synchronize(), CUDA_SUCCESS);

  std::vector<unsigned char> got(c.in_place ? hx.size() : y_elems * es);
  (c.in_place ? dx : dy).download(got.data());
  // Reference on the host copy, same strides (in place: y aliases x).
  std::vector<unsigned char> want = c.in_place ? hx : std::vector<unsigned char>(got.size(), 0xFF);
  const Problem p = Problem::of(c.dtype, 16,
                                families::RmsNormProblem{.rows = c.rows, .cols = c.cols, .x_row_stride = c.x_stride,
                                                         .y_row_stride = c.in_place ? c.x_stride : c.y_stride,
                                                         .eps = 1e-5});
  void* bufs[3] = {hx.data() + c.offset * es, hw.data() + c.offset * es,
                   (c.in_place ? want.data() : want.data()) + c.offset * es};
  if (c.in_place) bufs[0] = want.data() + c.offset * es;
  const Family& f = *Registry::global().find("rmsnorm");
  EXPECT_TRUE(f.cpu_reference(f.heuristic(p), p, bufs).ok());

  std::vector<std::int64_t> idx;
  const std::int64_t ys = c.in_place ? c.x_stride : c.y_stride;
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t col = 0; col < c.cols; ++col) idx.push_back(c.offset + r * ys + col);
  double err = testing::rel_l2(got.data(), want.data(), c.dtype, idx);
  // Padding between strided rows must be left alone (still poisoned).
  if (!c.in_place && c.y_stride > c.cols && c.rows > 1) {
    const auto pad = c.offset + c.cols;  // first element after row 0
    EXPECT_TRUE(std::isnan(load_as_double(got.data(), c.dtype, pad))) << "padding was written";
  }
  return err;
}

Status run_op(const Case& c, void* x, void* w, void* y, Runtime* rt, Stream stream = nullptr) {
  TensorView xv = TensorView::contiguous(x, c.dtype, {c.rows, c.cols}, Device::cuda(0));
  xv.strides[0] = c.x_stride;
  TensorView yv = TensorView::contiguous(y, c.dtype, {c.rows, c.cols}, Device::cuda(0));
  yv.strides[0] = c.in_place ? c.x_stride : c.y_stride;
  TensorView wv = TensorView::contiguous(w, c.dtype, {c.cols}, Device::cuda(0));
  return rms_norm(xv, wv, yv, 1e-5, stream, rt);
}

// Launches k on p as given, its SM count and compute capability included (Runtime::launch puts in
// the device's own), so that a test can size the grid as for a GPU of a few SMs.
Status launch_as_given(const Kernel& k, const Problem& p, std::span<void* const> buffers, CUstream stream) {
  const Family& f = *k.family;
  KILN_TRY(f.check_problem(k.params, p));
  const LaunchGeometry g = f.geometry(k.params, p);
  ArgPack args;
  f.pack_args(k.params, p, buffers, args);
  const jit::Driver* d = jit::Driver::get().value();
  return d->check(d->launch_kernel(static_cast<CUfunction>(k.function), g.grid.x, g.grid.y, g.grid.z, g.block.x,
                                   g.block.y, g.block.z, g.shared_bytes, stream, args.pointers(), nullptr),
                  "cuLaunchKernel");
}

using RmsNormGpu = testing::GpuFixture;

TEST_F(RmsNormGpu, MatchesReferenceForEveryDtypeAndRowLength) {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    for (std::int64_t cols : {1, 7, 64, 1000, 2048, 4095, 4096, 5120, 8191, 16384, 65536}) {
      for (std::int64_t rows : {1, 3, 37}) {
        Case c{t, rows, cols, cols, cols};
        double err = check_case(c, rng_, [&](void* x, void* w, void* y) { return run_op(c, x, w, y, rt_.get()); });
        EXPECT_LT(err, testing::tolerance(t)) << dtype_name(t) << " " << rows << "x" << cols << " seed " << seed_;
      }
    }
  }
  EXPECT_GT(rt_->counters().module_loads, 0);
  EXPECT_EQ(rt_->resolver(), "embedded");
}

TEST_F(RmsNormGpu, ManyRowsPipelineSeveralRowsPerBlock) {
  // More rows than the capped grid (about 1024 threads per SM): blocks loop over rows with the
  // next row's loads in flight. Row lengths from one pack to the largest that pipelines.
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    for (std::int64_t cols : {7, 1000, 4096, 4100}) {
      Case c{t, 6000, cols, cols, cols};
      double err = check_case(c, rng_, [&](void* x, void* w, void* y) { return run_op(c, x, w, y, rt_.get()); });
      EXPECT_LT(err, testing::tolerance(t)) << dtype_name(t) << " 6000x" << cols << " seed " << seed_;
    }
  }
}

TEST_F(RmsNormGpu, RowsOfTenToThirtyTwoKiBTakeSixteenByteAccesses) {
  // From 2048 to 16383 rows, f16/bf16 rows of 10-32 KiB run the heuristic's 16-byte accesses (four
  // per thread), 5120 columns with 2.5 packs per thread of 256; an odd row length narrows the
  // access and keeps that path's rule otherwise.
  const Family& f = *Registry::global().find("rmsnorm");
  for (DType t : {DType::f16, DType::bf16}) {
    for (std::int64_t cols : {5120, 12288, 16384, 5121}) {
      Case c{t, 2500, cols, cols, cols};
      const Problem p = Problem::of(
          t, 256, families::RmsNormProblem{.rows = c.rows, .cols = cols, .x_row_stride = cols, .y_row_stride = cols});
      EXPECT_EQ(*f.heuristic(p).get_int("vec"), cols % 8 ? 1 : 8) << cols;
      double err = check_case(c, rng_, [&](void* x, void* w, void* y) { return run_op(c, x, w, y, rt_.get()); });
      EXPECT_LT(err, testing::tolerance(t)) << dtype_name(t) << " 2500x" << cols << " seed " << seed_;
    }
  }
}

TEST_F(RmsNormGpu, WideRowsThroughTheTypedOp) {
  // 2048 rows of 64K elements (bf16) and 32K (f32): on sm_90 the heuristic's bulk-copy kernel
  // (128 KiB rows); in padded strides too.
  for (DType t : {DType::f32, DType::bf16}) {
    const std::int64_t cols = 128 * 1024 / std::int64_t(dtype_size(t));
    for (Case c : {Case{t, 2048, cols, cols, cols}, Case{t, 2048, cols, cols + 64, cols + 8}}) {
      double err = check_case(c, rng_, [&](void* x, void* w, void* y) { return run_op(c, x, w, y, rt_.get()); });
      EXPECT_LT(err, testing::tolerance(t)) << dtype_name(t) << " 2048x" << cols << " stride " << c.x_stride
                                            << " seed " << seed_;
    }
  }
}

TEST_F(RmsNormGpu, StridedMisalignedAndInPlace) {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    std::vector<Case> cases = {
        {t, 9, 1024, 1032, 1040},          // padded rows, vectorizable
        {t, 5, 777, 800, 777},             // odd length in aligned strides
        {t, 6, 512, 512, 512, 1},          // base pointers off by one element
        {t, 11, 4096, 4096, 4096, 0, true},  // y aliases x
        {t, 4, 3000, 3001, 3003},          // odd strides: scalar path
    };
    for (const auto& c : cases) {
      double err = check_case(c, rng_, [&](void* x, void* w, void* y) { return run_op(c, x, w, y, rt_.get()); });
      EXPECT_LT(err, testing::tolerance(t)) << dtype_name(t) << " " << c.rows << "x" << c.cols << " stride " << c.x_stride
                                            << "/" << c.y_stride << " off " << c.offset << " seed " << seed_;
    }
  }
}

TEST_F(RmsNormGpu, EveryCatalogVariantMatchesOnItsOwnStream) {
  const Family& f = *Registry::global().find("rmsnorm");
  const jit::Driver* d = jit::Driver::get().value();
  CUstream stream = nullptr;
  ASSERT_EQ(d->stream_create(&stream, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  CUdevice dev;
  int major = 0, minor = 0;
  ASSERT_EQ(d->device_get(&dev, 0), CUDA_SUCCESS);
  ASSERT_EQ(d->device_get_attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), CUDA_SUCCESS);
  ASSERT_EQ(d->device_get_attribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), CUDA_SUCCESS);
  const int cc = major * 10 + minor;
  int bulk_variants = 0, row_variants = 0;
  for (const Params& params : f.catalog()) {
    DType t = *parse_dtype(*params.get_str("dtype"));
    const std::int64_t bulk = *params.get_int("bulk");
    if (bulk > 0 && cc < 90) continue;  // sm_90 kernels: check_problem refuses them here (CPU tests)
    auto k = rt_->kernel(KernelSpec{"rmsnorm", params});
    ASSERT_TRUE(k.ok()) << k.status().to_string();
    std::vector<std::pair<Case, std::int64_t>> cases;
    if (const std::int64_t row = *params.get_int("row"); row > 0) {
      // The one-row kernel: the widest row it holds, in padded strides; a row a few packs short of
      // the last pack of every thread, and one row alone.
      ++row_variants;
      const std::int64_t vec = *params.get_int("vec"), widest = *params.get_int("block") * row * vec;
      cases = {{Case{t, 13, widest, widest + vec, widest + 3 * vec}, 0},
               {Case{t, 5, widest - 3 * vec, widest - 3 * vec, widest - 3 * vec}, 0},
               {Case{t, 1, vec, vec, vec}, 0}};
    } else if (bulk == 0) {
      // Tail elements and several packs per thread; then rows long enough that every variant uses
      // its register cache, its shared-memory cache and re-reads the rest.
      // Last, many short rows on a grid capped as if the GPU had 3 SMs: every variant whose rows
      // fit half its register cache pipelines several rows per block.
      cases = {{Case{t, 13, 8 * 300 + 3, 8 * 300 + 8, 8 * 300 + 8}, 0},
               {Case{t, 3, 8 * 8192 + 5, 8 * 8192 + 8, 8 * 8192 + 8}, 0},
               {Case{t, 700, 8 * 40 + 3, 8 * 40 + 8, 8 * 40 + 8}, 3}};
    } else {
      // Bulk-copy kernel (whole 16-byte packs, 16-byte aligned rows): the widest row it holds
      // less a few packs, in padded strides, one block per row; a second part that ends inside
      // the threads' last packs, many rows per persistent block (3 SMs); a row within the first
      // part alone (the second copy is empty).
      ++bulk_variants;
      const std::int64_t vec = 16 / std::int64_t(dtype_size(t)), block = *params.get_int("block");
      const std::int64_t widest = block * bulk * vec - 5 * vec, split = (block * (bulk / 2) + 37) * vec;
      cases = {{Case{t, 13, widest, widest + vec, widest + 3 * vec}, 0},
               {Case{t, 300, split, split, split}, 3},
               {Case{t, 40, 37 * vec, 40 * vec, 37 * vec}, 5}};
    }
    for (auto [c, sms] : cases) {
      double err = check_case(c, rng_, [&](void* x, void* w, void* y) {
        Problem p = Problem::of(t, 16,
                                families::RmsNormProblem{.rows = c.rows, .cols = c.cols, .x_row_stride = c.x_stride,
                                                         .y_row_stride = c.y_stride, .eps = 1e-5});
        p.sm_count = std::uint16_t(sms);
        p.cc = std::uint8_t(cc);
        void* b[3] = {x, w, y};
        Status s = launch_as_given(**k, p, b, stream);
        if (s.ok()) {
          EXPECT_EQ(d->stream_synchronize(stream), CUDA_SUCCESS);
        }
        return s;
      });
      EXPECT_LT(err, testing::tolerance(t)) << params.canonical() << " " << c.cols << " columns, seed " << seed_;
    }
  }
  if (cc >= 90) {
    EXPECT_EQ(bulk_variants, 9);
  }
  EXPECT_EQ(row_variants, 30);
  d->stream_destroy(stream);
}

TEST_F(RmsNormGpu, SavesInverseRmsForTheBackwardPass) {
  // The register kernel, and (2048 rows of 128 KiB, on sm_90) the bulk-copy kernel.
  for (auto [t, rows, cols] : {std::tuple{DType::f32, std::int64_t(33), std::int64_t(4100)},
                               std::tuple{DType::bf16, std::int64_t(33), std::int64_t(4100)},
                               std::tuple{DType::bf16, std::int64_t(2048), std::int64_t(65536)}}) {
    auto hx = testing::random_bytes(t, rows * cols, rng_, 3.0f);
    auto hw = testing::random_bytes(t, cols, rng_);
    DeviceBuffer dx(hx.size()), dw(hw.size()), dy(hx.size()), dinv(rows * 4);
    dx.upload(hx.data());
    dw.upload(hw.data());
    dy.poison();
    dinv.poison();
    auto xv = TensorView::contiguous(dx.get(), t, {rows, cols}, Device::cuda(0));
    auto yv = TensorView::contiguous(dy.get(), t, {rows, cols}, Device::cuda(0));
    auto wv = TensorView::contiguous(dw.get(), t, {cols}, Device::cuda(0));
    auto iv = TensorView::contiguous(dinv.get(), DType::f32, {rows}, Device::cuda(0));
    ASSERT_TRUE(rms_norm(xv, wv, yv, iv, 1e-5, nullptr, rt_.get()).ok());
    std::vector<float> got(rows);
    dinv.download(got.data());
    for (std::int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (std::int64_t c = 0; c < cols; ++c) ss += std::pow(load_as_double(hx.data(), t, r * cols + c), 2);
      EXPECT_NEAR(got[r], 1 / std::sqrt(ss / cols + 1e-5), 1e-5 * got[r]) << dtype_name(t) << " row " << r;
    }
    auto bad = TensorView::contiguous(dinv.get(), DType::f32, {rows - 1}, Device::cuda(0));
    EXPECT_EQ(rms_norm(xv, wv, yv, bad, 1e-5, nullptr, rt_.get()).code(), Code::shape_mismatch);
  }
}

class RmsNormColdCacheGpu : public testing::GpuFixture {
 protected:
  bool seed_cache() const override { return false; }
};

TEST_F(RmsNormColdCacheGpu, SecondRuntimeLoadsFromTheCacheWithoutCompiling) {
  Case c{DType::bf16, 4, 4096, 4096, 4096};
  ASSERT_LT(check_case(c, rng_, [&](void* x, void* w, void* y) { return run_op(c, x, w, y, rt_.get()); }), 1e-2);
  RuntimeOptions o;
  o.mode = ResolverMode::embedded;
  o.cache_file = (dir_.path() / "k.sqlite").string();
  auto second = Runtime::create(o).value();
  ASSERT_LT(check_case(c, rng_, [&](void* x, void* w, void* y) { return run_op(c, x, w, y, second.get()); }), 1e-2);
  auto st = cache::Store::open(dir_.path() / "k.sqlite").value();
  auto stats = st->stats().value();
  EXPECT_EQ(stats.stores, 1);  // compiled once, by the first runtime
  EXPECT_GE(stats.hits, 1);    // the second runtime's lookup
}

TEST_F(RmsNormGpu, ThroughARealDaemon) {
  testing::TempDir run_dir;
  const std::string sock = (run_dir.path() / "kiln" / "kilnd.sock").string();
  pid_t pid = fork();
  if (pid == 0) {
    setenv("KILN_SOCKET", sock.c_str(), 1);
    setenv("KILN_CACHE_DIR", (run_dir.path() / "cache").c_str(), 1);
    execl(KILN_KILND_PATH, "kilnd", nullptr);
    _exit(127);
  }
  // Whatever happens below, the daemon must not outlive the test (it holds our stdout open).
  struct Reaper {
    pid_t pid;
    ~Reaper() {
      if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
  } reaper{pid};
  RuntimeOptions o;
  o.mode = ResolverMode::daemon;
  o.socket_path = sock;
  std::shared_ptr<Runtime> rt;
  Case c{DType::f16, 7, 5120, 5120, 5120};
  Status last;
  for (int i = 0; i < 100; ++i) {  // wait up to ~10 s for the daemon to listen
    rt = Runtime::create(o).value();
    last = Status();
    auto k = rt->kernel(KernelSpec{"rmsnorm", Registry::global().find("rmsnorm")->catalog()[0]});
    if (k.ok()) break;
    last = k.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(last.ok()) << last.to_string();
  double err = check_case(c, rng_, [&](void* x, void* w, void* y) { return run_op(c, x, w, y, rt.get()); });
  EXPECT_LT(err, testing::tolerance(DType::f16));
  EXPECT_EQ(rt->resolver(), "daemon");
  EXPECT_GE(rt->counters().from_daemon, 2);
  EXPECT_EQ(rt->counters().from_embedded, 0);
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  reaper.pid = 0;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "kilnd exit status " << status;
}

}  // namespace
}  // namespace kiln
