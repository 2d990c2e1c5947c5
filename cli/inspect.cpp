// Read-side commands: ls, show, why, stats, verify.
#include <algorithm>
#include <functional>
#include <cctype>
#include <cstdio>
#include <iostream>

#include "cli/cli.h"
#include "common/paths.h"
#include "common/sha256.h"
#include "jit/builder.h"
#include "kiln/spec.h"

namespace kiln::cli {
namespace {

// "name   value" lines with the names padded to one column.
class Fields {
 public:
  void add(std::string name, std::string value) { rows_.emplace_back(std::move(name), std::move(value)); }
  std::string render(const std::string& indent = "") const {
    std::size_t w = 0;
    for (const auto& [n, v] : rows_) w = std::max(w, n.size());
    std::string out;
    for (const auto& [n, v] : rows_) out += indent + n + std::string(w - n.size() + 2, ' ') + v + "\n";
    return out;
  }

 private:
  std::vector<std::pair<std::string, std::string>> rows_;
};

std::string or_dash(int v) { return v >= 0 ? std::to_string(v) : "-"; }

bool is_hex(const std::string& s) {
  for (unsigned char c : s)
    if (!std::isxdigit(c)) return false;
  return true;
}

}  // namespace

int run_ls(const GlobalOptions& g, const ListOptions& o) {
  if (!o.arch.empty())
    if (Status s = validate_arch(o.arch); !s.ok())
      return report_error(invalid_argument("bad --arch '" + o.arch + "': " + s.message()), k_exit_usage);
  // --family is not checked against the registry: the cache may hold variants of plugin families
  // that this process has not loaded.
  const cache::ListFilter filter{o.family, o.arch};

  std::vector<cache::Entry> entries;
  std::string source;
  if (auto daemon = try_daemon(g)) {
    auto r = daemon->list(filter);
    if (!r.ok()) return report_error(r.status());
    entries = std::move(r).value();
    source = "kilnd at " + socket_path().string();
  } else {
    auto store = open_existing_store();
    if (!store.ok()) return report_error(store.status());
    if (*store) {
      auto r = (*store)->list(filter);
      if (!r.ok()) return report_error(r.status());
      entries = std::move(r).value();
    }
    source = cache_file().string();
  }

  if (o.json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const auto& e : entries) arr.push_back(entry_json(e, false));
    std::cout << arr.dump(2) << "\n";
    return k_exit_ok;
  }
  if (entries.empty()) {
    std::fprintf(stderr, "kiln: no cached variants%s (%s)\n",
                 (o.family.empty() && o.arch.empty()) ? "" : " match the filter", source.c_str());
    return k_exit_ok;
  }
  Table t({"KEY", "FAMILY", "PARAMS", "ARCH", "SIZE", "REGS", "COMPILE", "HITS", "LAST USED"},
          {false, false, false, false, true, true, true, true, false});
  std::int64_t total = 0;
  for (const auto& e : entries) {
    t.add({e.key.substr(0, 12), e.family, e.params, e.arch, human_bytes(e.size), or_dash(e.registers),
           human_ms(e.compile_ms), std::to_string(e.hits), format_age(e.last_used)});
    total += e.size;
  }
  std::cout << t.render();
  std::cout << entries.size() << " variant" << (entries.size() == 1 ? "" : "s") << ", "
            << human_bytes(total) << " (" << source << ")\n";
  return k_exit_ok;
}

int run_show(const GlobalOptions& g, const ShowOptions& o) {
  if (o.key.empty() || !is_hex(o.key))
    return report_error(invalid_argument("bad key '" + o.key + "': expected hex digits (a key or a prefix of one)"),
                        k_exit_usage);
  // The daemon has no call for one entry with its blob; SQLite (WAL) lets us read alongside it.
  auto store = open_existing_store();
  if (!store.ok()) return report_error(store.status());
  if (!*store) {
    print_error("no cached entry with key '" + o.key + "'", "there is no cache file at " + cache_file().string());
    return k_exit_failure;
  }
  std::string key = o.key;
  for (auto& c : key) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  auto r = (*store)->show(key);
  // An ambiguous prefix is the store's invalid_argument: the user's to fix, hence exit 2.
  if (!r.ok()) return report_error(r.status());
  if (!r->has_value()) {
    print_error("no cached entry with key '" + o.key + "'", "in " + cache_file().string());
    return k_exit_failure;
  }
  const cache::Entry& e = **r;
  // show() does not verify; say here whether the blob still matches what was stored.
  const std::string actual = sha256_hex(e.cubin);
  const bool size_ok = static_cast<std::int64_t>(e.cubin.size()) == e.size;
  const bool sum_ok = actual == e.checksum;

  if (o.json) {
    nlohmann::json j = entry_json(e, true);
    j["blob_size"] = static_cast<std::int64_t>(e.cubin.size());
    j["blob_checksum"] = actual;
    j["intact"] = size_ok && sum_ok;
    std::cout << j.dump(2) << "\n";
    return k_exit_ok;
  }
  Fields f;
  f.add("key", e.key);
  f.add("spec", e.family + "(" + e.params + ")");
  f.add("family", e.family + " (version " + std::to_string(e.family_version) + ")");
  f.add("params", e.params);
  f.add("arch", e.arch);
  f.add("toolchain", e.toolchain);
  f.add("size", std::to_string(e.size) + " bytes (" + human_bytes(e.size) + ")");
  f.add("checksum", "sha256 " + e.checksum);
  std::string integrity = size_ok && sum_ok ? "ok (size and checksum match)" : "BAD:";
  if (!size_ok) integrity += " blob has " + std::to_string(e.cubin.size()) + " bytes, " + std::to_string(e.size) + " stored;";
  if (!sum_ok) integrity += " blob hashes to " + actual;
  f.add("integrity", integrity);
  f.add("lowered name", e.lowered_name);
  f.add("registers", or_dash(e.registers));
  f.add("shared bytes", or_dash(e.shared_bytes));
  f.add("spill bytes", or_dash(e.spill_bytes));
  f.add("compile time", human_ms(e.compile_ms));
  f.add("created", format_time(e.created));
  f.add("last used", format_time(e.last_used) + (e.last_used > 0 ? " (" + format_age(e.last_used) + ")" : ""));
  f.add("hits", std::to_string(e.hits));
  std::cout << f.render() << "\nkey text (the lines the key hashes):\n"
            << indent_lines(e.key_text, "  ", "(not recorded)") << "\ncompile log:\n"
            << indent_lines(e.compile_log, "  ", "(empty)");
  return k_exit_ok;
}

int run_why(const GlobalOptions& g, const WhyOptions& o) {
  auto spec = KernelSpec::parse(o.spec);
  if (!spec.ok())
    return report_error(invalid_argument("bad spec '" + o.spec + "': " + spec.status().message(),
                                         spec.status().details()),
                        k_exit_usage);
  if (Status s = validate_arch(o.arch); !s.ok())
    return report_error(invalid_argument("bad --arch '" + o.arch + "': " + s.message()), k_exit_usage);

  jit::Builder builder(nullptr, &Registry::global());
  auto text = builder.key_text(*spec, o.arch);
  if (!text.ok()) {
    // An unknown family is the user's mistake just like a malformed spec.
    const bool user = text.status().code() == Code::invalid_argument || text.status().code() == Code::not_found;
    print_error(text.status().message(), text.status().details());
    return user ? k_exit_usage : k_exit_failure;
  }
  // Builder::key_text answers "<key>\n<key text>"; the key is the SHA-256 of the text (jit/key.h).
  std::string key, lines = *text;
  if (auto nl = lines.find('\n'); nl == 64 && is_hex(lines.substr(0, 64))) {
    key = lines.substr(0, 64);
    lines.erase(0, 65);
  } else {
    key = sha256_hex(lines);
  }

  // Whether it is cached is part of the explanation; a lookup without counting a hit (show()).
  std::optional<cache::Entry> cached;
  if (auto store = open_existing_store(); store.ok() && *store) {
    if (auto r = (*store)->show(key); r.ok() && r->has_value()) cached = std::move(**r);
  }

  if (o.json) {
    nlohmann::json j = {{"spec", spec->canonical()}, {"arch", o.arch}, {"key", key},
                        {"key_text", lines}, {"cached", cached.has_value()}};
    std::cout << j.dump(2) << "\n";
    return k_exit_ok;
  }
  Fields f;
  f.add("spec", spec->canonical());
  f.add("arch", o.arch);
  f.add("key", key);
  f.add("cached", cached ? "yes (" + std::to_string(cached->hits) + " hits, last used " +
                              format_age(cached->last_used) + ")"
                         : "no");
  std::cout << f.render() << "\nkey text (sha256 of these lines is the key):\n" << indent_lines(lines, "  ");
  return k_exit_ok;
}

int run_stats(const GlobalOptions& g, bool json) {
  cache::Stats cs;
  bool have_file = false;
  {
    auto store = open_existing_store();
    if (!store.ok()) return report_error(store.status());
    if (*store) {
      auto r = (*store)->stats();
      if (!r.ok()) return report_error(r.status());
      cs = *r;
      have_file = true;
    }
  }
  std::optional<nlohmann::json> ds;
  Status daemon_error;
  if (auto daemon = try_daemon(g)) {
    auto r = daemon->stats();
    if (r.ok())
      ds = std::move(r).value();
    else
      daemon_error = r.status();
  }

  const std::string socket = socket_path().string();
  if (json) {
    nlohmann::json j = {{"cache_file", cache_file().string()}, {"cache_file_exists", have_file},
                        {"cache", stats_json(cs)}};
    nlohmann::json d = {{"running", ds.has_value()}, {"socket", socket}};
    if (ds) d["stats"] = *ds;
    if (!daemon_error.ok()) d["error"] = daemon_error.to_string();
    j["daemon"] = std::move(d);
    std::cout << j.dump(2) << "\n";
  } else {
    Fields f;
    f.add("cache file", cache_file().string() + (have_file ? "" : " (does not exist yet)"));
    f.add("entries", std::to_string(cs.entries));
    f.add("bytes", std::to_string(cs.bytes) + " (" + human_bytes(cs.bytes) + ")");
    f.add("hits", std::to_string(cs.hits));
    f.add("misses", std::to_string(cs.misses));
    f.add("corrupt", std::to_string(cs.corrupt));
    f.add("stores", std::to_string(cs.stores));
    f.add("store_errors", std::to_string(cs.store_errors));
    f.add("evictions", std::to_string(cs.evictions));
    f.add("pinned", std::to_string(cs.pinned_entries) + " entries, " + human_bytes(cs.pinned_bytes));
    f.add("size cap", cs.max_bytes > 0 ? human_bytes(cs.max_bytes) + " (KILN_CACHE_MAX_MB)" : "none");
    std::cout << f.render();
    if (ds) {
      std::cout << "\ndaemon: running at " << socket << "\n";
      // The daemon's stats are sections of values, some of them objects (daemon.remote): print
      // them as they come, nested names joined by dots.
      Fields df;
      std::function<void(const std::string&, const nlohmann::json&)> add = [&](const std::string& name,
                                                                              const nlohmann::json& v) {
        if (v.is_object() && !v.empty()) {
          for (const auto& [k, sub] : v.items()) add(name.empty() ? k : name + "." + k, sub);
          return;
        }
        df.add(name, v.is_string() ? v.get<std::string>() : v.dump());
      };
      add("", *ds);
      std::cout << df.render("  ");
    } else {
      std::cout << "\ndaemon: not running (" << socket << ")\n";
    }
  }
  if (!daemon_error.ok()) {
    print_error("the daemon answered but its stats failed: " + daemon_error.message(), daemon_error.details());
    return k_exit_failure;
  }
  return k_exit_ok;
}

int run_verify(const GlobalOptions& g, bool json) {
  auto store = open_existing_store();
  if (!store.ok()) return report_error(store.status());
  cache::VerifyReport rep;
  if (*store) {
    auto r = (*store)->verify();
    if (!r.ok()) return report_error(r.status());
    rep = std::move(r).value();
  } else {
    rep.integrity = "ok";  // no file, nothing that can be bad
  }
  const bool good = rep.integrity == "ok" && rep.bad_keys.empty();
  if (json) {
    nlohmann::json j = {{"cache_file", cache_file().string()}, {"cache_file_exists", *store != nullptr},
                        {"integrity", rep.integrity},          {"checked", rep.checked},
                        {"bad_keys", rep.bad_keys},            {"ok", good}};
    std::cout << j.dump(2) << "\n";
  } else {
    Fields f;
    f.add("cache file", cache_file().string() + (*store ? "" : " (does not exist yet)"));
    f.add("integrity", rep.integrity);
    f.add("checked", std::to_string(rep.checked) + " entries");
    f.add("bad", std::to_string(rep.bad_keys.size()) +
                     (rep.bad_keys.empty() ? "" : " (dropped: recompiled on next use or prewarm)"));
    std::cout << f.render();
    for (const auto& k : rep.bad_keys) std::cout << "  " << k << "\n";
    std::cout << (good ? "verify: ok\n" : "verify: FAILED\n");
  }
  if (good) return k_exit_ok;
  std::string details;
  if (rep.integrity != "ok") details += "integrity_check: " + rep.integrity + "\n";
  for (const auto& k : rep.bad_keys) details += "bad blob (size or checksum): " + k + "\n";
  print_error("the cache has " + std::to_string(rep.bad_keys.size()) + " bad entr" +
                  (rep.bad_keys.size() == 1 ? "y" : "ies") +
                  (rep.integrity == "ok" ? "" : " and failed its integrity check"),
              details);
  return k_exit_failure;
}

}  // namespace kiln::cli
