#include "client/validate.h"
#include "families/act_and_mul/act_and_mul.h"
#include "kiln/family.h"
#include "kiln/op.h"
#include "kiln/ops.h"

namespace kiln {

Status act_and_mul(const TensorView& x, const TensorView& out, Activation act, Stream stream, Runtime* runtime) {
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_view(out, "out"));
  KILN_TRY(client::check_float_dtype(x, "x"));
  if (out.dtype != x.dtype)
    return unsupported_dtype(std::string("act_and_mul: dtypes differ (x ") + dtype_name(x.dtype) + ", out " +
                             dtype_name(out.dtype) + ")");
  std::int64_t kind;
  switch (act) {
    case Activation::silu: kind = families::k_am_silu; break;
    case Activation::gelu: kind = families::k_am_gelu; break;
    case Activation::gelu_tanh: kind = families::k_am_gelu_tanh; break;
    default: return invalid_argument("act_and_mul: unknown activation " + std::to_string(int(act)));
  }
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
  const auto xb = reinterpret_cast<std::uintptr_t>(x.data), ob = reinterpret_cast<std::uintptr_t>(out.data);
  if (xr.rows > 0) {
    const auto xe = xb + std::uintptr_t(((xr.rows - 1) * xr.row_stride + two_d) * esize);
    const auto oe = ob + std::uintptr_t(((orow.rows - 1) * orow.row_stride + d) * esize);
    const bool in_place = xb == ob && (xr.rows <= 1 || xr.row_stride == orow.row_stride);
    if (xb < oe && ob < xe && !in_place)
      return invalid_argument("act_and_mul: out overlaps x without being x[..., :d] (same pointer and row stride)");
  }

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
  if (!family) return internal_error("the act_and_mul family is not registered");
  void* buffers[2] = {x.data, out.data};
  if (where == DeviceKind::cpu) {
    const Params params = family->heuristic(p);
    KILN_TRY(family->check_problem(params, p));
    return family->cpu_reference(params, p, buffers);
  }
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  return runtime->run(*family, p, buffers, stream);
}

}  // namespace kiln

// ---- declarations (kiln/op.h) ----

void kiln_register_ops_act_and_mul(kiln::Registry& r) {
  using namespace kiln;
  OpDecl op;
  op.name = "act_and_mul";
  op.doc = "out = act(x[..., :d]) * x[..., d:]; activation: silu, gelu (erf) or gelu_tanh.";
  op.tensors = {{.name = "x", .shape = "[..., 2d]"}, {.name = "out", .role = TensorRole::output, .shape = "[..., d]"}};
  op.scalars = {{.name = "activation", .kind = ScalarKind::choice, .has_default = true, .default_value = 0,
                 .choices = {"silu", "gelu", "gelu_tanh"}}};
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
}
