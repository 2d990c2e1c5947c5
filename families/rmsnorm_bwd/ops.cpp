// kiln::rms_norm_backward and kiln::add_rms_norm_backward: validation, the CPU fallback, and the
// two launches (rmsnorm_bwd, then rmsnorm_bwd_reduce) over an f32 workspace of partial dw rows, or
// for a few rows the one launch of rmsnorm_bwd_rows where it holds the problem.
// add_rms_norm_backward is rms_norm_backward with the rmsnorm_bwd options on: inv_rms recomputed
// from h, and the residual output's gradient added to dx, all in the one pass over the rows.
//
// Workspace policy: a caller's workspace is used as given. Without one, the op takes the per-stream
// workspace of client/workspace.h: work on one stream runs in order, so consecutive calls share
// it, while two streams never do.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "client/validate.h"
#include "client/workspace.h"
#include "families/common/family_util.h"
#include "families/rmsnorm_bwd/ops.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd_reduce.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd_rows.h"
#include "jit/device_info.h"
#include "jit/driver.h"
#include "kiln/family.h"
#include "kiln/op.h"
#include "kiln/ops.h"

namespace kiln {
namespace {

// What the op reads of the device itself: the slab count (hence the workspace size) and the
// max_cluster key are settled here, before the runtime fills the problem's own device facts.
struct DeviceInfo {
  int sms = 0;
  int max_cluster = 1;
};

std::mutex g_mu;
// Clusters the GPU runs at once, by device ordinal and the clustered kernel's params.
std::map<std::pair<int, std::string>, int> g_resident;

// The slab count of the heuristic's choice for `p`. The clustered bulk kernel takes one slab per
// cluster the GPU runs at once, which only the driver knows for the loaded kernel (clusters must
// fit in one GPC: 30 clusters of 4 on a 132-SM H100), asked once per device and variant.
Result<std::int64_t> slabs_for(const Family& bwd, const Problem& p, int ordinal, int sms, Runtime& runtime) {
  const auto choice = families::rmsnorm_bwd_heuristic(p);
  int resident = 0;
  // Only the clustered kernel needs the count (checked here too, so other calls build no Params).
  if (choice.stages > 0 && choice.cluster > 1 && p.as<families::RmsNormBwdProblem>().rows > 0) {
    const Params params = bwd.heuristic(p);
    const std::pair<int, std::string> key{ordinal, params.canonical()};
    bool known = false;
    {
      std::lock_guard lock(g_mu);
      if (auto it = g_resident.find(key); it != g_resident.end()) resident = it->second, known = true;
    }
    if (!known) {
      KILN_ASSIGN_OR_RETURN(resident, client::rmsnorm_bwd_resident_clusters(runtime, bwd, params, p));
      std::lock_guard lock(g_mu);
      g_resident[key] = resident;
    }
  }
  return families::rmsnorm_bwd_slabs(choice, p, sms, resident);
}

Result<DeviceInfo> device_info(int ordinal) {
  KILN_ASSIGN_OR_RETURN(const jit::DeviceInfo* dev, jit::device_info(ordinal));
  DeviceInfo info;
  info.sms = dev->sm_count;
  info.max_cluster = dev->major >= 9 && dev->cluster_launch ? 8 : 1;  // 8: the portable cluster size
  return info;
}

}  // namespace

Result<std::int64_t> rms_norm_backward_workspace_elements(const TensorView& x) {
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_float_dtype(x, "x"));
  KILN_ASSIGN_OR_RETURN(auto xr, client::as_rows(x, "x"));
  if (x.device.kind != DeviceKind::cuda || xr.rows == 0 || xr.cols == 0) return std::int64_t(0);
  KILN_ASSIGN_OR_RETURN(DeviceInfo info, device_info(x.device.index));
  // dy, dx and dh may allow narrower accesses than x, which changes the heuristic's block shape,
  // and so may dh itself (add_rms_norm_backward): the most slabs over every access width, with
  // and without dh.
  std::int64_t slabs = 0;
  for (std::uint32_t align : {16u, 8u, 4u, 2u})
    for (std::int64_t stride : {xr.cols, xr.cols + 1})
      for (bool fused : {false, true}) {
        const Problem p = Problem::of(x.dtype, align,
                                      families::RmsNormBwdProblem{.rows = xr.rows,
                                                                  .cols = xr.cols,
                                                                  .dy_row_stride = stride,
                                                                  .x_row_stride = stride,
                                                                  .dx_row_stride = stride,
                                                                  .max_cluster = info.max_cluster,
                                                                  .dh_row_stride = fused ? stride : 0,
                                                                  .recompute = fused ? 1 : 0});
        slabs = std::max(slabs, families::rmsnorm_bwd_slabs(families::rmsnorm_bwd_heuristic(p), p, info.sms));
      }
  return slabs * xr.cols;
}

namespace {

// Both ops: the checks, then the CPU fallback or the two launches. `op` names the op in messages
// and `x_name` its normalized input ("x" or "h"). Without inv_rms the kernel recomputes it with
// eps; with dh, dh is added to dx.
Status backward(const char* op, const char* x_name, const TensorView& dy, const TensorView* dh, const TensorView& x,
                const TensorView& weight, const TensorView* inv_rms, double eps, const TensorView& dx,
                const TensorView& dw, Stream stream, Runtime* runtime, const TensorView* workspace) {
  const std::string prefix = std::string(op) + ": ";
  KILN_TRY(client::check_view(dy, "dy"));
  if (dh) KILN_TRY(client::check_view(*dh, "dh"));
  KILN_TRY(client::check_view(x, x_name));
  KILN_TRY(client::check_view(weight, "weight"));
  if (inv_rms) KILN_TRY(client::check_view(*inv_rms, "inv_rms"));
  KILN_TRY(client::check_view(dx, "dx"));
  KILN_TRY(client::check_view(dw, "dw"));
  if (workspace) KILN_TRY(client::check_view(*workspace, "workspace"));
  KILN_TRY(client::check_float_dtype(x, x_name));
  if (dy.dtype != x.dtype || (dh && dh->dtype != x.dtype) || weight.dtype != x.dtype || dx.dtype != x.dtype ||
      dw.dtype != x.dtype)
    return unsupported_dtype(prefix + "dtypes differ (" + x_name + " " + dtype_name(x.dtype) + ", dy " +
                             dtype_name(dy.dtype) + (dh ? std::string(", dh ") + dtype_name(dh->dtype) : "") +
                             ", weight " + dtype_name(weight.dtype) + ", dx " + dtype_name(dx.dtype) + ", dw " +
                             dtype_name(dw.dtype) + ")");
  if (inv_rms && inv_rms->dtype != DType::f32)
    return unsupported_dtype(prefix + "inv_rms must be f32, not " + dtype_name(inv_rms->dtype));
  if (workspace && workspace->dtype != DType::f32)
    return unsupported_dtype(prefix + "workspace must be f32, not " + dtype_name(workspace->dtype));
  const bool ranks = dy.rank == x.rank && dx.rank == x.rank && (!dh || dh->rank == x.rank);
  if (!ranks) return shape_mismatch(prefix + (dh ? "dy, dh, " : "dy, ") + x_name + " and dx have different ranks");
  for (int i = 0; i < x.rank; ++i)
    if (dy.shape[i] != x.shape[i] || dx.shape[i] != x.shape[i] || (dh && dh->shape[i] != x.shape[i]))
      return shape_mismatch(prefix + (dh ? "dy, dh, " : "dy, ") + x_name + " and dx have different shapes");
  const std::int64_t hidden = x.shape[x.rank - 1];
  if (hidden == 0) return shape_mismatch(prefix + "the normalized dimension is empty");
  for (const auto* t : {&weight, &dw}) {
    const char* name = t == &weight ? "weight" : "dw";
    if (t->rank != 1 || t->shape[0] != hidden)
      return shape_mismatch(prefix + name + " must have shape [" + std::to_string(hidden) + "]");
    if (t->strides[0] != 1 && hidden > 1) return shape_mismatch(prefix + name + " must be contiguous");
  }
  KILN_ASSIGN_OR_RETURN(auto dyr, client::as_rows(dy, "dy"));
  KILN_ASSIGN_OR_RETURN(auto xr, client::as_rows(x, x_name));
  KILN_ASSIGN_OR_RETURN(auto dxr, client::as_rows(dx, "dx"));
  client::RowView dhr{};
  if (dh) {
    KILN_ASSIGN_OR_RETURN(dhr, client::as_rows(*dh, "dh"));
    // The kernels take one row stride of at least the row length (a broadcast dh is not one).
    if (xr.rows > 1 && dhr.row_stride < hidden)
      return shape_mismatch(prefix + "dh's rows overlap (row stride " + std::to_string(dhr.row_stride) + ")");
  }
  if (inv_rms) {
    if (inv_rms->numel() != xr.rows)
      return shape_mismatch(prefix + "inv_rms must hold one value per row (" + std::to_string(xr.rows) + ")");
    if (!inv_rms->is_contiguous()) return shape_mismatch(prefix + "inv_rms must be contiguous");
  } else if (!std::isfinite(eps) || eps < 0) {
    return invalid_argument(prefix + "eps must be finite and non-negative");
  }
  if (workspace && !workspace->is_contiguous()) return shape_mismatch(prefix + "workspace must be contiguous");

  const DeviceKind where = x.device.kind;
  const TensorView* all[] = {&dy, &x, &weight, inv_rms, &dx, &dw, dh};
  const char* names[] = {"dy", x_name, "weight", "inv_rms", "dx", "dw", "dh"};
  for (int i = 0; i < 7; ++i) {
    if (!all[i]) continue;
    KILN_TRY(client::check_device(*all[i], names[i], where));
    if (where == DeviceKind::cuda && all[i]->device.index != x.device.index)
      return device_error(prefix + "tensors are on different GPUs");
  }
  if (workspace) {
    if (where != DeviceKind::cuda) return device_error(prefix + "a workspace is for CUDA tensors only");
    KILN_TRY(client::check_device(*workspace, "workspace", where));
    if (workspace->device.index != x.device.index) return device_error(prefix + "the workspace is on another GPU");
  }

  const auto esize = std::int64_t(dtype_size(x.dtype));
  // Without dh, dx stands in for it.
  const std::uint32_t alignment = client::common_alignment(
      {reinterpret_cast<std::uintptr_t>(dy.data), reinterpret_cast<std::uintptr_t>(x.data),
       reinterpret_cast<std::uintptr_t>(weight.data), reinterpret_cast<std::uintptr_t>(dx.data),
       reinterpret_cast<std::uintptr_t>(dh ? dh->data : dx.data)},
      {dyr.row_stride * esize, xr.row_stride * esize, dxr.row_stride * esize, dhr.row_stride * esize});
  // slabs and max_cluster follow below, for the host or the device.
  families::RmsNormBwdProblem q{.rows = xr.rows,
                                .cols = hidden,
                                .dy_row_stride = dyr.row_stride,
                                .x_row_stride = xr.row_stride,
                                .dx_row_stride = dxr.row_stride,
                                .dh_row_stride = dh ? dhr.row_stride : 0,
                                .recompute = inv_rms ? 0 : 1,
                                .eps = inv_rms ? 0.0 : eps};
  families::RmsNormBwdReduceProblem qr{.cols = hidden};

  static const Family* const bwd = Registry::global().find("rmsnorm_bwd");
  static const Family* const reduce = Registry::global().find("rmsnorm_bwd_reduce");
  if (!bwd || !reduce) return internal_error("the rmsnorm_bwd families are not registered");
  void* const inv_rms_data = inv_rms ? inv_rms->data : nullptr;
  void* const dh_data = dh ? dh->data : nullptr;

  if (where == DeviceKind::cpu) {
    // One slab: the whole sum in fp64, rounded once.
    q.slabs = qr.slabs = xr.rows > 0 ? 1 : 0;
    q.max_cluster = 1;
    const Problem p = Problem::of(x.dtype, alignment, q), pr = Problem::of(x.dtype, 16, qr);
    std::vector<float> partial(std::size_t(hidden), 0.f);
    void* b[7] = {dy.data, x.data, weight.data, inv_rms_data, dx.data, partial.data(), dh_data};
    KILN_TRY(bwd->cpu_reference(bwd->heuristic(p), p, b));
    void* r[2] = {partial.data(), dw.data};
    return reduce->cpu_reference(reduce->heuristic(pr), pr, r);
  }

  KILN_ASSIGN_OR_RETURN(DeviceInfo info, device_info(x.device.index));
  q.max_cluster = info.max_cluster;
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  // 1 to 8 rows, or up to 16 of at most 1024 elements (families::few_rows_launch): one launch of
  // rmsnorm_bwd_rows where it holds the problem (16-byte aligned rows of whole packs, dw included),
  // instead of the two stages below. One row's strides are the row length: only its first row is
  // read. Larger calls skip the check.
  if (families::few_rows_launch(xr.rows, hidden, 1024)) {
    const auto stride = [&](std::int64_t s) { return xr.rows <= 1 ? hidden : s; };
    const families::RmsNormBwdRowsProblem rq{.rows = xr.rows,
                                             .cols = hidden,
                                             .dy_row_stride = stride(dyr.row_stride),
                                             .x_row_stride = stride(xr.row_stride),
                                             .dx_row_stride = stride(dxr.row_stride),
                                             .dh_row_stride = dh ? stride(dhr.row_stride) : 0,
                                             .recompute = inv_rms ? 0 : 1,
                                             .eps = inv_rms ? 0.0 : eps};
    const std::uint32_t rows_alignment = client::common_alignment(
        {reinterpret_cast<std::uintptr_t>(dy.data), reinterpret_cast<std::uintptr_t>(x.data),
         reinterpret_cast<std::uintptr_t>(weight.data), reinterpret_cast<std::uintptr_t>(dx.data),
         reinterpret_cast<std::uintptr_t>(dw.data), reinterpret_cast<std::uintptr_t>(dh ? dh->data : dx.data)},
        {rq.dy_row_stride * esize, rq.x_row_stride * esize, rq.dx_row_stride * esize,
         (dh ? rq.dh_row_stride : rq.dx_row_stride) * esize, hidden * esize});
    const Problem rp = Problem::of(x.dtype, rows_alignment, rq);
    if (families::rmsnorm_bwd_rows_fits(rp, info.max_cluster)) {
      static const Family* const few = Registry::global().find("rmsnorm_bwd_rows");
      if (!few) return internal_error("the rmsnorm_bwd_rows family is not registered");
      void* b[7] = {dy.data, x.data, weight.data, inv_rms_data, dx.data, dw.data, dh_data};
      return runtime->run(*few, rp, b, stream);
    }
  }
  KILN_ASSIGN_OR_RETURN(const std::int64_t slabs,
                        slabs_for(*bwd, Problem::of(x.dtype, alignment, q), x.device.index, info.sms, *runtime));
  q.slabs = qr.slabs = slabs;
  const Problem p = Problem::of(x.dtype, alignment, q), pr = Problem::of(x.dtype, 16, qr);
  const std::int64_t needed = slabs * hidden;

  void* ws = nullptr;
  client::StreamWorkspace scratch;
  if (workspace) {
    if (workspace->numel() < needed)
      return invalid_argument(prefix + "the workspace holds " + std::to_string(workspace->numel()) +
                              " elements, this call needs " + std::to_string(needed));
    ws = workspace->data;
  } else if (needed > 0) {
    KILN_ASSIGN_OR_RETURN(scratch, client::StreamWorkspace::get(x.device.index, stream, needed));
    ws = scratch.data();
  }
  if (slabs > 0) {
    void* b[7] = {dy.data, x.data, weight.data, inv_rms_data, dx.data, ws, dh_data};
    KILN_TRY(runtime->run(*bwd, p, b, stream));
  }
  void* r[2] = {ws, dw.data};
  return runtime->run(*reduce, pr, r, stream);
}

}  // namespace

Status rms_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
                         const TensorView& inv_rms, const TensorView& dx, const TensorView& dw, Stream stream,
                         Runtime* runtime, const TensorView* workspace) {
  return backward("rms_norm_backward", "x", dy, nullptr, x, weight, &inv_rms, 0.0, dx, dw, stream, runtime,
                  workspace);
}

Status add_rms_norm_backward(const TensorView& dy, const TensorView* dh, const TensorView& h,
                             const TensorView& weight, const TensorView& dx, const TensorView& dw, double eps,
                             Stream stream, Runtime* runtime, const TensorView* workspace) {
  return backward("add_rms_norm_backward", "h", dy, dh, h, weight, nullptr, eps, dx, dw, stream, runtime, workspace);
}

}  // namespace kiln

// ---- declarations (kiln/op.h) ----

void kiln_register_ops_rmsnorm_bwd(kiln::Registry& r) {
  using namespace kiln;
  OpDecl op;
  op.name = "rms_norm_backward";
  op.doc = "(dx, dw) of RMSNorm from the forward's inv_rms. workspace: f32 scratch for the partial dw rows "
           "(at least rms_norm_backward_workspace_elements(x)); absent: one cached per stream.";
  op.tensors = {{.name = "dy", .shape = "[..., hidden]", .grad_of = "out", .strided_rows = true},
                {.name = "x", .shape = "[..., hidden]", .strided_rows = true},
                {.name = "weight", .max_rank = 1, .shape = "[hidden]"},
                {.name = "inv_rms", .dtypes = dtype_bit(DType::f32), .shape = "[rows]"},
                {.name = "workspace", .optional = true, .dtypes = dtype_bit(DType::f32), .shape = "[elements]"},
                {.name = "dx", .role = TensorRole::output, .shape = "[..., hidden]", .grad_of = "x",
                 .strided_rows = true},
                {.name = "dw", .role = TensorRole::output, .max_rank = 1, .shape = "[hidden]", .grad_of = "weight"}};
  op.run = [](const OpCall& c) {
    return rms_norm_backward(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(5), c.tensor(6), c.stream,
                             c.runtime, c.optional(4));
  };
  op.infer = [](const OpCall& c, std::span<OutputShape> out) {
    out[0] = shape_like(c.tensor(1), c.tensor(1).dtype);
    out[1] = shape_like(c.tensor(2), c.tensor(2).dtype);
    return Status{};
  };
  (void)r.add_op(std::move(op));

  OpDecl add;
  add.name = "add_rms_norm_backward";
  add.doc = "(dx, dw) of add_rms_norm (h = x + residual, out = rms_norm(h) * weight, residual_out = h) in one "
            "pass: inv_rms recomputed from h with eps, and dh, the gradient of residual_out (absent: zero), added "
            "to dx, which is the gradient of both x and residual. workspace: as rms_norm_backward's (at least "
            "rms_norm_backward_workspace_elements(h)).";
  add.tensors = {{.name = "dy", .shape = "[..., hidden]", .grad_of = "out", .strided_rows = true},
                 {.name = "dh", .optional = true, .shape = "[..., hidden]", .grad_of = "residual_out",
                  .strided_rows = true},
                 {.name = "h", .shape = "[..., hidden]", .strided_rows = true},
                 {.name = "weight", .max_rank = 1, .shape = "[hidden]"},
                 {.name = "workspace", .optional = true, .dtypes = dtype_bit(DType::f32), .shape = "[elements]"},
                 {.name = "dx", .role = TensorRole::output, .shape = "[..., hidden]", .grad_of = "x",
                  .strided_rows = true},
                 {.name = "dw", .role = TensorRole::output, .max_rank = 1, .shape = "[hidden]", .grad_of = "weight"}};
  add.scalars = {{.name = "eps", .kind = ScalarKind::f64, .has_default = true, .default_value = 1e-6}};
  add.run = [](const OpCall& c) {
    return add_rms_norm_backward(c.tensor(0), c.optional(1), c.tensor(2), c.tensor(3), c.tensor(5), c.tensor(6),
                                 c.f64(0), c.stream, c.runtime, c.optional(4));
  };
  add.infer = [](const OpCall& c, std::span<OutputShape> out) {
    out[0] = shape_like(c.tensor(2), c.tensor(2).dtype);
    out[1] = shape_like(c.tensor(3), c.tensor(3).dtype);
    return Status{};
  };
  (void)r.add_op(std::move(add));
}
