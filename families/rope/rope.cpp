#include "families/rope/rope.h"
#include "families/common/family_util.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "common/half.h"

namespace kiln::families {
namespace {

constexpr std::int64_t k_head_dims[] = {64, 80, 96, 128, 256};
// Items per token are 32-bit in the kernel: heads * head_dim / 2 / vec stays far below 2^31.
constexpr std::int64_t k_max_heads = 1 << 16;

// The cos/sin access for vec pairs: f32 values, at most 16 bytes at a time. A single value needs
// only the natural alignment of f32, which the op checks per tensor, so it does not limit vec.
std::uint32_t cos_access_bytes(std::int64_t vec) {
  return vec == 1 ? 1 : std::uint32_t(std::min<std::int64_t>(vec * 4, 16));
}

std::int64_t work_items(const Problem& p, std::int64_t vec) {
  const auto q = p.as<RopeProblem>();
  return q.tokens * (q.q_heads + q.kv_heads) * (q.head_dim / 2 / vec);
}

class Rope final : public Family {
 public:
  std::string_view name() const override { return "rope"; }
  int version() const override { return 2; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {64, 128, 256, 512}, {}, "threads per block (one work item per thread, grid-stride)"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of q, k, q_out and k_out (cos and sin are f32)"},
        {"head_dim", {64, 80, 96, 128, 256}, {}, "elements per head"},
        {"layout", {}, {"neox", "gptj"}, "rotation pairs: neox (i, i + head_dim/2), gptj (2i, 2i + 1)"},
        {"vec", {1, 2, 4, 8}, {}, "rotation pairs per work item (two vec-wide accesses of q or k)"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<RopeProblem>({
        bucketed(&RopeProblem::tokens, "tokens", "tokens to rotate"),
        key(&RopeProblem::q_heads, "q_heads", "query heads per token"),
        key(&RopeProblem::kv_heads, "kv_heads", "key heads per token"),
        key(&RopeProblem::head_dim, "head_dim", "elements per head"),
        key(&RopeProblem::layout, "layout", "rotation pairs: 0 neox (i, i + head_dim/2), 1 gptj (2i, 2i + 1)"),
        key(&RopeProblem::max_pos, "max_pos", "rows of cos and sin; position ids lie in [0, max_pos)"),
        value(&RopeProblem::q_stride, "q_stride", "elements between two tokens of q"),
        value(&RopeProblem::k_stride, "k_stride", "elements between two tokens of k"),
        value(&RopeProblem::q_out_stride, "q_out_stride", "elements between two tokens of q_out"),
        value(&RopeProblem::k_out_stride, "k_out_stride", "elements between two tokens of k_out")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    KILN_TRY(check_access_width(name(), params));
    const auto vec = *params.get_int("vec");
    if (*params.get_int("head_dim") % (2 * vec))
      return invalid_argument("rope: head_dim / 2 must be a multiple of vec");
    return {};
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"rope/rope_qk.cuh\"\n";
    r.name_expression = std::string("kiln::rope_qk<") + device_type(*params.get_str("dtype")) + ", float, " +
                        std::to_string(*params.get_int("head_dim")) + ", " +
                        (*params.get_str("layout") == "neox" ? "true" : "false") + ", " +
                        std::to_string(*params.get_int("vec")) + ", " + std::to_string(*params.get_int("block")) + ">";
    return r;
  }

  // What the heuristic picks for aligned tensors: 16-byte packs, 128 or 256 threads.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f32", "f16", "bf16"})
      for (std::int64_t head_dim : k_head_dims)
        for (const char* layout : {"neox", "gptj"})
          for (std::int64_t block : {128, 256}) {
            const std::int64_t vec = 16 / std::int64_t(dtype_size(*parse_dtype(dtype)));
            out.push_back(Params{{"dtype", std::string(dtype)}, {"head_dim", head_dim}, {"layout", std::string(layout)},
                                 {"vec", vec}, {"block", block}});
          }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<RopeProblem>();
    const auto tokens = q.tokens, qh = q.q_heads, kvh = q.kv_heads, head_dim = q.head_dim;
    if (tokens < 0 || qh < 0 || kvh < 0 || q.max_pos < 0)
      return shape_mismatch("rope: tokens, head counts and max_pos must be non-negative");
    if (qh + kvh > k_max_heads) return shape_mismatch("rope: more than 65536 heads per token");
    if (head_dim != *params.get_int("head_dim"))
      return shape_mismatch("rope: kernel is for head_dim " + std::to_string(*params.get_int("head_dim")) +
                            ", tensors have " + std::to_string(head_dim));
    const auto layout = q.layout;
    if (layout != k_rope_neox && layout != k_rope_gptj)
      return invalid_argument("rope: layout code must be 0 (neox) or 1 (gptj)");
    if ((layout == k_rope_neox) != (*params.get_str("layout") == "neox"))
      return invalid_argument("rope: kernel is for the " + *params.get_str("layout") + " layout");
    auto dtype = parse_dtype(*params.get_str("dtype"));
    if (*dtype != p.dtype)
      return unsupported_dtype(std::string("rope: kernel is for ") + dtype_name(*dtype) + ", tensors are " +
                               dtype_name(p.dtype));
    const auto vec = *params.get_int("vec");
    const std::int64_t strides[4] = {q.q_stride, q.k_stride, q.q_out_stride, q.k_out_stride};
    const std::int64_t min_stride[4] = {qh * head_dim, kvh * head_dim, qh * head_dim, kvh * head_dim};
    for (int i = 0; i < 4; ++i) {
      const auto s = strides[i];
      if (s < 0) return invalid_argument("rope: token strides must be non-negative");
      if (tokens > 1 && s < min_stride[i]) return shape_mismatch("rope: a token stride is shorter than a token");
      if (s % vec)
        return invalid_argument("rope: vec=" + std::to_string(vec) + " needs token strides that are multiples of vec");
    }
    if (p.alignment < vec * std::int64_t(dtype_size(*dtype)) || p.alignment < cos_access_bytes(vec))
      return invalid_argument("rope: vec=" + std::to_string(vec) + " needs buffers aligned to " +
                              std::to_string(std::max<std::int64_t>(vec * std::int64_t(dtype_size(*dtype)),
                                                                    cos_access_bytes(vec))) +
                              " bytes");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto block = *params.get_int("block");
    const auto items = work_items(p, *params.get_int("vec"));
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::clamp<std::int64_t>((items + block - 1) / block, 1, 0x7fffffff));
    g.block.x = std::uint32_t(block);
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto q = p.as<RopeProblem>();
    const auto c = rope_heuristic(p);
    return Params{{"dtype", std::string(dtype_name(p.dtype))},
                  {"head_dim", q.head_dim},
                  {"layout", std::string(q.layout == k_rope_gptj ? "gptj" : "neox")},
                  {"vec", std::int64_t(c.vec)},
                  {"block", std::int64_t(c.block)}};
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    Params base = heuristic(p);
    for (std::int64_t vec : {1, 2, 4, 8})
      for (std::int64_t block : {64, 128, 256, 512}) {
        Params c = base;
        c.set("vec", vec).set("block", block);
        if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
      }
    return out;
  }

  // Token strides default to contiguous tokens: q_heads * head_dim for q and q_out, kv_heads *
  // head_dim for k and k_out.
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    const auto q_heads = shape_value(shape, "q_heads"), kv_heads = shape_value(shape, "kv_heads");
    const auto head_dim = shape_value(shape, "head_dim");
    if (!q_heads || !kv_heads || !head_dim) return Family::problem_from_shape(dtype, shape);
    return Family::problem_from_shape(dtype, with_defaults(shape, {{"q_stride", *q_heads * *head_dim},
                                                                   {"k_stride", *kv_heads * *head_dim},
                                                                   {"q_out_stride", *q_heads * *head_dim},
                                                                   {"k_out_stride", *kv_heads * *head_dim}}));
  }

  // The rope benchmark shapes (families/rope/bench/rope.cpp): 32 query and 8 key heads of 64 or 128, both
  // layouts, contiguous tokens, positions below 4096.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t layout : {k_rope_neox, k_rope_gptj})
      for (std::int64_t head_dim : {64, 128})
        for (std::int64_t tokens : {1, 16, 512, 4096})
          out.push_back(Problem::of(dtype, 16,
                                    RopeProblem{.tokens = tokens,
                                                .q_heads = 32,
                                                .kv_heads = 8,
                                                .head_dim = head_dim,
                                                .layout = layout,
                                                .max_pos = 4096,
                                                .q_stride = 32 * head_dim,
                                                .k_stride = 8 * head_dim,
                                                .q_out_stride = 32 * head_dim,
                                                .k_out_stride = 8 * head_dim}));
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<RopeProblem>();
    const auto tokens = q.tokens, d = q.head_dim;
    auto extent = [&](std::int64_t stride, std::int64_t heads) {
      return tokens == 0 ? 0 : (tokens - 1) * stride + heads * d;
    };
    const auto table = q.max_pos * (d / 2);
    return {{"q", BufferRole::input, p.dtype, extent(q.q_stride, q.q_heads)},
            {"k", BufferRole::input, p.dtype, extent(q.k_stride, q.kv_heads)},
            {"cos", BufferRole::input, DType::f32, table},
            {"sin", BufferRole::input, DType::f32, table},
            {"position_ids", BufferRole::input, DType::i64, tokens, q.max_pos},
            {"q_out", BufferRole::output, p.dtype, extent(q.q_out_stride, q.q_heads)},
            {"k_out", BufferRole::output, p.dtype, extent(q.k_out_stride, q.kv_heads)}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<RopeProblem>();
    for (int i = 0; i < 7; ++i) out.add(b[i]);
    out.add(static_cast<long long>(q.tokens));
    out.add(static_cast<int>(q.q_heads));
    out.add(static_cast<int>(q.kv_heads));
    out.add(static_cast<long long>(q.max_pos));
    for (std::int64_t s : {q.q_stride, q.k_stride, q.q_out_stride, q.k_out_stride}) out.add(static_cast<long long>(s));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 7)
      return invalid_argument("rope: reference takes 7 buffers (q, k, cos, sin, position_ids, q_out, k_out)");
    const auto q = p.as<RopeProblem>();
    const auto tokens = q.tokens, d = q.head_dim, max_pos = q.max_pos;
    const auto half = d / 2;
    const bool neox = q.layout == k_rope_neox;
    const auto* pos_ids = static_cast<const std::int64_t*>(b[4]);
    struct Operand {
      const void* in;
      void* out;
      std::int64_t heads, in_stride, out_stride;
    };
    const Operand ops[2] = {
        {b[0], b[5], q.q_heads, q.q_stride, q.q_out_stride}, {b[1], b[6], q.kv_heads, q.k_stride, q.k_out_stride}};
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t pos = pos_ids[t];
      const bool valid = pos >= 0 && pos < max_pos;
      for (const Operand& op : ops)
        for (std::int64_t h = 0; h < op.heads; ++h) {
          const std::int64_t in0 = t * op.in_stride + h * d, out0 = t * op.out_stride + h * d;
          for (std::int64_t i = 0; i < half; ++i) {
            const std::int64_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
            // Both inputs are read before either output is written: q_out may be q.
            const double a = load_as_double(op.in, p.dtype, in0 + ia), bv = load_as_double(op.in, p.dtype, in0 + ib);
            const double c = valid ? load_as_double(b[2], DType::f32, pos * half + i)
                                   : std::numeric_limits<double>::quiet_NaN();
            const double s = valid ? load_as_double(b[3], DType::f32, pos * half + i)
                                   : std::numeric_limits<double>::quiet_NaN();
            store_from_double(op.out, p.dtype, out0 + ia, a * c - bv * s);
            store_from_double(op.out, p.dtype, out0 + ib, bv * c + a * s);
          }
        }
    }
    return {};
  }
};

}  // namespace

RopeChoice rope_heuristic(const Problem& p) {
  const int esize = int(dtype_size(p.dtype));
  int vec = 16 / esize;
  while (vec > 1 && (p.alignment < std::uint32_t(vec * esize) || p.alignment < cos_access_bytes(vec))) vec /= 2;
  const int block = work_items(p, vec) >= 256 * 264 ? 256 : 128;
  return {vec, block};
}

}  // namespace kiln::families

void kiln_register_family_rope(kiln::Registry& r) { (void)r.add(std::make_shared<kiln::families::Rope>()); }
