#include "daemon/tuning_service.h"

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <boost/asio/use_awaitable.hpp>

#include "daemon/log.h"
#include "daemon/offload.h"
#include "daemon/protocol.h"
#include "daemon/request_fields.h"
#include "jit/autotune_mode.h"
#include "jit/device_info.h"
#include "jit/tuning_setup.h"
#include "remote/tuning.h"

namespace kiln::daemon {

using boost::asio::awaitable;
using boost::asio::use_awaitable;
using nlohmann::json;

struct TuningService::TuneOutcome {
  Status status;
  cache::TuningRecord record;
};

struct TuningService::LookupOutcome {
  Status status;
  cache::Setup setup;
  std::optional<cache::TuningRecord> record;
};

namespace {

struct ResolveRequest {
  const Family* family = nullptr;
  Problem problem;
  std::string arch, device_name, driver_version, pci;
  jit::AutotuneMode mode = jit::AutotuneMode::off;
};

// The tuned winner as params for `problem`, when it still parses, validates and accepts the
// problem (a bucket's members share a winner, so each member is checked on its own).
std::optional<Params> usable_winner(const Family& family, const std::string& winner, const Problem& problem) {
  auto params = Params::parse(winner);
  if (!params.ok() || !family.validate(*params).ok() || !family.check_problem(*params, problem).ok())
    return std::nullopt;
  return std::move(params).value();
}

// Reads the family and problem of a resolve or tune request, and checks the problem against the
// family before anything is queued.
Status read_tuning_request(const json& req, const Family*& family, Problem& problem) {
  std::string name;
  KILN_TRY(required_string(req, "family", name));
  family = Registry::global().find(name);
  if (!family) return not_found("no kernel family named '" + name + "'");
  auto it = req.find("problem");
  if (it == req.end()) return invalid_argument("missing field 'problem'");
  KILN_ASSIGN_OR_RETURN(problem, problem_from_json(*family, *it));
  return family->check_problem(family->heuristic(problem), problem);
}

Status read_resolve_request(const json& req, ResolveRequest& out) {
  std::string mode_name = "off";
  KILN_TRY(read_tuning_request(req, out.family, out.problem));
  KILN_TRY(required_string(req, "arch", out.arch));
  KILN_TRY(validate_arch(out.arch));
  KILN_TRY(optional_string(req, "device_name", out.device_name));
  KILN_TRY(optional_string(req, "driver_version", out.driver_version));
  KILN_TRY(optional_string(req, "pci_bus_id", out.pci));
  KILN_TRY(optional_string(req, "autotune", mode_name));
  auto mode = jit::parse_autotune_mode(mode_name);
  if (!mode) return invalid_argument("autotune must be off, background or wait (got '" + mode_name + "')");
  out.mode = *mode;
  return {};
}

}  // namespace

Result<std::unique_ptr<TuningService>> TuningService::create(cache::Store& store, jit::Builder& builder,
                                                              WorkPool& aux_pool, bool autotune_all,
                                                              remote::Tier* remote) {
  KILN_ASSIGN_OR_RETURN(auto table, cache::TuningTable::open(store));
  return std::unique_ptr<TuningService>(
      new TuningService(std::move(table), builder, aux_pool, autotune_all, remote));
}

TuningService::TuningService(std::unique_ptr<cache::TuningTable> table, jit::Builder& builder, WorkPool& aux_pool,
                             bool autotune_all, remote::Tier* remote)
    : table_(std::move(table)),
      tuner_(&builder, table_.get()),
      aux_pool_(aux_pool),
      autotune_all_(autotune_all),
      remote_(remote),
      pool_(1, "tune pool") {}

// Runs on the tune pool.
TuningService::TuneOutcome TuningService::tune_now(const Family& family, const Problem& problem, int device,
                                                   const std::string& pci, bool run) {
  TuneOutcome o;
  if (!run) {
    o.status = shutting_down_status();
    return o;
  }
  jit::TuneOptions opts;
  opts.device = device;
  if (!pci.empty()) {
    auto d = jit::device_by_pci(pci);
    if (!d.ok()) {
      o.status = d.status();
      return o;
    }
    opts.device = *d;
  }
  auto r = tuner_.tune(family, problem, opts);
  ++runs_;
  if (!r.ok()) {
    ++run_failures_;
    o.status = r.status();
    log_warn("tuning " + std::string(family.name()) + " " + family.signature(problem) + " failed: " +
             o.status.message());
    return o;
  }
  o.record = std::move(r).value();
  if (remote_) remote::share_winner(*remote_, o.record);
  log_info("tuned " + o.record.family + " " + o.record.signature + ": " +
           (o.record.winner.empty() ? std::string("no candidate ran ok") : o.record.winner + " " +
            format_ms(o.record.winner_ms * 1000.0) + " us (heuristic " + format_ms(o.record.heuristic_ms * 1000.0) +
            " us)") + ", " + std::to_string(o.record.candidates.size()) + " candidates, compile " +
           format_ms(o.record.compile_ms) + " ms, measure " + format_ms(o.record.measure_ms) + " ms");
  return o;
}

awaitable<TuningService::TuneOutcome> TuningService::run_tune(const Family* family, const Problem& problem, int device,
                                                              const std::string& pci) {
  std::vector<std::function<TuneOutcome(bool)>> jobs;
  jobs.push_back([this, family, problem, device, pci](bool run) { return tune_now(*family, problem, device, pci, run); });
  auto out = co_await async_offload<TuneOutcome>(pool_, WorkPool::Lane::interactive, std::move(jobs), use_awaitable);
  co_return std::move(out.front());
}

// Queues background tuning unless it is queued, running or failed already. True when queued.
bool TuningService::queue_tuning(const Family* family, const Problem& problem, const std::string& pci,
                                 const std::string& key) {
  {
    std::lock_guard lock(queue_mu_);
    if (pending_.count(key)) return true;
    if (failed_.count(key)) return false;
    pending_.insert(key);
  }
  pool_.submit(WorkPool::Lane::background, [this, family, problem, pci, key](bool run) {
    TuneOutcome o = tune_now(*family, problem, 0, pci, run);
    std::lock_guard lock(queue_mu_);
    pending_.erase(key);
    if (run && (!o.status.ok() || o.record.winner.empty())) failed_.insert(key);
  });
  return true;
}

// The winner of a tuning run made now (resolve with autotune wait); nullopt if there is none.
awaitable<std::optional<Params>> TuningService::tune_for_resolve(const Family* family, const Problem& problem,
                                                                 const std::string& pci, json& reply) {
  TuneOutcome t = co_await run_tune(family, problem, 0, pci);
  if (!t.status.ok()) {
    reply["tune_error"] = t.status.message();
    co_return std::nullopt;
  }
  co_return usable_winner(*family, t.record.winner, problem);
}

// GCC 12 warns here that asio's coroutine frame is freed by a mismatched operator delete: a false
// positive of its inliner on class-specific frame allocators (the pair does match).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
awaitable<json> TuningService::resolve(const json& req) {
  ResolveRequest q;
  if (Status s = read_resolve_request(req, q); !s.ok()) co_return error_reply(s);
  LookupOutcome found = co_await lookup_tuned(q.family, q.problem, q.arch, q.device_name, q.driver_version);
  if (!found.status.ok()) co_return error_reply(found.status);

  const std::string signature = q.family->signature(q.problem);
  json r = ok_reply();
  r["signature"] = signature;
  std::optional<Params> tuned;
  if (found.record) tuned = usable_winner(*q.family, found.record->winner, q.problem);
  bool queued = false;
  if (!tuned && q.mode == jit::AutotuneMode::wait) {
    tuned = co_await tune_for_resolve(q.family, q.problem, q.pci, r);
  } else if (!tuned && (q.mode == jit::AutotuneMode::background || autotune_all_)) {
    const auto& st = found.setup;
    queued = queue_tuning(q.family, q.problem, q.pci,
                          std::string(q.family->name()) + "|" + signature + "|" + st.arch + "|" + st.device_name +
                              "|" + st.driver_version + "|" + st.toolchain);
  }
  r["params"] = (tuned ? *tuned : q.family->heuristic(q.problem)).canonical();
  r["tuned"] = tuned.has_value();
  r["queued"] = queued;
  co_return r;
}
#pragma GCC diagnostic pop

// A winner another host tuned for exactly this family, signature and setup, kept in the table.
std::optional<cache::TuningRecord> TuningService::remote_winner(const std::string& family, const std::string& signature,
                                                                const cache::Setup& setup) {
  auto rec = remote::fetch_winner(*remote_, *table_, family, signature, setup);
  if (rec) ++remote_hits_;
  return rec;
}

// The setup's fingerprint and the table row for problem's signature, on the cache pool.
awaitable<TuningService::LookupOutcome> TuningService::lookup_tuned(const Family* family, const Problem& problem,
                                                                    const std::string& arch,
                                                                    const std::string& device_name,
                                                                    const std::string& driver_version) {
  const std::string signature = family->signature(problem);
  std::vector<std::function<LookupOutcome(bool)>> jobs;
  jobs.push_back([this, family, problem, arch, device_name, driver_version, signature](bool run) {
    LookupOutcome o;
    if (!run) {
      o.status = shutting_down_status();
      return o;
    }
    auto setup = jit::tuning_setup(*family, problem, arch, device_name, driver_version);
    if (!setup.ok()) {
      o.status = setup.status();
      return o;
    }
    o.setup = *setup;
    auto r = table_->lookup(std::string(family->name()), signature, o.setup);
    if (!r.ok()) {
      o.status = r.status();
      return o;
    }
    o.record = std::move(r).value();
    if (!o.record && remote_) o.record = remote_winner(std::string(family->name()), signature, o.setup);
    return o;
  });
  auto out = co_await async_offload<LookupOutcome>(aux_pool_, WorkPool::Lane::interactive, std::move(jobs), use_awaitable);
  co_return std::move(out.front());
}

awaitable<json> TuningService::tune(const json& req) {
  const Family* family = nullptr;
  Problem problem;
  std::string pci;
  int device = 0;
  Status s = read_tuning_request(req, family, problem);
  if (s.ok()) s = optional_string(req, "pci_bus_id", pci);
  if (s.ok())
    if (auto it = req.find("device"); it != req.end()) {
      if (!it->is_number_integer() || it->get<std::int64_t>() < 0 || it->get<std::int64_t>() > 1024)
        s = invalid_argument("field 'device' must be a device ordinal");
      else
        device = it->get<int>();
    }
  if (!s.ok()) co_return error_reply(s);
  TuneOutcome t = co_await run_tune(family, problem, device, pci);
  if (!t.status.ok()) co_return error_reply(t.status);
  json r = ok_reply();
  r["record"] = tuning_record_to_json(t.record);
  co_return r;
}

}  // namespace kiln::daemon
