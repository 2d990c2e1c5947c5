#include <algorithm>
#include <cmath>

#include "client/validate.h"
#include "families/rmsnorm_rope/rmsnorm_rope.h"
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
}
