// Tuning in kilnd (docs/autotune.md): the `resolve` and `tune` requests and the background tuning
// queue.
//
// Tuning runs on a pool of its own with one thread: runs go one at a time (the GPU lock would
// serialize them anyway), `tune` requests and resolve-and-wait on the interactive lane, queued
// background tuning behind them. A signature whose background tuning failed is not queued again
// until kilnd restarts, so a family that cannot be tuned here costs one attempt, not one per
// client. Requests are served on the I/O thread; the queue is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include <boost/asio/awaitable.hpp>
#include <nlohmann/json.hpp>

#include "cache/store.h"
#include "cache/tuning.h"
#include "daemon/work_pool.h"
#include "jit/autotune.h"
#include "jit/builder.h"
#include "kiln/family.h"
#include "kiln/status.h"
#include "remote/signed.h"
#include "remote/tier.h"

namespace kiln::daemon {

struct TuningCounters {
  std::int64_t runs = 0;          // tuning runs finished (any outcome)
  std::int64_t run_failures = 0;  // runs that ended in an error
  std::int64_t remote_hits = 0;   // winners taken from the remote tier instead of tuning here
};

class TuningService {
 public:
  // Opens the tuning table in `store`. `aux_pool` runs the table lookups. `autotune_all` queues
  // background tuning for every resolve without a tuned winner, whatever the client asked (kilnd
  // --autotune). `remote` (may be null) is asked for winners the table lacks and given every
  // winner tuned here. Nothing is owned; everything must outlive the service.
  static Result<std::unique_ptr<TuningService>> create(cache::Store& store, jit::Builder& builder, WorkPool& aux_pool,
                                                       bool autotune_all, remote::Tier* remote = nullptr);
  TuningService(const TuningService&) = delete;
  TuningService& operator=(const TuningService&) = delete;

  boost::asio::awaitable<nlohmann::json> resolve(const nlohmann::json& req);
  boost::asio::awaitable<nlohmann::json> tune(const nlohmann::json& req);

  // Cancels queued tuning (see WorkPool::stop); a running one finishes.
  void stop() { pool_.stop(); }
  void join() { pool_.join(); }

  TuningCounters counters() const {
    return {runs_.load(), run_failures_.load(), remote_hits_.load()};
  }

 private:
  struct TuneOutcome;
  struct LookupOutcome;

  TuningService(std::unique_ptr<cache::TuningTable> table, jit::Builder& builder, WorkPool& aux_pool,
                bool autotune_all, remote::Tier* remote);

  TuneOutcome tune_now(const Family& family, const Problem& problem, int device, const std::string& pci, bool run);
  boost::asio::awaitable<TuneOutcome> run_tune(const Family* family, const Problem& problem, int device,
                                               const std::string& pci);
  bool queue_tuning(const Family* family, const Problem& problem, const std::string& pci, const std::string& key);
  boost::asio::awaitable<std::optional<Params>> tune_for_resolve(const Family* family, const Problem& problem,
                                                                 const std::string& pci, nlohmann::json& reply);
  std::optional<cache::TuningRecord> remote_winner(const std::string& family, const std::string& signature,
                                                   const cache::Setup& setup);
  boost::asio::awaitable<LookupOutcome> lookup_tuned(const Family* family, const Problem& problem,
                                                     const std::string& arch, const std::string& device_name,
                                                     const std::string& driver_version);

  std::unique_ptr<cache::TuningTable> table_;
  jit::Tuner tuner_;
  WorkPool& aux_pool_;
  const bool autotune_all_;
  remote::Tier* remote_;
  std::atomic<std::int64_t> runs_{0}, run_failures_{0}, remote_hits_{0};
  // Signatures (with their setup) whose background tuning is queued or running, and those whose
  // tuning failed.
  std::mutex queue_mu_;
  std::set<std::string> pending_;
  std::set<std::string> failed_;
  // Last: destroyed (and joined) first, while what its jobs use still exists.
  WorkPool pool_;
};

}  // namespace kiln::daemon
