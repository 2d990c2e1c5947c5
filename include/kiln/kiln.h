/* kiln's C ABI: the client calls for FFI users (Python, Rust, ...).
 *
 * Every function returns a kiln_code (0 is success). On failure, kiln_last_error() returns the
 * message for the calling thread until its next kiln call. No C++ exception crosses this boundary.
 *
 * Versioning: KILN_ABI_VERSION grows when functions are added; existing functions, enum values
 * and struct layouts never change meaning. A caller that needs version N checks
 * kiln_abi_version() >= N at load time. Version 1: runtime and kiln_rms_norm. Version 2: every
 * typed op (RMSNorm with inv_rms and backward, add + RMSNorm, activation-and-mul, RoPE, RMSNorm +
 * RoPE), the runtime counters and kiln_pointer_device. Version 3: kiln_quantize_fp8, kiln_fp8_gemm,
 * kiln_fused_gated_mlp. Version 4: ops by their declarations (kiln_op_*). Version 5: typed
 * problems: kiln_family_describe, and kiln_launch (the generic launch of any registered family,
 * plugins' included) takes the family's problem fields; version 4's kiln_launch, which took
 * untyped dims and scalars, is gone. Version 6: the paged KV cache's host bookkeeping (kiln_kv_*,
 * kiln_radix_*). Version 7: kiln_paged_decode_plan and kiln_paged_cascade_decode_plan (the paged
 * kernels themselves are declared ops: reshape_and_cache, copy_blocks, merge_state,
 * merge_state_in_place, paged_decode, paged_cascade_decode). Version 8: swapping in the KV cache
 * manager (kiln_kv_enable_swap, kiln_kv_swap_out, kiln_kv_swap_in, kiln_kv_can_swap_in,
 * kiln_kv_swap_state; the copies are the declared op swap_blocks).
 *
 * Each op is the C++ op of the same name in kiln/ops.h, with that contract: it validates every
 * tensor and returns KILN_DEVICE_ERROR, KILN_SHAPE_MISMATCH, KILN_UNSUPPORTED_DTYPE or
 * KILN_INVALID_ARGUMENT before anything is compiled or launched. A successful call on CUDA memory
 * has only enqueued the kernel on `stream`. After the first call for a shape, a call allocates
 * nothing and looks nothing up by string (the runtime's fast path); the error path does allocate.
 */
#ifndef KILN_KILN_H
#define KILN_KILN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_ABI_VERSION 8

/* Same values as kiln::Code. */
typedef enum kiln_code {
  KILN_OK = 0,
  KILN_INVALID_ARGUMENT = 1,
  KILN_DEVICE_ERROR = 2,
  KILN_SHAPE_MISMATCH = 3,
  KILN_UNSUPPORTED_DTYPE = 4,
  KILN_NOT_FOUND = 5,
  KILN_CORRUPTION = 6,
  KILN_COMPILE_ERROR = 7,
  KILN_DRIVER_ERROR = 8,
  KILN_IO_ERROR = 9,
  KILN_UNAVAILABLE = 10,
  KILN_TIMEOUT = 11,
  KILN_SHUTTING_DOWN = 12,
  KILN_INTERNAL = 13
} kiln_code;

/* Same values as kiln::DType. */
typedef enum kiln_dtype {
  KILN_F32 = 0,
  KILN_F16 = 1,
  KILN_BF16 = 2,
  KILN_U8 = 3,
  KILN_I32 = 4,
  KILN_I64 = 5
} kiln_dtype;

typedef enum kiln_device_kind { KILN_CPU = 0, KILN_CUDA = 1 } kiln_device_kind;

/* A non-owning tensor view. strides may be NULL for a row-major contiguous tensor. */
typedef struct kiln_tensor {
  void* data;
  int32_t dtype;       /* kiln_dtype */
  int32_t rank;        /* 1..8 */
  const int64_t* shape;
  const int64_t* strides; /* in elements */
  int32_t device_kind; /* kiln_device_kind */
  int32_t device_index;
} kiln_tensor;

typedef struct kiln_runtime kiln_runtime;

int kiln_abi_version(void);
const char* kiln_last_error(void);
const char* kiln_code_name(kiln_code code);

/* mode: "auto", "embedded" or "daemon" (NULL means "auto"). */
kiln_code kiln_runtime_create(const char* mode, kiln_runtime** out);
void kiln_runtime_destroy(kiln_runtime* rt);
/* "daemon" or "embedded" (valid for the runtime's lifetime). */
const char* kiln_runtime_resolver(kiln_runtime* rt);

/* In every op below, rt may be NULL for the process-wide runtime (KILN_MODE picks its resolver)
 * and stream is a CUstream (NULL: the legacy default stream). Tensors all on the CPU run the
 * op's CPU fallback where it has one (all but kiln_rms_norm_rope). */

/* y = x * rsqrt(mean(x^2, last dim) + eps) * weight. */
kiln_code kiln_rms_norm(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* weight,
                        const kiln_tensor* y, double eps, void* stream);

/* --- ABI version 2 --- */

/* kiln_rms_norm that also writes inv_rms (f32, one value per row, contiguous); inv_rms may be
 * NULL. */
kiln_code kiln_rms_norm_inv(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* weight,
                            const kiln_tensor* y, const kiln_tensor* inv_rms, double eps, void* stream);

/* h = x + residual; residual_out = h; y = rms_norm(h) * weight. */
kiln_code kiln_add_rms_norm(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* residual,
                            const kiln_tensor* weight, const kiln_tensor* y, const kiln_tensor* residual_out,
                            double eps, void* stream);

/* Same values as kiln::Activation. */
typedef enum kiln_activation { KILN_SILU = 0, KILN_GELU = 1, KILN_GELU_TANH = 2 } kiln_activation;

/* out = act(x[..., :d]) * x[..., d:]. activation: a kiln_activation. */
kiln_code kiln_act_and_mul(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* out, int32_t activation,
                           void* stream);

/* Same values as kiln::RopeLayout. */
typedef enum kiln_rope_layout { KILN_ROPE_NEOX = 0, KILN_ROPE_GPTJ = 1 } kiln_rope_layout;

/* Rotary embedding of q and k at position_ids; layout: a kiln_rope_layout. */
kiln_code kiln_apply_rope_qk(kiln_runtime* rt, const kiln_tensor* q, const kiln_tensor* k, const kiln_tensor* cos,
                             const kiln_tensor* sin, const kiln_tensor* position_ids, const kiln_tensor* q_out,
                             const kiln_tensor* k_out, int32_t layout, void* stream);

/* Fused RMSNorm + RoPE (CUDA only); num_heads 0 infers hidden / head_dim. */
kiln_code kiln_rms_norm_rope(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* weight,
                             const kiln_tensor* cos, const kiln_tensor* sin, const kiln_tensor* out, double eps,
                             int64_t num_heads, void* stream);

/* RMSNorm backward from the forward's inv_rms. workspace may be NULL (a workspace cached per
 * context and stream, allocated with cuMemAlloc on first use: not during CUDA graph capture);
 * otherwise f32, contiguous, CUDA, at least kiln_rms_norm_backward_workspace_elements(x). */
kiln_code kiln_rms_norm_backward(kiln_runtime* rt, const kiln_tensor* dy, const kiln_tensor* x,
                                 const kiln_tensor* weight, const kiln_tensor* inv_rms, const kiln_tensor* dx,
                                 const kiln_tensor* dw, const kiln_tensor* workspace, void* stream);
/* The f32 elements kiln_rms_norm_backward needs as workspace for tensors like x (0 on the CPU). */
kiln_code kiln_rms_norm_backward_workspace_elements(const kiln_tensor* x, int64_t* out);

/* Same values as kiln::Fp8Granularity. */
typedef enum kiln_fp8_granularity { KILN_FP8_TENSOR = 0, KILN_FP8_ROW_1X128 = 1, KILN_FP8_TILE_128 = 2 } kiln_fp8_granularity;

/* x -> e4m3 codes q (u8) and f32 scales; granularity: a kiln_fp8_granularity; transpose != 0
 * writes q as [cols, rows] (tensor and tile granularity). */
kiln_code kiln_quantize_fp8(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* q, const kiln_tensor* scale,
                            int32_t granularity, int32_t transpose, void* stream);

/* out = a b with e4m3 operands (u8 codes) and their scales (per tensor or block-wise, told apart
 * by their shapes); b K-major ([K, N] with strides {1, K}). a_scale and b_scale are required. */
kiln_code kiln_fp8_gemm(kiln_runtime* rt, const kiln_tensor* a, const kiln_tensor* b, const kiln_tensor* a_scale,
                        const kiln_tensor* b_scale, const kiln_tensor* out, void* stream);

/* Same values as kiln::GatedActivation. */
typedef enum kiln_gated_activation { KILN_GATED_SILU = 0, KILN_GATED_GELU = 1 } kiln_gated_activation;

/* out = act(x gate_weight^T) * (x up_weight^T); activation: a kiln_gated_activation. */
kiln_code kiln_fused_gated_mlp(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* gate_weight,
                               const kiln_tensor* up_weight, const kiln_tensor* out, int32_t activation, void* stream);

/* Same fields as kiln::RuntimeCounters. */
typedef struct kiln_runtime_counters {
  int64_t table_hits;
  int64_t from_daemon;
  int64_t from_embedded;
  int64_t module_loads;
} kiln_runtime_counters;

/* The counters of rt (NULL: the process-wide runtime, created if need be). */
kiln_code kiln_runtime_get_counters(kiln_runtime* rt, kiln_runtime_counters* out);
/* Where ptr lives, asked of the CUDA driver: *kind is KILN_CUDA and *index the device ordinal
 * for device or managed memory, KILN_CPU otherwise (also when no driver can be loaded). For FFI
 * tensors that carry no device index (__cuda_array_interface__). */
kiln_code kiln_pointer_device(const void* ptr, int32_t* kind, int32_t* index);

/* The resolver of rt, or of the process-wide runtime for NULL ("" before its first kernel). */
const char* kiln_runtime_resolver_name(kiln_runtime* rt);

/* --- ABI version 4: every op by its declaration --- */

/* An op as its family declares it (kiln/op.h): a handle valid for the process's life. Every typed
 * op above is also an op here, under the same name without the kiln_ prefix; ops that families
 * add later (and their bindings) appear here with no change to this header. */
typedef struct kiln_op kiln_op;

/* One scalar argument: ops read f64 for "f64" scalars and i64 for the others ("i64", "bool" as
 * 0/1, "choice" as the index of the choice). */
typedef struct kiln_value {
  double f64;
  int64_t i64;
} kiln_value;

/* The shape and dtype of one output (kiln_op_infer). */
typedef struct kiln_shape {
  int32_t dtype; /* kiln_dtype */
  int32_t rank;
  int64_t shape[8];
} kiln_shape;

/* The number of registered ops, and the op at index 0..count-1 (registration order). */
kiln_code kiln_op_count(int32_t* out);
kiln_code kiln_op_at(int32_t index, const kiln_op** out);
/* KILN_NOT_FOUND when no op has that name. */
kiln_code kiln_op_find(const char* name, const kiln_op** out);
/* The op's declaration as JSON: {"name", "doc", "backward", "cpu", "tensors": [{"name", "output",
 * "optional", "dtypes", "min_rank", "max_rank", "shape", "grad_of", "strided_rows"}], "scalars": [{"name",
 * "kind", "doc", "choices", "default"?}]}; valid for the process's life. NULL for a NULL op. */
const char* kiln_op_describe(const kiln_op* op);
/* Runs the op: tensors in declaration order (inputs, then outputs; NULL for an absent optional
 * one), scalars in declaration order. Validation and errors as the typed op's. */
kiln_code kiln_op_call(kiln_runtime* rt, const kiln_op* op, const kiln_tensor* const* tensors, int32_t tensor_count,
                       const kiln_value* scalars, int32_t scalar_count, void* stream);
/* The shape and dtype of every output (declaration order, `outputs` has one entry per output
 * tensor) for these inputs and scalars. Output entries of `tensors` are ignored, and input data
 * pointers may be NULL: only shapes, strides and dtypes are read. */
kiln_code kiln_op_infer(const kiln_op* op, const kiln_tensor* const* tensors, int32_t tensor_count,
                        const kiln_value* scalars, int32_t scalar_count, kiln_shape* outputs, int32_t output_count);

/* --- ABI version 5: any registered family by its typed problem --- */

/* The family `family` as JSON: {"name", "version", "plugin", "fields": [{"name", "slot", "type"
 * ("i64" or "f64"), "key", "bucketed", "doc"}], "params": [{"name", "doc", "ints" | "choices"}]};
 * valid for the process's life. NULL (and kiln_last_error set) when no family has that name. */
const char* kiln_family_describe(const char* family);

/* Launches the registered kernel family `family` (built in or from a plugin) on CUDA buffers:
 * fields[i] is the problem field in slot i (kiln_family_describe lists them; i64 fields read
 * .i64, f64 fields read .f64), field_count the family's field count, dtype its element type; the
 * problem's alignment is the smallest of the buffers' address alignments (at most 16 bytes) and
 * `alignment` (pass 16 when row strides are multiples of 16 bytes). The variant is the tuned or
 * heuristic one, as for a typed op. Checks the problem with the family (check_problem) before
 * anything is compiled or launched. */
kiln_code kiln_launch(kiln_runtime* rt, const char* family, int32_t dtype, const kiln_value* fields,
                      int32_t field_count, uint32_t alignment, void* const* buffers, int32_t buffer_count,
                      void* stream);

/* --- ABI version 6: the paged KV cache's host bookkeeping (kiln/kv_cache.h, kiln/radix_cache.h,
 * docs/serving.md) ---
 *
 * Not thread-safe: a manager, its radix caches and its plans are used by one thread at a time
 * (the caller serializes). Errors: KILN_INVALID_ARGUMENT (bad configuration, request id in use,
 * block outside the pool or already free), KILN_NOT_FOUND (unknown or finished request, evicted
 * node), KILN_UNAVAILABLE (not enough free blocks now), KILN_SHAPE_MISMATCH (context past a block
 * table); a failed call changes nothing. */

/* Same values as kiln::KVDType. */
typedef enum kiln_kv_dtype { KILN_KV_F16 = 0, KILN_KV_BF16 = 1, KILN_KV_FP8_E4M3 = 2, KILN_KV_FP8_E5M2 = 3 } kiln_kv_dtype;
/* Same values as kiln::Admission. */
typedef enum kiln_kv_admission { KILN_KV_NOW = 0, KILN_KV_LATER = 1, KILN_KV_NEVER = 2 } kiln_kv_admission;

typedef struct kiln_kv_config {
  int32_t num_blocks;
  int32_t page_size; /* 1, 8, 16, 32, 64 or 128 */
  int32_t dtype;     /* kiln_kv_dtype */
  int32_t num_layers;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t enable_prefix_caching; /* 0 or 1 */
} kiln_kv_config;

/* Same fields as kiln::KVCacheStats. */
typedef struct kiln_kv_stats {
  int64_t num_blocks;
  int64_t free_blocks;
  int64_t cached_free_blocks;
  int64_t used_blocks;
  int64_t cached_blocks;
  int64_t num_requests;
  int64_t prefix_queried_tokens;
  int64_t prefix_hit_tokens;
  int64_t evictions;
  int64_t cow_copies;
  uint64_t bytes_per_block;
} kiln_kv_stats;

typedef struct kiln_kv_manager kiln_kv_manager;
/* Gathers the slots of new tokens and the block copies of a batch (kiln::SlotPlan). */
typedef struct kiln_kv_plan kiln_kv_plan;

kiln_code kiln_kv_manager_create(const kiln_kv_config* config, kiln_kv_manager** out);
void kiln_kv_manager_destroy(kiln_kv_manager* m);
kiln_code kiln_kv_plan_create(kiln_kv_plan** out);
void kiln_kv_plan_destroy(kiln_kv_plan* plan);
void kiln_kv_plan_clear(kiln_kv_plan* plan);
/* The plan's slot mapping (one int64 per token) and copies (src, dst pairs of int32); valid until
 * the plan changes. */
kiln_code kiln_kv_plan_get(const kiln_kv_plan* plan, const int64_t** slots, int64_t* num_slots,
                           const int32_t** copies, int64_t* num_copies);

/* *out: a kiln_kv_admission for num_new_tokens more tokens of request (a new request when not
 * live), or for a new request with this prompt (prefix-cache hits counted); adapter and salt may
 * be NULL. */
kiln_code kiln_kv_can_allocate(kiln_kv_manager* m, int64_t request, int64_t num_new_tokens, int32_t* out);
kiln_code kiln_kv_can_allocate_prompt(kiln_kv_manager* m, const int32_t* tokens, int64_t num_tokens,
                                      const char* adapter, const char* salt, int32_t* out);
/* KVCacheManager::allocate: prefix_blocks may be NULL with num_prefix_blocks 0; *num_cached: the
 * leading tokens already cached (their slots are not in the plan). */
kiln_code kiln_kv_allocate(kiln_kv_manager* m, int64_t request, const int32_t* tokens, int64_t num_tokens,
                           const char* adapter, const char* salt, const int32_t* prefix_blocks,
                           int64_t num_prefix_blocks, kiln_kv_plan* plan, int64_t* num_cached);
kiln_code kiln_kv_append_slots(kiln_kv_manager* m, int64_t request, const int32_t* tokens, int64_t num_tokens,
                               kiln_kv_plan* plan);
kiln_code kiln_kv_fork(kiln_kv_manager* m, int64_t parent, int64_t child);
kiln_code kiln_kv_free(kiln_kv_manager* m, int64_t request);
kiln_code kiln_kv_retain(kiln_kv_manager* m, const int32_t* blocks, int64_t num_blocks);
kiln_code kiln_kv_release(kiln_kv_manager* m, const int32_t* blocks, int64_t num_blocks);
/* The request's block table (valid until the manager changes) and token count. */
kiln_code kiln_kv_block_table(kiln_kv_manager* m, int64_t request, const int32_t** blocks, int64_t* num_blocks,
                              int64_t* num_tokens);
/* One block's reference count, external references and whether it is in the prefix cache. */
kiln_code kiln_kv_block_info(kiln_kv_manager* m, int32_t block, int32_t* ref_count, int32_t* external_refs,
                             int32_t* cached);
kiln_code kiln_kv_get_stats(kiln_kv_manager* m, kiln_kv_stats* out);
/* KILN_INTERNAL naming the first broken invariant (KVCacheManager::check_invariants). */
kiln_code kiln_kv_check(kiln_kv_manager* m);
/* KVCacheManager::validate_block_table: what a paged kernel checks before launch. */
kiln_code kiln_kv_validate_block_table(const int32_t* table, int64_t table_len, int64_t context_len, int32_t num_blocks,
                                       int32_t page_size);

/* --- ABI version 8: swapping (KVCacheManager::enable_swap, swap_out, swap_in; kiln/kv_cache.h) --- */

/* Sets the host pool to num_host_blocks blocks (KILN_INVALID_ARGUMENT while a request is swapped out). */
kiln_code kiln_kv_enable_swap(kiln_kv_manager* m, int32_t num_host_blocks);
/* Moves request to the host pool (swap_out) or back into new device blocks (swap_in). pairs
 * receives (src, dst) block pairs, 2 * capacity int32s: (device, host) for swap_out, (host,
 * device) for swap_in; *num_pairs how many. A capacity below the request's block count is
 * KILN_INVALID_ARGUMENT and changes nothing (kiln_kv_block_table gives the count). */
kiln_code kiln_kv_swap_out(kiln_kv_manager* m, int64_t request, int32_t* pairs, int64_t capacity, int64_t* num_pairs);
kiln_code kiln_kv_swap_in(kiln_kv_manager* m, int64_t request, int32_t* pairs, int64_t capacity, int64_t* num_pairs);
/* *out: a kiln_kv_admission for swap_in of request. */
kiln_code kiln_kv_can_swap_in(kiln_kv_manager* m, int64_t request, int32_t* out);
/* *swapped: 1 when request is swapped out (0 for an unknown request); the host pool's size and free blocks. */
kiln_code kiln_kv_swap_state(kiln_kv_manager* m, int64_t request, int32_t* swapped, int32_t* host_blocks,
                             int32_t* free_host_blocks);

/* The host plan of a paged decode batch (kiln::plan_paged_decode, families/paged_attention/ops.h):
 * seq_lens [batch]; cu_seqlens_q [batch + 1] or NULL (one query per request); block_tables [batch *
 * max_blocks] or NULL (not checked); sm_count 0 for an H100's 132. Writes the values the declared
 * op paged_decode takes (max_seqlen_q, max_seq_len, splits) and the f32 elements its workspace
 * needs. Errors: KILN_SHAPE_MISMATCH (keys past a table, bad offsets), KILN_INVALID_ARGUMENT (a
 * table entry outside the pool, a page size not 1, 8, 16, 32, 64 or 128). */
typedef struct kiln_paged_decode_plan_t {
  int64_t batch, total_q, max_seqlen_q, max_seq_len, splits, workspace_elements;
} kiln_paged_decode_plan_t;
kiln_code kiln_paged_decode_plan(const int32_t* seq_lens, int64_t batch, const int32_t* cu_seqlens_q,
                                 const int32_t* block_tables, int64_t max_blocks, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, int64_t page_size, int64_t num_blocks, int64_t sm_count,
                                 kiln_paged_decode_plan_t* out);
/* The host plan of a cascade decode step (kiln::plan_paged_cascade_decode): the shared prefix's
 * table [shared_blocks] and length, each request's own seq_lens [batch] and block_tables [batch *
 * max_blocks] (or NULL: not checked). Writes the values the declared op paged_cascade_decode takes
 * (max_shared_len, max_seq_len, shared_splits, splits) and its workspace size in f32. Errors as
 * kiln_paged_decode_plan's, for both tables. */
typedef struct kiln_paged_cascade_plan_t {
  int64_t batch, shared_len, max_seq_len, shared_splits, splits, workspace_elements;
} kiln_paged_cascade_plan_t;
kiln_code kiln_paged_cascade_decode_plan(const int32_t* shared_block_table, int64_t shared_blocks, int64_t shared_len,
                                         const int32_t* seq_lens, int64_t batch, const int32_t* block_tables,
                                         int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                         int64_t page_size, int64_t num_blocks, int64_t sm_count,
                                         kiln_paged_cascade_plan_t* out);

/* A radix cache over a manager's blocks (kiln::RadixCache); the manager must outlive it. */
typedef struct kiln_radix kiln_radix;

/* Same fields as kiln::RadixCache::Stats, and reclaimable_blocks(). */
typedef struct kiln_radix_stats {
  int64_t nodes;
  int64_t cached_tokens;
  int64_t cached_blocks;
  int64_t evictable_blocks;
  int64_t protected_blocks;
  int64_t evicted_blocks;
  int64_t reclaimable_blocks;
} kiln_radix_stats;

kiln_code kiln_radix_create(kiln_kv_manager* m, kiln_radix** out);
/* Releases the tree's block references. */
void kiln_radix_destroy(kiln_radix* r);
/* The longest cached prefix: its blocks into blocks_out (capacity >= num_tokens / page_size, or
 * KILN_INVALID_ARGUMENT), their count, and the node ending it. */
kiln_code kiln_radix_match(kiln_radix* r, const int32_t* tokens, int64_t num_tokens, int32_t* blocks_out,
                           int64_t capacity, int64_t* num_blocks, int64_t* node);
kiln_code kiln_radix_insert(kiln_radix* r, const int32_t* tokens, int64_t num_tokens, const int32_t* blocks,
                            int64_t num_blocks, int64_t* node, int64_t* cached_tokens);
kiln_code kiln_radix_lock(kiln_radix* r, int64_t node);
kiln_code kiln_radix_unlock(kiln_radix* r, int64_t node);
/* *freed: the blocks freed in the manager. */
kiln_code kiln_radix_evict(kiln_radix* r, int64_t num_blocks, int64_t* freed);
kiln_code kiln_radix_get_stats(kiln_radix* r, kiln_radix_stats* out);
kiln_code kiln_radix_check(kiln_radix* r);

#ifdef __cplusplus
}
#endif

#endif /* KILN_KILN_H */
