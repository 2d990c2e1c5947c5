// The example plugin (docs/plugins.md): a LayerNorm forward family in a shared library.
//
//   y = (x - mean(x)) * rsqrt(var(x) + eps) * gamma + beta, row by row (biased variance).
//
// Params: dtype {f32, f16, bf16}, block {128, 256, 1024} threads, vec {1, 2, 4, 8} elements per
// access (vec * sizeof(dtype) <= 16 bytes).
// Problem: dims = {rows, cols} (contiguous rows), scalars = {eps}.
// Buffers: x (input), gamma (input, [cols]), beta (input, [cols]), y (output).
// Heuristic: the widest access the alignment and row length allow, and a block that gives each
// thread about eight packs of a row (128 threads up to 1024 packs, 256 up to 2048, then 1024).
// Template: templates/layernorm/layernorm_fwd.cuh, shipped inside the library.
#include <algorithm>
#include <cmath>

#include "common/half.h"
#include "families/common/family_util.h"  // header-only helpers kiln's families share; plugins may use them
#include "jit/templates.h"  // EmbeddedFile: the table cmake/embed_templates.cmake writes
#include "kiln/plugin_cpp.h"

namespace {

using namespace kiln;

enum LayerNormDim { k_rows = 0, k_cols = 1 };
enum LayerNormScalar { k_eps = 0 };

using families::check_access_width;
using families::device_type;

class LayerNorm final : public Family {
 public:
  std::string_view name() const override { return "layernorm"; }
  int version() const override { return 1; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {128, 256, 1024}, {}, "threads per block (one block per row)"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of x, gamma, beta and y"},
        {"vec", {1, 2, 4, 8}, {}, "elements per memory access"},
    };
    return defs;
  }
  std::vector<std::string> problem_dims() const override { return {"rows", "cols"}; }
  std::vector<std::string> problem_scalars() const override { return {"eps"}; }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    return check_access_width(name(), params);
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"layernorm/layernorm_fwd.cuh\"\n";
    r.name_expression = std::string("kiln_layernorm::layernorm_fwd<") + device_type(*params.get_str("dtype")) + ", " +
                        std::to_string(*params.get_int("block")) + ", " + std::to_string(*params.get_int("vec")) + ">";
    return r;
  }

  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f32", "f16", "bf16"})
      for (std::int64_t block : {128, 256, 1024})
        for (std::int64_t vec : {1, 2, 4, 8}) {
          Params p{{"dtype", std::string(dtype)}, {"block", block}, {"vec", vec}};
          if (validate(p).ok()) out.push_back(p);
        }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto rows = p.dims[k_rows], cols = p.dims[k_cols];
    if (rows < 0 || cols <= 0) return shape_mismatch("layernorm: need rows >= 0 and cols > 0");
    if (cols >= (std::int64_t(1) << 31)) return shape_mismatch("layernorm: rows longer than 2^31 elements");
    if (!std::isfinite(p.scalars[k_eps]) || !(p.scalars[k_eps] >= 0))
      return invalid_argument("layernorm: eps must be finite and non-negative");
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype(std::string("layernorm: kernel is for ") + dtype_name(dtype) + ", tensors are " +
                               dtype_name(p.dtype));
    const auto vec = *params.get_int("vec");
    if (p.alignment < vec * std::int64_t(dtype_size(dtype)) || (rows > 1 && cols % vec))
      return invalid_argument("layernorm: vec=" + std::to_string(vec) +
                              " needs buffers aligned to vec elements and a row length divisible by vec");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::clamp<std::int64_t>(p.dims[k_rows], 1, 0x7fffffff));
    g.block.x = std::uint32_t(*params.get_int("block"));
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto esize = std::int64_t(dtype_size(p.dtype));
    const auto cols = p.dims[k_cols];
    std::int64_t vec = 16 / esize;
    while (vec > 1 && (p.alignment < vec * esize || (p.dims[k_rows] > 1 && cols % vec))) vec /= 2;
    const std::int64_t packs = cols / vec;
    const std::int64_t block = packs <= 1024 ? 128 : packs <= 2048 ? 256 : 1024;
    return Params{{"dtype", std::string(dtype_name(p.dtype))}, {"block", block}, {"vec", vec}};
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    for (const auto& c : catalog())
      if (*c.get_str("dtype") == dtype_name(p.dtype) && check_problem(c, p).ok()) out.push_back(c);
    return out;
  }

  // eps defaults to 1e-5 (torch.nn.LayerNorm's).
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    KILN_ASSIGN_OR_RETURN(Problem p, Family::problem_from_shape(dtype, shape));
    p.scalars[k_eps] = 1e-5;
    return p;
  }

  // Decode and prefill sizes of BERT/ViT-style models, a row length that is not a multiple of any
  // vector width, and one block per SM's worth of rows.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t rows : {1, 77, 4096})
      for (std::int64_t cols : {768, 1023, 4096})
        out.push_back(problem_from_shape(dtype, {{"rows", rows}, {"cols", cols}}).value());
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto rows = p.dims[k_rows], cols = p.dims[k_cols];
    return {{"x", BufferRole::input, p.dtype, rows * cols},
            {"gamma", BufferRole::input, p.dtype, cols},
            {"beta", BufferRole::input, p.dtype, cols},
            {"y", BufferRole::output, p.dtype, rows * cols}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    for (std::size_t i = 0; i < 4; ++i) out.add(i < b.size() ? b[i] : static_cast<void*>(nullptr));
    out.add(static_cast<long long>(p.dims[k_rows]));
    out.add(static_cast<long long>(p.dims[k_cols]));
    out.add(static_cast<float>(p.scalars[k_eps]));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 4) return invalid_argument("layernorm: the reference takes buffers x, gamma, beta and y");
    for (void* ptr : b)
      if (!ptr) return invalid_argument("layernorm: a buffer of the reference is null");
    const auto rows = p.dims[k_rows], cols = p.dims[k_cols];
    for (std::int64_t r = 0; r < rows; ++r) {
      double sum = 0, sq = 0;
      for (std::int64_t c = 0; c < cols; ++c) sum += load_as_double(b[0], p.dtype, r * cols + c);
      const double mean = sum / double(cols);
      for (std::int64_t c = 0; c < cols; ++c) {
        const double d = load_as_double(b[0], p.dtype, r * cols + c) - mean;
        sq += d * d;
      }
      const double rstd = 1.0 / std::sqrt(sq / double(cols) + p.scalars[k_eps]);
      for (std::int64_t c = 0; c < cols; ++c)
        store_from_double(b[3], p.dtype, r * cols + c,
                          (load_as_double(b[0], p.dtype, r * cols + c) - mean) * rstd *
                                  load_as_double(b[1], p.dtype, c) +
                              load_as_double(b[2], p.dtype, c));
    }
    return {};
  }
};

std::vector<plugin_bridge::FamilyExport> layernorm_families() {
  std::vector<std::pair<std::string, std::string>> templates;
  for (const auto& f : jit::embedded_templates()) templates.emplace_back(f.path, std::string(f.bytes));
  return {{std::make_shared<LayerNorm>(), std::move(templates)}};
}

}  // namespace

KILN_PLUGIN("kiln-example-layernorm", "1.0.0", layernorm_families)
