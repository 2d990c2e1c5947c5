// The kernel family interface and the registry that holds families.
//
// A family turns a validated parameter set into CUDA source for NVRTC, says how to launch the
// kernel for a problem, which variants exist (the catalog, for prewarm), which to try when tuning,
// which to pick by default, and how to compute the same thing on the CPU (the test oracle).
// This is the C++ side of the plugin ABI: built-in families implement it directly.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/spec.h"
#include "kiln/status.h"
#include "kiln/types.h"

namespace kiln {

// One specialization parameter and the values it may take. Every value is enumerated: nothing
// outside the list reaches a template.
struct ParamDef {
  std::string name;
  std::vector<std::int64_t> ints;      // allowed integers (when the parameter is an integer)
  std::vector<std::string> choices;    // allowed strings (when the parameter is a string)
  std::string doc;
  bool is_int() const { return !ints.empty(); }
};

// What NVRTC gets. Options never contain -arch (the arch is part of the request) nor paths.
struct Rendered {
  std::string source;
  std::string name_expression;
  std::vector<std::string> options;
};

struct Dim3 {
  std::uint32_t x = 1, y = 1, z = 1;
};

struct LaunchGeometry {
  Dim3 grid;
  Dim3 block;
  std::uint32_t shared_bytes = 0;
};

// A problem instance: sizes and scalars whose meaning each family documents (problem_dims() and
// problem_scalars() name the slots), the element type, and the smallest byte alignment among the
// buffers' base addresses and row strides. Plain data so the launch path never allocates.
struct Problem {
  static constexpr int k_max_dims = 8;
  static constexpr int k_max_scalars = 4;
  DType dtype = DType::f32;
  std::uint32_t alignment = 16;
  std::array<std::int64_t, k_max_dims> dims{};
  std::array<double, k_max_scalars> scalars{};
};

enum class BufferRole : std::uint8_t { input, output };

// One buffer a kernel reads or writes for a problem, in kernel-argument order.
struct BufferSpec {
  std::string name;
  BufferRole role = BufferRole::input;
  DType dtype = DType::f32;
  std::int64_t elements = 0;  // elements to allocate (row strides included)
};

// A 2-D tiled tensor map (CUtensorMap, for the bulk tensor copy engine) as plain data: a family
// describes it in pack_args without touching CUDA, and the launcher encodes it
// (jit::encode_tensor_maps) into its argument slot before the launch. The map views `rows` rows of
// `row_bytes` bytes (a multiple of 16; rows `row_bytes` apart) as bytes, copied in boxes of
// `box_rows` x 128 bytes with the 128-byte swizzle; reads past either edge give zeros.
struct TensorMapRequest {
  const void* base = nullptr;
  std::uint64_t row_bytes = 0;
  std::uint64_t rows = 0;
  std::uint32_t box_rows = 0;
};

// The kernel's argument block, built without allocation: values are copied into aligned slots and
// `pointers()` is what cuLaunchKernel takes. Tensor maps take 128-byte slots (64-byte aligned)
// that stay zero until encoded.
class ArgPack {
 public:
  static constexpr std::size_t k_capacity = 768;
  static constexpr std::size_t k_max_args = 24;
  static constexpr std::size_t k_max_tensor_maps = 4;
  static constexpr std::size_t k_tensor_map_bytes = 128;

  template <class T>
  void add(const T& v) {
    static_assert(sizeof(T) <= 16 && std::is_trivially_copyable_v<T>);
    if (void* slot = reserve(sizeof(T), alignof(T))) std::memcpy(slot, &v, sizeof(T));
  }
  void add_tensor_map(const TensorMapRequest& r) {
    if (maps_ == k_max_tensor_maps) { overflow_ = true; return; }
    void* slot = reserve(k_tensor_map_bytes, 64);
    if (!slot) return;
    std::memset(slot, 0, k_tensor_map_bytes);
    map_slots_[maps_] = slot;
    map_requests_[maps_++] = r;
  }
  void** pointers() { return ptrs_; }
  std::size_t count() const { return count_; }
  bool overflow() const { return overflow_; }
  std::size_t tensor_maps() const { return maps_; }
  const TensorMapRequest& tensor_map_request(std::size_t i) const { return map_requests_[i]; }
  void* tensor_map_slot(std::size_t i) { return map_slots_[i]; }
  void clear() { used_ = 0; count_ = 0; maps_ = 0; overflow_ = false; }

 private:
  void* reserve(std::size_t bytes, std::size_t align) {
    used_ = (used_ + align - 1) / align * align;
    if (used_ + bytes > k_capacity || count_ == k_max_args) { overflow_ = true; return nullptr; }
    void* slot = storage_ + used_;
    ptrs_[count_++] = slot;
    used_ += bytes;
    return slot;
  }
  alignas(64) unsigned char storage_[k_capacity];
  void* ptrs_[k_max_args] = {};
  std::size_t used_ = 0;
  std::size_t count_ = 0;
  bool overflow_ = false;
  void* map_slots_[k_max_tensor_maps] = {};
  TensorMapRequest map_requests_[k_max_tensor_maps] = {};
  std::size_t maps_ = 0;
};

class Family {
 public:
  virtual ~Family() = default;

  virtual std::string_view name() const = 0;
  // Bump when the generated code changes meaning; it is part of every cache key.
  virtual int version() const = 0;
  virtual const std::vector<ParamDef>& schema() const = 0;
  // Names of the Problem::dims and Problem::scalars slots, in order.
  virtual std::vector<std::string> problem_dims() const = 0;
  virtual std::vector<std::string> problem_scalars() const = 0;

  // Checks params against schema(): every parameter present, no unknown ones, each value in its
  // allowed set. Families add cross-parameter rules by overriding and calling this first.
  virtual Status validate(const Params& params) const;
  // Source, name expression and options for validated params.
  virtual Result<Rendered> render(const Params& params) const = 0;
  // Every variant worth compiling ahead of time (kiln prewarm).
  virtual std::vector<Params> catalog() const = 0;
  // Checks that the problem is well formed and that `params` can run it.
  virtual Status check_problem(const Params& params, const Problem& problem) const = 0;
  virtual LaunchGeometry geometry(const Params& params, const Problem& problem) const = 0;
  // The default choice for a problem, and the candidates a tuner should time around it.
  virtual Params heuristic(const Problem& problem) const = 0;
  virtual std::vector<Params> tuning_space(const Problem& problem) const = 0;

  // Buffers in kernel-argument order, then the problem's scalars: `pack_args` appends both.
  virtual std::vector<BufferSpec> buffers(const Params& params, const Problem& problem) const = 0;
  virtual void pack_args(const Params& params, const Problem& problem,
                         std::span<void* const> buffers, ArgPack& out) const = 0;
  // The CPU reference (fp64 accumulation): reads the input buffers, writes the output ones, all in
  // host memory and in the order of buffers().
  virtual Status cpu_reference(const Params& params, const Problem& problem,
                               std::span<void* const> buffers) const = 0;

  // ---- tuning (docs/autotune.md) ----
  // The Problem::dims slot that tuning signatures bucket to powers of two (the token or row count,
  // which varies call to call); -1 for none. Default: slot 0.
  virtual int bucketed_dim() const { return 0; }
  // The key tuning results are stored under: "dtype=bf16,align=16,rows<=4096,cols=4096,...".
  // Default: the bucketed dim rounded up to a power of two (tuning_bucket), every other dim exact,
  // dtype and alignment included, scalars left out. Problems with one signature share a winner.
  virtual std::string signature(const Problem& problem) const;
  // The problem timed for problem's signature: problem with its bucketed dim set to the bucket's
  // upper bound, so every member of a bucket is tuned on the same instance.
  virtual Problem tuning_problem(const Problem& problem) const;
  // A problem from named sizes (`kiln tune --shape rows=4096,cols=4096`), 16-byte aligned. The
  // default needs every dim named; families fill in what follows from the rest (contiguous row
  // strides, say) and default scalars.
  virtual Result<Problem> problem_from_shape(DType dtype,
                                             const std::vector<std::pair<std::string, std::int64_t>>& shape) const;
  // The shapes `kiln tune --all` tunes (the family's benchmark shapes); empty when none declared.
  virtual std::vector<Problem> benchmark_problems(DType dtype) const { return {}; }
};

// The bucket a size falls in for tuning: the smallest power of two >= n (0 for n <= 0).
std::int64_t tuning_bucket(std::int64_t n);

// Families by name. Thread-safe. The global registry starts with the built-in families.
class Registry {
 public:
  static Registry& global();

  // Refuses a second family with the same name (the first is kept) with invalid_argument.
  Status add(std::shared_ptr<const Family> family);
  const Family* find(std::string_view name) const;
  std::vector<const Family*> all() const;

  // Looks the family up and validates spec.params against it.
  Result<const Family*> resolve(const KernelSpec& spec) const;

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<const Family>> families_;
};

// Defined in the CMake-generated builtin_families.cpp.
void register_builtin_families(Registry& r);

}  // namespace kiln
