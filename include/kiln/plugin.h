/* kiln's family plugin ABI: kernel families from shared libraries (docs/plugins.md).
 *
 * A plugin is a shared library that exports one C function, KILN_PLUGIN_ENTRY_SYMBOL
 * ("kiln_plugin_entry"), returning a kiln_plugin descriptor: the ABI version it was built for, its
 * name and version, an init/shutdown pair, and its families. Each family is a kiln_family: static
 * data (name, version, parameter schema, problem fields, catalog, template files) plus a vtable
 * of C functions that take the family's context pointer. kiln's built-in families are exported
 * through this same ABI (kiln/plugin_cpp.h) and registered by the same loader.
 *
 * Crossing the boundary: only C types. No C++ object, no exception and no allocator crosses it.
 *  - Strings are NUL-terminated UTF-8. Template sources also carry their size.
 *  - Data kiln passes in (params, problems, buffers) is valid for the call only.
 *  - Descriptor data (kiln_plugin, kiln_family and everything they point to) is plugin-owned and
 *    must stay valid and unchanged from a successful init until shutdown (kiln never unloads a
 *    plugin it has registered, so in practice: for the process's lifetime).
 *  - Results with variable size (render, heuristic, tuning space, buffers, signature, benchmark
 *    problems) point into plugin-owned storage named by their `owner` field; kiln copies what it
 *    needs and then calls vtable->release(context, owner) exactly once per successful call. A
 *    failed call leaves nothing to release.
 *  - Fixed-size results (geometry, a problem, the kernel argument block) go into caller-supplied
 *    structs.
 *  - Errors: every function that can fail returns a kiln_code (KILN_OK is 0) and, on failure,
 *    writes a message into the caller-supplied kiln_plugin_error (kiln_plugin_fail does both).
 *  - Variants: validated parameters are bound once (vtable->bind) to a plugin-owned handle that
 *    the launch-path calls take, so a launch never re-parses parameters. kiln unbinds each handle
 *    once, when it no longer needs it.
 *  - Every function may be called from several threads at once; the plugin synchronizes what it
 *    shares.
 *
 * Versioning: KILN_PLUGIN_API_VERSION changes when an existing struct field, function signature or
 * meaning changes; kiln loads only plugins built for the version it speaks and skips others with a
 * log line. Fields may be appended to the structs that carry `struct_size` without a version
 * change: a host reads an appended field only when struct_size says the plugin provides it, and a
 * plugin built against a newer header (a larger struct_size) still loads in an older host.
 */
#ifndef KILN_PLUGIN_H
#define KILN_PLUGIN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kiln/kiln.h" /* kiln_code, kiln_dtype */

#ifdef __cplusplus
extern "C" {
#define KILN_PLUGIN_ALIGN16 alignas(16)
#define KILN_PLUGIN_ALIGN64 alignas(64)
#else
#define KILN_PLUGIN_ALIGN16 _Alignas(16)
#define KILN_PLUGIN_ALIGN64 _Alignas(64)
#endif

#define KILN_PLUGIN_API_VERSION 3
#define KILN_PLUGIN_ENTRY_SYMBOL "kiln_plugin_entry"
#define KILN_PLUGIN_MAX_FIELDS 24
#define KILN_PLUGIN_ERROR_CAPACITY 1024

/* An error message, written by the plugin into storage kiln supplies. */
typedef struct kiln_plugin_error {
  char message[KILN_PLUGIN_ERROR_CAPACITY];
} kiln_plugin_error;

/* Writes `message` (truncated to fit) into err and returns code. */
static inline int kiln_plugin_fail(kiln_plugin_error* err, int code, const char* message) {
  if (err) {
    size_t n = message ? strlen(message) : 0;
    if (n >= KILN_PLUGIN_ERROR_CAPACITY) n = KILN_PLUGIN_ERROR_CAPACITY - 1;
    if (n) memcpy(err->message, message, n);
    err->message[n] = '\0';
  }
  return code;
}

/* One parameter of a variant: an integer (str == NULL) or a string. */
typedef struct kiln_param {
  const char* name;
  const char* str;
  int64_t int_value;
} kiln_param;

/* A variant's parameters, sorted by name, each name once. */
typedef struct kiln_params {
  const kiln_param* items;
  uint32_t count;
} kiln_params;

/* One schema entry: exactly one of ints / choices is non-empty. Every value a parameter may take
 * is listed, so no caller-chosen text reaches a template. Names match [a-z][a-z0-9_]*, strings
 * [A-Za-z0-9_.]+. */
typedef struct kiln_param_def {
  const char* name;
  const char* doc;
  const int64_t* ints;
  uint32_t int_count;
  const char* const* choices;
  uint32_t choice_count;
} kiln_param_def;

/* A header NVRTC may include as #include "path" (relative, '/'-separated, no ".."). kiln's own
 * templates (common/dtype.cuh, common/reduce.cuh, ...) are available too. */
typedef struct kiln_template_file {
  const char* path;
  const char* source;
  size_t size;
} kiln_template_file;

/* One field of a problem: a 64-bit integer or a double, as the family's field list types it. */
typedef union kiln_problem_value {
  int64_t i;
  double f;
} kiln_problem_value;

/* kiln::Problem: the family's problem fields (kiln_family.fields says which slot holds what), the
 * element type, the smallest byte alignment of the buffers' addresses and row strides, and the
 * device the problem runs on (filled by kiln from its device cache; 0 when unknown). The same
 * layout as kiln::Problem (checked in kiln/problem.h), so a launch passes the problem without
 * copying it; slots no field names are undefined on input and ignored on output. */
typedef struct kiln_problem {
  uint8_t dtype;     /* kiln_dtype */
  uint8_t cc;        /* compute capability, major * 10 + minor */
  uint16_t sm_count; /* multiprocessors */
  uint32_t alignment;
  kiln_problem_value fields[KILN_PLUGIN_MAX_FIELDS];
} kiln_problem;

typedef enum kiln_field_type { KILN_FIELD_I64 = 0, KILN_FIELD_F64 = 1 } kiln_field_type;

/* kiln_problem_field.flags. A key field may pick a different variant (the heuristic, the launch
 * geometry and the tuning signature read it); every other field is a per-call value that only
 * check_problem, pack_args, buffers and cpu_reference read, so problems that differ only in such
 * values share a variant and a tuning result. At most one field is bucketed: an i64 key that
 * tuning signatures round up to a power of two (the token or row count). */
#define KILN_FIELD_KEY 1u
#define KILN_FIELD_BUCKETED 2u

/* One named field of a family's problem. Slots are 0..field_count-1, each named once. */
typedef struct kiln_problem_field {
  const char* name; /* [a-z][a-z0-9_]* */
  const char* doc;
  uint32_t slot;    /* index into kiln_problem.fields */
  uint8_t type;     /* kiln_field_type */
  uint8_t flags;    /* KILN_FIELD_* bits; BUCKETED implies KEY */
  uint16_t reserved;
} kiln_problem_field;

typedef enum kiln_buffer_role { KILN_BUFFER_INPUT = 0, KILN_BUFFER_OUTPUT = 1 } kiln_buffer_role;

typedef struct kiln_buffer_spec {
  const char* name;
  int32_t role;  /* kiln_buffer_role */
  int32_t dtype; /* kiln_dtype */
  int64_t elements;
  int64_t index_bound; /* integer inputs that index something: values in [0, index_bound); else 0 */
} kiln_buffer_spec;

typedef struct kiln_geometry {
  uint32_t grid[3];
  uint32_t block[3];
  uint32_t shared_bytes;
} kiln_geometry;

/* A 2-D tiled tensor map (CUtensorMap, for sm_90's bulk tensor copy engine) as plain data: a
 * family asks for one in pack_args without touching CUDA, and kiln encodes it into its argument
 * slot before the launch. The map views `rows` rows of `row_bytes` bytes (a multiple of 16; rows
 * `row_bytes` apart) as bytes, copied in boxes of `box_rows` x 128 bytes with the 128-byte
 * swizzle; reads past either edge give zeros. With `f32_columns` > 0 (at most 32) it views them
 * as f32 elements instead, in boxes of `box_rows` x `f32_columns` with the same swizzle: tiles
 * that bulk reductions (cp.reduce.async.bulk.tensor ... .add) add to f32 memory. */
typedef struct kiln_tensor_map_request {
  const void* base;
  uint64_t row_bytes;
  uint64_t rows;
  uint32_t box_rows;
  uint32_t f32_columns; /* 0: the byte view */
} kiln_tensor_map_request;

/* The kernel's argument block: values copied into aligned slots of `storage`, `slots` pointing at
 * them (what cuLaunchKernel takes), and the tensor maps kiln encodes into their (128-byte,
 * 64-byte aligned) slots before the launch. Fill it with kiln_arg_pack_add and
 * kiln_arg_pack_add_tensor_map only. */
#define KILN_ARG_PACK_CAPACITY 768
#define KILN_ARG_PACK_MAX_ARGS 24
#define KILN_ARG_PACK_MAX_TENSOR_MAPS 4
#define KILN_TENSOR_MAP_BYTES 128
typedef struct kiln_arg_pack {
  KILN_PLUGIN_ALIGN64 unsigned char storage[KILN_ARG_PACK_CAPACITY];
  void* slots[KILN_ARG_PACK_MAX_ARGS];
  uint32_t used;
  uint32_t count;
  uint32_t overflow; /* set when an argument did not fit; kiln then refuses the launch */
  uint32_t map_count;
  void* map_slots[KILN_ARG_PACK_MAX_TENSOR_MAPS];
  kiln_tensor_map_request maps[KILN_ARG_PACK_MAX_TENSOR_MAPS];
} kiln_arg_pack;

/* Reserves `size` bytes at alignment `align` as the next argument; NULL (and overflow) when full. */
static inline unsigned char* kiln_arg_pack_reserve(kiln_arg_pack* pack, size_t size, size_t align) {
  size_t at = (pack->used + align - 1) / align * align;
  if (at + size > KILN_ARG_PACK_CAPACITY || pack->count == KILN_ARG_PACK_MAX_ARGS) {
    pack->overflow = 1;
    return NULL;
  }
  pack->slots[pack->count++] = pack->storage + at;
  pack->used = (uint32_t)(at + size);
  return pack->storage + at;
}

/* Appends one argument of `size` bytes (1..16) with alignment `align` (a power of two <= 16). */
static inline void kiln_arg_pack_add(kiln_arg_pack* pack, const void* value, size_t size, size_t align) {
  unsigned char* slot;
  if (size == 0 || size > 16 || align == 0 || align > 16 || (align & (align - 1))) {
    pack->overflow = 1;
    return;
  }
  slot = kiln_arg_pack_reserve(pack, size, align);
  if (slot) memcpy(slot, value, size);
}

/* Appends a tensor map argument (a __grid_constant__ const CUtensorMap parameter), encoded by kiln
 * from `request` before the launch. */
static inline void kiln_arg_pack_add_tensor_map(kiln_arg_pack* pack, const kiln_tensor_map_request* request) {
  unsigned char* slot;
  if (pack->map_count == KILN_ARG_PACK_MAX_TENSOR_MAPS) {
    pack->overflow = 1;
    return;
  }
  slot = kiln_arg_pack_reserve(pack, KILN_TENSOR_MAP_BYTES, 64);
  if (!slot) return;
  memset(slot, 0, KILN_TENSOR_MAP_BYTES);
  pack->map_slots[pack->map_count] = slot;
  pack->maps[pack->map_count++] = *request;
}

/* Plugin-owned results; see "Crossing the boundary" above for `owner`. */
typedef struct kiln_rendered {
  const char* source;          /* the translation unit; includes templates with #include "..." */
  const char* name_expression; /* the __global__ function to instantiate, e.g. "ns::kern<float, 256>" */
  const char* const* options;  /* extra NVRTC options: never -arch, never a path */
  uint32_t option_count;
  void* owner;
} kiln_rendered;

typedef struct kiln_params_list {
  const kiln_params* items;
  uint32_t count;
  void* owner;
} kiln_params_list;

typedef struct kiln_buffer_list {
  const kiln_buffer_spec* items;
  uint32_t count;
  void* owner;
} kiln_buffer_list;

typedef struct kiln_problem_list {
  const kiln_problem* items;
  uint32_t count;
  void* owner;
} kiln_problem_list;

typedef struct kiln_text {
  const char* text;
  void* owner;
} kiln_text;

/* A GPU architecture kiln compiles for, taken apart: "sm_90a" is {90, 'a'}, "sm_80" {80, 0}. */
typedef struct kiln_arch {
  uint32_t capability; /* compute capability as major * 10 + minor */
  uint32_t suffix;     /* 'a' (arch-specific features, e.g. sm_90a's wgmma), 'f' (family-specific) or 0 */
} kiln_arch;

/* What a family does; `ctx` is kiln_family.context. Functions marked optional may be NULL: kiln
 * then uses the default documented for kiln::Family (include/kiln/family.h). The rest are
 * required; a family lacking one is skipped at load. */
typedef struct kiln_family_vtable {
  uint32_t struct_size; /* sizeof(kiln_family_vtable) as the plugin was built */

  /* Cross-parameter rules. kiln has already checked the params against the schema (every
   * parameter present, each value in its allowed set). */
  int (*validate)(void* ctx, const kiln_params* params, kiln_plugin_error* err);
  /* Source, name expression and options for validated params. */
  int (*render)(void* ctx, const kiln_params* params, kiln_rendered* out, kiln_plugin_error* err);
  /* A handle for validated params that the calls below take; freed with unbind. */
  int (*bind)(void* ctx, const kiln_params* params, void** variant, kiln_plugin_error* err);
  void (*unbind)(void* ctx, void* variant);

  /* Is the problem well formed, and can this variant run it? */
  int (*check_problem)(void* ctx, const void* variant, const kiln_problem* problem, kiln_plugin_error* err);
  int (*geometry)(void* ctx, const void* variant, const kiln_problem* problem, kiln_geometry* out,
                  kiln_plugin_error* err);
  /* Buffers in kernel-argument order. */
  int (*buffers)(void* ctx, const void* variant, const kiln_problem* problem, kiln_buffer_list* out,
                 kiln_plugin_error* err);
  /* Appends the kernel's arguments (buffers, then sizes and scalars). On the launch path: must not
   * block, and should not allocate. */
  int (*pack_args)(void* ctx, const void* variant, const kiln_problem* problem, void* const* buffers,
                   uint32_t buffer_count, kiln_arg_pack* out, kiln_plugin_error* err);
  /* The CPU reference on host buffers in the order of `buffers` (fp64 accumulation advised). */
  int (*cpu_reference)(void* ctx, const void* variant, const kiln_problem* problem, void* const* buffers,
                       uint32_t buffer_count, kiln_plugin_error* err);

  /* The default variant for a problem (a list of exactly one), and the candidates to time. */
  int (*heuristic)(void* ctx, const kiln_problem* problem, kiln_params_list* out, kiln_plugin_error* err);
  int (*tuning_space)(void* ctx, const kiln_problem* problem, kiln_params_list* out, kiln_plugin_error* err);

  /* Optional tuning hooks (kiln::Family's defaults otherwise). */
  int (*signature)(void* ctx, const kiln_problem* problem, kiln_text* out, kiln_plugin_error* err);
  int (*tuning_problem)(void* ctx, const kiln_problem* problem, kiln_problem* out, kiln_plugin_error* err);
  /* `shape`: named sizes (str NULL, int_value the size), in the order given by the user. */
  int (*problem_from_shape)(void* ctx, int32_t dtype, const kiln_params* shape, kiln_problem* out,
                            kiln_plugin_error* err);
  int (*benchmark_problems)(void* ctx, int32_t dtype, kiln_problem_list* out, kiln_plugin_error* err);

  /* Frees the storage behind a result's `owner`. */
  void (*release)(void* ctx, void* owner);

  /* Optional: whether the validated params' variant can run on a device of `arch` (*runs = 1) or
   * not (*runs = 0); kiln compiles a family's catalog for an arch only where it does (kiln
   * prewarm). NULL: every variant runs on every arch. */
  int (*runs_on)(void* ctx, const kiln_params* params, const kiln_arch* arch, int32_t* runs,
                 kiln_plugin_error* err);
} kiln_family_vtable;

/* The smallest struct_size kiln accepts: the vtable as this API version first shipped it. */
#define KILN_FAMILY_VTABLE_MIN_STRUCT_SIZE sizeof(kiln_family_vtable)

typedef struct kiln_family {
  uint32_t struct_size; /* sizeof(kiln_family) as the plugin was built */
  const char* name;     /* [a-z][a-z0-9_]*: what specs name ("softcap(...)") */
  int32_t version;      /* bump when generated code changes meaning; part of every cache key */
  const kiln_param_def* params;
  uint32_t param_count;
  const kiln_problem_field* fields; /* the problem's fields (at most KILN_PLUGIN_MAX_FIELDS) */
  uint32_t field_count;
  const kiln_params* catalog; /* every variant worth compiling ahead of time (kiln prewarm) */
  uint32_t catalog_count;
  const kiln_template_file* templates; /* the headers the family's sources include */
  uint32_t template_count;
  const kiln_family_vtable* vtable;
  void* context;
  uint32_t flags; /* KILN_FAMILY_* bits */
} kiln_family;

/* kiln_family.flags: every kernel of the family executes griddepcontrol.wait before it touches
 * memory that the kernel before it in the stream may write or read, so kiln may launch it as a
 * programmatic dependent of that kernel on sm_90 and later (Family::programmatic_launch). */
#define KILN_FAMILY_PROGRAMMATIC_LAUNCH 1u
/* The smallest struct_size kiln accepts: kiln_family as this API version first shipped it. */
#define KILN_FAMILY_MIN_STRUCT_SIZE sizeof(kiln_family)

/* What kiln tells a plugin at init. */
typedef struct kiln_host {
  uint32_t api_version; /* KILN_PLUGIN_API_VERSION of the host */
  uint32_t struct_size;
  const char* kiln_version; /* "0.1.0" */
} kiln_host;

typedef struct kiln_plugin {
  uint32_t api_version; /* KILN_PLUGIN_API_VERSION the plugin was built with: checked first */
  uint32_t struct_size; /* sizeof(kiln_plugin) as the plugin was built */
  const char* name;     /* the plugin's name, e.g. "acme-norms" */
  const char* version;  /* its version, e.g. "1.2.0"; part of its kernels' cache keys */
  void* context;
  /* Called once before `families` is read; NULL when there is nothing to set up. A failure
   * skips the plugin. */
  int (*init)(void* context, const kiln_host* host, kiln_plugin_error* err);
  /* Called when a plugin that initialized is skipped after all (its descriptor failed
   * validation, say); NULL for none. */
  void (*shutdown)(void* context);
  const kiln_family* families;
  uint32_t family_count;
} kiln_plugin;

/* The one symbol a plugin exports. Called once per process, before anything else. */
typedef const kiln_plugin* (*kiln_plugin_entry_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* KILN_PLUGIN_H */
