#include "families/rmsnorm_rope/rope_hf_bwd.h"
#include "families/common/family_util.h"

#include <algorithm>
#include <optional>

#include "common/half.h"

namespace kiln::families {
namespace {

constexpr std::int64_t k_head_dims[] = {64, 80, 96, 128, 256};
constexpr std::int64_t k_blocks[] = {128, 256, 512};

// The cos/sin access for vec values, at most 16 bytes at a time. A single value needs only its
// natural alignment, which the op checks per tensor, so it does not limit vec.
std::uint32_t cos_access_bytes(std::int64_t vec, DType cos_dtype) {
  return vec == 1 ? 1 : std::uint32_t(std::min<std::int64_t>(vec * std::int64_t(dtype_size(cos_dtype)), 16));
}

std::optional<DType> cos_dtype_of(const Problem& p) {
  const auto code = p.as<RopeHfBwdProblem>().cos_dtype;
  if (code != std::int64_t(DType::f32) && code != std::int64_t(DType::f16) && code != std::int64_t(DType::bf16))
    return std::nullopt;
  return DType(code);
}

class RopeHfBwd final : public Family {
 public:
  std::string_view name() const override { return "rope_hf_bwd"; }
  int version() const override { return 1; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {128, 256, 512}, {}, "threads per block (grid-stride over work items)"},
        {"cos_dtype", {}, {"f32", "f16", "bf16"}, "element type of cos and sin: f32 or dtype"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of dout and dn"},
        {"head_dim", {64, 80, 96, 128, 256}, {}, "elements per head (cos/sin row length)"},
        {"vec", {1, 2, 4, 8}, {}, "rotation pairs per work item (a vec-wide access in each half of a head)"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    using P = RopeHfBwdProblem;
    static const std::vector<ProblemField> fields = problem_fields_of<P>({
        bucketed(&P::rows, "rows", "tokens (batch * seq rows)"),
        key(&P::hidden, "hidden", "elements per row (num_heads * head_dim)"),
        key(&P::head_dim, "head_dim", "elements per head"),
        key(&P::seq, "seq", "positions per sequence (rows of cos and sin)"),
        key(&P::num_heads, "num_heads", "heads per row"),
        key(&P::cos_dtype, "cos_dtype", "element type of cos and sin (a DType code)")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const auto dtype = *params.get_str("dtype"), cos_dtype = *params.get_str("cos_dtype");
    KILN_TRY(check_access_width(name(), params));
    if (cos_dtype != "f32" && cos_dtype != dtype)
      return invalid_argument("rope_hf_bwd: cos_dtype must be f32 or dtype (got " + cos_dtype + " with " + dtype + ")");
    if (*params.get_int("head_dim") % (2 * *params.get_int("vec")))
      return invalid_argument("rope_hf_bwd: head_dim / 2 must be a multiple of vec");
    return {};
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"rmsnorm_rope/rope_hf_bwd.cuh\"\n";
    r.name_expression = std::string("kiln::rope_hf_bwd<") + device_type(*params.get_str("dtype")) + ", " +
                        device_type(*params.get_str("cos_dtype")) + ", " +
                        std::to_string(*params.get_int("head_dim")) + ", " +
                        std::to_string(*params.get_int("block")) + ", " + std::to_string(*params.get_int("vec")) + ">";
    return r;
  }

  // The heuristic's choice for aligned tensors: 16-byte accesses, 256 threads.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f32", "f16", "bf16"})
      for (const char* cos_dtype : {"f32", "f16", "bf16"})
        for (std::int64_t head_dim : k_head_dims) {
          const std::int64_t vec = 16 / std::int64_t(dtype_size(*parse_dtype(dtype)));
          Params p{{"dtype", std::string(dtype)}, {"cos_dtype", std::string(cos_dtype)}, {"head_dim", head_dim},
                   {"block", std::int64_t(256)}, {"vec", vec}};
          if (validate(p).ok()) out.push_back(p);
        }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<RopeHfBwdProblem>();
    if (q.rows < 0 || q.hidden <= 0) return shape_mismatch("rope_hf_bwd: need rows >= 0 and hidden > 0");
    if (q.hidden >= (std::int64_t(1) << 31)) return shape_mismatch("rope_hf_bwd: rows longer than 2^31 elements");
    if (q.seq <= 0 || q.rows % q.seq) return shape_mismatch("rope_hf_bwd: rows must be a whole number of sequences");
    if (q.head_dim != *params.get_int("head_dim"))
      return shape_mismatch("rope_hf_bwd: kernel is for head_dim " + std::to_string(*params.get_int("head_dim")) +
                            ", tensors have " + std::to_string(q.head_dim));
    if (q.num_heads * q.head_dim != q.hidden)
      return shape_mismatch("rope_hf_bwd: num_heads * head_dim must equal hidden");
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype(std::string("rope_hf_bwd: kernel is for ") + dtype_name(dtype) + ", tensors are " +
                               dtype_name(p.dtype));
    const auto cos_dtype = *parse_dtype(*params.get_str("cos_dtype"));
    if (cos_dtype_of(p) != cos_dtype)
      return unsupported_dtype(std::string("rope_hf_bwd: kernel is for ") + dtype_name(cos_dtype) + " cos/sin");
    const auto vec = *params.get_int("vec");
    const std::int64_t need =
        std::max<std::int64_t>(vec * std::int64_t(dtype_size(dtype)), cos_access_bytes(vec, cos_dtype));
    if (p.alignment < need)
      return invalid_argument("rope_hf_bwd: vec=" + std::to_string(vec) + " needs buffers aligned to " +
                              std::to_string(need) + " bytes");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto q = p.as<RopeHfBwdProblem>();
    const std::int64_t block = *params.get_int("block");
    const std::int64_t items = q.rows * (q.hidden / (2 * *params.get_int("vec")));
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::clamp<std::int64_t>((items + block - 1) / block, 1, 0x7fffffff));
    g.block.x = std::uint32_t(block);
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto c = rope_hf_bwd_heuristic(p);
    return Params{{"dtype", std::string(dtype_name(p.dtype))},
                  {"cos_dtype", std::string(dtype_name(cos_dtype_of(p).value_or(DType::f32)))},
                  {"head_dim", p.as<RopeHfBwdProblem>().head_dim},
                  {"block", std::int64_t(c.block)},
                  {"vec", std::int64_t(c.vec)}};
  }

  // The bucket's upper bound in rows, rounded down to whole sequences (rows must be a multiple of
  // seq), and at least one sequence.
  Problem tuning_problem(const Problem& problem) const override {
    return whole_sequences<RopeHfBwdProblem>(Family::tuning_problem(problem));
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    const Params base = heuristic(p);
    for (std::int64_t vec : {1, 2, 4, 8})
      for (std::int64_t block : k_blocks) {
        Params c = base;
        c.set("vec", vec).set("block", block);
        if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
      }
    return out;
  }

  // The forward's benchmark shapes: 32 heads of 64 or 128, one to 4096 tokens.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t head_dim : {64, 128})
      for (std::int64_t rows : {1, 512, 4096})
        for (DType cos : {DType::f32, dtype}) {
          out.push_back(Problem::of(dtype, 16,
                                    RopeHfBwdProblem{.rows = rows, .hidden = 32 * head_dim, .head_dim = head_dim,
                                                     .seq = std::min<std::int64_t>(rows, 1024), .num_heads = 32,
                                                     .cos_dtype = std::int64_t(cos)}));
          if (cos == dtype) break;
        }
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<RopeHfBwdProblem>();
    const DType cos_dtype = cos_dtype_of(p).value_or(DType::f32);
    return {{"dout", BufferRole::input, p.dtype, q.rows * q.hidden},
            {"cos", BufferRole::input, cos_dtype, q.seq * q.head_dim},
            {"sin", BufferRole::input, cos_dtype, q.seq * q.head_dim},
            {"dn", BufferRole::output, p.dtype, q.rows * q.hidden}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<RopeHfBwdProblem>();
    for (int i = 0; i < 4; ++i) out.add(b[i]);
    out.add(static_cast<long long>(q.rows));
    out.add(static_cast<int>(q.hidden));
    out.add(static_cast<long long>(q.seq));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 4) return invalid_argument("rope_hf_bwd: reference takes 4 buffers (dout, cos, sin, dn)");
    const auto cos_dtype = cos_dtype_of(p);
    if (!cos_dtype) return unsupported_dtype("rope_hf_bwd: cos_dtype must be f32, f16 or bf16");
    const auto q = p.as<RopeHfBwdProblem>();
    const auto d = q.head_dim, half = d / 2;
    if (d <= 0 || d % 2 || q.hidden % d || q.seq <= 0)
      return shape_mismatch("rope_hf_bwd: hidden must be whole heads of an even head_dim");
    for (std::int64_t r = 0; r < q.rows; ++r) {
      const std::int64_t co = (r % q.seq) * d;
      for (std::int64_t h0 = r * q.hidden; h0 < (r + 1) * q.hidden; h0 += d)
        for (std::int64_t j = 0; j < half; ++j) {
          // Both partners are read before either is written: dn may be dout.
          const double g1 = load_as_double(b[0], p.dtype, h0 + j), g2 = load_as_double(b[0], p.dtype, h0 + j + half);
          const double c_lo = load_as_double(b[1], *cos_dtype, co + j);
          const double c_hi = load_as_double(b[1], *cos_dtype, co + j + half);
          const double s_lo = load_as_double(b[2], *cos_dtype, co + j);
          const double s_hi = load_as_double(b[2], *cos_dtype, co + j + half);
          store_from_double(b[3], p.dtype, h0 + j, g1 * c_lo + g2 * s_hi);
          store_from_double(b[3], p.dtype, h0 + j + half, g2 * c_hi - g1 * s_lo);
        }
    }
    return {};
  }
};

}  // namespace

RopeHfBwdChoice rope_hf_bwd_heuristic(const Problem& p) {
  const int esize = int(dtype_size(p.dtype));
  const DType cos_dtype = cos_dtype_of(p).value_or(DType::f32);
  int vec = 16 / esize;
  while (vec > 1 && (p.alignment < std::uint32_t(vec * esize) || p.alignment < cos_access_bytes(vec, cos_dtype)))
    vec /= 2;
  return {256, vec};
}

}  // namespace kiln::families

void kiln_register_kernels_rope_hf_bwd(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::RopeHfBwd>());
}
