// `kiln tune`, `kiln ls --tuned` and `kiln prewarm --problems`: tuning now, through kilnd when it
// runs (it owns the GPU lock and the table) or in-process otherwise. In-process, a remote tier
// configured in the environment (KILN_REMOTE) is used as kilnd uses its own: candidates are read
// through it and written back, and every winner tuned here is shared with the fleet.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "cache/tuning.h"
#include "cli/cli.h"
#include "common/paths.h"
#include "daemon/protocol.h"
#include "jit/autotune.h"
#include "jit/builder.h"
#include "jit/device_info.h"
#include "remote/config.h"
#include "remote/tier.h"
#include "remote/tuning.h"

namespace kiln::cli {
namespace {

struct TuneItem {
  const Family* family = nullptr;
  Problem problem;
};

// "rows=4096,cols=4096" -> named sizes; the family decides what is missing.
Result<std::vector<std::pair<std::string, std::int64_t>>> parse_shape(const std::string& text) {
  std::vector<std::pair<std::string, std::int64_t>> out;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    const auto eq = part.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == part.size())
      return invalid_argument("bad shape '" + text + "': expected name=size pairs separated by commas");
    const std::string value = part.substr(eq + 1);
    std::size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != value.size() || v < 0)
      return invalid_argument("bad shape '" + text + "': size '" + value + "' is not a non-negative integer");
    out.emplace_back(part.substr(0, eq), v);
  }
  if (out.empty()) return invalid_argument("empty shape");
  return out;
}

// The tuning device's facts as a problem carries them (kiln/problem.h); none when no driver or
// device answers (the tuning itself then fails with that error).
void set_device_facts(Problem& p, int device) {
  if (auto dev = jit::device_info(device); dev.ok()) jit::set_device(p, **dev);
}

// A problem from the command line (or a problems file), checked against the family's heuristic so
// that a bad shape fails before anything is compiled or launched. The device facts are the tuning
// device's, so that the candidates and the timings are this GPU's.
Result<TuneItem> make_item(const std::string& family_name, const std::string& dtype_text, const std::string& shape,
                           int device) {
  KILN_ASSIGN_OR_RETURN(auto fams, resolve_families({family_name}));
  TuneItem item;
  item.family = fams.front();
  auto dtype = parse_dtype(dtype_text);
  if (!dtype || !is_floating(*dtype)) return invalid_argument("bad dtype '" + dtype_text + "': expected f32, f16 or bf16");
  KILN_ASSIGN_OR_RETURN(auto named, parse_shape(shape));
  KILN_ASSIGN_OR_RETURN(item.problem, item.family->problem_from_shape(*dtype, named));
  set_device_facts(item.problem, device);
  KILN_TRY(item.family->check_problem(item.family->heuristic(item.problem), item.problem));
  return item;
}

Result<std::vector<TuneItem>> items_from_options(const TuneCliOptions& o) {
  if (o.all == !o.shape.empty())
    return invalid_argument(o.all ? "give either --shape or --all, not both" : "give --shape SIZES or --all");
  if (!o.all) {
    KILN_ASSIGN_OR_RETURN(TuneItem item, make_item(o.family, o.dtype, o.shape, o.device));
    return std::vector<TuneItem>{item};
  }
  KILN_ASSIGN_OR_RETURN(auto fams, resolve_families({o.family}));
  auto dtype = parse_dtype(o.dtype);
  if (!dtype || !is_floating(*dtype)) return invalid_argument("bad dtype '" + o.dtype + "': expected f32, f16 or bf16");
  std::vector<TuneItem> items;
  for (Problem p : fams.front()->benchmark_problems(*dtype)) {
    set_device_facts(p, o.device);
    KILN_TRY(fams.front()->check_problem(fams.front()->heuristic(p), p));
    items.push_back({fams.front(), p});
  }
  if (items.empty()) return invalid_argument("family " + o.family + " declares no benchmark shapes; use --shape");
  return items;
}

std::string us(double ms) {
  if (ms < 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", ms * 1000.0);
  return buf;
}

void print_record(const cache::TuningRecord& r) {
  std::printf("%s %s (%s) on %s, %s\n", r.family.c_str(), r.signature.c_str(), r.problem.c_str(),
              r.setup.device_name.c_str(), r.setup.arch.c_str());
  Table t({"RANK", "PARAMS", "STATUS", "MEDIAN_US", "SPREAD", "LAUNCHES", "NOTE"},
          {true, false, false, true, true, true, false});
  int rank = 0;
  for (const auto& c : r.candidates) {
    std::string note = c.params == r.winner ? "winner" : "";
    if (c.params == r.heuristic) note += note.empty() ? "heuristic" : ", heuristic";
    if (!c.error.empty()) note += (note.empty() ? "" : "; ") + c.error;
    char spread[16];
    std::snprintf(spread, sizeof spread, "%.1f%%", c.spread * 100);
    const bool ok = c.status == cache::CandidateStatus::ok;
    t.add({ok ? std::to_string(++rank) : "-", c.params, cache::candidate_status_name(c.status), us(ok ? c.median_ms : -1),
           ok ? spread : "-", ok ? std::to_string(c.launches) : "-", note});
  }
  std::cout << t.render();
  if (r.winner.empty()) {
    std::printf("no winner: no candidate ran ok\n\n");
    return;
  }
  std::string speedup = "-";
  if (r.heuristic_ms > 0 && r.winner_ms > 0) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3fx", r.heuristic_ms / r.winner_ms);
    speedup = buf;
  }
  std::printf("winner %s: %s us, heuristic %s: %s us (%s); compile %s, measure %s; ties within %.0f%%\n\n",
              r.winner.c_str(), us(r.winner_ms).c_str(), r.heuristic.c_str(), us(r.heuristic_ms).c_str(),
              speedup.c_str(), human_ms(r.compile_ms).c_str(), human_ms(r.measure_ms).c_str(), r.noise_band * 100);
}

// Tunes every item (daemon or in-process), prints as it goes; exit code per the CLI's contract.
int tune_items(const GlobalOptions& g, const std::vector<TuneItem>& items, int device, bool json) {
  std::unique_ptr<cache::Store> store;
  std::unique_ptr<cache::TuningTable> table;
  // Declared before the builder so that it outlives it; its destructor sends the write-backs
  // still queued when tuning ends.
  std::unique_ptr<remote::Tier> tier;
  std::unique_ptr<jit::Builder> builder;
  auto daemon = try_daemon(g);
  std::string via = daemon ? "kilnd at " + socket_path().string() : "in-process on " + cache_file().string();
  if (!daemon) {
    // kilnd tunes with its own remote tier; in-process, the environment's is checked first, so
    // that a wrong setting (an unsafe fleet key file, say) stops before anything is opened.
    auto remote_config = remote::config_from_env();
    if (!remote_config.ok()) return report_error(remote_config.status(), k_exit_usage);
    auto st = cache::Store::open(cache_file());
    if (!st.ok()) return report_error(st.status());
    store = std::move(st).value();
    auto t = cache::TuningTable::open(*store);
    if (!t.ok()) return report_error(t.status());
    table = std::move(t).value();
    if (*remote_config) {
      tier = remote::Tier::create(std::move(**remote_config));
      via += " (remote tier " + tier->describe() + ")";
    }
    // PCH pays for itself from the second compile of a process, and a tuning run has dozens.
    builder = std::make_unique<jit::Builder>(store.get(), &Registry::global(),
                                             jit::BuilderOptions{.use_pch = true, .remote = tier.get()});
  }
  std::fprintf(stderr, "kiln: tuning %zu problem%s %s\n", items.size(), items.size() == 1 ? "" : "s", via.c_str());

  nlohmann::json records = nlohmann::json::array();
  nlohmann::json errors = nlohmann::json::array();
  int failures = 0;
  for (const auto& item : items) {
    Result<cache::TuningRecord> r = [&]() -> Result<cache::TuningRecord> {
      if (daemon) return daemon->tune(*item.family, item.problem, device);
      jit::Tuner tuner(builder.get(), table.get());
      jit::TuneOptions o;
      o.device = device;
      auto rec = tuner.tune(*item.family, item.problem, o);
      if (rec.ok() && tier) remote::share_winner(*tier, *rec);
      return rec;
    }();
    if (!r.ok()) {
      const Status s(r.status().code(), std::string(item.family->name()) + " " +
                                            item.family->signature(item.problem) + ": " + r.status().message(),
                     r.status().details());
      // No GPU or driver, or no daemon any more: every other item would fail the same way.
      if (s.code() == Code::unavailable) return report_error(s);
      // Anything else (memory for a huge shape, say) costs this problem only.
      print_error(s.message(), s.details());
      errors.push_back({{"family", std::string(item.family->name())},
                        {"signature", item.family->signature(item.problem)},
                        {"error", s.to_string()}});
      ++failures;
      continue;
    }
    if (r->winner.empty()) ++failures;
    if (json)
      records.push_back(kiln::daemon::tuning_record_to_json(*r));
    else
      print_record(*r);
  }
  if (json)
    std::cout << nlohmann::json{{"via", via}, {"records", std::move(records)}, {"errors", std::move(errors)}}.dump(2)
              << "\n";
  if (failures) {
    print_error(std::to_string(failures) + " of " + std::to_string(items.size()) +
                " problems failed to tune or found no working candidate");
    return k_exit_failure;
  }
  return k_exit_ok;
}

}  // namespace

int run_tune(const GlobalOptions& g, const TuneCliOptions& o) {
  auto items = items_from_options(o);
  if (!items.ok()) return report_error(items.status(), k_exit_usage);
  return tune_items(g, *items, o.device, o.json);
}

Result<std::vector<std::string>> read_problem_lines(const std::string& file) {
  std::ifstream in(file);
  if (!in) return invalid_argument("cannot read problems file '" + file + "'");
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

int run_tune_problems(const GlobalOptions& g, const std::string& file, bool json) {
  auto lines = read_problem_lines(file);
  if (!lines.ok()) return report_error(lines.status(), k_exit_usage);
  std::vector<TuneItem> items;
  for (std::size_t n = 0; n < lines->size(); ++n) {
    std::string text = (*lines)[n];
    if (auto hash = text.find('#'); hash != std::string::npos) text.resize(hash);
    std::istringstream words(text);
    std::string family, dtype, shape, extra;
    if (!(words >> family)) continue;  // blank or comment
    const std::string where = file + ":" + std::to_string(n + 1);
    if (!(words >> dtype >> shape) || (words >> extra))
      return report_error(invalid_argument(where + ": expected 'FAMILY DTYPE name=size,...'"), k_exit_usage);
    auto item = make_item(family, dtype, shape, 0);  // problems files tune on device 0
    if (!item.ok())
      return report_error(Status(item.status().code(), where + ": " + item.status().message(), item.status().details()),
                          k_exit_usage);
    items.push_back(*item);
  }
  if (items.empty()) return report_error(invalid_argument("problems file '" + file + "' lists no problems"), k_exit_usage);
  return tune_items(g, items, 0, json);
}

int run_ls_tuned(const GlobalOptions& g, const ListOptions& o) {
  // Read from the file even when kilnd runs: SQLite (WAL) lets readers in beside it.
  auto store = open_existing_store();
  if (!store.ok()) return report_error(store.status());
  std::vector<cache::TuningRecord> records;
  if (*store) {
    auto table = cache::TuningTable::open(**store);
    if (!table.ok()) return report_error(table.status());
    auto r = (*table)->list(cache::TuningFilter{o.family, o.arch});
    if (!r.ok()) return report_error(r.status());
    records = std::move(r).value();
  }
  if (o.json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const auto& r : records) arr.push_back(daemon::tuning_record_to_json(r));
    std::cout << arr.dump(2) << "\n";
    return k_exit_ok;
  }
  if (records.empty()) {
    std::fprintf(stderr, "kiln: no tuned problems%s (%s)\n", (o.family.empty() && o.arch.empty()) ? "" : " match the filter",
                 cache_file().c_str());
    return k_exit_ok;
  }
  Table t({"FAMILY", "SIGNATURE", "ARCH", "DEVICE", "DRIVER", "TOOLCHAIN", "WINNER", "US", "HEURISTIC_US", "CANDIDATES",
           "CREATED"},
          {false, false, false, false, false, false, false, true, true, true, false});
  for (const auto& r : records)
    t.add({r.family, r.signature, r.setup.arch, r.setup.device_name, r.setup.driver_version,
           r.setup.toolchain.substr(0, 12), r.winner, us(r.winner_ms), us(r.heuristic_ms),
           std::to_string(r.candidates.size()), format_age(r.created)});
  std::cout << t.render();
  std::cout << records.size() << " tuned problem" << (records.size() == 1 ? "" : "s") << " (" << cache_file().string()
            << ")\n";
  return k_exit_ok;
}

}  // namespace kiln::cli
