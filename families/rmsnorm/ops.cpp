#include <cmath>

#include "client/validate.h"
#include "families/rmsnorm/rmsnorm.h"
#include "kiln/family.h"
#include "kiln/op.h"
#include "kiln/ops.h"

namespace kiln {

namespace {

Status rms_norm_impl(const TensorView& x, const TensorView& weight, const TensorView& y, const TensorView* inv_rms,
                     double eps, Stream stream, Runtime* runtime) {
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_view(weight, "weight"));
  KILN_TRY(client::check_view(y, "y"));
  KILN_TRY(client::check_float_dtype(x, "x"));
  if (weight.dtype != x.dtype || y.dtype != x.dtype)
    return unsupported_dtype(std::string("rms_norm: dtypes differ (x ") + dtype_name(x.dtype) + ", weight " +
                             dtype_name(weight.dtype) + ", y " + dtype_name(y.dtype) + ")");
  if (x.rank != y.rank) return shape_mismatch("rms_norm: x and y have different ranks");
  for (int i = 0; i < x.rank; ++i)
    if (x.shape[i] != y.shape[i]) return shape_mismatch("rms_norm: x and y have different shapes");
  const std::int64_t hidden = x.shape[x.rank - 1];
  if (weight.rank != 1 || weight.shape[0] != hidden)
    return shape_mismatch("rms_norm: weight must have shape [" + std::to_string(hidden) + "]");
  if (weight.strides[0] != 1 && hidden > 1) return shape_mismatch("rms_norm: weight must be contiguous");
  if (hidden == 0) return shape_mismatch("rms_norm: the normalized dimension is empty");
  if (!std::isfinite(eps) || eps < 0) return invalid_argument("rms_norm: eps must be finite and non-negative");
  KILN_ASSIGN_OR_RETURN(auto xr, client::as_rows(x, "x"));
  KILN_ASSIGN_OR_RETURN(auto yr, client::as_rows(y, "y"));

  if (inv_rms) {
    KILN_TRY(client::check_view(*inv_rms, "inv_rms"));
    if (inv_rms->dtype != DType::f32) return unsupported_dtype("rms_norm: inv_rms must be f32");
    if (inv_rms->numel() != xr.rows || !inv_rms->is_contiguous())
      return shape_mismatch("rms_norm: inv_rms must be contiguous with " + std::to_string(xr.rows) + " elements");
  }

  const DeviceKind where = x.device.kind;
  if (inv_rms) KILN_TRY(client::check_device(*inv_rms, "inv_rms", where));
  KILN_TRY(client::check_device(x, "x", where));
  KILN_TRY(client::check_device(weight, "weight", where));
  KILN_TRY(client::check_device(y, "y", where));
  if (where == DeviceKind::cuda && (weight.device.index != x.device.index || y.device.index != x.device.index))
    return device_error("rms_norm: tensors are on different GPUs");

  const auto esize = std::int64_t(dtype_size(x.dtype));
  const std::uint32_t alignment = client::common_alignment(
      {reinterpret_cast<std::uintptr_t>(x.data), reinterpret_cast<std::uintptr_t>(weight.data),
       reinterpret_cast<std::uintptr_t>(y.data)},
      {xr.row_stride * esize, yr.row_stride * esize});
  const Problem p = Problem::of(x.dtype, alignment,
                                families::RmsNormProblem{.rows = xr.rows, .cols = hidden, .x_row_stride = xr.row_stride,
                                                         .y_row_stride = yr.row_stride, .eps = eps});
  if (xr.rows == 0) return {};

  static const Family* family = Registry::global().find("rmsnorm");
  if (!family) return internal_error("the rmsnorm family is not registered");
  void* buffers[4] = {x.data, weight.data, y.data, inv_rms ? inv_rms->data : nullptr};
  if (where == DeviceKind::cpu) {
    const Params params = family->heuristic(p);
    KILN_TRY(family->check_problem(params, p));
    return family->cpu_reference(params, p, std::span<void* const>(buffers, inv_rms ? 4 : 3));
  }
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  return runtime->run(*family, p, buffers, stream);
}

}  // namespace

Status rms_norm(const TensorView& x, const TensorView& weight, const TensorView& y, double eps, Stream stream,
                Runtime* runtime) {
  return rms_norm_impl(x, weight, y, nullptr, eps, stream, runtime);
}

Status rms_norm(const TensorView& x, const TensorView& weight, const TensorView& y, const TensorView& inv_rms,
                double eps, Stream stream, Runtime* runtime) {
  return rms_norm_impl(x, weight, y, &inv_rms, eps, stream, runtime);
}

}  // namespace kiln

// ---- declarations (kiln/op.h) ----

void kiln_register_ops_rmsnorm(kiln::Registry& r) {
  using namespace kiln;
  OpDecl op;
  op.name = "rms_norm";
  op.doc = "out = x * rsqrt(mean(x^2, last dim) + eps) * weight; also fills inv_rms (f32, one value per row) if given.";
  op.tensors = {{.name = "x", .shape = "[..., hidden]", .strided_rows = true},
                {.name = "weight", .max_rank = 1, .shape = "[hidden]"},
                {.name = "out", .role = TensorRole::output, .shape = "[..., hidden]", .strided_rows = true},
                {.name = "inv_rms", .role = TensorRole::output, .optional = true, .dtypes = dtype_bit(DType::f32),
                 .shape = "[rows]"}};
  op.scalars = {{.name = "eps", .kind = ScalarKind::f64, .has_default = true, .default_value = 1e-6}};
  op.backward = "rms_norm_backward";
  op.run = [](const OpCall& c) {
    if (const TensorView* inv = c.optional(3))
      return rms_norm(c.tensor(0), c.tensor(1), c.tensor(2), *inv, c.f64(0), c.stream, c.runtime);
    return rms_norm(c.tensor(0), c.tensor(1), c.tensor(2), c.f64(0), c.stream, c.runtime);
  };
  op.infer = [](const OpCall& c, std::span<OutputShape> out) {
    out[0] = shape_like(c.tensor(0), c.tensor(0).dtype);
    out[1] = rows_of(c.tensor(0), DType::f32);
    return Status{};
  };
  (void)r.add_op(std::move(op));
}
