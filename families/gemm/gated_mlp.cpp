#include "families/gemm/gated_mlp.h"

#include <cmath>
#include <vector>

#include "common/half.h"
#include "families/common/family_util.h"
#include "families/common/gemm/gemm_util.h"

namespace kiln::families {
namespace {

namespace g = gemm;

int act_of(const Params& p) { return *p.get_str("act") == "gelu" ? k_gated_gelu : k_gated_silu; }

class GatedMlp final : public g::GemmFamily {
 public:
  std::string_view name() const override { return "gated_mlp"; }
  int version() const override { return 3; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = [] {
      auto d = g::tile_params();
      d.push_back({"dtype", {}, {"f16", "bf16"}, "element type of x, the weights and out"});
      d.push_back({"act", {}, {"silu", "gelu"}, "activation of the gate projection"});
      return d;
    }();
    return defs;
  }
  g::Kind kind(const Params&) const override { return g::k_gated; }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = g::problem_fields("activation of the gate: 0 silu, 1 gelu");
    return fields;
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    const g::Tile t = g::tile_of(params);
    const std::string type = device_type(*params.get_str("dtype"));
    Rendered r;
    r.source = t.wgmma ? "#include \"common/gemm/gemm_wgmma.cuh\"\n" : "#include \"common/gemm/gemm_mma.cuh\"\n";
    r.name_expression = g::name_expression(g::k_gated, type, type, act_of(params), t);
    return r;
  }

  static Params make(const g::Tile& t, const std::string& dtype, const std::string& act) {
    return g::with_tile(Params{{"dtype", dtype}, {"act", act}}, t);
  }

  // Every tile the heuristic can pick (gemm::default_tiles), for both dtypes and activations.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* d : {"f16", "bf16"})
      for (const char* a : {"silu", "gelu"})
        for (const g::Tile& t : g::default_tiles(g::k_gated)) out.push_back(make(t, d, a));
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto mode = p.as<g::GemmProblem>().mode;
    if (mode != k_gated_silu && mode != k_gated_gelu)
      return invalid_argument("gated_mlp: unknown activation " + std::to_string(mode));
    if (mode != act_of(params))
      return invalid_argument(std::string("gated_mlp: kernel is for ") + *params.get_str("act") +
                              ", the problem asks for " + (mode ? "gelu" : "silu"));
    const DType t = *parse_dtype(*params.get_str("dtype"));
    if (t != p.dtype)
      return unsupported_dtype(std::string("gated_mlp: kernel is for ") + dtype_name(t) + ", tensors are " +
                               dtype_name(p.dtype));
    return g::check_shape(name(), g::k_gated, t, g::tile_of(params), p);
  }

  Params heuristic(const Problem& p) const override {
    return make(g::default_tile(g::k_gated, p), p.dtype == DType::f16 ? "f16" : "bf16",
                p.as<g::GemmProblem>().mode == k_gated_gelu ? "gelu" : "silu");
  }

  // M = 4096 tokens, hidden 4096, intermediate 11008 and 14336.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t n : {11008, 14336})
      out.push_back(problem_from_shape(dtype, {{"m", 4096}, {"n", n}, {"k", 4096}}).value());
    // Decode on a small model (hidden 2048, intermediate 5632): also the one shape small enough
    // for the GPU conformance test's fp64 reference.
    out.push_back(problem_from_shape(dtype, {{"m", 128}, {"n", 5632}, {"k", 2048}}).value());
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const g::GemmProblem q = p.as<g::GemmProblem>();
    const auto m = q.m, n = q.n, k = q.k;
    return {{"x", BufferRole::input, p.dtype, m * k},
            {"wg", BufferRole::input, p.dtype, n * k},
            {"wu", BufferRole::input, p.dtype, n * k},
            {"out", BufferRole::output, p.dtype, m * n}};
  }

  void pack_args(const Params& params, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    g::pack(g::tile_of(params), p, std::int64_t(dtype_size(p.dtype)), b[0], b[1], b[2], nullptr, nullptr, b[3], out);
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 4) return invalid_argument("gated_mlp: reference takes 4 buffers (x, wg, wu, out)");
    const auto [m, n, k, mode] = p.as<g::GemmProblem>();
    const bool gelu = mode == k_gated_gelu;
    std::vector<double> x(std::size_t(m * k)), wg(std::size_t(n * k)), wu(std::size_t(n * k));
    for (std::int64_t i = 0; i < m * k; ++i) x[i] = load_as_double(b[0], p.dtype, i);
    for (std::int64_t i = 0; i < n * k; ++i) {
      wg[i] = load_as_double(b[1], p.dtype, i);
      wu[i] = load_as_double(b[2], p.dtype, i);
    }
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double gate = 0, up = 0;
        for (std::int64_t q = 0; q < k; ++q) {
          gate += x[i * k + q] * wg[j * k + q];
          up += x[i * k + q] * wu[j * k + q];
        }
        // erfc rather than 1 + erf, which cancels to 0 in double below gate = -8.
        const double act = gelu ? 0.5 * gate * std::erfc(-gate / std::sqrt(2.0)) : gate / (1.0 + std::exp(-gate));
        store_from_double(b[3], p.dtype, i * n + j, act * up);
      }
    return {};
  }
};

}  // namespace
}  // namespace kiln::families

void kiln_register_kernels_gated_mlp(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::GatedMlp>());
}
