#include "families/act_and_mul/act_and_mul.h"
#include "families/common/family_util.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "common/half.h"

namespace kiln::families {
namespace {

const char* const k_act_names[] = {"silu", "gelu", "gelu_tanh"};

int act_index(const std::string& name) {
  for (int i = 0; i < 3; ++i)
    if (name == k_act_names[i]) return i;
  return -1;
}

// Packs per row, the flat pack count and the division constants for a row of d elements.
void pack_rows(ArgPack& out, std::int64_t rows, std::int64_t d, std::int64_t vec) {
  const std::int64_t per_row = d / vec;
  const FastDiv div = fast_div(std::uint32_t(std::max<std::int64_t>(per_row, 1)));
  out.add(static_cast<long long>(rows * per_row));
  out.add(static_cast<long long>(per_row));
  out.add(static_cast<unsigned>(div.magic));
  out.add(static_cast<unsigned>(div.shift));
}

LaunchGeometry flat_grid(const Params& params, std::int64_t rows, std::int64_t d) {
  const std::int64_t block = *params.get_int("block");
  const std::int64_t packs = rows * (d / *params.get_int("vec"));
  LaunchGeometry g;
  g.grid.x = std::uint32_t(std::clamp<std::int64_t>((packs + block - 1) / block, 1, 0x7fffffff));
  g.block.x = std::uint32_t(block);
  return g;
}

// The name expression of kernel `kernel` (act_and_mul.cuh or act_and_mul_bwd.cuh) for params.
Rendered render_act(const Params& params, const char* header, const char* kernel) {
  Rendered r;
  r.source = std::string("#include \"act_and_mul/") + header + "\"\n";
  r.name_expression = std::string("kiln::") + kernel + "<" + device_type(*params.get_str("dtype")) + ", " +
                      std::to_string(act_index(*params.get_str("act"))) + ", " +
                      std::to_string(*params.get_int("block")) + ", " + std::to_string(*params.get_int("vec")) + ">";
  return r;
}

// Every activation, dtype, block and access width that validates.
std::vector<Params> act_catalog(const Family& f, std::initializer_list<std::int64_t> blocks) {
  std::vector<Params> out;
  for (const char* act : k_act_names)
    for (const char* dtype : {"f32", "f16", "bf16"})
      for (std::int64_t block : blocks)
        for (std::int64_t vec : {1, 2, 4, 8}) {
          Params p{{"act", std::string(act)}, {"dtype", std::string(dtype)}, {"block", block}, {"vec", vec}};
          if (f.validate(p).ok()) out.push_back(p);
        }
  return out;
}

// The heuristic's variant: 128-thread blocks and the widest access up to 8 bytes that the
// alignment and every size in `multiples` (d and the row strides, in elements) allow. For the
// forward, 8-byte accesses and 128-thread blocks are at or near the best for SiLU and GELU at large
// shapes on Hopper (bench section `variants`); 16-byte accesses are slower with GELU (erf)
// computed with erff, and tie with the fitted form of families/act_and_mul/activations.cuh.
// docs/benchmarks.md has the figures.
Params act_heuristic(const Problem& p, std::int64_t activation, std::initializer_list<std::int64_t> multiples) {
  const int esize = int(dtype_size(p.dtype));
  int vec = std::max(1, 8 / esize);
  auto fits = [&](int v) {
    if (p.alignment < std::uint32_t(v * esize)) return false;
    for (std::int64_t m : multiples)
      if (m % v) return false;
    return true;
  };
  while (vec > 1 && !fits(vec)) vec /= 2;
  return Params{{"act", std::string(k_act_names[std::clamp<std::int64_t>(activation, 0, 2)])},
                {"dtype", std::string(dtype_name(p.dtype))},
                {"block", std::int64_t(128)},
                {"vec", std::int64_t(vec)}};
}

// The d a shape names, or -1.
std::int64_t shape_d(const std::vector<std::pair<std::string, std::int64_t>>& shape) {
  return shape_value(shape, "d").value_or(-1);
}

// The checks both directions share: the variant's activation and dtype against the problem's.
Status check_act_and_dtype(std::string_view family, const Params& params, const Problem& p, std::int64_t act) {
  if (act < 0 || act > 2) return invalid_argument(std::string(family) + ": unknown activation " + std::to_string(act));
  if (act_index(*params.get_str("act")) != act)
    return invalid_argument(std::string(family) + ": kernel is for " + *params.get_str("act") + ", problem asks for " +
                            k_act_names[act]);
  auto dtype = parse_dtype(*params.get_str("dtype"));
  if (*dtype != p.dtype)
    return unsupported_dtype(std::string(family) + ": kernel is for " + dtype_name(*dtype) + ", tensors are " +
                             dtype_name(p.dtype));
  return {};
}

class ActAndMul final : public Family {
 public:
  std::string_view name() const override { return "act_and_mul"; }
  int version() const override { return 2; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"act", {}, {"silu", "gelu", "gelu_tanh"}, "activation applied to the first half"},
        {"block", {64, 128, 256, 512, 1024}, {}, "threads per block (flat grid, one pack per thread)"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of x and out"},
        {"vec", {1, 2, 4, 8}, {}, "elements per memory access"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<ActAndMulProblem>({
        bucketed(&ActAndMulProblem::rows, "rows", "rows of x and out"),
        key(&ActAndMulProblem::d, "d", "elements per row of out; x rows hold 2d"),
        key(&ActAndMulProblem::x_row_stride, "x_row_stride", "elements between two rows of x"),
        key(&ActAndMulProblem::out_row_stride, "out_row_stride", "elements between two rows of out"),
        key(&ActAndMulProblem::activation, "activation", "0 silu, 1 gelu (erf), 2 gelu_tanh")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    KILN_TRY(check_access_width(name(), params));
    return {};
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    return render_act(params, "act_and_mul.cuh", "act_and_mul");
  }

  std::vector<Params> catalog() const override { return act_catalog(*this, {64, 128, 256, 512, 1024}); }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<ActAndMulProblem>();
    const auto rows = q.rows, d = q.d;
    if (rows < 0 || d <= 0) return shape_mismatch("act_and_mul: need rows >= 0 and d > 0");
    if (d >= (std::int64_t(1) << 31)) return shape_mismatch("act_and_mul: d must be below 2^31");
    if (q.x_row_stride < 2 * d || q.out_row_stride < d)
      return shape_mismatch("act_and_mul: row strides must be at least 2d (x) and d (out)");
    KILN_TRY(check_act_and_dtype(name(), params, p, q.activation));
    const auto vec = *params.get_int("vec");
    if (p.alignment < vec * std::int64_t(dtype_size(p.dtype)) || d % vec || q.x_row_stride % vec ||
        q.out_row_stride % vec)
      return invalid_argument("act_and_mul: vec=" + std::to_string(vec) +
                              " needs buffers, d and row strides aligned to vec elements");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto q = p.as<ActAndMulProblem>();
    return flat_grid(params, q.rows, q.d);
  }

  Params heuristic(const Problem& p) const override {
    const auto q = p.as<ActAndMulProblem>();
    return act_heuristic(p, q.activation, {q.d, q.x_row_stride, q.out_row_stride});
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    for (const auto& c : catalog())
      if (check_problem(c, p).ok()) out.push_back(c);
    return out;
  }

  // Row strides default to contiguous rows (2d for x, d for out), the activation to silu.
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    const std::int64_t d = shape_d(shape);
    std::vector<std::pair<std::string, std::int64_t>> defaults = {{"activation", k_am_silu}};
    if (d >= 0) defaults.insert(defaults.end(), {{"x_row_stride", 2 * d}, {"out_row_stride", d}});
    return Family::problem_from_shape(dtype, with_defaults(shape, defaults));
  }

  // Tokens x d (the output width), contiguous, silu.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t rows : {1, 16, 512, 4096, 32768})
      for (std::int64_t d : {2048, 4096, 5120, 8192, 16384, 65536})
        out.push_back(problem_from_shape(dtype, {{"rows", rows}, {"d", d}}).value());
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<ActAndMulProblem>();
    const auto rows = q.rows, d = q.d;
    auto extent = [&](std::int64_t stride, std::int64_t cols) { return rows == 0 ? 0 : (rows - 1) * stride + cols; };
    return {{"x", BufferRole::input, p.dtype, extent(q.x_row_stride, 2 * d)},
            {"out", BufferRole::output, p.dtype, extent(q.out_row_stride, d)}};
  }

  void pack_args(const Params& params, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<ActAndMulProblem>();
    out.add(b[0]);
    out.add(b[1]);
    pack_rows(out, q.rows, q.d, *params.get_int("vec"));
    out.add(static_cast<long long>(q.d));
    out.add(static_cast<long long>(q.x_row_stride));
    out.add(static_cast<long long>(q.out_row_stride));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 2) return invalid_argument("act_and_mul: reference takes 2 buffers (x, out)");
    const auto q = p.as<ActAndMulProblem>();
    const auto act = q.activation;
    if (act < 0 || act > 2) return invalid_argument("act_and_mul: unknown activation " + std::to_string(act));
    const auto rows = q.rows, d = q.d;
    // Element c of a row reads x[c] and x[d + c] before writing out[c]; with out = x[..., :d] no
    // later element reads what an earlier one wrote.
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t xo = r * q.x_row_stride, oo = r * q.out_row_stride;
      for (std::int64_t c = 0; c < d; ++c) {
        const double a = load_as_double(b[0], p.dtype, xo + c), g = load_as_double(b[0], p.dtype, xo + d + c);
        store_from_double(b[1], p.dtype, oo + c, act_and_mul_activate(int(act), a) * g);
      }
    }
    return {};
  }
};

class ActAndMulBwd final : public Family {
 public:
  std::string_view name() const override { return "act_and_mul_bwd"; }
  int version() const override { return 1; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"act", {}, {"silu", "gelu", "gelu_tanh"}, "activation applied to the first half"},
        {"block", {128, 256, 512}, {}, "threads per block (flat grid, one pack of each half per thread)"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of x, dy and dx"},
        {"vec", {1, 2, 4, 8}, {}, "elements per memory access"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<ActAndMulBwdProblem>({
        bucketed(&ActAndMulBwdProblem::rows, "rows", "rows of x, dy and dx"),
        key(&ActAndMulBwdProblem::d, "d", "elements per row of dy; x and dx rows hold 2d"),
        key(&ActAndMulBwdProblem::x_row_stride, "x_row_stride", "elements between two rows of x"),
        key(&ActAndMulBwdProblem::dy_row_stride, "dy_row_stride", "elements between two rows of dy"),
        key(&ActAndMulBwdProblem::dx_row_stride, "dx_row_stride", "elements between two rows of dx"),
        key(&ActAndMulBwdProblem::activation, "activation", "0 silu, 1 gelu (erf), 2 gelu_tanh")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    KILN_TRY(check_access_width(name(), params));
    return {};
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    return render_act(params, "act_and_mul_bwd.cuh", "act_and_mul_bwd");
  }

  std::vector<Params> catalog() const override { return act_catalog(*this, {128, 256, 512}); }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<ActAndMulBwdProblem>();
    const auto rows = q.rows, d = q.d;
    if (rows < 0 || d <= 0) return shape_mismatch("act_and_mul_bwd: need rows >= 0 and d > 0");
    if (d >= (std::int64_t(1) << 31)) return shape_mismatch("act_and_mul_bwd: d must be below 2^31");
    if (q.x_row_stride < 2 * d || q.dy_row_stride < d || q.dx_row_stride < 2 * d)
      return shape_mismatch("act_and_mul_bwd: row strides must be at least 2d (x, dx) and d (dy)");
    KILN_TRY(check_act_and_dtype(name(), params, p, q.activation));
    const auto vec = *params.get_int("vec");
    if (p.alignment < vec * std::int64_t(dtype_size(p.dtype)) || d % vec || q.x_row_stride % vec ||
        q.dy_row_stride % vec || q.dx_row_stride % vec)
      return invalid_argument("act_and_mul_bwd: vec=" + std::to_string(vec) +
                              " needs buffers, d and row strides aligned to vec elements");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto q = p.as<ActAndMulBwdProblem>();
    return flat_grid(params, q.rows, q.d);
  }

  // Three streams (x and dy read, dx written) against the forward's two: the forward's choice,
  // until the variants section times the backward on a GPU.
  Params heuristic(const Problem& p) const override {
    const auto q = p.as<ActAndMulBwdProblem>();
    return act_heuristic(p, q.activation, {q.d, q.x_row_stride, q.dy_row_stride, q.dx_row_stride});
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    for (const auto& c : catalog())
      if (check_problem(c, p).ok()) out.push_back(c);
    return out;
  }

  // Row strides default to contiguous rows (2d for x and dx, d for dy), the activation to silu.
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    const std::int64_t d = shape_d(shape);
    std::vector<std::pair<std::string, std::int64_t>> defaults = {{"activation", k_am_silu}};
    if (d >= 0) defaults.insert(defaults.end(), {{"x_row_stride", 2 * d}, {"dy_row_stride", d}, {"dx_row_stride", 2 * d}});
    return Family::problem_from_shape(dtype, with_defaults(shape, defaults));
  }

  // Tokens x d (dy's width), contiguous, every activation at the MLP widths of common models.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t act : {k_am_silu, k_am_gelu, k_am_gelu_tanh})
      for (std::int64_t rows : {1, 77, 4096})
        for (std::int64_t d : {4096, 11008, 14336})
          out.push_back(problem_from_shape(dtype, {{"rows", rows}, {"d", d}, {"activation", act}}).value());
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<ActAndMulBwdProblem>();
    const auto rows = q.rows, d = q.d;
    auto extent = [&](std::int64_t stride, std::int64_t cols) { return rows == 0 ? 0 : (rows - 1) * stride + cols; };
    return {{"x", BufferRole::input, p.dtype, extent(q.x_row_stride, 2 * d)},
            {"dy", BufferRole::input, p.dtype, extent(q.dy_row_stride, d)},
            {"dx", BufferRole::output, p.dtype, extent(q.dx_row_stride, 2 * d)}};
  }

  void pack_args(const Params& params, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<ActAndMulBwdProblem>();
    out.add(b[0]);
    out.add(b[1]);
    out.add(b[2]);
    pack_rows(out, q.rows, q.d, *params.get_int("vec"));
    out.add(static_cast<long long>(q.d));
    out.add(static_cast<long long>(q.x_row_stride));
    out.add(static_cast<long long>(q.dy_row_stride));
    out.add(static_cast<long long>(q.dx_row_stride));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 3) return invalid_argument("act_and_mul_bwd: reference takes 3 buffers (x, dy, dx)");
    const auto q = p.as<ActAndMulBwdProblem>();
    const auto act = q.activation;
    if (act < 0 || act > 2) return invalid_argument("act_and_mul_bwd: unknown activation " + std::to_string(act));
    // Element c of a row reads x[c], x[d + c] and dy[c] before writing dx[c] and dx[d + c]; with
    // dx = x no later element reads what an earlier one wrote.
    for (std::int64_t r = 0; r < q.rows; ++r) {
      const std::int64_t xo = r * q.x_row_stride, yo = r * q.dy_row_stride, xo_out = r * q.dx_row_stride;
      for (std::int64_t c = 0; c < q.d; ++c) {
        const double g = load_as_double(b[0], p.dtype, xo + c), u = load_as_double(b[0], p.dtype, xo + q.d + c);
        const double dy = load_as_double(b[1], p.dtype, yo + c);
        store_from_double(b[2], p.dtype, xo_out + c, dy * u * act_and_mul_derivative(int(act), g));
        store_from_double(b[2], p.dtype, xo_out + q.d + c, dy * act_and_mul_activate(int(act), g));
      }
    }
    return {};
  }
};

}  // namespace

FastDiv fast_div(std::uint32_t d) {
  std::uint32_t shift = 0;
  while (shift < 32 && (std::uint64_t(1) << shift) < d) ++shift;
  const std::uint64_t magic = ((std::uint64_t(1) << 32) * ((std::uint64_t(1) << shift) - d)) / d + 1;
  return {std::uint32_t(magic), shift};
}

// In forms that do not cancel for negative v (1 + erf and 1 + tanh lose every digit in double
// below about v = -8 and -7.5, and gave 0 where the f32 kernels give the true tiny value):
// 0.5 v erfc(-v / sqrt(2)) and v / (1 + exp(-2u)), equal to the textbook formulas.
double act_and_mul_activate(int act, double v) {
  switch (act) {
    case k_am_silu: return v / (1.0 + std::exp(-v));
    case k_am_gelu: return 0.5 * v * std::erfc(-v / std::sqrt(2.0));
    default: return v / (1.0 + std::exp(-2.0 * std::sqrt(2.0 / std::numbers::pi) * (v + 0.044715 * v * v * v)));
  }
}

// The derivatives from the same non-cancelling pieces (activations.cuh says how each is built).
double act_and_mul_derivative(int act, double v) {
  switch (act) {
    case k_am_silu: {
      const double s = 1.0 / (1.0 + std::exp(-v));
      return s * (1.0 + v * (1.0 - s));
    }
    case k_am_gelu:
      return 0.5 * std::erfc(-v / std::sqrt(2.0)) + v * std::exp(-0.5 * v * v) / std::sqrt(2.0 * std::numbers::pi);
    default: {
      const double k = std::sqrt(2.0 / std::numbers::pi);
      const double s = 1.0 / (1.0 + std::exp(-2.0 * k * (v + 0.044715 * v * v * v)));
      return s + v * 2.0 * s * (1.0 - s) * k * (1.0 + 3.0 * 0.044715 * v * v);
    }
  }
}

ActAndMulChoice act_and_mul_heuristic(const Problem& p) {
  const auto q = p.as<ActAndMulProblem>();
  const Params h = act_heuristic(p, q.activation, {q.d, q.x_row_stride, q.out_row_stride});
  return {int(*h.get_int("block")), int(*h.get_int("vec"))};
}

}  // namespace kiln::families

void kiln_register_family_act_and_mul(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::ActAndMul>());
  (void)r.add(std::make_shared<kiln::families::ActAndMulBwd>());
}
