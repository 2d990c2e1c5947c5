// act_and_mul's backward on the GPU against the CPU reference: fresh random x and dy each run, dx
// poisoned before each launch (out of place), every activation and dtype, odd and LLM-sized d, one
// and many rows, strided and misaligned views, in place (dx = x), every catalog variant.
#include <gtest/gtest.h>

#include <cstring>

#include "families/act_and_mul/act_and_mul.h"
#include "families/act_and_mul/ops.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

struct Case {
  DType dtype;
  Activation act;
  std::int64_t rows, d;
  std::int64_t xs = 0, ys = 0, dxs = 0;  // row strides; 0: 2d, d and 2d
  std::int64_t offset = 0;               // elements added to every base pointer (misalignment)
  bool in_place = false;                 // dx = x
  std::int64_t x_stride() const { return xs ? xs : 2 * d; }
  std::int64_t dy_stride() const { return ys ? ys : d; }
  std::int64_t dx_stride() const { return in_place ? x_stride() : dxs ? dxs : 2 * d; }
  std::string describe() const {
    return std::string(dtype_name(dtype)) + " act " + std::to_string(int(act)) + " " + std::to_string(rows) + "x" +
           std::to_string(d) + " strides " + std::to_string(x_stride()) + "/" + std::to_string(dy_stride()) + "/" +
           std::to_string(dx_stride()) + " off " + std::to_string(offset) + (in_place ? " in place" : "");
  }
};

std::int64_t act_code(Activation a) {
  return a == Activation::silu ? families::k_am_silu : a == Activation::gelu ? families::k_am_gelu
                                                                             : families::k_am_gelu_tanh;
}

Problem problem_of(const Case& c) {
  return Problem::of(c.dtype, 16,
                     families::ActAndMulBwdProblem{.rows = c.rows,
                                                   .d = c.d,
                                                   .x_row_stride = c.x_stride(),
                                                   .dy_row_stride = c.dy_stride(),
                                                   .dx_row_stride = c.dx_stride(),
                                                   .activation = act_code(c.act)});
}

// Absolute allowance per element on top of the relative L2 bound, as the forward's test allows
// f16/bf16 (their cheaper Phi is flushed to 0 far below zero); f32 gets none.
double atol(DType t) { return t == DType::f32 ? 0.0 : 1e-5; }

template <class Launch>
void check_case(const Case& c, std::mt19937& rng, unsigned seed, Launch&& run) {
  SCOPED_TRACE(c.describe() + " seed " + std::to_string(seed));
  const auto es = dtype_size(c.dtype);
  const std::int64_t x_elems = c.offset + (c.rows - 1) * c.x_stride() + 2 * c.d;
  const std::int64_t dy_elems = c.offset + (c.rows - 1) * c.dy_stride() + c.d;
  const std::int64_t dx_elems = c.offset + (c.rows - 1) * c.dx_stride() + 2 * c.d;
  const auto hx = testing::random_bytes(c.dtype, x_elems, rng, 3.0f);
  const auto hy = testing::random_bytes(c.dtype, dy_elems, rng, 1.0f);
  DeviceBuffer bx(hx.size()), by(hy.size()), bdx(dx_elems * es);
  bx.upload(hx.data());
  by.upload(hy.data());
  bdx.poison();
  unsigned char* xp = static_cast<unsigned char*>(bx.get()) + c.offset * es;
  unsigned char* yp = static_cast<unsigned char*>(by.get()) + c.offset * es;
  unsigned char* dxp = c.in_place ? xp : static_cast<unsigned char*>(bdx.get()) + c.offset * es;
  Status s = run(xp, yp, dxp);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);

  std::vector<unsigned char> got(c.in_place ? hx.size() : dx_elems * es);
  (c.in_place ? bx : bdx).download(got.data());
  std::vector<unsigned char> want = c.in_place ? hx : std::vector<unsigned char>(got.size(), 0xFF);
  std::vector<unsigned char> x_copy = hx;  // the reference reads x before writing dx over it
  const Problem p = problem_of(c);
  void* bufs[3] = {(c.in_place ? want.data() : x_copy.data()) + c.offset * es,
                   const_cast<unsigned char*>(hy.data()) + c.offset * es, want.data() + c.offset * es};
  const Family& f = *Registry::global().find("act_and_mul_bwd");
  ASSERT_TRUE(f.cpu_reference(f.heuristic(p), p, bufs).ok());

  std::vector<std::int64_t> idx;
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t col = 0; col < 2 * c.d; ++col) idx.push_back(c.offset + r * c.dx_stride() + col);
  const testing::L2Norms n = testing::l2_norms(got.data(), want.data(), c.dtype, idx);
  EXPECT_LE(n.diff, testing::tolerance(c.dtype) * n.want + atol(c.dtype) * std::sqrt(double(idx.size())))
      << "L2 error " << n.diff << ", relative " << testing::rel_l2(got.data(), want.data(), c.dtype, idx);
  if (!c.in_place && c.rows > 1 && c.dx_stride() > 2 * c.d) {
    EXPECT_TRUE(std::isnan(load_as_double(got.data(), c.dtype, c.offset + 2 * c.d))) << "padding was written";
  }
}

Status run_op(const Case& c, void* x, void* dy, void* dx, Runtime* rt) {
  TensorView xv = TensorView::contiguous(x, c.dtype, {c.rows, 2 * c.d}, Device::cuda(0));
  xv.strides[0] = c.x_stride();
  TensorView yv = TensorView::contiguous(dy, c.dtype, {c.rows, c.d}, Device::cuda(0));
  yv.strides[0] = c.dy_stride();
  TensorView dv = TensorView::contiguous(dx, c.dtype, {c.rows, 2 * c.d}, Device::cuda(0));
  dv.strides[0] = c.dx_stride();
  return act_and_mul_backward(xv, yv, dv, c.act, nullptr, rt);
}

class ActAndMulBwdGpu : public testing::GpuFixture {
 protected:
  void check(const Case& c) {
    check_case(c, rng_, seed_, [&](void* x, void* dy, void* dx) { return run_op(c, x, dy, dx, rt_.get()); });
  }
};

constexpr Activation k_acts[] = {Activation::silu, Activation::gelu, Activation::gelu_tanh};

TEST_F(ActAndMulBwdGpu, MatchesReferenceForEveryActivationDtypeAndWidth) {
  for (Activation a : k_acts)
    for (DType t : {DType::f32, DType::f16, DType::bf16}) {
      for (std::int64_t d : {1, 7, 1000, 4096, 11008})
        for (std::int64_t rows : {1, 3, 37}) check({t, a, rows, d});
      check({t, a, 3000, 4096});
    }
  EXPECT_GT(rt_->counters().module_loads, 0);
}

TEST_F(ActAndMulBwdGpu, StridedMisalignedAndInPlace) {
  for (Activation a : k_acts)
    for (DType t : {DType::f32, DType::f16, DType::bf16}) {
      const std::vector<Case> cases = {
          {t, a, 9, 1024, 2056, 1032, 2064},        // padded rows, vectorizable
          {t, a, 5, 777, 1600, 800, 1560},          // odd d in aligned strides
          {t, a, 6, 512, 0, 0, 0, 1},               // base pointers off by one element
          {t, a, 11, 4096, 0, 0, 0, 0, true},       // in place
          {t, a, 4, 11008, 22032, 11016, 0, 8, true},  // in place, strided, offset
          {t, a, 4, 3000, 6001, 3003, 6003},        // odd strides: scalar path
      };
      for (const auto& c : cases) check(c);
    }
}

TEST_F(ActAndMulBwdGpu, EveryCatalogVariantMatches) {
  const Family& f = *Registry::global().find("act_and_mul_bwd");
  for (const Params& params : f.catalog()) {
    SCOPED_TRACE(params.canonical());
    const DType t = *parse_dtype(*params.get_str("dtype"));
    const std::string act = *params.get_str("act");
    const Activation a = act == "silu" ? Activation::silu : act == "gelu" ? Activation::gelu : Activation::gelu_tanh;
    auto k = rt_->kernel(KernelSpec{"act_and_mul_bwd", params});
    ASSERT_TRUE(k.ok()) << k.status().to_string();
    const Case c{t, a, 13, 8 * 173, 2 * 8 * 173 + 8, 8 * 173 + 16, 2 * 8 * 173 + 24};
    check_case(c, rng_, seed_, [&](void* x, void* dy, void* dx) {
      void* b[3] = {x, dy, dx};
      return rt_->launch(**k, problem_of(c), b, nullptr);
    });
  }
}

}  // namespace
}  // namespace kiln
