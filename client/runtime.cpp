#include "kiln/runtime.h"

#include <cstdio>
#include <cstdlib>
#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "cache/store.h"
#include "client/daemon_client.h"
#include "client/embedded_tuning.h"
#include "common/paths.h"
#include "jit/autotune_mode.h"
#include "jit/builder.h"
#include "jit/device_info.h"
#include "jit/driver.h"
#include "remote/config.h"
#include "remote/tier.h"

namespace kiln {
namespace {

// One launch of a loaded kernel. A kernel of a family with programmatic_launch(), built for sm_90
// or later, goes through cuLaunchKernelEx as a programmatic dependent of the stream's previous
// kernel; everything else, or a driver without cuLaunchKernelEx, launches plainly (a kernel's
// griddepcontrol.wait then returns at once).
Status launch_kernel(const jit::Driver* d, const Kernel& k, const LaunchGeometry& g, CUstream stream, void** args) {
  auto fn = static_cast<CUfunction>(k.function);
  if (k.dependent_launch && d->launch_kernel_ex) {
    CUlaunchAttribute attr{};
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig cfg{};
    cfg.gridDimX = g.grid.x;
    cfg.gridDimY = g.grid.y;
    cfg.gridDimZ = g.grid.z;
    cfg.blockDimX = g.block.x;
    cfg.blockDimY = g.block.y;
    cfg.blockDimZ = g.block.z;
    cfg.sharedMemBytes = g.shared_bytes;
    cfg.hStream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return d->check(d->launch_kernel_ex(&cfg, fn, args, nullptr), "cuLaunchKernelEx");
  }
  return d->check(d->launch_kernel(fn, g.grid.x, g.grid.y, g.grid.z, g.block.x, g.block.y, g.block.z, g.shared_bytes,
                                   stream, args, nullptr),
                  "cuLaunchKernel");
}

class RuntimeImpl final : public Runtime {
 public:
  explicit RuntimeImpl(RuntimeOptions opts) : opts_(std::move(opts)) {
    switch (opts_.autotune) {
      case Autotune::off: autotune_ = jit::AutotuneMode::off; break;
      case Autotune::background: autotune_ = jit::AutotuneMode::background; break;
      case Autotune::wait: autotune_ = jit::AutotuneMode::wait; break;
      case Autotune::from_env: {
        auto m = jit::autotune_mode_from_env();
        if (m.ok()) autotune_ = *m;
        else std::fprintf(stderr, "kiln: %s; tuning stays off\n", m.status().message().c_str());
      }
    }
  }
  ~RuntimeImpl() override {
    // Modules stay loaded: contexts may already be gone at exit, and unloading into a destroyed
    // context is an error the caller cannot act on.
  }

  Result<const Kernel*> kernel(const KernelSpec& spec) override {
    KILN_ASSIGN_OR_RETURN(CUcontext ctx, jit::current_context());
    std::string table_key = std::to_string(reinterpret_cast<std::uintptr_t>(ctx)) + "|" + spec.canonical();
    {
      std::lock_guard lock(mu_);
      if (auto it = table_.find(table_key); it != table_.end()) {
        ++counters_.table_hits;
        return &it->second->kernel;
      }
    }
    // Resolving may compile for a long time: it holds resolve_mu_, never mu_, so launches of
    // kernels already in the table go on meanwhile.
    std::lock_guard resolving(resolve_mu_);
    {
      std::lock_guard lock(mu_);
      if (auto it = table_.find(table_key); it != table_.end()) return &it->second->kernel;
    }
    KILN_ASSIGN_OR_RETURN(const Family* family, Registry::global().resolve(spec));
    KILN_ASSIGN_OR_RETURN(const jit::DeviceInfo* dev, device_of(ctx));
    KILN_ASSIGN_OR_RETURN(jit::Artifact art, resolve(*family, spec, dev->arch));
    // The bytes were verified on their way here: by the store (size and SHA-256) on a cache hit,
    // by DaemonClient on arrival from kilnd, or they were compiled in this process just now.

    const jit::Driver* d = jit::Driver::get().value();
    auto loaded = std::make_unique<Loaded>();
    KILN_TRY(d->check(d->module_load_data(&loaded->module, art.entry.cubin.data()), "cuModuleLoadData"));
    CUfunction fn = nullptr;
    Status s = d->check(d->module_get_function(&fn, loaded->module, art.entry.lowered_name.c_str()),
                        "cuModuleGetFunction");
    if (!s.ok()) {
      d->module_unload(loaded->module);
      return s;
    }
    // Let the kernel take as much dynamic shared memory as the device grants one block: families
    // size it per problem (geometry().shared_bytes), and above 48 KiB the driver wants this opt-in.
    s = jit::allow_dynamic_smem(fn);
    if (!s.ok()) {
      d->module_unload(loaded->module);
      return s;
    }
    loaded->kernel = Kernel{family, spec.params, art.entry.key, art.entry.lowered_name, fn, ctx, family->bind(spec.params)};
    loaded->kernel.dependent_launch = family->programmatic_launch() && dev->major >= 9;
    std::lock_guard lock(mu_);
    ++counters_.module_loads;
    const Kernel* out = &loaded->kernel;
    table_.emplace(std::move(table_key), std::move(loaded));
    return out;
  }

  Status launch(const Kernel& k, const Problem& problem, std::span<void* const> buffers, Stream stream) override {
    KILN_TRY(k.family->check_problem(k.params, problem));
    const LaunchGeometry g = k.family->geometry(k.params, problem);
    ArgPack args;
    k.family->pack_bound(k.bound, k.params, problem, buffers, args);
    if (args.overflow()) return internal_error("the kernel arguments could not be packed (more than the argument block holds, or the family failed: see stderr)");
    KILN_TRY(jit::encode_tensor_maps(args));
    return launch_kernel(jit::Driver::get().value(), k, g, static_cast<CUstream>(stream), args.pointers());
  }

  Status run(const Family& family, const Problem& given, std::span<void* const> buffers, Stream stream) override {
    const jit::Driver* d = jit::Driver::get().value();
    CUcontext ctx = nullptr;
    if (d->ctx_get_current(&ctx) != CUDA_SUCCESS || !ctx) {
      KILN_ASSIGN_OR_RETURN(ctx, jit::current_context());
    }
    FastKey key{ctx, &family, given.dtype, given.alignment, {}};
    for (const ProblemField& f : family.problem_fields())
      if (f.key) key.fields[f.slot] = given.fields[f.slot].i;
    FastEntry entry;
    bool hit = false;
    {
      std::lock_guard lock(mu_);
      if (auto it = fast_.find(key); it != fast_.end()) {
        entry = it->second;
        hit = true;
      }
    }
    Problem problem = given;
    if (hit) {
      problem.cc = entry.cc;
      problem.sm_count = entry.sm_count;
    } else {
      {
        std::lock_guard resolving(resolve_mu_);
        KILN_ASSIGN_OR_RETURN(const jit::DeviceInfo* dev, device_of(ctx));
        jit::set_device(problem, *dev);
      }
      const Params params = choose(family, problem, ctx);
      KILN_TRY(family.check_problem(params, problem));
      KILN_ASSIGN_OR_RETURN(entry.kernel, kernel(KernelSpec{std::string(family.name()), params}));
      entry.geometry = family.geometry(params, problem);
      entry.cc = problem.cc;
      entry.sm_count = problem.sm_count;
      std::lock_guard lock(mu_);
      // Serving loops vary the token count every step; a bounded table keeps memory flat.
      if (fast_.size() >= k_fast_capacity) fast_.clear();
      fast_.emplace(key, entry);
    }
    ArgPack args;
    family.pack_bound(entry.kernel->bound, entry.kernel->params, problem, buffers, args);
    if (args.overflow()) return internal_error("the kernel arguments could not be packed (more than the argument block holds, or the family failed: see stderr)");
    KILN_TRY(jit::encode_tensor_maps(args));
    return launch_kernel(d, *entry.kernel, entry.geometry, static_cast<CUstream>(stream), args.pointers());
  }

  std::string resolver() const override {
    std::lock_guard lock(mu_);
    return last_resolver_;
  }

  RuntimeCounters counters() const override {
    std::lock_guard lock(mu_);
    return counters_;
  }

 private:
  struct Loaded {
    Kernel kernel;
    CUmodule module = nullptr;
  };

  // The fast path's key: everything a family's heuristic and geometry may depend on (the context
  // stands for the device; value fields stay zero).
  struct FastKey {
    CUcontext ctx;
    const Family* family;
    DType dtype;
    std::uint32_t alignment;
    std::array<std::int64_t, Problem::k_max_fields> fields;
    bool operator==(const FastKey&) const = default;
  };
  struct FastHash {
    std::size_t operator()(const FastKey& k) const {
      std::uint64_t h = std::hash<const void*>()(k.ctx) ^ (std::hash<const void*>()(k.family) << 1);
      h = h * 0x9e3779b97f4a7c15ull + (std::uint64_t(k.dtype) << 32 | k.alignment);
      for (auto v : k.fields) h = (h ^ std::uint64_t(v)) * 0x100000001b3ull;
      return std::size_t(h);
    }
  };
  struct FastEntry {
    const Kernel* kernel = nullptr;
    LaunchGeometry geometry;
    std::uint8_t cc = 0;
    std::uint16_t sm_count = 0;
  };
  static constexpr std::size_t k_fast_capacity = 4096;
  struct TunedMemo {
    std::optional<Params> params;  // the winner, or nullopt: use the heuristic
    std::chrono::steady_clock::time_point at;
  };
  static constexpr std::chrono::seconds k_retry_miss{10};


  // The variant for a shape's first call: the tuned winner for the problem's signature when the
  // tuning table has a fresh one, else the heuristic's choice. Tuning trouble (no daemon, an
  // unreadable table, a failed tuning run) never fails the call: it costs the tuned winner only.
  // Answers are remembered per signature (a bucket of row counts), so a serving loop whose token
  // count changes every step asks once per bucket: a winner for good, a miss for k_retry_miss
  // (tuning may be under way in kilnd).
  Params choose(const Family& family, const Problem& problem, CUcontext ctx) {
    const auto now = std::chrono::steady_clock::now();
    const std::string memo_key = std::to_string(reinterpret_cast<std::uintptr_t>(ctx)) + "|" +
                                 std::string(family.name()) + "|" + family.signature(problem);
    std::optional<Params> tuned;
    bool known = false;
    {
      std::lock_guard lock(mu_);
      if (auto it = tuned_memo_.find(memo_key);
          it != tuned_memo_.end() && (it->second.params || now - it->second.at < k_retry_miss)) {
        tuned = it->second.params;
        known = true;
      }
    }
    if (!known) {
      auto r = tuned_params(family, problem, ctx);
      if (r.ok())
        tuned = std::move(r).value();
      else if (!warned_tuning_.exchange(true))
        std::fprintf(stderr, "kiln: tuned variants unavailable, using heuristics: %s\n",
                     r.status().to_string().c_str());
      std::lock_guard lock(mu_);
      if (tuned_memo_.size() >= k_fast_capacity) tuned_memo_.clear();
      tuned_memo_[memo_key] = TunedMemo{tuned, now};
    }
    if (tuned && family.check_problem(*tuned, problem).ok()) {
      std::lock_guard lock(mu_);
      ++counters_.tuned_choices;
      return *tuned;
    }
    return family.heuristic(problem);
  }

  Result<std::optional<Params>> tuned_params(const Family& family, const Problem& problem, CUcontext ctx) {
    std::lock_guard resolving(resolve_mu_);
    KILN_ASSIGN_OR_RETURN(const jit::DeviceInfo* dev, device_of(ctx));
    if (opts_.mode != ResolverMode::embedded) {
      KILN_TRY(connect_daemon());
      if (daemon_) {
        client::ResolveTarget target{dev->arch, dev->name, dev->driver_version, dev->pci_bus_id};
        auto r = daemon_->resolve(family, problem, target, autotune_);
        if (r.ok()) return r->tuned ? std::optional<Params>(r->params) : std::nullopt;
        const Code c = r.status().code();
        if (c != Code::unavailable && c != Code::timeout && c != Code::io_error && c != Code::shutting_down)
          return r.status();
        daemon_.reset();
        if (opts_.mode == ResolverMode::daemon) return r.status();
      }
    }
    KILN_TRY(open_embedded());
    if (!store_) return unavailable("no cache file, so no tuning table");
    if (!tuning_) {
      KILN_ASSIGN_OR_RETURN(tuning_, client::EmbeddedTuning::open(*store_, *builder_, remote_.get()));
    }
    return tuning_->winner(family, problem, *dev, autotune_);
  }

  // The device of the current context `ctx`, remembered per context so that a call needs no
  // driver round trip to find it.
  Result<const jit::DeviceInfo*> device_of(CUcontext ctx) {
    if (auto it = device_by_ctx_.find(ctx); it != device_by_ctx_.end()) return it->second;
    const jit::Driver* d = jit::Driver::get().value();
    CUdevice dev;
    KILN_TRY(d->check(d->ctx_get_device(&dev), "cuCtxGetDevice"));
    KILN_ASSIGN_OR_RETURN(const jit::DeviceInfo* info, jit::device_info(int(dev)));
    device_by_ctx_.emplace(ctx, info);
    return info;
  }

  // Connects on first use. ok with no connection when none can be made in automatic mode.
  Status connect_daemon() {
    if (daemon_) return {};
    auto c = client::DaemonClient::connect(opts_.socket_path.empty() ? socket_path()
                                                                      : std::filesystem::path(opts_.socket_path));
    if (c.ok()) daemon_ = std::move(c).value();
    else if (opts_.mode == ResolverMode::daemon) return c.status();
    return {};
  }

  // A remote tier configured in the environment (KILN_REMOTE) is used here too; a configuration
  // that is wrong (an unsafe fleet key file, a malformed URL) fails every resolve until fixed,
  // rather than silently running without the tier or without its checks.
  Status open_embedded() {
    if (builder_) return {};
    auto remote = remote::config_from_env();
    if (!remote.ok()) return remote.status();
    auto st = cache::Store::open(opts_.cache_file.empty() ? cache_file() : std::filesystem::path(opts_.cache_file));
    if (st.ok()) store_ = std::move(st).value();
    else std::fprintf(stderr, "kiln: cache unavailable, compiling without it: %s\n", st.status().to_string().c_str());
    jit::BuilderOptions bo;
    if (*remote) {
      remote_ = remote::Tier::create(std::move(**remote));
      bo.remote = remote_.get();
    }
    builder_ = std::make_unique<jit::Builder>(store_.get(), &Registry::global(), bo);
    return {};
  }

  // Daemon first (unless embedded); a daemon that cannot be reached falls back to the embedded
  // builder in automatic mode. Errors about the request itself are returned as they are, except
  // that a daemon without this process's build of the family (plugins differ between the two)
  // is never trusted with it: the kernel is built here, in any mode but `daemon`.
  Result<jit::Artifact> resolve(const Family& family, const KernelSpec& spec, const std::string& arch) {
    if (opts_.mode != ResolverMode::embedded) {
      KILN_TRY(connect_daemon());
      if (daemon_) {
        auto art = daemon_->get_kernel(spec, arch);
        Status other = art.ok() ? client::same_family_build(family, art->entry)
                                : art.status().code() == Code::not_found
                                      ? Status(Code::not_found, "kilnd has no family '" + spec.family +
                                                                    "': " + art.status().message())
                                      : Status();
        if (art.ok() && other.ok()) {
          std::lock_guard lock(mu_);
          ++counters_.from_daemon;
          last_resolver_ = "daemon";
          return art;
        }
        const Code c = art.ok() ? Code::ok : art.status().code();
        if (!other.ok()) {
          if (opts_.mode == ResolverMode::daemon) return other;
          if (!warned_family_.exchange(true))
            std::fprintf(stderr, "kiln: %s; compiling such kernels in this process\n", other.message().c_str());
        } else if (c != Code::unavailable && c != Code::timeout && c != Code::io_error && c != Code::shutting_down) {
          return art.status();
        } else {
          daemon_.reset();
          if (opts_.mode == ResolverMode::daemon) return art.status();
        }
      }
    }
    KILN_TRY(open_embedded());
    auto art = builder_->get(spec, arch);
    if (art.ok()) {
      std::lock_guard lock(mu_);
      ++counters_.from_embedded;
      last_resolver_ = "embedded";
    }
    return art;
  }

  RuntimeOptions opts_;
  mutable std::mutex mu_;  // table_, counters_, last_resolver_
  std::mutex resolve_mu_;  // everything resolve() and device_of() touch
  std::unique_ptr<cache::Store> store_;
  std::unique_ptr<remote::Tier> remote_;  // outlives builder_
  std::unique_ptr<jit::Builder> builder_;
  std::unique_ptr<client::EmbeddedTuning> tuning_;  // the tuned winners without a daemon
  std::unique_ptr<client::DaemonClient> daemon_;
  std::unordered_map<CUcontext, const jit::DeviceInfo*> device_by_ctx_;
  std::unordered_map<std::string, TunedMemo> tuned_memo_;  // under mu_
  jit::AutotuneMode autotune_ = jit::AutotuneMode::off;
  std::atomic<bool> warned_tuning_{false};
  std::atomic<bool> warned_family_{false};
  std::unordered_map<std::string, std::unique_ptr<Loaded>> table_;
  std::unordered_map<FastKey, FastEntry, FastHash> fast_;
  RuntimeCounters counters_;
  std::string last_resolver_;
};

}  // namespace

Result<std::shared_ptr<Runtime>> Runtime::create(const RuntimeOptions& options) {
  return std::shared_ptr<Runtime>(std::make_shared<RuntimeImpl>(options));
}

Result<Runtime*> Runtime::shared() {
  static std::once_flag once;
  static std::shared_ptr<Runtime> rt;
  static Status failure;
  std::call_once(once, [] {
    RuntimeOptions o;
    const char* mode = std::getenv("KILN_MODE");
    std::string m = mode ? mode : "auto";
    if (m == "embedded") o.mode = ResolverMode::embedded;
    else if (m == "daemon") o.mode = ResolverMode::daemon;
    else if (m != "auto" && !m.empty()) {
      failure = invalid_argument("KILN_MODE must be auto, embedded or daemon (got '" + m + "')");
      return;
    }
    rt = create(o).value();
  });
  if (!rt) return failure;
  return rt.get();
}

}  // namespace kiln
