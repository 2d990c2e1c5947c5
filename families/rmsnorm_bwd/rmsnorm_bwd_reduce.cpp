#include "families/rmsnorm_bwd/rmsnorm_bwd_reduce.h"
#include "families/common/family_util.h"

#include <vector>

#include "common/half.h"

namespace kiln::families {
namespace {

class RmsNormBwdReduce final : public Family {
 public:
  std::string_view name() const override { return "rmsnorm_bwd_reduce"; }
  int version() const override { return 3; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {128, 256, 512, 1024}, {}, "threads per block: columns x block / columns slab lanes"},
        {"columns", {8, 16, 32}, {}, "adjacent columns per block"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of dw"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<RmsNormBwdReduceProblem>({
        bucketed(&RmsNormBwdReduceProblem::slabs, "slabs", "partial dw rows to sum"),
        key(&RmsNormBwdReduceProblem::cols, "cols", "elements per row (the hidden size)")});
    return fields;
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"rmsnorm_bwd/rmsnorm_bwd_reduce.cuh\"\n";
    r.name_expression = std::string("kiln::rmsnorm_bwd_reduce<") + device_type(*params.get_str("dtype")) + ", " +
                        std::to_string(*params.get_int("block")) + ", " + std::to_string(*params.get_int("columns")) +
                        ">";
    return r;
  }

  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f32", "f16", "bf16"})
      for (std::int64_t block : {128, 256, 512, 1024})
        for (std::int64_t columns : {8, 16, 32})
          out.push_back(Params{{"dtype", std::string(dtype)}, {"block", block}, {"columns", columns}});
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<RmsNormBwdReduceProblem>();
    const auto slabs = q.slabs, cols = q.cols;
    if (slabs < 0 || cols <= 0) return shape_mismatch("rmsnorm_bwd_reduce: need slabs >= 0 and cols > 0");
    if ((cols + 7) / 8 > 0x7fffffff) return shape_mismatch("rmsnorm_bwd_reduce: too many columns");
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype(std::string("rmsnorm_bwd_reduce: kernel is for ") + dtype_name(dtype) +
                               ", dw is " + dtype_name(p.dtype));
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    LaunchGeometry g;
    const auto columns = *params.get_int("columns");
    g.grid.x = std::uint32_t((p.as<RmsNormBwdReduceProblem>().cols + columns - 1) / columns);
    g.block.x = std::uint32_t(*params.get_int("block"));
    return g;
  }

  // The kernel starts with griddepcontrol.wait (families/rmsnorm_bwd/rmsnorm_bwd_reduce.cuh).
  bool programmatic_launch() const override { return true; }

  Params heuristic(const Problem& p) const override {
    return Params{{"dtype", std::string(dtype_name(p.dtype))},
                  {"block", std::int64_t(rmsnorm_bwd_reduce_heuristic(p))},
                  {"columns", rmsnorm_bwd_reduce_columns(p)}};
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    for (const auto& c : catalog())
      if (*c.get_str("dtype") == dtype_name(p.dtype)) out.push_back(c);
    return out;
  }

  // Slab counts the backward pass produces on GPUs of 1 to 132 SMs, for common hidden sizes.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t slabs : {1, 37, 264})
      for (std::int64_t cols : {2048, 4096, 8192})
        out.push_back(Problem::of(dtype, 16, RmsNormBwdReduceProblem{.slabs = slabs, .cols = cols}));
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<RmsNormBwdReduceProblem>();
    return {{"partial", BufferRole::input, DType::f32, q.slabs * q.cols},
            {"dw", BufferRole::output, p.dtype, q.cols}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<RmsNormBwdReduceProblem>();
    out.add(b[0]);
    out.add(b[1]);
    out.add(static_cast<long long>(q.slabs));
    out.add(static_cast<long long>(q.cols));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 2) return invalid_argument("rmsnorm_bwd_reduce: reference takes 2 buffers (partial, dw)");
    const auto q = p.as<RmsNormBwdReduceProblem>();
    const auto slabs = q.slabs, cols = q.cols;
    const auto* partial = static_cast<const float*>(b[0]);
    for (std::int64_t c = 0; c < cols; ++c) {
      double acc = 0;
      for (std::int64_t s = 0; s < slabs; ++s) acc += partial[s * cols + c];
      store_from_double(b[1], p.dtype, c, acc);
    }
    return {};
  }
};

}  // namespace

int rmsnorm_bwd_reduce_heuristic(const Problem& p) {
  const auto slabs = p.as<RmsNormBwdReduceProblem>().slabs;
  return slabs <= 8 ? 128 : slabs <= 64 ? 256 : 512;
}

std::int64_t rmsnorm_bwd_reduce_columns(const Problem& p) {
  std::int64_t columns = 32;
  const auto cols = p.as<RmsNormBwdReduceProblem>().cols;
  while (columns > 8 && cols / columns < 256) columns /= 2;
  return columns;
}

}  // namespace kiln::families

void kiln_register_kernels_rmsnorm_bwd_reduce(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::RmsNormBwdReduce>());
}
