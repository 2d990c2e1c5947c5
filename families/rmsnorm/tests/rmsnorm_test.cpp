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
  return Problem::of(t, align,
                     RmsNormProblem{.rows = rows, .cols = cols, .x_row_stride = xs ? xs : cols,
                                    .y_row_stride = ys ? ys : cols, .eps = 1e-6});
}

// p with eps replaced.
Problem with_eps(Problem p, double eps) {
  auto q = p.as<RmsNormProblem>();
  q.eps = eps;
  p.set(q);
  return p;
}

// p with rows replaced.
Problem with_rows(Problem p, std::int64_t rows) {
  auto q = p.as<RmsNormProblem>();
  q.rows = rows;
  p.set(q);
  return p;
}

// p on a device of compute capability cc (0: unknown).
Problem on_cc(Problem p, int cc) {
  p.cc = std::uint8_t(cc);
  return p;
}

TEST(RmsNorm, ReferenceMatchesHandComputedRows) {
  // Row [3, 4]: mean(x^2) = 12.5, rsqrt = 0.28284271; w = [1, 2].
  // Row [1, 1]: mean 1, eps 0 -> y = w.
  std::vector<float> x = {3, 4, 1, 1}, w = {1, 2}, y(4, -1);
  Problem p = with_eps(problem(DType::f32, 2, 2), 0);
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
  Problem p = with_eps(problem(DType::bf16, 2, 3, 4, 4), 0);
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
  // Under 16384 rows, rows of 10-32 KiB in 16-bit types: 16-byte accesses, four per thread.
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 5120)).vec, 8);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 5120)).block, 256);  // 640 packs
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 8192)).block, 256);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 8192)).vec, 8);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::f16, 4096, 16384)).vec, 8);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 16384)).block, 512);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 32768, 8192)).vec, 4);  // many rows: 8-byte packs
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 32768, 8192)).block, 256);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 20480)).vec, 4);   // 40 KiB rows
  // Alignment narrows the access, and the block still gives each thread eight 8-byte packs.
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 8192, 8192, 8192, 8)).vec, 4);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 4096, 8192, 8192, 8192, 8)).block, 256);
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
  // Other rows under 2048: 4-byte accesses, 16 packs per thread.
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1100, 4096)).vec, 2);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1100, 4096)).block, 128);
  // Up to 1024 rows of whole 16-byte packs: the one-row kernel, two packs per thread, the smallest
  // block from 64 threads that holds the row.
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1, 4096)).block, 256);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1, 4096)).vec, 8);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1, 4096)).row, 2);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 16, 896)).block, 64);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::f32, 16, 4096)).block, 512);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::f32, 16, 4096)).row, 2);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 16, 16384)).vec, 8);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 16, 16384)).block, 1024);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 512, 4096)).row, 2);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1024, 16384)).row, 2);
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1025, 4096)).row, 0);  // past 1024 rows
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1, 4100)).row, 0);     // not whole 16-byte packs
  EXPECT_EQ(rmsnorm_heuristic(problem(DType::bf16, 1, 32768)).row, 0);    // over 2048 packs
  // The one-row kernel's grid is the row count; it needs no shared memory.
  {
    const Problem p = problem(DType::bf16, 16, 4096);
    const Params h = rmsnorm().heuristic(p);
    EXPECT_EQ(rmsnorm().geometry(h, p).grid.x, 16u);
    EXPECT_EQ(rmsnorm().geometry(h, p).block.x, 256u);
    EXPECT_EQ(rmsnorm().geometry(h, p).shared_bytes, 0u);
    // A row longer than block * row packs, or not of whole packs, is refused before any launch.
    EXPECT_FALSE(rmsnorm().check_problem(h, problem(DType::bf16, 16, 4104)).ok());
    EXPECT_FALSE(rmsnorm().check_problem(h, problem(DType::bf16, 16, 4100)).ok());
    Params bad = h;
    bad.set("bulk", 2);
    EXPECT_FALSE(rmsnorm().validate(bad).ok());
  }
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
    return Params{{"dtype", std::string("bf16")}, {"block", block}, {"vec", vec}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}};
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
  Params f32{{"dtype", std::string("f32")}, {"block", std::int64_t(1024)}, {"vec", std::int64_t(4)}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}};
  EXPECT_EQ(rmsnorm_smem_packs(f32, problem(DType::f32, 1, 65536)), 96 * 1024 / 16);
  // 8 packs each: the row fits, the weight (8 KiB) is staged.
  EXPECT_EQ(rmsnorm().geometry(params(128, 4), problem(DType::bf16, 1, 4096)).shared_bytes, 4096u * 2);
  EXPECT_EQ(rmsnorm().geometry(params(64, 4), problem(DType::bf16, 1, 4096)).shared_bytes, 512u * 8);
}

TEST(RmsNorm, GridIsCappedOnlyForRowsThatPipeline) {
  Params small{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)},
               {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}};
  Problem p = problem(DType::bf16, 4096, 4096);
  EXPECT_EQ(rmsnorm_grid(small, p), 4096);  // no SM count: one block per row
  p.sm_count = 132;
  // 512 packs of 16 bytes: 2 per thread, half of the 4-pack cache: 4 blocks of 256 per SM.
  EXPECT_EQ(rmsnorm_grid(small, p), 132 * 4);
  EXPECT_EQ(rmsnorm().geometry(small, p).grid.x, 132u * 4);
  EXPECT_EQ(rmsnorm_grid(small, with_rows(p, 100)), 100);  // never more blocks than rows
  Problem wide = problem(DType::bf16, 4096, 16384);
  wide.sm_count = 132;
  EXPECT_EQ(rmsnorm_grid(small, wide), 4096);  // 8 packs per thread: no room to prefetch a row
}

TEST(RmsNorm, CheckProblemRejectsMismatches) {
  Params bf16_vec8{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)},
                  {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}};
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, problem(DType::f16, 2, 64)).code(), Code::unsupported_dtype);
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, problem(DType::bf16, 2, 60)).code(), Code::invalid_argument);
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, problem(DType::bf16, 2, 64, 64, 64, 8)).code(), Code::invalid_argument);
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, problem(DType::bf16, 2, 64, 32)).code(), Code::shape_mismatch);
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, with_eps(problem(DType::bf16, 2, 64), -1)).code(),
            Code::invalid_argument);
  EXPECT_EQ(rmsnorm().check_problem(bf16_vec8, with_eps(problem(DType::bf16, 2, 64), NAN)).code(),
            Code::invalid_argument);
  EXPECT_TRUE(rmsnorm().check_problem(bf16_vec8, problem(DType::bf16, 2, 64)).ok());
}

Params bulk_params(DType t, std::int64_t block, std::int64_t bulk) {
  return Params{{"dtype", std::string(dtype_name(t))},
                {"block", block},
                {"vec", std::int64_t(16 / dtype_size(t))},
                {"bulk", bulk}, {"row", std::int64_t(0)}};
}

TEST(RmsNorm, BulkCopyKernelForWideRowsOnSm90) {
  Problem p = on_cc(problem(DType::bf16, 4096, 65536), 90);
  p.sm_count = 132;
  const auto c = rmsnorm_heuristic(p);
  EXPECT_EQ(c.block, 1024);
  EXPECT_EQ(c.vec, 8);
  EXPECT_EQ(c.bulk, 8);  // 8192 packs of 16 bytes over 1024 threads
  const Params h = rmsnorm().heuristic(p);
  ASSERT_TRUE(rmsnorm().check_problem(h, p).ok());
  EXPECT_NE(rmsnorm().render(h)->name_expression.find("rmsnorm_fwd_bulk<kiln::bf16_t, 1024, 8>"), std::string::npos);
  // Persistent blocks, one per SM at 128 KiB each; the whole row buffer in shared memory.
  const auto g = rmsnorm().geometry(h, p);
  EXPECT_EQ(g.grid.x, 132u);
  EXPECT_EQ(g.block.x, 1024u);
  EXPECT_EQ(g.shared_bytes, 128u * 1024);
  // 96 KiB rows: 1024 threads, 6 packs each; 64 KiB: 512 threads, 8 each; 80 KiB: 1024 x 6 (the
  // checked body); f32 rows of 128 KiB: 1024 x 8.
  Problem p96 = on_cc(problem(DType::f16, 4096, 49152), 90);
  EXPECT_EQ(rmsnorm_heuristic(p96).bulk, 6);
  EXPECT_EQ(rmsnorm_heuristic(p96).block, 1024);
  Problem p64 = on_cc(problem(DType::bf16, 4096, 32768), 90);
  EXPECT_EQ(rmsnorm_heuristic(p64).bulk, 8);
  EXPECT_EQ(rmsnorm_heuristic(p64).block, 512);
  Problem p80 = on_cc(problem(DType::bf16, 4096, 40960), 90);
  EXPECT_EQ(rmsnorm_heuristic(p80).bulk, 6);
  EXPECT_EQ(rmsnorm_heuristic(p80).block, 1024);
  Problem f32 = on_cc(problem(DType::f32, 4096, 32768), 90);
  EXPECT_EQ(rmsnorm_heuristic(f32).bulk, 8);
  // Not on sm_80 or an unknown device, nor under 2048 rows, nor for rows under 64 KiB or over
  // 128, nor misaligned: the register kernel.
  for (int cc : {0, 80}) {
    Problem q = on_cc(p, cc);
    EXPECT_EQ(rmsnorm_heuristic(q).bulk, 0) << cc;
  }
  EXPECT_EQ(rmsnorm_heuristic(with_rows(p, 512)).bulk, 0);
  for (std::int64_t cols : {32760, 65544, 131072}) {
    Problem q = on_cc(problem(DType::bf16, 4096, cols), 90);
    EXPECT_EQ(rmsnorm_heuristic(q).bulk, 0) << cols;
  }
  Problem odd_stride = on_cc(problem(DType::bf16, 4096, 65536, 65540, 65536), 90);
  EXPECT_EQ(rmsnorm_heuristic(odd_stride).bulk, 0);
  Problem misaligned = on_cc(problem(DType::bf16, 4096, 65536, 0, 0, 8), 90);
  EXPECT_EQ(rmsnorm_heuristic(misaligned).bulk, 0);
  // Whatever it picks passes check_problem, on every device kind.
  for (int cc : {0, 80, 90})
    for (auto t : {DType::f32, DType::f16, DType::bf16})
      for (std::int64_t cols : {16384, 32768, 40000, 49152, 65536}) {
        Problem q = on_cc(problem(t, 4096, cols), cc);
        EXPECT_TRUE(rmsnorm().check_problem(rmsnorm().heuristic(q), q).ok()) << cc << " " << cols;
      }
}

TEST(RmsNorm, BulkCopyKernelRejectsWhatItCannotRun) {
  Problem p = on_cc(problem(DType::bf16, 4096, 65536), 90);
  EXPECT_TRUE(rmsnorm().check_problem(bulk_params(DType::bf16, 1024, 8), p).ok());
  // Too few packs for the row.
  EXPECT_EQ(rmsnorm().check_problem(bulk_params(DType::bf16, 1024, 6), p).code(), Code::invalid_argument);
  // sm_80, or unknown.
  for (int cc : {0, 80}) {
    Problem q = on_cc(p, cc);
    EXPECT_EQ(rmsnorm().check_problem(bulk_params(DType::bf16, 1024, 8), q).code(), Code::invalid_argument);
  }
  // Rows or strides not whole 16-byte packs, buffers aligned to less.
  Problem odd = on_cc(problem(DType::bf16, 4096, 65532), 90);
  EXPECT_EQ(rmsnorm().check_problem(bulk_params(DType::bf16, 1024, 8), odd).code(), Code::invalid_argument);
  Problem stride = on_cc(problem(DType::bf16, 4096, 65536, 65540, 65536), 90);
  EXPECT_EQ(rmsnorm().check_problem(bulk_params(DType::bf16, 1024, 8), stride).code(), Code::invalid_argument);
  Problem align = on_cc(problem(DType::bf16, 4096, 65536, 0, 0, 8), 90);
  EXPECT_EQ(rmsnorm().check_problem(bulk_params(DType::bf16, 1024, 8), align).code(), Code::invalid_argument);
  // validate: 16-byte packs and blocks of at least 256 threads.
  Params narrow = bulk_params(DType::bf16, 1024, 8);
  narrow.set("vec", std::int64_t(4));
  EXPECT_EQ(rmsnorm().validate(narrow).code(), Code::invalid_argument);
  EXPECT_EQ(rmsnorm().validate(bulk_params(DType::bf16, 128, 8)).code(), Code::invalid_argument);
  EXPECT_EQ(rmsnorm().validate(bulk_params(DType::bf16, 1024, 3)).code(), Code::invalid_argument);
  // The tuning space holds the bulk kernels that fit the row on sm_90, none elsewhere.
  auto count_bulk = [](const std::vector<Params>& v) {
    return std::count_if(v.begin(), v.end(), [](const Params& q) { return *q.get_int("bulk") > 0; });
  };
  EXPECT_EQ(count_bulk(rmsnorm().tuning_space(p)), 1);  // 1024 x 8: 512 threads hold at most 4096 packs
  Problem sm80 = on_cc(p, 80);
  EXPECT_EQ(count_bulk(rmsnorm().tuning_space(sm80)), 0);
}

TEST(RmsNorm, ShapesDefaultToContiguousRowsAndSignaturesLeaveTheDeviceOut) {
  auto p = rmsnorm().problem_from_shape(DType::bf16, {{"rows", 3000}, {"cols", 4096}});
  ASSERT_TRUE(p.ok());
  const auto q = p->as<RmsNormProblem>();
  EXPECT_EQ(q.rows, 3000);
  EXPECT_EQ(q.x_row_stride, 4096);
  EXPECT_EQ(q.y_row_stride, 4096);
  EXPECT_EQ(q.eps, 1e-6);
  EXPECT_EQ(rmsnorm().signature(*p), "dtype=bf16,align=16,rows<=4096,cols=4096,x_row_stride=4096,y_row_stride=4096");
  Problem h100 = *p;
  h100.cc = 90;
  h100.sm_count = 132;
  EXPECT_EQ(rmsnorm().signature(h100), rmsnorm().signature(*p));
  EXPECT_EQ(rmsnorm().problem_from_shape(DType::bf16, {{"rows", 1}, {"cols", 64}, {"sms", 132}}).status().code(),
            Code::invalid_argument);
}

TEST(RmsNorm, CatalogIsValidAndRendersDistinctNames) {
  auto cat = rmsnorm().catalog();
  // 5 blocks x (3 f32 + 4 f16 + 4 bf16 vector widths), the one-row kernel's 5 blocks x 2 packs per
  // thread for each dtype, and the bulk-copy kernel's 512 x 8, 1024 x 6 and 1024 x 8 for each dtype.
  EXPECT_EQ(cat.size(), 94u);
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
