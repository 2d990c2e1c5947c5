// The LoRA typed ops (families/lora/ops.h) and their declarations (kiln/op.h).
#include "families/lora/ops.h"

#include <string>
#include <vector>

#include "client/validate.h"
#include "client/workspace.h"
#include "families/common/gemm/gemm_util.h"
#include "families/lora/lora.h"
#include "jit/device_info.h"
#include "kiln/family.h"
#include "kiln/op.h"

namespace kiln {
namespace {

namespace l = families::lora;

struct LoraArgs {
  const TensorView* x;
  const TensorView* weight;
  const TensorView* a;
  const TensorView* b;
  const TensorView* indices;  // null: one adapter
  const TensorView* ranks;
  const TensorView* scales;
  const TensorView* bias;
  const TensorView* out;
};

Status want(bool ok, const char* op, const std::string& what) {
  return ok ? Status{} : shape_mismatch(std::string(op) + ": " + what);
}

Status check_layout(const char* op, const char* name, const TensorView& t, std::uintptr_t bytes) {
  if (!t.is_contiguous()) return shape_mismatch(std::string(op) + ": " + name + " must be contiguous");
  if (client::address(t) % bytes)
    return invalid_argument(std::string(op) + ": " + name + " must be " + std::to_string(bytes) + "-byte aligned");
  return {};
}

Status check_dtype(const char* op, const char* name, const TensorView& t, DType want_dtype) {
  if (t.dtype == want_dtype) return {};
  return unsupported_dtype(std::string(op) + ": " + name + " must be " + dtype_name(want_dtype) + ", got " +
                           dtype_name(t.dtype));
}

Status run_lora(const char* op, const LoraArgs& g, std::int64_t r, std::int64_t adapters, std::int64_t slices,
                std::int64_t slice_end0, std::int64_t slice_end1, double scale, Stream stream, Runtime* runtime) {
  const TensorView& x = *g.x;
  const std::int64_t k = x.shape[x.rank - 1], n = g.weight->shape[0];
  const std::int64_t m = k > 0 ? x.numel() / k : 0;
  const bool multi = g.indices != nullptr;
  std::int64_t n1 = 0, n2 = 0;
  if (slices >= 2) {
    const bool given = slice_end0 != 0 || slice_end1 != 0;
    n1 = given ? slice_end0 : n / slices;
    n2 = slices == 3 ? (given ? slice_end1 : 2 * n / 3) : 0;
    if (n1 < 0 || n1 > n || (slices == 3 && (n2 < n1 || n2 > n)))
      return invalid_argument(std::string(op) + ": slice ends " + std::to_string(n1) + ", " + std::to_string(n2) +
                              " must be non-decreasing within [0, n = " + std::to_string(n) + "]");
  } else if (slice_end0 != 0 || slice_end1 != 0) {
    return invalid_argument(std::string(op) + ": slice ends are for 2 or 3 slices");
  }
  KILN_TRY(want(k % 8 == 0, op, "k = " + std::to_string(k) + " must be a multiple of 8"));
  KILN_TRY(want(r >= 1 && r <= l::k_max_rank, op, "the rank must be in [1, 128], got " + std::to_string(r)));
  for (const auto& [t, name] : {std::pair{g.x, "x"}, {g.weight, "weight"}, {g.a, "lora_a"}, {g.b, "lora_b"}, {g.out, "out"}})
    KILN_TRY(check_layout(op, name, *t, 16));
  if (g.bias) KILN_TRY(check_layout(op, "bias", *g.bias, dtype_size(g.bias->dtype)));
  if (multi)
    for (const auto& [t, name] : {std::pair{g.indices, "indices"}, {g.ranks, "ranks"}, {g.scales, "scales"}})
      KILN_TRY(check_layout(op, name, *t, 4));
  DeviceKind where = x.device.kind;
  for (const auto& [t, name] : {std::pair{g.x, "x"}, {g.weight, "weight"}, {g.a, "lora_a"}, {g.b, "lora_b"},
                                {g.indices, "indices"}, {g.ranks, "ranks"}, {g.scales, "scales"}, {g.bias, "bias"},
                                {g.out, "out"}}) {
    if (!t) continue;
    KILN_TRY(client::check_device(*t, name, where));
    if (where == DeviceKind::cuda && t->device.index != x.device.index)
      return device_error(std::string(op) + ": tensors are on different GPUs");
  }
  std::int64_t sms = families::gemm::k_reference_sms, cc = 0;
  if (where == DeviceKind::cuda) {
    KILN_ASSIGN_OR_RETURN(const jit::DeviceInfo* dev, jit::device_info(x.device.index));
    sms = dev->sm_count;
    cc = dev->compute_capability;
  }
  const std::int64_t mm = std::max<std::int64_t>(m, 1);
  // The core path on sm_90a: the shrink writes the rank tail's operand t itself (one split).
  const bool t = l::core_path(cc, mm, r, multi ? 1 : 0, slices, n1, n2);
  const std::int64_t splits = t ? 1 : l::shrink_splits(mm, k, r, slices, sms);
  const l::LoraShrinkProblem sq{.m = mm, .k = k, .r = r, .adapters = adapters, .slices = slices, .splits = splits,
                                .multi = multi ? 1 : 0, .t = t ? 1 : 0, .scale = scale};
  const l::LoraGemmProblem gq{.m = mm, .n = std::max<std::int64_t>(n, 1), .k = k, .r = r, .adapters = adapters,
                              .slices = slices, .splits = splits, .multi = multi ? 1 : 0, .bias = g.bias ? 1 : 0,
                              .t = t ? 1 : 0, .n1 = n1, .n2 = n2, .scale = scale};
  const Problem sp = Problem::of(x.dtype, 16, sq), gp = Problem::of(x.dtype, 16, gq);
  const Family* shrink = Registry::global().find("lora_shrink");
  const Family* gemm = Registry::global().find("lora_gemm");
  if (!shrink || !gemm) return internal_error(std::string(op) + ": the lora families are not registered");
  // The families' own rules as typed errors before anything runs (the device's are checked again
  // when the kernels resolve).
  KILN_TRY(shrink->check_problem(shrink->heuristic(sp), sp));
  KILN_TRY(gemm->check_problem(gemm->heuristic(gp), gp));
  if (m == 0 || n == 0) return {};

  // f32 elements: the partial sums, or t's 16-bit values two to an element.
  const std::int64_t u_elems = t ? (m * slices * l::t_pitch(r) + 1) / 2 : splits * m * slices * l::rank_pitch(r);
  std::vector<float> host;
  client::StreamWorkspace scratch;
  void* u;
  if (where == DeviceKind::cpu) {
    host.resize(std::size_t(u_elems));
    u = host.data();
  } else {
    KILN_ASSIGN_OR_RETURN(scratch, client::StreamWorkspace::get(x.device.index, stream, u_elems));
    u = scratch.data();
  }
  std::int32_t zero_i = 0;
  float zero_f = 0.0f;
  void* idx = multi ? g.indices->data : &zero_i;
  void* ranks = multi ? g.ranks->data : &zero_i;
  void* scales = multi ? g.scales->data : &zero_f;
  void* bias = g.bias ? g.bias->data : x.data;
  void* sb[5] = {x.data, g.a->data, idx, ranks, u};
  KILN_TRY(client::run_family(shrink, "lora_shrink", sp, sb, where, stream, runtime));
  void* gb[9] = {x.data, g.weight->data, g.b->data, u, idx, ranks, scales, bias, g.out->data};
  return client::run_family(gemm, "lora_gemm", gp, gb, where, stream, runtime);
}

// The checks both ops share: views, dtypes, x and out against weight.
Status check_base(const char* op, const TensorView& x, const TensorView& weight, const TensorView& a,
                  const TensorView& b, const TensorView* bias, const TensorView& out) {
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&weight, "weight"}, {&a, "lora_a"}, {&b, "lora_b"}, {&out, "out"}})
    KILN_TRY(client::check_view(*t, name));
  if (bias) KILN_TRY(client::check_view(*bias, "bias"));
  if (x.dtype != DType::f16 && x.dtype != DType::bf16)
    return unsupported_dtype(std::string(op) + ": x must be f16 or bf16, got " + dtype_name(x.dtype));
  for (const auto& [t, name] : {std::pair{&weight, "weight"}, {&a, "lora_a"}, {&b, "lora_b"}, {bias, "bias"}, {&out, "out"}})
    if (t) KILN_TRY(check_dtype(op, name, *t, x.dtype));
  const std::int64_t k = x.shape[x.rank - 1];
  KILN_TRY(want(weight.rank == 2 && weight.shape[1] == k, op,
                "weight must be [n, " + std::to_string(k) + "], got " + client::dims(weight)));
  const std::int64_t n = weight.shape[0];
  bool out_ok = out.rank == x.rank && out.shape[out.rank - 1] == n;
  for (int i = 0; out_ok && i + 1 < x.rank; ++i) out_ok = out.shape[i] == x.shape[i];
  KILN_TRY(want(out_ok, op, "out must be x's shape with " + std::to_string(n) + " columns, got " + client::dims(out)));
  if (bias) KILN_TRY(want(bias->rank == 1 && bias->shape[0] == n, op, "bias must be [" + std::to_string(n) + "]"));
  return {};
}

}  // namespace

Status lora_linear(const TensorView& x, const TensorView& weight, const TensorView& lora_a, const TensorView& lora_b,
                   const TensorView* bias, const TensorView& out, double scale, std::int64_t slice_end0,
                   std::int64_t slice_end1, Stream stream, Runtime* runtime) {
  constexpr const char* op = "lora_linear";
  KILN_TRY(check_base(op, x, weight, lora_a, lora_b, bias, out));
  const std::int64_t k = x.shape[x.rank - 1], n = weight.shape[0];
  KILN_TRY(want(lora_b.rank == 2 && lora_b.shape[0] == n && lora_b.shape[1] >= 1, op,
                "lora_b must be [" + std::to_string(n) + ", r], got " + client::dims(lora_b)));
  const std::int64_t r = lora_b.shape[1];
  KILN_TRY(want(lora_a.rank == 2 && lora_a.shape[1] == k && lora_a.shape[0] % r == 0 && lora_a.shape[0] / r >= 1 &&
                    lora_a.shape[0] / r <= l::k_max_slices,
                op, "lora_a must be [slices x " + std::to_string(r) + ", " + std::to_string(k) +
                        "] with 1 to 3 slices, got " + client::dims(lora_a)));
  const LoraArgs g{&x, &weight, &lora_a, &lora_b, nullptr, nullptr, nullptr, bias, &out};
  return run_lora(op, g, r, 1, lora_a.shape[0] / r, slice_end0, slice_end1, scale, stream, runtime);
}

Status lora_linear_multi(const TensorView& x, const TensorView& weight, const TensorView& lora_a,
                         const TensorView& lora_b, const TensorView& indices, const TensorView& ranks,
                         const TensorView& scales, const TensorView* bias, const TensorView& out,
                         std::int64_t slice_end0, std::int64_t slice_end1, Stream stream, Runtime* runtime) {
  constexpr const char* op = "lora_linear_multi";
  KILN_TRY(check_base(op, x, weight, lora_a, lora_b, bias, out));
  for (const auto& [t, name] : {std::pair{&indices, "indices"}, {&ranks, "ranks"}, {&scales, "scales"}})
    KILN_TRY(client::check_view(*t, name));
  KILN_TRY(check_dtype(op, "indices", indices, DType::i32));
  KILN_TRY(check_dtype(op, "ranks", ranks, DType::i32));
  KILN_TRY(check_dtype(op, "scales", scales, DType::f32));
  const std::int64_t k = x.shape[x.rank - 1], n = weight.shape[0], m = k > 0 ? x.numel() / k : 0;
  KILN_TRY(want(lora_b.rank == 3 && lora_b.shape[1] == n, op,
                "lora_b must be [adapters, " + std::to_string(n) + ", r], got " + client::dims(lora_b)));
  const std::int64_t adapters = lora_b.shape[0], r = lora_b.shape[2];
  KILN_TRY(want(lora_a.rank == 3 && lora_a.shape[0] == adapters && lora_a.shape[2] == k && r > 0 &&
                    lora_a.shape[1] % r == 0,
                op, "lora_a must be [" + std::to_string(adapters) + ", slices x " + std::to_string(r) + ", " +
                        std::to_string(k) + "], got " + client::dims(lora_a)));
  const std::int64_t slices = lora_a.shape[1] / r;
  KILN_TRY(want(slices >= 1 && slices <= l::k_max_slices, op,
                "lora_a holds " + std::to_string(slices) + " slices of rank " + std::to_string(r) + "; 1 to 3 are taken"));
  KILN_TRY(want(indices.rank == 1 && indices.shape[0] == m, op, "indices must be [" + std::to_string(m) + "]"));
  KILN_TRY(want(ranks.rank == 1 && ranks.shape[0] == adapters, op, "ranks must be [" + std::to_string(adapters) + "]"));
  KILN_TRY(want(scales.rank == 1 && scales.shape[0] == adapters, op, "scales must be [" + std::to_string(adapters) + "]"));
  KILN_TRY(want(adapters >= 1, op, "at least one adapter is needed"));
  const LoraArgs g{&x, &weight, &lora_a, &lora_b, &indices, &ranks, &scales, bias, &out};
  return run_lora(op, g, r, adapters, slices, slice_end0, slice_end1, 1.0, stream, runtime);
}

}  // namespace kiln

// ---- declarations (kiln/op.h) ----

void kiln_register_ops_lora(kiln::Registry& r) {
  using namespace kiln;
  const std::uint32_t i32 = dtype_bit(DType::i32), f32 = dtype_bit(DType::f32);
  auto infer_out = [](const OpCall& c, std::span<OutputShape> out) {
    out[0] = shape_like(c.tensor(0), c.tensor(0).dtype, c.tensor(1).shape[0]);
    return Status{};
  };
  {
    OpDecl op;
    op.name = "lora_linear";
    op.doc = "out [..., n] = x [..., k] W^T + scale (x A^T) B^T + bias: weight [n, k], lora_a [r, k], lora_b [n, r], "
             "bias [n]; the low-rank product accumulated in the base GEMM (one output write). Merged projections: "
             "lora_a [slices r, k] (2 or 3 slices), out's columns split at slice_end0, slice_end1 (0: equal parts), "
             "slice s using A rows [s r, s r + r) and its own rows of lora_b. f16/bf16, k a multiple of 8, r in "
             "[1, 128]; not during CUDA-graph capture (stream workspace).";
    op.tensors = {{.name = "x", .dtypes = k_half_dtypes, .shape = "[..., k]"},
                  {.name = "weight", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2, .shape = "[n, k]"},
                  {.name = "lora_a", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2, .shape = "[slices r, k]"},
                  {.name = "lora_b", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2, .shape = "[n, r]"},
                  {.name = "bias", .optional = true, .dtypes = k_half_dtypes, .max_rank = 1, .shape = "[n]"},
                  {.name = "out", .role = TensorRole::output, .dtypes = k_half_dtypes, .shape = "[..., n]"}};
    op.scalars = {{.name = "scale", .kind = ScalarKind::f64, .has_default = true, .default_value = 1.0},
                  {.name = "slice_end0", .kind = ScalarKind::i64, .has_default = true, .default_value = 0},
                  {.name = "slice_end1", .kind = ScalarKind::i64, .has_default = true, .default_value = 0}};
    op.run = [](const OpCall& c) {
      return lora_linear(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.optional(4), c.tensor(5), c.f64(0),
                         c.i64(1), c.i64(2), c.stream, c.runtime);
    };
    op.infer = infer_out;
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "lora_linear_multi";
    op.doc = "out [..., n] = x W^T + per row i, for adapter a = indices[i] (none outside [0, adapters)): scales[a] "
             "(x A_a,s^T) B_a^T restricted to rank ranks[a], + bias. lora_a [adapters, slices r, k] (slice s: rows "
             "[s r, s r + r)), lora_b [adapters, n, r]; out's columns split into slices at slice_end0, slice_end1 "
             "(0: equal parts). Rows need not be sorted by adapter.";
    op.tensors = {{.name = "x", .dtypes = k_half_dtypes, .shape = "[..., k]"},
                  {.name = "weight", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2, .shape = "[n, k]"},
                  {.name = "lora_a", .dtypes = k_half_dtypes, .min_rank = 3, .max_rank = 3,
                   .shape = "[adapters, slices r, k]"},
                  {.name = "lora_b", .dtypes = k_half_dtypes, .min_rank = 3, .max_rank = 3, .shape = "[adapters, n, r]"},
                  {.name = "indices", .dtypes = i32, .max_rank = 1, .shape = "[rows]"},
                  {.name = "ranks", .dtypes = i32, .max_rank = 1, .shape = "[adapters]"},
                  {.name = "scales", .dtypes = f32, .max_rank = 1, .shape = "[adapters]"},
                  {.name = "bias", .optional = true, .dtypes = k_half_dtypes, .max_rank = 1, .shape = "[n]"},
                  {.name = "out", .role = TensorRole::output, .dtypes = k_half_dtypes, .shape = "[..., n]"}};
    op.scalars = {{.name = "slice_end0", .kind = ScalarKind::i64, .has_default = true, .default_value = 0},
                  {.name = "slice_end1", .kind = ScalarKind::i64, .has_default = true, .default_value = 0}};
    op.run = [](const OpCall& c) {
      return lora_linear_multi(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5),
                               c.tensor(6), c.optional(7), c.tensor(8), c.i64(0), c.i64(1), c.stream, c.runtime);
    };
    op.infer = infer_out;
    (void)r.add_op(std::move(op));
  }
}
