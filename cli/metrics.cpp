// `kiln metrics`: kiln's counters in the Prometheus text format, from the daemon when it runs and
// from the cache file otherwise.
#include <cstdio>

#include "cli/cli.h"
#include "daemon/metrics.h"
#include "daemon/protocol.h"

namespace kiln::cli {

int run_metrics(const GlobalOptions& g) {
  if (auto daemon = try_daemon(g)) {
    auto text = daemon->metrics();
    if (!text.ok()) return report_error(text.status());
    std::fputs(text->c_str(), stdout);
    return k_exit_ok;
  }
  // Without a daemon only the cache file's own counters exist; an absent file is an empty cache.
  cache::Stats cs;
  auto store = open_existing_store();
  if (!store.ok()) return report_error(store.status());
  if (*store) {
    auto r = (*store)->stats();
    if (!r.ok()) return report_error(r.status());
    cs = *r;
  }
  std::fputs(daemon::render_metrics(nlohmann::json{{"cache", daemon::store_stats_to_json(cs)}}).c_str(), stdout);
  return k_exit_ok;
}

}  // namespace kiln::cli
