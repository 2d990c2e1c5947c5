#include "families/layernorm/layernorm.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <vector>

#include "common/half.h"
#include "families/common/family_util.h"

namespace kiln::families {
namespace {

// Elements per thread either kernel may hold: the forward keeps a row's packed elements, the
// backward dy's and x's (and its two column sums per element in shared memory).
std::int64_t max_elements(bool backward) { return backward ? 16 : 32; }
std::int64_t max_block(bool backward) { return backward ? 512 : 1024; }
// The forward stages weight and bias in shared memory up to this many bytes of both.
constexpr std::int64_t k_max_staged = 64 * 1024;

struct Shape {
  std::int64_t group, rows, vec, packs;
};
Shape shape_of(const Params& params) {
  return {*params.get_int("group"), *params.get_int("rows"), *params.get_int("vec"), *params.get_int("packs")};
}

Status check_variant(std::string_view family, const Params& params, bool backward) {
  KILN_TRY(check_access_width(family, params));
  const auto s = shape_of(params);
  const std::string f(family);
  if (s.group * s.rows > max_block(backward))
    return invalid_argument(f + ": group * rows must be at most " + std::to_string(max_block(backward)) +
                            " threads (got " + std::to_string(s.group * s.rows) + ")");
  if (s.packs * s.vec > max_elements(backward))
    return invalid_argument(f + ": packs * vec must be at most " + std::to_string(max_elements(backward)));
  return {};
}

// What both kernels check of a problem of `rows` rows of `cols` elements with the given row
// strides for a variant: sizes, dtype, alignment and row length.
Status check_rows(std::string_view family, const Params& params, const Problem& p, std::int64_t rows,
                  std::int64_t cols, std::initializer_list<std::int64_t> strides) {
  const std::string f(family);
  if (rows < 0 || cols <= 0) return shape_mismatch(f + ": need rows >= 0 and cols > 0");
  if (cols >= (std::int64_t(1) << 31)) return shape_mismatch(f + ": rows longer than 2^31 elements");
  for (std::int64_t s : strides)
    if (s < cols) return shape_mismatch(f + ": row strides must be at least the row length");
  const auto dtype = *parse_dtype(*params.get_str("dtype"));
  if (dtype != p.dtype)
    return unsupported_dtype(f + ": kernel is for " + dtype_name(dtype) + ", tensors are " + dtype_name(p.dtype));
  const auto s = shape_of(params);
  bool strides_ok = true;
  for (std::int64_t st : strides) strides_ok = strides_ok && st % s.vec == 0;
  if (p.alignment < s.vec * std::int64_t(dtype_size(dtype)) || cols % s.vec || !strides_ok)
    return invalid_argument(f + ": vec=" + std::to_string(s.vec) +
                            " needs buffers aligned to vec elements and a row length and row strides divisible by vec");
  if (cols > s.group * s.packs * s.vec)
    return invalid_argument(f + ": group=" + std::to_string(s.group) + ", packs=" + std::to_string(s.packs) +
                            ", vec=" + std::to_string(s.vec) + " holds rows of at most " +
                            std::to_string(s.group * s.packs * s.vec) + " elements, not " + std::to_string(cols));
  return {};
}

// Elements a buffer of `rows` rows of `cols` at `stride` spans.
std::int64_t extent(std::int64_t rows, std::int64_t cols, std::int64_t stride) {
  return rows == 0 ? 0 : (rows - 1) * stride + cols;
}

// `shape` with each of `strides` not named in it set to the row length (contiguous rows).
std::vector<std::pair<std::string, std::int64_t>> with_strides(
    const std::vector<std::pair<std::string, std::int64_t>>& shape, std::initializer_list<const char*> strides) {
  auto out = shape;
  std::int64_t cols = -1;
  for (const auto& [n, v] : shape)
    if (n == "cols") cols = v;
  if (cols < 0) return out;
  for (const char* stride : strides)
    if (std::none_of(shape.begin(), shape.end(), [&](const auto& s) { return s.first == stride; }))
      out.emplace_back(stride, cols);
  return out;
}

std::string render_name(const char* kernel, const Params& params) {
  const auto s = shape_of(params);
  return std::string("kiln::layernorm::") + kernel + "<" + device_type(*params.get_str("dtype")) + ", " +
         std::to_string(s.group) + ", " + std::to_string(s.rows) + ", " + std::to_string(s.vec) + ", " +
         std::to_string(s.packs) + ">";
}

Params params_of(DType t, const Shape& s) {
  return Params{{"dtype", std::string(dtype_name(t))}, {"group", s.group}, {"rows", s.rows}, {"vec", s.vec},
                {"packs", s.packs}};
}

// The shapes the catalog covers: the hidden sizes of encoders and LLMs, odd ones, the longest
// rows; decode to prefill row counts; 16-byte and 2-byte aligned buffers.
constexpr std::int64_t k_catalog_cols[] = {64,   768,  896,  1023, 1024, 2047, 2048, 2880,  3072,  3584,
                                           4096, 5120, 7168, 8192, 8200, 12288, 16384, 32768};
constexpr std::int64_t k_catalog_rows[] = {1, 3, 16, 64, 77, 1000, 2048, 4096, 16384};

std::vector<Params> tuning_candidates(const Family& f, const Problem& p, bool backward) {
  std::vector<Params> out;
  const std::int64_t cols = backward ? p.as<LayerNormBwdProblem>().cols : p.as<LayerNormProblem>().cols;
  const std::int64_t problem_rows = backward ? p.as<LayerNormBwdProblem>().rows : p.as<LayerNormProblem>().rows;
  const auto h = layernorm_choice(p, backward);
  if (h.ok()) out.push_back(*h);
  for (std::int64_t vec : {1, 2, 4, 8})
    for (std::int64_t group : {32, 64, 128, 256, 512, 1024})
      for (std::int64_t rows : {1, 2, 4, 8})
        for (std::int64_t packs : {1, 2, 4, 8, 16}) {
          const Params c = params_of(p.dtype, {group, rows, vec, packs});
          if (!f.validate(c).ok() || !f.check_problem(c, p).ok()) continue;
          // Row caches at least half in use, and no more rows a block than the problem has.
          if (2 * (cols / vec) <= group * packs || rows > std::max<std::int64_t>(1, problem_rows)) continue;
          if (h.ok() && c == *h) continue;
          out.push_back(c);
        }
  return out;
}

std::vector<Problem> shapes(const Family& f, DType dtype, bool backward) {
  std::vector<Problem> out;
  // LLM and encoder widths, a row length that is no multiple of a vector width, decode and
  // prefill row counts.
  for (std::int64_t rows : {1, 16, 77, 4096, 16384})
    for (std::int64_t cols : {768, 1023, 2880, 4096, 8192})
      out.push_back(f.problem_from_shape(dtype, {{"rows", rows}, {"cols", cols}}).value());
  return out;
}

// The catalog of one kernel: what the heuristic picks over k_catalog_cols x k_catalog_rows, every
// dtype, 16- and 2-byte aligned buffers, contiguous rows.
std::vector<Params> catalog_of(const Family& f, bool backward) {
  std::vector<Params> out;
  std::set<std::string> seen;
  for (DType t : {DType::f32, DType::f16, DType::bf16})
    for (std::int64_t cols : k_catalog_cols)
      for (std::int64_t rows : k_catalog_rows)
        for (std::uint32_t align : {16u, 2u}) {
          const std::uint32_t a = std::max<std::uint32_t>(align, std::uint32_t(dtype_size(t)));
          const Problem p =
              backward ? Problem::of(t, a, LayerNormBwdProblem{.rows = rows, .cols = cols, .dy_row_stride = cols,
                                                               .x_row_stride = cols, .dx_row_stride = cols, .slabs = 1})
                       : Problem::of(t, a, LayerNormProblem{.rows = rows, .cols = cols, .x_row_stride = cols,
                                                            .y_row_stride = cols, .eps = 1e-5});
          const auto c = layernorm_choice(p, backward);
          if (c.ok() && f.validate(*c).ok() && seen.insert(c->canonical()).second) out.push_back(*c);
        }
  return out;
}

class LayerNorm final : public Family {
 public:
  std::string_view name() const override { return "layernorm"; }
  int version() const override { return 4; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of x, weight, bias and y"},
        {"group", {32, 64, 128, 256, 512, 1024}, {}, "threads per row"},
        {"packs", {1, 2, 4, 8, 16}, {}, "packs of vec elements each thread holds in registers"},
        {"rows", {1, 2, 4, 8}, {}, "rows per block, one per group of threads"},
        {"vec", {1, 2, 4, 8}, {}, "elements per memory access"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<LayerNormProblem>({
        bucketed(&LayerNormProblem::rows, "rows", "rows to normalize"),
        key(&LayerNormProblem::cols, "cols", "elements per row"),
        key(&LayerNormProblem::x_row_stride, "x_row_stride", "elements between two rows of x"),
        key(&LayerNormProblem::y_row_stride, "y_row_stride", "elements between two rows of y"),
        value(&LayerNormProblem::eps, "eps", "added to the variance")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    return check_variant(name(), params, false);
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"layernorm/layernorm.cuh\"\n";
    r.name_expression = render_name("layernorm_fwd", params);
    return r;
  }

  std::vector<Params> catalog() const override { return catalog_of(*this, false); }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<LayerNormProblem>();
    KILN_TRY(check_rows(name(), params, p, q.rows, q.cols, {q.x_row_stride, q.y_row_stride}));
    if (!std::isfinite(q.eps) || !(q.eps >= 0))
      return invalid_argument("layernorm: eps must be finite and non-negative");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto rows_per_block = *params.get_int("rows");
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::clamp<std::int64_t>(
        (p.as<LayerNormProblem>().rows + rows_per_block - 1) / rows_per_block, 1, 0x7fffffff));
    g.block.x = std::uint32_t(*params.get_int("group") * rows_per_block);
    g.shared_bytes = std::uint32_t(layernorm_fwd_smem(params, p));
    return g;
  }

  Params heuristic(const Problem& p) const override {
    auto c = layernorm_choice(p, false);
    return c.ok() ? *c : params_of(p.dtype, {1024, 1, 1, 16});
  }
  std::vector<Params> tuning_space(const Problem& p) const override { return tuning_candidates(*this, p, false); }

  // Row strides default to the row length (contiguous rows), eps to 1e-5 (torch.nn.LayerNorm's).
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    KILN_ASSIGN_OR_RETURN(Problem p,
                          Family::problem_from_shape(dtype, with_strides(shape, {"x_row_stride", "y_row_stride"})));
    if (std::none_of(shape.begin(), shape.end(), [](const auto& s) { return s.first == "eps"; })) {
      auto q = p.as<LayerNormProblem>();
      q.eps = 1e-5;
      p.set(q);
    }
    return p;
  }
  std::vector<Problem> benchmark_problems(DType dtype) const override { return shapes(*this, dtype, false); }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<LayerNormProblem>();
    const auto rows = q.rows, cols = q.cols;
    return {{"x", BufferRole::input, p.dtype, extent(rows, cols, q.x_row_stride)},
            {"weight", BufferRole::input, p.dtype, cols},
            {"bias", BufferRole::input, p.dtype, cols},
            {"y", BufferRole::output, p.dtype, extent(rows, cols, q.y_row_stride)},
            {"mean", BufferRole::output, DType::f32, rows},
            {"rstd", BufferRole::output, DType::f32, rows}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<LayerNormProblem>();
    for (std::size_t i = 0; i < 6; ++i) out.add(i < b.size() ? b[i] : static_cast<void*>(nullptr));
    out.add(static_cast<long long>(q.rows));
    out.add(static_cast<long long>(q.cols));
    out.add(static_cast<long long>(q.x_row_stride));
    out.add(static_cast<long long>(q.y_row_stride));
    out.add(static_cast<float>(q.eps));
  }

  // Buffers as buffers() lists them; bias, mean and rstd may be null.
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 6 || !b[0] || !b[1] || !b[3])
      return invalid_argument("layernorm: the reference takes x, weight, bias, y, mean, rstd (x, weight, y non-null)");
    const auto q = p.as<LayerNormProblem>();
    const auto rows = q.rows, cols = q.cols;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t xo = r * q.x_row_stride, yo = r * q.y_row_stride;
      double sum = 0, sq = 0;
      for (std::int64_t c = 0; c < cols; ++c) sum += load_as_double(b[0], p.dtype, xo + c);
      const double mean = sum / double(cols);
      for (std::int64_t c = 0; c < cols; ++c) {
        const double d = load_as_double(b[0], p.dtype, xo + c) - mean;
        sq += d * d;
      }
      const double rstd = 1.0 / std::sqrt(sq / double(cols) + q.eps);
      for (std::int64_t c = 0; c < cols; ++c) {
        const double bias = b[2] ? load_as_double(b[2], p.dtype, c) : 0.0;
        store_from_double(b[3], p.dtype, yo + c,
                          (load_as_double(b[0], p.dtype, xo + c) - mean) * rstd * load_as_double(b[1], p.dtype, c) +
                              bias);
      }
      if (b[4]) static_cast<float*>(b[4])[r] = float(mean);
      if (b[5]) static_cast<float*>(b[5])[r] = float(rstd);
    }
    return {};
  }
};

class LayerNormBwd final : public Family {
 public:
  std::string_view name() const override { return "layernorm_bwd"; }
  int version() const override { return 3; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of dy, x, weight and dx"},
        {"group", {32, 64, 128, 256, 512}, {}, "threads per row"},
        {"packs", {1, 2, 4}, {}, "packs of vec elements of dy and of x each thread holds in registers"},
        {"rows", {1, 2, 4, 8}, {}, "rows in flight per block, one per group of threads"},
        {"vec", {1, 2, 4, 8}, {}, "elements per memory access"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<LayerNormBwdProblem>({
        bucketed(&LayerNormBwdProblem::rows, "rows", "rows of dy, x and dx"),
        key(&LayerNormBwdProblem::cols, "cols", "elements per row"),
        key(&LayerNormBwdProblem::dy_row_stride, "dy_row_stride", "elements between two rows of dy"),
        key(&LayerNormBwdProblem::x_row_stride, "x_row_stride", "elements between two rows of x"),
        key(&LayerNormBwdProblem::dx_row_stride, "dx_row_stride", "elements between two rows of dx"),
        key(&LayerNormBwdProblem::slabs, "slabs",
            "blocks; slab i sums the gradients of rows i, i + slabs, ... (layernorm_bwd_slabs)")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    return check_variant(name(), params, true);
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"layernorm/layernorm.cuh\"\n";
    r.name_expression = render_name("layernorm_bwd", params);
    return r;
  }

  std::vector<Params> catalog() const override { return catalog_of(*this, true); }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<LayerNormBwdProblem>();
    KILN_TRY(check_rows(name(), params, p, q.rows, q.cols, {q.dy_row_stride, q.x_row_stride, q.dx_row_stride}));
    const auto rows = q.rows, slabs = q.slabs;
    if (slabs < (rows > 0 ? 1 : 0) || slabs > std::max<std::int64_t>(rows, 1) || slabs > 0x7fffffff)
      return shape_mismatch("layernorm_bwd: need 1 <= slabs <= rows");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>(p.as<LayerNormBwdProblem>().slabs, 1));
    g.block.x = std::uint32_t(*params.get_int("group") * *params.get_int("rows"));
    g.shared_bytes = std::uint32_t(layernorm_bwd_smem(params));
    return g;
  }

  Params heuristic(const Problem& p) const override {
    auto c = layernorm_choice(p, true);
    return c.ok() ? *c : params_of(p.dtype, {512, 1, 1, 4});
  }
  std::vector<Params> tuning_space(const Problem& p) const override { return tuning_candidates(*this, p, true); }

  // Row strides default to the row length, slabs to the heuristic's for a 132-SM GPU.
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    auto full = with_strides(shape, {"dy_row_stride", "x_row_stride", "dx_row_stride"});
    std::int64_t rows = 0;
    bool has_slabs = false;
    for (const auto& [n, v] : shape) {
      if (n == "rows") rows = v;
      has_slabs |= n == "slabs";
    }
    // A placeholder the problem's checks accept, replaced below.
    if (!has_slabs) full.emplace_back("slabs", std::max<std::int64_t>(rows, 1));
    KILN_ASSIGN_OR_RETURN(Problem p, Family::problem_from_shape(dtype, full));
    if (!has_slabs) {
      auto q = p.as<LayerNormBwdProblem>();
      const auto c = layernorm_choice(p, true);
      q.slabs = c.ok() ? layernorm_bwd_slabs(*c, q.rows, 132) : std::clamp<std::int64_t>(q.rows, 0, 132);
      p.set(q);
    }
    return p;
  }
  std::vector<Problem> benchmark_problems(DType dtype) const override { return shapes(*this, dtype, true); }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<LayerNormBwdProblem>();
    const auto rows = q.rows, cols = q.cols, slabs = q.slabs;
    return {{"dy", BufferRole::input, p.dtype, extent(rows, cols, q.dy_row_stride)},
            {"x", BufferRole::input, p.dtype, extent(rows, cols, q.x_row_stride)},
            {"weight", BufferRole::input, p.dtype, cols},
            {"mean", BufferRole::input, DType::f32, rows},
            {"rstd", BufferRole::input, DType::f32, rows},
            {"dx", BufferRole::output, p.dtype, extent(rows, cols, q.dx_row_stride)},
            {"partial", BufferRole::output, DType::f32, 2 * slabs * cols}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    for (std::size_t i = 0; i < 7; ++i) out.add(i < b.size() ? b[i] : static_cast<void*>(nullptr));
    const auto q = p.as<LayerNormBwdProblem>();
    for (std::int64_t v : {q.rows, q.cols, q.dy_row_stride, q.x_row_stride, q.dx_row_stride,
                           std::max<std::int64_t>(q.slabs, 1)})
      out.add(static_cast<long long>(v));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 7)
      return invalid_argument("layernorm_bwd: the reference takes dy, x, weight, mean, rstd, dx and partial");
    for (void* ptr : b)
      if (!ptr) return invalid_argument("layernorm_bwd: a buffer of the reference is null");
    const auto q = p.as<LayerNormBwdProblem>();
    const auto rows = q.rows, cols = q.cols, slabs = std::max<std::int64_t>(q.slabs, 1);
    auto* partial = static_cast<float*>(b[6]);
    std::vector<double> acc_w(static_cast<std::size_t>(cols)), acc_b(static_cast<std::size_t>(cols));
    for (std::int64_t s = 0; s < slabs; ++s) {
      std::fill(acc_w.begin(), acc_w.end(), 0.0);
      std::fill(acc_b.begin(), acc_b.end(), 0.0);
      for (std::int64_t r = s; r < rows; r += slabs) {
        const std::int64_t dyo = r * q.dy_row_stride, xo = r * q.x_row_stride, dxo = r * q.dx_row_stride;
        const double m = static_cast<const float*>(b[3])[r], rs = static_cast<const float*>(b[4])[r];
        double sum_g = 0, sum_gx = 0;
        for (std::int64_t c = 0; c < cols; ++c) {
          const double d = load_as_double(b[0], p.dtype, dyo + c);
          const double xh = (load_as_double(b[1], p.dtype, xo + c) - m) * rs;
          const double g = d * load_as_double(b[2], p.dtype, c);
          sum_g += g;
          sum_gx += g * xh;
          acc_w[std::size_t(c)] += d * xh;
          acc_b[std::size_t(c)] += d;
        }
        for (std::int64_t c = 0; c < cols; ++c) {
          const double xh = (load_as_double(b[1], p.dtype, xo + c) - m) * rs;
          const double g = load_as_double(b[0], p.dtype, dyo + c) * load_as_double(b[2], p.dtype, c);
          store_from_double(b[5], p.dtype, dxo + c, rs * (g - (sum_g + xh * sum_gx) / double(cols)));
        }
      }
      for (std::int64_t c = 0; c < cols; ++c) {
        partial[s * cols + c] = float(acc_w[std::size_t(c)]);
        partial[(slabs + s) * cols + c] = float(acc_b[std::size_t(c)]);
      }
    }
    return {};
  }
};

}  // namespace

namespace {

// Registers a thread's packs take (a pack narrower than a register still takes one): the
// kernels' cache_regs (layernorm.cuh).
std::int64_t cache_regs(std::int64_t packs, std::int64_t pack_bytes) {
  return packs * std::max<std::int64_t>(1, pack_bytes / 4);
}

// The widest access of at most `widest` elements that the alignment, the row length and every
// row stride allow.
std::int64_t access_width(const Problem& p, std::int64_t widest, std::int64_t cols,
                          std::initializer_list<std::int64_t> strides) {
  const auto esize = std::int64_t(dtype_size(p.dtype));
  std::int64_t vec = std::max<std::int64_t>(1, widest);
  auto fits = [&](std::int64_t v) {
    if (p.alignment < v * esize || cols % v) return false;
    for (std::int64_t s : strides)
      if (s % v) return false;
    return true;
  };
  while (vec > 1 && !fits(vec)) vec /= 2;
  return vec;
}

std::int64_t pow2_at_least(std::int64_t n) {
  std::int64_t v = 1;
  while (v < n) v *= 2;
  return v;
}

// The forward's variant at accesses of `vec` elements: the smallest group from 32 threads giving
// at most `per_thread` packs a thread, up to `max_group`; then more packs a thread, then more
// threads, until the row fits. None when 1024 threads cannot hold it.
std::optional<Shape> forward_shape(std::int64_t cols, std::int64_t vec, std::int64_t per_thread,
                                   std::int64_t max_group) {
  const std::int64_t row_packs = cols / vec;
  std::int64_t group = 32;
  while (group < max_group && group * per_thread < row_packs) group *= 2;
  for (;;) {
    const std::int64_t packs = pow2_at_least((row_packs + group - 1) / group);
    if (packs <= 16 && packs * vec <= max_elements(false)) return Shape{group, 1, vec, packs};
    if (group >= 1024) return std::nullopt;
    group *= 2;
  }
}

std::optional<Params> forward_choice(const Problem& p) {
  const auto q = p.as<LayerNormProblem>();
  const auto esize = std::int64_t(dtype_size(p.dtype));
  const std::int64_t rows = q.rows, cols = q.cols, row_bytes = cols * esize;
  // Access width and packs a thread: 16 bytes and two packs up to layernorm_lean_rows (the row
  // spread over up to 1024 threads); 8 bytes and eight packs from 2048 rows, except f16/bf16 rows
  // of 10-32 KiB under 16384 rows (16 bytes, four packs); 4 bytes and 16 packs in between.
  // "decode": up to layernorm_lean_rows, where kiln tune ranks 16-byte accesses and two packs a
  // thread ahead of the 4-byte ones at 77 and 512 rows of 4096 bf16 on Hopper, and the sweep has
  // them ahead at 1000 rows of 896-4096 but behind at 1000 rows of 5120-8192 (the lean path, no
  // staging, layernorm_fwd_smem).
  const bool decode = rows <= layernorm_lean_rows(row_bytes);
  std::int64_t pack_bytes = decode ? 16 : rows >= 2048 ? 8 : 4;
  if (rows >= 2048 && rows < 16384 && esize == 2 && row_bytes >= 10 * 1024 && row_bytes <= 32 * 1024) pack_bytes = 16;
  const std::int64_t vec = access_width(p, std::max<std::int64_t>(1, pack_bytes / esize), cols,
                                        {q.x_row_stride, q.y_row_stride});
  const std::int64_t per_thread = decode ? 2 : rows >= 2048 ? (vec * esize == 16 ? 4 : 8) : 16;
  auto s = forward_shape(cols, vec, per_thread, decode ? 1024 : 512);
  // Rows too long for that width: the widest access allowed.
  if (!s) s = forward_shape(cols, access_width(p, 16 / esize, cols, {q.x_row_stride, q.y_row_stride}), 16, 1024);
  if (!s) return std::nullopt;
  // Groups under 128 threads share a block (several rows a block, up to 8) while the grid keeps at
  // least two blocks per SM: fewer, larger blocks for the same rows.
  const std::int64_t sms = p.sm_count > 0 ? p.sm_count : 132;
  while (s->group * s->rows < 128 && s->rows < 8 && (rows + 2 * s->rows - 1) / (2 * s->rows) >= 2 * sms) s->rows *= 2;
  return params_of(p.dtype, *s);
}

std::optional<Params> backward_choice(const Problem& p) {
  const auto q = p.as<LayerNormBwdProblem>();
  const auto esize = std::int64_t(dtype_size(p.dtype));
  // As rmsnorm_bwd's register kernel: 16-byte accesses where allowed, the smallest group from 32
  // threads holding the row at two packs a thread (up to 512 threads, then up to four packs).
  const std::int64_t vec =
      access_width(p, 16 / esize, q.cols, {q.dy_row_stride, q.x_row_stride, q.dx_row_stride});
  const std::int64_t row_packs = q.cols / vec;
  std::int64_t group = 32;
  while (group < 512 && 2 * group < row_packs) group *= 2;
  const std::int64_t packs = pow2_at_least((row_packs + group - 1) / group);
  if (packs > 4 || packs * vec > max_elements(true)) return std::nullopt;
  // Rows in flight per block up to 512 threads (never more than the problem's rows): two blocks
  // per SM at the 64-register cap, so one slab's two partial rows per 512 resident threads.
  std::int64_t rows_per_block = 1;
  while (group * rows_per_block < 512 && rows_per_block < 8 && rows_per_block * 2 <= q.rows) rows_per_block *= 2;
  return params_of(p.dtype, {group, rows_per_block, vec, packs});
}

}  // namespace

Result<Params> layernorm_choice(const Problem& p, bool backward) {
  if (auto c = backward ? backward_choice(p) : forward_choice(p)) return *c;
  const auto cols = backward ? p.as<LayerNormBwdProblem>().cols : p.as<LayerNormProblem>().cols;
  const std::int64_t vec_max = 16 / std::int64_t(dtype_size(p.dtype));
  const std::int64_t limit = backward ? 512 * max_elements(true) : 1024 * max_elements(false);
  return invalid_argument(std::string(backward ? "layer_norm_backward" : "layer_norm") + ": rows of " +
                          std::to_string(cols) + " elements are longer than the kernels hold (" +
                          std::to_string(limit) + " with " + std::to_string(vec_max) +
                          "-element accesses, fewer when the row length, row strides or alignment need narrower ones)");
}

std::int64_t layernorm_bwd_slabs(const Params& params, std::int64_t rows, int sms) {
  if (rows <= 0) return 0;
  const auto s = shape_of(params);
  const auto esize = std::int64_t(dtype_size(*parse_dtype(*params.get_str("dtype"))));
  // The kernel's register cap (layernorm.cuh, min_blocks): 1024 resident threads while dy's and
  // x's packs take at most 16 registers, else 512.
  const std::int64_t sm_threads = 2 * cache_regs(s.packs, s.vec * esize) <= 16 ? 1024 : 512;
  const std::int64_t block = s.group * s.rows;
  const std::int64_t resident = std::max<std::int64_t>(1, sm_threads / block);
  return std::min(std::int64_t(std::max(sms, 1)) * resident, (rows + s.rows - 1) / s.rows);
}

std::int64_t layernorm_fwd_smem(const Params& params, const Problem& p) {
  const auto q = p.as<LayerNormProblem>();
  const auto esize = std::int64_t(dtype_size(p.dtype));
  const auto s = shape_of(params);
  // Up to layernorm_lean_rows, blocks of one row whose threads hold at most two packs and 32 bytes
  // of each buffer: no staging, the kernel's lean path (layernorm.cuh) loads the weight and bias
  // beside x.
  if (q.rows <= layernorm_lean_rows(q.cols * esize) && s.rows == 1 && s.packs <= 2 && s.packs * s.vec * esize <= 32)
    return 0;
  const std::int64_t bytes = 2 * q.cols * esize;
  return bytes <= k_max_staged ? bytes : 0;
}

std::int64_t layernorm_bwd_smem(const Params& params) {
  const auto s = shape_of(params);
  return s.group * s.rows * s.packs * s.vec * 8;  // a float2 per element
}

}  // namespace kiln::families

namespace kiln::families {
void register_layernorm_bwd_rows(Registry& r);
}

// LayerNorm's kernel families: the forward, the backward's row pass, and the one-launch backward of
// a few rows.
void kiln_register_family_layernorm(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::LayerNorm>());
  (void)r.add(std::make_shared<kiln::families::LayerNormBwd>());
  kiln::families::register_layernorm_bwd_rows(r);
}
