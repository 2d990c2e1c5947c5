// Reporting, cache/daemon access and formatting shared by the commands.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <sstream>

#include "cli/cli.h"
#include "common/paths.h"
#include "kiln/spec.h"

namespace kiln::cli {

void print_error(const std::string& message, const std::string& details) {
  std::string out = "kiln: error: " + message + "\n";
  if (!details.empty()) out += indent_lines(details, "  ");
  // One write so that lines from worker threads or the daemon's log do not interleave mid-line.
  std::fputs(out.c_str(), stderr);
  std::fflush(stderr);
}

void print_warning(const std::string& message) {
  std::fputs(("kiln: warning: " + message + "\n").c_str(), stderr);
  std::fflush(stderr);
}

int report_error(const Status& s, int otherwise) {
  print_error(s.message(), s.details());
  return s.code() == Code::invalid_argument ? k_exit_usage : otherwise;
}

std::unique_ptr<client::DaemonClient> try_daemon(const GlobalOptions& g) {
  if (g.embedded) return nullptr;
  const auto socket = socket_path();
  auto c = client::DaemonClient::connect(socket);
  if (c.ok()) {
    // A daemon serving another cache file (kiln --cache-dir elsewhere) would answer for the wrong
    // cache: then the file the user named wins. A daemon that does not say which file it serves
    // is trusted.
    if (auto st = (*c)->stats(); st.ok()) {
      const auto cache = st->value("cache", nlohmann::json::object());
      if (cache.is_object() && cache.contains("path") && cache["path"].is_string()) {
        std::error_code ec1, ec2;
        const auto theirs = std::filesystem::weakly_canonical(cache["path"].get<std::string>(), ec1);
        const auto ours = std::filesystem::weakly_canonical(cache_file(), ec2);
        if (!ec1 && !ec2 && theirs != ours) {
          print_warning("the daemon at " + socket.string() + " serves " + theirs.string() + ", not " +
                        ours.string() + "; using the cache file directly");
          return nullptr;
        }
      }
    }
    return std::move(c).value();
  }
  // Nothing listening is the ordinary embedded case; anything else (a wedged daemon, a socket we
  // may not use) deserves a word, since the user may believe the daemon serves them.
  if (c.status().code() != Code::unavailable)
    print_warning("the daemon at " + socket.string() + " did not answer (" + c.status().message() +
                  "); using the cache file directly");
  return nullptr;
}

Result<std::unique_ptr<cache::Store>> open_existing_store() {
  const auto file = cache_file();
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) return std::unique_ptr<cache::Store>();
  return cache::Store::open(file);
}

Result<std::vector<const Family*>> resolve_families(const std::vector<std::string>& names) {
  const Registry& reg = Registry::global();
  if (names.empty()) return reg.all();
  std::vector<const Family*> out;
  for (const auto& n : names) {
    if (n.empty()) return invalid_argument("empty family name in --family");
    const Family* f = reg.find(n);
    if (!f) {
      std::string known;
      for (const Family* k : reg.all()) known += (known.empty() ? "" : ", ") + std::string(k->name());
      return invalid_argument("unknown family '" + n + "'",
                              "known families: " + (known.empty() ? "(none)" : known));
    }
    if (std::find(out.begin(), out.end(), f) == out.end()) out.push_back(f);
  }
  return out;
}

Result<std::vector<std::string>> resolve_archs(const std::vector<std::string>& archs) {
  std::vector<std::string> out;
  for (const auto& a : archs) {
    if (Status s = validate_arch(a); !s.ok())
      return invalid_argument("bad --arch '" + a + "': " + s.message());
    if (std::find(out.begin(), out.end(), a) == out.end()) out.push_back(a);
  }
  if (out.empty()) return invalid_argument("--arch needs at least one architecture");
  return out;
}

std::string human_bytes(std::int64_t bytes) {
  if (bytes < 0) return "-";
  char buf[32];
  if (bytes < 1024) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
    return buf;
  }
  static const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes) / 1024.0;
  int u = 0;
  while (v >= 1024.0 && u < 3) {
    v /= 1024.0;
    ++u;
  }
  std::snprintf(buf, sizeof buf, v < 10 ? "%.1f %s" : "%.0f %s", v, units[u]);
  return buf;
}

std::string human_ms(double ms) {
  char buf[32];
  if (ms < 0) return "-";
  if (ms < 1000)
    std::snprintf(buf, sizeof buf, "%.0f ms", ms);
  else
    std::snprintf(buf, sizeof buf, "%.2f s", ms / 1000.0);
  return buf;
}

std::string human_duration(double seconds) {
  if (seconds < 0) return "-";
  auto s = static_cast<std::int64_t>(seconds);
  char buf[48];
  if (s < 60)
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  else if (s < 3600)
    std::snprintf(buf, sizeof buf, "%lldm %llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  else if (s < 86400)
    std::snprintf(buf, sizeof buf, "%lldh %lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s % 3600 / 60));
  else
    std::snprintf(buf, sizeof buf, "%lldd %lldh", static_cast<long long>(s / 86400),
                  static_cast<long long>(s % 86400 / 3600));
  return buf;
}

std::string format_time(std::int64_t unix_s) {
  if (unix_s <= 0) return "never";
  std::time_t t = static_cast<std::time_t>(unix_s);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

std::string format_age(std::int64_t unix_s) {
  if (unix_s <= 0) return "never";
  const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  const std::int64_t d = now - unix_s;
  if (d < 0) return "just now";  // clocks of other writers may be slightly ahead
  if (d < 60) return std::to_string(d) + "s ago";
  if (d < 3600) return std::to_string(d / 60) + "m ago";
  if (d < 86400) return std::to_string(d / 3600) + "h ago";
  return std::to_string(d / 86400) + "d ago";
}

nlohmann::json entry_json(const cache::Entry& e, bool full) {
  nlohmann::json j = {
      {"key", e.key},
      {"spec", e.family + "(" + e.params + ")"},
      {"family", e.family},
      {"family_version", e.family_version},
      {"params", e.params},
      {"arch", e.arch},
      {"toolchain", e.toolchain},
      {"size", e.size},
      {"checksum", e.checksum},
      {"lowered_name", e.lowered_name},
      {"compile_ms", e.compile_ms},
      // -1 means "not known": null says so without a magic number.
      {"registers", e.registers >= 0 ? nlohmann::json(e.registers) : nlohmann::json()},
      {"shared_bytes", e.shared_bytes >= 0 ? nlohmann::json(e.shared_bytes) : nlohmann::json()},
      {"spill_bytes", e.spill_bytes >= 0 ? nlohmann::json(e.spill_bytes) : nlohmann::json()},
      {"created", e.created},
      {"last_used", e.last_used},
      {"hits", e.hits},
  };
  if (full) {
    j["key_text"] = e.key_text;
    j["compile_log"] = e.compile_log;
  }
  return j;
}

nlohmann::json stats_json(const cache::Stats& s) {
  return {{"entries", s.entries}, {"bytes", s.bytes},   {"hits", s.hits},
          {"misses", s.misses},   {"corrupt", s.corrupt}, {"stores", s.stores},
          {"store_errors", s.store_errors}, {"evictions", s.evictions}, {"pinned_entries", s.pinned_entries},
          {"pinned_bytes", s.pinned_bytes}, {"max_bytes", s.max_bytes}};
}

Table::Table(std::vector<std::string> headers, std::vector<bool> right_aligned)
    : headers_(std::move(headers)), right_(std::move(right_aligned)) {
  right_.resize(headers_.size(), false);
}

void Table::add(std::vector<std::string> row) {
  row.resize(headers_.size());
  rows_.push_back(std::move(row));
}

std::string Table::render() const {
  std::vector<std::size_t> w(headers_.size());
  for (std::size_t c = 0; c < headers_.size(); ++c) w[c] = headers_[c].size();
  for (const auto& r : rows_)
    for (std::size_t c = 0; c < r.size(); ++c) w[c] = std::max(w[c], r[c].size());
  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string l;
    for (std::size_t c = 0; c < cells.size(); ++c) {
      const std::string pad(w[c] - cells[c].size(), ' ');
      const bool last = c + 1 == cells.size();
      if (right_[c])
        l += pad + cells[c];
      else
        l += cells[c] + (last ? "" : pad);
      if (!last) l += "  ";
    }
    while (!l.empty() && l.back() == ' ') l.pop_back();
    out += l + "\n";
  };
  line(headers_);
  for (const auto& r : rows_) line(r);
  return out;
}

std::string indent_lines(const std::string& text, const std::string& indent,
                         const std::string& empty_note) {
  if (text.empty()) return empty_note.empty() ? std::string() : indent + empty_note + "\n";
  std::string out;
  std::istringstream in(text);
  std::string l;
  while (std::getline(in, l)) out += indent + l + "\n";
  return out;
}

}  // namespace kiln::cli
