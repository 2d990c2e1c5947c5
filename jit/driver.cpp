#include "jit/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "jit/device_info.h"

namespace kiln::jit {

Result<const Driver*> Driver::get() {
  static std::once_flag once;
  static Driver* instance = nullptr;
  static Status failure;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    if (const char* p = std::getenv("KILN_CUDA_DRIVER_PATH"); p && *p) candidates.push_back(p);
    for (const char* c : {"libcuda.so.1", "/usr/lib/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                          "/usr/lib64/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1"})
      candidates.push_back(c);
    void* lib = nullptr;
    std::string tried;
    for (const auto& c : candidates) {
      lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib) break;
      tried += "  tried " + c + ": " + dlerror() + "\n";
    }
    if (!lib) {
      failure = unavailable(
          "the CUDA driver (libcuda.so.1) could not be loaded: no NVIDIA driver on this machine? Set "
          "KILN_CUDA_DRIVER_PATH to the library file if it is installed somewhere unusual",
          tried);
      return;
    }
    auto* d = new Driver;
    std::string missing;
#define KILN_CU_LOAD(field, fn)                                                  \
  d->field = reinterpret_cast<decltype(d->field)>(dlsym(lib, KILN_CU_STR(fn)));  \
  if (!d->field) missing += std::string(" ") + KILN_CU_STR(fn);
    KILN_CUDA_DRIVER_FUNCTIONS(KILN_CU_LOAD)
#undef KILN_CU_LOAD
#define KILN_CU_LOAD_OPTIONAL(field, fn) d->field = reinterpret_cast<decltype(d->field)>(dlsym(lib, KILN_CU_STR(fn)));
    KILN_CUDA_DRIVER_OPTIONAL_FUNCTIONS(KILN_CU_LOAD_OPTIONAL)
#undef KILN_CU_LOAD_OPTIONAL
    if (!missing.empty()) {
      failure = unavailable("the CUDA driver lacks required entry points (driver too old?):" + missing);
      delete d;
      return;
    }
    CUresult rc = d->init(0);
    if (rc != CUDA_SUCCESS) {
      failure = d->check(rc, "cuInit");
      failure = Status(Code::unavailable, "the CUDA driver failed to initialize (no usable GPU?)", failure.message());
      delete d;
      return;
    }
    instance = d;
  });
  if (!instance) return failure;
  return static_cast<const Driver*>(instance);
}

Status Driver::check(CUresult rc, const char* what) const {
  if (rc == CUDA_SUCCESS) return {};
  const char* msg = nullptr;
  if (get_error_string) get_error_string(rc, &msg);
  return Status(Code::driver_error, std::string(what) + " failed: " + (msg ? msg : "unknown error") + " (CUresult " +
                                        std::to_string(int(rc)) + ")");
}

Result<CUcontext> current_context(int device_ordinal) {
  KILN_ASSIGN_OR_RETURN(const Driver* d, Driver::get());
  CUcontext ctx = nullptr;
  KILN_TRY(d->check(d->ctx_get_current(&ctx), "cuCtxGetCurrent"));
  if (ctx) return ctx;
  CUdevice dev;
  KILN_TRY(d->check(d->device_get(&dev, device_ordinal), "cuDeviceGet"));
  KILN_TRY(d->check(d->primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain"));
  KILN_TRY(d->check(d->ctx_set_current(ctx), "cuCtxSetCurrent"));
  return ctx;
}

Status allow_dynamic_smem(CUfunction fn) {
  KILN_ASSIGN_OR_RETURN(const Driver* d, Driver::get());
  CUdevice dev;
  KILN_TRY(d->check(d->ctx_get_device(&dev), "cuCtxGetDevice"));
  KILN_ASSIGN_OR_RETURN(const DeviceInfo* info, device_info(int(dev)));
  const int optin = info->max_shared_optin;
  int static_bytes = 0;
  KILN_TRY(d->check(d->func_get_attribute(&static_bytes, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn), "cuFuncGetAttribute"));
  if (optin - static_bytes <= 48 * 1024) return {};
  return d->check(d->func_set_attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - static_bytes),
                  "cuFuncSetAttribute");
}

Status encode_tensor_maps(ArgPack& args) {
  if (args.tensor_maps() == 0) return {};
  KILN_ASSIGN_OR_RETURN(const Driver* d, Driver::get());
  if (!d->tensor_map_encode_tiled)
    return unavailable("this CUDA driver has no cuTensorMapEncodeTiled (it is older than CUDA 12), which the kernel's "
                       "tensor maps need");
  for (std::size_t i = 0; i < args.tensor_maps(); ++i) {
    const TensorMapRequest& r = args.tensor_map_request(i);
    // Bytes in 128-byte-wide boxes, or f32 elements in boxes f32_columns wide; 128-byte swizzle.
    const bool f32 = r.f32_columns > 0;
    if (f32 && r.f32_columns > 32)
      return invalid_argument("a tensor map's f32 boxes are at most 32 columns (128 bytes) wide");
    const cuuint64_t dims[2] = {f32 ? r.row_bytes / 4 : r.row_bytes, r.rows};
    const cuuint64_t strides[1] = {r.row_bytes};
    const cuuint32_t box[2] = {f32 ? r.f32_columns : 128u, r.box_rows};
    const cuuint32_t element_strides[2] = {1, 1};
    KILN_TRY(d->check(
        d->tensor_map_encode_tiled(static_cast<CUtensorMap*>(args.tensor_map_slot(i)),
                                   f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
                                   const_cast<void*>(r.base), dims, strides, box, element_strides,
                                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        "cuTensorMapEncodeTiled"));
  }
  return {};
}

}  // namespace kiln::jit
