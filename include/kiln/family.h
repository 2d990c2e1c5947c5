// The kernel family interface and the registry that holds families.
//
// A family turns a validated parameter set into CUDA source for NVRTC, says how to launch the
// kernel for a problem, which variants exist (the catalog, for prewarm), which to try when tuning,
// which to pick by default, and how to compute the same thing on the CPU (the test oracle).
// This is the C++ side of the plugin ABI (kiln/plugin.h): families implement it, and
// kiln/plugin_cpp.h exports them through the C ABI, the built-in ones included; what a Registry
// holds is the loader's adapter over that ABI (plugin/loader.h, docs/plugins.md).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kiln/op.h"
#include "kiln/plugin.h"
#include "kiln/problem.h"
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

enum class BufferRole : std::uint8_t { input, output };

// One buffer a kernel reads or writes for a problem, in kernel-argument order.
struct BufferSpec {
  std::string name;
  BufferRole role = BufferRole::input;
  DType dtype = DType::f32;
  std::int64_t elements = 0;  // elements to allocate (row strides included)
  // Integer inputs that index something (positions, ids): every value must lie in
  // [0, index_bound). 0: no bound (float buffers, outputs).
  std::int64_t index_bound = 0;
};

// A tensor map for the bulk tensor copy engine, as plain data (plugin.h: kiln_tensor_map_request):
// a family asks for one in pack_args without touching CUDA, and the launcher encodes it
// (jit::encode_tensor_maps) into its argument slot before the launch.
using TensorMapRequest = kiln_tensor_map_request;

// The kernel's argument block, built without allocation: values are copied into aligned slots and
// `pointers()` is what cuLaunchKernel takes; tensor maps take 128-byte slots (64-byte aligned)
// that stay zero until encoded. It is the plugin ABI's kiln_arg_pack (same layout), so a
// plugin's C++ family and kiln fill one block.
class ArgPack {
 public:
  static constexpr std::size_t k_capacity = KILN_ARG_PACK_CAPACITY;
  static constexpr std::size_t k_max_args = KILN_ARG_PACK_MAX_ARGS;
  static constexpr std::size_t k_max_tensor_maps = KILN_ARG_PACK_MAX_TENSOR_MAPS;

  ArgPack() { clear(); }
  template <class T>
  void add(const T& v) {
    static_assert(sizeof(T) <= 16 && std::is_trivially_copyable_v<T>);
    kiln_arg_pack_add(&raw_, &v, sizeof(T), alignof(T));
  }
  void add_tensor_map(const TensorMapRequest& r) { kiln_arg_pack_add_tensor_map(&raw_, &r); }
  void** pointers() { return raw_.slots; }
  std::size_t count() const { return raw_.count; }
  bool overflow() const { return raw_.overflow != 0; }
  std::size_t tensor_maps() const { return raw_.map_count; }
  const TensorMapRequest& tensor_map_request(std::size_t i) const { return raw_.maps[i]; }
  void* tensor_map_slot(std::size_t i) { return raw_.map_slots[i]; }
  void clear() { raw_.used = 0; raw_.count = 0; raw_.overflow = 0; raw_.map_count = 0; }
  kiln_arg_pack* raw() { return &raw_; }
  // The ArgPack whose storage is `raw` (a standard-layout class and its first member share an
  // address): how a plugin's C++ family fills the block kiln passed it.
  static ArgPack& over(kiln_arg_pack* raw) { return *reinterpret_cast<ArgPack*>(raw); }

 private:
  kiln_arg_pack raw_;
};
static_assert(std::is_standard_layout_v<ArgPack> && sizeof(ArgPack) == sizeof(kiln_arg_pack));

// Where a family comes from: the plugin that registered it (built-in families come from the
// built-in plugin, "builtin"). Its name, version and template hash are part of every cache key of
// its kernels (docs/cache-format.md), so a rebuilt plugin never gets a stale kernel.
struct PluginInfo {
  std::string name;
  std::string version;
  std::string path;            // the shared library, or "(built in)"
  std::string templates_hash;  // SHA-256 over every template file the plugin ships (path and bytes)
  std::vector<std::string> families;
};

// Template files by path ("softcap/softcap.cuh" -> source).
using TemplateFiles = std::map<std::string, std::string>;

class Family {
 public:
  virtual ~Family() = default;

  virtual std::string_view name() const = 0;
  // Bump when the generated code changes meaning; it is part of every cache key.
  virtual int version() const = 0;
  virtual const std::vector<ParamDef>& schema() const = 0;
  // The problem's fields (kiln/problem.h): which slot holds what, which fields are keys, and the
  // one the tuning signature buckets. Valid as long as the family lives.
  virtual const std::vector<ProblemField>& problem_fields() const = 0;

  // Checks params against schema(): every parameter present, no unknown ones, each value in its
  // allowed set. Families add cross-parameter rules by overriding and calling this first.
  virtual Status validate(const Params& params) const;
  // Source, name expression and options for validated params.
  virtual Result<Rendered> render(const Params& params) const = 0;
  // Every variant worth compiling ahead of time (kiln prewarm), for every arch: catalog_for picks
  // the ones that run on a given arch.
  virtual std::vector<Params> catalog() const = 0;
  // Whether the variant can run on a device of `arch`. A variant that uses instructions an arch
  // lacks (wgmma needs sm_90a; clusters and bulk copies need sm_90) may still compile for it, but
  // never runs there, so prewarm and the conformance test leave it out. Default: every arch.
  virtual bool runs_on(const Params& params, const GpuArch& arch) const { return true; }
  // Checks that the problem is well formed and that `params` can run it.
  virtual Status check_problem(const Params& params, const Problem& problem) const = 0;
  virtual LaunchGeometry geometry(const Params& params, const Problem& problem) const = 0;
  // True when every kernel of the family executes griddepcontrol.wait (which returns once the
  // kernel before it in the stream has finished and its writes are visible) before it touches any
  // memory that kernel may write or read. kiln then launches its kernels built for sm_90 and later
  // as programmatic dependents of the previous kernel (cuLaunchKernelEx, programmatic stream
  // serialization): the launch is prepared, and blocks may be scheduled, while that kernel still
  // runs. Default: false, an ordinary launch.
  virtual bool programmatic_launch() const { return false; }
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
  // The key tuning results are stored under: "dtype=bf16,align=16,rows<=4096,cols=4096,...".
  // Default: dtype and alignment, then every key field in declaration order, the bucketed one
  // rounded up to a power of two (tuning_bucket); value fields are left out. Problems with one
  // signature share a winner.
  virtual std::string signature(const Problem& problem) const;
  // The problem timed for problem's signature: problem with its bucketed field set to the bucket's
  // upper bound, so every member of a bucket is tuned on the same instance.
  virtual Problem tuning_problem(const Problem& problem) const;
  // A problem from named fields (`kiln tune --shape rows=4096,cols=4096`), 16-byte aligned. The
  // default needs every key field named and sets value fields that are not named to their
  // ProblemField default (the problem struct's member initializer; 0 for a plugin's fields);
  // families fill in what follows from the rest (contiguous row strides, say).
  virtual Result<Problem> problem_from_shape(DType dtype,
                                             const std::vector<std::pair<std::string, std::int64_t>>& shape) const;
  // The shapes `kiln tune --all` tunes (the family's benchmark shapes); empty when none declared.
  virtual std::vector<Problem> benchmark_problems(DType dtype) const { return {}; }

  // ---- the launch path and the family's origin (kiln/plugin.h, docs/plugins.md) ----
  // A handle for validated `params` that pack_bound takes, valid while the family lives; null
  // when the family has none. Families that decode their parameters once override both (the
  // plugin adapter binds the plugin's own variant handle), so a launch never re-reads params.
  virtual const void* bind(const Params& params) const { return nullptr; }
  virtual void pack_bound(const void* bound, const Params& params, const Problem& problem,
                          std::span<void* const> buffers, ArgPack& out) const {
    pack_args(params, problem, buffers, out);
  }
  // The plugin that registered the family; null for one added to a Registry directly (tests).
  virtual const PluginInfo* plugin() const { return nullptr; }
  // Headers the family ships (a plugin's templates), looked up after kiln's own, which they may
  // not replace; null for none.
  virtual const TemplateFiles* template_files() const { return nullptr; }
};

// The catalog variants that run on `arch` ("sm_90a"): catalog() filtered through runs_on, in
// catalog order. invalid_argument for a bad arch name.
Result<std::vector<Params>> catalog_for(const Family& family, std::string_view arch);

// The family as JSON: name, version, plugin, problem fields (name, slot, type, key, bucketed, doc)
// and parameter schema (kiln_family_describe, `kiln plugins --json`).
std::string describe_family(const Family& family);

// The bucket a size falls in for tuning: the smallest power of two >= n (0 for n <= 0).
std::int64_t tuning_bucket(std::int64_t n);

// Families and ops by name. Thread-safe. The global registry is filled once, on first use, by the
// plugin loader: the built-in families and their ops, then the plugins of KILN_PLUGIN_PATH or the
// default directory.
class Registry {
 public:
  static Registry& global();

  // Refuses a second family with the same name (the first is kept) with invalid_argument.
  Status add(std::shared_ptr<const Family> family);
  const Family* find(std::string_view name) const;
  std::vector<const Family*> all() const;

  // Looks the family up and validates spec.params against it.
  Result<const Family*> resolve(const KernelSpec& spec) const;

  // Refuses a declaration that fails OpDecl::check or reuses a name (invalid_argument). A
  // registered op lives as long as the registry, at a stable address.
  Status add_op(OpDecl op);
  const OpDecl* find_op(std::string_view name) const;
  std::vector<const OpDecl*> ops() const;

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<const Family>> families_;
  std::vector<std::unique_ptr<const OpDecl>> ops_;
};

// Defined in the CMake-generated builtin_families.cpp.
void register_builtin_families(Registry& r);

}  // namespace kiln
