#include <algorithm>
#include <cmath>

#include "client/validate.h"
#include "families/rmsnorm_bwd/ops.h"
#include "families/rmsnorm_rope/ops.h"
#include "families/rmsnorm_rope/rmsnorm_rope.h"
#include "families/rmsnorm_rope/rope_hf_bwd.h"
#include "kiln/family.h"
#include "kiln/op.h"
#include "kiln/ops.h"

namespace kiln {
namespace {

constexpr std::int64_t k_fused_head_dims[] = {64, 80, 96, 128, 256};

struct Span {
  std::uintptr_t begin, end;
};
Span span_of(const TensorView& t) {
  const auto b = reinterpret_cast<std::uintptr_t>(t.data);
  return {b, b + std::uintptr_t(t.numel()) * dtype_size(t.dtype)};
}
bool overlap(Span a, Span b) { return a.begin < b.end && b.begin < a.end; }

}  // namespace

Status rms_norm_rope(const TensorView& x, const TensorView& weight, const TensorView& cos, const TensorView& sin,
                     const TensorView& out, double eps, std::int64_t num_heads, Stream stream, Runtime* runtime) {
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_view(weight, "weight"));
  KILN_TRY(client::check_view(cos, "cos"));
  KILN_TRY(client::check_view(sin, "sin"));
  KILN_TRY(client::check_view(out, "out"));

  // The seed's contract is CUDA only: host tensors are a device error, checked first.
  for (auto [t, name] : {std::pair{&x, "x"}, std::pair{&weight, "weight"}, std::pair{&cos, "cos"},
                         std::pair{&sin, "sin"}, std::pair{&out, "out"}})
    if (t->device.kind != DeviceKind::cuda)
      return device_error(std::string("rms_norm_rope: ") + name + " is not a CUDA tensor");

  KILN_TRY(client::check_float_dtype(x, "x"));
  if (weight.dtype != x.dtype || out.dtype != x.dtype)
    return unsupported_dtype(std::string("rms_norm_rope: dtypes differ (x ") + dtype_name(x.dtype) + ", weight " +
                             dtype_name(weight.dtype) + ", out " + dtype_name(out.dtype) + ")");
  KILN_TRY(client::check_float_dtype(cos, "cos"));
  if (sin.dtype != cos.dtype)
    return unsupported_dtype(std::string("rms_norm_rope: cos and sin dtypes differ (") + dtype_name(cos.dtype) + ", " +
                             dtype_name(sin.dtype) + ")");
  if (cos.dtype != DType::f32 && cos.dtype != x.dtype)
    return unsupported_dtype(std::string("rms_norm_rope: cos and sin must be f32 or the dtype of x (") +
                             dtype_name(x.dtype) + "), got " + dtype_name(cos.dtype));

  if (x.rank != 3) return shape_mismatch("rms_norm_rope: x must be [batch, seq, hidden]");
  const std::int64_t batch = x.shape[0], seq = x.shape[1], hidden = x.shape[2];
  if (out.rank != 3 || !std::equal(x.shape, x.shape + 3, out.shape))
    return shape_mismatch("rms_norm_rope: out must have the shape of x");
  if (weight.rank != 1 || weight.shape[0] != hidden)
    return shape_mismatch("rms_norm_rope: weight must have shape [" + std::to_string(hidden) + "]");
  const bool cos_2d = cos.rank == 2, cos_4d = cos.rank == 4 && cos.shape[0] == 1 && cos.shape[2] == 1;
  if (!cos_2d && !cos_4d) return shape_mismatch("rms_norm_rope: cos must be [seq, head_dim] or [1, seq, 1, head_dim]");
  if (sin.rank != cos.rank || !std::equal(cos.shape, cos.shape + cos.rank, sin.shape))
    return shape_mismatch("rms_norm_rope: sin must have the shape of cos");
  const std::int64_t head_dim = cos.shape[cos.rank - 1];
  const std::int64_t cos_seq = cos_2d ? cos.shape[0] : cos.shape[1];
  if (cos_seq != seq)
    return shape_mismatch("rms_norm_rope: cos has " + std::to_string(cos_seq) + " positions, x has seq " +
                          std::to_string(seq));
  if (head_dim <= 0 || head_dim % 2)
    return shape_mismatch("rms_norm_rope: head_dim must be even (got " + std::to_string(head_dim) + ")");
  if (std::find(std::begin(k_fused_head_dims), std::end(k_fused_head_dims), head_dim) == std::end(k_fused_head_dims))
    return invalid_argument("rms_norm_rope: head_dim " + std::to_string(head_dim) +
                            " is not supported (64, 80, 96, 128, 256)");
  if (num_heads < 0) return invalid_argument("rms_norm_rope: num_heads must be positive, or 0 to infer it");
  if (num_heads == 0) {
    if (hidden % head_dim)
      return shape_mismatch("rms_norm_rope: hidden " + std::to_string(hidden) + " is not a multiple of head_dim " +
                            std::to_string(head_dim));
    num_heads = hidden / head_dim;
  } else if (num_heads * head_dim != hidden) {
    return shape_mismatch("rms_norm_rope: num_heads * head_dim = " + std::to_string(num_heads * head_dim) +
                          " but hidden is " + std::to_string(hidden));
  }
  if (hidden == 0) return shape_mismatch("rms_norm_rope: the normalized dimension is empty");
  for (auto [t, name] : {std::pair{&x, "x"}, std::pair{&weight, "weight"}, std::pair{&cos, "cos"},
                         std::pair{&sin, "sin"}, std::pair{&out, "out"}})
    if (!t->is_contiguous()) return shape_mismatch(std::string("rms_norm_rope: ") + name + " must be contiguous");
  if (!std::isfinite(eps) || eps < 0) return invalid_argument("rms_norm_rope: eps must be finite and non-negative");
  for (const TensorView* t : {&x, &weight, &cos, &sin, &out})
    if (reinterpret_cast<std::uintptr_t>(t->data) % dtype_size(t->dtype))
      return invalid_argument("rms_norm_rope: every tensor must be aligned to its element size");

  // out may be x itself; no other overlap.
  const Span xs = span_of(x), ws = span_of(weight), cs = span_of(cos), ss = span_of(sin), os = span_of(out);
  if (overlap(os, xs) && out.data != x.data) return invalid_argument("rms_norm_rope: out overlaps x without being x");
  if (overlap(os, ws) || overlap(os, cs) || overlap(os, ss))
    return invalid_argument("rms_norm_rope: out overlaps weight, cos or sin");

  for (auto [t, name] : {std::pair{&x, "x"}, std::pair{&weight, "weight"}, std::pair{&cos, "cos"},
                         std::pair{&sin, "sin"}, std::pair{&out, "out"}}) {
    KILN_TRY(client::check_device(*t, name, DeviceKind::cuda));
    if (t->device.index != x.device.index) return device_error("rms_norm_rope: tensors are on different GPUs");
  }

  const std::uint32_t alignment = client::common_alignment(
      {reinterpret_cast<std::uintptr_t>(x.data), reinterpret_cast<std::uintptr_t>(weight.data),
       reinterpret_cast<std::uintptr_t>(cos.data), reinterpret_cast<std::uintptr_t>(sin.data),
       reinterpret_cast<std::uintptr_t>(out.data)},
      {});
  const Problem p = Problem::of(x.dtype, alignment,
                                families::RmsNormRopeProblem{.rows = batch * seq, .hidden = hidden,
                                                             .head_dim = head_dim, .seq = seq, .num_heads = num_heads,
                                                             .cos_dtype = std::int64_t(cos.dtype), .eps = eps});
  if (batch * seq == 0) return {};
  if (hidden >= (std::int64_t(1) << 31)) return shape_mismatch("rms_norm_rope: rows longer than 2^31 elements");

  static const Family* family = Registry::global().find("rmsnorm_rope");
  if (!family) return internal_error("the rmsnorm_rope family is not registered");
  void* buffers[5] = {x.data, weight.data, cos.data, sin.data, out.data};
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  return runtime->run(*family, p, buffers, stream);
}

Status rms_norm_rope_backward(const TensorView& dout, const TensorView& x, const TensorView& weight,
                              const TensorView& cos, const TensorView& sin, double eps, std::int64_t num_heads,
                              const TensorView& dx, const TensorView& dw, Stream stream, Runtime* runtime,
                              const TensorView* workspace) {
  const std::pair<const TensorView*, const char*> all[] = {{&dout, "dout"}, {&x, "x"},     {&weight, "weight"},
                                                           {&cos, "cos"},   {&sin, "sin"}, {&dx, "dx"},
                                                           {&dw, "dw"}};
  for (auto [t, name] : all) KILN_TRY(client::check_view(*t, name));
  if (workspace) KILN_TRY(client::check_view(*workspace, "workspace"));

  KILN_TRY(client::check_float_dtype(x, "x"));
  if (dout.dtype != x.dtype || weight.dtype != x.dtype || dx.dtype != x.dtype || dw.dtype != x.dtype)
    return unsupported_dtype(std::string("rms_norm_rope_backward: dtypes differ (x ") + dtype_name(x.dtype) +
                             ", dout " + dtype_name(dout.dtype) + ", weight " + dtype_name(weight.dtype) + ", dx " +
                             dtype_name(dx.dtype) + ", dw " + dtype_name(dw.dtype) + ")");
  KILN_TRY(client::check_float_dtype(cos, "cos"));
  if (sin.dtype != cos.dtype)
    return unsupported_dtype(std::string("rms_norm_rope_backward: cos and sin dtypes differ (") +
                             dtype_name(cos.dtype) + ", " + dtype_name(sin.dtype) + ")");
  if (cos.dtype != DType::f32 && cos.dtype != x.dtype)
    return unsupported_dtype(std::string("rms_norm_rope_backward: cos and sin must be f32 or the dtype of x (") +
                             dtype_name(x.dtype) + "), got " + dtype_name(cos.dtype));
  if (workspace && workspace->dtype != DType::f32)
    return unsupported_dtype(std::string("rms_norm_rope_backward: workspace must be f32, not ") +
                             dtype_name(workspace->dtype));

  if (x.rank != 3) return shape_mismatch("rms_norm_rope_backward: x must be [batch, seq, hidden]");
  const std::int64_t batch = x.shape[0], seq = x.shape[1], hidden = x.shape[2];
  for (auto [t, name] : {std::pair{&dout, "dout"}, std::pair{&dx, "dx"}})
    if (t->rank != 3 || !std::equal(x.shape, x.shape + 3, t->shape))
      return shape_mismatch(std::string("rms_norm_rope_backward: ") + name + " must have the shape of x");
  for (auto [t, name] : {std::pair{&weight, "weight"}, std::pair{&dw, "dw"}})
    if (t->rank != 1 || t->shape[0] != hidden)
      return shape_mismatch(std::string("rms_norm_rope_backward: ") + name + " must have shape [" +
                            std::to_string(hidden) + "]");
  const bool cos_2d = cos.rank == 2, cos_4d = cos.rank == 4 && cos.shape[0] == 1 && cos.shape[2] == 1;
  if (!cos_2d && !cos_4d)
    return shape_mismatch("rms_norm_rope_backward: cos must be [seq, head_dim] or [1, seq, 1, head_dim]");
  if (sin.rank != cos.rank || !std::equal(cos.shape, cos.shape + cos.rank, sin.shape))
    return shape_mismatch("rms_norm_rope_backward: sin must have the shape of cos");
  const std::int64_t head_dim = cos.shape[cos.rank - 1];
  const std::int64_t cos_seq = cos_2d ? cos.shape[0] : cos.shape[1];
  if (cos_seq != seq)
    return shape_mismatch("rms_norm_rope_backward: cos has " + std::to_string(cos_seq) + " positions, x has seq " +
                          std::to_string(seq));
  if (head_dim <= 0 || head_dim % 2)
    return shape_mismatch("rms_norm_rope_backward: head_dim must be even (got " + std::to_string(head_dim) + ")");
  if (std::find(std::begin(k_fused_head_dims), std::end(k_fused_head_dims), head_dim) == std::end(k_fused_head_dims))
    return invalid_argument("rms_norm_rope_backward: head_dim " + std::to_string(head_dim) +
                            " is not supported (64, 80, 96, 128, 256)");
  if (num_heads < 0)
    return invalid_argument("rms_norm_rope_backward: num_heads must be positive, or 0 to infer it");
  if (num_heads == 0) {
    if (hidden % head_dim)
      return shape_mismatch("rms_norm_rope_backward: hidden " + std::to_string(hidden) +
                            " is not a multiple of head_dim " + std::to_string(head_dim));
    num_heads = hidden / head_dim;
  } else if (num_heads * head_dim != hidden) {
    return shape_mismatch("rms_norm_rope_backward: num_heads * head_dim = " + std::to_string(num_heads * head_dim) +
                          " but hidden is " + std::to_string(hidden));
  }
  if (hidden == 0) return shape_mismatch("rms_norm_rope_backward: the normalized dimension is empty");
  if (hidden >= (std::int64_t(1) << 31))
    return shape_mismatch("rms_norm_rope_backward: rows longer than 2^31 elements");
  for (auto [t, name] : all)
    if (!t->is_contiguous())
      return shape_mismatch(std::string("rms_norm_rope_backward: ") + name + " must be contiguous");
  if (workspace && !workspace->is_contiguous())
    return shape_mismatch("rms_norm_rope_backward: workspace must be contiguous");
  if (!std::isfinite(eps) || eps < 0)
    return invalid_argument("rms_norm_rope_backward: eps must be finite and non-negative");
  for (auto [t, name] : all)
    if (reinterpret_cast<std::uintptr_t>(t->data) % dtype_size(t->dtype))
      return invalid_argument("rms_norm_rope_backward: every tensor must be aligned to its element size");

  // dx holds dn between the two passes: it may be dout itself, and overlaps nothing else.
  const Span dos = span_of(dout), xs = span_of(x), ws = span_of(weight), cs = span_of(cos), ss = span_of(sin),
             dxs = span_of(dx), dws = span_of(dw);
  if (overlap(dxs, dos) && dx.data != dout.data)
    return invalid_argument("rms_norm_rope_backward: dx overlaps dout without being dout");
  if (overlap(dxs, xs) || overlap(dxs, ws) || overlap(dxs, cs) || overlap(dxs, ss) || overlap(dxs, dws))
    return invalid_argument("rms_norm_rope_backward: dx overlaps x, weight, cos, sin or dw");
  if (overlap(dws, dos) || overlap(dws, xs) || overlap(dws, ws))
    return invalid_argument("rms_norm_rope_backward: dw overlaps dout, x or weight");

  const DeviceKind where = x.device.kind;
  for (auto [t, name] : all) {
    KILN_TRY(client::check_device(*t, name, where));
    if (where == DeviceKind::cuda && t->device.index != x.device.index)
      return device_error("rms_norm_rope_backward: tensors are on different GPUs");
  }
  if (workspace) {
    if (where != DeviceKind::cuda) return device_error("rms_norm_rope_backward: a workspace is for CUDA tensors only");
    KILN_TRY(client::check_device(*workspace, "workspace", where));
    if (workspace->device.index != x.device.index)
      return device_error("rms_norm_rope_backward: the workspace is on another GPU");
    // The second pass's own check comes after the first launch: this one comes before it.
    KILN_ASSIGN_OR_RETURN(const std::int64_t needed, rms_norm_backward_workspace_elements(x));
    if (workspace->numel() < needed)
      return invalid_argument("rms_norm_rope_backward: the workspace holds " + std::to_string(workspace->numel()) +
                              " elements, this call needs " + std::to_string(needed));
  }

  const std::uint32_t alignment = client::common_alignment(
      {reinterpret_cast<std::uintptr_t>(dout.data), reinterpret_cast<std::uintptr_t>(cos.data),
       reinterpret_cast<std::uintptr_t>(sin.data), reinterpret_cast<std::uintptr_t>(dx.data)},
      {});
  const Problem p = Problem::of(x.dtype, alignment,
                                families::RopeHfBwdProblem{.rows = batch * seq, .hidden = hidden,
                                                           .head_dim = head_dim, .seq = seq, .num_heads = num_heads,
                                                           .cos_dtype = std::int64_t(cos.dtype)});
  static const Family* const rope = Registry::global().find("rope_hf_bwd");
  if (!rope) return internal_error("the rope_hf_bwd family is not registered");
  void* buffers[4] = {dout.data, cos.data, sin.data, dx.data};
  if (where == DeviceKind::cpu) {
    if (batch * seq > 0) KILN_TRY(rope->cpu_reference(rope->heuristic(p), p, buffers));
  } else {
    if (!runtime) {
      KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
    }
    if (batch * seq > 0) KILN_TRY(runtime->run(*rope, p, buffers, stream));
  }
  return add_rms_norm_backward(dx, nullptr, x, weight, dx, dw, eps, stream, runtime, workspace);
}

}  // namespace kiln

// ---- declarations (kiln/op.h) ----

void kiln_register_ops_rmsnorm_rope(kiln::Registry& r) {
  using namespace kiln;
  OpDecl op;
  op.name = "rms_norm_rope";
  op.doc = "RMSNorm then neox RoPE per head, in one kernel (CUDA only). x [batch, seq, hidden], cos/sin [seq, "
           "head_dim] or [1, seq, 1, head_dim]; num_heads 0 infers hidden / head_dim.";
  op.tensors = {{.name = "x", .min_rank = 3, .max_rank = 3, .shape = "[batch, seq, hidden]"},
                {.name = "weight", .max_rank = 1, .shape = "[hidden]"},
                {.name = "cos", .min_rank = 2, .max_rank = 4, .shape = "[seq, head_dim]"},
                {.name = "sin", .min_rank = 2, .max_rank = 4, .shape = "[seq, head_dim]"},
                {.name = "out", .role = TensorRole::output, .min_rank = 3, .max_rank = 3,
                 .shape = "[batch, seq, hidden]"}};
  op.scalars = {{.name = "eps", .kind = ScalarKind::f64, .has_default = true, .default_value = 1e-6},
                {.name = "num_heads", .kind = ScalarKind::i64, .has_default = true, .default_value = 0}};
  op.backward = "rms_norm_rope_backward";
  op.cpu = false;
  op.run = [](const OpCall& c) {
    return rms_norm_rope(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.f64(0), c.i64(1),
                         c.stream, c.runtime);
  };
  op.infer = [](const OpCall& c, std::span<OutputShape> out) {
    out[0] = shape_like(c.tensor(0), c.tensor(0).dtype);
    return Status{};
  };
  (void)r.add_op(std::move(op));

  OpDecl bwd;
  bwd.name = "rms_norm_rope_backward";
  bwd.doc = "(dx, dw) of rms_norm_rope in two passes: dout through the rotation's transpose (into dx), then the "
            "RMSNorm backward with inv_rms recomputed from x, in place. workspace: as rms_norm_backward's (at least "
            "rms_norm_backward_workspace_elements(x)); absent: one cached per stream.";
  bwd.tensors = {{.name = "dout", .min_rank = 3, .max_rank = 3, .shape = "[batch, seq, hidden]", .grad_of = "out"},
                 {.name = "x", .min_rank = 3, .max_rank = 3, .shape = "[batch, seq, hidden]"},
                 {.name = "weight", .max_rank = 1, .shape = "[hidden]"},
                 {.name = "cos", .min_rank = 2, .max_rank = 4, .shape = "[seq, head_dim]"},
                 {.name = "sin", .min_rank = 2, .max_rank = 4, .shape = "[seq, head_dim]"},
                 {.name = "workspace", .optional = true, .dtypes = dtype_bit(DType::f32), .shape = "[elements]"},
                 {.name = "dx", .role = TensorRole::output, .min_rank = 3, .max_rank = 3,
                  .shape = "[batch, seq, hidden]", .grad_of = "x"},
                 {.name = "dw", .role = TensorRole::output, .max_rank = 1, .shape = "[hidden]", .grad_of = "weight"}};
  bwd.scalars = {{.name = "eps", .kind = ScalarKind::f64, .has_default = true, .default_value = 1e-6},
                 {.name = "num_heads", .kind = ScalarKind::i64, .has_default = true, .default_value = 0}};
  bwd.run = [](const OpCall& c) {
    return rms_norm_rope_backward(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.f64(0),
                                  c.i64(1), c.tensor(6), c.tensor(7), c.stream, c.runtime, c.optional(5));
  };
  bwd.infer = [](const OpCall& c, std::span<OutputShape> out) {
    out[0] = shape_like(c.tensor(1), c.tensor(1).dtype);
    out[1] = shape_like(c.tensor(2), c.tensor(2).dtype);
    return Status{};
  };
  (void)r.add_op(std::move(bwd));
}
