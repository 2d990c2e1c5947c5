// The example plugin (docs/plugins.md): a soft-capping family in a shared library, built against
// kiln's public headers and family SDK only.
//
//   y = cap * tanh(x / cap), elementwise over a contiguous tensor of n elements.
//
// Params: dtype {f32, f16, bf16}, block {128, 256, 1024} threads, vec {1, 2, 4, 8} elements per
// access (vec * sizeof(dtype) <= 16 bytes).
// Problem: SoftcapProblem: n elements (the bucketed key), cap (a value: finite, > 0).
// Buffers: x (input, n elements), y (output, n elements), not overlapping.
// Heuristic: the widest access the alignment allows; 128 threads per block up to 64Ki packs, 256
// beyond (one pack per thread, a grid of up to 2^20 blocks striding over the rest).
// Template: templates/softcap/softcap.cuh, shipped inside the library.
#include <algorithm>
#include <cmath>

#include "kiln/embedded_templates.h"
#include "kiln/family_util.h"
#include "kiln/half.h"
#include "kiln/plugin_cpp.h"

namespace {

using namespace kiln;

struct SoftcapProblem {
  std::int64_t n = 0;
  double cap = 0;
};

constexpr std::int64_t k_max_blocks = std::int64_t(1) << 20;

class Softcap final : public Family {
 public:
  std::string_view name() const override { return "softcap"; }
  int version() const override { return 1; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {128, 256, 1024}, {}, "threads per block"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of x and y"},
        {"vec", {1, 2, 4, 8}, {}, "elements per memory access"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<SoftcapProblem>({
        bucketed(&SoftcapProblem::n, "n", "elements of x and y"),
        value(&SoftcapProblem::cap, "cap", "the soft cap: finite and positive"),
    });
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    return check_access_width(name(), params);
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"softcap/softcap.cuh\"\n";
    r.name_expression = std::string("kiln_softcap::softcap<") + device_type(*params.get_str("dtype")) + ", " +
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
    const auto q = p.as<SoftcapProblem>();
    if (q.n < 0) return shape_mismatch("softcap: need n >= 0");
    const double cap = q.cap;
    if (!std::isfinite(cap) || !(cap > 0)) return invalid_argument("softcap: cap must be finite and positive");
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype(std::string("softcap: kernel is for ") + dtype_name(dtype) + ", tensors are " +
                               dtype_name(p.dtype));
    const auto vec = *params.get_int("vec");
    if (p.alignment < vec * std::int64_t(dtype_size(dtype)))
      return invalid_argument("softcap: vec=" + std::to_string(vec) + " needs buffers aligned to vec elements");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto block = *params.get_int("block"), vec = *params.get_int("vec");
    const std::int64_t packs = p.as<SoftcapProblem>().n / vec;
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::clamp<std::int64_t>((packs + block - 1) / block, 1, k_max_blocks));
    g.block.x = std::uint32_t(block);
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto esize = std::int64_t(dtype_size(p.dtype));
    std::int64_t vec = 16 / esize;
    while (vec > 1 && p.alignment < vec * esize) vec /= 2;
    const std::int64_t block = p.as<SoftcapProblem>().n / vec <= 65536 ? 128 : 256;
    return Params{{"dtype", std::string(dtype_name(p.dtype))}, {"block", block}, {"vec", vec}};
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    for (const auto& c : catalog())
      if (*c.get_str("dtype") == dtype_name(p.dtype) && check_problem(c, p).ok()) out.push_back(c);
    return out;
  }

  // cap defaults to 30 (a common cap for final logits).
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    KILN_ASSIGN_OR_RETURN(Problem p, Family::problem_from_shape(dtype, shape));
    auto q = p.as<SoftcapProblem>();
    q.cap = 30.0;
    p.set(q);
    return p;
  }

  // One row of logits over a 256000-token vocabulary, a length that is not a multiple of any
  // vector width, and 2^24 elements (a batch of attention scores).
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t n : {256000, 1000003, 1 << 24}) out.push_back(problem_from_shape(dtype, {{"n", n}}).value());
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto n = p.as<SoftcapProblem>().n;
    return {{"x", BufferRole::input, p.dtype, n}, {"y", BufferRole::output, p.dtype, n}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    for (std::size_t i = 0; i < 2; ++i) out.add(i < b.size() ? b[i] : static_cast<void*>(nullptr));
    const auto q = p.as<SoftcapProblem>();
    out.add(static_cast<long long>(q.n));
    out.add(static_cast<float>(q.cap));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 2) return invalid_argument("softcap: the reference takes buffers x and y");
    if (!b[0] || !b[1]) return invalid_argument("softcap: a buffer of the reference is null");
    const auto q = p.as<SoftcapProblem>();
    const double cap = q.cap;
    for (std::int64_t i = 0; i < q.n; ++i)
      store_from_double(b[1], p.dtype, i, cap * std::tanh(load_as_double(b[0], p.dtype, i) / cap));
    return {};
  }
};

std::vector<plugin_bridge::FamilyExport> softcap_families() {
  return {{std::make_shared<Softcap>(), template_sources(plugin_templates())}};
}

}  // namespace

KILN_PLUGIN("kiln-example-softcap", "1.0.0", softcap_families)
