// The routing families: moe_topk, moe_sort, moe_gather, moe_combine (families/moe/moe.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/half.h"
#include "families/common/family_util.h"
#include "families/moe/moe.h"

namespace kiln::families::moe {

void topk_route(const double* logits, const float* bias, const MoeTopkProblem& p, float* weights,
                std::int32_t* ids) {
  const std::int64_t experts = p.experts, top_k = p.top_k;
  const std::size_t ne = std::size_t(experts);
  std::vector<double> s(ne), choice(ne);
  std::vector<char> taken(ne, 0);
  // The best untaken entry of v: larger value, lower index on ties, NaN never; -1 for none.
  auto best = [&](const std::vector<double>& v) {
    std::int64_t at = -1;
    for (std::int64_t e = 0; e < experts; ++e)
      if (!taken[e] && !std::isnan(v[e]) && (at < 0 || v[e] > v[at])) at = e;
    return at;
  };
  std::vector<double> w(std::size_t(top_k), 0.0);
  std::vector<std::int64_t> id(std::size_t(top_k), -1);
  if (p.scoring == k_softmax) {
    double mx = -INFINITY, total = 0;
    for (std::int64_t e = 0; e < experts; ++e) mx = std::max(mx, logits[e]);
    for (std::int64_t e = 0; e < experts; ++e) total += std::exp(logits[e] - mx);
    for (std::int64_t j = 0; j < top_k; ++j) {
      const std::int64_t i = best(std::vector<double>(logits, logits + experts));
      id[j] = i;
      if (i >= 0) {
        w[j] = std::exp(logits[i] - mx) / total;
        taken[i] = 1;
      }
    }
  } else {
    for (std::int64_t e = 0; e < experts; ++e) {
      s[e] = 1.0 / (1.0 + std::exp(-logits[e]));
      choice[e] = s[e] + double(bias[e]);
    }
    const std::int64_t gsize = experts / p.n_group;
    std::vector<double> gscore(std::size_t(p.n_group));
    for (std::int64_t g = 0; g < p.n_group; ++g) {
      double b0 = -INFINITY, b1 = -INFINITY;
      for (std::int64_t e = g * gsize; e < (g + 1) * gsize; ++e) {
        if (choice[e] > b0) {
          b1 = b0;
          b0 = choice[e];
        } else if (choice[e] > b1) {
          b1 = choice[e];
        }
      }
      gscore[g] = gsize > 1 ? b0 + b1 : b0;
    }
    std::vector<char> kept(std::size_t(p.n_group), 0);
    for (std::int64_t j = 0; j < p.topk_group; ++j) {
      std::int64_t at = -1;
      for (std::int64_t g = 0; g < p.n_group; ++g)
        if (!kept[g] && !std::isnan(gscore[g]) && (at < 0 || gscore[g] > gscore[at])) at = g;
      if (at >= 0) kept[at] = 1;
    }
    for (std::int64_t e = 0; e < experts; ++e)
      if (!kept[e / gsize]) taken[e] = 1;
    for (std::int64_t j = 0; j < top_k; ++j) {
      const std::int64_t i = best(choice);
      id[j] = i;
      if (i >= 0) {
        w[j] = s[i];
        taken[i] = 1;
      }
    }
  }
  double sum = 0;
  for (double v : w) sum += v;
  const double scale = p.scoring == k_softmax ? 1.0 : p.scale;
  for (std::int64_t j = 0; j < top_k; ++j) {
    weights[j] = float((p.renormalize && sum > 0 ? w[j] / sum : w[j]) * scale);
    ids[j] = std::int32_t(id[j]);
  }
}

namespace {

const char* scoring_name(std::int64_t s) { return s == k_sigmoid_group ? "sigmoid_group" : "softmax"; }

Status check_dtype(std::string_view family, const Params& params, const Problem& p) {
  const DType t = *parse_dtype(*params.get_str("dtype"));
  if (t != p.dtype)
    return unsupported_dtype(std::string(family) + ": kernel is for " + dtype_name(t) + ", tensors are " +
                             dtype_name(p.dtype));
  return {};
}

constexpr int k_topk_warps = 4;

class MoeTopk final : public Family {
 public:
  std::string_view name() const override { return "moe_topk"; }
  int version() const override { return 1; }
  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of the router logits"},
        {"scoring", {}, {"softmax", "sigmoid_group"}, "softmax top-k, or sigmoid + bias with group-limited top-k"}};
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<MoeTopkProblem>(
        {bucketed(&MoeTopkProblem::tokens, "tokens", "tokens (rows of logits)"),
         key(&MoeTopkProblem::experts, "experts", "experts (columns of logits)"),
         key(&MoeTopkProblem::top_k, "top_k", "experts picked per token"),
         key(&MoeTopkProblem::scoring, "scoring", "0 softmax, 1 sigmoid + bias, group-limited"),
         key(&MoeTopkProblem::n_group, "n_group", "expert groups (sigmoid_group)"),
         key(&MoeTopkProblem::topk_group, "topk_group", "groups kept per token (sigmoid_group)"),
         value(&MoeTopkProblem::renormalize, "renormalize", "1: weights divided by their sum"),
         value(&MoeTopkProblem::scale, "scale", "weights times this (sigmoid_group)")});
    return fields;
  }
  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"moe/routing.cuh\"\n";
    r.name_expression = std::string("kiln::moe::moe_topk<") + device_type(*params.get_str("dtype")) + ", " +
                        (*params.get_str("scoring") == "softmax" ? "0" : "1") + ", " + std::to_string(k_topk_warps) +
                        ">";
    return r;
  }
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* d : {"f32", "f16", "bf16"})
      for (const char* s : {"softmax", "sigmoid_group"}) out.push_back(Params{{"dtype", d}, {"scoring", s}});
    return out;
  }
  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<MoeTopkProblem>();
    if (q.tokens < 0 || q.tokens >= (std::int64_t(1) << 31)) return shape_mismatch("moe_topk: tokens must be in [0, 2^31)");
    if (q.experts < 1 || q.experts > k_max_experts)
      return shape_mismatch("moe_topk: experts must be in [1, " + std::to_string(k_max_experts) + "]");
    if (q.top_k < 1 || q.top_k > std::min(q.experts, k_max_top_k))
      return invalid_argument("moe_topk: top_k must be in [1, min(experts, 32)], got " + std::to_string(q.top_k));
    if (q.scoring != k_softmax && q.scoring != k_sigmoid_group)
      return invalid_argument("moe_topk: unknown scoring " + std::to_string(q.scoring));
    if (*params.get_str("scoring") != scoring_name(q.scoring))
      return invalid_argument(std::string("moe_topk: kernel is for ") + *params.get_str("scoring") +
                              " scoring, the problem asks for " + scoring_name(q.scoring));
    if (q.scoring == k_sigmoid_group) {
      if (q.n_group < 1 || q.n_group > 32 || q.experts % q.n_group)
        return invalid_argument("moe_topk: n_group must be in [1, 32] and divide experts");
      if (q.topk_group < 1 || q.topk_group > q.n_group)
        return invalid_argument("moe_topk: topk_group must be in [1, n_group]");
      if (q.top_k > q.topk_group * (q.experts / q.n_group))
        return invalid_argument("moe_topk: top_k exceeds the experts of the kept groups");
    }
    return check_dtype(name(), params, p);
  }
  LaunchGeometry geometry(const Params&, const Problem& p) const override {
    const auto q = p.as<MoeTopkProblem>();
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>(1, (q.tokens + k_topk_warps - 1) / k_topk_warps));
    g.block.x = 32 * k_topk_warps;
    const std::int64_t per_warp = (q.scoring == k_sigmoid_group ? 2 : 1) * q.experts + q.experts / 32 + 1;
    g.shared_bytes = std::uint32_t(k_topk_warps * per_warp * 4);
    return g;
  }
  Params heuristic(const Problem& p) const override {
    return Params{{"dtype", std::string(dtype_name(p.dtype))},
                  {"scoring", std::string(scoring_name(p.as<MoeTopkProblem>().scoring))}};
  }
  std::vector<Params> tuning_space(const Problem& p) const override { return {heuristic(p)}; }
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    return Family::problem_from_shape(
        dtype, with_defaults(shape, {{"scoring", k_softmax}, {"n_group", 1}, {"topk_group", 1}}));
  }
  // Mixtral (8 experts, top 2) and Qwen3-MoE (128, top 8) at decode and prefill sizes; DeepSeek-V3
  // (256, 8 groups keep 4, top 8) at decode size only: its picks rank fp32 sigmoids, which an fp64
  // reference may order differently where two lie within an ulp or two (about one token in 10^4
  // on random logits), and the GPU conformance test compares ids exactly.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t tokens : {16, 4096}) {
      out.push_back(Problem::of(dtype, 16, MoeTopkProblem{.tokens = tokens, .experts = 8, .top_k = 2, .renormalize = 1}));
      out.push_back(Problem::of(dtype, 16, MoeTopkProblem{.tokens = tokens, .experts = 128, .top_k = 8, .renormalize = 1}));
    }
    out.push_back(Problem::of(dtype, 16,
                              MoeTopkProblem{.tokens = 16, .experts = 256, .top_k = 8, .scoring = k_sigmoid_group,
                                             .n_group = 8, .topk_group = 4, .renormalize = 1, .scale = 2.5}));
    return out;
  }
  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<MoeTopkProblem>();
    return {{"logits", BufferRole::input, p.dtype, q.tokens * q.experts},
            {"bias", BufferRole::input, DType::f32, q.scoring == k_sigmoid_group ? q.experts : 1},
            {"weights", BufferRole::output, DType::f32, q.tokens * q.top_k},
            {"ids", BufferRole::output, DType::i32, q.tokens * q.top_k}};
  }
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<MoeTopkProblem>();
    for (int i = 0; i < 4; ++i) out.add(b[i]);
    out.add(int(q.tokens));
    out.add(int(q.experts));
    out.add(int(q.top_k));
    out.add(int(q.n_group));
    out.add(int(q.topk_group));
    out.add(int(q.renormalize ? 1 : 0));
    out.add(float(q.scale));
  }
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 4) return invalid_argument("moe_topk: reference takes 4 buffers (logits, bias, weights, ids)");
    const auto q = p.as<MoeTopkProblem>();
    std::vector<double> row(std::size_t(q.experts));
    for (std::int64_t t = 0; t < q.tokens; ++t) {
      for (std::int64_t e = 0; e < q.experts; ++e) row[e] = load_as_double(b[0], p.dtype, t * q.experts + e);
      topk_route(row.data(), static_cast<const float*>(b[1]), q, static_cast<float*>(b[2]) + t * q.top_k,
                 static_cast<std::int32_t*>(b[3]) + t * q.top_k);
    }
    return {};
  }
};

class MoeSort final : public Family {
 public:
  std::string_view name() const override { return "moe_sort"; }
  int version() const override { return 1; }
  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {{"block", {1024}, {}, "threads of the one block"}};
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<MoeSortProblem>(
        {bucketed(&MoeSortProblem::n, "n", "entries (tokens x top_k)"), key(&MoeSortProblem::experts, "experts", "experts")});
    return fields;
  }
  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"moe/routing.cuh\"\n";
    r.name_expression = "kiln::moe::moe_sort";
    return r;
  }
  std::vector<Params> catalog() const override { return {Params{{"block", std::int64_t(1024)}}}; }
  Status check_problem(const Params&, const Problem& p) const override {
    const auto q = p.as<MoeSortProblem>();
    if (q.n < 0 || q.n >= (std::int64_t(1) << 31)) return shape_mismatch("moe_sort: n must be in [0, 2^31)");
    if (q.experts < 1 || q.experts > k_max_experts)
      return shape_mismatch("moe_sort: experts must be in [1, " + std::to_string(k_max_experts) + "]");
    return {};
  }
  LaunchGeometry geometry(const Params&, const Problem& p) const override {
    LaunchGeometry g;
    g.block.x = 1024;
    g.shared_bytes = std::uint32_t(p.as<MoeSortProblem>().experts * (4 + 4 + 64));
    return g;
  }
  Params heuristic(const Problem&) const override { return catalog()[0]; }
  std::vector<Params> tuning_space(const Problem&) const override { return catalog(); }
  // Ids are always i32; the problem's dtype is not read, and the problems are listed once (f32).
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    if (dtype != DType::f32) return {};
    return {Problem::of(dtype, 16, MoeSortProblem{.n = 4096 * 2, .experts = 8}),
            Problem::of(dtype, 16, MoeSortProblem{.n = 4096 * 8, .experts = 256}),
            Problem::of(dtype, 16, MoeSortProblem{.n = 16 * 8, .experts = 256})};
  }
  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<MoeSortProblem>();
    return {{"ids", BufferRole::input, DType::i32, q.n, q.experts},
            {"offsets", BufferRole::output, DType::i32, q.experts + 1},
            {"row_of", BufferRole::output, DType::i32, q.n},
            {"src_of", BufferRole::output, DType::i32, q.n}};
  }
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<MoeSortProblem>();
    for (int i = 0; i < 4; ++i) out.add(b[i]);
    out.add(int(q.n));
    out.add(int(q.experts));
  }
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 4) return invalid_argument("moe_sort: reference takes 4 buffers (ids, offsets, row_of, src_of)");
    const auto q = p.as<MoeSortProblem>();
    const auto* ids = static_cast<const std::int32_t*>(b[0]);
    auto* offsets = static_cast<std::int32_t*>(b[1]);
    auto* row_of = static_cast<std::int32_t*>(b[2]);
    auto* src_of = static_cast<std::int32_t*>(b[3]);
    std::vector<std::int64_t> count(std::size_t(q.experts + 1), 0);
    for (std::int64_t i = 0; i < q.n; ++i)
      if (ids[i] >= 0 && ids[i] < q.experts) ++count[ids[i] + 1];
    for (std::int64_t e = 0; e < q.experts; ++e) count[e + 1] += count[e];
    for (std::int64_t e = 0; e <= q.experts; ++e) offsets[e] = std::int32_t(count[e]);
    for (std::int64_t r = count[q.experts]; r < q.n; ++r) src_of[r] = -1;
    for (std::int64_t i = 0; i < q.n; ++i) {
      if (ids[i] < 0 || ids[i] >= q.experts) {
        row_of[i] = -1;
        continue;
      }
      const std::int64_t r = count[ids[i]]++;
      row_of[i] = std::int32_t(r);
      src_of[r] = std::int32_t(i);
    }
    return {};
  }
};

// moe_gather and moe_combine: row copies with vec elements per access.
class RowFamily : public Family {
 public:
  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of the rows"},
        {"vec", {1, 2, 4, 8}, {}, "elements per access (at most 16 bytes)"},
        {"weighted", {0, 1}, {}, "1: rows scaled by the routing weights"}};
    return defs;
  }
  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    return check_access_width(name(), params);
  }
  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"moe/routing.cuh\"\n";
    r.name_expression = std::string("kiln::moe::") + std::string(name()) + "<" +
                        device_type(*params.get_str("dtype")) + ", " + std::to_string(*params.get_int("vec")) + ", " +
                        std::to_string(*params.get_int("weighted")) + ">";
    return r;
  }
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* d : {"f32", "f16", "bf16"})
      for (std::int64_t vec : {1, 2, 4, 8})
        for (std::int64_t w : {0, 1}) {
          Params p{{"dtype", d}, {"vec", vec}, {"weighted", w}};
          if (validate(p).ok()) out.push_back(p);
        }
    return out;
  }
  // The widest access (up to 16 bytes) that the alignment and the row length allow.
  Params pick(const Problem& p, std::int64_t hidden, std::int64_t weighted) const {
    const std::int64_t es = std::int64_t(dtype_size(p.dtype));
    std::int64_t vec = 16 / es;
    while (vec > 1 && (hidden % vec || std::int64_t(p.alignment) < vec * es)) vec /= 2;
    return Params{{"dtype", std::string(dtype_name(p.dtype))}, {"vec", vec}, {"weighted", weighted}};
  }
  Status check_rows(const Params& params, const Problem& p, std::int64_t hidden, std::int64_t weighted) const {
    KILN_TRY(check_dtype(name(), params, p));
    if (hidden < 1 || hidden >= (std::int64_t(1) << 31)) return shape_mismatch(std::string(name()) + ": hidden must be in [1, 2^31)");
    const auto vec = *params.get_int("vec");
    if (hidden % vec || std::int64_t(p.alignment) < vec * std::int64_t(dtype_size(p.dtype)))
      return invalid_argument(std::string(name()) + ": vec=" + std::to_string(vec) +
                              " needs hidden and the row buffers aligned to vec elements");
    if (weighted != *params.get_int("weighted"))
      return invalid_argument(std::string(name()) + ": kernel and problem disagree on weights");
    return {};
  }
  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    for (const Params& c : catalog())
      if (check_problem(c, p).ok()) out.push_back(c);
    return out;
  }
};

class MoeGather final : public RowFamily {
 public:
  std::string_view name() const override { return "moe_gather"; }
  int version() const override { return 1; }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<MoeGatherProblem>(
        {bucketed(&MoeGatherProblem::rows, "rows", "rows of out (sorted entries)"),
         key(&MoeGatherProblem::hidden, "hidden", "elements per row"),
         value(&MoeGatherProblem::tokens, "tokens", "rows of x"),
         value(&MoeGatherProblem::top_k, "top_k", "entries per token"),
         key(&MoeGatherProblem::weighted, "weighted", "1: rows scaled by weights[src_of]")});
    return fields;
  }
  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<MoeGatherProblem>();
    if (q.rows < 0 || q.rows >= (std::int64_t(1) << 31) || q.tokens < 0 || q.top_k < 1 ||
        q.tokens * q.top_k >= (std::int64_t(1) << 31))
      return shape_mismatch("moe_gather: need 0 <= rows, tokens x top_k < 2^31 and top_k >= 1");
    return check_rows(params, p, q.hidden, q.weighted);
  }
  LaunchGeometry geometry(const Params&, const Problem& p) const override {
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>(1, p.as<MoeGatherProblem>().rows));
    g.block.x = 128;
    return g;
  }
  Params heuristic(const Problem& p) const override {
    const auto q = p.as<MoeGatherProblem>();
    return pick(p, q.hidden, q.weighted);
  }
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    return Family::problem_from_shape(dtype, with_defaults(shape, {{"weighted", 0}}));
  }
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (auto [tokens, top_k, hidden] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{4096, 2, 4096},
                                         {4096, 8, 7168}, {16, 8, 7168}})
      out.push_back(Problem::of(dtype, 16, MoeGatherProblem{.rows = tokens * top_k, .hidden = hidden, .tokens = tokens,
                                                            .top_k = top_k}));
    return out;
  }
  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<MoeGatherProblem>();
    return {{"x", BufferRole::input, p.dtype, q.tokens * q.hidden},
            {"src_of", BufferRole::input, DType::i32, q.rows, std::max<std::int64_t>(1, q.tokens * q.top_k)},
            {"weights", BufferRole::input, DType::f32, q.weighted ? q.tokens * q.top_k : 1},
            {"out", BufferRole::output, p.dtype, q.rows * q.hidden}};
  }
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<MoeGatherProblem>();
    for (int i = 0; i < 4; ++i) out.add(b[i]);
    out.add(int(q.rows));
    out.add(int(q.tokens));
    out.add(int(q.top_k));
    out.add(int(q.hidden));
  }
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 4) return invalid_argument("moe_gather: reference takes 4 buffers (x, src_of, weights, out)");
    const auto q = p.as<MoeGatherProblem>();
    const auto* src_of = static_cast<const std::int32_t*>(b[1]);
    const auto* w = static_cast<const float*>(b[2]);
    for (std::int64_t r = 0; r < q.rows; ++r) {
      const std::int64_t src = src_of[r];
      const bool ok = src >= 0 && src / q.top_k < q.tokens;
      // The kernel rounds x * w once from fp32; so does the reference.
      const float scale = q.weighted && ok ? w[src] : 1.0f;
      for (std::int64_t c = 0; c < q.hidden; ++c) {
        const double v = ok ? double(float(load_as_double(b[0], p.dtype, (src / q.top_k) * q.hidden + c)) * scale) : 0.0;
        store_from_double(b[3], p.dtype, r * q.hidden + c, v);
      }
    }
    return {};
  }
};

class MoeCombine final : public RowFamily {
 public:
  std::string_view name() const override { return "moe_combine"; }
  int version() const override { return 1; }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<MoeCombineProblem>(
        {bucketed(&MoeCombineProblem::tokens, "tokens", "rows of out"),
         key(&MoeCombineProblem::hidden, "hidden", "elements per row"),
         value(&MoeCombineProblem::rows, "rows", "rows of y (sorted entries)"),
         key(&MoeCombineProblem::top_k, "top_k", "entries per token"),
         key(&MoeCombineProblem::weighted, "weighted", "1: entries weighted by the routing weights")});
    return fields;
  }
  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<MoeCombineProblem>();
    if (q.tokens < 0 || q.rows < 0 || q.rows >= (std::int64_t(1) << 31) || q.top_k < 1 ||
        q.tokens * q.top_k >= (std::int64_t(1) << 31))
      return shape_mismatch("moe_combine: need 0 <= rows, tokens x top_k < 2^31 and top_k >= 1");
    return check_rows(params, p, q.hidden, q.weighted);
  }
  LaunchGeometry geometry(const Params&, const Problem& p) const override {
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>(1, p.as<MoeCombineProblem>().tokens));
    g.block.x = 128;
    return g;
  }
  Params heuristic(const Problem& p) const override {
    const auto q = p.as<MoeCombineProblem>();
    return pick(p, q.hidden, q.weighted);
  }
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    return Family::problem_from_shape(dtype, with_defaults(shape, {{"weighted", 1}}));
  }
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (auto [tokens, top_k, hidden] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{4096, 2, 4096},
                                         {4096, 8, 7168}, {16, 8, 7168}})
      out.push_back(Problem::of(dtype, 16, MoeCombineProblem{.tokens = tokens, .hidden = hidden, .rows = tokens * top_k,
                                                             .top_k = top_k, .weighted = 1}));
    return out;
  }
  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<MoeCombineProblem>();
    return {{"y", BufferRole::input, p.dtype, q.rows * q.hidden},
            {"row_of", BufferRole::input, DType::i32, q.tokens * q.top_k, std::max<std::int64_t>(1, q.rows)},
            {"weights", BufferRole::input, DType::f32, q.weighted ? q.tokens * q.top_k : 1},
            {"out", BufferRole::output, p.dtype, q.tokens * q.hidden}};
  }
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<MoeCombineProblem>();
    for (int i = 0; i < 4; ++i) out.add(b[i]);
    out.add(int(q.tokens));
    out.add(int(q.rows));
    out.add(int(q.top_k));
    out.add(int(q.hidden));
  }
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 4) return invalid_argument("moe_combine: reference takes 4 buffers (y, row_of, weights, out)");
    const auto q = p.as<MoeCombineProblem>();
    const auto* row_of = static_cast<const std::int32_t*>(b[1]);
    const auto* w = static_cast<const float*>(b[2]);
    for (std::int64_t t = 0; t < q.tokens; ++t)
      for (std::int64_t c = 0; c < q.hidden; ++c) {
        double acc = 0;
        for (std::int64_t j = 0; j < q.top_k; ++j) {
          const std::int64_t r = row_of[t * q.top_k + j];
          if (r < 0 || r >= q.rows) continue;
          acc += (q.weighted ? double(w[t * q.top_k + j]) : 1.0) * load_as_double(b[0], p.dtype, r * q.hidden + c);
        }
        store_from_double(b[3], p.dtype, t * q.hidden + c, acc);
      }
    return {};
  }
};

}  // namespace
}  // namespace kiln::families::moe

void kiln_register_kernels_moe_routing(kiln::Registry& r) {
  using namespace kiln::families::moe;
  (void)r.add(std::make_shared<MoeTopk>());
  (void)r.add(std::make_shared<MoeSort>());
  (void)r.add(std::make_shared<MoeGather>());
  (void)r.add(std::make_shared<MoeCombine>());
}
