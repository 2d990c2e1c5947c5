#include <algorithm>
#include <tuple>

#include "client/validate.h"
#include "families/rope/rope.h"
#include "kiln/family.h"
#include "kiln/op.h"
#include "kiln/ops.h"

namespace kiln {
namespace {

constexpr std::int64_t k_rope_head_dims[] = {64, 80, 96, 128, 256};

// q, k or an output as tokens of `heads` contiguous heads, tokens evenly strided.
struct TokenView {
  std::int64_t tokens = 0, heads = 0, stride = 0;  // stride in elements
};

Result<TokenView> as_tokens(const TensorView& t, const char* name, std::int64_t head_dim) {
  if (t.rank != 3) return shape_mismatch(std::string("apply_rope_qk: ") + name + " must be [tokens, heads, head_dim]");
  TokenView v{t.shape[0], t.shape[1], t.strides[0]};
  if (t.strides[2] != 1 || (v.heads > 1 && t.strides[1] != head_dim))
    return shape_mismatch(std::string("apply_rope_qk: ") + name + " must have contiguous heads (strides [*, " +
                          std::to_string(head_dim) + ", 1])");
  if (v.tokens <= 1) v.stride = v.heads * head_dim;
  if (v.stride < v.heads * head_dim)
    return shape_mismatch(std::string("apply_rope_qk: ") + name + "'s token stride is shorter than a token");
  return v;
}

// The bytes a tensor touches: `rows` rows of `row_bytes`, `stride` bytes apart.
struct ByteRows {
  std::uintptr_t base;
  std::int64_t row_bytes, stride, rows;
};

ByteRows byte_rows(const TensorView& t, const TokenView& v, std::int64_t head_dim) {
  const auto es = std::int64_t(dtype_size(t.dtype));
  return {reinterpret_cast<std::uintptr_t>(t.data), v.heads * head_dim * es, v.stride * es, v.tokens};
}
ByteRows byte_rows(const TensorView& t) {
  return {reinterpret_cast<std::uintptr_t>(t.data), t.numel() * std::int64_t(dtype_size(t.dtype)), 0, 1};
}

// Whether two row sets may share a byte. Rows with the same stride are compared modulo the stride,
// so q and k (or q_out and k_out) interleaved in one fused qkv tensor do not count as overlapping;
// otherwise any intersection of the spans does.
bool may_overlap(const ByteRows& a, const ByteRows& b) {
  if (a.rows == 0 || b.rows == 0 || a.row_bytes == 0 || b.row_bytes == 0) return false;
  const std::uintptr_t a_end = a.base + std::uintptr_t((a.rows - 1) * a.stride + a.row_bytes);
  const std::uintptr_t b_end = b.base + std::uintptr_t((b.rows - 1) * b.stride + b.row_bytes);
  if (a_end <= b.base || b_end <= a.base) return false;
  if (a.rows == 1 || b.rows == 1 || a.stride != b.stride) return true;
  const auto s = std::int64_t(a.stride);
  const auto d = std::int64_t(b.base - a.base);  // two's complement difference
  const std::int64_t r = ((d % s) + s) % s;      // where b's rows start within a's row period
  return r < a.row_bytes || r + b.row_bytes > s;
}

}  // namespace

Status apply_rope_qk(const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
                     const TensorView& position_ids, const TensorView& q_out, const TensorView& k_out,
                     RopeLayout layout, Stream stream, Runtime* runtime) {
  KILN_TRY(client::check_view(q, "q"));
  KILN_TRY(client::check_view(k, "k"));
  KILN_TRY(client::check_view(cos, "cos"));
  KILN_TRY(client::check_view(sin, "sin"));
  KILN_TRY(client::check_view(position_ids, "position_ids"));
  KILN_TRY(client::check_view(q_out, "q_out"));
  KILN_TRY(client::check_view(k_out, "k_out"));
  if (layout != RopeLayout::neox && layout != RopeLayout::gptj)
    return invalid_argument("apply_rope_qk: unknown layout");

  KILN_TRY(client::check_float_dtype(q, "q"));
  if (k.dtype != q.dtype || q_out.dtype != q.dtype || k_out.dtype != q.dtype)
    return unsupported_dtype(std::string("apply_rope_qk: q, k, q_out and k_out must share a dtype (q ") +
                             dtype_name(q.dtype) + ", k " + dtype_name(k.dtype) + ", q_out " + dtype_name(q_out.dtype) +
                             ", k_out " + dtype_name(k_out.dtype) + ")");
  if (cos.dtype != DType::f32 || sin.dtype != DType::f32)
    return unsupported_dtype(std::string("apply_rope_qk: cos and sin must be f32 (got ") + dtype_name(cos.dtype) +
                             ", " + dtype_name(sin.dtype) + ")");
  if (position_ids.dtype != DType::i64)
    return unsupported_dtype(std::string("apply_rope_qk: position_ids must be i64 (got ") +
                             dtype_name(position_ids.dtype) + ")");

  if (q.rank != 3 || k.rank != 3) return shape_mismatch("apply_rope_qk: q and k must be [tokens, heads, head_dim]");
  const std::int64_t tokens = q.shape[0], head_dim = q.shape[2];
  if (k.shape[0] != tokens || k.shape[2] != head_dim)
    return shape_mismatch("apply_rope_qk: q is [" + std::to_string(tokens) + ", *, " + std::to_string(head_dim) +
                          "] but k is [" + std::to_string(k.shape[0]) + ", *, " + std::to_string(k.shape[2]) + "]");
  for (auto [out, in, name] : {std::tuple{&q_out, &q, "q_out"}, std::tuple{&k_out, &k, "k_out"}})
    if (out->rank != in->rank || !std::equal(out->shape, out->shape + out->rank, in->shape))
      return shape_mismatch(std::string("apply_rope_qk: ") + name + " must have the shape of its input");
  if (head_dim % 2)
    return shape_mismatch("apply_rope_qk: head_dim must be even (got " + std::to_string(head_dim) + ")");
  if (std::find(std::begin(k_rope_head_dims), std::end(k_rope_head_dims), head_dim) == std::end(k_rope_head_dims))
    return invalid_argument("apply_rope_qk: head_dim " + std::to_string(head_dim) +
                            " is not supported (64, 80, 96, 128, 256)");
  if (cos.rank != 2 || cos.shape[1] != head_dim / 2)
    return shape_mismatch("apply_rope_qk: cos must be [max_pos, " + std::to_string(head_dim / 2) + "]");
  if (sin.rank != 2 || sin.shape[0] != cos.shape[0] || sin.shape[1] != cos.shape[1])
    return shape_mismatch("apply_rope_qk: sin must have the shape of cos");
  if (!cos.is_contiguous() || !sin.is_contiguous())
    return shape_mismatch("apply_rope_qk: cos and sin must be contiguous");
  if (position_ids.rank != 1 || position_ids.shape[0] != tokens)
    return shape_mismatch("apply_rope_qk: position_ids must be [" + std::to_string(tokens) + "]");
  if (!position_ids.is_contiguous()) return shape_mismatch("apply_rope_qk: position_ids must be contiguous");
  for (const TensorView* t : {&q, &k, &cos, &sin, &position_ids, &q_out, &k_out})
    if (reinterpret_cast<std::uintptr_t>(t->data) % dtype_size(t->dtype))
      return invalid_argument("apply_rope_qk: every tensor must be aligned to its element size");
  KILN_ASSIGN_OR_RETURN(const TokenView qv, as_tokens(q, "q", head_dim));
  KILN_ASSIGN_OR_RETURN(const TokenView kv, as_tokens(k, "k", head_dim));
  KILN_ASSIGN_OR_RETURN(const TokenView qov, as_tokens(q_out, "q_out", head_dim));
  KILN_ASSIGN_OR_RETURN(const TokenView kov, as_tokens(k_out, "k_out", head_dim));
  if (qv.heads + kv.heads > (std::int64_t(1) << 16))
    return shape_mismatch("apply_rope_qk: more than 65536 heads per token");

  // Each output is its own input (in place) or overlaps no input and not the other output.
  const ByteRows qb = byte_rows(q, qv, head_dim), kb = byte_rows(k, kv, head_dim);
  const ByteRows qob = byte_rows(q_out, qov, head_dim), kob = byte_rows(k_out, kov, head_dim);
  const ByteRows tables[3] = {byte_rows(cos), byte_rows(sin), byte_rows(position_ids)};
  const bool q_in_place = q_out.data == q.data && qov.stride == qv.stride;
  const bool k_in_place = k_out.data == k.data && kov.stride == kv.stride;
  if (may_overlap(qob, kob)) return invalid_argument("apply_rope_qk: q_out and k_out overlap");
  if (may_overlap(qob, kb) || may_overlap(kob, qb))
    return invalid_argument("apply_rope_qk: q_out may alias only q, and k_out only k");
  if (!q_in_place && may_overlap(qob, qb)) return invalid_argument("apply_rope_qk: q_out overlaps q without being q");
  if (!k_in_place && may_overlap(kob, kb)) return invalid_argument("apply_rope_qk: k_out overlaps k without being k");
  for (const ByteRows& t : tables)
    if (may_overlap(qob, t) || may_overlap(kob, t))
      return invalid_argument("apply_rope_qk: an output overlaps cos, sin or position_ids");

  const DeviceKind where = q.device.kind;
  KILN_TRY(client::check_device(q, "q", where));
  KILN_TRY(client::check_device(k, "k", where));
  KILN_TRY(client::check_device(cos, "cos", where));
  KILN_TRY(client::check_device(sin, "sin", where));
  KILN_TRY(client::check_device(position_ids, "position_ids", where));
  KILN_TRY(client::check_device(q_out, "q_out", where));
  KILN_TRY(client::check_device(k_out, "k_out", where));
  if (where == DeviceKind::cuda)
    for (const TensorView* t : {&k, &cos, &sin, &position_ids, &q_out, &k_out})
      if (t->device.index != q.device.index) return device_error("apply_rope_qk: tensors are on different GPUs");

  const std::int64_t max_pos = cos.shape[0];
  const auto es = std::int64_t(dtype_size(q.dtype));
  // position_ids are read one at a time and do not limit the access width.
  const std::uint32_t alignment = client::common_alignment(
      {reinterpret_cast<std::uintptr_t>(q.data), reinterpret_cast<std::uintptr_t>(k.data),
       reinterpret_cast<std::uintptr_t>(cos.data), reinterpret_cast<std::uintptr_t>(sin.data),
       reinterpret_cast<std::uintptr_t>(q_out.data), reinterpret_cast<std::uintptr_t>(k_out.data)},
      {qv.stride * es, kv.stride * es, qov.stride * es, kov.stride * es});
  const Problem p = Problem::of(
      q.dtype, alignment,
      families::RopeProblem{.tokens = tokens,
                            .q_heads = qv.heads,
                            .kv_heads = kv.heads,
                            .head_dim = head_dim,
                            .layout = layout == RopeLayout::neox ? families::k_rope_neox : families::k_rope_gptj,
                            .max_pos = max_pos,
                            .q_stride = qv.stride,
                            .k_stride = kv.stride,
                            .q_out_stride = qov.stride,
                            .k_out_stride = kov.stride});
  if (tokens == 0 || qv.heads + kv.heads == 0) return {};

  static const Family* family = Registry::global().find("rope");
  void* buffers[7] = {q.data, k.data, cos.data, sin.data, position_ids.data, q_out.data, k_out.data};
  if (where == DeviceKind::cpu) {
    const auto* ids = static_cast<const std::int64_t*>(position_ids.data);
    for (std::int64_t t = 0; t < tokens; ++t)
      if (ids[t] < 0 || ids[t] >= max_pos)
        return invalid_argument("apply_rope_qk: position_ids[" + std::to_string(t) + "] = " + std::to_string(ids[t]) +
                                " is outside [0, " + std::to_string(max_pos) + ")");
  }
  return client::run_family(family, "rope", p, buffers, where, stream, runtime);
}

}  // namespace kiln

// ---- declarations (kiln/op.h) ----

void kiln_register_ops_rope(kiln::Registry& r) {
  using namespace kiln;
  OpDecl op;
  op.name = "apply_rope_qk";
  op.doc = "(q_out, k_out): rotary embedding of q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim] at "
           "position_ids (i64 [tokens]) from f32 cos/sin [max_pos, head_dim/2]; layout neox or gptj. q_out may be q "
           "and k_out may be k (in place).";
  op.tensors = {{.name = "q", .min_rank = 3, .max_rank = 3, .shape = "[tokens, q_heads, head_dim]"},
                {.name = "k", .min_rank = 3, .max_rank = 3, .shape = "[tokens, kv_heads, head_dim]"},
                {.name = "cos", .dtypes = dtype_bit(DType::f32), .min_rank = 2, .max_rank = 2,
                 .shape = "[max_pos, head_dim / 2]"},
                {.name = "sin", .dtypes = dtype_bit(DType::f32), .min_rank = 2, .max_rank = 2,
                 .shape = "[max_pos, head_dim / 2]"},
                {.name = "position_ids", .dtypes = dtype_bit(DType::i64), .max_rank = 1, .shape = "[tokens]"},
                {.name = "q_out", .role = TensorRole::output, .min_rank = 3, .max_rank = 3,
                 .shape = "[tokens, q_heads, head_dim]"},
                {.name = "k_out", .role = TensorRole::output, .min_rank = 3, .max_rank = 3,
                 .shape = "[tokens, kv_heads, head_dim]"}};
  op.scalars = {{.name = "layout", .kind = ScalarKind::choice, .has_default = true, .default_value = 0,
                 .choices = {"neox", "gptj"}}};
  op.run = [](const OpCall& c) {
    return apply_rope_qk(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5), c.tensor(6),
                         static_cast<RopeLayout>(c.i64(0)), c.stream, c.runtime);
  };
  op.infer = [](const OpCall& c, std::span<OutputShape> out) {
    out[0] = shape_like(c.tensor(0), c.tensor(0).dtype);
    out[1] = shape_like(c.tensor(1), c.tensor(1).dtype);
    return Status{};
  };
  (void)r.add_op(std::move(op));
}
