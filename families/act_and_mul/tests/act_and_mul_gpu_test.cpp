// Activation-and-mul on the GPU against the CPU reference: fresh random data each run, the output
// poisoned before each launch (out of place), every activation and dtype, odd and LLM-sized d, one
// and many rows, strided and misaligned views, in place (out = x[..., :d]), every catalog variant.
#include <gtest/gtest.h>

#include <cstring>

#include "families/act_and_mul/act_and_mul.h"
#include "kiln/ops.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

struct Case {
  DType dtype;
  Activation act;
  std::int64_t rows, d;
  std::int64_t xs = 0, os = 0;  // row strides; 0: 2d and d
  std::int64_t offset = 0;      // elements added to both base pointers (misalignment)
  bool in_place = false;        // out = x[..., :d]
  std::int64_t x_stride() const { return xs ? xs : 2 * d; }
  std::int64_t out_stride() const { return in_place ? x_stride() : os ? os : d; }
  std::string describe() const {
    return std::string(dtype_name(dtype)) + " act " + std::to_string(int(act)) + " " + std::to_string(rows) + "x" +
           std::to_string(d) + " strides " + std::to_string(x_stride()) + "/" + std::to_string(out_stride()) + " off " +
           std::to_string(offset) + (in_place ? " in place" : "");
  }
};

std::int64_t act_code(Activation a) {
  return a == Activation::silu ? families::k_am_silu : a == Activation::gelu ? families::k_am_gelu
                                                                             : families::k_am_gelu_tanh;
}

// Absolute error allowed on top of the relative one, per element (the L2 analogue of
// torch.testing's |got - want| <= atol + rtol |want|): f16/bf16 outputs take the cheaper
// activation forms (families/act_and_mul/activations.cuh), as PyTorch's kernels do, whose error
// at far-negative gates is small in absolute terms and large against the tiny output itself:
// GELU (erf) flushes x Phi(x) to 0 below x = -5.66 (|output| < 4.4e-8 |up|), and GELU (tanh)
// computes 1 + tanh(u), which cancels (about 1e-7 |x up| absolute). Found by a 1 x 1 bf16 case
// whose only gate fell near -4.3 (relative error 0.012 against 0.01). f32 outputs take forms
// with full relative accuracy and get no absolute allowance.
double atol(DType t) { return t == DType::f32 ? 0.0 : 1e-5; }

// ||got - want|| over idx against rtol ||want|| + atol sqrt(n); true when within.
bool within(const void* got, const void* want, DType t, const std::vector<std::int64_t>& idx, double rtol,
            double abs_tol, double* err_out) {
  const testing::L2Norms n = testing::l2_norms(got, want, t, idx);
  *err_out = n.diff;
  return n.diff <= rtol * n.want + abs_tol * std::sqrt(double(idx.size()));  // false when NaN
}

template <class Launch>
void check_case(const Case& c, std::mt19937& rng, unsigned seed, Launch&& run,
                const std::vector<unsigned char>* gate_values = nullptr, std::int64_t only_first = 0) {
  SCOPED_TRACE(c.describe() + " seed " + std::to_string(seed));
  const auto es = dtype_size(c.dtype);
  const std::int64_t x_elems = c.offset + (c.rows - 1) * c.x_stride() + 2 * c.d;
  const std::int64_t out_elems = c.offset + (c.rows - 1) * c.out_stride() + c.d;
  auto hx = testing::random_bytes(c.dtype, x_elems, rng, 2.0f);
  if (gate_values) hx = *gate_values;
  DeviceBuffer dx(hx.size()), dout(out_elems * es);
  dx.upload(hx.data());
  dout.poison();
  unsigned char* xp = static_cast<unsigned char*>(dx.get()) + c.offset * es;
  unsigned char* op = c.in_place ? xp : static_cast<unsigned char*>(dout.get()) + c.offset * es;
  Status s = run(xp, op);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);

  std::vector<unsigned char> got(c.in_place ? hx.size() : out_elems * es);
  (c.in_place ? dx : dout).download(got.data());
  std::vector<unsigned char> want = c.in_place ? hx : std::vector<unsigned char>(got.size(), 0xFF);
  const Problem p = Problem::of(c.dtype, 16,
                                families::ActAndMulProblem{.rows = c.rows,
                                                           .d = c.d,
                                                           .x_row_stride = c.x_stride(),
                                                           .out_row_stride = c.out_stride(),
                                                           .activation = act_code(c.act)});
  void* bufs[2] = {(c.in_place ? want.data() : hx.data()) + c.offset * es, want.data() + c.offset * es};
  const Family& f = *Registry::global().find("act_and_mul");
  ASSERT_TRUE(f.cpu_reference(f.heuristic(p), p, bufs).ok());

  std::vector<std::int64_t> idx;
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t col = 0; col < (only_first ? only_first : c.d); ++col)
      idx.push_back(c.offset + r * c.out_stride() + col);
  double abs_err = 0;
  EXPECT_TRUE(within(got.data(), want.data(), c.dtype, idx, testing::tolerance(c.dtype), atol(c.dtype), &abs_err))
      << "L2 error " << abs_err << ", relative " << testing::rel_l2(got.data(), want.data(), c.dtype, idx);
  if (c.in_place) {
    // The gate halves are read, never written.
    std::int64_t changed = 0;
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t col = 0; col < c.d; ++col) {
        const std::int64_t i = c.offset + r * c.x_stride() + c.d + col;
        changed += std::memcmp(got.data() + i * es, hx.data() + i * es, es) != 0;
      }
    EXPECT_EQ(changed, 0);
  } else if (c.rows > 1 && c.out_stride() > c.d) {
    EXPECT_TRUE(std::isnan(load_as_double(got.data(), c.dtype, c.offset + c.d))) << "padding was written";
  }
}

Status run_op(const Case& c, void* x, void* out, Runtime* rt) {
  TensorView xv = TensorView::contiguous(x, c.dtype, {c.rows, 2 * c.d}, Device::cuda(0));
  xv.strides[0] = c.x_stride();
  TensorView ov = TensorView::contiguous(out, c.dtype, {c.rows, c.d}, Device::cuda(0));
  ov.strides[0] = c.out_stride();
  return act_and_mul(xv, ov, c.act, nullptr, rt);
}

class ActAndMulGpu : public testing::GpuFixture {
 protected:
  void check(const Case& c) {
    check_case(c, rng_, seed_, [&](void* x, void* out) { return run_op(c, x, out, rt_.get()); });
  }
};

constexpr Activation k_acts[] = {Activation::silu, Activation::gelu, Activation::gelu_tanh};

TEST_F(ActAndMulGpu, MatchesReferenceForEveryActivationDtypeAndWidth) {
  for (Activation a : k_acts)
    for (DType t : {DType::f32, DType::f16, DType::bf16}) {
      for (std::int64_t d : {1, 3, 7, 64, 1000, 4095, 4096, 11008, 14336})
        for (std::int64_t rows : {1, 3, 37}) check({t, a, rows, d});
      check({t, a, 3000, 4096});  // many rows: 1.5M packs over a flat grid
    }
  EXPECT_GT(rt_->counters().module_loads, 0);
}

TEST_F(ActAndMulGpu, FarNegativeGatesStayWithinTheAbsoluteAllowance) {
  // Every gate in [-9, -3] (outputs from about -1e-2 down to 0), every up value 1.5, checked over
  // the whole row and over the gates below -5 alone (the first 170, outputs under 1e-5 in size,
  // whose errors the whole row's norm would hide): f32 must stay relatively accurate even there;
  // f16/bf16 within the absolute allowance above, and this is where their cheaper forms differ
  // most from the reference.
  const std::int64_t d = 256;
  for (Activation a : k_acts)
    for (DType t : {DType::f32, DType::f16, DType::bf16}) {
      const auto es = dtype_size(t);
      std::vector<unsigned char> x(2 * d * es);
      for (std::int64_t i = 0; i < d; ++i) {
        store_from_double(x.data(), t, i, -9.0 + 6.0 * double(i) / double(d - 1));
        store_from_double(x.data(), t, d + i, 1.5);
      }
      const Case c{t, a, 1, d};
      for (std::int64_t first : {std::int64_t(0), std::int64_t(170)})
        check_case(c, rng_, seed_, [&](void* xp, void* out) { return run_op(c, xp, out, rt_.get()); }, &x, first);
    }
}

TEST_F(ActAndMulGpu, StridedMisalignedAndInPlace) {
  for (Activation a : k_acts)
    for (DType t : {DType::f32, DType::f16, DType::bf16}) {
      const std::vector<Case> cases = {
          {t, a, 9, 1024, 2056, 1032},         // padded rows, vectorizable
          {t, a, 5, 777, 1600, 800},           // odd d in aligned strides
          {t, a, 6, 512, 0, 0, 1},             // base pointers off by one element
          {t, a, 11, 4096, 0, 0, 0, true},     // in place
          {t, a, 4, 11008, 22032, 0, 8, true}, // in place, strided, offset
          {t, a, 4, 3000, 6001, 3003},         // odd strides: scalar path
          {t, a, 1, 14336, 0, 0, 0, true},     // one row in place
      };
      for (const auto& c : cases) check(c);
    }
}

TEST_F(ActAndMulGpu, EveryCatalogVariantMatchesOnItsOwnStream) {
  const Family& f = *Registry::global().find("act_and_mul");
  const jit::Driver* drv = jit::Driver::get().value();
  CUstream stream = nullptr;
  ASSERT_EQ(drv->stream_create(&stream, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  for (const Params& params : f.catalog()) {
    SCOPED_TRACE(params.canonical());
    const DType t = *parse_dtype(*params.get_str("dtype"));
    const std::string act = *params.get_str("act");
    const Activation a = act == "silu" ? Activation::silu : act == "gelu" ? Activation::gelu : Activation::gelu_tanh;
    auto k = rt_->kernel(KernelSpec{"act_and_mul", params});
    ASSERT_TRUE(k.ok()) << k.status().to_string();
    for (bool in_place : {false, true}) {
      Case c{t, a, 13, 8 * 173, 2 * 8 * 173 + 8, 8 * 173 + 16, 0, in_place};
      check_case(c, rng_, seed_, [&](void* x, void* out) {
        const Problem p = Problem::of(t, 16,
                                      families::ActAndMulProblem{.rows = c.rows,
                                                                 .d = c.d,
                                                                 .x_row_stride = c.x_stride(),
                                                                 .out_row_stride = c.out_stride(),
                                                                 .activation = act_code(a)});
        void* b[2] = {x, out};
        Status s = rt_->launch(**k, p, b, stream);
        if (s.ok()) {
          EXPECT_EQ(drv->stream_synchronize(stream), CUDA_SUCCESS);
        }
        return s;
      });
    }
  }
  drv->stream_destroy(stream);
}

}  // namespace
}  // namespace kiln
