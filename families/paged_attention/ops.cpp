// The paged cache's ops: validation, the host references, the launches, and their declarations
// (kiln/op.h), from which the C ABI, Python and torch bindings come.
#include "families/paged_attention/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "client/validate.h"
#include "client/workspace.h"
#include "common/half.h"
#include "families/attention/attention_splitkv.h"
#include "families/paged_attention/paged_attention.h"
#include "jit/device_info.h"
#include "jit/driver.h"
#include "kiln/family.h"
#include "kiln/kv_cache.h"
#include "kiln/op.h"
#include "kiln/runtime.h"

namespace kiln {
namespace {

using client::address;
using client::dims;

using families::PagedDecodeProblem;

bool is_index(DType t) { return t == DType::i32 || t == DType::i64; }

std::int64_t index_at(const TensorView& t, std::int64_t i) {
  return t.dtype == DType::i64 ? static_cast<const std::int64_t*>(t.data)[i]
                               : std::int64_t(static_cast<const std::int32_t*>(t.data)[i]);
}

// view, contiguity (unless rows_ok: inner dims contiguous, any leading stride), device.
Status check_tensor(const char* op, const TensorView& t, const char* name, const TensorView& like, bool rows_ok = false) {
  KILN_TRY(client::check_view(t, name));
  if (rows_ok) {
    std::int64_t stride = 1;
    for (int i = t.rank - 1; i >= 1; --i) {
      if (t.shape[i] != 1 && t.strides[i] != stride)
        return shape_mismatch(std::string(op) + ": " + name + " must be contiguous within a token");
      stride *= t.shape[i];
    }
  } else if (!t.is_contiguous()) {
    return shape_mismatch(std::string(op) + ": " + name + " must be contiguous");
  }
  KILN_TRY(client::check_device(t, name, like.device.kind));
  if (like.device.kind == DeviceKind::cuda && t.device.index != like.device.index)
    return device_error(std::string(op) + ": " + name + " is on another GPU than the other tensors");
  return {};
}

Status check_cache_pair(const char* op, const TensorView& kc, const TensorView& vc) {
  if (kc.rank != 4) return shape_mismatch(std::string(op) + ": key_cache must be [num_blocks, page_size, kv_heads, head_dim], got " + dims(kc));
  for (int i = 0; i < 4; ++i)
    if (vc.rank != 4 || vc.shape[i] != kc.shape[i])
      return shape_mismatch(std::string(op) + ": value_cache must have key_cache's shape " + dims(kc) + ", got " + dims(vc));
  if (vc.dtype != kc.dtype) return unsupported_dtype(std::string(op) + ": key_cache and value_cache differ in dtype");
  if (!families::paged_page_size_supported(kc.shape[1]))
    return invalid_argument(std::string(op) + ": page_size (the caches' second dimension) must be 1, 8, 16, 32, 64 or "
                            "128, got " + std::to_string(kc.shape[1]));
  if (kc.shape[0] * kc.shape[1] > 0x7fffffff)
    return invalid_argument(std::string(op) + ": the caches must hold fewer than 2^31 slots");
  return {};
}

const Family* family(const char* name) { return Registry::global().find(name); }

Status launch(const Family* f, const char* name, const Problem& p, std::span<void* const> buffers, Stream stream,
              Runtime* runtime) {
  if (!f) return internal_error(std::string("the ") + name + " family is not registered");
  KILN_TRY(f->check_problem(f->heuristic(p), p));
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  return runtime->run(*f, p, buffers, stream);
}

}  // namespace

// ---- reshape_and_cache ----

Status reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& slot_mapping,
                         const TensorView& key_cache, const TensorView& value_cache, const TensorView* k_scale,
                         const TensorView* v_scale, Stream stream, Runtime* runtime) {
  const char* op = "reshape_and_cache";
  KILN_TRY(check_tensor(op, key, "key", key, true));
  KILN_TRY(check_tensor(op, value, "value", key, true));
  KILN_TRY(check_tensor(op, slot_mapping, "slot_mapping", key));
  KILN_TRY(check_tensor(op, key_cache, "key_cache", key));
  KILN_TRY(check_tensor(op, value_cache, "value_cache", key));
  KILN_TRY(client::check_float_dtype(key, "key"));
  if (value.dtype != key.dtype) return unsupported_dtype("reshape_and_cache: value must have key's dtype");
  if (!is_index(slot_mapping.dtype)) return unsupported_dtype("reshape_and_cache: slot_mapping must be int32 or int64");
  KILN_TRY(check_cache_pair(op, key_cache, value_cache));
  const bool fp8 = key_cache.dtype == DType::u8;
  if (!fp8 && key_cache.dtype != key.dtype)
    return unsupported_dtype(std::string("reshape_and_cache: the caches must be of key's dtype (") + dtype_name(key.dtype) +
                             ") or u8 (fp8 e4m3), got " + dtype_name(key_cache.dtype));
  if (fp8 && key.dtype == DType::f32)
    return unsupported_dtype("reshape_and_cache: fp8 caches take f16 or bf16 keys and values");
  if (key.rank != 3) return shape_mismatch("reshape_and_cache: key must be [tokens, kv_heads, head_dim], got " + dims(key));
  const std::int64_t tokens = key.shape[0], hk = key_cache.shape[2], d = key_cache.shape[3];
  if (key.shape[1] != hk || key.shape[2] != d || value.rank != 3 || value.shape[0] != tokens || value.shape[1] != hk ||
      value.shape[2] != d)
    return shape_mismatch("reshape_and_cache: key and value must be [tokens, " + std::to_string(hk) + ", " +
                          std::to_string(d) + "] as the caches' heads, got " + dims(key) + " and " + dims(value));
  if (slot_mapping.rank != 1 || slot_mapping.shape[0] != tokens)
    return shape_mismatch("reshape_and_cache: slot_mapping must be [tokens] = [" + std::to_string(tokens) + "], got " +
                          dims(slot_mapping));
  for (const auto& [s, name] : {std::pair{k_scale, "k_scale"}, std::pair{v_scale, "v_scale"}}) {
    if (!s) {
      if (fp8) return invalid_argument(std::string("reshape_and_cache: an fp8 cache needs ") + name);
      continue;
    }
    KILN_TRY(check_tensor(op, *s, name, key));
    if (s->dtype != DType::f32 || s->numel() != 1)
      return shape_mismatch(std::string("reshape_and_cache: ") + name + " must be one f32 value");
  }
  families::ReshapeAndCacheProblem a{.tokens = tokens,
                                     .row_elems = hk * d,
                                     .slots = key_cache.shape[0] * key_cache.shape[1],
                                     .key_stride = tokens > 1 ? key.strides[0] : hk * d,
                                     .value_stride = tokens > 1 ? value.strides[0] : hk * d,
                                     .slot_i64 = slot_mapping.dtype == DType::i64 ? 1 : 0,
                                     .fp8 = fp8 ? 1 : 0};
  void* buffers[7] = {key.data, value.data, slot_mapping.data, key_cache.data, value_cache.data,
                      k_scale ? k_scale->data : nullptr, v_scale ? v_scale->data : nullptr};
  const Problem p = Problem::of(
      key.dtype, client::common_alignment({address(key), address(value), address(key_cache), address(value_cache)}, {}), a);
  static const Family* f = family("reshape_and_cache");
  if (!f) return internal_error("the reshape_and_cache family is not registered");
  if (key.device.kind == DeviceKind::cpu) {
    for (std::int64_t t = 0; t < tokens; ++t)
      if (index_at(slot_mapping, t) >= a.slots)
        return invalid_argument("reshape_and_cache: slot_mapping[" + std::to_string(t) + "] = " +
                                std::to_string(index_at(slot_mapping, t)) + " is past the cache's " +
                                std::to_string(a.slots) + " slots");
    // The reference reads the problem's dtype (f32 too); the params only name the cache element.
    return f->cpu_reference(Params{{"cache", std::string(fp8 ? "fp8_e4m3" : "same")}, {"dtype", std::string("f16")}},
                            p, buffers);
  }
  if (key.dtype == DType::f32) return unsupported_dtype("reshape_and_cache: the GPU kernels take f16 and bf16");
  if (tokens == 0) return {};
  return launch(f, "reshape_and_cache", p, buffers, stream, runtime);
}

// ---- copy_blocks and swap_blocks ----

namespace {

// The pairs' host-side checks: every id inside its pool, no destination twice, and (one pool) no
// block both a source and a destination, since the copies run in parallel.
Status check_pairs(const char* op, const TensorView& pairs, std::int64_t src_blocks, std::int64_t dst_blocks,
                   bool one_pool) {
  const std::int64_t n = pairs.shape[0];
  std::vector<char> dst(std::size_t(dst_blocks), 0), src(one_pool ? std::size_t(src_blocks) : 0, 0);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t s = index_at(pairs, 2 * i), d = index_at(pairs, 2 * i + 1);
    if (s < 0 || s >= src_blocks || d < 0 || d >= dst_blocks)
      return invalid_argument(std::string(op) + ": pair " + std::to_string(i) + " (" + std::to_string(s) + ", " +
                              std::to_string(d) + ") names a block outside its pool (" + std::to_string(src_blocks) +
                              " source, " + std::to_string(dst_blocks) + " destination blocks)");
    if (dst[std::size_t(d)]++)
      return invalid_argument(std::string(op) + ": block " + std::to_string(d) + " is a destination twice");
    if (one_pool) src[std::size_t(s)] = 1;
  }
  if (one_pool)
    for (std::int64_t i = 0; i < n; ++i)
      if (src[std::size_t(index_at(pairs, 2 * i + 1))])
        return invalid_argument(std::string(op) + ": block " + std::to_string(index_at(pairs, 2 * i + 1)) +
                                " is both a source and a destination (the copies run in parallel)");
  return {};
}

// The address a kernel reaches `t` at: its own for GPU memory; for host memory, the device mapping
// of its page-locked pages (invalid_argument for pageable memory, which the GPU cannot reach).
Result<void*> kernel_address(const char* op, const TensorView& t, const char* name) {
  if (t.device.kind == DeviceKind::cuda) return t.data;
  KILN_ASSIGN_OR_RETURN(const jit::Driver* d, jit::Driver::get());
  KILN_TRY(jit::current_context(0).status());
  CUdeviceptr mapped = 0;
  CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_DEVICE_POINTER;
  void* values[1] = {&mapped};
  // For memory the driver does not know, cuPointerGetAttributes succeeds and leaves it null.
  if (d->pointer_get_attributes(1, &attr, values, reinterpret_cast<CUdeviceptr>(t.data)) != CUDA_SUCCESS || !mapped)
    return invalid_argument(std::string(op) + ": " + name + " is host memory the GPU cannot reach; allocate it " +
                            "page-locked (torch's pin_memory(), cuMemHostAlloc)");
  return reinterpret_cast<void*>(mapped);
}

// copy_blocks and swap_blocks: one kernel, from a source pool to a destination pool (the same
// memory for copy-on-write).
Status copy_pool_blocks(const char* op, const TensorView& src_key, const TensorView& src_value,
                        const TensorView& dst_key, const TensorView& dst_value, const TensorView& pairs, Stream stream,
                        Runtime* runtime) {
  const TensorView* all[5] = {&src_key, &src_value, &dst_key, &dst_value, &pairs};
  const char* names[5] = {"src_key", "src_value", "dst_key", "dst_value", "pairs"};
  for (int i = 0; i < 5; ++i) {
    KILN_TRY(client::check_view(*all[i], names[i]));
    if (!all[i]->is_contiguous()) return shape_mismatch(std::string(op) + ": " + names[i] + " must be contiguous");
  }
  KILN_TRY(check_cache_pair(op, src_key, src_value));
  KILN_TRY(check_cache_pair(op, dst_key, dst_value));
  for (int i = 1; i < 4; ++i)
    if (src_key.shape[i] != dst_key.shape[i] || src_key.dtype != dst_key.dtype)
      return shape_mismatch(std::string(op) + ": the pools' blocks differ: source " + dims(src_key) + " " +
                            dtype_name(src_key.dtype) + ", destination " + dims(dst_key) + " " +
                            dtype_name(dst_key.dtype) + " (the first dimension may differ)");
  if (src_key.device.kind != src_value.device.kind || dst_key.device.kind != dst_value.device.kind)
    return device_error(std::string(op) + ": a pool's K and V must live on the same side (both GPU or both host)");
  if (!is_index(pairs.dtype)) return unsupported_dtype(std::string(op) + ": pairs must be int32 or int64");
  if (pairs.rank != 2 || pairs.shape[1] != 2)
    return shape_mismatch(std::string(op) + ": pairs must be [n, 2] (src, dst), got " + dims(pairs));
  // GPU tensors: real device memory, all on one GPU.
  int gpu = -1;
  for (int i = 0; i < 5; ++i) {
    if (all[i]->device.kind != DeviceKind::cuda) continue;
    KILN_TRY(client::check_device(*all[i], names[i], DeviceKind::cuda));
    if (gpu >= 0 && all[i]->device.index != gpu)
      return device_error(std::string(op) + ": " + names[i] + " is on another GPU than the other GPU tensors");
    gpu = all[i]->device.index;
  }
  const bool one_pool = src_key.data == dst_key.data;
  if (one_pool && (src_value.data != dst_value.data || src_key.shape[0] != dst_key.shape[0]))
    return invalid_argument(std::string(op) + ": src_key is dst_key but the values' pools differ");
  const std::int64_t block_bytes =
      src_key.shape[1] * src_key.shape[2] * src_key.shape[3] * std::int64_t(dtype_size(src_key.dtype));
  families::CopyBlocksProblem a{.pairs = pairs.shape[0],
                                .block_bytes = block_bytes,
                                .num_blocks = dst_key.shape[0],
                                .pairs_i64 = pairs.dtype == DType::i64 ? 1 : 0,
                                .src_blocks = src_key.shape[0]};
  if (pairs.device.kind == DeviceKind::cpu) KILN_TRY(check_pairs(op, pairs, a.src_blocks, a.num_blocks, one_pool));
  static const Family* f = family("copy_blocks");
  if (!f) return internal_error("the copy_blocks family is not registered");
  const Problem p = Problem::of(
      DType::f16,
      client::common_alignment({address(src_key), address(src_value), address(dst_key), address(dst_value)}, {}), a);
  if (gpu < 0) {
    void* buffers[5] = {src_key.data, src_value.data, dst_key.data, dst_value.data, pairs.data};
    KILN_TRY(f->check_problem(f->heuristic(p), p));
    return f->cpu_reference(f->heuristic(p), p, buffers);
  }
  void* buffers[5];
  for (int i = 0; i < 5; ++i) {
    KILN_ASSIGN_OR_RETURN(buffers[i], kernel_address(op, *all[i], names[i]));
  }
  if (a.pairs == 0) return f->check_problem(f->heuristic(p), p);
  return launch(f, op, p, buffers, stream, runtime);
}

}  // namespace

Status copy_blocks(const TensorView& key_cache, const TensorView& value_cache, const TensorView& pairs, Stream stream,
                   Runtime* runtime) {
  return copy_pool_blocks("copy_blocks", key_cache, value_cache, key_cache, value_cache, pairs, stream, runtime);
}

Status swap_blocks(const TensorView& src_key, const TensorView& src_value, const TensorView& dst_key,
                   const TensorView& dst_value, const TensorView& pairs, Stream stream, Runtime* runtime) {
  return copy_pool_blocks("swap_blocks", src_key, src_value, dst_key, dst_value, pairs, stream, runtime);
}

// ---- merge_state ----

namespace {

Status merge(const char* op, const TensorView& v_a, const TensorView& s_a, const TensorView& v_b,
             const TensorView& s_b, const TensorView& v_out, const TensorView& s_out, Stream stream, Runtime* runtime) {
  for (const auto& [t, name] : {std::pair{&v_a, "v_a"}, std::pair{&s_a, "s_a"}, std::pair{&v_b, "v_b"},
                                std::pair{&s_b, "s_b"}, std::pair{&v_out, "v_out"}, std::pair{&s_out, "s_out"}})
    KILN_TRY(check_tensor(op, *t, name, v_a));
  KILN_TRY(client::check_float_dtype(v_a, "v_a"));
  if (v_b.dtype != v_a.dtype || v_out.dtype != v_a.dtype)
    return unsupported_dtype(std::string(op) + ": the v tensors must share one dtype");
  if (s_a.dtype != DType::f32 || s_b.dtype != DType::f32 || s_out.dtype != DType::f32)
    return unsupported_dtype(std::string(op) + ": the s tensors (lse) must be f32");
  if (v_a.rank != 3) return shape_mismatch(std::string(op) + ": v must be [tokens, heads, head_dim], got " + dims(v_a));
  for (const TensorView* v : {&v_b, &v_out})
    if (v->rank != 3 || v->shape[0] != v_a.shape[0] || v->shape[1] != v_a.shape[1] || v->shape[2] != v_a.shape[2])
      return shape_mismatch(std::string(op) + ": every v must be " + dims(v_a) + ", got " + dims(*v));
  for (const TensorView* s : {&s_a, &s_b, &s_out})
    if (s->rank != 2 || s->shape[0] != v_a.shape[0] || s->shape[1] != v_a.shape[1])
      return shape_mismatch(std::string(op) + ": every s must be [tokens, heads] = [" + std::to_string(v_a.shape[0]) +
                            ", " + std::to_string(v_a.shape[1]) + "], got " + dims(*s));
  families::MergeStateProblem a{.rows = v_a.shape[0] * v_a.shape[1], .head_dim = v_a.shape[2]};
  const Problem p =
      Problem::of(v_a.dtype, client::common_alignment({address(v_a), address(v_b), address(v_out)}, {}), a);
  void* buffers[6] = {v_a.data, s_a.data, v_b.data, s_b.data, v_out.data, s_out.data};
  static const Family* f = family("merge_state");
  if (!f) return internal_error("the merge_state family is not registered");
  if (v_a.device.kind == DeviceKind::cpu) return f->cpu_reference(Params{{"dtype", std::string("f16")}}, p, buffers);
  if (v_a.dtype == DType::f32) return unsupported_dtype(std::string(op) + ": the GPU kernels take f16 and bf16");
  if (a.rows == 0) return {};
  return launch(f, "merge_state", p, buffers, stream, runtime);
}

}  // namespace

Status merge_state(const TensorView& v_a, const TensorView& s_a, const TensorView& v_b, const TensorView& s_b,
                   const TensorView& v_out, const TensorView& s_out, Stream stream, Runtime* runtime) {
  return merge("merge_state", v_a, s_a, v_b, s_b, v_out, s_out, stream, runtime);
}

Status merge_state_in_place(const TensorView& v, const TensorView& s, const TensorView& v_other,
                            const TensorView& s_other, Stream stream, Runtime* runtime) {
  return merge("merge_state_in_place", v, s, v_other, s_other, v, s, stream, runtime);
}

// ---- paged_decode ----

namespace {

// The cache slots of request b's keys, in order, from its padded table.
std::vector<std::int64_t> slots_of(const std::int32_t* table, std::int64_t len, std::int64_t page) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(len));
  for (std::int64_t j = 0; j < len; ++j) out[std::size_t(j)] = std::int64_t(table[j / page]) * page + j % page;
  return out;
}

// fp64 attention of one request's queries (q rows q0 .. q0 + lq - 1) over the keys at `slots`
// (every query head of a KV head's group reads them once): out rows and lse [token, head].
void attend_slots(const PagedDecodeProblem& a, DType dtype, const TensorView& q, const TensorView& kc,
                  const TensorView& vc, const std::vector<std::int64_t>& slots, std::int64_t q0, std::int64_t lq,
                  const TensorView& out, const TensorView* lse) {
  const std::int64_t d = a.head_dim, group = a.heads / a.kv_heads, row = a.kv_heads * d;
  const std::int64_t lk = std::int64_t(slots.size());
  const double ninf = -std::numeric_limits<double>::infinity();
  std::vector<double> kd(static_cast<std::size_t>(lk * d)), vd(kd.size()), qd(static_cast<std::size_t>(d)), sc,
      acc(static_cast<std::size_t>(d));
  for (std::int64_t hk = 0; hk < a.kv_heads; ++hk) {
    for (std::int64_t j = 0; j < lk; ++j)
      for (std::int64_t c = 0; c < d; ++c) {
        kd[std::size_t(j * d + c)] = load_as_double(kc.data, dtype, slots[std::size_t(j)] * row + hk * d + c);
        vd[std::size_t(j * d + c)] = load_as_double(vc.data, dtype, slots[std::size_t(j)] * row + hk * d + c);
      }
    for (std::int64_t i = 0; i < lq; ++i)
      for (std::int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const std::int64_t qrow = ((q0 + i) * a.heads + h) * d;
        for (std::int64_t c = 0; c < d; ++c) qd[std::size_t(c)] = load_as_double(q.data, dtype, qrow + c);
        std::int64_t lo = 0, hi = lk;
        if (a.window_left >= 0) lo = std::max(lo, i + lk - lq - a.window_left);
        if (a.window_right >= 0) hi = std::min(hi, i + lk - lq + a.window_right + 1);
        sc.assign(std::size_t(std::max<std::int64_t>(hi - lo, 0)), 0.0);
        double mx = ninf;
        for (std::int64_t j = lo; j < hi; ++j) {
          double dot = 0;
          for (std::int64_t c = 0; c < d; ++c) dot += qd[std::size_t(c)] * kd[std::size_t(j * d + c)];
          double sv = dot * a.scale;
          if (a.softcap > 0) sv = a.softcap * std::tanh(sv / a.softcap);
          sc[std::size_t(j - lo)] = sv;
          mx = std::max(mx, sv);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double sum = 0;
        for (std::int64_t j = lo; j < hi; ++j) {
          const double w = std::exp(sc[std::size_t(j - lo)] - mx);
          sum += w;
          for (std::int64_t c = 0; c < d; ++c) acc[std::size_t(c)] += w * vd[std::size_t(j * d + c)];
        }
        for (std::int64_t c = 0; c < d; ++c)
          store_from_double(out.data, dtype, qrow + c, sum > 0 ? acc[std::size_t(c)] / sum : 0.0);
        if (lse)
          static_cast<float*>(lse->data)[(q0 + i) * a.heads + h] =
              sum > 0 ? float(mx + std::log(sum)) : -std::numeric_limits<float>::infinity();
      }
  }
}

}  // namespace

Status paged_decode(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                    const TensorView& block_tables, const TensorView& seq_lens, const TensorView* cu_seqlens_q,
                    const TensorView& out, const TensorView* lse, const TensorView* workspace,
                    const PagedDecodeOptions& o, Stream stream, Runtime* runtime) {
  const char* op = "paged_decode";
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"},
                                std::pair{&block_tables, "block_tables"}, std::pair{&seq_lens, "seq_lens"},
                                std::pair{cu_seqlens_q, "cu_seqlens_q"}, std::pair{&out, "out"}, std::pair{lse, "lse"},
                                std::pair{workspace, "workspace"}})
    if (t) KILN_TRY(check_tensor(op, *t, name, q));
  KILN_TRY(client::check_float_dtype(q, "q"));
  KILN_TRY(check_cache_pair(op, k_cache, v_cache));
  if (k_cache.dtype != q.dtype || out.dtype != q.dtype)
    return unsupported_dtype(std::string("paged_decode: k_cache, v_cache and out must be of q's dtype (") +
                             dtype_name(q.dtype) + ")");
  for (const auto& [t, name] : {std::pair{&block_tables, "block_tables"}, std::pair{&seq_lens, "seq_lens"},
                                std::pair{cu_seqlens_q, "cu_seqlens_q"}})
    if (t && t->dtype != DType::i32) return unsupported_dtype(std::string("paged_decode: ") + name + " must be int32");
  if ((lse && lse->dtype != DType::f32) || (workspace && workspace->dtype != DType::f32))
    return unsupported_dtype("paged_decode: lse and workspace must be f32");
  if (q.rank != 3) return shape_mismatch("paged_decode: q must be [total_q, heads, head_dim], got " + dims(q));
  if (block_tables.rank != 2) return shape_mismatch("paged_decode: block_tables must be [batch, max_blocks], got " + dims(block_tables));
  PagedDecodeProblem a;
  a.batch = block_tables.shape[0];
  a.max_blocks = block_tables.shape[1];
  a.total_q = q.shape[0];
  a.heads = q.shape[1];
  a.head_dim = q.shape[2];
  a.num_blocks = k_cache.shape[0];
  a.page_size = k_cache.shape[1];
  a.kv_heads = k_cache.shape[2];
  if (k_cache.shape[3] != a.head_dim)
    return shape_mismatch("paged_decode: the caches' head_dim " + std::to_string(k_cache.shape[3]) + " differs from q's " +
                          std::to_string(a.head_dim));
  if (a.heads % a.kv_heads)
    return shape_mismatch("paged_decode: q has " + std::to_string(a.heads) + " heads, not a multiple of the caches' " +
                          std::to_string(a.kv_heads));
  if (seq_lens.rank != 1 || seq_lens.shape[0] != a.batch)
    return shape_mismatch("paged_decode: seq_lens must be [batch] = [" + std::to_string(a.batch) + "], got " + dims(seq_lens));
  if (cu_seqlens_q) {
    if (cu_seqlens_q->rank != 1 || cu_seqlens_q->shape[0] != a.batch + 1)
      return shape_mismatch("paged_decode: cu_seqlens_q must be [batch + 1], got " + dims(*cu_seqlens_q));
    a.varlen = 1;
    a.seqlen_q = o.max_seqlen_q > 0 ? o.max_seqlen_q : a.total_q;
  } else {
    if (a.total_q != a.batch)
      return shape_mismatch("paged_decode: without cu_seqlens_q, q holds one query per request: [" +
                            std::to_string(a.batch) + ", heads, head_dim], got " + dims(q));
    a.seqlen_q = 1;
  }
  if (out.rank != 3 || out.shape[0] != a.total_q || out.shape[1] != a.heads || out.shape[2] != a.head_dim)
    return shape_mismatch("paged_decode: out must be q's shape " + dims(q) + ", got " + dims(out));
  if (lse && (lse->rank != 2 || lse->shape[0] != a.total_q || lse->shape[1] != a.heads))
    return shape_mismatch("paged_decode: lse must be [total_q, heads] = [" + std::to_string(a.total_q) + ", " +
                          std::to_string(a.heads) + "], got " + dims(*lse));
  if (o.window_left < -1) return invalid_argument("paged_decode: window_left must be -1 (unbounded) or non-negative");
  if (!std::isfinite(o.softcap) || o.softcap < 0 || !std::isfinite(o.scale))
    return invalid_argument("paged_decode: scale must be finite, softcap finite and non-negative");
  if (o.max_seqlen_q < 0 || o.max_seq_len < 0 || o.splits < 0 || o.splits > 1024)
    return invalid_argument("paged_decode: max_seqlen_q and max_seq_len must be non-negative, splits 0 to 1024");
  a.max_seq_len = o.max_seq_len > 0 ? o.max_seq_len : a.max_blocks * a.page_size;
  a.window_left = o.window_left;
  a.window_right = o.causal ? 0 : -1;
  a.scale = o.scale != 0 ? o.scale : 1.0 / std::sqrt(double(a.head_dim));
  a.softcap = o.softcap;
  if (a.max_seq_len > a.max_blocks * a.page_size)
    return shape_mismatch("paged_decode: max_seq_len " + std::to_string(a.max_seq_len) + " is past the " +
                          std::to_string(a.max_blocks) + " blocks of " + std::to_string(a.page_size) +
                          " tokens block_tables holds");
  if (q.device.kind == DeviceKind::cpu) {
    const auto* tables = static_cast<const std::int32_t*>(block_tables.data);
    const auto* lens = static_cast<const std::int32_t*>(seq_lens.data);
    const auto* cu = cu_seqlens_q ? static_cast<const std::int32_t*>(cu_seqlens_q->data) : nullptr;
    if (cu && cu[0] != 0) return shape_mismatch("paged_decode: cu_seqlens_q[0] must be 0");
    for (std::int64_t b = 0; b < a.batch; ++b) {
      if (lens[b] > a.max_seq_len)
        return shape_mismatch("paged_decode: seq_lens[" + std::to_string(b) + "] = " + std::to_string(lens[b]) +
                              " is past max_seq_len " + std::to_string(a.max_seq_len));
      KILN_TRY(KVCacheManager::validate_block_table(
          std::span<const std::int32_t>(tables + b * a.max_blocks, std::size_t(a.max_blocks)), lens[b],
          std::int32_t(a.num_blocks), std::int32_t(a.page_size)));
      if (cu && (cu[b + 1] < cu[b] || cu[b + 1] > a.total_q || cu[b + 1] - cu[b] > a.seqlen_q))
        return shape_mismatch("paged_decode: cu_seqlens_q gives request " + std::to_string(b) + " queries " +
                              std::to_string(cu[b]) + ".." + std::to_string(cu[b + 1]) + ", outside q's " +
                              std::to_string(a.total_q) + " rows or longer than max_seqlen_q");
    }
    for (std::int64_t b = 0; b < a.batch; ++b)
      attend_slots(a, q.dtype, q, k_cache, v_cache, slots_of(tables + b * a.max_blocks, lens[b], a.page_size),
                   cu ? cu[b] : b, cu ? cu[b + 1] - cu[b] : 1, out, lse);
    return {};
  }
  if (q.dtype == DType::f32) return unsupported_dtype("paged_decode: the GPU kernels take f16 and bf16");
  if (!families::attention_head_dims_supported(a.head_dim, a.head_dim))
    return invalid_argument("paged_decode: the GPU kernels take head_dim 64, 80, 96, 128, 192 and 256, not " +
                            std::to_string(a.head_dim));
  std::int64_t splits = o.splits;
  if (splits == 0) {
    KILN_ASSIGN_OR_RETURN(const jit::DeviceInfo* dev, jit::device_info(q.device.index));
    splits = families::paged_decode_splits(a.batch, a.seqlen_q, a.heads, a.kv_heads, a.head_dim, a.max_seq_len,
                                           dev->sm_count, dev->compute_capability);
  }
  a.splits = splits;
  static const Family* split = family("paged_decode");
  static const Family* combine = family("attention_combine");
  if (!split || !combine) return internal_error("the paged decode families are not registered");
  const std::uint32_t alignment = client::common_alignment({address(q), address(k_cache), address(v_cache), address(out)}, {});
  const Problem ps = Problem::of(q.dtype, alignment, a);
  const families::AttentionCombineProblem ac{.batch = a.batch,
                                             .seqlen_q = a.seqlen_q,
                                             .total_q = a.total_q,
                                             .heads = a.heads,
                                             .head_dim_v = a.head_dim,
                                             .varlen = a.varlen,
                                             .splits = splits,
                                             .lse_token_major = 1};
  const Problem pc = Problem::of(q.dtype, 16, ac);
  KILN_TRY(split->check_problem(split->heuristic(ps), ps));
  KILN_TRY(combine->check_problem(combine->heuristic(pc), pc));
  const std::int64_t elements = families::paged_decode_workspace_elements(splits, a.total_q, a.heads, a.head_dim);
  if (workspace && workspace->numel() < elements)
    return invalid_argument("paged_decode: workspace holds " + std::to_string(workspace->numel()) + " f32, the call needs " +
                            std::to_string(elements) + " (paged_decode_workspace_elements)");
  if (workspace && address(*workspace) % 16) return invalid_argument("paged_decode: workspace must be 16-byte aligned");
  if (a.batch == 0 || a.total_q == 0) return {};
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  client::StreamWorkspace scratch;
  if (!workspace) {
    KILN_ASSIGN_OR_RETURN(scratch, client::StreamWorkspace::get(q.device.index, stream, elements));
  }
  void* ws = workspace ? workspace->data : scratch.data();
  float* o_part = static_cast<float*>(ws);
  float* lse_part = o_part + splits * a.total_q * a.heads * a.head_dim;
  void* sb[8] = {q.data, k_cache.data, v_cache.data, cu_seqlens_q ? cu_seqlens_q->data : nullptr,
                 block_tables.data, seq_lens.data, o_part, lse_part};
  KILN_TRY(runtime->run(*split, ps, sb, stream));
  void* cb[5] = {o_part, lse_part, cu_seqlens_q ? cu_seqlens_q->data : nullptr, out.data, lse ? lse->data : nullptr};
  return runtime->run(*combine, pc, cb, stream);
}

Status paged_cascade_decode(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                            const TensorView& shared_block_table, const TensorView& shared_seq_len,
                            const TensorView& block_tables, const TensorView& seq_lens, const TensorView& out,
                            const TensorView* lse, const TensorView* workspace, const PagedCascadeOptions& o,
                            Stream stream, Runtime* runtime) {
  const char* op = "paged_cascade_decode";
  for (const auto& [t, name] :
       {std::pair{&q, "q"}, std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"},
        std::pair{&shared_block_table, "shared_block_table"}, std::pair{&shared_seq_len, "shared_seq_len"},
        std::pair{&block_tables, "block_tables"}, std::pair{&seq_lens, "seq_lens"}, std::pair{&out, "out"},
        std::pair{lse, "lse"}, std::pair{workspace, "workspace"}})
    if (t) KILN_TRY(check_tensor(op, *t, name, q));
  KILN_TRY(client::check_float_dtype(q, "q"));
  KILN_TRY(check_cache_pair(op, k_cache, v_cache));
  if (k_cache.dtype != q.dtype || out.dtype != q.dtype)
    return unsupported_dtype(std::string("paged_cascade_decode: k_cache, v_cache and out must be of q's dtype (") +
                             dtype_name(q.dtype) + ")");
  for (const auto& [t, name] : {std::pair{&shared_block_table, "shared_block_table"},
                                std::pair{&shared_seq_len, "shared_seq_len"}, std::pair{&block_tables, "block_tables"},
                                std::pair{&seq_lens, "seq_lens"}})
    if (t->dtype != DType::i32) return unsupported_dtype(std::string("paged_cascade_decode: ") + name + " must be int32");
  if ((lse && lse->dtype != DType::f32) || (workspace && workspace->dtype != DType::f32))
    return unsupported_dtype("paged_cascade_decode: lse and workspace must be f32");
  if (q.rank != 3) return shape_mismatch("paged_cascade_decode: q must be [batch, heads, head_dim], got " + dims(q));
  if (block_tables.rank != 2 || block_tables.shape[0] != q.shape[0])
    return shape_mismatch("paged_cascade_decode: block_tables must be [batch, max_blocks] with q's batch " +
                          std::to_string(q.shape[0]) + ", got " + dims(block_tables));
  if (shared_block_table.rank != 1 || shared_seq_len.rank != 1 || shared_seq_len.shape[0] != 1)
    return shape_mismatch("paged_cascade_decode: shared_block_table must be [shared_blocks] and shared_seq_len [1]");
  // The two passes' problems: the prefix as one request of `batch` queries, the own keys per request.
  PagedDecodeProblem own;
  own.batch = q.shape[0];
  own.seqlen_q = 1;
  own.total_q = own.batch;
  own.heads = q.shape[1];
  own.head_dim = q.shape[2];
  own.num_blocks = k_cache.shape[0];
  own.page_size = k_cache.shape[1];
  own.kv_heads = k_cache.shape[2];
  own.max_blocks = block_tables.shape[1];
  if (k_cache.shape[3] != own.head_dim)
    return shape_mismatch("paged_cascade_decode: the caches' head_dim " + std::to_string(k_cache.shape[3]) +
                          " differs from q's " + std::to_string(own.head_dim));
  if (own.heads % own.kv_heads)
    return shape_mismatch("paged_cascade_decode: q has " + std::to_string(own.heads) +
                          " heads, not a multiple of the caches' " + std::to_string(own.kv_heads));
  if (seq_lens.rank != 1 || seq_lens.shape[0] != own.batch)
    return shape_mismatch("paged_cascade_decode: seq_lens must be [batch], got " + dims(seq_lens));
  if (out.rank != 3 || out.shape[0] != own.batch || out.shape[1] != own.heads || out.shape[2] != own.head_dim)
    return shape_mismatch("paged_cascade_decode: out must be q's shape " + dims(q) + ", got " + dims(out));
  if (lse && (lse->rank != 2 || lse->shape[0] != own.batch || lse->shape[1] != own.heads))
    return shape_mismatch("paged_cascade_decode: lse must be [batch, heads], got " + dims(*lse));
  if (!std::isfinite(o.softcap) || o.softcap < 0 || !std::isfinite(o.scale))
    return invalid_argument("paged_cascade_decode: scale must be finite, softcap finite and non-negative");
  if (o.max_shared_len < 0 || o.max_seq_len < 0 || o.shared_splits < 0 || o.shared_splits > 1024 || o.splits < 0 ||
      o.splits > 1024)
    return invalid_argument("paged_cascade_decode: lengths must be non-negative, split counts 0 to 1024");
  own.scale = o.scale != 0 ? o.scale : 1.0 / std::sqrt(double(own.head_dim));
  own.softcap = o.softcap;
  own.max_seq_len = o.max_seq_len > 0 ? o.max_seq_len : own.max_blocks * own.page_size;
  PagedDecodeProblem pre = own;
  pre.batch = 1;
  pre.seqlen_q = own.batch;
  pre.max_blocks = shared_block_table.shape[0];
  pre.max_seq_len = o.max_shared_len > 0 ? o.max_shared_len : pre.max_blocks * pre.page_size;
  for (const PagedDecodeProblem* a : {&pre, &own})
    if (a->max_seq_len > a->max_blocks * a->page_size)
      return shape_mismatch(std::string("paged_cascade_decode: ") + (a == &pre ? "max_shared_len " : "max_seq_len ") +
                            std::to_string(a->max_seq_len) + " is past the " + std::to_string(a->max_blocks) +
                            " blocks of " + std::to_string(a->page_size) + " tokens its table holds");
  if (q.device.kind == DeviceKind::cpu) {
    const auto* shared = static_cast<const std::int32_t*>(shared_block_table.data);
    const auto* tables = static_cast<const std::int32_t*>(block_tables.data);
    const auto* lens = static_cast<const std::int32_t*>(seq_lens.data);
    const std::int64_t shared_len = *static_cast<const std::int32_t*>(shared_seq_len.data);
    if (shared_len > pre.max_seq_len)
      return shape_mismatch("paged_cascade_decode: shared_seq_len " + std::to_string(shared_len) +
                            " is past max_shared_len " + std::to_string(pre.max_seq_len));
    KILN_TRY(KVCacheManager::validate_block_table(
        std::span<const std::int32_t>(shared, std::size_t(pre.max_blocks)), shared_len, std::int32_t(own.num_blocks),
        std::int32_t(own.page_size)));
    const std::vector<std::int64_t> prefix = slots_of(shared, shared_len, own.page_size);
    for (std::int64_t b = 0; b < own.batch; ++b) {
      if (lens[b] > own.max_seq_len)
        return shape_mismatch("paged_cascade_decode: seq_lens[" + std::to_string(b) + "] = " + std::to_string(lens[b]) +
                              " is past max_seq_len " + std::to_string(own.max_seq_len));
      KILN_TRY(KVCacheManager::validate_block_table(
          std::span<const std::int32_t>(tables + b * own.max_blocks, std::size_t(own.max_blocks)), lens[b],
          std::int32_t(own.num_blocks), std::int32_t(own.page_size)));
      std::vector<std::int64_t> slots = prefix;
      const std::vector<std::int64_t> mine = slots_of(tables + b * own.max_blocks, lens[b], own.page_size);
      slots.insert(slots.end(), mine.begin(), mine.end());
      attend_slots(own, q.dtype, q, k_cache, v_cache, slots, b, 1, out, lse);
    }
    return {};
  }
  if (q.dtype == DType::f32) return unsupported_dtype("paged_cascade_decode: the GPU kernels take f16 and bf16");
  if (!families::attention_head_dims_supported(own.head_dim, own.head_dim))
    return invalid_argument("paged_cascade_decode: the GPU kernels take head_dim 64, 80, 96, 128, 192 and 256, not " +
                            std::to_string(own.head_dim));
  pre.splits = o.shared_splits;
  own.splits = o.splits;
  if (pre.splits == 0 || own.splits == 0) {
    KILN_ASSIGN_OR_RETURN(const jit::DeviceInfo* dev, jit::device_info(q.device.index));
    for (PagedDecodeProblem* a : {&pre, &own})
      if (a->splits == 0)
        a->splits = families::paged_decode_splits(a->batch, a->seqlen_q, a->heads, a->kv_heads, a->head_dim,
                                                  a->max_seq_len, dev->sm_count, dev->compute_capability);
  }
  static const Family* split = family("paged_decode");
  static const Family* combine = family("attention_combine");
  if (!split || !combine) return internal_error("the paged decode families are not registered");
  const std::int64_t total_splits = pre.splits + own.splits;
  const std::uint32_t alignment = client::common_alignment({address(q), address(k_cache), address(v_cache), address(out)}, {});
  // The own pass reads nothing the prefix pass writes: on sm_90 it runs beside it.
  own.overlap_previous = 1;
  const Problem pp = Problem::of(q.dtype, alignment, pre), po = Problem::of(q.dtype, alignment, own);
  const Problem pc = Problem::of(q.dtype, 16,
                                 families::AttentionCombineProblem{.batch = own.batch,
                                                                   .seqlen_q = 1,
                                                                   .total_q = own.batch,
                                                                   .heads = own.heads,
                                                                   .head_dim_v = own.head_dim,
                                                                   .varlen = 0,
                                                                   .splits = total_splits,
                                                                   .lse_token_major = 1});
  KILN_TRY(split->check_problem(split->heuristic(pp), pp));
  KILN_TRY(split->check_problem(split->heuristic(po), po));
  KILN_TRY(combine->check_problem(combine->heuristic(pc), pc));
  const std::int64_t rows = own.batch * own.heads;
  const std::int64_t elements = total_splits * rows * (own.head_dim + 1);
  if (workspace && workspace->numel() < elements)
    return invalid_argument("paged_cascade_decode: workspace holds " + std::to_string(workspace->numel()) +
                            " f32, the call needs " + std::to_string(elements));
  if (workspace && address(*workspace) % 16)
    return invalid_argument("paged_cascade_decode: workspace must be 16-byte aligned");
  if (own.batch == 0) return {};
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  client::StreamWorkspace scratch;
  if (!workspace) {
    KILN_ASSIGN_OR_RETURN(scratch, client::StreamWorkspace::get(q.device.index, stream, elements));
  }
  void* ws = workspace ? workspace->data : scratch.data();
  // Partials [splits, batch, heads, head_dim] then lse [splits, batch, heads]: the prefix pass
  // fills splits 0 .. shared_splits - 1, the own pass the rest.
  float* o_part = static_cast<float*>(ws);
  float* lse_part = o_part + total_splits * rows * own.head_dim;
  void* pb[8] = {q.data, k_cache.data, v_cache.data, nullptr, shared_block_table.data, shared_seq_len.data, o_part,
                 lse_part};
  KILN_TRY(runtime->run(*split, pp, pb, stream));
  void* ob[8] = {q.data, k_cache.data, v_cache.data, nullptr, block_tables.data, seq_lens.data,
                 o_part + pre.splits * rows * own.head_dim, lse_part + pre.splits * rows};
  KILN_TRY(runtime->run(*split, po, ob, stream));
  void* cb[5] = {o_part, lse_part, nullptr, out.data, lse ? lse->data : nullptr};
  return runtime->run(*combine, pc, cb, stream);
}

PagedCascadeOptions PagedCascadePlan::options(const PagedCascadeOptions& base) const {
  PagedCascadeOptions o = base;
  o.max_shared_len = shared_len;
  o.max_seq_len = max_seq_len;
  o.shared_splits = shared_splits;
  o.splits = splits;
  return o;
}

Result<PagedCascadePlan> plan_paged_cascade_decode(const PagedDecodeShape& s, std::span<const std::int32_t> shared_table,
                                                   std::int64_t shared_len, std::span<const std::int32_t> seq_lens,
                                                   std::span<const std::int32_t> block_tables, std::int64_t sm_count) {
  KILN_ASSIGN_OR_RETURN(const PagedDecodePlan own, plan_paged_decode(s, seq_lens, {}, block_tables, sm_count));
  PagedDecodeShape shared = s;
  shared.max_blocks = std::int64_t(shared_table.size());
  const std::int32_t len = std::int32_t(std::clamp<std::int64_t>(shared_len, -1, 0x7fffffff));
  KILN_ASSIGN_OR_RETURN(const PagedDecodePlan pre,
                        plan_paged_decode(shared, std::span<const std::int32_t>(&len, 1), {}, shared_table, sm_count));
  PagedCascadePlan p;
  p.batch = own.batch;
  p.shared_len = pre.max_seq_len;
  p.max_seq_len = own.max_seq_len;
  p.shared_splits = families::paged_decode_splits(1, own.batch, s.heads, s.kv_heads, s.head_dim, pre.max_seq_len,
                                                  sm_count);
  p.splits = own.splits;
  p.workspace_elements = (p.shared_splits + p.splits) * own.batch * s.heads * (s.head_dim + 1);
  return p;
}

PagedDecodeOptions PagedDecodePlan::options(const PagedDecodeOptions& base) const {
  PagedDecodeOptions o = base;
  o.max_seqlen_q = max_seqlen_q;
  o.max_seq_len = max_seq_len;
  o.splits = splits;
  return o;
}

Result<PagedDecodePlan> plan_paged_decode(const PagedDecodeShape& s, std::span<const std::int32_t> seq_lens,
                                          std::span<const std::int32_t> cu_seqlens_q,
                                          std::span<const std::int32_t> block_tables, std::int64_t sm_count) {
  if (s.heads <= 0 || s.kv_heads <= 0 || s.heads % s.kv_heads || s.head_dim <= 0)
    return shape_mismatch("plan_paged_decode: heads must be a positive multiple of kv_heads, head_dim positive");
  if (!families::paged_page_size_supported(s.page_size))
    return invalid_argument("plan_paged_decode: page_size must be 1, 8, 16, 32, 64 or 128");
  if (s.num_blocks < 0 || s.max_blocks < 0) return shape_mismatch("plan_paged_decode: negative num_blocks or max_blocks");
  PagedDecodePlan p;
  p.batch = std::int64_t(seq_lens.size());
  if (!cu_seqlens_q.empty() && std::int64_t(cu_seqlens_q.size()) != p.batch + 1)
    return shape_mismatch("plan_paged_decode: cu_seqlens_q must hold batch + 1 offsets");
  if (!block_tables.empty() && std::int64_t(block_tables.size()) != p.batch * s.max_blocks)
    return shape_mismatch("plan_paged_decode: block_tables must hold batch * max_blocks entries");
  if (!cu_seqlens_q.empty() && cu_seqlens_q[0] != 0) return shape_mismatch("plan_paged_decode: cu_seqlens_q[0] must be 0");
  p.max_seqlen_q = cu_seqlens_q.empty() ? 1 : 0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t len = seq_lens[std::size_t(b)];
    if (len < 0 || len > s.max_blocks * s.page_size)
      return shape_mismatch("plan_paged_decode: request " + std::to_string(b) + " has " + std::to_string(len) +
                            " keys, past its table of " + std::to_string(s.max_blocks) + " blocks of " +
                            std::to_string(s.page_size));
    if (!block_tables.empty())
      KILN_TRY(KVCacheManager::validate_block_table(block_tables.subspan(std::size_t(b * s.max_blocks), std::size_t(s.max_blocks)),
                                                    len, std::int32_t(s.num_blocks), std::int32_t(s.page_size)));
    p.max_seq_len = std::max(p.max_seq_len, len);
    if (!cu_seqlens_q.empty()) {
      const std::int64_t lq = std::int64_t(cu_seqlens_q[std::size_t(b + 1)]) - cu_seqlens_q[std::size_t(b)];
      if (lq < 0) return shape_mismatch("plan_paged_decode: cu_seqlens_q must never decrease");
      p.max_seqlen_q = std::max(p.max_seqlen_q, lq);
    }
  }
  p.total_q = cu_seqlens_q.empty() ? p.batch : cu_seqlens_q.back();
  if (p.max_seqlen_q == 0) p.max_seqlen_q = 1;
  p.max_seq_len = std::max<std::int64_t>(p.max_seq_len, 1);
  p.splits = families::paged_decode_splits(p.batch, p.max_seqlen_q, s.heads, s.kv_heads, s.head_dim, p.max_seq_len,
                                           sm_count);
  p.workspace_elements = families::paged_decode_workspace_elements(p.splits, p.total_q, s.heads, s.head_dim);
  return p;
}

}  // namespace kiln

void kiln_register_ops_paged_attention(kiln::Registry& r) {
  using namespace kiln;
  const std::uint32_t index = dtype_bit(DType::i32) | dtype_bit(DType::i64);
  const std::uint32_t cache = k_float_dtypes | dtype_bit(DType::u8);
  {
    OpDecl op;
    op.name = "reshape_and_cache";
    op.doc = "Writes token t's key and value rows into slot slot_mapping[t] of key_cache and value_cache (in place; "
             "negative slots are skipped); u8 caches hold fp8 e4m3 of x / k_scale (v_scale).";
    op.tensors = {{.name = "key", .min_rank = 3, .max_rank = 3, .shape = "[tokens, kv_heads, head_dim]", .strided_rows = true},
                  {.name = "value", .min_rank = 3, .max_rank = 3, .shape = "[tokens, kv_heads, head_dim]", .strided_rows = true},
                  {.name = "slot_mapping", .dtypes = index, .max_rank = 1, .shape = "[tokens]"},
                  {.name = "k_scale", .optional = true, .dtypes = dtype_bit(DType::f32), .shape = "[1]"},
                  {.name = "v_scale", .optional = true, .dtypes = dtype_bit(DType::f32), .shape = "[1]"},
                  {.name = "key_cache", .role = TensorRole::output, .dtypes = cache, .min_rank = 4, .max_rank = 4,
                   .shape = "[num_blocks, page_size, kv_heads, head_dim]"},
                  {.name = "value_cache", .role = TensorRole::output, .dtypes = cache, .min_rank = 4, .max_rank = 4,
                   .shape = "[num_blocks, page_size, kv_heads, head_dim]"}};
    op.run = [](const OpCall& c) {
      return reshape_and_cache(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(5), c.tensor(6), c.optional(3),
                               c.optional(4), c.stream, c.runtime);
    };
    op.infer = [](const OpCall&, std::span<OutputShape>) {
      return invalid_argument("reshape_and_cache writes into the caches it is given: pass key_cache and value_cache");
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "copy_blocks";
    op.doc = "For each (src, dst) row of pairs, block dst of key_cache and value_cache becomes a copy of block src (in "
             "place; pairs must not chain or repeat a dst).";
    op.tensors = {{.name = "pairs", .dtypes = index, .min_rank = 2, .max_rank = 2, .shape = "[n, 2]"},
                  {.name = "key_cache", .role = TensorRole::output, .dtypes = cache, .min_rank = 4, .max_rank = 4,
                   .shape = "[num_blocks, page_size, kv_heads, head_dim]"},
                  {.name = "value_cache", .role = TensorRole::output, .dtypes = cache, .min_rank = 4, .max_rank = 4,
                   .shape = "[num_blocks, page_size, kv_heads, head_dim]"}};
    op.run = [](const OpCall& c) { return copy_blocks(c.tensor(1), c.tensor(2), c.tensor(0), c.stream, c.runtime); };
    op.infer = [](const OpCall&, std::span<OutputShape>) {
      return invalid_argument("copy_blocks writes into the caches it is given: pass key_cache and value_cache");
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "swap_blocks";
    op.doc = "For each (src, dst) row of pairs, block dst of the destination pool (dst_key, dst_value) becomes a copy "
             "of block src of the source pool: GPU to pinned host memory (swap out), back (swap in), or between two "
             "GPU pools; stream-ordered, one launch. Host pools must be page-locked.";
    op.tensors = {{.name = "pairs", .dtypes = index, .min_rank = 2, .max_rank = 2, .shape = "[n, 2]"},
                  {.name = "src_key", .dtypes = cache, .min_rank = 4, .max_rank = 4,
                   .shape = "[src_blocks, page_size, kv_heads, head_dim]"},
                  {.name = "src_value", .dtypes = cache, .min_rank = 4, .max_rank = 4,
                   .shape = "[src_blocks, page_size, kv_heads, head_dim]"},
                  {.name = "dst_key", .role = TensorRole::output, .dtypes = cache, .min_rank = 4, .max_rank = 4,
                   .shape = "[num_blocks, page_size, kv_heads, head_dim]"},
                  {.name = "dst_value", .role = TensorRole::output, .dtypes = cache, .min_rank = 4, .max_rank = 4,
                   .shape = "[num_blocks, page_size, kv_heads, head_dim]"}};
    op.run = [](const OpCall& c) {
      return swap_blocks(c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(0), c.stream, c.runtime);
    };
    op.infer = [](const OpCall&, std::span<OutputShape>) {
      return invalid_argument("swap_blocks writes into the pool it is given: pass dst_key and dst_value");
    };
    (void)r.add_op(std::move(op));
  }
  const auto state_shapes = [](const OpCall& c, std::span<OutputShape> out) {
    out[0] = shape_like(c.tensor(0), c.tensor(0).dtype);
    out[1] = shape_like(c.tensor(1), DType::f32);
    return Status{};
  };
  {
    OpDecl op;
    op.name = "merge_state";
    op.doc = "Merges two attention states over disjoint keys by their lse: s_out = log(exp(s_a) + exp(s_b)), v_out = "
             "exp(s_a - s_out) v_a + exp(s_b - s_out) v_b; both empty (-inf): zeros and -inf.";
    op.tensors = {{.name = "v_a", .min_rank = 3, .max_rank = 3, .shape = "[tokens, heads, head_dim]"},
                  {.name = "s_a", .dtypes = dtype_bit(DType::f32), .min_rank = 2, .max_rank = 2, .shape = "[tokens, heads]"},
                  {.name = "v_b", .min_rank = 3, .max_rank = 3, .shape = "[tokens, heads, head_dim]"},
                  {.name = "s_b", .dtypes = dtype_bit(DType::f32), .min_rank = 2, .max_rank = 2, .shape = "[tokens, heads]"},
                  {.name = "v_out", .role = TensorRole::output, .min_rank = 3, .max_rank = 3, .shape = "[tokens, heads, head_dim]"},
                  {.name = "s_out", .role = TensorRole::output, .dtypes = dtype_bit(DType::f32), .min_rank = 2,
                   .max_rank = 2, .shape = "[tokens, heads]"}};
    op.run = [](const OpCall& c) {
      return merge_state(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5), c.stream,
                         c.runtime);
    };
    op.infer = state_shapes;
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "merge_state_in_place";
    op.doc = "merge_state into (v, s): they become the merge of themselves with (v_other, s_other).";
    op.tensors = {{.name = "v_other", .min_rank = 3, .max_rank = 3, .shape = "[tokens, heads, head_dim]"},
                  {.name = "s_other", .dtypes = dtype_bit(DType::f32), .min_rank = 2, .max_rank = 2, .shape = "[tokens, heads]"},
                  {.name = "v", .role = TensorRole::output, .min_rank = 3, .max_rank = 3, .shape = "[tokens, heads, head_dim]"},
                  {.name = "s", .role = TensorRole::output, .dtypes = dtype_bit(DType::f32), .min_rank = 2, .max_rank = 2,
                   .shape = "[tokens, heads]"}};
    op.run = [](const OpCall& c) {
      return merge_state_in_place(c.tensor(2), c.tensor(3), c.tensor(0), c.tensor(1), c.stream, c.runtime);
    };
    op.infer = [](const OpCall&, std::span<OutputShape>) {
      return invalid_argument("merge_state_in_place updates the state it is given: pass v and s");
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "paged_decode";
    op.doc = "Attention of each request's last queries (one each without cu_seqlens_q) over its seq_lens[b] keys in "
             "blocks block_tables[b] of the paged k_cache and v_cache; out [total_q, heads, head_dim], lse [total_q, "
             "heads]. workspace (f32, optional): the split partials, needed under CUDA graph capture.";
    op.tensors = {{.name = "q", .min_rank = 3, .max_rank = 3, .shape = "[total_q, heads, head_dim]"},
                  {.name = "k_cache", .min_rank = 4, .max_rank = 4, .shape = "[num_blocks, page_size, kv_heads, head_dim]"},
                  {.name = "v_cache", .min_rank = 4, .max_rank = 4, .shape = "[num_blocks, page_size, kv_heads, head_dim]"},
                  {.name = "block_tables", .dtypes = dtype_bit(DType::i32), .min_rank = 2, .max_rank = 2,
                   .shape = "[batch, max_blocks]"},
                  {.name = "seq_lens", .dtypes = dtype_bit(DType::i32), .max_rank = 1, .shape = "[batch]"},
                  {.name = "cu_seqlens_q", .optional = true, .dtypes = dtype_bit(DType::i32), .max_rank = 1,
                   .shape = "[batch + 1]"},
                  {.name = "workspace", .optional = true, .dtypes = dtype_bit(DType::f32), .max_rank = 1,
                   .shape = "[workspace_elements]"},
                  {.name = "out", .role = TensorRole::output, .min_rank = 3, .max_rank = 3,
                   .shape = "[total_q, heads, head_dim]"},
                  {.name = "lse", .role = TensorRole::output, .optional = true, .dtypes = dtype_bit(DType::f32),
                   .min_rank = 2, .max_rank = 2, .shape = "[total_q, heads]"}};
    op.scalars = {{.name = "max_seqlen_q", .kind = ScalarKind::i64, .has_default = true, .default_value = 0,
                   .doc = "with cu_seqlens_q, the most queries of a request (0: total_q)"},
                  {.name = "max_seq_len", .kind = ScalarKind::i64, .has_default = true, .default_value = 0,
                   .doc = "bound of seq_lens (0: max_blocks * page_size)"},
                  {.name = "splits", .kind = ScalarKind::i64, .has_default = true, .default_value = 0,
                   .doc = "key ranges; 0: the heuristic (the plan's choice)"},
                  {.name = "scale", .kind = ScalarKind::f64, .has_default = true, .default_value = 0,
                   .doc = "multiplies q k^T; 0: 1/sqrt(head_dim)"},
                  {.name = "causal", .kind = ScalarKind::boolean, .has_default = true, .default_value = 0,
                   .doc = "causal among a request's queries, aligned to the end of its keys"},
                  {.name = "window_left", .kind = ScalarKind::i64, .has_default = true, .default_value = -1,
                   .doc = "keys left of the diagonal each query sees; -1 unbounded"},
                  {.name = "softcap", .kind = ScalarKind::f64, .has_default = true, .default_value = 0,
                   .doc = "> 0: scores become softcap * tanh(score / softcap)"}};
    op.run = [](const OpCall& c) {
      PagedDecodeOptions o;
      o.max_seqlen_q = c.i64(0);
      o.max_seq_len = c.i64(1);
      o.splits = c.i64(2);
      o.scale = c.f64(3);
      o.causal = c.i64(4) != 0;
      o.window_left = c.i64(5);
      o.softcap = c.f64(6);
      return paged_decode(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.optional(5), c.tensor(7),
                          c.optional(8), c.optional(6), o, c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      const TensorView& q = c.tensor(0);
      out[0] = shape_like(q, q.dtype);
      out[1].dtype = DType::f32;
      out[1].rank = 2;
      out[1].shape[0] = q.shape[0];
      out[1].shape[1] = q.shape[1];
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
  {
    OpDecl op;
    op.name = "paged_cascade_decode";
    op.doc = "One decode step where every request's context is a shared prefix (shared_seq_len[0] keys in blocks "
             "shared_block_table) then its own seq_lens[b] keys in blocks block_tables[b]: the prefix is read once for "
             "the batch, the states merged by lse. out [batch, heads, head_dim], lse [batch, heads].";
    op.tensors = {{.name = "q", .min_rank = 3, .max_rank = 3, .shape = "[batch, heads, head_dim]"},
                  {.name = "k_cache", .min_rank = 4, .max_rank = 4, .shape = "[num_blocks, page_size, kv_heads, head_dim]"},
                  {.name = "v_cache", .min_rank = 4, .max_rank = 4, .shape = "[num_blocks, page_size, kv_heads, head_dim]"},
                  {.name = "shared_block_table", .dtypes = dtype_bit(DType::i32), .max_rank = 1, .shape = "[shared_blocks]"},
                  {.name = "shared_seq_len", .dtypes = dtype_bit(DType::i32), .max_rank = 1, .shape = "[1]"},
                  {.name = "block_tables", .dtypes = dtype_bit(DType::i32), .min_rank = 2, .max_rank = 2,
                   .shape = "[batch, max_blocks]"},
                  {.name = "seq_lens", .dtypes = dtype_bit(DType::i32), .max_rank = 1, .shape = "[batch]"},
                  {.name = "workspace", .optional = true, .dtypes = dtype_bit(DType::f32), .max_rank = 1,
                   .shape = "[workspace_elements]"},
                  {.name = "out", .role = TensorRole::output, .min_rank = 3, .max_rank = 3, .shape = "[batch, heads, head_dim]"},
                  {.name = "lse", .role = TensorRole::output, .optional = true, .dtypes = dtype_bit(DType::f32),
                   .min_rank = 2, .max_rank = 2, .shape = "[batch, heads]"}};
    op.scalars = {{.name = "max_shared_len", .kind = ScalarKind::i64, .has_default = true, .default_value = 0,
                   .doc = "bound of shared_seq_len (0: the shared table's capacity)"},
                  {.name = "max_seq_len", .kind = ScalarKind::i64, .has_default = true, .default_value = 0,
                   .doc = "bound of seq_lens (0: max_blocks * page_size)"},
                  {.name = "shared_splits", .kind = ScalarKind::i64, .has_default = true, .default_value = 0,
                   .doc = "key ranges of the prefix pass; 0: the heuristic"},
                  {.name = "splits", .kind = ScalarKind::i64, .has_default = true, .default_value = 0,
                   .doc = "key ranges of the own pass; 0: the heuristic"},
                  {.name = "scale", .kind = ScalarKind::f64, .has_default = true, .default_value = 0,
                   .doc = "multiplies q k^T; 0: 1/sqrt(head_dim)"},
                  {.name = "softcap", .kind = ScalarKind::f64, .has_default = true, .default_value = 0,
                   .doc = "> 0: scores become softcap * tanh(score / softcap)"}};
    op.run = [](const OpCall& c) {
      PagedCascadeOptions o;
      o.max_shared_len = c.i64(0);
      o.max_seq_len = c.i64(1);
      o.shared_splits = c.i64(2);
      o.splits = c.i64(3);
      o.scale = c.f64(4);
      o.softcap = c.f64(5);
      return paged_cascade_decode(c.tensor(0), c.tensor(1), c.tensor(2), c.tensor(3), c.tensor(4), c.tensor(5),
                                  c.tensor(6), c.tensor(8), c.optional(9), c.optional(7), o, c.stream, c.runtime);
    };
    op.infer = [](const OpCall& c, std::span<OutputShape> out) {
      const TensorView& q = c.tensor(0);
      out[0] = shape_like(q, q.dtype);
      out[1].dtype = DType::f32;
      out[1].rank = 2;
      out[1].shape[0] = q.shape[0];
      out[1].shape[1] = q.shape[1];
      return Status{};
    };
    (void)r.add_op(std::move(op));
  }
}
