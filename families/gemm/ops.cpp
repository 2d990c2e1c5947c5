// The tensor-core typed ops: quantize_fp8, fp8_gemm, fused_gated_mlp (contracts in kiln/ops.h).

#include "client/validate.h"
#include "families/common/gemm/gemm_util.h"
#include "families/gemm/fp8_gemm.h"
#include "families/gemm/gated_mlp.h"
#include "families/gemm/quantize_fp8.h"
#include "jit/driver.h"
#include "kiln/family.h"
#include "kiln/op.h"
#include "kiln/ops.h"

namespace kiln {
namespace {

namespace g = families::gemm;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

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

Status require_contiguous(const TensorView& t, const char* op, const char* name) {
  if (!t.is_contiguous()) return shape_mismatch(std::string(op) + ": " + name + " must be contiguous");
  return {};
}

// Operands move in 16-byte pieces; scales are read as single floats.
Status require_aligned(const TensorView& t, const char* op, const char* name, std::uintptr_t bytes = 16) {
  if (reinterpret_cast<std::uintptr_t>(t.data) % bytes)
    return invalid_argument(std::string(op) + ": " + name + " must be " + std::to_string(bytes) + "-byte aligned");
  return {};
}

// Checks that every tensor is on one device kind (the first's) and one GPU; returns that kind.
Result<DeviceKind> common_device(const char* op, std::initializer_list<std::pair<const TensorView*, const char*>> ts) {
  const TensorView& first = *ts.begin()->first;
  const DeviceKind where = first.device.kind;
  for (const auto& [t, name] : ts) {
    KILN_TRY(client::check_device(*t, name, where));
    if (where == DeviceKind::cuda && t->device.index != first.device.index)
      return device_error(std::string(op) + ": tensors are on different GPUs");
  }
  return where;
}

// Runs `family_name` on the problem: the CPU reference for host tensors, the GPU kernel otherwise.
Status dispatch(const char* family_name, const Problem& p, std::span<void* const> buffers, DeviceKind where,
                Stream stream, Runtime* runtime) {
  return client::run_family(Registry::global().find(family_name), family_name, p, buffers, where, stream, runtime);
}

}  // namespace

Status quantize_fp8(const TensorView& x, const TensorView& q, const TensorView& scale, Fp8Granularity granularity,
                    bool transpose, Stream stream, Runtime* runtime) {
  constexpr const char* op = "quantize_fp8";
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_view(q, "q"));
  KILN_TRY(client::check_view(scale, "scale"));
  KILN_TRY(client::check_float_dtype(x, "x"));
  if (q.dtype != DType::u8) return unsupported_dtype("quantize_fp8: q must be u8 (e4m3 codes)");
  if (scale.dtype != DType::f32) return unsupported_dtype("quantize_fp8: scale must be f32");
  std::int64_t mode;
  switch (granularity) {
    case Fp8Granularity::tensor: mode = families::k_q_tensor; break;
    case Fp8Granularity::row_1x128: mode = families::k_q_row; break;
    case Fp8Granularity::tile_128: mode = families::k_q_tile; break;
    default: return invalid_argument("quantize_fp8: unknown granularity " + std::to_string(int(granularity)));
  }
  if (transpose && mode == families::k_q_row)
    return invalid_argument("quantize_fp8: transpose is for weights (tensor or tile_128 granularity)");
  if (transpose && x.rank != 2) return shape_mismatch("quantize_fp8: transpose takes a rank-2 x");
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&q, "q"}, {&scale, "scale"}}) {
    KILN_TRY(require_contiguous(*t, op, name));
    KILN_TRY(require_aligned(*t, op, name, t == &scale ? 4 : 16));
  }
  const std::int64_t cols = x.shape[x.rank - 1], rows = cols ? x.numel() / cols : 0;
  bool q_ok = q.rank == x.rank;
  for (int i = 0; q_ok && i < x.rank; ++i) q_ok = q.shape[i] == x.shape[transpose ? 1 - i : i];
  if (!q_ok)
    return shape_mismatch("quantize_fp8: q must have shape " +
                          (transpose ? "[" + std::to_string(cols) + ", " + std::to_string(rows) + "]" : shape_text(x)) +
                          ", got " + shape_text(q));
  const std::int64_t want = mode == families::k_q_tensor ? 1
                            : mode == families::k_q_row  ? rows * ceil_div(cols, 128)
                                                         : ceil_div(rows, 128) * ceil_div(cols, 128);
  bool s_ok = scale.numel() == want;
  if (mode == families::k_q_row)
    s_ok = s_ok && scale.rank >= 2 && scale.shape[scale.rank - 1] == ceil_div(cols, 128);
  if (mode == families::k_q_tile)
    s_ok = has_shape(scale, {transpose ? ceil_div(cols, 128) : ceil_div(rows, 128),
                             transpose ? ceil_div(rows, 128) : ceil_div(cols, 128)});
  if (!s_ok) return shape_mismatch("quantize_fp8: scale has the wrong shape " + shape_text(scale) + " for this granularity");
  KILN_ASSIGN_OR_RETURN(DeviceKind where, common_device(op, {{&x, "x"}, {&q, "q"}, {&scale, "scale"}}));
  if (rows == 0 || cols == 0) return {};

  const families::QuantizeFp8Problem problem{.rows = rows, .cols = cols, .mode = mode, .transpose = transpose ? 1 : 0};
  void* buffers[3] = {x.data, q.data, scale.data};
  if (mode == families::k_q_tensor) {
    // Pass 1 raises scale[0] from 0 to amax / 448; pass 2 quantizes with it.
    if (where == DeviceKind::cpu) {
      *static_cast<float*>(scale.data) = 0.0f;
    } else {
      KILN_ASSIGN_OR_RETURN(const jit::Driver* d, jit::Driver::get());
      KILN_TRY(d->check(d->memset_d8_async(reinterpret_cast<CUdeviceptr>(scale.data), 0, 4, static_cast<CUstream>(stream)),
                        "cuMemsetD8Async"));
    }
    auto amax = problem;
    amax.mode = families::k_q_amax;
    amax.transpose = 0;
    KILN_TRY(dispatch("quantize_fp8", Problem::of(x.dtype, 16, amax), buffers, where, stream, runtime));
  }
  return dispatch("quantize_fp8", Problem::of(x.dtype, 16, problem), buffers, where, stream, runtime);
}

Status fp8_gemm(const TensorView& a, const TensorView& b, const TensorView& a_scale, const TensorView& b_scale,
                const TensorView& out, Stream stream, Runtime* runtime) {
  constexpr const char* op = "fp8_gemm";
  KILN_TRY(client::check_view(a, "a"));
  KILN_TRY(client::check_view(b, "b"));
  if (!a_scale.data) return invalid_argument("fp8_gemm: a is pre-quantized (u8 e4m3 codes) and needs a_scale");
  if (!b_scale.data) return invalid_argument("fp8_gemm: b is pre-quantized (u8 e4m3 codes) and needs b_scale");
  KILN_TRY(client::check_view(a_scale, "a_scale"));
  KILN_TRY(client::check_view(b_scale, "b_scale"));
  KILN_TRY(client::check_view(out, "out"));
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&b, "b"}})
    if (t->dtype != DType::u8)
      return unsupported_dtype(std::string("fp8_gemm: ") + name + " has dtype " + dtype_name(t->dtype) +
                               "; expected u8 e4m3 codes (quantize_fp8 makes them)");
  if (a_scale.dtype != DType::f32 || b_scale.dtype != DType::f32)
    return unsupported_dtype("fp8_gemm: a_scale and b_scale must be f32");
  if (out.dtype != DType::f16 && out.dtype != DType::bf16)
    return unsupported_dtype(std::string("fp8_gemm: out has dtype ") + dtype_name(out.dtype) + "; expected f16 or bf16");
  if (a.rank != 2 || b.rank != 2 || out.rank != 2) return shape_mismatch("fp8_gemm: a, b and out must be matrices");
  const std::int64_t m = a.shape[0], k = a.shape[1], n = b.shape[1];
  if (b.shape[0] != k)
    return shape_mismatch("fp8_gemm: a is " + shape_text(a) + " but b is " + shape_text(b) + " (K does not match)");
  if (!has_shape(out, {m, n}))
    return shape_mismatch("fp8_gemm: out must have shape [" + std::to_string(m) + ", " + std::to_string(n) + "], got " +
                          shape_text(out));
  KILN_TRY(require_contiguous(a, op, "a"));
  KILN_TRY(require_contiguous(out, op, "out"));
  KILN_TRY(require_contiguous(a_scale, op, "a_scale"));
  KILN_TRY(require_contiguous(b_scale, op, "b_scale"));
  KILN_TRY(require_aligned(a_scale, op, "a_scale", 4));
  KILN_TRY(require_aligned(b_scale, op, "b_scale", 4));
  if (!(b.strides[0] == 1 && (b.strides[1] == k || n <= 1)) && !(k <= 1 && b.is_contiguous()))
    return invalid_argument(
        "fp8_gemm: b must be K-major ([K, N] with strides {1, K}: the transposed view of a contiguous [N, K] "
        "tensor); quantize_fp8 with transpose makes that layout from a row-major [K, N] weight");
  if (k % 16) return shape_mismatch("fp8_gemm: K = " + std::to_string(k) + " must be a multiple of 16");
  const std::int64_t kb = ceil_div(k, 128);
  std::int64_t mode;
  // Where both readings fit (M = 1, K <= 128, N <= 128) they compute the same product.
  if (has_shape(a_scale, {m, kb}) && has_shape(b_scale, {ceil_div(n, 128), kb})) {
    mode = families::k_fp8_blockwise;
  } else if (a_scale.numel() == 1 && b_scale.numel() == 1) {
    mode = families::k_fp8_per_tensor;
  } else {
    return shape_mismatch("fp8_gemm: scales must be one element each (per tensor) or a_scale [" + std::to_string(m) +
                          ", " + std::to_string(kb) + "] and b_scale [" + std::to_string(ceil_div(n, 128)) + ", " +
                          std::to_string(kb) + "] (block-wise); got " + shape_text(a_scale) + " and " +
                          shape_text(b_scale));
  }
  for (const auto& [t, name] : {std::pair{&a, "a"}, {&b, "b"}, {&out, "out"}}) KILN_TRY(require_aligned(*t, op, name));
  KILN_ASSIGN_OR_RETURN(DeviceKind where, common_device(op, {{&a, "a"}, {&b, "b"}, {&a_scale, "a_scale"},
                                                             {&b_scale, "b_scale"}, {&out, "out"}}));
  if (m == 0 || n == 0) return {};
  if (k == 0) return client::fill(out, where, stream);

  const Problem p = Problem::of(out.dtype, 16, g::GemmProblem{.m = m, .n = n, .k = k, .mode = mode});
  void* buffers[5] = {a.data, b.data, a_scale.data, b_scale.data, out.data};
  return dispatch("fp8_gemm", p, buffers, where, stream, runtime);
}

Status fused_gated_mlp(const TensorView& x, const TensorView& gate_weight, const TensorView& up_weight,
                       const TensorView& out, GatedActivation act, Stream stream, Runtime* runtime) {
  constexpr const char* op = "fused_gated_mlp";
  KILN_TRY(client::check_view(x, "x"));
  KILN_TRY(client::check_view(gate_weight, "gate_weight"));
  KILN_TRY(client::check_view(up_weight, "up_weight"));
  KILN_TRY(client::check_view(out, "out"));
  if (x.dtype != DType::f16 && x.dtype != DType::bf16)
    return unsupported_dtype(std::string("fused_gated_mlp: x has dtype ") + dtype_name(x.dtype) +
                             "; expected f16 or bf16");
  for (const auto& [t, name] : {std::pair{&gate_weight, "gate_weight"}, {&up_weight, "up_weight"}, {&out, "out"}})
    if (t->dtype != x.dtype)
      return unsupported_dtype(std::string("fused_gated_mlp: ") + name + " has dtype " + dtype_name(t->dtype) +
                               ", x has " + dtype_name(x.dtype));
  std::int64_t mode;
  switch (act) {
    case GatedActivation::silu: mode = families::k_gated_silu; break;
    case GatedActivation::gelu: mode = families::k_gated_gelu; break;
    default: return invalid_argument("fused_gated_mlp: unknown activation " + std::to_string(int(act)));
  }
  if (x.rank < 2) return shape_mismatch("fused_gated_mlp: x must be [..., hidden] with at least 2 dimensions");
  const std::int64_t hidden = x.shape[x.rank - 1], m = hidden ? x.numel() / hidden : 0;
  if (gate_weight.rank != 2) return shape_mismatch("fused_gated_mlp: gate_weight must be [intermediate, hidden]");
  const std::int64_t inter = gate_weight.shape[0];
  if (gate_weight.shape[1] != hidden)
    return shape_mismatch("fused_gated_mlp: gate_weight is " + shape_text(gate_weight) + " but x has hidden size " +
                          std::to_string(hidden));
  if (!has_shape(up_weight, {inter, hidden}))
    return shape_mismatch("fused_gated_mlp: up_weight must have gate_weight's shape " + shape_text(gate_weight) +
                          ", got " + shape_text(up_weight));
  bool out_ok = out.rank == x.rank && out.shape[out.rank - 1] == inter;
  for (int i = 0; out_ok && i + 1 < x.rank; ++i) out_ok = out.shape[i] == x.shape[i];
  if (!out_ok)
    return shape_mismatch("fused_gated_mlp: out must be x's leading shape by " + std::to_string(inter) + ", got " +
                          shape_text(out));
  if (hidden % 8) return shape_mismatch("fused_gated_mlp: hidden = " + std::to_string(hidden) + " must be a multiple of 8");
  for (const auto& [t, name] :
       {std::pair{&x, "x"}, {&gate_weight, "gate_weight"}, {&up_weight, "up_weight"}, {&out, "out"}}) {
    KILN_TRY(require_contiguous(*t, op, name));
    KILN_TRY(require_aligned(*t, op, name));
  }
  KILN_ASSIGN_OR_RETURN(DeviceKind where, common_device(op, {{&x, "x"}, {&gate_weight, "gate_weight"},
                                                             {&up_weight, "up_weight"}, {&out, "out"}}));
  if (m == 0 || inter == 0) return {};
  if (hidden == 0) return client::fill(out, where, stream);

  const Problem p = Problem::of(x.dtype, 16, g::GemmProblem{.m = m, .n = inter, .k = hidden, .mode = mode});
  void* buffers[4] = {x.data, gate_weight.data, up_weight.data, out.data};
  return dispatch("gated_mlp", p, buffers, where, stream, runtime);
}

}  // namespace kiln

// ---- declarations (kiln/op.h) ----

void kiln_register_ops_gemm(kiln::Registry& r) {
  using namespace kiln;
  {
    OpDecl op;
    op.name = "quantize_fp8";
    op.doc = "(q, scale): x (f32/f16/bf16, contiguous) as e4m3 codes (u8) and f32 scales, one per granularity "
             "group: tensor, 1x128 (per 128 values of a row) or 128x128 (per block). transpose (rank-2 x; tensor "
             "and 128x128) writes q as [cols, rows].";
    op.tensors = {{.name = "x", .shape = "[..., cols]"},
                  {.name = "q", .role = TensorRole::output, .dtypes = dtype_bit(DType::u8), .shape = "[..., cols]"},
                  {.name = "scale", .role = TensorRole::output, .dtypes = dtype_bit(DType::f32), .shape = "[groups]"}};
    op.scalars = {{.name = "granularity", .kind = ScalarKind::choice, .has_default = true, .default_value = 0,
                   .choices = {"tensor", "1x128", "128x128"}},
                  {.name = "transpose", .kind = ScalarKind::boolean, .has_default = true, .default_value = 0}};
    op.run = [](const OpCall& c) {
      return quantize_fp8(c.tensor(0), c.tensor(1), c.tensor(2), static_cast<Fp8Granularity>(c.i64(0)),
                          c.i64(1) != 0, c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      const TensorView& x = c.tensor(0);
      const bool transpose = c.i64(1) != 0;
      const std::int64_t cols = x.shape[x.rank - 1];
      std::int64_t rows = 1;
      for (int i = 0; i + 1 < x.rank; ++i) rows *= x.shape[i];
      const auto blocks = [](std::int64_t n) { return (n + 127) / 128; };
      out[0] = shape_like(x, DType::u8);
      if (transpose) {
        if (x.rank != 2) return shape_mismatch("quantize_fp8: transpose takes a rank-2 x");
        out[0].shape[0] = x.shape[1];
        out[0].shape[1] = x.shape[0];
      }
      out[1].dtype = DType::f32;
      switch (static_cast<Fp8Granularity>(c.i64(0))) {
        case Fp8Granularity::tensor: out[1].rank = 1, out[1].shape[0] = 1; break;
        case Fp8Granularity::row_1x128: out[1].rank = 2, out[1].shape[0] = rows, out[1].shape[1] = blocks(cols); break;
        case Fp8Granularity::tile_128:
          out[1].rank = 2;
          out[1].shape[0] = transpose ? blocks(cols) : blocks(rows);
          out[1].shape[1] = transpose ? blocks(rows) : blocks(cols);
          break;
      }
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "fp8_gemm";
    op.doc = "out [M, N] = a [M, K] x b [K, N] in e4m3 (u8 codes) with fp32 accumulation, f16 or bf16 out; b "
             "K-major (the transposed view of a contiguous [N, K]); scales f32, one element each (per tensor) or "
             "[M, ceil(K/128)] and [ceil(N/128), ceil(K/128)] (block-wise). K a multiple of 16.";
    op.tensors = {{.name = "a", .dtypes = dtype_bit(DType::u8), .min_rank = 2, .max_rank = 2, .shape = "[M, K]"},
                  {.name = "b", .dtypes = dtype_bit(DType::u8), .min_rank = 2, .max_rank = 2, .shape = "[K, N]"},
                  {.name = "a_scale", .dtypes = dtype_bit(DType::f32), .max_rank = 2, .shape = "[1] or [M, K/128]"},
                  {.name = "b_scale", .dtypes = dtype_bit(DType::f32), .max_rank = 2, .shape = "[1] or [N/128, K/128]"},
                  {.name = "out", .role = TensorRole::output, .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2,
                   .shape = "[M, N]"}};
    op.scalars = {{.name = "output_dtype", .kind = ScalarKind::choice, .has_default = true, .default_value = 0,
                   .choices = {"f16", "bf16"}, .doc = "the dtype of out when kiln allocates it"}};
    op.run = [](const OpCall& c) {
      const DType want = c.i64(0) == 0 ? DType::f16 : DType::bf16;
      if (c.tensor(4).dtype != want)
        return unsupported_dtype(std::string("fp8_gemm: out is ") + dtype_name(c.tensor(4).dtype) +
                                 " but output_dtype is " + dtype_name(want));
      return fp8_gemm(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      out[0].dtype = c.i64(0) == 0 ? DType::f16 : DType::bf16;
      out[0].rank = 2;
      out[0].shape[0] = c.tensor(0).shape[0];
      out[0].shape[1] = c.tensor(1).shape[1];
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "fused_gated_mlp";
    op.doc = "out = act(x gate_weight^T) * (x up_weight^T), both projections in one kernel and the intermediate "
             "never written. x [..., hidden] f16/bf16 contiguous; weights [intermediate, hidden]; activation silu "
             "or gelu.";
    op.tensors = {{.name = "x", .dtypes = k_half_dtypes, .shape = "[..., hidden]"},
                  {.name = "gate_weight", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2,
                   .shape = "[intermediate, hidden]"},
                  {.name = "up_weight", .dtypes = k_half_dtypes, .min_rank = 2, .max_rank = 2,
                   .shape = "[intermediate, hidden]"},
                  {.name = "out", .role = TensorRole::output, .dtypes = k_half_dtypes, .shape = "[..., intermediate]"}};
    op.scalars = {{.name = "activation", .kind = ScalarKind::choice, .has_default = true, .default_value = 0,
                   .choices = {"silu", "gelu"}}};
    op.run = [](const OpCall& c) {
      return fused_gated_mlp(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3),
                             static_cast<GatedActivation>(c.i64(0)), c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      if (c.tensor(1).rank != 2) return shape_mismatch("fused_gated_mlp: gate_weight must be [intermediate, hidden]");
      out[0] = shape_like(c.tensor(0), c.tensor(0).dtype, c.tensor(1).shape[0]);
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
}
