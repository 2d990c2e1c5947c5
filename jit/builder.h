// Spec + arch -> compiled kernel, through the cache.
//
// The path every resolver shares (the daemon and the embedded runtime): validate, render, key,
// cache lookup (verified), compile on a miss, store. Concurrent requests for one key in this
// process are coalesced: one compile, every waiter gets its result (single-flight). Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "cache/store.h"
#include "jit/nvrtc.h"
#include "kiln/family.h"
#include "kiln/spec.h"
#include "kiln/status.h"

namespace kiln::jit {

class TemplateSet;

enum class ArtifactSource { cache, compiled };

struct Artifact {
  cache::Entry entry;  // cubin, lowered name, key, metadata
  ArtifactSource source = ArtifactSource::cache;
};

struct BuilderOptions {
  bool use_pch = false;  // NVRTC automatic PCH; worth it in a long-lived process
  // The headers kernels are compiled against; null: TemplateSet::active(). Not owned.
  const TemplateSet* templates = nullptr;
  // Runs one NVRTC compile; null: in this process. kilnd sets it to compile in a worker process
  // under a deadline (daemon/compile_workers.h); a worker compiles against TemplateSet::active(),
  // so it is not combined with `templates`.
  std::function<Result<CompileOutput>(const CompileRequest&)> compiler = nullptr;
};

struct BuilderStats {
  std::int64_t requests = 0;
  std::int64_t cache_hits = 0;
  std::int64_t compiles = 0;          // NVRTC invocations
  std::int64_t compile_failures = 0;
  std::int64_t coalesced = 0;         // requests that waited on another's in-flight compile
  std::int64_t store_failures = 0;    // compiled but could not be stored (still served)
  std::int64_t negative_hits = 0;     // requests answered from a remembered compile failure
};

class Builder {
 public:
  // `store` may be null (compile every time, store nothing). Neither pointer is owned.
  Builder(cache::Store* store, const Registry* registry, BuilderOptions options = {});

  // Errors: invalid_argument / not_found for bad specs or arch (before any compile), unavailable
  // when NVRTC cannot be loaded, compile_error with log and options.
  Result<Artifact> get(const KernelSpec& spec, const std::string& arch);

  // The key a spec would have, without compiling (for `kiln why` and tests).
  Result<std::string> key_text(const KernelSpec& spec, const std::string& arch) const;

  BuilderStats stats() const;

 private:
  struct Flight;
  const TemplateSet& templates() const;
  Result<Artifact> build(const KernelSpec& spec, const std::string& arch);

  cache::Store* store_;
  const Registry* registry_;
  BuilderOptions options_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Flight>> in_flight_;
  // Keys whose compile failed, with the error (log and options). The key hashes the source,
  // options and toolchain, so the same key fails the same way again: it is answered from here
  // instead of running NVRTC once per request. Bounded; cleared when full.
  std::map<std::string, Status> failed_;
  BuilderStats stats_;
};

}  // namespace kiln::jit
