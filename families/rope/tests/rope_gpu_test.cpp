// apply_rope_qk on the GPU against the CPU reference: fresh random data each run, outputs poisoned
// before each launch, every dtype, head_dim and layout, GQA head counts, in place and out of place,
// strided (fused qkv) views, misaligned views, out-of-range positions, every catalog variant.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "families/rope/rope.h"
#include "kiln/ops.h"
#include "tests/gpu_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using testing::DeviceBuffer;

struct Case {
  DType dtype;
  std::int64_t tokens, qh, kvh, d;
  RopeLayout layout;
  bool in_place = false;
  std::int64_t q_stride = 0, k_stride = 0;          // 0: contiguous
  std::int64_t q_out_stride = 0, k_out_stride = 0;  // 0: contiguous (ignored in place)
  std::int64_t offset = 0;                          // elements added to the q, k and output bases
  std::int64_t max_pos = 64;
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " t" + std::to_string(c.tokens) + " q" + std::to_string(c.qh) + " kv" +
         std::to_string(c.kvh) + " d" + std::to_string(c.d) + (c.layout == RopeLayout::neox ? " neox" : " gptj") +
         (c.in_place ? " in-place" : "") + " strides " + std::to_string(c.q_stride) + "/" + std::to_string(c.k_stride) +
         " off " + std::to_string(c.offset);
}

// The family's problem for a case whose strides are filled in (16-byte aligned).
Problem rope_problem(const Case& c) {
  return Problem::of(c.dtype, 16,
                     families::RopeProblem{.tokens = c.tokens,
                                           .q_heads = c.qh,
                                           .kv_heads = c.kvh,
                                           .head_dim = c.d,
                                           .layout = c.layout == RopeLayout::neox ? families::k_rope_neox
                                                                                  : families::k_rope_gptj,
                                           .max_pos = c.max_pos,
                                           .q_stride = c.q_stride,
                                           .k_stride = c.k_stride,
                                           .q_out_stride = c.q_out_stride,
                                           .k_out_stride = c.k_out_stride});
}

std::int64_t extent(std::int64_t tokens, std::int64_t stride, std::int64_t row) {
  return tokens == 0 ? 0 : (tokens - 1) * stride + row;
}

// The launcher gets device pointers {q, k, cos, sin, pos, q_out, k_out} and the case's strides.
template <class Launch>
double check_case(Case c, std::mt19937& rng, Launch&& launch, std::vector<std::int64_t> positions = {}) {
  const auto es = std::int64_t(dtype_size(c.dtype));
  if (!c.q_stride) c.q_stride = c.qh * c.d;
  if (!c.k_stride) c.k_stride = c.kvh * c.d;
  if (c.in_place) c.q_out_stride = c.q_stride, c.k_out_stride = c.k_stride;
  if (!c.q_out_stride) c.q_out_stride = c.qh * c.d;
  if (!c.k_out_stride) c.k_out_stride = c.kvh * c.d;
  const std::int64_t qn = c.offset + extent(c.tokens, c.q_stride, c.qh * c.d);
  const std::int64_t kn = c.offset + extent(c.tokens, c.k_stride, c.kvh * c.d);
  const std::int64_t qon = c.offset + extent(c.tokens, c.q_out_stride, c.qh * c.d);
  const std::int64_t kon = c.offset + extent(c.tokens, c.k_out_stride, c.kvh * c.d);
  auto hq = testing::random_bytes(c.dtype, qn, rng, 2.0f);
  auto hk = testing::random_bytes(c.dtype, kn, rng, 2.0f);
  const std::int64_t half = c.d / 2;
  std::vector<float> hcos(c.max_pos * half), hsin(c.max_pos * half);
  std::uniform_real_distribution<double> angle(-std::numbers::pi, std::numbers::pi);
  for (std::size_t i = 0; i < hcos.size(); ++i) {
    const double a = angle(rng);
    hcos[i] = float(std::cos(a));
    hsin[i] = float(std::sin(a));
  }
  std::vector<std::int64_t> hpos = positions;
  if (hpos.empty()) {
    std::uniform_int_distribution<std::int64_t> pick(0, c.max_pos - 1);
    for (std::int64_t t = 0; t < c.tokens; ++t) hpos.push_back(pick(rng));
  }

  DeviceBuffer dq(hq.size()), dk(hk.size()), dcos(hcos.size() * 4), dsin(hsin.size() * 4), dpos(hpos.size() * 8);
  DeviceBuffer dqo(c.in_place ? 1 : qon * es), dko(c.in_place ? 1 : kon * es);
  dq.upload(hq.data());
  dk.upload(hk.data());
  dcos.upload(hcos.data());
  dsin.upload(hsin.data());
  dpos.upload(hpos.data());
  dqo.poison();
  dko.poison();
  auto at = [&](const DeviceBuffer& b) { return static_cast<unsigned char*>(b.get()) + c.offset * es; };
  void* ptrs[7] = {at(dq), at(dk), dcos.get(), dsin.get(), dpos.get(), c.in_place ? at(dq) : at(dqo),
                   c.in_place ? at(dk) : at(dko)};
  Status s = launch(c, ptrs);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);

  std::vector<unsigned char> gq(c.in_place ? hq.size() : qon * es), gk(c.in_place ? hk.size() : kon * es);
  (c.in_place ? dq : dqo).download(gq.data());
  (c.in_place ? dk : dko).download(gk.data());

  // The reference on host copies with the same strides (in place: the outputs are the inputs).
  std::vector<unsigned char> wq = c.in_place ? hq : std::vector<unsigned char>(gq.size(), 0xFF);
  std::vector<unsigned char> wk = c.in_place ? hk : std::vector<unsigned char>(gk.size(), 0xFF);
  const Problem p = rope_problem(c);
  void* ref[7] = {(c.in_place ? wq.data() : hq.data()) + c.offset * es,
                  (c.in_place ? wk.data() : hk.data()) + c.offset * es,
                  hcos.data(),
                  hsin.data(),
                  hpos.data(),
                  wq.data() + c.offset * es,
                  wk.data() + c.offset * es};
  const Family& f = *Registry::global().find("rope");
  EXPECT_TRUE(f.cpu_reference(f.heuristic(p), p, ref).ok());

  double num = 0, den = 0;
  bool nan = false;
  auto accumulate = [&](const std::vector<unsigned char>& got, const std::vector<unsigned char>& want,
                        std::int64_t stride, std::int64_t row) {
    std::vector<std::int64_t> idx;
    for (std::int64_t t = 0; t < c.tokens; ++t)
      for (std::int64_t j = 0; j < row; ++j) idx.push_back(c.offset + t * stride + j);
    for (auto i : idx) {
      const double g = load_as_double(got.data(), c.dtype, i), w = load_as_double(want.data(), c.dtype, i);
      if (std::isnan(w)) {  // out-of-range position: the kernel must write NaN too
        nan |= !std::isnan(g);
        continue;
      }
      nan |= std::isnan(g);
      num += (g - w) * (g - w);
      den += w * w;
    }
    // Out of place, the bytes between strided token rows must stay poisoned.
    if (!c.in_place && stride > row && c.tokens > 1) {
      EXPECT_TRUE(std::isnan(load_as_double(got.data(), c.dtype, c.offset + row)))
          << "padding written: " << describe(c);
    }
  };
  accumulate(gq, wq, c.q_out_stride, c.qh * c.d);
  accumulate(gk, wk, c.k_out_stride, c.kvh * c.d);
  if (nan) return NAN;
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

Status run_op(const Case& c, void* const* b, Runtime* rt, Stream stream = nullptr) {
  const Device dev = Device::cuda(0);
  auto view = [&](void* data, std::int64_t heads, std::int64_t stride) {
    TensorView v = TensorView::contiguous(data, c.dtype, {c.tokens, heads, c.d}, dev);
    v.strides[0] = stride;
    return v;
  };
  const TensorView q = view(b[0], c.qh, c.q_stride), k = view(b[1], c.kvh, c.k_stride);
  const TensorView qo = view(b[5], c.qh, c.q_out_stride), ko = view(b[6], c.kvh, c.k_out_stride);
  const TensorView cos = TensorView::contiguous(b[2], DType::f32, {c.max_pos, c.d / 2}, dev);
  const TensorView sin = TensorView::contiguous(b[3], DType::f32, {c.max_pos, c.d / 2}, dev);
  const TensorView pos = TensorView::contiguous(b[4], DType::i64, {c.tokens}, dev);
  return apply_rope_qk(q, k, cos, sin, pos, qo, ko, c.layout, stream, rt);
}

class RopeGpu : public testing::GpuFixture {
 protected:
  double run(const Case& c, std::vector<std::int64_t> positions = {}) {
    return check_case(c, rng_, [&](const Case& cc, void* const* b) { return run_op(cc, b, rt_.get()); },
                      std::move(positions));
  }
};

TEST_F(RopeGpu, EveryDtypeHeadDimLayoutAndGqaShapeInAndOutOfPlace) {
  const std::int64_t heads[][2] = {{32, 8}, {4, 1}, {3, 3}, {2, 1}};
  int n = 0;
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (std::int64_t d : {64, 80, 96, 128, 256})
      for (RopeLayout layout : {RopeLayout::neox, RopeLayout::gptj})
        for (bool in_place : {false, true}) {
          const auto* h = heads[n++ % 4];
          for (std::int64_t tokens : {1, 37}) {
            Case c{t, tokens, h[0], h[1], d, layout, in_place};
            EXPECT_LT(run(c), testing::tolerance(t)) << describe(c) << " seed " << seed_;
          }
        }
  EXPECT_EQ(rt_->resolver(), "embedded");
}

TEST_F(RopeGpu, ManyTokensUseTheWideBlocks) {
  for (DType t : {DType::bf16, DType::f32}) {
    Case c{t, 4096, 32, 8, 128, RopeLayout::neox};
    c.max_pos = 8192;
    EXPECT_LT(run(c), testing::tolerance(t)) << describe(c) << " seed " << seed_;
    c.layout = RopeLayout::gptj;
    EXPECT_LT(run(c), testing::tolerance(t)) << describe(c) << " seed " << seed_;
  }
}

TEST_F(RopeGpu, StridedFusedQkvViewsAndMisalignedBases) {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    for (RopeLayout layout : {RopeLayout::neox, RopeLayout::gptj}) {
      // q and k rows inside wider rows (as views of a fused qkv tensor), in place and into
      // contiguous outputs, and into strided outputs.
      Case strided{t, 29, 8, 2, 128, layout, true, 12 * 128, 12 * 128};
      EXPECT_LT(run(strided), testing::tolerance(t)) << describe(strided) << " seed " << seed_;
      strided.in_place = false;
      EXPECT_LT(run(strided), testing::tolerance(t)) << describe(strided) << " seed " << seed_;
      strided.q_out_stride = 9 * 128, strided.k_out_stride = 3 * 128;
      EXPECT_LT(run(strided), testing::tolerance(t)) << describe(strided) << " seed " << seed_;
      // Bases one element off 16 bytes: narrower accesses.
      Case shifted{t, 13, 4, 2, 80, layout, false, 0, 0, 0, 0, 1};
      EXPECT_LT(run(shifted), testing::tolerance(t)) << describe(shifted) << " seed " << seed_;
      shifted.in_place = true;
      EXPECT_LT(run(shifted), testing::tolerance(t)) << describe(shifted) << " seed " << seed_;
      // Odd token strides (in elements): every access one element wide.
      Case odd{t, 9, 2, 1, 64, layout, false, 2 * 64 + 1, 64 + 3};
      EXPECT_LT(run(odd), testing::tolerance(t)) << describe(odd) << " seed " << seed_;
    }
  }
}

TEST_F(RopeGpu, FusedQkvInPlaceLeavesVAlone) {
  // One [tokens, 8 + 2 + 2 heads, 128] bf16 buffer: q and k rotated in place, v untouched.
  const std::int64_t tokens = 17, qh = 8, kvh = 2, d = 128, row = (qh + 2 * kvh) * d;
  auto host = testing::random_bytes(DType::bf16, tokens * row, rng_);
  DeviceBuffer qkv(host.size());
  qkv.upload(host.data());
  std::vector<float> cos(32 * 64), sin(32 * 64);
  for (std::size_t i = 0; i < cos.size(); ++i) cos[i] = std::cos(0.01 * double(i)), sin[i] = std::sin(0.01 * double(i));
  std::vector<std::int64_t> pos(tokens);
  for (std::int64_t t = 0; t < tokens; ++t) pos[t] = (t * 7) % 32;
  DeviceBuffer dc(cos.size() * 4), ds(sin.size() * 4), dp(pos.size() * 8);
  dc.upload(cos.data());
  ds.upload(sin.data());
  dp.upload(pos.data());
  auto* base = static_cast<std::uint16_t*>(qkv.get());
  TensorView q = TensorView::contiguous(base, DType::bf16, {tokens, qh, d}, Device::cuda(0));
  TensorView k = TensorView::contiguous(base + qh * d, DType::bf16, {tokens, kvh, d}, Device::cuda(0));
  q.strides[0] = k.strides[0] = row;
  ASSERT_TRUE(apply_rope_qk(q, k, TensorView::contiguous(dc.get(), DType::f32, {32, 64}, Device::cuda(0)),
                            TensorView::contiguous(ds.get(), DType::f32, {32, 64}, Device::cuda(0)),
                            TensorView::contiguous(dp.get(), DType::i64, {tokens}, Device::cuda(0)), q, k,
                            RopeLayout::neox, nullptr, rt_.get())
                  .ok());
  std::vector<unsigned char> got(host.size());
  qkv.download(got.data());
  std::vector<unsigned char> want = host;
  const Problem p = Problem::of(DType::bf16, 16,
                                families::RopeProblem{.tokens = tokens,
                                                      .q_heads = qh,
                                                      .kv_heads = kvh,
                                                      .head_dim = d,
                                                      .layout = families::k_rope_neox,
                                                      .max_pos = 32,
                                                      .q_stride = row,
                                                      .k_stride = row,
                                                      .q_out_stride = row,
                                                      .k_out_stride = row});
  auto* w = reinterpret_cast<std::uint16_t*>(want.data());
  void* ref[7] = {w, w + qh * d, cos.data(), sin.data(), pos.data(), w, w + qh * d};
  const Family& f = *Registry::global().find("rope");
  ASSERT_TRUE(f.cpu_reference(f.heuristic(p), p, ref).ok());
  std::vector<std::int64_t> qk_idx, v_idx;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t j = 0; j < row; ++j) (j < (qh + kvh) * d ? qk_idx : v_idx).push_back(t * row + j);
  EXPECT_LT(testing::rel_l2(got.data(), want.data(), DType::bf16, qk_idx), 1e-2) << "seed " << seed_;
  for (auto i : v_idx) ASSERT_EQ(got[2 * i] | got[2 * i + 1] << 8, host[2 * i] | host[2 * i + 1] << 8) << "v changed";
}

TEST_F(RopeGpu, OutOfRangePositionsGiveNanRows) {
  Case c{DType::bf16, 5, 4, 2, 64, RopeLayout::neox};
  c.max_pos = 16;
  // check_case expects NaN exactly where the reference has NaN (tokens 1 and 3).
  EXPECT_LT(run(c, {3, 16, 0, -2, 15}), testing::tolerance(DType::bf16)) << "seed " << seed_;
}

TEST_F(RopeGpu, EveryCatalogVariantMatchesOnItsOwnStream) {
  const Family& f = *Registry::global().find("rope");
  const jit::Driver* d = jit::Driver::get().value();
  CUstream stream = nullptr;
  ASSERT_EQ(d->stream_create(&stream, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  for (const Params& params : f.catalog()) {
    const DType t = *parse_dtype(*params.get_str("dtype"));
    const auto hd = *params.get_int("head_dim");
    const RopeLayout layout = *params.get_str("layout") == "neox" ? RopeLayout::neox : RopeLayout::gptj;
    auto k = rt_->kernel(KernelSpec{"rope", params});
    ASSERT_TRUE(k.ok()) << k.status().to_string();
    Case c{t, 300, 5, 3, hd, layout};  // more items than one block of either size
    const double err = check_case(c, rng_, [&](const Case& cc, void* const* b) {
      const Problem p = rope_problem(cc);
      Status s = rt_->launch(**k, p, std::span<void* const>(b, 7), stream);
      if (s.ok()) {
        EXPECT_EQ(d->stream_synchronize(stream), CUDA_SUCCESS);
      }
      return s;
    });
    EXPECT_LT(err, testing::tolerance(t)) << params.canonical() << " seed " << seed_;
  }
  d->stream_destroy(stream);
}

}  // namespace
}  // namespace kiln
