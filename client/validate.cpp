#include "client/validate.h"

#include <algorithm>
#include <cstring>

#include "families/rmsnorm_bwd/rmsnorm_bwd.h"
#include "jit/driver.h"

namespace kiln::client {

Status fill(const TensorView& t, DeviceKind where, Stream stream, std::uint32_t word) {
  const std::size_t n = std::size_t(t.numel()), bytes = n * dtype_size(t.dtype);
  if (bytes == 0) return {};
  if (word != 0 && dtype_size(t.dtype) != 4) return internal_error("fill: a 32-bit word needs a 4-byte dtype");
  if (where == DeviceKind::cpu) {
    if (word == 0) std::memset(t.data, 0, bytes);
    else std::fill_n(static_cast<std::uint32_t*>(t.data), n, word);
    return {};
  }
  KILN_ASSIGN_OR_RETURN(const jit::Driver* d, jit::Driver::get());
  const auto ptr = reinterpret_cast<CUdeviceptr>(t.data);
  const auto s = static_cast<CUstream>(stream);
  if (word == 0) return d->check(d->memset_d8_async(ptr, 0, bytes, s), "cuMemsetD8Async");
  return d->check(d->memset_d32_async(ptr, word, n, s), "cuMemsetD32Async");
}

Status check_view(const TensorView& t, const char* name) {
  if (!t.data) return invalid_argument(std::string(name) + " has a null data pointer");
  if (t.rank < 1 || t.rank > TensorView::k_max_rank)
    return shape_mismatch(std::string(name) + " has rank " + std::to_string(t.rank) + " (expected 1..8)");
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] < 0) return shape_mismatch(std::string(name) + " has a negative size");
  return {};
}

Status check_float_dtype(const TensorView& t, const char* name) {
  if (!is_floating(t.dtype))
    return unsupported_dtype(std::string(name) + " has dtype " + dtype_name(t.dtype) +
                             "; expected one of f32, f16, bf16");
  return {};
}

Status check_device(const TensorView& t, const char* name, DeviceKind expected) {
  if (t.device.kind != expected)
    return device_error(std::string(name) + " is on the " + (t.device.kind == DeviceKind::cuda ? "GPU" : "CPU") +
                        " but the other tensors are on the " + (expected == DeviceKind::cuda ? "GPU" : "CPU"));
  if (expected != DeviceKind::cuda) return {};
  auto d = jit::Driver::get();
  if (!d.ok()) return Status(Code::device_error, std::string(name) + " is a CUDA tensor but " + d.status().message());
  // One driver call per tensor: this runs on every op call.
  unsigned int mem_type = 0;
  int ordinal = -1;
  CUpointer_attribute attrs[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  void* values[2] = {&mem_type, &ordinal};
  CUresult rc = (*d)->pointer_get_attributes(2, attrs, values, reinterpret_cast<CUdeviceptr>(t.data));
  if (rc != CUDA_SUCCESS || (mem_type != CU_MEMORYTYPE_DEVICE && mem_type != CU_MEMORYTYPE_UNIFIED))
    return device_error(std::string(name) + " is labelled as a CUDA tensor but its pointer is not device memory");
  if (ordinal != t.device.index)
    return device_error(std::string(name) + " lives on cuda:" + std::to_string(ordinal) + ", not cuda:" +
                        std::to_string(t.device.index));
  return {};
}

Result<RowView> as_rows(const TensorView& t, const char* name) {
  RowView v;
  v.cols = t.shape[t.rank - 1];
  if (t.strides[t.rank - 1] != 1 && v.cols > 1)
    return shape_mismatch(std::string(name) + ": the last dimension must be contiguous (stride 1)");
  v.rows = 1;
  for (int i = 0; i < t.rank - 1; ++i) v.rows *= t.shape[i];
  if (t.rank == 1) {
    v.row_stride = v.cols;
    return v;
  }
  v.row_stride = t.strides[t.rank - 2];
  // Leading dimensions must collapse into one evenly strided row index.
  for (int i = 0; i < t.rank - 2; ++i)
    if (t.shape[i] > 1 && t.strides[i] != t.strides[i + 1] * t.shape[i + 1])
      return shape_mismatch(std::string(name) + ": leading dimensions cannot be viewed as evenly strided rows");
  if (v.rows <= 1) v.row_stride = std::max<std::int64_t>(v.row_stride, v.cols);
  return v;
}

std::uint32_t common_alignment(std::initializer_list<std::uintptr_t> addresses,
                               std::initializer_list<std::int64_t> byte_strides) {
  std::uint64_t bits = 16;
  for (auto a : addresses) bits |= a;
  for (auto s : byte_strides) bits |= std::uint64_t(s);
  return std::uint32_t(bits & (~bits + 1));
}

int resident_clusters(const Kernel& kernel, unsigned block, unsigned shared_bytes, int cluster) {
  auto d = jit::Driver::get();
  if (!d.ok() || !(*d)->occupancy_max_active_clusters || !kernel.function || cluster < 1) return 0;
  CUlaunchConfig config{};
  config.gridDimX = unsigned(cluster);
  config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = block;
  config.blockDimY = config.blockDimZ = 1;
  config.sharedMemBytes = shared_bytes;
  // The kernel's compile-time cluster shape applies: the config names none.
  int clusters = 0;
  if ((*d)->occupancy_max_active_clusters(&clusters, static_cast<CUfunction>(kernel.function), &config) !=
      CUDA_SUCCESS)
    return 0;
  return clusters;
}

Status run_family(const Family* family, const char* family_name, const Problem& p, std::span<void* const> buffers,
                  DeviceKind where, Stream stream, Runtime* runtime) {
  if (!family) return internal_error(std::string("the ") + family_name + " family is not registered");
  if (where == DeviceKind::cpu) {
    const Params params = family->heuristic(p);
    KILN_TRY(family->check_problem(params, p));
    return family->cpu_reference(params, p, buffers);
  }
  if (!runtime) {
    KILN_ASSIGN_OR_RETURN(runtime, Runtime::shared());
  }
  return runtime->run(*family, p, buffers, stream);
}

Result<int> rmsnorm_bwd_resident_clusters(Runtime& runtime, const Family& bwd, const Params& params, const Problem& p) {
  const auto choice = families::rmsnorm_bwd_choice(params);
  if (choice.stages == 0 || choice.cluster <= 1) return 0;
  KILN_ASSIGN_OR_RETURN(const Kernel* k, runtime.kernel(KernelSpec{std::string(bwd.name()), params}));
  const LaunchGeometry g = bwd.geometry(params, p);
  return resident_clusters(*k, g.block.x, g.shared_bytes, choice.cluster);
}

}  // namespace kiln::client
