// The CUDA driver API, opened with dlopen so that binaries start on machines without a driver.
//
// Search order: $KILN_CUDA_DRIVER_PATH, then libcuda.so.1 on the loader path, then
// /usr/lib/libcuda.so.1 and the usual distribution folders. Missing driver: Code::unavailable,
// naming what was tried. Entry points are the versioned symbols that cuda.h maps names to.
#pragma once

#include <cuda.h>

#include <string>

#include "kiln/family.h"
#include "kiln/status.h"

namespace kiln::jit {

#define KILN_CU_STR_INNER(x) #x
#define KILN_CU_STR(x) KILN_CU_STR_INNER(x)

// X(field name, cuda.h function name)
#define KILN_CUDA_DRIVER_FUNCTIONS(X)                      \
  X(init, cuInit)                                          \
  X(driver_get_version, cuDriverGetVersion)                \
  X(get_error_string, cuGetErrorString)                    \
  X(device_get, cuDeviceGet)                               \
  X(device_get_count, cuDeviceGetCount)                    \
  X(device_get_attribute, cuDeviceGetAttribute)            \
  X(device_get_name, cuDeviceGetName)                      \
  X(primary_ctx_retain, cuDevicePrimaryCtxRetain)          \
  X(ctx_get_current, cuCtxGetCurrent)                      \
  X(ctx_set_current, cuCtxSetCurrent)                      \
  X(ctx_get_device, cuCtxGetDevice)                        \
  X(ctx_synchronize, cuCtxSynchronize)                     \
  X(module_load_data, cuModuleLoadData)                    \
  X(module_unload, cuModuleUnload)                         \
  X(module_get_function, cuModuleGetFunction)              \
  X(launch_kernel, cuLaunchKernel)                         \
  X(mem_alloc, cuMemAlloc)                                 \
  X(mem_free, cuMemFree)                                   \
  X(memcpy_htod, cuMemcpyHtoD)                             \
  X(memcpy_dtoh, cuMemcpyDtoH)                             \
  X(memcpy_dtod, cuMemcpyDtoD)                             \
  X(memcpy_dtod_async, cuMemcpyDtoDAsync)                  \
  X(memset_d8, cuMemsetD8)                                 \
  X(memset_d8_async, cuMemsetD8Async)                      \
  X(memset_d32_async, cuMemsetD32Async)                    \
  X(mem_host_alloc, cuMemHostAlloc)                        \
  X(mem_free_host, cuMemFreeHost)                          \
  X(pointer_get_attributes, cuPointerGetAttributes)        \
  X(stream_synchronize, cuStreamSynchronize)               \
  X(stream_create, cuStreamCreate)                         \
  X(stream_destroy, cuStreamDestroy)                       \
  X(event_create, cuEventCreate)                           \
  X(event_destroy, cuEventDestroy)                         \
  X(event_record, cuEventRecord)                           \
  X(event_query, cuEventQuery)                             \
  X(stream_wait_event, cuStreamWaitEvent)                  \
  X(event_synchronize, cuEventSynchronize)                 \
  X(event_elapsed_time, cuEventElapsedTime)                \
  X(func_get_attribute, cuFuncGetAttribute)                \
  X(func_set_attribute, cuFuncSetAttribute)

// Entry points that only some paths use, null when the driver lacks them: cuTensorMapEncodeTiled
// came with CUDA 12, and only the sm_90a GEMM path (which needs such a driver anyway) encodes
// tensor maps, so an older driver still runs everything else.
// cuLaunchKernelEx (CUDA 12) launches with attributes: programmatic dependent launches
// (Family::programmatic_launch) use it, and fall back to cuLaunchKernel without it.
// cuOccupancyMaxActiveClusters (CUDA 12): how many clusters of a kernel run at once, which sizes
// the clustered RMSNorm backward's slabs; without it the op assumes SMs / cluster size.
// cuStreamIsCapturing, cuMemAllocAsync, cuMemFreeAsync: a workspace the caller did not pass
// (client/workspace.h) is the graph's own memory while a stream is being captured into a CUDA
// graph.
#define KILN_CUDA_DRIVER_OPTIONAL_FUNCTIONS(X)                  \
  X(tensor_map_encode_tiled, cuTensorMapEncodeTiled)            \
  X(launch_kernel_ex, cuLaunchKernelEx)                         \
  X(occupancy_max_active_clusters, cuOccupancyMaxActiveClusters)  \
  X(stream_is_capturing, cuStreamIsCapturing)                   \
  X(mem_alloc_async, cuMemAllocAsync)                           \
  X(mem_free_async, cuMemFreeAsync)

struct Driver {
#define KILN_CU_FIELD(field, fn) decltype(&::fn) field = nullptr;
  KILN_CUDA_DRIVER_FUNCTIONS(KILN_CU_FIELD)
  KILN_CUDA_DRIVER_OPTIONAL_FUNCTIONS(KILN_CU_FIELD)
#undef KILN_CU_FIELD

  // Loads libcuda and calls cuInit(0) once. Thread-safe.
  static Result<const Driver*> get();

  // ok, or Code::driver_error naming `what` and the driver's message.
  Status check(CUresult rc, const char* what) const;
};

// Makes a context current on the calling thread when none is (the device's primary context), and
// returns it.
Result<CUcontext> current_context(int device_ordinal = 0);

// Lets `fn` (loaded in the current context) take as much dynamic shared memory as the device
// grants one block. Families size it per problem (LaunchGeometry::shared_bytes), and above 48 KiB
// the driver refuses a launch without this opt-in; every loader calls it once per function.
Status allow_dynamic_smem(CUfunction fn);

// Encodes every tensor map `args` holds (family.h, TensorMapRequest) into its slot. Every launcher
// calls it between pack_args and cuLaunchKernel; without maps it costs nothing.
Status encode_tensor_maps(ArgPack& args);

}  // namespace kiln::jit
