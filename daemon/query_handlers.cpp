#include "daemon/query_handlers.h"

#include <utility>
#include <vector>

#include <boost/asio/use_awaitable.hpp>

#include "daemon/metrics.h"
#include "daemon/offload.h"
#include "daemon/protocol.h"
#include "daemon/request_fields.h"

namespace kiln::daemon {

using boost::asio::awaitable;
using boost::asio::use_awaitable;
using nlohmann::json;

namespace {

struct ListOutcome {
  Status status;
  std::vector<cache::Entry> entries;
};

struct StatsOutcome {
  Status status;
  cache::Stats stats;
};

}  // namespace

awaitable<json> QueryHandlers::list(const json& req) {
  cache::ListFilter filter;
  Status s = optional_string(req, "family", filter.family);
  if (s.ok()) s = optional_string(req, "arch", filter.arch);
  if (!s.ok()) co_return error_reply(s);

  std::vector<std::function<ListOutcome(bool)>> jobs;
  jobs.push_back([this, filter](bool run) {
    ListOutcome o;
    if (!run) {
      o.status = shutting_down_status();
      return o;
    }
    auto r = store_.list(filter);
    if (r.ok())
      o.entries = std::move(r).value();
    else
      o.status = r.status();
    return o;
  });
  auto out = co_await async_offload<ListOutcome>(aux_pool_, WorkPool::Lane::interactive, std::move(jobs), use_awaitable);
  if (!out.front().status.ok()) co_return error_reply(out.front().status);
  json entries = json::array();
  for (const auto& e : out.front().entries) entries.push_back(entry_to_json(e));
  json r = ok_reply();
  r["entries"] = std::move(entries);
  co_return r;
}

awaitable<json> QueryHandlers::stats() {
  std::vector<std::function<StatsOutcome(bool)>> jobs;
  jobs.push_back([this](bool run) {
    StatsOutcome o;
    if (!run) {
      o.status = shutting_down_status();
      return o;
    }
    auto r = store_.stats();
    if (r.ok())
      o.stats = *r;
    else
      o.status = r.status();
    return o;
  });
  auto out = co_await async_offload<StatsOutcome>(aux_pool_, WorkPool::Lane::interactive, std::move(jobs), use_awaitable);
  if (!out.front().status.ok()) co_return error_reply(out.front().status);

  json r = ok_reply();
  r["daemon"] = daemon_stats_();
  r["builder"] = builder_stats_to_json(builder_.stats());
  json cache_json = store_stats_to_json(out.front().stats);
  cache_json["path"] = store_.path().string();
  r["cache"] = std::move(cache_json);
  co_return r;
}

}  // namespace kiln::daemon

namespace kiln::daemon {

boost::asio::awaitable<nlohmann::json> QueryHandlers::metrics() {
  nlohmann::json s = co_await stats();
  if (!s.value("ok", false)) co_return s;
  nlohmann::json r = ok_reply();
  r["content_type"] = k_metrics_content_type;
  r["text"] = render_metrics(s);
  co_return r;
}

}  // namespace kiln::daemon
