#include <cmath>
#include <utility>

#include "client/validate.h"
#include "families/add_rmsnorm/add_rmsnorm.h"
#include "kiln/family.h"
#include "kiln/op.h"
#include "kiln/ops.h"

namespace kiln {
namespace {

struct ByteSpan {
  std::uintptr_t begin = 0, end = 0;
};

ByteSpan byte_span(const TensorView& t, const client::RowView& r) {
  const auto base = reinterpret_cast<std::uintptr_t>(t.data);
  if (r.rows == 0 || r.cols == 0) return {base, base};
  return {base, base + std::uintptr_t(((r.rows - 1) * r.row_stride + r.cols) * std::int64_t(dtype_size(t.dtype)))};
}

bool overlap(ByteSpan a, ByteSpan b) { return a.begin < b.end && b.begin < a.end; }

// The same elements in the same order: what in-place use means.
bool same_view(const TensorView& a, const client::RowView& ra, const TensorView& b, const client::RowView& rb) {
  return a.data == b.data && (ra.rows <= 1 || ra.row_stride == rb.row_stride);
}

}  // namespace

Status add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight, const TensorView& y,
                    const TensorView& residual_out, double eps, Stream stream, Runtime* runtime) {
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_view(residual, "residual"));
  KILN_TRY(client::check_view(weight, "weight"));
  KILN_TRY(client::check_view(y, "y"));
  KILN_TRY(client::check_view(residual_out, "residual_out"));
  KILN_TRY(client::check_float_dtype(x, "x"));
  for (const TensorView* t : {&residual, &weight, &y, &residual_out})
    if (t->dtype != x.dtype)
      return unsupported_dtype(std::string("add_rms_norm: dtypes differ (x ") + dtype_name(x.dtype) + ", residual " +
                               dtype_name(residual.dtype) + ", weight " + dtype_name(weight.dtype) + ", y " +
                               dtype_name(y.dtype) + ", residual_out " + dtype_name(residual_out.dtype) + ")");
  using Named = std::pair<const TensorView*, const char*>;
  for (const auto& [t, name] : {Named{&residual, "residual"}, Named{&y, "y"}, Named{&residual_out, "residual_out"}}) {
    bool same = t->rank == x.rank;
    for (int i = 0; same && i < x.rank; ++i) same = t->shape[i] == x.shape[i];
    if (!same) return shape_mismatch(std::string("add_rms_norm: ") + name + " and x have different shapes");
  }
  const std::int64_t hidden = x.shape[x.rank - 1];
  if (weight.rank != 1 || weight.shape[0] != hidden)
    return shape_mismatch("add_rms_norm: weight must have shape [" + std::to_string(hidden) + "]");
  if (weight.strides[0] != 1 && hidden > 1) return shape_mismatch("add_rms_norm: weight must be contiguous");
  if (hidden == 0) return shape_mismatch("add_rms_norm: the normalized dimension is empty");
  if (!std::isfinite(eps) || eps < 0) return invalid_argument("add_rms_norm: eps must be finite and non-negative");
  KILN_ASSIGN_OR_RETURN(auto xr, client::as_rows(x, "x"));
  KILN_ASSIGN_OR_RETURN(auto rr, client::as_rows(residual, "residual"));
  KILN_ASSIGN_OR_RETURN(auto yr, client::as_rows(y, "y"));
  KILN_ASSIGN_OR_RETURN(auto hr, client::as_rows(residual_out, "residual_out"));

  // Each element is read and written by one thread, inputs first: an output may be exactly its
  // input (in place) but must not partly overlap any input, the weight or the other output.
  const client::RowView wr{1, hidden, hidden};
  const ByteSpan xs = byte_span(x, xr), rs = byte_span(residual, rr), ws = byte_span(weight, wr),
                 ys = byte_span(y, yr), hs = byte_span(residual_out, hr);
  if (overlap(ys, hs)) return invalid_argument("add_rms_norm: y and residual_out overlap");
  if (overlap(ys, ws) || overlap(hs, ws)) return invalid_argument("add_rms_norm: an output overlaps weight");
  if (overlap(ys, xs) && !same_view(y, yr, x, xr))
    return invalid_argument("add_rms_norm: y overlaps x without being the same view");
  if (overlap(hs, rs) && !same_view(residual_out, hr, residual, rr))
    return invalid_argument("add_rms_norm: residual_out overlaps residual without being the same view");
  if (overlap(ys, rs) || overlap(hs, xs))
    return invalid_argument("add_rms_norm: y may alias only x, and residual_out only residual");

  const DeviceKind where = x.device.kind;
  for (const auto& [t, name] : {Named{&x, "x"}, Named{&residual, "residual"}, Named{&weight, "weight"}, Named{&y, "y"},
                                Named{&residual_out, "residual_out"}}) {
    KILN_TRY(client::check_device(*t, name, where));
    if (where == DeviceKind::cuda && t->device.index != x.device.index)
      return device_error("add_rms_norm: tensors are on different GPUs");
  }

  const auto esize = std::int64_t(dtype_size(x.dtype));
  const std::uint32_t alignment = client::common_alignment(
      {reinterpret_cast<std::uintptr_t>(x.data), reinterpret_cast<std::uintptr_t>(residual.data),
       reinterpret_cast<std::uintptr_t>(weight.data), reinterpret_cast<std::uintptr_t>(y.data),
       reinterpret_cast<std::uintptr_t>(residual_out.data)},
      {xr.row_stride * esize, rr.row_stride * esize, yr.row_stride * esize, hr.row_stride * esize});
  const Problem p = Problem::of(x.dtype, alignment,
                                families::AddRmsNormProblem{.rows = xr.rows, .cols = hidden,
                                                            .x_row_stride = xr.row_stride,
                                                            .residual_row_stride = rr.row_stride,
                                                            .y_row_stride = yr.row_stride,
                                                            .residual_out_row_stride = hr.row_stride, .eps = eps});
  if (xr.rows == 0) return {};

  static const Family* const family = Registry::global().find("add_rmsnorm");
  void* buffers[5] = {x.data, residual.data, weight.data, y.data, residual_out.data};
  return client::run_family(family, "add_rmsnorm", p, buffers, where, stream, runtime);
}

}  // namespace kiln

// ---- declarations (kiln/op.h) ----

void kiln_register_ops_add_rmsnorm(kiln::Registry& r) {
  using namespace kiln;
  OpDecl op;
  op.name = "add_rms_norm";
  op.doc = "(out, residual_out): h = x + residual, residual_out = h, out = rms_norm(h) * weight. "
           "residual_out may be residual and out may be x (in place).";
  op.tensors = {{.name = "x", .shape = "[..., hidden]", .strided_rows = true},
                {.name = "residual", .shape = "[..., hidden]", .strided_rows = true},
                {.name = "weight", .max_rank = 1, .shape = "[hidden]"},
                {.name = "out", .role = TensorRole::output, .shape = "[..., hidden]", .strided_rows = true},
                {.name = "residual_out", .role = TensorRole::output, .shape = "[..., hidden]", .strided_rows = true}};
  op.scalars = {{.name = "eps", .kind = ScalarKind::f64, .has_default = true, .default_value = 1e-6}};
  op.run = [](const OpCall& c) {
    return add_rms_norm(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.f64(0), c.stream,
                        c.runtime);
  };
  op.infer = [](const OpCall& c, std::span<OutputShape> out) {
    out[0] = out[1] = shape_like(c.tensor(0), c.tensor(0).dtype);
    return Status{};
  };
  (void)r.add_op(std::move(op));
}
