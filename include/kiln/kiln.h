/* kiln's C ABI: the client calls for FFI users (Python, Rust, ...).
 *
 * Every function returns a kiln_code (0 is success). On failure, kiln_last_error() returns the
 * message for the calling thread until its next kiln call. No C++ exception crosses this boundary.
 */
#ifndef KILN_KILN_H
#define KILN_KILN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_ABI_VERSION 1

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

/* rt may be NULL for the process-wide runtime. stream is a CUstream (NULL: default stream). */
kiln_code kiln_rms_norm(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* weight,
                        const kiln_tensor* y, double eps, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* KILN_KILN_H */
