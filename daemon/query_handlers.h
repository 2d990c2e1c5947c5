// The requests that only read: `list` (the cache's entries), `stats` (the daemon's, the
// builder's and the cache's counters) and `metrics` (the same for Prometheus). The SQLite queries run on the cache pool.
#pragma once

#include <functional>
#include <utility>

#include <boost/asio/awaitable.hpp>
#include <nlohmann/json.hpp>

#include "cache/store.h"
#include "daemon/work_pool.h"
#include "jit/builder.h"

namespace kiln::daemon {

class QueryHandlers {
 public:
  // `daemon_stats` gives the "daemon" object of a stats reply; it is called on the I/O thread. The
  // references are not owned and must outlive every request.
  QueryHandlers(cache::Store& store, const jit::Builder& builder, WorkPool& aux_pool,
                std::function<nlohmann::json()> daemon_stats)
      : store_(store), builder_(builder), aux_pool_(aux_pool), daemon_stats_(std::move(daemon_stats)) {}

  boost::asio::awaitable<nlohmann::json> list(const nlohmann::json& req);
  boost::asio::awaitable<nlohmann::json> stats();
  // The stats in the Prometheus text format (daemon/metrics.h), as the reply's "text".
  boost::asio::awaitable<nlohmann::json> metrics();

 private:
  cache::Store& store_;
  const jit::Builder& builder_;
  WorkPool& aux_pool_;
  std::function<nlohmann::json()> daemon_stats_;
};

}  // namespace kiln::daemon
