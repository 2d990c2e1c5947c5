#include "daemon/build_handlers.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio/use_awaitable.hpp>

#include "daemon/log.h"
#include "daemon/offload.h"
#include "daemon/protocol.h"
#include "daemon/request_fields.h"
#include "kiln/family.h"
#include "kiln/spec.h"

namespace kiln::daemon {

using boost::asio::awaitable;
using boost::asio::use_awaitable;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

constexpr std::size_t k_max_prewarm_errors = 200;

struct BuildOutcome {
  Status status;
  jit::Artifact artifact;
};

std::string short_key(const std::string& key) { return key.substr(0, std::min<std::size_t>(12, key.size())); }

// Runs on a compile worker.
BuildOutcome build(jit::Builder& builder, const KernelSpec& spec, const std::string& arch, bool run) {
  BuildOutcome o;
  if (!run) {
    o.status = shutting_down_status();
    return o;
  }
  auto r = builder.get(spec, arch);
  if (!r.ok()) {
    o.status = r.status();
    log_warn("build " + spec.canonical() + " @ " + arch + " failed: " + code_name(o.status.code()) + ": " +
             o.status.message());
    return o;
  }
  o.artifact = std::move(r).value();
  if (o.artifact.source == jit::ArtifactSource::remote)
    log_info("fetched " + spec.canonical() + " @ " + arch + " from the remote tier (key " + short_key(o.artifact.entry.key) +
             ")");
  else if (o.artifact.source == jit::ArtifactSource::compiled)
    log_info("compiled " + spec.canonical() + " @ " + arch + " in " + format_ms(o.artifact.entry.compile_ms) +
             " ms (" + std::to_string(o.artifact.entry.cubin.size()) + " bytes, key " +
             short_key(o.artifact.entry.key) + ")");
  return o;
}

}  // namespace

awaitable<Reply> BuildHandlers::get(const json& req) {
  Reply reply;
  std::string spec_text, arch;
  Status s = required_string(req, "spec", spec_text);
  if (s.ok()) s = required_string(req, "arch", arch);
  auto spec = KernelSpec::parse(spec_text);
  if (s.ok() && !spec.ok()) s = spec.status();
  if (s.ok()) s = validate_arch(arch);
  // Bad specs fail here, on the I/O thread, before anything is queued or compiled.
  if (s.ok()) {
    auto family = Registry::global().resolve(*spec);
    if (!family.ok()) s = family.status();
  }
  if (!s.ok()) {
    reply.body = error_reply(s);
    co_return reply;
  }

  std::vector<std::function<BuildOutcome(bool)>> jobs;
  jobs.push_back([this, spec = *spec, arch](bool run) { return build(builder_, spec, arch, run); });
  std::vector<BuildOutcome> out =
      co_await async_offload<BuildOutcome>(compile_pool_, WorkPool::Lane::interactive, std::move(jobs), use_awaitable);
  BuildOutcome& o = out.front();
  if (!o.status.ok()) {
    reply.body = error_reply(o.status);
    co_return reply;
  }
  reply.body = ok_reply();
  reply.body["entry"] = entry_to_json(o.artifact.entry);
  reply.body["source"] = source_name(o.artifact.source);
  reply.blob = std::move(o.artifact.entry.cubin);
  co_return reply;
}

awaitable<json> BuildHandlers::prewarm(const json& req) {
  std::vector<std::string> archs, families;
  Status s = string_array(req, "archs", archs);
  if (s.ok()) s = string_array(req, "families", families);
  if (s.ok() && archs.empty()) s = invalid_argument("prewarm needs at least one arch");
  for (const auto& a : archs)
    if (s.ok()) s = validate_arch(a);
  std::vector<const Family*> chosen;
  if (s.ok()) {
    if (families.empty()) {
      chosen = Registry::global().all();
    } else {
      for (const auto& name : families) {
        const Family* f = Registry::global().find(name);
        if (!f) {
          s = not_found("no kernel family named '" + name + "'");
          break;
        }
        chosen.push_back(f);
      }
    }
  }
  if (!s.ok()) co_return error_reply(s);

  // Each arch gets the variants that run on it (catalog_for), not the whole catalog.
  std::vector<std::function<BuildOutcome(bool)>> jobs;
  std::vector<std::string> labels;
  for (const auto& arch : archs)
    for (const Family* f : chosen) {
      auto catalog = catalog_for(*f, arch);
      if (!catalog.ok()) co_return error_reply(catalog.status());
      for (const Params& p : *catalog) {
        KernelSpec spec{std::string(f->name()), p};
        labels.push_back(spec.canonical() + " @ " + arch);
        jobs.push_back([this, spec, arch](bool run) { return build(builder_, spec, arch, run); });
      }
    }
  log_info("prewarm: " + std::to_string(jobs.size()) + " variant(s) for " + std::to_string(archs.size()) +
           " arch(s)");
  const auto t0 = Clock::now();
  std::vector<BuildOutcome> out =
      co_await async_offload<BuildOutcome>(compile_pool_, WorkPool::Lane::background, std::move(jobs), use_awaitable);

  std::int64_t compiled = 0, cached = 0, remote = 0, failed = 0;
  json errors = json::array();
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (!out[i].status.ok()) {
      ++failed;
      if (errors.size() < k_max_prewarm_errors)
        errors.push_back(labels[i] + ": " + code_name(out[i].status.code()) + ": " + out[i].status.message());
    } else if (out[i].artifact.source == jit::ArtifactSource::compiled) {
      ++compiled;
    } else if (out[i].artifact.source == jit::ArtifactSource::remote) {
      ++remote;
    } else {
      ++cached;
    }
  }
  if (failed > static_cast<std::int64_t>(errors.size()))
    errors.push_back("... and " + std::to_string(failed - static_cast<std::int64_t>(errors.size())) +
                     " more failure(s)");
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  log_info("prewarm done in " + format_ms(ms) + " ms: " + std::to_string(compiled) + " compiled, " +
           std::to_string(cached) + " cached, " + std::to_string(remote) + " from the remote tier, " + std::to_string(failed) + " failed");
  json r = ok_reply();
  r["requested"] = static_cast<std::int64_t>(out.size());
  r["compiled"] = compiled;
  r["cached"] = cached;
  r["remote"] = remote;
  r["failed"] = failed;
  r["errors"] = std::move(errors);
  r["elapsed_ms"] = ms;
  co_return r;
}

}  // namespace kiln::daemon
