#include "families/rmsnorm/rmsnorm.h"
#include "families/common/family_util.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/half.h"

namespace kiln::families {
namespace {

Params params_of(DType t, const RmsNormChoice& c) {
  return Params{{"dtype", std::string(dtype_name(t))},
                {"block", c.block},
                {"vec", c.vec},
                {"bulk", c.bulk},
                {"row", c.row}};
}

// Whether the bulk-copy kernel can run the problem: sm_90 or later, 16-byte aligned buffers and
// row strides, whole 16-byte packs per row.
bool bulk_fits(const Problem& p) {
  const auto q = p.as<RmsNormProblem>();
  const std::int64_t esize = std::int64_t(dtype_size(p.dtype));
  return p.cc >= 90 && p.alignment >= 16 && (q.cols * esize) % 16 == 0 && (q.x_row_stride * esize) % 16 == 0 &&
         (q.y_row_stride * esize) % 16 == 0;
}

class RmsNorm final : public Family {
 public:
  std::string_view name() const override { return "rmsnorm"; }
  int version() const override { return 6; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", row_kernel_blocks(), {}, "threads per block: a power of two, or any multiple of 32 for the "
                                           "one-row kernel (row > 0)"},
        {"bulk", {0, 2, 4, 6, 8}, {}, "16-byte packs per thread of a row staged in shared memory by bulk copies "
                                     "(sm_90 and later, persistent blocks); 0: rows read into registers"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of x, w and y"},
        {"row", {0, 1, 2, 4}, {}, "packs per thread of the one-row kernel (one block per row, the row in "
                                  "registers, rows of at most block * row whole packs); 0: another kernel"},
        {"vec", {1, 2, 4, 8}, {}, "elements per memory access"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<RmsNormProblem>({
        bucketed(&RmsNormProblem::rows, "rows", "rows to normalize"),
        key(&RmsNormProblem::cols, "cols", "elements per row"),
        key(&RmsNormProblem::x_row_stride, "x_row_stride", "elements between two rows of x"),
        key(&RmsNormProblem::y_row_stride, "y_row_stride", "elements between two rows of y"),
        value(&RmsNormProblem::eps, "eps", "added to the mean square")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    KILN_TRY(check_access_width(name(), params));
    const auto bulk = params.get_int("bulk").value_or(0);
    if (bulk > 0 && params.get_int("row").value_or(0) > 0)
      return invalid_argument("rmsnorm: row > 0 (the one-row kernel) needs bulk = 0");
    if (const auto block = *params.get_int("block"); params.get_int("row").value_or(0) == 0 && (block & (block - 1)))
      return invalid_argument("rmsnorm: block must be a power of two but for the one-row kernel (row > 0)");
    if (bulk > 0) {
      const auto esize = std::int64_t(dtype_size(*parse_dtype(*params.get_str("dtype"))));
      if (*params.get_int("vec") * esize != 16 || *params.get_int("block") < 256)
        return invalid_argument("rmsnorm: bulk > 0 needs 16-byte packs and blocks of at least 256 threads");
    }
    return {};
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"rmsnorm/rmsnorm_fwd.cuh\"\n";
    if (const auto row = params.get_int("row").value_or(0); row > 0) {
      r.name_expression = std::string("kiln::rmsnorm_fwd_row<") + device_type(*params.get_str("dtype")) + ", " +
                          std::to_string(*params.get_int("block")) + ", " + std::to_string(*params.get_int("vec")) +
                          ", " + std::to_string(row) + ">";
      return r;
    }
    if (const auto bulk = params.get_int("bulk").value_or(0); bulk > 0) {
      r.name_expression = std::string("kiln::rmsnorm_fwd_bulk<") + device_type(*params.get_str("dtype")) + ", " +
                          std::to_string(*params.get_int("block")) + ", " + std::to_string(bulk) + ">";
      return r;
    }
    r.name_expression = std::string("kiln::rmsnorm_fwd<") + device_type(*params.get_str("dtype")) + ", " +
                        std::to_string(*params.get_int("block")) + ", " + std::to_string(*params.get_int("vec")) + ">";
    return r;
  }

  // Every block and access width of the register kernel, the one-row kernel at 16-byte accesses
  // with one and two packs per thread, and the bulk-copy kernels the heuristic picks (rows of 64,
  // 96 and 128 KiB: 512 x 8, 1024 x 6 and 1024 x 8).
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f32", "f16", "bf16"})
      for (std::int64_t block : {64, 128, 256, 512, 1024})
        for (std::int64_t vec : {1, 2, 4, 8}) {
          Params p{{"dtype", std::string(dtype)}, {"block", block}, {"vec", vec}, {"bulk", 0}, {"row", 0}};
          if (validate(p).ok()) out.push_back(p);
        }
    for (DType t : {DType::f32, DType::f16, DType::bf16})
      for (int block : {64, 128, 256, 512, 1024})
        for (int row : {1, 2}) out.push_back(params_of(t, {block, 16 / int(dtype_size(t)), 0, row}));
    for (DType t : {DType::f32, DType::f16, DType::bf16})
      for (std::int64_t row_bytes : {64 * 1024, 96 * 1024, 128 * 1024}) {
        const std::int64_t cols = row_bytes / std::int64_t(dtype_size(t));
        Problem p = Problem::of(t, 16, RmsNormProblem{.rows = 4096, .cols = cols, .x_row_stride = cols,
                                                      .y_row_stride = cols, .eps = 1e-6});
        p.cc = 90;
        const auto c = rmsnorm_heuristic(p);
        if (c.bulk > 0) out.push_back(params_of(t, c));
      }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<RmsNormProblem>();
    const auto rows = q.rows, cols = q.cols;
    if (rows < 0 || cols <= 0) return shape_mismatch("rmsnorm: need rows >= 0 and cols > 0");
    if (cols >= (std::int64_t(1) << 31)) return shape_mismatch("rmsnorm: rows longer than 2^31 elements");
    if (q.x_row_stride < cols || q.y_row_stride < cols)
      return shape_mismatch("rmsnorm: row strides must be at least the row length");
    if (!(q.eps >= 0) || !std::isfinite(q.eps))
      return invalid_argument("rmsnorm: eps must be finite and non-negative");
    auto dtype = parse_dtype(*params.get_str("dtype"));
    if (*dtype != p.dtype)
      return unsupported_dtype(std::string("rmsnorm: kernel is for ") + dtype_name(*dtype) + ", tensors are " +
                               dtype_name(p.dtype));
    const auto vec = *params.get_int("vec");
    if (p.alignment < vec * std::int64_t(dtype_size(*dtype)) || q.x_row_stride % vec || q.y_row_stride % vec)
      return invalid_argument("rmsnorm: vec=" + std::to_string(vec) +
                              " needs buffers and row strides aligned to vec elements");
    if (const auto row = params.get_int("row").value_or(0); row > 0) {
      if (cols % vec || cols / vec > *params.get_int("block") * row)
        return invalid_argument("rmsnorm: row > 0 (the one-row kernel) needs rows of whole packs, at most block * row "
                                "of them");
      if (rows >= (std::int64_t(1) << 31)) return shape_mismatch("rmsnorm: the one-row kernel takes under 2^31 rows");
    }
    if (const auto bulk = params.get_int("bulk").value_or(0); bulk > 0) {
      if (!bulk_fits(p))
        return invalid_argument("rmsnorm: bulk > 0 (bulk copies) needs sm_90 or later (cc >= 90), 16-byte aligned "
                                "buffers and row strides, and rows of whole 16-byte packs");
      if (cols / vec > *params.get_int("block") * bulk)
        return invalid_argument("rmsnorm: bulk > 0 needs the row to fit in block * bulk packs");
    }
    return {};
  }

  // The bulk-copy kernel (cp.async.bulk, mbarrier transaction counts) needs sm_90 or later.
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    return params.get_int("bulk").value_or(0) == 0 || arch.capability >= 90;
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::clamp<std::int64_t>(rmsnorm_grid(params, p), 1, 0x7fffffff));
    g.block.x = std::uint32_t(*params.get_int("block"));
    g.shared_bytes = std::uint32_t(rmsnorm_smem_packs(params, p) * *params.get_int("vec") * dtype_size(p.dtype));
    return g;
  }

  Params heuristic(const Problem& p) const override { return params_of(p.dtype, rmsnorm_heuristic(p)); }

  // The register and one-row kernels' catalog variants for the dtype, the bulk-copy kernel at every
  // block and pack count that holds the row, and the heuristic's variant.
  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    for (const auto& c : catalog()) {
      if (*c.get_str("dtype") != dtype_name(p.dtype) || c.get_int("bulk").value_or(0) > 0) continue;
      if (check_problem(c, p).ok()) out.push_back(c);
    }
    for (int block : {256, 512, 1024})
      for (int bulk : {2, 4, 6, 8}) {
        const Params c = params_of(p.dtype, {block, 16 / int(dtype_size(p.dtype)), bulk, 0});
        if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
      }
    // The heuristic's own (a one-row block of whole warps need not be in the catalog).
    const Params h = heuristic(p);
    if (std::find(out.begin(), out.end(), h) == out.end() && check_problem(h, p).ok()) out.push_back(h);
    return out;
  }

  // Row strides default to the row length (contiguous rows), eps to 1e-6.
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    auto full = shape;
    std::int64_t cols = -1;
    bool x_stride = false, y_stride = false, eps = false;
    for (const auto& [n, v] : shape) {
      if (n == "cols") cols = v;
      x_stride |= n == "x_row_stride";
      y_stride |= n == "y_row_stride";
      eps |= n == "eps";
    }
    if (!x_stride && cols >= 0) full.emplace_back("x_row_stride", cols);
    if (!y_stride && cols >= 0) full.emplace_back("y_row_stride", cols);
    KILN_ASSIGN_OR_RETURN(Problem p, Family::problem_from_shape(dtype, full));
    if (!eps) {
      auto q = p.as<RmsNormProblem>();
      q.eps = 1e-6;
      p.set(q);
    }
    return p;
  }

  // The benchmark shapes of docs/benchmarks.md: tokens x hidden, contiguous.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t rows : {1, 16, 512, 4096, 32768})
      for (std::int64_t cols : {2048, 4096, 5120, 8192, 16384, 65536})
        out.push_back(problem_from_shape(dtype, {{"rows", rows}, {"cols", cols}}).value());
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<RmsNormProblem>();
    const auto rows = q.rows, cols = q.cols;
    auto extent = [&](std::int64_t stride) { return rows == 0 ? 0 : (rows - 1) * stride + cols; };
    return {{"x", BufferRole::input, p.dtype, extent(q.x_row_stride)},
            {"w", BufferRole::input, p.dtype, cols},
            {"y", BufferRole::output, p.dtype, extent(q.y_row_stride)},
            {"inv_rms", BufferRole::output, DType::f32, rows}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<RmsNormProblem>();
    out.add(b[0]);
    out.add(b[1]);
    out.add(b[2]);
    out.add(b.size() > 3 ? b[3] : static_cast<void*>(nullptr));
    out.add(static_cast<long long>(q.rows));
    out.add(static_cast<long long>(q.cols));
    out.add(static_cast<long long>(q.x_row_stride));
    out.add(static_cast<long long>(q.y_row_stride));
    out.add(static_cast<float>(q.eps));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 3 && b.size() != 4)
      return invalid_argument("rmsnorm: reference takes buffers x, w, y and optionally inv_rms");
    float* inv_rms = b.size() > 3 ? static_cast<float*>(b[3]) : nullptr;
    const auto q = p.as<RmsNormProblem>();
    const auto rows = q.rows, cols = q.cols;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t xo = r * q.x_row_stride, yo = r * q.y_row_stride;
      double ss = 0;
      for (std::int64_t c = 0; c < cols; ++c) {
        double v = load_as_double(b[0], p.dtype, xo + c);
        ss += v * v;
      }
      const double scale = 1.0 / std::sqrt(ss / double(cols) + q.eps);
      if (inv_rms) inv_rms[r] = float(scale);
      for (std::int64_t c = 0; c < cols; ++c)
        store_from_double(b[2], p.dtype, yo + c,
                          load_as_double(b[0], p.dtype, xo + c) * scale * load_as_double(b[1], p.dtype, c));
    }
    return {};
  }
};

}  // namespace

namespace {
// Packs per thread in the kernel's register cache (families/rmsnorm/rmsnorm_fwd.cuh,
// rmsnorm_cache_regs).
std::int64_t cached_packs(const Params& params, const Problem& p) {
  return register_cache_packs(*params.get_int("block") >= 1024 ? 8 : 16,
                              *params.get_int("vec") * std::int64_t(dtype_size(p.dtype)));
}
}  // namespace

std::int64_t rmsnorm_grid(const Params& params, const Problem& p) {
  const auto q = p.as<RmsNormProblem>();
  const auto block = *params.get_int("block");
  const std::int64_t rows = q.rows, packs = q.cols / *params.get_int("vec"), sms = p.sm_count;
  if (params.get_int("row").value_or(0) > 0) return rows;  // the one-row kernel
  // Bulk-copy kernels: persistent blocks, as many as the SMs hold at once (one per row when the SM
  // count is unknown).
  if (const auto bulk = params.get_int("bulk").value_or(0); bulk > 0) {
    if (sms == 0) return rows;
    const std::int64_t smem = block * bulk * 16 + 1024;  // an SM has 228 KiB, 1 KiB reserved per block
    const std::int64_t per_sm = std::max<std::int64_t>(1, std::min(1024 / block, 228 * 1024 / smem));
    return std::min(rows, sms * per_sm);
  }
  // Rows that fit half the register cache are pipelined when the grid is capped (the kernel's
  // k_half path): about 1024 threads per SM, every block looping over several rows.
  if (sms > 0 && packs <= cached_packs(params, p) / 2 * block)
    return std::min(rows, sms * std::max<std::int64_t>(1, 1024 / block));
  return rows;
}

std::int64_t rmsnorm_smem_packs(const Params& params, const Problem& p) {
  const auto vec = *params.get_int("vec"), block = *params.get_int("block");
  if (params.get_int("row").value_or(0) > 0) return 0;
  if (const auto bulk = params.get_int("bulk").value_or(0); bulk > 0) return block * bulk;
  const std::int64_t packs = p.as<RmsNormProblem>().cols / vec, pack_bytes = vec * std::int64_t(dtype_size(p.dtype));
  const std::int64_t cached = cached_packs(params, p);
  // Rows that fit the register cache: blocks under 1024 threads with packs of 8 bytes and more
  // stage the weight there (families/rmsnorm/rmsnorm_fwd.cuh, k_w_smem).
  if (packs <= block * cached) return block < 1024 && pack_bytes >= 8 ? packs : 0;
  return smem_cache_packs(packs, block, cached, pack_bytes, k_rmsnorm_max_smem);
}

RmsNormChoice rmsnorm_heuristic(const Problem& p) {
  // Chosen on Hopper with bench section `variants` and scripts/tune_report.sh, under the
  // 64-register cap (docs/benchmarks.md has the figures):
  // - 2048 rows and more: 8-byte accesses, eight packs per thread (the whole register cache), blocks
  //   of 64..512 threads; at or near the best at 4096 and 32768 rows for hidden 2048 ..
  //   16384; f16/bf16 rows of 10-32 KiB under 16384 rows take 16-byte accesses, four per thread
  //   (below). Rows of 64-128 KiB (hidden 65536 bf16): 1024 threads and 4-byte accesses, 24 of each
  //   thread's 32 packs in shared memory (16-byte packs are far slower there).
  // - Up to 2048 rows: 4-byte accesses and 16 packs per thread (ahead of the others at 512 rows).
  // - Decode (up to 64 rows), rows that 1024 threads cover with two 16-byte packs each: 16-byte
  //   accesses, two packs per thread, with the weight loaded before the reduction: faster than
  //   1024 threads with 2-byte accesses at 1 and 16 rows of 4096 bf16. Longer rows: 1024 threads,
  //   accesses widened (up to 8 bytes) only while each thread keeps at least eight.
  const auto q = p.as<RmsNormProblem>();
  const int esize = int(dtype_size(p.dtype));
  const std::int64_t rows = q.rows, cols = q.cols;
  // Up to 1024 rows of whole 16-byte packs, at most 2048 of them, with 16-byte aligned buffers and
  // row strides: the one-row kernel, two packs per thread, the smallest block of whole warps (at
  // least 64 threads) that holds the row. kiln tune ranks it first, or within 2% of the first, at
  // 16, 77, 256, 512 and 1000 rows of 896 and 4096 bf16 elements on Hopper (clearly ahead of the
  // register kernel's 4-byte accesses at 77 rows); a call of a few rows lasts about as long as one
  // block takes for its row, and this kernel has the fewest instructions between a row's loads
  // and its stores.
  if (const int vec16 = 16 / esize; rows <= k_rmsnorm_row_kernel_rows && p.alignment >= 16 && cols % vec16 == 0 &&
                                    cols / vec16 <= 2048 && q.x_row_stride % vec16 == 0 &&
                                    q.y_row_stride % vec16 == 0) {
    return {int(row_kernel_block(cols / vec16)), vec16, 0, 2};
  }
  // From 2048 rows, rows of 64-128 KiB on sm_90 with 16-byte aligned rows: the bulk-copy kernel,
  // the smallest block of 256..1024 threads that covers the row with 8 packs each, an even number
  // of packs per thread (faster than the register kernel below at 4096 x 65536 and 4096 x 32768
  // bf16, in the bench and in kiln tune). Shorter rows lose to the register kernel in the tuner
  // (4096 x 5120 to 16384).
  if (rows >= 2048 && cols * esize >= 64 * 1024 && cols * esize <= 128 * 1024 && bulk_fits(p)) {
    const std::int64_t packs = cols * esize / 16;
    int block = 256;
    while (block < 1024 && std::int64_t(block) * 8 < packs) block *= 2;
    const int bulk = int((packs + block - 1) / block);
    return {block, 16 / esize, bulk + bulk % 2, 0};
  }
  int pack_bytes = rows >= 2048 ? 8 : 4;
  // 2048 to 16383 rows of 10-32 KiB in f16/bf16 (hidden 5120 to 16384): 16-byte accesses, four per
  // thread (the same 64-byte register cache). In the bench's variants sweep they are slightly
  // ahead of 8-byte packs at 4096 rows; at 32768 rows, and at hidden 4096, 8-byte packs are as
  // fast or faster (docs/benchmarks.md).
  const bool wide_packs = rows >= 2048 && rows < 16384 && esize == 2 && cols * esize >= 10 * 1024 &&
                          cols * esize <= 32 * 1024;
  if (wide_packs) pack_bytes = 16;
  const bool decode_wide = rows <= 64 && cols * esize <= 2 * 1024 * 16;
  if (decode_wide) {
    pack_bytes = 16;
  } else if (rows <= 64) {
    pack_bytes = esize;
    while (pack_bytes < 8 && std::int64_t(pack_bytes) * 2 * 1024 * 8 <= cols * esize) pack_bytes *= 2;
  }
  int vec = std::max(1, pack_bytes / esize);
  // The widest access that every row start and the weight allow.
  while (vec > 1 && (p.alignment < std::uint32_t(vec * esize) || q.x_row_stride % vec || q.y_row_stride % vec ||
                     cols < vec))
    vec /= 2;
  const std::int64_t packs = std::max<std::int64_t>(1, cols / vec);
  int block = 64;
  if (decode_wide) {
    while (block < 1024 && block * 2 < packs) block *= 2;
  } else if (rows <= 64) {
    block = 1024;
  } else if (rows >= 2048 && cols * esize > 64 * 1024 && cols * esize <= 128 * 1024 && vec * esize == 8) {
    // Rows of 64-128 KiB: 1024 threads with 4-byte packs keep 8 packs each in registers and 24 in
    // shared memory, the weight in registers. kiln tune ranks them well ahead of 512 threads with
    // 8-byte packs, which also stage the weight in the shared memory the row cache needs.
    return {1024, std::max(1, 4 / esize), 0, 0};
  } else {
    // Packs per thread that fill the register cache: eight of 8 bytes, four of 16.
    const int per_thread = rows >= 2048 ? (vec * esize == 16 ? 4 : 8) : 16;
    while (block < 512 && block * per_thread < packs) block *= 2;
  }
  return {block, vec, 0, 0};
}

}  // namespace kiln::families

void kiln_register_family_rmsnorm(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::RmsNorm>());
}
