#include "jit/builder.h"

#include <cstdio>

#include "common/sha256.h"
#include "jit/key.h"
#include "jit/nvrtc.h"
#include "jit/templates.h"
#include "remote/tier.h"

namespace kiln::jit {

struct Builder::Flight {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::optional<Result<Artifact>> result;
};

namespace {

constexpr std::size_t k_max_remembered_failures = 4096;

struct Prepared {
  const Family* family = nullptr;
  Rendered rendered;
  Key key;
  // The headers of the closure only the family ships: what a compile (or a worker) needs besides
  // kiln's template set.
  std::map<std::string, std::string> own_headers;
};

Result<Prepared> prepare(const Registry& registry, const TemplateSet& templates, const KernelSpec& spec,
                         const std::string& arch) {
  KILN_TRY(validate_arch(arch));
  Prepared p;
  KILN_ASSIGN_OR_RETURN(p.family, registry.resolve(spec));
  KILN_ASSIGN_OR_RETURN(p.rendered, p.family->render(spec.params));
  KILN_ASSIGN_OR_RETURN(Nvrtc * nvrtc, Nvrtc::get());
  const TemplateFiles* own = p.family->template_files();
  KILN_ASSIGN_OR_RETURN(auto closure, templates.closure(p.rendered.source, own));
  for (const auto& h : closure.headers)
    if (!templates.find(h)) p.own_headers.emplace(h, *templates.find(h, own));
  KeyInputs in;
  in.family = std::string(p.family->name());
  in.family_version = p.family->version();
  in.params = spec.params.canonical();
  const PluginInfo* plugin = p.family->plugin();
  in.plugin = plugin ? plugin->name + " " + plugin->version : "-";
  in.plugin_templates = plugin ? plugin->templates_hash : "-";
  in.arch = arch;
  in.nvrtc_version = nvrtc->version();
  // The rendered source (the instantiation) is hashed along with the headers it includes.
  in.template_hash = sha256_hex(closure.hash + "\n" + p.rendered.source);
  in.options = Nvrtc::base_options();
  for (const auto& o : p.rendered.options) in.options.push_back(o);
  in.options.push_back("name=" + p.rendered.name_expression);
  p.key = make_key(in);
  return p;
}

}  // namespace

Builder::Builder(cache::Store* store, const Registry* registry, BuilderOptions options)
    : store_(store), registry_(registry), options_(options) {}

Result<std::string> Builder::key_text(const KernelSpec& spec, const std::string& arch) const {
  KILN_ASSIGN_OR_RETURN(auto p, prepare(*registry_, templates(), spec, arch));
  return p.key.hex + "\n" + p.key.text;
}

const TemplateSet& Builder::templates() const {
  return options_.templates ? *options_.templates : TemplateSet::active();
}

BuilderStats Builder::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

Result<Artifact> Builder::get(const KernelSpec& spec, const std::string& arch) {
  KILN_ASSIGN_OR_RETURN(auto prepared, prepare(*registry_, templates(), spec, arch));
  const std::string& key = prepared.key.hex;

  std::shared_ptr<Flight> flight;
  bool leader = false;
  {
    std::lock_guard lock(mu_);
    ++stats_.requests;
    if (auto f = failed_.find(key); f != failed_.end()) {
      ++stats_.negative_hits;
      return f->second;
    }
    auto it = in_flight_.find(key);
    if (it != in_flight_.end()) {
      flight = it->second;
      ++stats_.coalesced;
    } else {
      flight = std::make_shared<Flight>();
      in_flight_.emplace(key, flight);
      leader = true;
    }
  }
  if (!leader) {
    std::unique_lock lock(flight->mu);
    flight->cv.wait(lock, [&] { return flight->done; });
    return *flight->result;
  }

  Result<Artifact> result = [&]() -> Result<Artifact> {
    if (store_) {
      auto hit = store_->get(key, cache::Expected{arch, prepared.key.toolchain});
      if (hit.ok() && hit->has_value()) {
        std::lock_guard lock(mu_);
        ++stats_.cache_hits;
        return Artifact{std::move(**hit), ArtifactSource::cache};
      }
      if (!hit.ok()) std::fprintf(stderr, "kiln: cache lookup failed, compiling: %s\n", hit.status().to_string().c_str());
    }
    {
      std::lock_guard lock(mu_);
      ++stats_.cache_misses;
    }
    // Held while this host compiles the key for the fleet; released after the write-back, or at
    // once on any return without one.
    remote::CompileLock fleet_lock;
    if (options_.remote) {
      const cache::Expected expected{arch, prepared.key.toolchain};
      auto entry = options_.remote->get_entry(key, expected);
      if (!entry) {
        // Other hosts may be missing it now too: one compiles, the rest wait for its record.
        remote::Claim claim = options_.remote->claim(key, expected);
        entry = std::move(claim.entry);
        fleet_lock = std::move(claim.lock);
      }
      std::lock_guard lock(mu_);
      if (entry) {
        ++stats_.remote_hits;
      } else {
        ++stats_.remote_misses;
      }
      if (entry) {
        // Kept locally too: the next process on this host needs no network. A failed store is
        // counted like a compiled kernel's, and the kernel is served anyway.
        if (store_ && !store_->put(*entry).ok()) ++stats_.store_failures;
        return Artifact{std::move(*entry), ArtifactSource::remote};
      }
    }
    KILN_ASSIGN_OR_RETURN(Nvrtc * nvrtc, Nvrtc::get());
    CompileRequest req{prepared.rendered.source, prepared.rendered.name_expression, prepared.rendered.options, arch,
                       options_.use_pch, &templates(), &prepared.own_headers};
    auto run = [&](const CompileRequest& r) { return options_.compiler ? options_.compiler(r) : nvrtc->compile(r); };
    auto compiled = run(req);
    // NVRTC's automatic PCH needs file-backed memory; with the disk full (or a file size limit)
    // it fails before looking at the source. The kernel itself is fine: compile it without PCH.
    if (!compiled.ok() && req.use_pch &&
        compiled.status().details().find("unable to obtain mapped memory") != std::string::npos) {
      req.use_pch = false;
      compiled = run(req);
    }
    {
      std::lock_guard lock(mu_);
      ++stats_.compiles;
      if (!compiled.ok()) ++stats_.compile_failures;
      if (compiled.ok()) {
        const double secs = compiled->compile_ms / 1000.0;
        std::size_t b = 0;
        while (b < std::size(k_compile_seconds_buckets) && secs > k_compile_seconds_buckets[b]) ++b;
        ++stats_.compile_seconds_counts[b];
        stats_.compile_seconds_sum += secs;
      }
      // Only NVRTC's verdict on the source is remembered; a missing NVRTC may be fixed meanwhile.
      if (!compiled.ok() && compiled.status().code() == Code::compile_error) {
        if (failed_.size() >= k_max_remembered_failures) failed_.clear();
        failed_.emplace(key, compiled.status());
      }
    }
    if (!compiled.ok()) return compiled.status();
    cache::Entry e;
    e.key = key;
    e.family = std::string(prepared.family->name());
    e.family_version = prepared.family->version();
    e.params = spec.params.canonical();
    e.arch = arch;
    e.toolchain = prepared.key.toolchain;
    e.key_text = prepared.key.text;
    e.cubin = std::move(compiled->cubin);
    e.size = std::int64_t(e.cubin.size());
    e.checksum = sha256_hex(e.cubin);
    e.lowered_name = compiled->lowered_name;
    e.compile_log = compiled->log;
    e.compile_ms = compiled->compile_ms;
    e.registers = compiled->registers;
    e.shared_bytes = compiled->shared_bytes;
    e.spill_bytes = compiled->spill_bytes;
    if (store_) {
      Status s = store_->put(e);
      if (!s.ok()) {
        std::lock_guard lock(mu_);
        // A full disk or read-only file fails every store: one line in the log, the rest counted
        // (stats: store_failures), and the kernel is served anyway.
        if (++stats_.store_failures == 1)
          std::fprintf(stderr, "kiln: compiled %s but could not store it (further store failures are only counted): %s\n",
                       key.c_str(), s.to_string().c_str());
      }
    }
    if (options_.remote) options_.remote->put_entry(e, std::move(fleet_lock));
    return Artifact{std::move(e), ArtifactSource::compiled};
  }();

  {
    std::lock_guard lock(mu_);
    in_flight_.erase(key);
  }
  {
    std::lock_guard lock(flight->mu);
    flight->result.emplace(result);
    flight->done = true;
  }
  flight->cv.notify_all();
  return result;
}

}  // namespace kiln::jit
