// libkiln's C++ client: kernel handles and typed ops.
//
// A Runtime resolves a KernelSpec to a cubin through the daemon when one is reachable, otherwise
// by compiling in-process on the same SQLite cache (the embedded default). It loads each cubin
// once per CUDA context and keeps the function handles in a table, so after the first call an op
// costs a table lookup plus cuLaunchKernel on the caller's stream. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kiln/family.h"
#include "kiln/spec.h"
#include "kiln/status.h"
#include "kiln/types.h"

namespace kiln {

// A CUstream; nullptr is the legacy default stream.
using Stream = void*;

enum class ResolverMode {
  automatic,  // the daemon if its socket answers, else embedded
  embedded,   // always compile in-process
  daemon,     // always the daemon; an error if it is not running
};

// Tuning on a shape's first call (docs/autotune.md). Tuned winners are always used when the
// tuning table has one for the problem's signature on this GPU, driver and toolchain.
enum class Autotune {
  from_env,    // KILN_AUTOTUNE: unset or 0 -> off, 1 -> background, wait -> wait
  off,         // use tuned winners, never start tuning
  background,  // also ask kilnd to tune missing signatures in the background (never waits)
  wait,        // tune a missing signature before the first launch (in kilnd, or in-process)
};

struct RuntimeOptions {
  ResolverMode mode = ResolverMode::automatic;
  Autotune autotune = Autotune::from_env;
  std::string socket_path;  // empty: kiln's default (KILN_SOCKET, XDG_RUNTIME_DIR ...)
  std::string cache_file;   // empty: kiln's default (KILN_CACHE_DIR, XDG_CACHE_HOME ...)
};

// A kernel loaded in one CUDA context.
struct Kernel {
  const Family* family = nullptr;
  Params params;
  std::string key;
  std::string lowered_name;
  void* function = nullptr;  // CUfunction
  void* context = nullptr;   // CUcontext it was loaded in
  const void* bound = nullptr;  // family->bind(params): what the launch path packs arguments with
  // Launched as a programmatic dependent of the stream's previous kernel: the family allows it
  // (Family::programmatic_launch) and the kernel is built for sm_90 or later.
  bool dependent_launch = false;
};

struct RuntimeCounters {
  std::int64_t table_hits = 0;      // kernel() answered from the handle table
  std::int64_t from_daemon = 0;     // cubins received from kilnd
  std::int64_t from_embedded = 0;   // cubins from the in-process builder (cache or compile)
  std::int64_t module_loads = 0;
  std::int64_t tuned_choices = 0;   // first calls for a shape that ran a tuned winner
};

class Runtime {
 public:
  static Result<std::shared_ptr<Runtime>> create(const RuntimeOptions& options = {});
  // The process-wide runtime, created on first use. KILN_MODE=embedded|daemon|auto picks the mode.
  static Result<Runtime*> shared();
  virtual ~Runtime() = default;

  // The kernel for `spec` in the calling thread's current CUDA context (the device's primary
  // context is made current when none is).
  virtual Result<const Kernel*> kernel(const KernelSpec& spec) = 0;
  // Checks the problem against the kernel's family and launches on `stream`: exactly this variant
  // on exactly this problem, its device facts (Problem::sm_count, Problem::cc) included as given.
  virtual Status launch(const Kernel& kernel, const Problem& problem, std::span<void* const> buffers,
                        Stream stream) = 0;
  // The path typed ops take: picks the family's variant for `problem` (the tuned winner for the
  // problem's signature when there is one, else its heuristic; see Autotune), resolves and
  // loads it on first use, and launches on `stream`. The problem's device facts are the current
  // context's device (jit/device_info.h), whatever the caller set. After the first call for a given
  // context, family and problem key (key fields, dtype, alignment; value fields excluded), the
  // variant, its function and launch geometry come from a hash table: no spec strings, no
  // parameter maps. The caller has validated the tensors; the family's check_problem runs on the
  // first call only, and value fields must be checked by the caller.
  virtual Status run(const Family& family, const Problem& problem, std::span<void* const> buffers,
                     Stream stream) = 0;
  // "daemon" or "embedded": what resolved the last cubin.
  virtual std::string resolver() const = 0;
  virtual RuntimeCounters counters() const = 0;
};

}  // namespace kiln
