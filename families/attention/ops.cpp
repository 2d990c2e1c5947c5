// attention and attention_varlen: validation, the CPU fallback, the launch, and their declarations
// (kiln/op.h), from which the C ABI, Python and torch bindings come.
#include "families/attention/ops.h"

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>

#include "client/validate.h"
#include "client/workspace.h"
#include "families/attention/attention_bwd.h"
#include "families/attention/attention.h"
#include "families/attention/attention_splitkv.h"
#include "jit/device_info.h"
#include "kiln/family.h"
#include "kiln/op.h"
#include "kiln/runtime.h"

namespace kiln {
namespace {

using client::address;
using client::dims;

using families::AttentionProblem;

Status expect_shape(const char* op, const TensorView& t, const char* name, std::initializer_list<std::int64_t> want,
                    const char* names) {
  bool ok = t.rank == int(want.size());
  int i = 0;
  for (std::int64_t w : want) ok = ok && t.shape[i++] == w;
  if (ok) return {};
  std::string w = "[";
  i = 0;
  for (std::int64_t x : want) w += (i++ ? ", " : "") + std::to_string(x);
  return shape_mismatch(std::string(op) + ": " + name + " must be " + names + " = " + w + "], got " + dims(t));
}

// Checks every tensor but the shapes (view, contiguity, dtype, device) and fills the problem from
// q, k and v, whose ranks are `rank`.
Status check_tensors(const char* op, std::initializer_list<std::pair<const TensorView*, const char*>> ts,
                     const TensorView& q) {
  for (const auto& [t, name] : ts) {
    if (!t) continue;
    KILN_TRY(client::check_view(*t, name));
    if (!t->is_contiguous()) return shape_mismatch(std::string(op) + ": " + name + " must be contiguous");
  }
  KILN_TRY(client::check_float_dtype(q, "q"));
  for (const auto& [t, name] : ts) {
    if (!t) continue;
    const std::string n = name;
    const bool index = n.rfind("cu_seqlens", 0) == 0, stats = n == "lse";
    const DType want = index ? DType::i32 : stats ? DType::f32 : q.dtype;
    if (t->dtype != want)
      return unsupported_dtype(std::string(op) + ": " + name + " is " + dtype_name(t->dtype) + ", must be " +
                               dtype_name(want) + (index || stats ? "" : " (the dtype of q)"));
    KILN_TRY(client::check_device(*t, name, q.device.kind));
    if (q.device.kind == DeviceKind::cuda && t->device.index != q.device.index)
      return device_error(std::string(op) + ": " + name + " is on another GPU than q");
  }
  return {};
}

Status check_options(const char* op, const AttentionOptions& o, AttentionProblem& a) {
  if (o.window_left < -1 || o.window_right < -1)
    return invalid_argument(std::string(op) + ": window sizes must be -1 (unbounded) or non-negative, got (" +
                            std::to_string(o.window_left) + ", " + std::to_string(o.window_right) + ")");
  if (o.causal && o.window_right > 0)
    return invalid_argument(std::string(op) + ": causal sees no key right of the diagonal; window_right must be -1 "
                            "or 0 with causal, got " + std::to_string(o.window_right));
  if (!std::isfinite(o.softcap) || o.softcap < 0)
    return invalid_argument(std::string(op) + ": softcap must be finite and non-negative (0: none)");
  if (!std::isfinite(o.scale)) return invalid_argument(std::string(op) + ": scale must be finite (0: 1/sqrt(head_dim))");
  a.causal = o.causal ? 1 : 0;
  a.window_left = o.window_left;
  a.window_right = o.causal ? 0 : o.window_right;
  a.softcap = o.softcap;
  a.scale = o.scale != 0 ? o.scale : 1.0 / std::sqrt(double(a.head_dim));
  return {};
}

// The GPU path's limits, named before anything is compiled.
Status check_gpu(const char* op, const TensorView& q, const AttentionProblem& a) {
  if (q.dtype != DType::f16 && q.dtype != DType::bf16)
    return unsupported_dtype(std::string(op) + ": the GPU kernels take f16 and bf16, not " + dtype_name(q.dtype) +
                             " (f32 runs on host tensors only)");
  if (!families::attention_head_dims_supported(a.head_dim, a.head_dim_v))
    return invalid_argument(std::string(op) + ": the GPU kernels take head_dim/head_dim_v 64/64, 80/80, 96/96, "
                            "128/128, 192/192, 256/256 and 192/128, not " + std::to_string(a.head_dim) + "/" +
                            std::to_string(a.head_dim_v));
  if (a.batch > 65535 || a.heads > 65535)
    return invalid_argument(std::string(op) + ": the GPU kernels take at most 65535 sequences and 65535 heads");
  const std::int64_t lim = 0x7fffffff;
  if (a.seqlen_q > lim || a.seqlen_k > lim || a.total_q * a.heads > lim || a.total_k > lim)
    return invalid_argument(std::string(op) + ": token and row counts must stay below 2^31 on the GPU");
  return {};
}

// The decode path (families/attention/attention_splitkv.h): the split kernel writes each split's
// partial output and lse to a workspace (client/workspace.h: the stream's, or the graph's own
// under capture), the combine kernel merges them into out and lse.
Status run_decode(const AttentionProblem& a, std::int64_t splits, std::uint32_t alignment, const TensorView& q,
                  void* const* buffers, Stream stream, Runtime* runtime) {
  static const Family* split = Registry::global().find("attention_splitkv");
  static const Family* combine = Registry::global().find("attention_combine");
  if (!split || !combine) return internal_error("the attention decode families are not registered");
  const Problem ps = Problem::of(q.dtype, alignment, families::attention_splitkv_problem(a, splits));
  const Problem pc = Problem::of(q.dtype, 16, families::attention_combine_problem(a, splits));
  KILN_TRY(split->check_problem(split->heuristic(ps), ps));
  KILN_TRY(combine->check_problem(combine->heuristic(pc), pc));
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  const std::int64_t elements = families::attention_splitkv_workspace_elements(a, splits);
  KILN_ASSIGN_OR_RETURN(client::StreamWorkspace ws, client::StreamWorkspace::get(q.device.index, stream, elements));
  float* o_part = static_cast<float*>(ws.data());
  float* lse_part = o_part + splits * a.total_q * a.heads * a.head_dim_v;
  void* sb[7] = {buffers[0], buffers[1], buffers[2], buffers[3], buffers[4], o_part, lse_part};
  KILN_TRY(runtime->run(*split, ps, sb, stream));
  void* cb[5] = {o_part, lse_part, buffers[3], buffers[5], buffers[6]};
  return runtime->run(*combine, pc, cb, stream);
}

constexpr std::uint32_t k_f32_neg_inf = 0xff800000u;

Status run(const char* op, const AttentionProblem& a, const TensorView& q, const TensorView& k, const TensorView& v,
           const TensorView* cu_q, const TensorView* cu_k, const TensorView& out, const TensorView* lse,
           std::int64_t decode_splits, Stream stream, Runtime* runtime) {
  static const Family* family = Registry::global().find("attention");
  if (!family) return internal_error("the attention family is not registered");
  const Problem p =
      Problem::of(q.dtype, client::common_alignment({address(q), address(k), address(v), address(out)}, {}), a);
  void* buffers[7] = {q.data, k.data, v.data, cu_q ? cu_q->data : nullptr, cu_k ? cu_k->data : nullptr, out.data,
                      lse ? lse->data : nullptr};
  if (q.device.kind == DeviceKind::cpu) return family->cpu_reference(family->heuristic(p), p, buffers);
  KILN_TRY(check_gpu(op, q, a));
  KILN_TRY(family->check_problem(family->heuristic(p), p));
  if (a.batch == 0 || a.seqlen_q == 0 || a.total_q == 0) return {};
  // No key at all: every row sees nothing (zeros, lse -inf). The kernels need a key token to map,
  // and the choice of kernel does not depend on token counts, so this never reaches them.
  if (a.total_k == 0) {
    KILN_TRY(client::fill(out, DeviceKind::cuda, stream));
    return lse ? client::fill(*lse, DeviceKind::cuda, stream, k_f32_neg_inf) : Status{};
  }
  if (decode_splits < -1 || decode_splits > 1024)
    return invalid_argument(std::string(op) + ": decode_splits must be -1 (one pass), 0 (the heuristic) or 1 to 1024");
  std::int64_t splits = decode_splits;
  if (splits == 0) {
    KILN_ASSIGN_OR_RETURN(const jit::DeviceInfo* dev, jit::device_info(q.device.index));
    splits = families::attention_decode_splits(a, dev->sm_count, dev->compute_capability);
  }
  if (splits >= 1) return run_decode(a, splits, p.alignment, q, buffers, stream, runtime);
  return client::run_family(family, "attention", p, buffers, DeviceKind::cuda, stream, runtime);
}

// The padded layout's problem from q, k, v, out and lse (shapes, dtypes, devices, options).
Status padded_problem(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const TensorView* lse, const AttentionOptions& options,
                      AttentionProblem& a) {
  KILN_TRY(check_tensors(op, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {lse, "lse"}}, q));
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}, std::pair{&out, "out"}})
    if (t->rank != 4)
      return shape_mismatch(std::string(op) + ": " + name + " must be [batch, seqlen, heads, head_dim], got " +
                            dims(*t));
  a = {};
  a.batch = q.shape[0];
  a.seqlen_q = q.shape[1];
  a.heads = q.shape[2];
  a.head_dim = q.shape[3];
  a.seqlen_k = k.shape[1];
  a.kv_heads = k.shape[2];
  a.head_dim_v = v.shape[3];
  a.total_q = a.batch * a.seqlen_q;
  a.total_k = a.batch * a.seqlen_k;
  KILN_TRY(expect_shape(op, k, "k", {a.batch, a.seqlen_k, a.kv_heads, a.head_dim},
                        "[batch, seqlen_k, kv_heads, head_dim]"));
  KILN_TRY(expect_shape(op, v, "v", {a.batch, a.seqlen_k, a.kv_heads, a.head_dim_v},
                        "[batch, seqlen_k, kv_heads, head_dim_v]"));
  KILN_TRY(expect_shape(op, out, "out", {a.batch, a.seqlen_q, a.heads, a.head_dim_v},
                        "[batch, seqlen_q, heads, head_dim_v]"));
  if (lse) KILN_TRY(expect_shape(op, *lse, "lse", {a.batch, a.heads, a.seqlen_q}, "[batch, heads, seqlen_q]"));
  if (a.heads % a.kv_heads)
    return shape_mismatch(std::string(op) + ": q has " + std::to_string(a.heads) +
                          " heads, not a multiple of k's and v's " + std::to_string(a.kv_heads));
  return check_options(op, options, a);
}

}  // namespace

Status attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                 const TensorView* lse, const AttentionOptions& options, Stream stream, Runtime* runtime) {
  const char* op = "attention";
  AttentionProblem a;
  KILN_TRY(padded_problem(op, q, k, v, out, lse, options, a));
  return run(op, a, q, k, v, nullptr, nullptr, out, lse, options.decode_splits, stream, runtime);
}

namespace {

// The packed layout's problem from q, k, v, the offsets, out and lse (shapes, dtypes, devices,
// options; on the host, the offsets' contents).
Status varlen_problem(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, const TensorView& out,
                      const TensorView* lse, std::int64_t max_seqlen_q, std::int64_t max_seqlen_k,
                      const AttentionOptions& options, AttentionProblem& a) {
  KILN_TRY(check_tensors(op,
                         {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&cu_seqlens_q, "cu_seqlens_q"},
                          {&cu_seqlens_k, "cu_seqlens_k"}, {&out, "out"}, {lse, "lse"}},
                         q));
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}, std::pair{&out, "out"}})
    if (t->rank != 3)
      return shape_mismatch(std::string(op) + ": " + name + " must be [tokens, heads, head_dim], got " + dims(*t));
  if (cu_seqlens_q.rank != 1 || cu_seqlens_q.shape[0] < 1)
    return shape_mismatch(std::string(op) + ": cu_seqlens_q must be [batch + 1], got " + dims(cu_seqlens_q));
  a = {};
  a.varlen = 1;
  a.batch = cu_seqlens_q.shape[0] - 1;
  a.total_q = q.shape[0];
  a.heads = q.shape[1];
  a.head_dim = q.shape[2];
  a.total_k = k.shape[0];
  a.kv_heads = k.shape[1];
  a.head_dim_v = v.shape[2];
  a.seqlen_q = max_seqlen_q;
  a.seqlen_k = max_seqlen_k;
  KILN_TRY(expect_shape(op, cu_seqlens_k, "cu_seqlens_k", {a.batch + 1}, "[batch + 1]"));
  KILN_TRY(expect_shape(op, k, "k", {a.total_k, a.kv_heads, a.head_dim}, "[total_k, kv_heads, head_dim]"));
  KILN_TRY(expect_shape(op, v, "v", {a.total_k, a.kv_heads, a.head_dim_v}, "[total_k, kv_heads, head_dim_v]"));
  KILN_TRY(expect_shape(op, out, "out", {a.total_q, a.heads, a.head_dim_v}, "[total_q, heads, head_dim_v]"));
  if (lse) KILN_TRY(expect_shape(op, *lse, "lse", {a.heads, a.total_q}, "[heads, total_q]"));
  if (a.heads % a.kv_heads)
    return shape_mismatch(std::string(op) + ": q has " + std::to_string(a.heads) +
                          " heads, not a multiple of k's and v's " + std::to_string(a.kv_heads));
  if (max_seqlen_q < 0 || max_seqlen_k < 0)
    return invalid_argument(std::string(op) + ": max_seqlen_q and max_seqlen_k must be non-negative");
  if (q.device.kind == DeviceKind::cpu) {
    // The host can read the offsets: each sequence within the tokens and the max lengths.
    for (const auto& [cu, name, total, longest] :
         {std::tuple{&cu_seqlens_q, "cu_seqlens_q", a.total_q, max_seqlen_q},
          std::tuple{&cu_seqlens_k, "cu_seqlens_k", a.total_k, max_seqlen_k}}) {
      const auto* c = static_cast<const std::int32_t*>(cu->data);
      if (c[0] != 0) return shape_mismatch(std::string(op) + ": " + name + "[0] must be 0");
      for (std::int64_t b = 0; b < a.batch; ++b) {
        const std::int64_t len = std::int64_t(c[b + 1]) - c[b];
        if (len < 0 || c[b + 1] > total || len > longest)
          return shape_mismatch(std::string(op) + ": " + name + " gives sequence " + std::to_string(b) + " tokens " +
                                std::to_string(c[b]) + ".." + std::to_string(c[b + 1]) + ", outside " +
                                std::to_string(total) + " tokens or longer than its max_seqlen " +
                                std::to_string(longest));
      }
    }
  }
  return check_options(op, options, a);
}

}  // namespace

Status attention_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, const TensorView& out,
                        const TensorView* lse, std::int64_t max_seqlen_q, std::int64_t max_seqlen_k,
                        const AttentionOptions& options, Stream stream, Runtime* runtime) {
  const char* op = "attention_varlen";
  AttentionProblem a;
  KILN_TRY(varlen_problem(op, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, max_seqlen_q, max_seqlen_k, options, a));
  return run(op, a, q, k, v, &cu_seqlens_q, &cu_seqlens_k, out, lse, options.decode_splits, stream, runtime);
}

namespace {

// The gradients' and dout's checks: dout as out, dq as q, dk as k, dv as v (dtype, device,
// contiguity, shape).
Status check_gradients(const char* op, const TensorView& dout, const TensorView& q, const TensorView& k,
                       const TensorView& v, const TensorView& out, const TensorView& dq, const TensorView& dk,
                       const TensorView& dv) {
  KILN_TRY(check_tensors(op, {{&dout, "dout"}, {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}}, q));
  for (const auto& [g, like, name, of] : {std::tuple{&dout, &out, "dout", "out"}, std::tuple{&dq, &q, "dq", "q"},
                                         std::tuple{&dk, &k, "dk", "k"}, std::tuple{&dv, &v, "dv", "v"}}) {
    bool same = g->rank == like->rank;
    for (int i = 0; same && i < g->rank; ++i) same = g->shape[i] == like->shape[i];
    if (!same)
      return shape_mismatch(std::string(op) + ": " + name + " must have the shape of " + of + ", " + dims(*like) +
                            ", got " + dims(*g));
  }
  return {};
}

// The GPU backward's limits, named before anything is compiled.
Status check_gpu_backward(const char* op, const TensorView& q, const AttentionProblem& a) {
  if (q.dtype != DType::f16 && q.dtype != DType::bf16)
    return unsupported_dtype(std::string(op) + ": the GPU kernels take f16 and bf16, not " + dtype_name(q.dtype) +
                             " (f32 runs on host tensors only)");
  if (!families::attention_bwd_head_dims_supported(a.head_dim, a.head_dim_v))
    return invalid_argument(std::string(op) + ": the GPU backward takes head_dim/head_dim_v 64/64, 80/80, 96/96 "
                            "and 128/128, not " + std::to_string(a.head_dim) + "/" + std::to_string(a.head_dim_v) +
                            " (host tensors take any)");
  if (a.batch > 65535 || a.heads > 65535)
    return invalid_argument(std::string(op) + ": the GPU kernels take at most 65535 sequences and 65535 heads");
  const std::int64_t lim = 0x7fffffff;
  if (a.seqlen_q > lim || a.seqlen_k > lim || a.total_q * a.heads > lim || a.total_k * a.heads > lim)
    return invalid_argument(std::string(op) + ": token and row counts must stay below 2^31 on the GPU");
  return {};
}

Status run_backward(const char* op, const AttentionProblem& f, bool deterministic, const TensorView& dout,
                    const TensorView& q, const TensorView& k, const TensorView& v, const TensorView* cu_q,
                    const TensorView* cu_k, const TensorView& out, const TensorView& lse, const TensorView& dq,
                    const TensorView& dk, const TensorView& dv, Stream stream, Runtime* runtime) {
  families::AttentionBwdProblem a;
  a.batch = f.batch;
  a.seqlen_q = f.seqlen_q;
  a.seqlen_k = f.seqlen_k;
  a.total_q = f.total_q;
  a.total_k = f.total_k;
  a.heads = f.heads;
  a.kv_heads = f.kv_heads;
  a.head_dim = f.head_dim;
  a.head_dim_v = f.head_dim_v;
  a.varlen = f.varlen;
  a.deterministic = deterministic ? 1 : 0;
  a.window_left = f.window_left;
  a.window_right = f.window_right;
  a.scale = f.scale;
  a.softcap = f.softcap;
  void* buffers[12] = {q.data,  k.data,   v.data,  out.data, dout.data, lse.data, cu_q ? cu_q->data : nullptr,
                       cu_k ? cu_k->data : nullptr, nullptr, dq.data, dk.data, dv.data};
  if (q.device.kind == DeviceKind::cpu) return families::attention_backward_reference(a, q.dtype, buffers);
  KILN_TRY(check_gpu_backward(op, q, f));
  static const Family* family = Registry::global().find("attention_bwd");
  if (!family) return internal_error("the attention_bwd family is not registered");
  const std::uint32_t alignment = client::common_alignment(
      {address(q), address(k), address(v), address(out), address(dout), address(dq), address(dk), address(dv)}, {});
  Problem stages[3];
  for (std::int64_t stage = 0; stage < 3; ++stage) {
    a.stage = stage;
    stages[stage] = Problem::of(q.dtype, alignment, a);
    KILN_TRY(family->check_problem(family->heuristic(stages[stage]), stages[stage]));
  }
  // Without queries no key gets a gradient; without keys no query does. The kernels need tokens of
  // both to map, and the choice of kernel does not depend on token counts.
  if (a.total_q == 0 || a.total_k == 0) {
    KILN_TRY(client::fill(dq, DeviceKind::cuda, stream));
    KILN_TRY(client::fill(dk, DeviceKind::cuda, stream));
    return client::fill(dv, DeviceKind::cuda, stream);
  }
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  KILN_ASSIGN_OR_RETURN(
      client::StreamWorkspace ws,
      client::StreamWorkspace::get(q.device.index, stream, families::attention_bwd_workspace_elements(a)));
  buffers[8] = ws.data();
  for (const Problem& p : stages) KILN_TRY(runtime->run(*family, p, buffers, stream));
  return {};
}

}  // namespace

Status attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv, const AttentionOptions& options, bool deterministic, Stream stream,
                          Runtime* runtime) {
  const char* op = "attention_backward";
  AttentionProblem a;
  KILN_TRY(padded_problem(op, q, k, v, out, &lse, options, a));
  KILN_TRY(check_gradients(op, dout, q, k, v, out, dq, dk, dv));
  return run_backward(op, a, deterministic, dout, q, k, v, nullptr, nullptr, out, lse, dq, dk, dv, stream, runtime);
}

Status attention_varlen_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                 const TensorView& out, const TensorView& lse, const TensorView& dq,
                                 const TensorView& dk, const TensorView& dv, std::int64_t max_seqlen_q,
                                 std::int64_t max_seqlen_k, const AttentionOptions& options, bool deterministic,
                                 Stream stream, Runtime* runtime) {
  const char* op = "attention_varlen_backward";
  AttentionProblem a;
  KILN_TRY(varlen_problem(op, q, k, v, cu_seqlens_q, cu_seqlens_k, out, &lse, max_seqlen_q, max_seqlen_k, options, a));
  KILN_TRY(check_gradients(op, dout, q, k, v, out, dq, dk, dv));
  return run_backward(op, a, deterministic, dout, q, k, v, &cu_seqlens_q, &cu_seqlens_k, out, lse, dq, dk, dv, stream,
                      runtime);
}

}  // namespace kiln

void kiln_register_ops_attention(kiln::Registry& r) {
  using namespace kiln;
  const auto options = [](const OpCall& c, std::size_t first) {
    return AttentionOptions{.scale = c.f64(first),
                            .causal = c.i64(first + 1) != 0,
                            .window_left = c.i64(first + 2),
                            .window_right = c.i64(first + 3),
                            .softcap = c.f64(first + 4)};
  };
  const std::vector<OpScalar> common = {
      {.name = "scale", .kind = ScalarKind::f64, .has_default = true, .default_value = 0,
       .doc = "multiplies q k^T; 0: 1/sqrt(head_dim)"},
      {.name = "causal", .kind = ScalarKind::boolean, .has_default = true, .default_value = 0,
       .doc = "causal mask aligned to the end of the keys (window_right 0)"},
      {.name = "window_left", .kind = ScalarKind::i64, .has_default = true, .default_value = -1,
       .doc = "keys left of the diagonal each query sees; -1 unbounded"},
      {.name = "window_right", .kind = ScalarKind::i64, .has_default = true, .default_value = -1,
       .doc = "keys right of the diagonal each query sees; -1 unbounded"},
      {.name = "softcap", .kind = ScalarKind::f64, .has_default = true, .default_value = 0,
       .doc = "> 0: scores become softcap * tanh(score / softcap)"}};
  const OpScalar deterministic = {.name = "deterministic", .kind = ScalarKind::boolean, .has_default = true,
                                  .default_value = 0,
                                  .doc = "the backward's mode: 1 sums dq in a fixed order (bitwise reproducible), 0 "
                                         "by atomic adds; the forward is deterministic either way"};
  const char* doc_tail =
      " Query head h reads key/value head h / (heads / kv_heads); causal and windows are aligned to the end of the "
      "keys (FlashAttention 2); lse (f32, natural log) is written when given; rows that see no key get zeros and lse "
      "-inf.";
  {
    OpDecl op;
    op.name = "attention";
    op.doc = std::string("out = softmax(mask(softcap(scale * q k^T))) v over padded sequences.") + doc_tail;
    op.tensors = {
        {.name = "q", .dtypes = k_float_dtypes, .min_rank = 4, .max_rank = 4, .shape = "[batch, seqlen_q, heads, head_dim]"},
        {.name = "k", .min_rank = 4, .max_rank = 4, .shape = "[batch, seqlen_k, kv_heads, head_dim]"},
        {.name = "v", .min_rank = 4, .max_rank = 4, .shape = "[batch, seqlen_k, kv_heads, head_dim_v]"},
        {.name = "out", .role = TensorRole::output, .min_rank = 4, .max_rank = 4,
         .shape = "[batch, seqlen_q, heads, head_dim_v]"},
        {.name = "lse", .role = TensorRole::output, .optional = true, .dtypes = dtype_bit(DType::f32), .min_rank = 3,
         .max_rank = 3, .shape = "[batch, heads, seqlen_q]"}};
    op.scalars = common;
    op.scalars.push_back(deterministic);
    op.backward = "attention_backward";
    op.run = [options](const OpCall& c) {
      return attention(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.optional(4), options(c, 0), c.stream,
                       c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      const TensorView &q = c.tensor(0), &v = c.tensor(2);
      out[0] = shape_like(q, q.dtype, v.shape[3]);
      out[1].dtype = DType::f32;
      out[1].rank = 3;
      out[1].shape[0] = q.shape[0];
      out[1].shape[1] = q.shape[2];
      out[1].shape[2] = q.shape[1];
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "attention_varlen";
    op.doc = std::string("out = softmax(mask(softcap(scale * q k^T))) v over packed sequences: sequence b is tokens "
                         "cu_seqlens[b] .. cu_seqlens[b + 1] - 1 (int32), at most max_seqlen_q / max_seqlen_k long.") +
             doc_tail;
    op.tensors = {
        {.name = "q", .min_rank = 3, .max_rank = 3, .shape = "[total_q, heads, head_dim]"},
        {.name = "k", .min_rank = 3, .max_rank = 3, .shape = "[total_k, kv_heads, head_dim]"},
        {.name = "v", .min_rank = 3, .max_rank = 3, .shape = "[total_k, kv_heads, head_dim_v]"},
        {.name = "cu_seqlens_q", .dtypes = dtype_bit(DType::i32), .max_rank = 1, .shape = "[batch + 1]"},
        {.name = "cu_seqlens_k", .dtypes = dtype_bit(DType::i32), .max_rank = 1, .shape = "[batch + 1]"},
        {.name = "out", .role = TensorRole::output, .min_rank = 3, .max_rank = 3, .shape = "[total_q, heads, head_dim_v]"},
        {.name = "lse", .role = TensorRole::output, .optional = true, .dtypes = dtype_bit(DType::f32), .min_rank = 2,
         .max_rank = 2, .shape = "[heads, total_q]"}};
    op.scalars = {{.name = "max_seqlen_q", .kind = ScalarKind::i64, .doc = "the longest query sequence"},
                  {.name = "max_seqlen_k", .kind = ScalarKind::i64, .doc = "the longest key sequence"}};
    op.scalars.insert(op.scalars.end(), common.begin(), common.end());
    op.scalars.push_back(deterministic);
    op.backward = "attention_varlen_backward";
    op.run = [options](const OpCall& c) {
      return attention_varlen(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5),
                              c.optional(6), c.i64(0), c.i64(1), options(c, 2), c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      const TensorView &q = c.tensor(0), &v = c.tensor(2);
      out[0] = shape_like(q, q.dtype, v.shape[2]);
      out[1].dtype = DType::f32;
      out[1].rank = 2;
      out[1].shape[0] = q.shape[1];
      out[1].shape[1] = q.shape[0];
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  const char* bwd_doc =
      " D = rowsum(dout * out); P is recomputed from q, k and the forward's lse (no seqlen_q x seqlen_k buffer); dk "
      "and dv are summed over each KV head's query heads; rows that saw no key (lse -inf) contribute nothing.";
  {
    OpDecl op;
    op.name = "attention_backward";
    op.doc = std::string("(dq, dk, dv) of attention from dout, q, k, v, out and lse.") + bwd_doc;
    op.tensors = {
        {.name = "dout", .min_rank = 4, .max_rank = 4, .shape = "[batch, seqlen_q, heads, head_dim_v]",
         .grad_of = "out"},
        {.name = "q", .min_rank = 4, .max_rank = 4, .shape = "[batch, seqlen_q, heads, head_dim]"},
        {.name = "k", .min_rank = 4, .max_rank = 4, .shape = "[batch, seqlen_k, kv_heads, head_dim]"},
        {.name = "v", .min_rank = 4, .max_rank = 4, .shape = "[batch, seqlen_k, kv_heads, head_dim_v]"},
        {.name = "out", .min_rank = 4, .max_rank = 4, .shape = "[batch, seqlen_q, heads, head_dim_v]"},
        {.name = "lse", .dtypes = dtype_bit(DType::f32), .min_rank = 3, .max_rank = 3, .shape = "[batch, heads, seqlen_q]"},
        {.name = "dq", .role = TensorRole::output, .min_rank = 4, .max_rank = 4,
         .shape = "[batch, seqlen_q, heads, head_dim]", .grad_of = "q"},
        {.name = "dk", .role = TensorRole::output, .min_rank = 4, .max_rank = 4,
         .shape = "[batch, seqlen_k, kv_heads, head_dim]", .grad_of = "k"},
        {.name = "dv", .role = TensorRole::output, .min_rank = 4, .max_rank = 4,
         .shape = "[batch, seqlen_k, kv_heads, head_dim_v]", .grad_of = "v"}};
    op.scalars = common;
    op.scalars.push_back(deterministic);
    op.run = [options](const OpCall& c) {
      return attention_backward(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5),
                                c.tensor(6), c.tensor(7), c.tensor(8), options(c, 0), c.i64(5) != 0, c.stream,
                                c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      out[0] = shape_like(c.tensor(1), c.tensor(1).dtype);
      out[1] = shape_like(c.tensor(2), c.tensor(1).dtype);
      out[2] = shape_like(c.tensor(3), c.tensor(1).dtype);
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "attention_varlen_backward";
    op.doc = std::string("(dq, dk, dv) of attention_varlen from dout, q, k, v, the offsets, out and lse.") + bwd_doc;
    op.tensors = {
        {.name = "dout", .min_rank = 3, .max_rank = 3, .shape = "[total_q, heads, head_dim_v]", .grad_of = "out"},
        {.name = "q", .min_rank = 3, .max_rank = 3, .shape = "[total_q, heads, head_dim]"},
        {.name = "k", .min_rank = 3, .max_rank = 3, .shape = "[total_k, kv_heads, head_dim]"},
        {.name = "v", .min_rank = 3, .max_rank = 3, .shape = "[total_k, kv_heads, head_dim_v]"},
        {.name = "cu_seqlens_q", .dtypes = dtype_bit(DType::i32), .max_rank = 1, .shape = "[batch + 1]"},
        {.name = "cu_seqlens_k", .dtypes = dtype_bit(DType::i32), .max_rank = 1, .shape = "[batch + 1]"},
        {.name = "out", .min_rank = 3, .max_rank = 3, .shape = "[total_q, heads, head_dim_v]"},
        {.name = "lse", .dtypes = dtype_bit(DType::f32), .min_rank = 2, .max_rank = 2, .shape = "[heads, total_q]"},
        {.name = "dq", .role = TensorRole::output, .min_rank = 3, .max_rank = 3, .shape = "[total_q, heads, head_dim]",
         .grad_of = "q"},
        {.name = "dk", .role = TensorRole::output, .min_rank = 3, .max_rank = 3,
         .shape = "[total_k, kv_heads, head_dim]", .grad_of = "k"},
        {.name = "dv", .role = TensorRole::output, .min_rank = 3, .max_rank = 3,
         .shape = "[total_k, kv_heads, head_dim_v]", .grad_of = "v"}};
    op.scalars = {{.name = "max_seqlen_q", .kind = ScalarKind::i64, .doc = "the longest query sequence"},
                  {.name = "max_seqlen_k", .kind = ScalarKind::i64, .doc = "the longest key sequence"}};
    op.scalars.insert(op.scalars.end(), common.begin(), common.end());
    op.scalars.push_back(deterministic);
    op.run = [options](const OpCall& c) {
      return attention_varlen_backward(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5),
                                       c.tensor(6), c.tensor(7), c.tensor(8), c.tensor(9), c.tensor(10), c.i64(0),
                                       c.i64(1), options(c, 2), c.i64(7) != 0, c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      out[0] = shape_like(c.tensor(1), c.tensor(1).dtype);
      out[1] = shape_like(c.tensor(2), c.tensor(1).dtype);
      out[2] = shape_like(c.tensor(3), c.tensor(1).dtype);
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
}
