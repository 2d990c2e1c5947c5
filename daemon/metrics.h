// Prometheus text exposition (format 0.0.4) of kiln's counters.
//
// The input is a stats reply (docs/protocol.md, `stats`): "cache" (the cache file's counters) is
// always there; "builder", "daemon" and "remote" when a daemon (with a remote tier) produced it.
// Missing parts give no series. Shared by kilnd's `metrics` request, its HTTP listener and
// `kiln metrics` without a daemon.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace kiln::daemon {

inline constexpr const char* k_metrics_content_type = "text/plain; version=0.0.4; charset=utf-8";

std::string render_metrics(const nlohmann::json& stats);

}  // namespace kiln::daemon
