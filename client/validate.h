// Tensor checks shared by the typed ops. Each returns the seed's error kinds (device_error,
// shape_mismatch, unsupported_dtype, invalid_argument) before anything is compiled or launched.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "kiln/runtime.h"
#include "kiln/status.h"
#include "kiln/types.h"

namespace kiln::client {

// Non-null data, rank in 1..8, non-negative sizes.
Status check_view(const TensorView& t, const char* name);
// Floating dtype (f32, f16, bf16).
Status check_float_dtype(const TensorView& t, const char* name);
// Every tensor is on `device` kind. For CUDA tensors, asks the driver that the pointer is device
// memory (a host pointer labelled CUDA is a device_error) on the claimed device.
Status check_device(const TensorView& t, const char* name, DeviceKind expected);

// A tensor seen as rows x cols: last dimension contiguous, leading dimensions collapsible into one
// evenly strided row index.
struct RowView {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;  // elements
};
Result<RowView> as_rows(const TensorView& t, const char* name);

// Runs the family found under `family_name` (`family`: the caller's cached lookup, null when it is
// not registered: internal_error) on problem `p`: for host tensors its CPU reference with the
// heuristic's params, otherwise the kernel through `runtime` (the shared one when null) on `stream`.
Status run_family(const Family* family, const char* family_name, const Problem& p, std::span<void* const> buffers,
                  DeviceKind where, Stream stream, Runtime* runtime);

// Fills a contiguous tensor with zeros, or with `word` in each 32-bit element (a 4-byte dtype;
// f32 -inf is 0xff800000), on the host or on `stream`, without a kernel: what an op writes when
// it has nothing to compute (K = 0, no key tokens).
Status fill(const TensorView& t, DeviceKind where, Stream stream, std::uint32_t word = 0);

// How many clusters of `kernel` (built with a fixed cluster shape of `cluster` blocks) the device
// runs at once with blocks of `block` threads and `shared_bytes` of dynamic shared memory, as the
// driver reports it (cuOccupancyMaxActiveClusters); 0 when the driver cannot say.
int resident_clusters(const Kernel& kernel, unsigned block, unsigned shared_bytes, int cluster);

// For the rmsnorm_bwd family (`bwd`): the clusters of `params`'s kernel resident at once for
// problem `p` when that is the clustered bulk kernel, which takes one slab per such cluster (the
// kernel is loaded through `runtime` to ask the driver); 0 for its other kernels, whose slab count
// needs none. families/rmsnorm_bwd: rmsnorm_bwd_slabs takes it.
Result<int> rmsnorm_bwd_resident_clusters(Runtime& runtime, const Family& bwd, const Params& params, const Problem& p);

// The largest power of two (at most 16) dividing the address and every byte stride given.
std::uint32_t common_alignment(std::initializer_list<std::uintptr_t> addresses,
                               std::initializer_list<std::int64_t> byte_strides);

// A tensor's shape as "[d0, d1, ...]", for error messages.
inline std::string dims(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

// A tensor's data address, as common_alignment takes it.
inline std::uintptr_t address(const TensorView& t) { return reinterpret_cast<std::uintptr_t>(t.data); }

}  // namespace kiln::client
