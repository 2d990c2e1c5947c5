#include "families/add_rmsnorm/add_rmsnorm.h"
#include "families/common/family_util.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "common/half.h"

namespace kiln::families {
namespace {

// The four row strides: x, residual, y, residual_out.
std::array<std::int64_t, 4> row_strides(const AddRmsNormProblem& q) {
  return {q.x_row_stride, q.residual_row_stride, q.y_row_stride, q.residual_out_row_stride};
}

// v rounded to the nearest value of dtype t (round to nearest even), as the kernel's from_float.
double round_to(DType t, double v) {
  unsigned char tmp[4];
  store_from_double(tmp, t, 0, v);
  return load_as_double(tmp, t, 0);
}

class AddRmsNorm final : public Family {
 public:
  std::string_view name() const override { return "add_rmsnorm"; }
  int version() const override { return 4; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", row_kernel_blocks(), {}, "threads per block (one block per row): a power of two, or any "
                                           "multiple of 32 for the one-row kernel (row > 0)"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of every buffer"},
        {"row", {0, 1, 2}, {}, "packs per thread of the one-row kernel (the row in registers, rows of at most "
                               "block * row whole packs); 0: the general kernel"},
        {"vec", {1, 2, 4, 8}, {}, "elements per memory access"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    using P = AddRmsNormProblem;
    static const std::vector<ProblemField> fields = problem_fields_of<P>({
        bucketed(&P::rows, "rows", "rows to normalize"),
        key(&P::cols, "cols", "elements per row"),
        key(&P::x_row_stride, "x_row_stride", "elements between two rows of x"),
        key(&P::residual_row_stride, "residual_row_stride", "elements between two rows of residual"),
        key(&P::y_row_stride, "y_row_stride", "elements between two rows of y"),
        key(&P::residual_out_row_stride, "residual_out_row_stride", "elements between two rows of residual_out"),
        value(&P::eps, "eps", "added to the mean square")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    KILN_TRY(check_access_width(name(), params));
    if (const auto block = *params.get_int("block"); *params.get_int("row") == 0 && (block & (block - 1)))
      return invalid_argument("add_rmsnorm: block must be a power of two but for the one-row kernel (row > 0)");
    return {};
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"add_rmsnorm/add_rmsnorm_fwd.cuh\"\n";
    const auto row = *params.get_int("row");
    r.name_expression = std::string(row > 0 ? "kiln::add_rmsnorm_fwd_row<" : "kiln::add_rmsnorm_fwd<") +
                        device_type(*params.get_str("dtype")) + ", " + std::to_string(*params.get_int("block")) + ", " +
                        std::to_string(*params.get_int("vec")) + (row > 0 ? ", " + std::to_string(row) : "") + ">";
    return r;
  }

  // Every block and access width of the general kernel, and the one-row kernel at 16-byte
  // accesses with one and two packs per thread.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f32", "f16", "bf16"})
      for (std::int64_t row : {0, 1, 2})
        for (std::int64_t block : {64, 128, 256, 512, 1024})
          for (std::int64_t vec : {1, 2, 4, 8}) {
            if (row > 0 && vec * std::int64_t(dtype_size(*parse_dtype(dtype))) != 16) continue;
            Params p{{"dtype", std::string(dtype)}, {"block", block}, {"vec", vec}, {"row", row}};
            if (validate(p).ok()) out.push_back(p);
          }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<AddRmsNormProblem>();
    const auto rows = q.rows, cols = q.cols;
    if (rows < 0 || cols <= 0) return shape_mismatch("add_rmsnorm: need rows >= 0 and cols > 0");
    if (cols >= (std::int64_t(1) << 31)) return shape_mismatch("add_rmsnorm: rows longer than 2^31 elements");
    for (std::int64_t stride : row_strides(q))
      if (stride < cols) return shape_mismatch("add_rmsnorm: row strides must be at least the row length");
    if (!(q.eps >= 0) || !std::isfinite(q.eps))
      return invalid_argument("add_rmsnorm: eps must be finite and non-negative");
    auto dtype = parse_dtype(*params.get_str("dtype"));
    if (*dtype != p.dtype)
      return unsupported_dtype(std::string("add_rmsnorm: kernel is for ") + dtype_name(*dtype) + ", tensors are " +
                               dtype_name(p.dtype));
    const auto vec = *params.get_int("vec");
    bool strides_ok = true;
    for (std::int64_t stride : row_strides(q)) strides_ok &= stride % vec == 0;
    if (p.alignment < vec * std::int64_t(dtype_size(*dtype)) || !strides_ok)
      return invalid_argument("add_rmsnorm: vec=" + std::to_string(vec) +
                              " needs buffers and row strides aligned to vec elements");
    if (const auto row = *params.get_int("row"); row > 0) {
      if (cols % vec || cols / vec > *params.get_int("block") * row)
        return invalid_argument("add_rmsnorm: row > 0 (the one-row kernel) needs rows of whole packs, at most "
                                "block * row of them");
      if (rows >= (std::int64_t(1) << 31))
        return shape_mismatch("add_rmsnorm: the one-row kernel takes under 2^31 rows");
    }
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::clamp<std::int64_t>(p.as<AddRmsNormProblem>().rows, 1, 0x7fffffff));
    g.block.x = std::uint32_t(*params.get_int("block"));
    g.shared_bytes = *params.get_int("row") > 0 ? 0u
                     : std::uint32_t(add_rmsnorm_smem_packs(params, p) * *params.get_int("vec") *
                                     dtype_size(p.dtype));
    return g;
  }

  Params heuristic(const Problem& p) const override {
    auto c = add_rmsnorm_heuristic(p);
    return Params{{"dtype", std::string(dtype_name(p.dtype))}, {"block", c.block}, {"vec", c.vec}, {"row", c.row}};
  }

  // The catalog's variants for the dtype that hold the problem, and the heuristic's (a one-row
  // block of whole warps need not be in the catalog).
  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    for (const auto& c : catalog()) {
      if (*c.get_str("dtype") != dtype_name(p.dtype)) continue;
      if (check_problem(c, p).ok()) out.push_back(c);
    }
    const Params h = heuristic(p);
    if (std::find(out.begin(), out.end(), h) == out.end() && check_problem(h, p).ok()) out.push_back(h);
    return out;
  }

  // Row strides default to the row length (contiguous rows).
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    const auto cols = shape_value(shape, "cols");
    if (!cols) return Family::problem_from_shape(dtype, shape);
    return Family::problem_from_shape(
        dtype, with_defaults(shape, {{"x_row_stride", *cols},
                                     {"residual_row_stride", *cols},
                                     {"y_row_stride", *cols},
                                     {"residual_out_row_stride", *cols}}));
  }

  // The rmsnorm benchmark shapes (docs/benchmarks.md): tokens x hidden, every tensor contiguous.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t rows : {1, 16, 512, 4096, 32768})
      for (std::int64_t cols : {2048, 4096, 5120, 8192, 16384, 65536})
        out.push_back(Problem::of(dtype, 16,
                                  AddRmsNormProblem{.rows = rows, .cols = cols, .x_row_stride = cols,
                                                    .residual_row_stride = cols, .y_row_stride = cols,
                                                    .residual_out_row_stride = cols, .eps = 1e-6}));
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<AddRmsNormProblem>();
    const auto rows = q.rows, cols = q.cols;
    auto extent = [&](std::int64_t stride) { return rows == 0 ? 0 : (rows - 1) * stride + cols; };
    return {{"x", BufferRole::input, p.dtype, extent(q.x_row_stride)},
            {"residual", BufferRole::input, p.dtype, extent(q.residual_row_stride)},
            {"w", BufferRole::input, p.dtype, cols},
            {"y", BufferRole::output, p.dtype, extent(q.y_row_stride)},
            {"residual_out", BufferRole::output, p.dtype, extent(q.residual_out_row_stride)}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<AddRmsNormProblem>();
    for (int i = 0; i < 5; ++i) out.add(b[i]);
    for (std::int64_t v : {q.rows, q.cols, q.x_row_stride, q.residual_row_stride, q.y_row_stride,
                           q.residual_out_row_stride})
      out.add(static_cast<long long>(v));
    out.add(static_cast<float>(q.eps));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 5) return invalid_argument("add_rmsnorm: reference takes 5 buffers (x, residual, w, y, residual_out)");
    const auto q = p.as<AddRmsNormProblem>();
    const auto rows = q.rows, cols = q.cols;
    // A whole row of h is read before anything of that row is written, so exact aliasing
    // (residual_out = residual, y = x) computes the same as separate buffers.
    std::vector<double> h(std::size_t(std::max<std::int64_t>(cols, 0)));
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t xo = r * q.x_row_stride, ro = r * q.residual_row_stride;
      double ss = 0;
      for (std::int64_t c = 0; c < cols; ++c) {
        h[c] = round_to(p.dtype, load_as_double(b[0], p.dtype, xo + c) + load_as_double(b[1], p.dtype, ro + c));
        ss += h[c] * h[c];
      }
      const double scale = 1.0 / std::sqrt(ss / double(cols) + q.eps);
      const std::int64_t yo = r * q.y_row_stride, hoff = r * q.residual_out_row_stride;
      for (std::int64_t c = 0; c < cols; ++c) {
        store_from_double(b[4], p.dtype, hoff + c, h[c]);
        store_from_double(b[3], p.dtype, yo + c, h[c] * scale * load_as_double(b[2], p.dtype, c));
      }
    }
    return {};
  }
};

}  // namespace

std::int64_t add_rmsnorm_smem_packs(const Params& params, const Problem& p) {
  // The kernel's register cache: 8 registers of h per thread (templates/add_rmsnorm).
  const auto vec = *params.get_int("vec");
  const std::int64_t pack_bytes = vec * std::int64_t(dtype_size(p.dtype));
  return smem_cache_packs(p.as<AddRmsNormProblem>().cols / vec, *params.get_int("block"), register_cache_packs(8, pack_bytes),
                          pack_bytes, k_add_rmsnorm_max_smem);
}

AddRmsNormChoice add_rmsnorm_heuristic(const Problem& p) {
  const auto q = p.as<AddRmsNormProblem>();
  const int esize = int(dtype_size(p.dtype));
  int vec = 16 / esize;
  auto strides_allow = [&](int v) {
    for (std::int64_t stride : row_strides(q))
      if (stride % v) return false;
    return true;
  };
  while (vec > 1 && (p.alignment < std::uint32_t(vec * esize) || !strides_allow(vec) || q.cols < vec))
    vec /= 2;
  // Rows past the register cache (two packs per thread of 1024): 8-byte accesses, whose
  // shared-memory batches keep two loads per buffer in flight; 16-byte packs are far slower there
  // on Hopper. From 2048 rows those rows take 512 threads, which kiln tune ranks slightly ahead of
  // 1024 at 4096 x 65536 bf16. docs/benchmarks.md has the figures.
  const bool past_cache = q.cols / vec > 2 * 1024;
  if (past_cache && vec * esize > 8) vec = 8 / esize;
  const std::int64_t packs = std::max<std::int64_t>(1, q.cols / vec);
  // Up to 1024 rows of whole 16-byte packs, at most 2048 of them: the one-row kernel, two packs
  // per thread, the smallest block of whole warps (at least 64 threads) that holds the row. kiln
  // tune ranks it first at 77 to 1000 rows of 4096 bf16 elements and first or close behind at 896
  // on Hopper; it loads the weight beside x and the residual, before the reduction (the general
  // kernel loads it after), and issues the fewest instructions in between.
  if (q.rows <= k_add_rmsnorm_row_kernel_rows && vec * esize == 16 && q.cols % vec == 0 && packs <= 2048) {
    return {int(row_kernel_block(packs)), vec, 2};
  }
  const int max_block = past_cache && q.rows >= 2048 ? 512 : 1024;
  // The smallest block that gives each thread at most its two cached packs; from 2048 rows, up to
  // half a pack more per thread through shared memory rather than a block twice the size with
  // some threads holding one: at 5120 bf16 columns (640 packs) the bench's variants sweep has 256
  // threads ahead of 512 at 32768 rows and level at 4096. Power-of-two rows choose the same block
  // either way.
  const std::int64_t per_thread_x2 = q.rows >= 2048 ? 5 : 4;  // packs per thread, doubled
  int block = 64;
  while (block < max_block && block * per_thread_x2 < packs * 2) block *= 2;
  return {block, vec, 0};
}

}  // namespace kiln::families

void kiln_register_family_add_rmsnorm(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::AddRmsNorm>());
}
