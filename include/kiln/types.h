// Element types, devices and the small tensor view that typed ops take.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string_view>

namespace kiln {

enum class DType : std::uint8_t { f32 = 0, f16 = 1, bf16 = 2, u8 = 3, i32 = 4, i64 = 5 };

const char* dtype_name(DType t);
std::optional<DType> parse_dtype(std::string_view name);
std::size_t dtype_size(DType t);
inline bool is_floating(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

enum class DeviceKind : std::uint8_t { cpu = 0, cuda = 1 };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int i = 0) { return {DeviceKind::cuda, i}; }
  bool operator==(const Device&) const = default;
};

// A non-owning view: pointer, dtype, shape and strides (in elements), and where the memory lives.
// The device field is what the caller claims; ops on CUDA memory also ask the driver, so a host
// pointer labelled as CUDA is still caught before any launch.
struct TensorView {
  static constexpr int k_max_rank = 8;

  void* data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  std::int64_t shape[k_max_rank] = {};
  std::int64_t strides[k_max_rank] = {};
  Device device;

  // A row-major contiguous view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device);
  std::int64_t numel() const;
  bool is_contiguous() const;
};

}  // namespace kiln
