#include "families/rmsnorm/rmsnorm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "common/half.h"

namespace kiln::families {
namespace {

const Family& rmsnorm() { return *Registry::global().find("rmsnorm"); }

Problem problem(DType t, std::int64_t rows, std::int64_t cols, std::int64_t xs = 0, std::int64_t ys = 0,
                std::uint32_t align = 16) {
  Problem p;
  p.dtype = t;
  p.alignment = align;
  p.dims[k_rows] = rows;
  p.dims[k_cols] = cols;
  p.dims[k_x_stride] = xs ? xs : cols;
  p.dims[k_y_stride] = ys ? ys : cols;
  p.scalars[k_eps] = 1e-6;
  return p;
}

TEST(RmsNorm, ReferenceMatchesHandComputedRows) {
  // Row [3, 4]: mean(x^2) = 12.5, rsqrt = 0.28284271; w = [1, 2].
  // Row [1, 1]: mean 1, eps 0 -> y = w.
  std::vector<float> x = {3, 4, 1, 1}, w = {1, 2}, y(4, -1);
  Problem p = problem(DType::f32, 2, 2);
  p.scalars[k_eps] = 0;
  void* b[3] = {x.data(), w.data(), y.data()};
  ASSERT_TRUE(rmsnorm().cpu_reference(rmsnorm().heuristic(p), p, b).ok());
  EXPECT_NEAR(y[0], 3 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y[1], 8 / std::sqrt(12.5), 1e-6);
  EXPECT_FLOAT_EQ(y[2], 1);
  EXPECT_FLOAT_EQ(y[3], 2);
  std::vector<float> inv(2, -1);
  void* b4[4] = {x.data(), w.data(), y.data(), inv.data()};
  ASSERT_TRUE(rmsnorm().cpu_reference(rmsnorm().heuristic(p), p, b4).ok());
  EXPECT_NEAR(inv[0], 1 / std::sqrt(12.5), 1e-7);
  EXPECT_FLOAT_EQ(inv[1], 1);
}

TEST(RmsNorm, ReferenceHonoursStridesAndHalfTypes) {
  // Two rows of 3 in a stride of 4; the padding must be left alone.
  std::vector<std::uint16_t> x(8), w(3), y(8, 0xBEEF);
  const float xv[] = {1, 2, 2, 0, -2, 0, 0, 0};
  for (int i = 0; i < 8; ++i) x[i] = float_to_bf16(xv[i]);
  for (int i = 0; i < 3; ++i) w[i] = float_to_bf16(1.0f);
  Problem p = problem(DType::bf16, 2, 3, 4, 4);
  p.scalars[k_eps] = 0;
  void* b[3] = {x.data(), w.data(), y.data()};
  ASSERT_TRUE(rmsnorm().cpu_reference(rmsnorm().heuristic(p), p, b).ok());
  // Row 0: rms = sqrt(9/3) = sqrt(3). Row 1: [-2, 0, 0] -> rms = 2/sqrt(3).
  EXPECT_NEAR(bf16_to_float(y[0]), 1 / std::sqrt(3.0), 1e-2);
  EXPECT_NEAR(bf16_to_float(y[2]), 2 / std::sqrt(3.0), 1e-2);
  EXPECT_EQ(y[3], 0xBEEF);
  EXPECT_NEAR(bf16_to_float(y[4]), -std::sqrt(3.0), 1e-2);
  EXPECT_EQ(y[7], 0xBEEF);
}

TEST(RmsNorm, HeuristicFollowsTheMeasuredRule) {
  auto h = rmsnorm_heuristic(problem(DType::bf16, 4096, 4096));
  EXPECT_EQ(h.vec, 4);      // 8-byte accesses
  EXPECT_EQ(h.block, 128);  // 1024 packs, eight per thread
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 8192)).block, 256);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 16384)).block, 512);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 2048)).block, 64);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::f32, 4096, 4096)).vec, 2);
  // Rows of 64-128 KiB: 1024 threads, 4-byte packs, 32 per thread, 24 of them in shared memory.
  auto wide = rmsnorm_heuristic(problem(DType::bf16, 4096, 65536));
  EXPECT_EQ(wide.vec, 2);
  EXPECT_EQ(wide.block, 1024);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::f32, 4096, 32768)).block, 1024);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::f32, 4096, 32768)).vec, 1);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 32768)).block, 512);   // 64 KiB: 8-byte packs
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 131072)).block, 512);  // 256 KiB
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 65536, 65536, 65536, 4)).block, 512);  // 4-byte aligned
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 2048, 4095)).vec, 1);   // odd rows: row starts misalign
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::f16, 2048, 4094)).vec, 2);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 2048, 4096, 4096, 4096, 4)).vec, 2);  // 4-byte aligned buffers
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1, 3)).vec, 1);
  // Under 2048 rows: 4-byte accesses, 16 packs per thread.
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 512, 4096)).vec, 2);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 512, 4096)).block, 128);
  // Decode (up to 64 rows): 16-byte accesses, two packs per thread, up to 1024 threads.
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1, 4096)).block, 256);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1, 4096)).vec, 8);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::f32, 16, 4096)).block, 512);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 16, 16384)).vec, 8);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 16, 16384)).block, 1024);
  // Misaligned rows narrow the access and keep up to 1024 threads.
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1, 4095)).vec, 1);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1, 4095)).block, 1024);
  // Longer rows: 1024 threads, accesses widened only while each thread keeps eight.
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::f32, 1, 65536)).vec, 2);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::f32, 1, 65536)).block, 1024);
  // Whatever it picks must pass check_problem.
  for (auto cols : {1, 3, 7, 64, 1000, 4095, 4096, 5120, 65536}) {
    for (auto t : {DType::f32, DType::f16, DType::bf16}) {
      Problem p = problem(t, 3, cols);
      EXPECT_TRUE(rmsnorm().check_problem(rmsnorm().heuristic(p), p).ok()) << cols;
    }
  }
}

TEST(RmsNorm, SharedMemoryHoldsLongRowsUpToItsCapOrTheWeight) {
  auto params = [](std::int64_t block, std::int64_t vec) {
    return Params{{"dtype", std::string("bf16")}, {"block", block}, {"vec", vec}};
  };
  // 1024 threads x 8 registers = 4 packs of 8 bytes each: 4096 packs in registers (the weight
  // too: no shared memory).
  EXPECT_EQ(rmsnorm_smem_packs(params(1024, 4), problem(DType::bf16, 1, 4096 * 4)), 0);
  // 512 threads x 16 registers = 8 packs of 8 bytes each: the row fits, the weight is staged.
  EXPECT_EQ(rmsnorm_smem_packs(params(512, 4), problem(DType::bf16, 1, 4096 * 4)), 4096);
  // Packs of 4 bytes are not staged.
  EXPECT_EQ(rmsnorm_smem_packs(params(512, 2), problem(DType::bf16, 1, 4096 * 2)), 0);
  // 512 threads x 16 registers = 8 packs of 8 bytes each, the next 100 packs in shared memory.
  EXPECT_EQ(rmsnorm_smem_packs(params(512, 4), problem(DType::bf16, 1, (4096 + 100) * 4)), 100);
  // 64K bf16 = 16384 packs: 12288 (96 KiB) in shared memory, the whole row read once.
  Problem wide = problem(DType::bf16, 1, 65536);
  EXPECT_EQ(rmsnorm_smem_packs(params(1024, 4), wide), 12288);
  EXPECT_EQ(rmsnorm().geometry(params(1024, 4), wide).shared_bytes, 96u * 1024);
  // f32 rows of 64K: the cap leaves the rest to be read twice.
  Params f32{{"dtype", std::string("f32")}, {"block", std::int64_t(1024)}, {"vec", std::int64_t(4)}};
  EXPECT_EQ(rmsnorm_smem_packs(f32, problem(DType::f32, 1, 65536)), 96 * 1024 / 16);
  // 8 packs each: the row fits, the weight (8 KiB) is staged.
  EXPECT_EQ(rmsnorm().geometry(params(128, 4), problem(DType::bf16, 1, 4096)).shared_bytes, 4096u * 2);
  EXPECT_EQ(rmsnorm().geometry(params(64, 4), problem(DType::bf16, 1, 4096)).shared_bytes, 512u * 8);
}

TEST(RmsNorm, GridIsCappedOnlyForRowsThatPipeline) {
  Params small{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}};
  Problem p = problem(DType::bf16, 4096, 4096);
  EXPECT_EQ(rmsnorm_grid(small, p), 4096);  // no SM count: one block per row
  p.dims[k_sms] = 132;
  // 512 packs of 16 bytes: 2 per thread, half of the 4-pack cache: 4 blocks of 256 per SM.
  EXPECT_EQ(rmsnorm_grid(small, p), 132 * 4);
  EXPECT_EQ(rmsnorm().geometry(small, p).grid.x, 132u * 4);
  p.dims[k_rows] = 100;
  EXPECT_EQ(rmsnorm_grid(small, p), 100);  // never more blocks than rows
  Problem wide = problem(DType::bf16, 4096, 16384);
  wide.dims[k_sms] = 132;
  EXPECT_EQ(rmsnorm_grid(small, wide), 4096);  // 8 packs per thread: no room to prefetch a row
  p.dims[k_sms] = -1;
  EXPECT_EQ(rmsnorm().check_problem(small, p).code(), Code::invalid_argument);
}

TEST(RmsNorm, CheckProblemRejectsMismatches) {
  Params bf16_vec8{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}};
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, problem(DType::f16, 2, 64)).code(), Code::unsupported_dtype);
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, problem(DType::bf16, 2, 60)).code(), Code::invalid_argument);
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, problem(DType::bf16, 2, 64, 64, 64, 8)).code(), Code::invalid_argument);
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, problem(DType::bf16, 2, 64, 32)).code(), Code::shape_mismatch);
  Problem neg = problem(DType::bf16, 2, 64);
  neg.scalars[k_eps] = -1;
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, neg).code(), Code::invalid_argument);
  neg.scalars[k_eps] = NAN;
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, neg).code(), Code::invalid_argument);
  EXPECT_TRUE(rmsnorm().check_problem(bf16_vec8, problem(DType::bf16, 2, 64)).ok());
}

TEST(RmsNorm, CatalogIsValidAndRendersDistinctNames) {
  auto cat = rmsnorm().catalog();
  EXPECT_EQ(cat.size(), 55u);  // 5 blocks x (3 f32 + 4 f16 + 4 bf16 vector widths)
  std::set<std::string> names;
  for (const auto& p : cat) {
    ASSERT_TRUE(rmsnorm().validate(p).ok()) << p.canonical();
    auto r = rmsnorm().render(p);
    ASSERT_TRUE(r.ok());
    names.insert(r->name_expression);
  }
  EXPECT_EQ(names.size(), cat.size());
}

TEST(RmsNorm, ArgsPackInKernelOrder) {
  Problem p = problem(DType::bf16, 7, 64, 128, 64);
  ArgPack args;
  int a, b, c;
  void* bufs[3] = {&a, &b, &c};
  rmsnorm().pack_args(rmsnorm().heuristic(p), p, bufs, args);
  ASSERT_EQ(args.count(), 9u);  // the kernel reads its shared-memory cache size off the launch
  EXPECT_EQ(*static_cast<void**>(args.pointers()[0]), &a);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[3]), nullptr);  // no inv_rms buffer given
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[4]), 7);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[6]), 128);
  EXPECT_FLOAT_EQ(*static_cast<float*>(args.pointers()[8]), 1e-6f);
  auto bs = rmsnorm().buffers(rmsnorm().heuristic(p), p);
  ASSERT_EQ(bs.size(), 4u);
  EXPECT_EQ(bs[3].dtype, DType::f32);
  EXPECT_EQ(bs[3].elements, 7);
  EXPECT_EQ(bs[0].elements, 6 * 128 + 64);
  EXPECT_EQ(bs[2].role, BufferRole::output);
}

}  // namespace
}  // namespace kiln::families
