#include "families/gemm/fp8_gemm.h"

#include <vector>

#include "common/fp8.h"
#include "common/half.h"
#include "families/common/family_util.h"
#include "families/common/gemm/gemm_util.h"

namespace kiln::families {
namespace {

namespace g = gemm;

g::Kind kind_of(const Params& p) { return *p.get_str("scaling") == "block" ? g::k_fp8_block : g::k_fp8_tensor; }

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

class Fp8Gemm final : public g::GemmFamily {
 public:
  std::string_view name() const override { return "fp8_gemm"; }
  int version() const override { return 3; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = [] {
      auto d = g::tile_params();
      d.push_back({"out", {}, {"f16", "bf16"}, "output element type"});
      d.push_back({"scaling", {}, {"tensor", "block"}, "per-tensor scales, or 1x128 (a) / 128x128 (b) block scales"});
      return d;
    }();
    return defs;
  }
  g::Kind kind(const Params& params) const override { return kind_of(params); }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields =
        g::problem_fields("scaling: 0 per tensor, 1 block-wise (1x128 for a, 128x128 for b)");
    return fields;
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    const g::Tile t = g::tile_of(params);
    Rendered r;
    r.source = t.wgmma ? "#include \"common/gemm/gemm_wgmma.cuh\"\n" : "#include \"common/gemm/gemm_mma.cuh\"\n";
    r.name_expression = g::name_expression(kind_of(params), "kiln::gemm::u8", device_type(*params.get_str("out")), 0, t);
    return r;
  }

  static Params make(const g::Tile& t, const std::string& out, const std::string& scaling) {
    return g::with_tile(Params{{"out", out}, {"scaling", scaling}}, t);
  }

  // Every tile the heuristic can pick (gemm::default_tiles), for both outputs and scalings.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* o : {"f16", "bf16"})
      for (const char* s : {"tensor", "block"})
        for (const g::Tile& t : g::default_tiles(std::string(s) == "block" ? g::k_fp8_block : g::k_fp8_tensor))
          out.push_back(make(t, o, s));
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto mode = p.as<g::GemmProblem>().mode;
    if (mode != k_fp8_per_tensor && mode != k_fp8_blockwise)
      return invalid_argument("fp8_gemm: unknown scaling mode " + std::to_string(mode));
    if ((mode == k_fp8_blockwise) != (kind_of(params) == g::k_fp8_block))
      return invalid_argument(std::string("fp8_gemm: kernel is for ") + *params.get_str("scaling") +
                              " scaling, the problem asks for " + (mode ? "block" : "tensor"));
    const DType out = *parse_dtype(*params.get_str("out"));
    if (out != p.dtype)
      return unsupported_dtype(std::string("fp8_gemm: kernel writes ") + dtype_name(out) + ", out is " +
                               dtype_name(p.dtype));
    return g::check_shape(name(), kind_of(params), DType::u8, g::tile_of(params), p);
  }

  Params heuristic(const Problem& p) const override {
    const bool block = p.as<g::GemmProblem>().mode == k_fp8_blockwise;
    const g::Tile t = g::default_tile(block ? g::k_fp8_block : g::k_fp8_tensor, p);
    return make(t, p.dtype == DType::f16 ? "f16" : "bf16", block ? "block" : "tensor");
  }

  // 8192^3 and the LLM shapes (M in {128, 4096}, NxK in {7168x16384, 4096x7168, 2112x7168}).
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    if (dtype != DType::f16 && dtype != DType::bf16) return out;  // the problem's dtype is the output's
    for (std::int64_t mode : {k_fp8_per_tensor, k_fp8_blockwise}) {
      out.push_back(problem_from_shape(dtype, {{"m", 8192}, {"n", 8192}, {"k", 8192}, {"mode", mode}}).value());
      for (std::int64_t m : {128, 4096})
        for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{7168, 16384}, {4096, 7168}, {2112, 7168}})
          out.push_back(problem_from_shape(dtype, {{"m", m}, {"n", n}, {"k", k}, {"mode", mode}}).value());
    }
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto [m, n, k, mode] = p.as<g::GemmProblem>();
    const bool block = mode == k_fp8_blockwise;
    const auto kb = ceil_div(k, 128);
    return {{"a", BufferRole::input, DType::u8, m * k},
            {"b", BufferRole::input, DType::u8, n * k},
            {"a_scale", BufferRole::input, DType::f32, block ? m * kb : 1},
            {"b_scale", BufferRole::input, DType::f32, block ? ceil_div(n, 128) * kb : 1},
            {"out", BufferRole::output, p.dtype, m * n}};
  }

  void pack_args(const Params& params, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    g::pack(g::tile_of(params), p, 1, b[0], b[1], nullptr, b[2], b[3], b[4], out);
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 5) return invalid_argument("fp8_gemm: reference takes 5 buffers (a, b, a_scale, b_scale, out)");
    const auto [m, n, k, mode] = p.as<g::GemmProblem>();
    const bool block = mode == k_fp8_blockwise;
    const auto kb = ceil_div(k, 128);
    const auto* a = static_cast<const std::uint8_t*>(b[0]);
    const auto* w = static_cast<const std::uint8_t*>(b[1]);
    const auto* sa = static_cast<const float*>(b[2]);
    const auto* sb = static_cast<const float*>(b[3]);
    float lut[256];
    for (int i = 0; i < 256; ++i) lut[i] = e4m3_to_float(std::uint8_t(i));
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double total = 0;
        for (std::int64_t q = 0; q < kb; ++q) {
          double part = 0;
          for (std::int64_t x = q * 128; x < std::min(k, (q + 1) * 128); ++x)
            part += double(lut[a[i * k + x]]) * double(lut[w[j * k + x]]);
          total += block ? part * double(sa[i * kb + q]) * double(sb[(j / 128) * kb + q]) : part;
        }
        if (!block) total *= double(sa[0]) * double(sb[0]);
        store_from_double(b[4], p.dtype, i * n + j, total);
      }
    return {};
  }
};

}  // namespace
}  // namespace kiln::families

void kiln_register_kernels_fp8_gemm(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::Fp8Gemm>());
}
