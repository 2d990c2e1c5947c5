// The MoE typed ops (families/moe/ops.h) and their declarations (kiln/op.h).
#include "families/moe/ops.h"

#include <string>
#include <vector>

#include "client/validate.h"
#include "client/workspace.h"
#include "families/moe/moe.h"
#include "kiln/family.h"
#include "kiln/op.h"

namespace kiln {
namespace {

namespace m = families::moe;

std::string shape_text(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

bool has_shape(const TensorView& t, std::initializer_list<std::int64_t> shape) {
  if (t.rank != int(shape.size())) return false;
  int i = 0;
  for (auto v : shape)
    if (t.shape[i++] != v) return false;
  return true;
}

Status want_shape(const char* op, const char* name, const TensorView& t, std::initializer_list<std::int64_t> shape) {
  if (has_shape(t, shape)) return {};
  std::string s = "[";
  int i = 0;
  for (auto v : shape) s += (i++ ? ", " : "") + std::to_string(v);
  return shape_mismatch(std::string(op) + ": " + name + " must have shape " + s + "], got " + shape_text(t));
}

Status want_dtype(const char* op, const char* name, const TensorView& t, DType d) {
  if (t.dtype == d) return {};
  return unsupported_dtype(std::string(op) + ": " + name + " must be " + dtype_name(d) + ", got " + dtype_name(t.dtype));
}

// Contiguous, and aligned to `bytes`.
Status want_layout(const char* op, const char* name, const TensorView& t, std::uintptr_t bytes) {
  if (!t.is_contiguous()) return shape_mismatch(std::string(op) + ": " + name + " must be contiguous");
  if (reinterpret_cast<std::uintptr_t>(t.data) % bytes)
    return invalid_argument(std::string(op) + ": " + name + " must be " + std::to_string(bytes) + "-byte aligned");
  return {};
}

// Every tensor on the first one's device kind, and on one GPU.
Result<DeviceKind> common_device(const char* op, std::initializer_list<std::pair<const TensorView*, const char*>> ts) {
  const TensorView& first = *ts.begin()->first;
  const DeviceKind where = first.device.kind;
  for (const auto& [t, name] : ts) {
    if (!t) continue;
    KILN_TRY(client::check_device(*t, name, where));
    if (where == DeviceKind::cuda && t->device.index != first.device.index)
      return device_error(std::string(op) + ": tensors are on different GPUs");
  }
  return where;
}

Status dispatch(const char* family, const Problem& p, std::span<void* const> buffers, DeviceKind where, Stream stream,
                Runtime* runtime) {
  return client::run_family(Registry::global().find(family), family, p, buffers, where, stream, runtime);
}

// The widest power of two up to 16 dividing every address and the row length in bytes.
std::uint32_t alignment_of(std::initializer_list<const void*> ptrs, std::int64_t row_bytes) {
  std::uint32_t a = 16;
  for (const void* p : ptrs)
    while (a > 1 && reinterpret_cast<std::uintptr_t>(p) % a) a /= 2;
  while (a > 1 && row_bytes % a) a /= 2;
  return a;
}

// Host offsets (cumulative ends) must be non-decreasing, from 0, within the rows.
Status check_host_offsets(const char* op, const TensorView& offs, std::int64_t rows, bool counts) {
  const auto* v = static_cast<const std::int32_t*>(offs.data);
  std::int64_t prev = 0;
  for (std::int64_t e = 0; e < offs.numel(); ++e) {
    if (counts ? (v[e] < 0 || v[e] > rows) : (v[e] < prev || v[e] > rows))
      return invalid_argument(std::string(op) + ": " + (counts ? "counts" : "offsets") + "[" + std::to_string(e) +
                              "] = " + std::to_string(v[e]) +
                              (counts ? " is outside [0, max_tokens = " : " is not within [previous offset, rows = ") +
                              std::to_string(rows) + "]");
    prev = v[e];
  }
  return {};
}

Status check_half(const char* op, std::initializer_list<std::pair<const TensorView*, const char*>> ts) {
  const DType d = ts.begin()->first->dtype;
  if (d != DType::f16 && d != DType::bf16)
    return unsupported_dtype(std::string(op) + ": " + ts.begin()->second + " has dtype " + dtype_name(d) +
                             "; expected f16 or bf16");
  for (const auto& [t, name] : ts)
    if (t->dtype != d)
      return unsupported_dtype(std::string(op) + ": " + name + " has dtype " + dtype_name(t->dtype) + ", " +
                               ts.begin()->second + " has " + dtype_name(d));
  return {};
}

Status run_grouped(const char* op, const TensorView& a, const TensorView& b, const TensorView& offs,
                   const TensorView& out, m::Layout layout, std::int64_t mm, std::int64_t n, std::int64_t k,
                   std::int64_t experts, Stream stream, Runtime* runtime) {
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&b, layout == m::k_kgrouped ? "b" : "weight"}, {&out, "out"}})
    KILN_TRY(want_layout(op, name, *t, 16));
  KILN_TRY(want_layout(op, layout == m::k_masked ? "counts" : "offs", offs, 4));
  if (experts < 1 || experts > m::k_max_experts)
    return shape_mismatch(std::string(op) + ": experts must be in [1, " + std::to_string(m::k_max_experts) + "], got " +
                          std::to_string(experts));
  if (k % 8) return shape_mismatch(std::string(op) + ": k = " + std::to_string(k) + " must be a multiple of 8");
  if ((layout == m::k_kgrouped || layout == m::k_dgrad) && n % 8)
    return shape_mismatch(std::string(op) + ": n = " + std::to_string(n) + " must be a multiple of 8");
  KILN_ASSIGN_OR_RETURN(DeviceKind where,
                        common_device(op, {{&a, "a"}, {&b, "b"}, {&offs, "offs"}, {&out, "out"}}));
  if (where == DeviceKind::cpu) KILN_TRY(check_host_offsets(op, offs, mm, layout == m::k_masked));
  // Empty products: nothing to write (no rows, an empty out), or zeros (kgrouped without rows,
  // contiguous and masked with k = 0: every row, the uncovered ones too).
  if (out.numel() == 0) return {};
  if (layout == m::k_kgrouped ? mm == 0 : k == 0) return client::fill(out, where, stream);
  if (mm == 0) return {};
  const Problem p =
      Problem::of(a.dtype, 16, m::GroupedGemmProblem{.m = mm, .n = n, .k = k, .experts = experts, .layout = layout});
  void* buffers[4] = {a.data, b.data, offs.data, out.data};
  return dispatch("grouped_gemm", p, buffers, where, stream, runtime);
}

}  // namespace

Status moe_topk(const TensorView& logits, const TensorView* bias, const TensorView& weights, const TensorView& ids,
                MoeScoring scoring, bool renormalize, std::int64_t n_group, std::int64_t topk_group, double scale,
                Stream stream, Runtime* runtime) {
  constexpr const char* op = "moe_topk";
  KILN_TRY(client::check_view(logits, "logits"));
  KILN_TRY(client::check_view(weights, "weights"));
  KILN_TRY(client::check_view(ids, "ids"));
  if (bias) KILN_TRY(client::check_view(*bias, "bias"));
  KILN_TRY(client::check_float_dtype(logits, "logits"));
  KILN_TRY(want_dtype(op, "weights", weights, DType::f32));
  KILN_TRY(want_dtype(op, "ids", ids, DType::i32));
  if (scoring != MoeScoring::softmax && scoring != MoeScoring::sigmoid_group)
    return invalid_argument("moe_topk: unknown scoring " + std::to_string(int(scoring)));
  const bool sig = scoring == MoeScoring::sigmoid_group;
  if (logits.rank != 2) return shape_mismatch("moe_topk: logits must be [tokens, experts], got " + shape_text(logits));
  const std::int64_t tokens = logits.shape[0], experts = logits.shape[1];
  if (weights.rank != 2 || weights.shape[0] != tokens)
    return shape_mismatch("moe_topk: weights must be [" + std::to_string(tokens) + ", top_k], got " + shape_text(weights));
  const std::int64_t top_k = weights.shape[1];
  KILN_TRY(want_shape(op, "ids", ids, {tokens, top_k}));
  if (sig && !bias) return invalid_argument("moe_topk: sigmoid_group scoring needs bias [experts] f32");
  if (bias) {
    KILN_TRY(want_dtype(op, "bias", *bias, DType::f32));
    KILN_TRY(want_shape(op, "bias", *bias, {experts}));
    KILN_TRY(want_layout(op, "bias", *bias, 4));
  }
  KILN_TRY(want_layout(op, "logits", logits, dtype_size(logits.dtype)));
  KILN_TRY(want_layout(op, "weights", weights, 4));
  KILN_TRY(want_layout(op, "ids", ids, 4));
  const m::MoeTopkProblem q{.tokens = tokens, .experts = experts, .top_k = top_k,
                            .scoring = sig ? m::k_sigmoid_group : m::k_softmax, .n_group = sig ? n_group : 1,
                            .topk_group = sig ? topk_group : 1, .renormalize = renormalize ? 1 : 0, .scale = scale};
  // The family's own rules (experts, top_k, groups) as typed errors before anything runs.
  const Family* f = Registry::global().find("moe_topk");
  const Problem p = Problem::of(logits.dtype, 16, q);
  if (f) KILN_TRY(f->check_problem(f->heuristic(p), p));
  KILN_ASSIGN_OR_RETURN(DeviceKind where,
                        common_device(op, {{&logits, "logits"}, {bias, "bias"}, {&weights, "weights"}, {&ids, "ids"}}));
  if (tokens == 0) return {};
  float one = 0.0f;
  void* buffers[4] = {logits.data, bias ? bias->data : &one, weights.data, ids.data};
  if (!bias && where == DeviceKind::cuda) buffers[1] = weights.data;  // never read: softmax scoring
  return dispatch("moe_topk", p, buffers, where, stream, runtime);
}

Status moe_permute(const TensorView& x, const TensorView& ids, const TensorView& x_sorted, const TensorView& offsets,
                   const TensorView& row_of, const TensorView& src_of, Stream stream, Runtime* runtime) {
  constexpr const char* op = "moe_permute";
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&ids, "ids"}, {&x_sorted, "x_sorted"}, {&offsets, "offsets"},
                                {&row_of, "row_of"}, {&src_of, "src_of"}})
    KILN_TRY(client::check_view(*t, name));
  KILN_TRY(client::check_float_dtype(x, "x"));
  if (x_sorted.dtype != x.dtype) return unsupported_dtype("moe_permute: x_sorted must have x's dtype");
  for (const auto& [t, name] : {std::pair{&ids, "ids"}, {&offsets, "offsets"}, {&row_of, "row_of"}, {&src_of, "src_of"}})
    KILN_TRY(want_dtype(op, name, *t, DType::i32));
  if (x.rank != 2) return shape_mismatch("moe_permute: x must be [tokens, hidden], got " + shape_text(x));
  const std::int64_t tokens = x.shape[0], hidden = x.shape[1];
  if (ids.rank != 2 || ids.shape[0] != tokens)
    return shape_mismatch("moe_permute: ids must be [" + std::to_string(tokens) + ", top_k], got " + shape_text(ids));
  const std::int64_t top_k = ids.shape[1], n = tokens * top_k;
  if (offsets.rank != 1 || offsets.shape[0] < 2)
    return shape_mismatch("moe_permute: offsets must be [experts + 1], got " + shape_text(offsets));
  const std::int64_t experts = offsets.shape[0] - 1;
  if (experts > m::k_max_experts)
    return shape_mismatch("moe_permute: at most " + std::to_string(m::k_max_experts) + " experts");
  if (top_k < 1) return shape_mismatch("moe_permute: top_k must be at least 1");
  if (n >= (std::int64_t(1) << 31)) return shape_mismatch("moe_permute: tokens x top_k must be below 2^31");
  KILN_TRY(want_shape(op, "x_sorted", x_sorted, {n, hidden}));
  KILN_TRY(want_shape(op, "row_of", row_of, {tokens, top_k}));
  KILN_TRY(want_shape(op, "src_of", src_of, {n}));
  KILN_TRY(want_layout(op, "x", x, dtype_size(x.dtype)));
  KILN_TRY(want_layout(op, "x_sorted", x_sorted, dtype_size(x.dtype)));
  for (const auto& [t, name] : {std::pair{&ids, "ids"}, {&offsets, "offsets"}, {&row_of, "row_of"}, {&src_of, "src_of"}})
    KILN_TRY(want_layout(op, name, *t, 4));
  KILN_ASSIGN_OR_RETURN(DeviceKind where, common_device(op, {{&x, "x"}, {&ids, "ids"}, {&x_sorted, "x_sorted"},
                                                             {&offsets, "offsets"}, {&row_of, "row_of"},
                                                             {&src_of, "src_of"}}));
  if (where == DeviceKind::cpu) {
    const auto* v = static_cast<const std::int32_t*>(ids.data);
    for (std::int64_t i = 0; i < n; ++i)
      if (v[i] < 0 || v[i] >= experts)
        return invalid_argument("moe_permute: ids[" + std::to_string(i / top_k) + ", " + std::to_string(i % top_k) +
                                "] = " + std::to_string(v[i]) + " is not an expert in [0, " + std::to_string(experts) +
                                ")");
  }
  void* sort_buffers[4] = {ids.data, offsets.data, row_of.data, src_of.data};
  if (n == 0) return client::fill(offsets, where, stream);  // no entries: every expert is empty
  KILN_TRY(dispatch("moe_sort", Problem::of(DType::f32, 16, m::MoeSortProblem{.n = n, .experts = experts}),
                    sort_buffers, where, stream, runtime));
  if (hidden == 0) return {};
  const std::uint32_t align = alignment_of({x.data, x_sorted.data}, hidden * std::int64_t(dtype_size(x.dtype)));
  const Problem p = Problem::of(
      x.dtype, align, m::MoeGatherProblem{.rows = n, .hidden = hidden, .tokens = tokens, .top_k = top_k, .weighted = 0});
  float one = 1.0f;
  void* gather_buffers[4] = {x.data, src_of.data, where == DeviceKind::cpu ? static_cast<void*>(&one) : src_of.data,
                             x_sorted.data};
  return dispatch("moe_gather", p, gather_buffers, where, stream, runtime);
}

Status moe_gather(const TensorView& x, const TensorView& src_of, const TensorView* weights, const TensorView& out,
                  std::int64_t top_k, Stream stream, Runtime* runtime) {
  constexpr const char* op = "moe_gather";
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_view(src_of, "src_of"));
  KILN_TRY(client::check_view(out, "out"));
  if (weights) KILN_TRY(client::check_view(*weights, "weights"));
  KILN_TRY(client::check_float_dtype(x, "x"));
  if (out.dtype != x.dtype) return unsupported_dtype("moe_gather: out must have x's dtype");
  KILN_TRY(want_dtype(op, "src_of", src_of, DType::i32));
  if (x.rank != 2) return shape_mismatch("moe_gather: x must be [tokens, hidden], got " + shape_text(x));
  const std::int64_t tokens = x.shape[0], hidden = x.shape[1];
  if (src_of.rank != 1) return shape_mismatch("moe_gather: src_of must be [rows], got " + shape_text(src_of));
  const std::int64_t rows = src_of.shape[0];
  if (top_k < 1 || top_k > m::k_max_top_k) return invalid_argument("moe_gather: top_k must be in [1, 32]");
  KILN_TRY(want_shape(op, "out", out, {rows, hidden}));
  if (weights) {
    KILN_TRY(want_dtype(op, "weights", *weights, DType::f32));
    KILN_TRY(want_shape(op, "weights", *weights, {tokens, top_k}));
    KILN_TRY(want_layout(op, "weights", *weights, 4));
  }
  KILN_TRY(want_layout(op, "x", x, dtype_size(x.dtype)));
  KILN_TRY(want_layout(op, "out", out, dtype_size(x.dtype)));
  KILN_TRY(want_layout(op, "src_of", src_of, 4));
  KILN_ASSIGN_OR_RETURN(DeviceKind where, common_device(op, {{&x, "x"}, {&src_of, "src_of"}, {weights, "weights"},
                                                             {&out, "out"}}));
  if (where == DeviceKind::cpu) {
    const auto* v = static_cast<const std::int32_t*>(src_of.data);
    for (std::int64_t r = 0; r < rows; ++r)
      if (v[r] >= tokens * top_k)
        return invalid_argument("moe_gather: src_of[" + std::to_string(r) + "] = " + std::to_string(v[r]) +
                                " is past tokens x top_k");
  }
  if (rows == 0 || hidden == 0) return {};
  const std::uint32_t align = alignment_of({x.data, out.data}, hidden * std::int64_t(dtype_size(x.dtype)));
  const Problem p = Problem::of(x.dtype, align,
                                m::MoeGatherProblem{.rows = rows, .hidden = hidden, .tokens = tokens, .top_k = top_k,
                                                    .weighted = weights ? 1 : 0});
  float one = 1.0f;
  void* buffers[4] = {x.data, src_of.data, weights ? weights->data : (where == DeviceKind::cpu ? &one : src_of.data),
                      out.data};
  return dispatch("moe_gather", p, buffers, where, stream, runtime);
}

Status moe_combine(const TensorView& y, const TensorView& row_of, const TensorView* weights, const TensorView& out,
                   Stream stream, Runtime* runtime) {
  constexpr const char* op = "moe_combine";
  KILN_TRY(client::check_view(y, "y"));
  KILN_TRY(client::check_view(row_of, "row_of"));
  KILN_TRY(client::check_view(out, "out"));
  if (weights) KILN_TRY(client::check_view(*weights, "weights"));
  KILN_TRY(client::check_float_dtype(y, "y"));
  if (out.dtype != y.dtype) return unsupported_dtype("moe_combine: out must have y's dtype");
  KILN_TRY(want_dtype(op, "row_of", row_of, DType::i32));
  if (y.rank != 2) return shape_mismatch("moe_combine: y must be [rows, hidden], got " + shape_text(y));
  const std::int64_t rows = y.shape[0], hidden = y.shape[1];
  if (row_of.rank != 2) return shape_mismatch("moe_combine: row_of must be [tokens, top_k], got " + shape_text(row_of));
  const std::int64_t tokens = row_of.shape[0], top_k = row_of.shape[1];
  if (top_k < 1) return shape_mismatch("moe_combine: top_k must be at least 1");
  KILN_TRY(want_shape(op, "out", out, {tokens, hidden}));
  if (weights) {
    KILN_TRY(want_dtype(op, "weights", *weights, DType::f32));
    KILN_TRY(want_shape(op, "weights", *weights, {tokens, top_k}));
    KILN_TRY(want_layout(op, "weights", *weights, 4));
  }
  KILN_TRY(want_layout(op, "y", y, dtype_size(y.dtype)));
  KILN_TRY(want_layout(op, "out", out, dtype_size(y.dtype)));
  KILN_TRY(want_layout(op, "row_of", row_of, 4));
  KILN_ASSIGN_OR_RETURN(DeviceKind where, common_device(op, {{&y, "y"}, {&row_of, "row_of"}, {weights, "weights"},
                                                             {&out, "out"}}));
  if (where == DeviceKind::cpu) {
    const auto* v = static_cast<const std::int32_t*>(row_of.data);
    for (std::int64_t i = 0; i < tokens * top_k; ++i)
      if (v[i] >= rows)
        return invalid_argument("moe_combine: row_of[" + std::to_string(i / top_k) + ", " + std::to_string(i % top_k) +
                                "] = " + std::to_string(v[i]) + " is past the " + std::to_string(rows) + " rows of y");
  }
  if (tokens == 0 || hidden == 0) return {};
  const std::uint32_t align = alignment_of({y.data, out.data}, hidden * std::int64_t(dtype_size(y.dtype)));
  const Problem p = Problem::of(y.dtype, align,
                                m::MoeCombineProblem{.tokens = tokens, .hidden = hidden, .rows = rows, .top_k = top_k,
                                                     .weighted = weights ? 1 : 0});
  float one = 1.0f;
  void* buffers[4] = {y.data, row_of.data, weights ? weights->data : (where == DeviceKind::cpu ? &one : row_of.data),
                      out.data};
  return dispatch("moe_combine", p, buffers, where, stream, runtime);
}

Status grouped_gemm(const TensorView& a, const TensorView& weight, const TensorView& offs, const TensorView& out,
                    Stream stream, Runtime* runtime) {
  constexpr const char* op = "grouped_gemm";
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&weight, "weight"}, {&offs, "offs"}, {&out, "out"}})
    KILN_TRY(client::check_view(*t, name));
  KILN_TRY(check_half(op, {{&a, "a"}, {&weight, "weight"}, {&out, "out"}}));
  KILN_TRY(want_dtype(op, "offs", offs, DType::i32));
  if (a.rank != 2) return shape_mismatch("grouped_gemm: a must be [m, k], got " + shape_text(a));
  if (weight.rank != 3) return shape_mismatch("grouped_gemm: weight must be [experts, n, k], got " + shape_text(weight));
  const std::int64_t mm = a.shape[0], k = a.shape[1], experts = weight.shape[0], n = weight.shape[1];
  if (weight.shape[2] != k)
    return shape_mismatch("grouped_gemm: a is " + shape_text(a) + " but weight is " + shape_text(weight) +
                          " (k does not match)");
  KILN_TRY(want_shape(op, "offs", offs, {experts}));
  KILN_TRY(want_shape(op, "out", out, {mm, n}));
  return run_grouped(op, a, weight, offs, out, m::k_contiguous, mm, n, k, experts, stream, runtime);
}

Status grouped_gemm_masked(const TensorView& a, const TensorView& weight, const TensorView& counts,
                           const TensorView& out, Stream stream, Runtime* runtime) {
  constexpr const char* op = "grouped_gemm_masked";
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&weight, "weight"}, {&counts, "counts"}, {&out, "out"}})
    KILN_TRY(client::check_view(*t, name));
  KILN_TRY(check_half(op, {{&a, "a"}, {&weight, "weight"}, {&out, "out"}}));
  KILN_TRY(want_dtype(op, "counts", counts, DType::i32));
  if (a.rank != 3) return shape_mismatch("grouped_gemm_masked: a must be [experts, max_tokens, k], got " + shape_text(a));
  if (weight.rank != 3)
    return shape_mismatch("grouped_gemm_masked: weight must be [experts, n, k], got " + shape_text(weight));
  const std::int64_t experts = a.shape[0], mm = a.shape[1], k = a.shape[2], n = weight.shape[1];
  if (weight.shape[0] != experts || weight.shape[2] != k)
    return shape_mismatch("grouped_gemm_masked: a is " + shape_text(a) + " but weight is " + shape_text(weight) +
                          " (experts or k do not match)");
  KILN_TRY(want_shape(op, "counts", counts, {experts}));
  KILN_TRY(want_shape(op, "out", out, {experts, mm, n}));
  return run_grouped(op, a, weight, counts, out, m::k_masked, mm, n, k, experts, stream, runtime);
}

Status grouped_gemm_dgrad(const TensorView& a, const TensorView& weight, const TensorView& offs, const TensorView& out,
                          Stream stream, Runtime* runtime) {
  constexpr const char* op = "grouped_gemm_dgrad";
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&weight, "weight"}, {&offs, "offs"}, {&out, "out"}})
    KILN_TRY(client::check_view(*t, name));
  KILN_TRY(check_half(op, {{&a, "a"}, {&weight, "weight"}, {&out, "out"}}));
  KILN_TRY(want_dtype(op, "offs", offs, DType::i32));
  if (a.rank != 2) return shape_mismatch("grouped_gemm_dgrad: a must be [m, k], got " + shape_text(a));
  if (weight.rank != 3)
    return shape_mismatch("grouped_gemm_dgrad: weight must be [experts, k, n], got " + shape_text(weight));
  const std::int64_t mm = a.shape[0], k = a.shape[1], experts = weight.shape[0], n = weight.shape[2];
  if (weight.shape[1] != k)
    return shape_mismatch("grouped_gemm_dgrad: a is " + shape_text(a) + " but weight is " + shape_text(weight) +
                          " (k does not match)");
  KILN_TRY(want_shape(op, "offs", offs, {experts}));
  KILN_TRY(want_shape(op, "out", out, {mm, n}));
  return run_grouped(op, a, weight, offs, out, m::k_dgrad, mm, n, k, experts, stream, runtime);
}

Status grouped_gemm_wgrad(const TensorView& a, const TensorView& b, const TensorView& offs, const TensorView& out,
                          Stream stream, Runtime* runtime) {
  constexpr const char* op = "grouped_gemm_wgrad";
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&b, "b"}, {&offs, "offs"}, {&out, "out"}})
    KILN_TRY(client::check_view(*t, name));
  KILN_TRY(check_half(op, {{&a, "a"}, {&b, "b"}, {&out, "out"}}));
  KILN_TRY(want_dtype(op, "offs", offs, DType::i32));
  if (a.rank != 2 || b.rank != 2 || a.shape[0] != b.shape[0])
    return shape_mismatch("grouped_gemm_wgrad: a [m, n] and b [m, k] must be matrices with the same rows, got " +
                          shape_text(a) + " and " + shape_text(b));
  if (offs.rank != 1) return shape_mismatch("grouped_gemm_wgrad: offs must be [experts], got " + shape_text(offs));
  const std::int64_t mm = a.shape[0], n = a.shape[1], k = b.shape[1], experts = offs.shape[0];
  KILN_TRY(want_shape(op, "out", out, {experts, n, k}));
  return run_grouped(op, a, b, offs, out, m::k_kgrouped, mm, n, k, experts, stream, runtime);
}

namespace {

Status run_fp8(const char* op, const TensorView& a, const TensorView& weight, const TensorView& offs,
               const TensorView& a_scale, const TensorView& b_scale, const TensorView& out, bool masked, Stream stream,
               Runtime* runtime) {
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&weight, "weight"}, {&offs, masked ? "counts" : "offs"},
                                {&a_scale, "a_scale"}, {&b_scale, "b_scale"}, {&out, "out"}})
    KILN_TRY(client::check_view(*t, name));
  KILN_TRY(want_dtype(op, "a", a, DType::u8));
  KILN_TRY(want_dtype(op, "weight", weight, DType::u8));
  KILN_TRY(want_dtype(op, masked ? "counts" : "offs", offs, DType::i32));
  KILN_TRY(want_dtype(op, "a_scale", a_scale, DType::f32));
  KILN_TRY(want_dtype(op, "b_scale", b_scale, DType::f32));
  if (out.dtype != DType::f16 && out.dtype != DType::bf16)
    return unsupported_dtype(std::string(op) + ": out has dtype " + dtype_name(out.dtype) + "; expected f16 or bf16");
  if (a.rank != (masked ? 3 : 2) || weight.rank != 3)
    return shape_mismatch(std::string(op) + ": a must be " + (masked ? "[experts, max_tokens, k]" : "[m, k]") +
                          " and weight [experts, n, k], got " + shape_text(a) + " and " + shape_text(weight));
  const std::int64_t experts = weight.shape[0], n = weight.shape[1], k = weight.shape[2];
  const std::int64_t mm = masked ? a.shape[1] : a.shape[0];
  if (a.shape[a.rank - 1] != k || (masked && a.shape[0] != experts))
    return shape_mismatch(std::string(op) + ": a is " + shape_text(a) + " but weight is " + shape_text(weight));
  KILN_TRY(want_shape(op, masked ? "counts" : "offs", offs, {experts}));
  if (masked)
    KILN_TRY(want_shape(op, "out", out, {experts, mm, n}));
  else
    KILN_TRY(want_shape(op, "out", out, {mm, n}));
  // Rowwise: a_scale has a's leading shape, b_scale [experts, n]; block: a_scale adds ceil(k/128)
  // blocks per row, b_scale is [experts, ceil(n/128), ceil(k/128)].
  const std::int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
  const bool block = a_scale.rank == a.rank;
  if (block) {
    if (masked)
      KILN_TRY(want_shape(op, "a_scale", a_scale, {experts, mm, kb}));
    else
      KILN_TRY(want_shape(op, "a_scale", a_scale, {mm, kb}));
    KILN_TRY(want_shape(op, "b_scale", b_scale, {experts, nb, kb}));
  } else {
    if (masked)
      KILN_TRY(want_shape(op, "a_scale", a_scale, {experts, mm}));
    else
      KILN_TRY(want_shape(op, "a_scale", a_scale, {mm}));
    KILN_TRY(want_shape(op, "b_scale", b_scale, {experts, n}));
  }
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&weight, "weight"}, {&out, "out"}}) KILN_TRY(want_layout(op, name, *t, 16));
  for (const auto& [t, name] : {std::pair{&offs, "offs"}, {&a_scale, "a_scale"}, {&b_scale, "b_scale"}})
    KILN_TRY(want_layout(op, name, *t, 4));
  if (experts < 1 || experts > m::k_max_experts)
    return shape_mismatch(std::string(op) + ": experts must be in [1, " + std::to_string(m::k_max_experts) + "]");
  if (k % 16) return shape_mismatch(std::string(op) + ": k = " + std::to_string(k) + " must be a multiple of 16");
  KILN_ASSIGN_OR_RETURN(DeviceKind where, common_device(op, {{&a, "a"}, {&weight, "weight"}, {&offs, "offs"},
                                                             {&a_scale, "a_scale"}, {&b_scale, "b_scale"}, {&out, "out"}}));
  if (where == DeviceKind::cpu) KILN_TRY(check_host_offsets(op, offs, mm, masked));
  if (out.numel() == 0) return {};
  if (k == 0) return client::fill(out, where, stream);
  if (mm == 0) return {};
  const Problem p = Problem::of(
      out.dtype, 16,
      m::GroupedGemmFp8Problem{.m = mm, .n = n, .k = k, .experts = experts,
                               .layout = masked ? m::k_masked : m::k_contiguous,
                               .scaling = block ? m::k_fp8_block : m::k_fp8_rowwise});
  void* buffers[6] = {a.data, weight.data, offs.data, a_scale.data, b_scale.data, out.data};
  return dispatch("grouped_gemm_fp8", p, buffers, where, stream, runtime);
}

}  // namespace

Status grouped_gemm_fp8(const TensorView& a, const TensorView& weight, const TensorView& offs,
                        const TensorView& a_scale, const TensorView& b_scale, const TensorView& out, Stream stream,
                        Runtime* runtime) {
  return run_fp8("grouped_gemm_fp8", a, weight, offs, a_scale, b_scale, out, false, stream, runtime);
}

Status grouped_gemm_fp8_masked(const TensorView& a, const TensorView& weight, const TensorView& counts,
                               const TensorView& a_scale, const TensorView& b_scale, const TensorView& out,
                               Stream stream, Runtime* runtime) {
  return run_fp8("grouped_gemm_fp8_masked", a, weight, counts, a_scale, b_scale, out, true, stream, runtime);
}

Status fused_moe(const TensorView& x, const TensorView& router_logits, const TensorView& w_gate_up,
                 const TensorView& w_down, const TensorView& out, std::int64_t top_k, Activation act,
                 bool renormalize, Stream stream, Runtime* runtime) {
  constexpr const char* op = "fused_moe";
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&router_logits, "router_logits"}, {&w_gate_up, "w_gate_up"},
                                {&w_down, "w_down"}, {&out, "out"}})
    KILN_TRY(client::check_view(*t, name));
  KILN_TRY(check_half(op, {{&x, "x"}, {&w_gate_up, "w_gate_up"}, {&w_down, "w_down"}, {&out, "out"}}));
  KILN_TRY(client::check_float_dtype(router_logits, "router_logits"));
  if (x.rank != 2 || router_logits.rank != 2 || w_gate_up.rank != 3 || w_down.rank != 3)
    return shape_mismatch("fused_moe: x [tokens, hidden], router_logits [tokens, experts], w_gate_up [experts, 2 inter, "
                          "hidden] and w_down [experts, hidden, inter] expected");
  const std::int64_t tokens = x.shape[0], hidden = x.shape[1], experts = router_logits.shape[1];
  const std::int64_t inter = w_down.shape[2];
  KILN_TRY(want_shape(op, "router_logits", router_logits, {tokens, experts}));
  KILN_TRY(want_shape(op, "w_gate_up", w_gate_up, {experts, 2 * inter, hidden}));
  KILN_TRY(want_shape(op, "w_down", w_down, {experts, hidden, inter}));
  KILN_TRY(want_shape(op, "out", out, {tokens, hidden}));
  if (hidden % 8 || inter % 8)
    return shape_mismatch("fused_moe: hidden and inter must be multiples of 8, got " + std::to_string(hidden) + " and " +
                          std::to_string(inter));
  if (top_k < 1 || top_k > std::min<std::int64_t>(experts, m::k_max_top_k))
    return invalid_argument("fused_moe: top_k must be in [1, min(experts, 32)], got " + std::to_string(top_k));
  if (act != Activation::silu && act != Activation::gelu && act != Activation::gelu_tanh)
    return invalid_argument("fused_moe: unknown activation " + std::to_string(int(act)));
  KILN_ASSIGN_OR_RETURN(DeviceKind where, common_device(op, {{&x, "x"}, {&router_logits, "router_logits"},
                                                             {&w_gate_up, "w_gate_up"}, {&w_down, "w_down"},
                                                             {&out, "out"}}));
  if (tokens == 0) return {};
  // The intermediates, each 16-byte aligned in one block: weights, ids, offsets, row_of, src_of,
  // x_sorted, gate_up, act, y_sorted.
  const std::int64_t n = tokens * top_k, es = std::int64_t(dtype_size(x.dtype));
  const std::int64_t sizes[9] = {n * 4, n * 4, (experts + 1) * 4, n * 4, n * 4, n * hidden * es, n * 2 * inter * es,
                                 n * inter * es, n * hidden * es};
  std::int64_t at[9], total = 0;
  for (int i = 0; i < 9; ++i) {
    at[i] = total;
    total += (sizes[i] + 15) / 16 * 16;
  }
  std::vector<std::uint64_t> host;
  client::StreamWorkspace scratch;
  char* base;
  if (where == DeviceKind::cpu) {
    host.resize(std::size_t(total / 8 + 2));
    base = reinterpret_cast<char*>(host.data());
  } else {
    KILN_ASSIGN_OR_RETURN(scratch, client::StreamWorkspace::get(x.device.index, stream, total / 4 + 4));
    base = static_cast<char*>(scratch.data());
  }
  auto view = [&](int i, DType t, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(base + at[i], t, shape, x.device);
  };
  const TensorView weights = view(0, DType::f32, {tokens, top_k}), ids = view(1, DType::i32, {tokens, top_k});
  const TensorView offsets = view(2, DType::i32, {experts + 1}), row_of = view(3, DType::i32, {tokens, top_k});
  const TensorView src_of = view(4, DType::i32, {n}), xs = view(5, x.dtype, {n, hidden});
  const TensorView h = view(6, x.dtype, {n, 2 * inter}), a = view(7, x.dtype, {n, inter});
  const TensorView ys = view(8, x.dtype, {n, hidden});
  const TensorView ends = TensorView::contiguous(base + at[2] + 4, DType::i32, {experts}, x.device);
  KILN_TRY(moe_topk(router_logits, nullptr, weights, ids, MoeScoring::softmax, renormalize, 1, 1, 1.0, stream, runtime));
  KILN_TRY(moe_permute(x, ids, xs, offsets, row_of, src_of, stream, runtime));
  KILN_TRY(grouped_gemm(xs, w_gate_up, ends, h, stream, runtime));
  KILN_TRY(act_and_mul(h, a, act, stream, runtime));
  KILN_TRY(grouped_gemm(a, w_down, ends, ys, stream, runtime));
  return moe_combine(ys, row_of, &weights, out, stream, runtime);
}

}  // namespace kiln

// ---- declarations (kiln/op.h) ----

namespace {

// An op's output_dtype choice (0 f16, 1 bf16) against the out tensor it was given.
kiln::Status check_output_dtype(const char* op, const kiln::TensorView& out, std::int64_t choice) {
  const kiln::DType want = choice == 0 ? kiln::DType::f16 : kiln::DType::bf16;
  if (out.dtype == want) return {};
  return kiln::unsupported_dtype(std::string(op) + ": out is " + kiln::dtype_name(out.dtype) + " but output_dtype is " +
                                 kiln::dtype_name(want));
}

}  // namespace

void kiln_register_ops_moe(kiln::Registry& r) {
  using namespace kiln;
  const std::uint32_t i32 = dtype_bit(DType::i32), f32 = dtype_bit(DType::f32);
  {
    OpDecl op;
    op.name = "moe_topk";
    op.doc = "(weights f32, ids i32) [tokens, top_k]: top-k routing of logits [tokens, experts]. softmax: the top_k "
             "of softmax(logits); sigmoid_group (DeepSeek-V3): sigmoid(logits) + bias ranks, groups of experts / "
             "n_group scored by their two best, topk_group groups kept; weights sigmoid(logits) times scale. "
             "renormalize divides the weights by their sum. Ties go to the lower expert.";
    op.tensors = {{.name = "logits", .min_rank = 2, .max_rank = 2, .shape = "[tokens, experts]"},
                  {.name = "bias", .optional = true, .dtypes = f32, .max_rank = 1, .shape = "[experts]"},
                  {.name = "weights", .role = TensorRole::output, .dtypes = f32, .min_rank = 2, .max_rank = 2,
                   .shape = "[tokens, top_k]"},
                  {.name = "ids", .role = TensorRole::output, .dtypes = i32, .min_rank = 2, .max_rank = 2,
                   .shape = "[tokens, top_k]"}};
    op.scalars = {{.name = "top_k", .kind = ScalarKind::i64},
                  {.name = "scoring", .kind = ScalarKind::choice, .has_default = true, .default_value = 0,
                   .choices = {"softmax", "sigmoid_group"}},
                  {.name = "renormalize", .kind = ScalarKind::boolean, .has_default = true, .default_value = 1},
                  {.name = "n_group", .kind = ScalarKind::i64, .has_default = true, .default_value = 1},
                  {.name = "topk_group", .kind = ScalarKind::i64, .has_default = true, .default_value = 1},
                  {.name = "scale", .kind = ScalarKind::f64, .has_default = true, .default_value = 1.0,
                   .doc = "routed scaling factor (sigmoid_group)"}};
    op.run = [](const OpCall& c) {
      if (c.tensor(2).rank == 2 && c.tensor(2).shape[1] != c.i64(0))
        return shape_mismatch("moe_topk: weights has " + std::to_string(c.tensor(2).shape[1]) + " columns, top_k is " +
                              std::to_string(c.i64(0)));
      return moe_topk(c.tensor(0), c.optional(1), c.tensor(2), c.tensor(3), static_cast<MoeScoring>(c.i64(1)),
                      c.i64(2) != 0, c.i64(3), c.i64(4), c.f64(5), c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      if (c.i64(0) < 1) return invalid_argument("moe_topk: top_k must be at least 1");
      out[0].dtype = DType::f32;
      out[0].rank = 2;
      out[0].shape[0] = c.tensor(0).shape[0];
      out[0].shape[1] = c.i64(0);
      out[1] = out[0];
      out[1].dtype = DType::i32;
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "moe_permute";
    op.doc = "(x_sorted [tokens x top_k, hidden], offsets [experts + 1], row_of [tokens, top_k], src_of "
             "[tokens x top_k]): the entries of ids [tokens, top_k] sorted by expert (stable), x's rows gathered in "
             "that order; expert e's rows are [offsets[e], offsets[e + 1]).";
    op.tensors = {{.name = "x", .min_rank = 2, .max_rank = 2, .shape = "[tokens, hidden]"},
                  {.name = "ids", .dtypes = i32, .min_rank = 2, .max_rank = 2, .shape = "[tokens, top_k]"},
                  {.name = "x_sorted", .role = TensorRole::output, .min_rank = 2, .max_rank = 2,
                   .shape = "[tokens x top_k, hidden]"},
                  {.name = "offsets", .role = TensorRole::output, .dtypes = i32, .max_rank = 1, .shape = "[experts + 1]"},
                  {.name = "row_of", .role = TensorRole::output, .dtypes = i32, .min_rank = 2, .max_rank = 2,
                   .shape = "[tokens, top_k]"},
                  {.name = "src_of", .role = TensorRole::output, .dtypes = i32, .max_rank = 1,
                   .shape = "[tokens x top_k]"}};
    op.scalars = {{.name = "num_experts", .kind = ScalarKind::i64}};
    op.run = [](const OpCall& c) {
      if (c.tensor(3).rank == 1 && c.tensor(3).shape[0] != c.i64(0) + 1)
        return shape_mismatch("moe_permute: offsets must have num_experts + 1 = " + std::to_string(c.i64(0) + 1) +
                              " elements");
      return moe_permute(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5), c.stream,
                         c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      if (c.i64(0) < 1) return invalid_argument("moe_permute: num_experts must be at least 1");
      const std::int64_t tokens = c.tensor(0).shape[0], top_k = c.tensor(1).shape[1];
      out[0].dtype = c.tensor(0).dtype;
      out[0].rank = 2;
      out[0].shape[0] = tokens * top_k;
      out[0].shape[1] = c.tensor(0).shape[1];
      out[1].dtype = DType::i32;
      out[1].rank = 1;
      out[1].shape[0] = c.i64(0) + 1;
      out[2].dtype = DType::i32;
      out[2].rank = 2;
      out[2].shape[0] = tokens;
      out[2].shape[1] = top_k;
      out[3].dtype = DType::i32;
      out[3].rank = 1;
      out[3].shape[0] = tokens * top_k;
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "moe_gather";
    op.doc = "out [rows, hidden] = x[src_of[r] / top_k] * weights[src_of[r]] (weights absent: 1), zeros where "
             "src_of < 0: the gradient of moe_combine with respect to the sorted rows.";
    op.tensors = {{.name = "x", .min_rank = 2, .max_rank = 2, .shape = "[tokens, hidden]"},
                  {.name = "src_of", .dtypes = i32, .max_rank = 1, .shape = "[rows]"},
                  {.name = "weights", .optional = true, .dtypes = f32, .min_rank = 2, .max_rank = 2,
                   .shape = "[tokens, top_k]"},
                  {.name = "out", .role = TensorRole::output, .min_rank = 2, .max_rank = 2, .shape = "[rows, hidden]"}};
    op.scalars = {{.name = "top_k", .kind = ScalarKind::i64}};
    op.run = [](const OpCall& c) {
      return moe_gather(c.tensor(0), c.tensor(1), c.optional(2), c.tensor(3), c.i64(0), c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      out[0].dtype = c.tensor(0).dtype;
      out[0].rank = 2;
      out[0].shape[0] = c.tensor(1).shape[0];
      out[0].shape[1] = c.tensor(0).shape[1];
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "moe_combine";
    op.doc = "out [tokens, hidden] = sum over j of weights[t, j] * y[row_of[t, j]] (weights absent: 1), fp32 in j "
             "order: the expert outputs back in token order.";
    op.tensors = {{.name = "y", .min_rank = 2, .max_rank = 2, .shape = "[rows, hidden]"},
                  {.name = "row_of", .dtypes = i32, .min_rank = 2, .max_rank = 2, .shape = "[tokens, top_k]"},
                  {.name = "weights", .optional = true, .dtypes = f32, .min_rank = 2, .max_rank = 2,
                   .shape = "[tokens, top_k]"},
                  {.name = "out", .role = TensorRole::output, .min_rank = 2, .max_rank = 2,
                   .shape = "[tokens, hidden]"}};
    op.run = [](const OpCall& c) {
      return moe_combine(c.tensor(0), c.tensor(1), c.optional(2), c.tensor(3), c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      out[0].dtype = c.tensor(0).dtype;
      out[0].rank = 2;
      out[0].shape[0] = c.tensor(1).shape[0];
      out[0].shape[1] = c.tensor(0).shape[1];
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  auto grouped = [&](const char* name, const char* doc, std::vector<OpTensor> tensors,
                     std::function<Status(const OpCall&)> run, std::function<Status(const OpCall&, std::span<OutputShape>)> infer) {
    OpDecl op;
    op.name = name;
    op.doc = doc;
    op.tensors = std::move(tensors);
    op.run = std::move(run);
    op.infer = std::move(infer);
    (void)r.add_op(std::move(op));
  };
  grouped("grouped_gemm",
          "out [m, n] = a [m, k] x weight[e]^T ([experts, n, k]) for expert e's rows [offs[e - 1], offs[e]) "
          "(offs: cumulative ends, i32): torch._grouped_mm(a, weight.transpose(-2, -1), offs). f16/bf16, k a "
          "multiple of 8; rows past offs[-1] are not written.",
          {{.name = "a", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2, .shape = "[m, k]"},
           {.name = "weight", .dtypes = k_half_dtypes, .min_rank = 3, .max_rank = 3, .shape = "[experts, n, k]"},
           {.name = "offs", .dtypes = i32, .max_rank = 1, .shape = "[experts]"},
           {.name = "out", .role = TensorRole::output, .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2,
            .shape = "[m, n]"}},
          [](const OpCall& c) { return grouped_gemm(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.stream, c.runtime); },
          [](const OpCall& c, std::span<OutputShape> out) {
            out[0].dtype = c.tensor(0).dtype;
            out[0].rank = 2;
            out[0].shape[0] = c.tensor(0).shape[0];
            out[0].shape[1] = c.tensor(1).shape[1];
            return Status{};
          });
  grouped("grouped_gemm_masked",
          "out [experts, max_tokens, n] = a [experts, max_tokens, k] x weight[e]^T for the first counts[e] rows of "
          "each expert; the other rows are not written (a fixed shape for CUDA-graph decode).",
          {{.name = "a", .dtypes = k_half_dtypes, .min_rank = 3, .max_rank = 3, .shape = "[experts, max_tokens, k]"},
           {.name = "weight", .dtypes = k_half_dtypes, .min_rank = 3, .max_rank = 3, .shape = "[experts, n, k]"},
           {.name = "counts", .dtypes = i32, .max_rank = 1, .shape = "[experts]"},
           {.name = "out", .role = TensorRole::output, .dtypes = k_half_dtypes, .min_rank = 3, .max_rank = 3,
            .shape = "[experts, max_tokens, n]"}},
          [](const OpCall& c) {
            return grouped_gemm_masked(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.stream, c.runtime);
          },
          [](const OpCall& c, std::span<OutputShape> out) {
            out[0].dtype = c.tensor(0).dtype;
            out[0].rank = 3;
            out[0].shape[0] = c.tensor(0).shape[0];
            out[0].shape[1] = c.tensor(0).shape[1];
            out[0].shape[2] = c.tensor(1).shape[1];
            return Status{};
          });
  {
    OpDecl op;
    op.name = "fused_moe";
    op.doc = "out [tokens, hidden]: the MoE layer's forward with softmax top-k routing: moe_topk, moe_permute, "
             "grouped_gemm (w_gate_up [experts, 2 inter, hidden], gate rows first), act_and_mul, grouped_gemm "
             "(w_down [experts, hidden, inter]), moe_combine. f16/bf16; intermediates in the stream's workspace "
             "(not during CUDA-graph capture). kiln.torch.fused_moe adds the backward.";
    op.tensors = {{.name = "x", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2, .shape = "[tokens, hidden]"},
                  {.name = "router_logits", .min_rank = 2, .max_rank = 2, .shape = "[tokens, experts]"},
                  {.name = "w_gate_up", .dtypes = k_half_dtypes, .min_rank = 3, .max_rank = 3,
                   .shape = "[experts, 2 inter, hidden]"},
                  {.name = "w_down", .dtypes = k_half_dtypes, .min_rank = 3, .max_rank = 3,
                   .shape = "[experts, hidden, inter]"},
                  {.name = "out", .role = TensorRole::output, .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2,
                   .shape = "[tokens, hidden]"}};
    op.scalars = {{.name = "top_k", .kind = ScalarKind::i64},
                  {.name = "activation", .kind = ScalarKind::choice, .has_default = true, .default_value = 0,
                   .choices = {"silu", "gelu", "gelu_tanh"}},
                  {.name = "renormalize", .kind = ScalarKind::boolean, .has_default = true, .default_value = 1}};
    op.run = [](const OpCall& c) {
      return fused_moe(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.i64(0),
                       static_cast<Activation>(c.i64(1)), c.i64(2) != 0, c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      out[0] = shape_like(c.tensor(0), c.tensor(0).dtype);
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  const std::uint32_t u8 = dtype_bit(DType::u8);
  for (bool masked : {false, true}) {
    OpDecl op;
    op.name = masked ? "grouped_gemm_fp8_masked" : "grouped_gemm_fp8";
    op.doc = masked ? "The masked layout of grouped_gemm_fp8: a [experts, max_tokens, k], a_scale [experts, max_tokens], "
                      "out [experts, max_tokens, n] for the first counts[e] rows of each expert."
                    : "out [m, n] = a x weight[e]^T with scales for expert e's rows [offs[e - 1], offs[e]): e4m3 "
                      "codes (u8); rowwise f32 scales (a_scale [m], b_scale [experts, n], as "
                      "torch._scaled_grouped_mm takes them) or DeepSeek-V3 blocks (a_scale [m, k/128], b_scale "
                      "[experts, n/128, k/128]); f16/bf16 out, k a multiple of 16.";
    op.tensors = {{.name = "a", .dtypes = u8, .min_rank = masked ? 3 : 2, .max_rank = masked ? 3 : 2,
                   .shape = masked ? "[experts, max_tokens, k]" : "[m, k]"},
                  {.name = "weight", .dtypes = u8, .min_rank = 3, .max_rank = 3, .shape = "[experts, n, k]"},
                  {.name = masked ? "counts" : "offs", .dtypes = i32, .max_rank = 1, .shape = "[experts]"},
                  {.name = "a_scale", .dtypes = f32, .max_rank = 3,
                   .shape = masked ? "[experts, max_tokens] or [experts, max_tokens, k/128]" : "[m] or [m, k/128]"},
                  {.name = "b_scale", .dtypes = f32, .min_rank = 2, .max_rank = 3,
                   .shape = "[experts, n] or [experts, n/128, k/128]"},
                  {.name = "out", .role = TensorRole::output, .dtypes = k_half_dtypes, .min_rank = masked ? 3 : 2,
                   .max_rank = masked ? 3 : 2, .shape = masked ? "[experts, max_tokens, n]" : "[m, n]"}};
    op.scalars = {{.name = "output_dtype", .kind = ScalarKind::choice, .has_default = true, .default_value = 1,
                   .choices = {"f16", "bf16"}, .doc = "the dtype of out when kiln allocates it"}};
    op.cpu = true;
    if (masked)
      op.run = [](const OpCall& c) {
        KILN_TRY(check_output_dtype("grouped_gemm_fp8_masked", c.tensor(5), c.i64(0)));
        return grouped_gemm_fp8_masked(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5),
                                       c.stream, c.runtime);
      };
    else
      op.run = [](const OpCall& c) {
        KILN_TRY(check_output_dtype("grouped_gemm_fp8", c.tensor(5), c.i64(0)));
        return grouped_gemm_fp8(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5), c.stream,
                                c.runtime);
      };
    op.infer = [masked](const OpCall& c, std::span<OutputShape> out) {
      out[0].dtype = c.i64(0) == 0 ? DType::f16 : DType::bf16;
      out[0].rank = masked ? 3 : 2;
      for (int i = 0; i + 1 < out[0].rank; ++i) out[0].shape[i] = c.tensor(0).shape[i];
      out[0].shape[out[0].rank - 1] = c.tensor(1).shape[1];
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  grouped("grouped_gemm_dgrad",
          "out [m, n] = a [m, k] x weight[e] ([experts, k, n]) for expert e's rows as grouped_gemm's offs: the "
          "input gradient of grouped_gemm with the same weight, read as stored (torch._grouped_mm(a, weight, "
          "offs)). f16/bf16, n and k multiples of 8; rows past offs[-1] are not written.",
          {{.name = "a", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2, .shape = "[m, k]"},
           {.name = "weight", .dtypes = k_half_dtypes, .min_rank = 3, .max_rank = 3, .shape = "[experts, k, n]"},
           {.name = "offs", .dtypes = i32, .max_rank = 1, .shape = "[experts]"},
           {.name = "out", .role = TensorRole::output, .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2,
            .shape = "[m, n]"}},
          [](const OpCall& c) {
            return grouped_gemm_dgrad(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.stream, c.runtime);
          },
          [](const OpCall& c, std::span<OutputShape> out) {
            out[0].dtype = c.tensor(0).dtype;
            out[0].rank = 2;
            out[0].shape[0] = c.tensor(0).shape[0];
            out[0].shape[1] = c.tensor(1).shape[2];
            return Status{};
          });
  grouped("grouped_gemm_wgrad",
          "out [experts, n, k]: out[e] = a_e^T b_e for a [m, n] and b [m, k] grouped by rows as grouped_gemm's offs "
          "(the weight gradient dW_e = dY_e^T X_e); experts without rows get zeros. n and k multiples of 8.",
          {{.name = "a", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2, .shape = "[m, n]"},
           {.name = "b", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2, .shape = "[m, k]"},
           {.name = "offs", .dtypes = i32, .max_rank = 1, .shape = "[experts]"},
           {.name = "out", .role = TensorRole::output, .dtypes = k_half_dtypes, .min_rank = 3, .max_rank = 3,
            .shape = "[experts, n, k]"}},
          [](const OpCall& c) {
            return grouped_gemm_wgrad(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.stream, c.runtime);
          },
          [](const OpCall& c, std::span<OutputShape> out) {
            out[0].dtype = c.tensor(0).dtype;
            out[0].rank = 3;
            out[0].shape[0] = c.tensor(2).shape[0];
            out[0].shape[1] = c.tensor(0).shape[1];
            out[0].shape[2] = c.tensor(1).shape[1];
            return Status{};
          });
}
