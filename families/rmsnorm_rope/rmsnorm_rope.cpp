#include "families/rmsnorm_rope/rmsnorm_rope.h"
#include "families/common/family_util.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "common/half.h"

namespace kiln::families {
namespace {

constexpr std::int64_t k_head_dims[] = {64, 80, 96, 128, 256};

// The cos/sin access for vec values, at most 16 bytes at a time. A single value needs only its
// natural alignment, which the op checks per tensor, so it does not limit vec.
std::uint32_t cos_access_bytes(std::int64_t vec, DType cos_dtype) {
  return vec == 1 ? 1 : std::uint32_t(std::min<std::int64_t>(vec * std::int64_t(dtype_size(cos_dtype)), 16));
}

// The cos/sin dtype a problem carries, if it is one of the floating types.
std::optional<DType> cos_dtype_of(const Problem& p) {
  const auto code = p.as<RmsNormRopeProblem>().cos_dtype;
  if (code != std::int64_t(DType::f32) && code != std::int64_t(DType::f16) && code != std::int64_t(DType::bf16))
    return std::nullopt;
  return DType(code);
}

class RmsNormRope final : public Family {
 public:
  std::string_view name() const override { return "rmsnorm_rope"; }
  int version() const override { return 1; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {64, 128, 256, 512, 1024}, {}, "threads per block (one block per row)"},
        {"cos_dtype", {}, {"f32", "f16", "bf16"}, "element type of cos and sin: f32 or dtype"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of x, weight and y"},
        {"head_dim", {64, 80, 96, 128, 256}, {}, "elements per head (cos/sin row length)"},
        {"vec", {1, 2, 4, 8}, {}, "rotation pairs per work item (a vec-wide access in each half of a head)"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    using P = RmsNormRopeProblem;
    static const std::vector<ProblemField> fields = problem_fields_of<P>({
        bucketed(&P::rows, "rows", "tokens (batch * seq rows)"),
        key(&P::hidden, "hidden", "elements per row (num_heads * head_dim)"),
        key(&P::head_dim, "head_dim", "elements per head"),
        key(&P::seq, "seq", "positions per sequence (rows of cos and sin)"),
        key(&P::num_heads, "num_heads", "heads per row"),
        key(&P::cos_dtype, "cos_dtype", "element type of cos and sin (a DType code)"),
        value(&P::eps, "eps", "added to the mean square")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const auto dtype = *params.get_str("dtype"), cos_dtype = *params.get_str("cos_dtype");
    KILN_TRY(check_access_width(name(), params));
    const auto vec = *params.get_int("vec");
    if (cos_dtype != "f32" && cos_dtype != dtype)
      return invalid_argument("rmsnorm_rope: cos_dtype must be f32 or dtype (got " + cos_dtype + " with " + dtype +
                              ")");
    if (*params.get_int("head_dim") % (2 * vec))
      return invalid_argument("rmsnorm_rope: head_dim / 2 must be a multiple of vec");
    return {};
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"rmsnorm_rope/rmsnorm_rope_fwd.cuh\"\n";
    r.name_expression = std::string("kiln::rmsnorm_rope_fwd<") + device_type(*params.get_str("dtype")) + ", " +
                        device_type(*params.get_str("cos_dtype")) + ", " +
                        std::to_string(*params.get_int("head_dim")) + ", " +
                        std::to_string(*params.get_int("block")) + ", " + std::to_string(*params.get_int("vec")) + ">";
    return r;
  }

  // 16-byte accesses (aligned tensors) at every block size the heuristic picks.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f32", "f16", "bf16"})
      for (const char* cos_dtype : {"f32", "f16", "bf16"})
        for (std::int64_t head_dim : k_head_dims)
          for (std::int64_t block : {64, 128, 256, 512, 1024}) {
            const std::int64_t vec = 16 / std::int64_t(dtype_size(*parse_dtype(dtype)));
            Params p{{"dtype", std::string(dtype)}, {"cos_dtype", std::string(cos_dtype)}, {"head_dim", head_dim},
                     {"block", block}, {"vec", vec}};
            if (validate(p).ok()) out.push_back(p);
          }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<RmsNormRopeProblem>();
    const auto rows = q.rows, hidden = q.hidden, head_dim = q.head_dim;
    const auto seq = q.seq, heads = q.num_heads;
    if (rows < 0 || hidden <= 0) return shape_mismatch("rmsnorm_rope: need rows >= 0 and hidden > 0");
    if (hidden >= (std::int64_t(1) << 31)) return shape_mismatch("rmsnorm_rope: rows longer than 2^31 elements");
    if (seq <= 0 || rows % seq) return shape_mismatch("rmsnorm_rope: rows must be a whole number of sequences");
    if (head_dim != *params.get_int("head_dim"))
      return shape_mismatch("rmsnorm_rope: kernel is for head_dim " + std::to_string(*params.get_int("head_dim")) +
                            ", tensors have " + std::to_string(head_dim));
    if (heads * head_dim != hidden)
      return shape_mismatch("rmsnorm_rope: num_heads * head_dim must equal hidden");
    if (!(q.eps >= 0) || !std::isfinite(q.eps))
      return invalid_argument("rmsnorm_rope: eps must be finite and non-negative");
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype(std::string("rmsnorm_rope: kernel is for ") + dtype_name(dtype) + ", tensors are " +
                               dtype_name(p.dtype));
    const auto cos_dtype = *parse_dtype(*params.get_str("cos_dtype"));
    if (cos_dtype_of(p) != cos_dtype)
      return unsupported_dtype(std::string("rmsnorm_rope: kernel is for ") + dtype_name(cos_dtype) + " cos/sin");
    const auto vec = *params.get_int("vec");
    if (p.alignment < vec * std::int64_t(dtype_size(dtype)) || p.alignment < cos_access_bytes(vec, cos_dtype))
      return invalid_argument("rmsnorm_rope: vec=" + std::to_string(vec) + " needs buffers aligned to " +
                              std::to_string(std::max<std::int64_t>(vec * std::int64_t(dtype_size(dtype)),
                                                                    cos_access_bytes(vec, cos_dtype))) +
                              " bytes");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::clamp<std::int64_t>(p.as<RmsNormRopeProblem>().rows, 1, 0x7fffffff));
    g.block.x = std::uint32_t(*params.get_int("block"));
    g.shared_bytes = std::uint32_t(rmsnorm_rope_weight_smem(params, p));
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto c = rmsnorm_rope_heuristic(p);
    const DType cos_dtype = cos_dtype_of(p).value_or(DType::f32);
    return Params{{"dtype", std::string(dtype_name(p.dtype))},
                  {"cos_dtype", std::string(dtype_name(cos_dtype))},
                  {"head_dim", p.as<RmsNormRopeProblem>().head_dim},
                  {"block", std::int64_t(c.block)},
                  {"vec", std::int64_t(c.vec)}};
  }

  // The bucket's upper bound in rows, rounded down to whole sequences (rows must be a multiple of
  // seq), and at least one sequence.
  Problem tuning_problem(const Problem& problem) const override {
    return whole_sequences<RmsNormRopeProblem>(Family::tuning_problem(problem));
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    Params base = heuristic(p);
    for (std::int64_t vec : {1, 2, 4, 8})
      for (std::int64_t block : {64, 128, 256, 512, 1024}) {
        Params c = base;
        c.set("vec", vec).set("block", block);
        if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
      }
    return out;
  }

  // Query-key norm shapes: 32 heads of 64 or 128, batches of one to 4096 tokens in sequences of up
  // to 1024, cos/sin in f32 and in the tensors' own dtype.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t head_dim : {64, 128})
      for (std::int64_t rows : {1, 512, 4096})
        for (DType cos : {DType::f32, dtype}) {
          out.push_back(Problem::of(dtype, 16,
                                    RmsNormRopeProblem{.rows = rows, .hidden = 32 * head_dim, .head_dim = head_dim,
                                                       .seq = std::min<std::int64_t>(rows, 1024), .num_heads = 32,
                                                       .cos_dtype = std::int64_t(cos), .eps = 1e-6}));
          if (cos == dtype) break;
        }
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<RmsNormRopeProblem>();
    const auto rows = q.rows, hidden = q.hidden;
    const auto table = q.seq * q.head_dim;
    const DType cos_dtype = cos_dtype_of(p).value_or(DType::f32);
    return {{"x", BufferRole::input, p.dtype, rows * hidden},
            {"weight", BufferRole::input, p.dtype, hidden},
            {"cos", BufferRole::input, cos_dtype, table},
            {"sin", BufferRole::input, cos_dtype, table},
            {"y", BufferRole::output, p.dtype, rows * hidden}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<RmsNormRopeProblem>();
    for (int i = 0; i < 5; ++i) out.add(b[i]);
    out.add(static_cast<long long>(q.rows));
    out.add(static_cast<int>(q.hidden));
    out.add(static_cast<long long>(q.seq));
    out.add(static_cast<float>(q.eps));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 5) return invalid_argument("rmsnorm_rope: reference takes 5 buffers (x, weight, cos, sin, y)");
    const auto cos_dtype = cos_dtype_of(p);
    if (!cos_dtype) return unsupported_dtype("rmsnorm_rope: cos_dtype must be f32, f16 or bf16");
    const auto q = p.as<RmsNormRopeProblem>();
    const auto rows = q.rows, hidden = q.hidden, d = q.head_dim;
    const auto seq = q.seq, half = d / 2;
    if (d <= 0 || d % 2 || hidden % d || seq <= 0)
      return shape_mismatch("rmsnorm_rope: hidden must be whole heads of an even head_dim");
    std::vector<double> n(static_cast<std::size_t>(hidden));
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t xo = r * hidden, co = (r % seq) * d;
      double ss = 0;
      for (std::int64_t c = 0; c < hidden; ++c) {
        const double v = load_as_double(b[0], p.dtype, xo + c);
        ss += v * v;
      }
      const double scale = 1.0 / std::sqrt(ss / double(hidden) + q.eps);
      // The whole row is read before any of it is written: y may be x.
      for (std::int64_t c = 0; c < hidden; ++c)
        n[std::size_t(c)] = load_as_double(b[0], p.dtype, xo + c) * scale * load_as_double(b[1], p.dtype, c);
      for (std::int64_t h0 = 0; h0 < hidden; h0 += d)
        for (std::int64_t j = 0; j < d; ++j) {
          const double rotated = j < half ? -n[std::size_t(h0 + j + half)] : n[std::size_t(h0 + j - half)];
          const double c = load_as_double(b[2], *cos_dtype, co + j), s = load_as_double(b[3], *cos_dtype, co + j);
          store_from_double(b[4], p.dtype, xo + h0 + j, n[std::size_t(h0 + j)] * c + rotated * s);
        }
    }
    return {};
  }
};

}  // namespace

std::int64_t rmsnorm_rope_weight_smem(const Params& params, const Problem& p) {
  // The kernel's register cache (families/rmsnorm_rope/rmsnorm_rope_fwd.cuh): 16 registers per
  // thread, 8 in 1024-thread blocks; an item is two packs.
  const auto block = *params.get_int("block"), vec = *params.get_int("vec");
  const std::int64_t pack_bytes = vec * std::int64_t(dtype_size(p.dtype));
  const std::int64_t cached = (block >= 1024 ? 8 : 16) / ((2 * pack_bytes + 3) / 4);
  const std::int64_t hidden = p.as<RmsNormRopeProblem>().hidden, items = hidden / (2 * vec);
  return pack_bytes >= 4 && items <= cached * block ? hidden * std::int64_t(dtype_size(p.dtype)) : 0;
}

RmsNormRopeChoice rmsnorm_rope_heuristic(const Problem& p) {
  const int esize = int(dtype_size(p.dtype));
  const DType cos_dtype = cos_dtype_of(p).value_or(DType::f32);
  int vec = 16 / esize;
  while (vec > 1 && (p.alignment < std::uint32_t(vec * esize) || p.alignment < cos_access_bytes(vec, cos_dtype)))
    vec /= 2;
  const std::int64_t items = std::max<std::int64_t>(1, p.as<RmsNormRopeProblem>().hidden / (2 * vec));
  int block = 64;
  while (block < 1024 && block * 4 <= items) block *= 2;
  return {block, vec};
}

}  // namespace kiln::families

void kiln_register_kernels_rope_hf_bwd(kiln::Registry& r);

// The folder's two kernel families: the fused forward and the rotation's transpose that its
// backward runs before the RMSNorm backward.
void kiln_register_family_rmsnorm_rope(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::RmsNormRope>());
  kiln_register_kernels_rope_hf_bwd(r);
}
