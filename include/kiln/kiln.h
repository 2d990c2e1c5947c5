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
 * untyped dims and scalars, is gone.
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

#define KILN_ABI_VERSION 5

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

#ifdef __cplusplus
}
#endif

#endif /* KILN_KILN_H */
