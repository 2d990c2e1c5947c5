#include "daemon/metrics.h"

#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace kiln::daemon {
namespace {

using nlohmann::json;

// The shortest text that reads back as `v` ("0.05", not "0.050000000000000003").
std::string number(double v) {
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

double num(const json& obj, const char* name) {
  if (!obj.is_object()) return 0;
  auto it = obj.find(name);
  return it != obj.end() && it->is_number() ? it->get<double>() : 0;
}

class Writer {
 public:
  void family(const char* name, const char* type, const char* help) {
    out_ += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void sample(const std::string& name, double v, const std::string& labels = {}) {
    out_ += name + (labels.empty() ? "" : "{" + labels + "}") + " " + number(v) + "\n";
  }
  void one(const char* name, const char* type, const char* help, double v) {
    family(name, type, help);
    sample(name, v);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

void builder_series(Writer& w, const json& b, const json* remote) {
  w.one("kiln_build_requests_total", "counter", "Kernel requests the builder served.", num(b, "requests"));
  w.family("kiln_cache_hits_total", "counter", "Kernel requests served by each cache tier.");
  w.sample("kiln_cache_hits_total", num(b, "cache_hits"), "tier=\"local\"");
  if (remote) w.sample("kiln_cache_hits_total", num(b, "remote_hits"), "tier=\"remote\"");
  w.family("kiln_cache_misses_total", "counter", "Kernel requests each cache tier could not serve.");
  w.sample("kiln_cache_misses_total", num(b, "cache_misses"), "tier=\"local\"");
  if (remote) w.sample("kiln_cache_misses_total", num(b, "remote_misses"), "tier=\"remote\"");
  w.one("kiln_coalesced_requests_total", "counter", "Requests that joined another request's compile.",
        num(b, "coalesced"));
  w.one("kiln_compiles_total", "counter", "NVRTC compiles run.", num(b, "compiles"));
  w.one("kiln_compile_failures_total", "counter", "NVRTC compiles that failed.", num(b, "compile_failures"));
  w.one("kiln_store_failures_total", "counter", "Kernels compiled but not stored in the local cache.",
        num(b, "store_failures"));
  const json& h = b.contains("compile_seconds") ? b["compile_seconds"] : json();
  if (h.is_object() && h["buckets"].is_array() && h["counts"].is_array() &&
      h["counts"].size() == h["buckets"].size() + 1) {
    w.family("kiln_compile_seconds", "histogram", "NVRTC time of successful compiles.");
    double cumulative = 0;
    for (std::size_t i = 0; i < h["counts"].size(); ++i) {
      cumulative += h["counts"][i].get<double>();
      const std::string le = i < h["buckets"].size() ? number(h["buckets"][i].get<double>()) : "+Inf";
      w.sample("kiln_compile_seconds_bucket", cumulative, "le=\"" + le + "\"");
    }
    w.sample("kiln_compile_seconds_sum", num(h, "sum"));
    w.sample("kiln_compile_seconds_count", cumulative);
  }
}

void daemon_series(Writer& w, const json& d) {
  w.one("kiln_daemon_uptime_seconds", "gauge", "Seconds since kilnd started.", num(d, "uptime_s"));
  w.one("kiln_daemon_requests_total", "counter", "Protocol requests kilnd received.", num(d, "requests"));
  w.one("kiln_daemon_request_errors_total", "counter", "Protocol requests answered with an error.", num(d, "errors"));
  w.one("kiln_daemon_connections", "gauge", "Open client connections.", num(d, "active_connections"));
  w.one("kiln_compile_queue_depth", "gauge", "Compile jobs waiting for a compile thread.", num(d, "compiles_queued"));
  w.one("kiln_compiles_running", "gauge", "Compile jobs running now.", num(d, "compiles_running"));
  w.one("kiln_compile_timeouts_total", "counter", "Compiles cancelled at their deadline.", num(d, "compile_timeouts"));
  w.one("kiln_tuning_runs_total", "counter", "Autotuning runs finished.", num(d, "tuning_runs"));
  w.one("kiln_tuning_failures_total", "counter", "Autotuning runs that failed.", num(d, "tuning_failures"));
  w.one("kiln_tuning_remote_hits_total", "counter", "Tuned winners taken from the remote tier.",
        num(d, "tuning_remote_hits"));
}

void cache_series(Writer& w, const json& c) {
  w.one("kiln_cache_entries", "gauge", "Kernels in the local cache file.", num(c, "entries"));
  w.one("kiln_cache_bytes", "gauge", "Bytes of cubins in the local cache file.", num(c, "bytes"));
  w.one("kiln_cache_evictions_total", "counter", "Entries evicted to keep the cache under its cap (all processes).",
        num(c, "evictions"));
  w.one("kiln_cache_corrupt_total", "counter", "Local entries that failed their checksum and were dropped (all processes).",
        num(c, "corrupt"));
  w.one("kiln_cache_file_hits_total", "counter", "Lookups the cache file answered (all processes).", num(c, "hits"));
  w.one("kiln_cache_file_misses_total", "counter", "Lookups the cache file missed (all processes).", num(c, "misses"));
}

void remote_series(Writer& w, const json& r) {
  w.one("kiln_remote_up", "gauge", "1 when the remote tier is in use, 0 while it backs off.",
        r.value("up", false) ? 1.0 : 0.0);
  w.one("kiln_remote_lookups_total", "counter", "Reads the remote tier answered (hit or miss).", num(r, "lookups"));
  w.one("kiln_remote_rejected_total", "counter", "Remote records that failed verification and were not used.",
        num(r, "rejected"));
  w.family("kiln_remote_errors_total", "counter", "Remote tier failures by kind.");
  w.sample("kiln_remote_errors_total", num(r, "timeouts"), "kind=\"timeout\"");
  w.sample("kiln_remote_errors_total", num(r, "errors") - num(r, "tls_errors"), "kind=\"connection\"");
  w.sample("kiln_remote_errors_total", num(r, "tls_errors"), "kind=\"tls\"");
  w.sample("kiln_remote_errors_total", num(r, "write_errors"), "kind=\"write\"");
  w.sample("kiln_remote_errors_total", num(r, "full"), "kind=\"full\"");
  w.one("kiln_remote_skipped_total", "counter", "Reads not sent because the remote tier was backing off.",
        num(r, "skipped"));
  w.one("kiln_remote_outages_total", "counter", "Times the remote tier went local-only.", num(r, "outages"));
  w.one("kiln_remote_writes_total", "counter", "Records written back to the remote tier.", num(r, "writes"));
  w.one("kiln_remote_writes_dropped_total", "counter", "Write-backs dropped (queue full, backing off).",
        num(r, "writes_dropped"));
  w.one("kiln_remote_pending_writes", "gauge", "Write-backs queued now.", num(r, "pending_writes"));
  w.one("kiln_remote_locks_won_total", "counter", "Compile locks this host took: it compiled for the fleet.",
        num(r, "locks_won"));
  w.one("kiln_remote_lock_waits_total", "counter", "Misses that waited for another host's compile.",
        num(r, "locks_waited"));
  w.one("kiln_remote_lock_wait_hits_total", "counter", "Waits that ended with the other host's kernel.",
        num(r, "lock_wait_hits"));
  w.one("kiln_remote_lock_timeouts_total", "counter", "Waits that ran out; the kernel was compiled here.",
        num(r, "lock_timeouts"));
}

}  // namespace

std::string render_metrics(const json& stats) {
  Writer w;
  const json* remote = nullptr;
  if (stats.contains("daemon") && stats["daemon"].is_object() && stats["daemon"].contains("remote") &&
      stats["daemon"]["remote"].is_object())
    remote = &stats["daemon"]["remote"];
  if (stats.contains("builder") && stats["builder"].is_object()) builder_series(w, stats["builder"], remote);
  if (stats.contains("daemon") && stats["daemon"].is_object()) daemon_series(w, stats["daemon"]);
  if (stats.contains("cache") && stats["cache"].is_object()) cache_series(w, stats["cache"]);
  if (remote) remote_series(w, *remote);
  return w.take();
}

}  // namespace kiln::daemon
