#include "families/layernorm/layernorm.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "common/half.h"
#include "families/common/family_util.h"

namespace kiln::families {
namespace {

// Packs per thread either kernel may hold: the forward keeps a row's values, the backward four
// values per element (x-hat, dy and the two slab sums), within the registers a block size leaves.
std::int64_t max_elements(bool backward, std::int64_t block) {
  if (!backward) return 32;
  return block >= 512 ? 16 : 32;
}

Status check_variant(std::string_view family, const Params& params, bool backward) {
  KILN_TRY(check_access_width(family, params));
  const auto packs = *params.get_int("packs"), vec = *params.get_int("vec"), block = *params.get_int("block");
  if (packs * vec > max_elements(backward, block))
    return invalid_argument(std::string(family) + ": packs * vec must be at most " +
                            std::to_string(max_elements(backward, block)) + " for block=" + std::to_string(block));
  return {};
}

// What both kernels check of a problem of `rows` rows of `cols` elements at the given row strides
// for a variant: sizes, dtype, alignment and row length.
Status check_rows(std::string_view family, const Params& params, const Problem& p, std::int64_t rows,
                  std::int64_t cols, std::initializer_list<std::int64_t> strides) {
  const std::string f(family);
  if (rows < 0 || cols <= 0) return shape_mismatch(f + ": need rows >= 0 and cols > 0");
  for (std::int64_t s : strides)
    if (s < cols) return shape_mismatch(f + ": row strides must be at least the row length");
  const auto dtype = *parse_dtype(*params.get_str("dtype"));
  if (dtype != p.dtype)
    return unsupported_dtype(f + ": kernel is for " + dtype_name(dtype) + ", tensors are " + dtype_name(p.dtype));
  const auto vec = *params.get_int("vec"), block = *params.get_int("block"), packs = *params.get_int("packs");
  bool strides_ok = true;
  for (std::int64_t s : strides) strides_ok = strides_ok && s % vec == 0;
  if (p.alignment < vec * std::int64_t(dtype_size(dtype)) || cols % vec || !strides_ok)
    return invalid_argument(f + ": vec=" + std::to_string(vec) +
                            " needs buffers aligned to vec elements and a row length and row strides divisible by vec");
  if (cols > block * packs * vec)
    return invalid_argument(f + ": block=" + std::to_string(block) + ", packs=" + std::to_string(packs) +
                            ", vec=" + std::to_string(vec) + " holds rows of at most " +
                            std::to_string(block * packs * vec) + " elements, not " + std::to_string(cols));
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
  return std::string("kiln::layernorm::") + kernel + "<" + device_type(*params.get_str("dtype")) + ", " +
         std::to_string(*params.get_int("block")) + ", " + std::to_string(*params.get_int("vec")) + ", " +
         std::to_string(*params.get_int("packs")) + ">";
}

// The catalog: the heuristic's 8-byte accesses and 1-element ones (odd row lengths), every block
// and packs count.
std::vector<Params> variants(const Family& f, std::initializer_list<std::int64_t> blocks,
                             std::initializer_list<std::int64_t> packs_list) {
  std::vector<Params> out;
  for (const char* dtype : {"f32", "f16", "bf16"})
    for (std::int64_t vec : {std::int64_t(1), std::max<std::int64_t>(8 / std::int64_t(dtype_size(*parse_dtype(dtype))), 2)})
      for (std::int64_t block : blocks)
        for (std::int64_t packs : packs_list) {
          Params p{{"dtype", std::string(dtype)}, {"block", block}, {"vec", vec}, {"packs", packs}};
          if (f.validate(p).ok()) out.push_back(p);
        }
  return out;
}

std::vector<Params> tuning_candidates(const Family& f, const Problem& p) {
  std::vector<Params> out;
  for (const char* dtype : {"f32", "f16", "bf16"}) {
    if (dtype != std::string(dtype_name(p.dtype))) continue;
    for (std::int64_t vec : {1, 2, 4, 8})
      for (std::int64_t block : {128, 256, 512, 1024})
        for (std::int64_t packs : {1, 2, 4, 8}) {
          Params c{{"dtype", std::string(dtype)}, {"block", block}, {"vec", vec}, {"packs", packs}};
          if (f.validate(c).ok() && f.check_problem(c, p).ok()) out.push_back(c);
        }
  }
  return out;
}

std::vector<Problem> shapes(const Family& f, DType dtype, bool backward) {
  std::vector<Problem> out;
  // BERT/ViT and Llama-style widths, a row length that is no multiple of a vector width, decode
  // and prefill row counts.
  for (std::int64_t rows : {1, 77, 4096})
    for (std::int64_t cols : {768, 1023, 4096, 8192}) {
      std::vector<std::pair<std::string, std::int64_t>> s = {{"rows", rows}, {"cols", cols}};
      if (backward) s.emplace_back("slabs", layernorm_bwd_slabs(rows, 132));
      out.push_back(f.problem_from_shape(dtype, s).value());
    }
  return out;
}

class LayerNorm final : public Family {
 public:
  std::string_view name() const override { return "layernorm"; }
  int version() const override { return 2; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {128, 256, 512, 1024}, {}, "threads per block (one block per row)"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of x, weight, bias and y"},
        {"packs", {1, 2, 4, 8}, {}, "packs of vec elements each thread holds in registers"},
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

  std::vector<Params> catalog() const override { return variants(*this, {128, 256, 512, 1024}, {1, 2, 4, 8}); }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<LayerNormProblem>();
    KILN_TRY(check_rows(name(), params, p, q.rows, q.cols, {q.x_row_stride, q.y_row_stride}));
    if (!std::isfinite(q.eps) || !(q.eps >= 0))
      return invalid_argument("layernorm: eps must be finite and non-negative");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::clamp<std::int64_t>(p.as<LayerNormProblem>().rows, 1, 0x7fffffff));
    g.block.x = std::uint32_t(*params.get_int("block"));
    return g;
  }

  Params heuristic(const Problem& p) const override {
    auto c = layernorm_choice(p, false);
    return c.ok() ? *c : Params{{"dtype", std::string(dtype_name(p.dtype))}, {"block", 1024}, {"vec", 1}, {"packs", 8}};
  }
  std::vector<Params> tuning_space(const Problem& p) const override { return tuning_candidates(*this, p); }

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
  int version() const override { return 2; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {128, 256, 512}, {}, "threads per block (one block per slab of rows)"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of dy, x, weight and dx"},
        {"packs", {1, 2, 4}, {}, "packs of vec elements each thread holds in registers"},
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
        key(&LayerNormBwdProblem::slabs, "slabs", "blocks, each summing the gradients of consecutive rows")});
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

  std::vector<Params> catalog() const override { return variants(*this, {128, 256, 512}, {1, 2, 4}); }

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
    g.block.x = std::uint32_t(*params.get_int("block"));
    return g;
  }

  Params heuristic(const Problem& p) const override {
    auto c = layernorm_choice(p, true);
    return c.ok() ? *c : Params{{"dtype", std::string(dtype_name(p.dtype))}, {"block", 512}, {"vec", 1}, {"packs", 4}};
  }
  std::vector<Params> tuning_space(const Problem& p) const override { return tuning_candidates(*this, p); }

  // Row strides default to the row length, slabs to the op's choice for a 132-SM GPU.
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    auto named = with_strides(shape, {"dy_row_stride", "x_row_stride", "dx_row_stride"});
    const bool has_slabs = std::any_of(shape.begin(), shape.end(), [](const auto& s) { return s.first == "slabs"; });
    if (!has_slabs) {
      std::int64_t rows = 0;
      for (const auto& [n, v] : shape)
        if (n == "rows") rows = v;
      named.emplace_back("slabs", layernorm_bwd_slabs(rows, 132));
    }
    return Family::problem_from_shape(dtype, named);
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
    const auto rows = q.rows, slabs = std::max<std::int64_t>(q.slabs, 1);
    for (std::int64_t v : {rows, q.cols, q.dy_row_stride, q.x_row_stride, q.dx_row_stride, (rows + slabs - 1) / slabs})
      out.add(static_cast<long long>(v));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 7)
      return invalid_argument("layernorm_bwd: the reference takes dy, x, weight, mean, rstd, dx and partial");
    for (void* ptr : b)
      if (!ptr) return invalid_argument("layernorm_bwd: a buffer of the reference is null");
    const auto q = p.as<LayerNormBwdProblem>();
    const auto rows = q.rows, cols = q.cols, slabs = std::max<std::int64_t>(q.slabs, 1);
    const std::int64_t per_slab = (rows + slabs - 1) / slabs;
    auto* partial = static_cast<float*>(b[6]);
    std::vector<double> acc_w(static_cast<std::size_t>(cols)), acc_b(static_cast<std::size_t>(cols));
    for (std::int64_t s = 0; s < slabs; ++s) {
      std::fill(acc_w.begin(), acc_w.end(), 0.0);
      std::fill(acc_b.begin(), acc_b.end(), 0.0);
      for (std::int64_t r = s * per_slab; r < std::min(rows, (s + 1) * per_slab); ++r) {
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

// The row length of either kernel's problem.
std::int64_t cols_of(const Problem& p, bool backward) {
  return backward ? p.as<LayerNormBwdProblem>().cols : p.as<LayerNormProblem>().cols;
}

// The heuristic's variant for accesses of up to `widest` elements (narrowed until the alignment,
// the row length and the row strides allow them); none when its threads cannot hold the row.
std::optional<Params> choose(const Problem& p, bool backward, std::int64_t widest) {
  const auto esize = std::int64_t(dtype_size(p.dtype));
  const auto cols = cols_of(p, backward);
  std::vector<std::int64_t> strides;
  if (backward) {
    const auto q = p.as<LayerNormBwdProblem>();
    strides = {q.dy_row_stride, q.x_row_stride, q.dx_row_stride};
  } else {
    const auto q = p.as<LayerNormProblem>();
    strides = {q.x_row_stride, q.y_row_stride};
  }
  auto strides_allow = [&](std::int64_t v) {
    return std::all_of(strides.begin(), strides.end(), [&](std::int64_t s) { return s % v == 0; });
  };
  std::int64_t vec = widest;
  while (vec > 1 && (p.alignment < vec * esize || cols % vec || !strides_allow(vec))) vec /= 2;
  const std::int64_t packs_total = (cols + vec - 1) / vec;
  const auto make = [&](std::int64_t block, std::int64_t packs) {
    return Params{{"dtype", std::string(dtype_name(p.dtype))}, {"block", block}, {"vec", vec}, {"packs", packs}};
  };
  if (backward) {
    // The backward is latency-bound (two reductions a row, rows one after another in a slab):
    // as many threads as the row has packs, up to 512, then more packs per thread.
    std::int64_t block = 128;
    while (block < 512 && block < packs_total) block *= 2;
    std::int64_t packs = 1;
    while (packs * block < packs_total) packs *= 2;
    if (packs <= 4 && packs * vec <= max_elements(true, block)) return make(block, packs);
    return std::nullopt;
  }
  // The forward keeps a row in registers: the most packs a thread may hold, and as few threads as
  // that needs (at least 128).
  std::int64_t packs = 8;
  while (packs > 1 && packs * vec > max_elements(false, 1024)) packs /= 2;
  std::int64_t block = 128;
  while (block < 1024 && block * packs < packs_total) block *= 2;
  while (packs > 1 && block * (packs / 2) >= packs_total) packs /= 2;
  if (block * packs >= packs_total) return make(block, packs);
  return std::nullopt;
}

}  // namespace

Result<Params> layernorm_choice(const Problem& p, bool backward) {
  // 8-byte accesses first (at least two elements), 16-byte ones for rows too long for them.
  const auto esize = std::int64_t(dtype_size(p.dtype));
  for (std::int64_t widest : {std::max<std::int64_t>(8 / esize, 2), 16 / esize})
    if (auto c = choose(p, backward, widest)) return *c;
  const std::int64_t vec_max = 16 / esize, limit = backward ? 512 * 16 : 1024 * 32;
  return invalid_argument(std::string(backward ? "layer_norm_backward" : "layer_norm") + ": rows of " +
                          std::to_string(cols_of(p, backward)) + " elements are longer than the kernels hold (" +
                          std::to_string(limit) + " with " + std::to_string(vec_max) +
                          "-element accesses, fewer when the row length or alignment needs narrower ones)");
}

std::int64_t layernorm_bwd_slabs(std::int64_t rows, int sms) {
  // Four blocks per SM: enough rows in flight, and partial sums a small fraction of the traffic.
  return std::clamp<std::int64_t>(std::int64_t(4) * std::max(sms, 1), 1, std::max<std::int64_t>(rows, 1));
}

}  // namespace kiln::families

void kiln_register_family_layernorm(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::LayerNorm>());
  (void)r.add(std::make_shared<kiln::families::LayerNormBwd>());
}
