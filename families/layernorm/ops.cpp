// layer_norm and layer_norm_backward: validation, the CPU fallback, the launches, and their
// declarations (kiln/op.h), from which the C ABI, Python and torch bindings come.
#include "families/layernorm/ops.h"

#include <cmath>
#include <string>
#include <vector>

#include "client/validate.h"
#include "client/workspace.h"
#include "common/half.h"
#include "families/common/family_util.h"
#include "families/layernorm/layernorm.h"
#include "families/layernorm/layernorm_bwd_rows.h"
#include "jit/device_info.h"
#include "kiln/family.h"
#include "kiln/op.h"

namespace kiln {
namespace {

using families::LayerNormBwdProblem;
using families::LayerNormProblem;

// t's rows (client::as_rows): the last dimension contiguous, the leading ones one evenly strided
// row index, rows at least a row length apart.
Result<client::RowView> rows_of_tensor(const char* op, const TensorView& t, const char* name) {
  KILN_ASSIGN_OR_RETURN(auto r, client::as_rows(t, name));
  if (r.rows > 1 && r.row_stride < r.cols)
    return shape_mismatch(std::string(op) + ": " + name + "'s rows overlap (row stride " +
                          std::to_string(r.row_stride) + ")");
  return r;
}

// Checks t: a floating tensor of x's dtype and device kind, contiguous, with shape [cols].
Status check_vector(const char* op, const TensorView& t, const char* name, const TensorView& x, std::int64_t cols) {
  KILN_TRY(client::check_view(t, name));
  if (t.dtype != x.dtype)
    return unsupported_dtype(std::string(op) + ": " + name + " is " + dtype_name(t.dtype) + ", x is " +
                             dtype_name(x.dtype));
  if (t.rank != 1 || t.shape[0] != cols || !t.is_contiguous())
    return shape_mismatch(std::string(op) + ": " + name + " must be contiguous with shape [" + std::to_string(cols) +
                          "]");
  return client::check_device(t, name, x.device.kind);
}

// Checks t: f32, contiguous, `rows` elements (mean, rstd).
Status check_stats(const char* op, const TensorView& t, const char* name, const TensorView& x, std::int64_t rows) {
  KILN_TRY(client::check_view(t, name));
  if (t.dtype != DType::f32) return unsupported_dtype(std::string(op) + ": " + name + " must be f32");
  if (t.numel() != rows || !t.is_contiguous())
    return shape_mismatch(std::string(op) + ": " + name + " must be contiguous with " + std::to_string(rows) +
                          " elements (one per row)");
  return client::check_device(t, name, x.device.kind);
}

// Checks t: x's shape, dtype and device kind, its rows evenly strided (the last dimension
// contiguous) and not overlapping; returns its row view.
Result<client::RowView> check_rows_like_x(const char* op, const TensorView& t, const char* name, const TensorView& x) {
  KILN_TRY(client::check_view(t, name));
  if (t.dtype != x.dtype)
    return unsupported_dtype(std::string(op) + ": " + name + " is " + dtype_name(t.dtype) + ", x is " +
                             dtype_name(x.dtype));
  if (t.rank != x.rank) return shape_mismatch(std::string(op) + ": " + name + " and x have different ranks");
  for (int i = 0; i < x.rank; ++i)
    if (t.shape[i] != x.shape[i]) return shape_mismatch(std::string(op) + ": " + name + " and x have different shapes");
  KILN_TRY(client::check_device(t, name, x.device.kind));
  return rows_of_tensor(op, t, name);
}

Status same_gpu(const char* op, std::initializer_list<const TensorView*> ts) {
  const TensorView* first = *ts.begin();
  if (first->device.kind != DeviceKind::cuda) return {};
  for (const TensorView* t : ts)
    if (t && t->device.index != first->device.index) return device_error(std::string(op) + ": tensors are on different GPUs");
  return {};
}

// A tensor's address for client::common_alignment; an absent tensor adds nothing (0).
std::uintptr_t address(const TensorView* t) { return t ? reinterpret_cast<std::uintptr_t>(t->data) : 0; }
std::uintptr_t address(const TensorView& t) { return address(&t); }

Result<const Family*> family(const char* name) {
  const Family* f = Registry::global().find(name);
  if (!f) return internal_error(std::string("the ") + name + " family is not registered");
  return f;
}

// rmsnorm_bwd_reduce's problem: `slabs` rows of partial sums of `cols` columns, set through the
// family's field names (slabs, cols).
Result<Problem> reduce_problem(const Family& reduce, DType dtype, std::int64_t slabs, std::int64_t cols) {
  Problem p;
  p.dtype = dtype;
  p.alignment = 16;
  int named = 0;
  for (const ProblemField& f : reduce.problem_fields()) {
    if (f.name != "slabs" && f.name != "cols") continue;
    p.fields[f.slot].i = f.name == "slabs" ? slabs : cols;
    ++named;
  }
  if (named != 2) return internal_error("rmsnorm_bwd_reduce has no problem fields 'slabs' and 'cols'");
  return p;
}

}  // namespace

Status layer_norm(const TensorView& x, const TensorView& weight, const TensorView* bias, const TensorView& y,
                  const TensorView* mean, const TensorView* rstd, double eps, Stream stream, Runtime* runtime) {
  const char* op = "layer_norm";
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_float_dtype(x, "x"));
  KILN_TRY(client::check_device(x, "x", x.device.kind));
  KILN_ASSIGN_OR_RETURN(const auto xr, rows_of_tensor(op, x, "x"));
  const std::int64_t cols = xr.cols;
  if (cols == 0) return shape_mismatch("layer_norm: the normalized dimension is empty");
  const std::int64_t rows = xr.rows;
  KILN_TRY(check_vector(op, weight, "weight", x, cols));
  if (bias) KILN_TRY(check_vector(op, *bias, "bias", x, cols));
  KILN_ASSIGN_OR_RETURN(const auto yr, check_rows_like_x(op, y, "y", x));
  if (mean) KILN_TRY(check_stats(op, *mean, "mean", x, rows));
  if (rstd) KILN_TRY(check_stats(op, *rstd, "rstd", x, rows));
  KILN_TRY(same_gpu(op, {&x, &weight, bias, &y, mean, rstd}));
  if (!std::isfinite(eps) || eps < 0) return invalid_argument("layer_norm: eps must be finite and non-negative");

  const auto esize = std::int64_t(dtype_size(x.dtype));
  const Problem p = Problem::of(
      x.dtype,
      client::common_alignment({address(x), address(weight), address(bias), address(y)},
                               {cols * esize, xr.row_stride * esize, yr.row_stride * esize}),
      LayerNormProblem{.rows = rows, .cols = cols, .x_row_stride = xr.row_stride, .y_row_stride = yr.row_stride,
                       .eps = eps});
  void* buffers[6] = {x.data,           weight.data, bias ? bias->data : nullptr, y.data, mean ? mean->data : nullptr,
                      rstd ? rstd->data : nullptr};
  KILN_ASSIGN_OR_RETURN(const Family* fwd, family("layernorm"));
  if (x.device.kind == DeviceKind::cpu) return fwd->cpu_reference(fwd->heuristic(p), p, buffers);
  KILN_TRY(families::layernorm_choice(p, false).status());
  if (rows == 0) return {};
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  return runtime->run(*fwd, p, buffers, stream);
}

Status layer_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
                           const TensorView& mean, const TensorView& rstd, const TensorView& dx,
                           const TensorView& dweight, const TensorView* dbias, Stream stream, Runtime* runtime) {
  const char* op = "layer_norm_backward";
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_float_dtype(x, "x"));
  KILN_TRY(client::check_device(x, "x", x.device.kind));
  KILN_ASSIGN_OR_RETURN(const auto xr, rows_of_tensor(op, x, "x"));
  const std::int64_t cols = xr.cols;
  if (cols == 0) return shape_mismatch("layer_norm_backward: the normalized dimension is empty");
  const std::int64_t rows = xr.rows;
  KILN_ASSIGN_OR_RETURN(const auto dyr, check_rows_like_x(op, dy, "dy", x));
  KILN_ASSIGN_OR_RETURN(const auto dxr, check_rows_like_x(op, dx, "dx", x));
  KILN_TRY(check_vector(op, weight, "weight", x, cols));
  KILN_TRY(check_vector(op, dweight, "dweight", x, cols));
  if (dbias) KILN_TRY(check_vector(op, *dbias, "dbias", x, cols));
  KILN_TRY(check_stats(op, mean, "mean", x, rows));
  KILN_TRY(check_stats(op, rstd, "rstd", x, rows));
  KILN_TRY(same_gpu(op, {&x, &dy, &weight, &mean, &rstd, &dx, &dweight, dbias}));

  const auto esize = std::int64_t(dtype_size(x.dtype));
  const std::uint32_t alignment =
      client::common_alignment({address(dy), address(x), address(weight), address(dx)},
                               {cols * esize, dyr.row_stride * esize, xr.row_stride * esize, dxr.row_stride * esize});
  LayerNormBwdProblem q{.rows = rows,
                        .cols = cols,
                        .dy_row_stride = dyr.row_stride,
                        .x_row_stride = xr.row_stride,
                        .dx_row_stride = dxr.row_stride};
  KILN_ASSIGN_OR_RETURN(const Family* bwd, family("layernorm_bwd"));

  if (x.device.kind == DeviceKind::cpu) {
    // One slab: partial holds the column sums themselves.
    q.slabs = 1;
    const Problem p = Problem::of(x.dtype, alignment, q);
    std::vector<float> partial(std::size_t(2 * cols));
    void* b[7] = {dy.data, x.data, weight.data, mean.data, rstd.data, dx.data, partial.data()};
    KILN_TRY(bwd->cpu_reference(bwd->heuristic(p), p, b));
    for (std::int64_t c = 0; c < cols; ++c) {
      store_from_double(dweight.data, dweight.dtype, c, partial[std::size_t(c)]);
      if (dbias) store_from_double(dbias->data, dbias->dtype, c, partial[std::size_t(cols + c)]);
    }
    return {};
  }

  KILN_ASSIGN_OR_RETURN(const Params choice, families::layernorm_choice(Problem::of(x.dtype, alignment, q), true));
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  KILN_ASSIGN_OR_RETURN(const jit::DeviceInfo* device, jit::device_info(x.device.index));
  // 1 to 8 rows, or up to 16 of at most 4096 elements (families::few_rows_launch): one launch of
  // layernorm_bwd_rows where it holds the problem (16-byte aligned rows of whole packs, the
  // gradients included), instead of the three below. One row's strides are the row length: only
  // its first row is read. Larger calls skip the check.
  if (families::few_rows_launch(rows, cols, 4096)) {
    const auto stride = [&](std::int64_t s) { return rows <= 1 ? cols : s; };
    const families::LayerNormBwdRowsProblem rq{.rows = rows,
                                               .cols = cols,
                                               .dy_row_stride = stride(dyr.row_stride),
                                               .x_row_stride = stride(xr.row_stride),
                                               .dx_row_stride = stride(dxr.row_stride)};
    const std::uint32_t rows_alignment = client::common_alignment(
        {address(dy), address(x), address(weight), address(dx), address(dweight), address(dbias)},
        {cols * esize, rq.dy_row_stride * esize, rq.x_row_stride * esize, rq.dx_row_stride * esize});
    const Problem rp = Problem::of(x.dtype, rows_alignment, rq);
    const int max_cluster = device->major >= 9 && device->cluster_launch ? 8 : 1;
    if (families::layernorm_bwd_rows_fits(rp, max_cluster)) {
      KILN_ASSIGN_OR_RETURN(const Family* few, family("layernorm_bwd_rows"));
      void* b[8] = {dy.data,  x.data,       weight.data, mean.data, rstd.data,
                    dx.data, dweight.data, dbias ? dbias->data : nullptr};
      return runtime->run(*few, rp, b, stream);
    }
  }
  // One slab per block of the heuristic's variant that the GPU holds at once (the slab count is a
  // key of the problem, so a tuned variant runs with the same count).
  const std::int64_t slabs = families::layernorm_bwd_slabs(choice, rows, device->sm_count);
  q.slabs = slabs;
  void* ws = nullptr;
  client::StreamWorkspace scratch;
  if (slabs > 0) {
    KILN_ASSIGN_OR_RETURN(scratch, client::StreamWorkspace::get(x.device.index, stream, 2 * slabs * cols));
    ws = scratch.data();
    void* b[7] = {dy.data, x.data, weight.data, mean.data, rstd.data, dx.data, ws};
    KILN_TRY(runtime->run(*bwd, Problem::of(x.dtype, alignment, q), b, stream));
  }
  // The slab sums, in a fixed order: dweight from the first slabs rows of partial, dbias from the rest.
  KILN_ASSIGN_OR_RETURN(const Family* reduce, family("rmsnorm_bwd_reduce"));
  KILN_ASSIGN_OR_RETURN(const Problem pr, reduce_problem(*reduce, x.dtype, slabs, cols));
  void* rw[2] = {ws, dweight.data};
  KILN_TRY(runtime->run(*reduce, pr, rw, stream));
  if (dbias) {
    void* rb[2] = {ws ? static_cast<float*>(ws) + slabs * cols : nullptr, dbias->data};
    KILN_TRY(runtime->run(*reduce, pr, rb, stream));
  }
  return {};
}

}  // namespace kiln

void kiln_register_ops_layernorm(kiln::Registry& r) {
  using namespace kiln;
  {
    OpDecl op;
    op.name = "layer_norm";
    op.doc = "out = (x - mean) * rstd * weight + bias over the last dimension (biased variance, fp32 statistics); "
             "mean and rstd (f32, one per row) are written when given, for layer_norm_backward.";
    op.tensors = {{.name = "x", .shape = "[..., cols]", .strided_rows = true},
                  {.name = "weight", .max_rank = 1, .shape = "[cols]"},
                  {.name = "bias", .optional = true, .max_rank = 1, .shape = "[cols]"},
                  {.name = "out", .role = TensorRole::output, .shape = "[..., cols]", .strided_rows = true},
                  {.name = "mean", .role = TensorRole::output, .optional = true, .dtypes = dtype_bit(DType::f32),
                   .shape = "[rows]"},
                  {.name = "rstd", .role = TensorRole::output, .optional = true, .dtypes = dtype_bit(DType::f32),
                   .shape = "[rows]"}};
    op.scalars = {{.name = "eps", .kind = ScalarKind::f64, .has_default = true, .default_value = 1e-5}};
    op.backward = "layer_norm_backward";
    op.run = [](const OpCall& c) {
      return layer_norm(c.tensor(0), c.tensor(1), c.optional(2), c.tensor(3), c.optional(4), c.optional(5), c.f64(0),
                        c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      out[0] = shape_like(c.tensor(0), c.tensor(0).dtype);
      out[1] = out[2] = rows_of(c.tensor(0), DType::f32);
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "layer_norm_backward";
    op.doc = "(dx, dweight, dbias) of layer_norm from its mean and rstd; dweight and dbias are reduced over rows in a "
             "fixed order (deterministic).";
    op.tensors = {{.name = "dy", .shape = "[..., cols]", .grad_of = "out", .strided_rows = true},
                  {.name = "x", .shape = "[..., cols]", .strided_rows = true},
                  {.name = "weight", .max_rank = 1, .shape = "[cols]"},
                  {.name = "mean", .dtypes = dtype_bit(DType::f32), .shape = "[rows]"},
                  {.name = "rstd", .dtypes = dtype_bit(DType::f32), .shape = "[rows]"},
                  {.name = "dx", .role = TensorRole::output, .shape = "[..., cols]", .grad_of = "x",
                   .strided_rows = true},
                  {.name = "dweight", .role = TensorRole::output, .max_rank = 1, .shape = "[cols]",
                   .grad_of = "weight"},
                  {.name = "dbias", .role = TensorRole::output, .optional = true, .max_rank = 1, .shape = "[cols]",
                   .grad_of = "bias"}};
    op.run = [](const OpCall& c) {
      return layer_norm_backward(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5),
                                 c.tensor(6), c.optional(7), c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      out[0] = shape_like(c.tensor(1), c.tensor(1).dtype);
      out[1] = out[2] = shape_like(c.tensor(2), c.tensor(2).dtype);
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
}
