#include "client/validate.h"
#include "families/act_and_mul/act_and_mul.h"
#include "families/act_and_mul/ops.h"
#include "kiln/family.h"
#include "kiln/op.h"
#include "kiln/ops.h"

namespace kiln {
namespace {

Result<std::int64_t> activation_code(const char* op, Activation act) {
  switch (act) {
    case Activation::silu: return std::int64_t(families::k_am_silu);
    case Activation::gelu: return std::int64_t(families::k_am_gelu);
    case Activation::gelu_tanh: return std::int64_t(families::k_am_gelu_tanh);
  }
  return invalid_argument(std::string(op) + ": unknown activation " + std::to_string(int(act)));
}

// The byte range [begin, end) a row view spans, `cols` elements per row.
std::pair<std::uintptr_t, std::uintptr_t> span_of(const TensorView& t, const client::RowView& r, std::int64_t cols) {
  const auto b = reinterpret_cast<std::uintptr_t>(t.data);
  if (r.rows == 0) return {b, b};
  return {b, b + std::uintptr_t(((r.rows - 1) * r.row_stride + cols) * std::int64_t(dtype_size(t.dtype)))};
}

bool overlap(std::pair<std::uintptr_t, std::uintptr_t> a, std::pair<std::uintptr_t, std::uintptr_t> b) {
  return a.first < b.second && b.first < a.second;
}

}  // namespace

Status act_and_mul(const TensorView& x, const TensorView& out, Activation act, Stream stream, Runtime* runtime) {
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_view(out, "out"));
  KILN_TRY(client::check_float_dtype(x, "x"));
  if (out.dtype != x.dtype)
    return unsupported_dtype(std::string("act_and_mul: dtypes differ (x ") + dtype_name(x.dtype) + ", out " +
                             dtype_name(out.dtype) + ")");
  KILN_ASSIGN_OR_RETURN(const std::int64_t kind, activation_code("act_and_mul", act));
  if (out.rank != x.rank) return shape_mismatch("act_and_mul: x and out have different ranks");
  for (int i = 0; i + 1 < x.rank; ++i)
    if (out.shape[i] != x.shape[i]) return shape_mismatch("act_and_mul: x and out have different leading shapes");
  const std::int64_t two_d = x.shape[x.rank - 1];
  if (two_d % 2) return shape_mismatch("act_and_mul: the last dimension of x must be even (2d)");
  const std::int64_t d = two_d / 2;
  if (out.shape[out.rank - 1] != d)
    return shape_mismatch("act_and_mul: out must have last dimension " + std::to_string(d) + " (half of x's)");
  if (d == 0) return shape_mismatch("act_and_mul: the last dimension is empty");
  KILN_ASSIGN_OR_RETURN(auto xr, client::as_rows(x, "x"));
  KILN_ASSIGN_OR_RETURN(auto orow, client::as_rows(out, "out"));

  // One thread reads both halves of a pack and then writes it: out may be x[..., :d] itself, but
  // any other overlap would race with other threads' reads.
  const auto esize = std::int64_t(dtype_size(x.dtype));
  const auto xs = span_of(x, xr, two_d), os = span_of(out, orow, d);
  const bool in_place = x.data == out.data && (xr.rows <= 1 || xr.row_stride == orow.row_stride);
  if (overlap(xs, os) && !in_place)
    return invalid_argument("act_and_mul: out overlaps x without being x[..., :d] (same pointer and row stride)");
  const auto xb = xs.first, ob = os.first;

  const DeviceKind where = x.device.kind;
  KILN_TRY(client::check_device(x, "x", where));
  KILN_TRY(client::check_device(out, "out", where));
  if (where == DeviceKind::cuda && out.device.index != x.device.index)
    return device_error("act_and_mul: tensors are on different GPUs");

  // The second half starts d elements into each row: its offset counts like a stride.
  const std::uint32_t alignment =
      client::common_alignment({xb, ob}, {xr.row_stride * esize, orow.row_stride * esize, d * esize});
  const Problem p = Problem::of(x.dtype, alignment,
                                families::ActAndMulProblem{.rows = xr.rows,
                                                           .d = d,
                                                           .x_row_stride = xr.row_stride,
                                                           .out_row_stride = orow.row_stride,
                                                           .activation = kind});
  if (xr.rows == 0) return {};

  static const Family* const family = Registry::global().find("act_and_mul");
  void* buffers[2] = {x.data, out.data};
  return client::run_family(family, "act_and_mul", p, buffers, where, stream, runtime);
}

Status act_and_mul_backward(const TensorView& x, const TensorView& dy, const TensorView& dx, Activation act,
                            Stream stream, Runtime* runtime) {
  const char* op = "act_and_mul_backward";
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_view(dy, "dy"));
  KILN_TRY(client::check_view(dx, "dx"));
  KILN_TRY(client::check_float_dtype(x, "x"));
  if (dy.dtype != x.dtype || dx.dtype != x.dtype)
    return unsupported_dtype(std::string(op) + ": dtypes differ (x " + dtype_name(x.dtype) + ", dy " +
                             dtype_name(dy.dtype) + ", dx " + dtype_name(dx.dtype) + ")");
  KILN_ASSIGN_OR_RETURN(const std::int64_t kind, activation_code(op, act));
  if (dy.rank != x.rank || dx.rank != x.rank) return shape_mismatch(std::string(op) + ": x, dy and dx have different ranks");
  for (int i = 0; i + 1 < x.rank; ++i)
    if (dy.shape[i] != x.shape[i] || dx.shape[i] != x.shape[i])
      return shape_mismatch(std::string(op) + ": x, dy and dx have different leading shapes");
  const std::int64_t two_d = x.shape[x.rank - 1];
  if (two_d % 2) return shape_mismatch(std::string(op) + ": the last dimension of x must be even (2d)");
  const std::int64_t d = two_d / 2;
  if (dy.shape[dy.rank - 1] != d)
    return shape_mismatch(std::string(op) + ": dy must have last dimension " + std::to_string(d) + " (half of x's)");
  if (dx.shape[dx.rank - 1] != two_d) return shape_mismatch(std::string(op) + ": dx must have x's shape");
  if (d == 0) return shape_mismatch(std::string(op) + ": the last dimension is empty");
  KILN_ASSIGN_OR_RETURN(auto xr, client::as_rows(x, "x"));
  KILN_ASSIGN_OR_RETURN(auto yr, client::as_rows(dy, "dy"));
  KILN_ASSIGN_OR_RETURN(auto dr, client::as_rows(dx, "dx"));

  // One thread reads x's two halves and dy before writing dx's: dx may be x itself, but any other
  // overlap would race with other threads' reads.
  const auto xs = span_of(x, xr, two_d), ys = span_of(dy, yr, d), ds = span_of(dx, dr, two_d);
  const bool in_place = x.data == dx.data && (xr.rows <= 1 || xr.row_stride == dr.row_stride);
  if (overlap(ds, xs) && !in_place)
    return invalid_argument(std::string(op) + ": dx overlaps x without being x itself (same pointer and row stride)");
  if (overlap(ds, ys)) return invalid_argument(std::string(op) + ": dx overlaps dy");

  const DeviceKind where = x.device.kind;
  KILN_TRY(client::check_device(x, "x", where));
  KILN_TRY(client::check_device(dy, "dy", where));
  KILN_TRY(client::check_device(dx, "dx", where));
  if (where == DeviceKind::cuda && (dy.device.index != x.device.index || dx.device.index != x.device.index))
    return device_error(std::string(op) + ": tensors are on different GPUs");

  const auto esize = std::int64_t(dtype_size(x.dtype));
  // The second halves start d elements into each row: that offset counts like a stride.
  const std::uint32_t alignment = client::common_alignment(
      {xs.first, ys.first, ds.first},
      {xr.row_stride * esize, yr.row_stride * esize, dr.row_stride * esize, d * esize});
  const Problem p = Problem::of(x.dtype, alignment,
                                families::ActAndMulBwdProblem{.rows = xr.rows,
                                                              .d = d,
                                                              .x_row_stride = xr.row_stride,
                                                              .dy_row_stride = yr.row_stride,
                                                              .dx_row_stride = dr.row_stride,
                                                              .activation = kind});
  if (xr.rows == 0) return {};

  static const Family* const family = Registry::global().find("act_and_mul_bwd");
  void* buffers[3] = {x.data, dy.data, dx.data};
  return client::run_family(family, "act_and_mul_bwd", p, buffers, where, stream, runtime);
}

}  // namespace kiln

// ---- declarations (kiln/op.h) ----

void kiln_register_ops_act_and_mul(kiln::Registry& r) {
  using namespace kiln;
  OpDecl op;
  op.name = "act_and_mul";
  op.doc = "out = act(x[..., :d]) * x[..., d:]; activation: silu, gelu (erf) or gelu_tanh.";
  op.tensors = {{.name = "x", .shape = "[..., 2d]", .strided_rows = true},
                {.name = "out", .role = TensorRole::output, .shape = "[..., d]", .strided_rows = true}};
  op.scalars = {{.name = "activation", .kind = ScalarKind::choice, .has_default = true, .default_value = 0,
                 .choices = {"silu", "gelu", "gelu_tanh"}}};
  op.backward = "act_and_mul_backward";
  op.run = [](const OpCall& c) {
    return act_and_mul(c.tensor(0), c.tensor(1), static_cast<Activation>(c.i64(0)), c.stream, c.runtime);
  };
  op.infer = [](const OpCall& c, std::span<OutputShape> out) {
    const TensorView& x = c.tensor(0);
    if (x.shape[x.rank - 1] % 2) return shape_mismatch("act_and_mul: the last dimension of x must be even (2d)");
    out[0] = shape_like(x, x.dtype, x.shape[x.rank - 1] / 2);
    return Status{};
  };
  (void)r.add_op(std::move(op));

  OpDecl bwd;
  bwd.name = "act_and_mul_backward";
  bwd.doc = "The gradient of act_and_mul with respect to x, recomputing act from x: "
            "dx[..., :d] = dy * x[..., d:] * act'(x[..., :d]), dx[..., d:] = dy * act(x[..., :d]).";
  bwd.tensors = {{.name = "x", .shape = "[..., 2d]", .strided_rows = true},
                 {.name = "dy", .shape = "[..., d]", .grad_of = "out", .strided_rows = true},
                 {.name = "dx", .role = TensorRole::output, .shape = "[..., 2d]", .grad_of = "x",
                  .strided_rows = true}};
  bwd.scalars = {{.name = "activation", .kind = ScalarKind::choice, .has_default = true, .default_value = 0,
                  .choices = {"silu", "gelu", "gelu_tanh"}}};
  bwd.run = [](const OpCall& c) {
    return act_and_mul_backward(c.tensor(0), c.tensor(1), c.tensor(2), static_cast<Activation>(c.i64(0)), c.stream,
                                c.runtime);
  };
  bwd.infer = [](const OpCall& c, std::span<OutputShape> out) {
    out[0] = shape_like(c.tensor(0), c.tensor(0).dtype);
    return Status{};
  };
  (void)r.add_op(std::move(bwd));
}
