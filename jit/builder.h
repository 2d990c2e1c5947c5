// Spec + arch -> compiled kernel, through the cache.
//
// The path every resolver shares (the daemon and the embedded runtime): validate, render, key,
// cache lookup (verified), compile on a miss, store. Concurrent requests for one key in this
// process are coalesced: one compile, every waiter gets its result (single-flight). Thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <iterator>
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

namespace kiln::remote {
class Tier;
}

namespace kiln::jit {

class TemplateSet;

// cache: the local SQLite cache; remote: the fleet's remote tier (then stored locally);
// compiled: NVRTC, in this request or the in-flight compile it joined.
enum class ArtifactSource { cache, compiled, remote };

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
  // The fleet's remote tier (remote/tier.h), asked after a local miss and before compiling (where
  // it may wait for another host compiling the same key: Tier::claim), and given every kernel
  // compiled here; null: none. Not owned.
  remote::Tier* remote = nullptr;
};

// Compile times are counted in these buckets (seconds, upper bounds; a last one is unbounded).
inline constexpr double k_compile_seconds_buckets[] = {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
inline constexpr std::size_t k_compile_buckets = std::size(k_compile_seconds_buckets) + 1;

struct BuilderStats {
  std::int64_t requests = 0;
  std::int64_t cache_hits = 0;
  std::int64_t cache_misses = 0;      // local cache lookups that found nothing usable (or no cache)
  std::int64_t compiles = 0;          // NVRTC invocations
  std::int64_t compile_failures = 0;
  std::int64_t coalesced = 0;         // requests that waited on another's in-flight compile
  std::int64_t store_failures = 0;    // compiled but could not be stored (still served)
  std::int64_t negative_hits = 0;     // requests answered from a remembered compile failure
  std::int64_t remote_hits = 0;       // local misses served by the remote tier
  std::int64_t remote_misses = 0;     // local misses the remote tier could not serve
  // Successful compiles by NVRTC time (k_compile_seconds_buckets, not cumulative) and their sum.
  std::array<std::int64_t, k_compile_buckets> compile_seconds_counts{};
  double compile_seconds_sum = 0;
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
