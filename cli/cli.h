// The `kiln` command-line tool: options, commands and the helpers they share.
//
// Every command is a function that returns the process exit code. Commands report failures through
// report_error() so that all of them look alike ("kiln: error: ..." on stderr, details indented
// below) and keep stdout for results (tables, reports, JSON) so that it can be piped.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache/store.h"
#include "client/daemon_client.h"
#include "kiln/family.h"
#include "kiln/status.h"

namespace kiln::cli {

// Exit codes are part of the CLI's contract (docs/cli.md); scripts test them.
enum ExitCode : int {
  k_exit_ok = 0,
  k_exit_failure = 1,      // the command ran and something was bad (a failed compile, a bad row)
  k_exit_usage = 2,        // bad input: nothing was done
  k_exit_not_running = 3,  // `kiln daemon status` when no daemon answers (LSB convention)
};

struct GlobalOptions {
  std::string cache_dir;  // empty: the environment's choice
  std::string socket;
  bool embedded = false;  // never talk to the daemon
};

struct PrewarmOptions {
  std::vector<std::string> archs;
  std::vector<std::string> families;
  int jobs = 2;
  bool json = false;
  std::string problems;  // a file of problems to tune (cli/tune.cpp); needs a GPU
  bool pin = false;      // pin every prewarmed variant (never evicted; cli/evict.cpp)
  std::string model;     // a Hugging Face config.json: that model's variants only (cli/model_plan.h)
  std::vector<std::int64_t> tokens;  // token buckets for --model (empty: the defaults)
  int sm_count = 0;      // multiprocessors the heuristics assume for --model (0: the arch's flagship)
  bool dry_run = false;  // --model: list the variants, compile nothing
  std::vector<std::string> specs;  // exact variants to compile instead of catalogs ("family(k=v,...)")
};

struct EvictOptions {
  std::optional<double> max_mb;  // evict down to this; unset: the cache's cap
  bool all = false;              // every unpinned entry
  std::vector<std::string> pin, unpin;  // keys (or unique prefixes)
  bool json = false;
};

struct ListOptions {
  std::string family;
  std::string arch;
  bool json = false;
  bool tuned = false;  // the tuning table instead of the kernels
};

struct TuneCliOptions {
  std::string family;
  std::string dtype = "bf16";
  std::string shape;  // "rows=4096,cols=4096"
  bool all = false;   // the family's benchmark shapes
  bool json = false;
  int device = 0;
};

struct ShowOptions {
  std::string key;
  bool json = false;
};

struct WhyOptions {
  std::string spec;
  std::string arch;
  bool json = false;
};

struct DaemonStartOptions {
  std::optional<int> jobs;
  bool no_pch = false;
};

struct ExportOptions {
  std::string out;       // the bundle file
  std::string family;    // empty: every family
  std::string arch;      // empty: every arch
  std::string key_file;  // empty: $KILN_FLEET_KEY_FILE
  bool no_tuning = false;
  bool json = false;
};

struct ImportOptions {
  std::string file;
  std::string key_file;
  bool json = false;
};

// Commands. Each returns an ExitCode.
int run_prewarm(const GlobalOptions& g, const PrewarmOptions& o);
int run_evict(const GlobalOptions& g, const EvictOptions& o);
// Pins the cache entries of these variants (their keys computed without compiling).
Status pin_variants(const std::vector<std::pair<KernelSpec, std::string>>& variants);
int run_tune(const GlobalOptions& g, const TuneCliOptions& o);
// Tunes every problem of a file: one "FAMILY DTYPE name=size,..." per line, '#' comments.
int run_tune_problems(const GlobalOptions& g, const std::string& file, bool json);
int run_ls_tuned(const GlobalOptions& g, const ListOptions& o);
// The lines of a problems file (invalid_argument when it cannot be read).
Result<std::vector<std::string>> read_problem_lines(const std::string& file);
int run_ls(const GlobalOptions& g, const ListOptions& o);
int run_show(const GlobalOptions& g, const ShowOptions& o);
int run_why(const GlobalOptions& g, const WhyOptions& o);
int run_stats(const GlobalOptions& g, bool json);
int run_verify(const GlobalOptions& g, bool json);
int run_daemon_start(const GlobalOptions& g, const DaemonStartOptions& o);
int run_daemon_stop(const GlobalOptions& g);
int run_daemon_status(const GlobalOptions& g, bool json);
int run_plugins(const GlobalOptions& g, bool json);
int run_metrics(const GlobalOptions& g);
int run_export(const GlobalOptions& g, const ExportOptions& o);
int run_import(const GlobalOptions& g, const ImportOptions& o);

// ---- reporting -------------------------------------------------------------------------------

// Prints "kiln: error: <message>" and the details, indented, on the lines below.
void print_error(const std::string& message, const std::string& details = {});
void print_warning(const std::string& message);
// print_error for a Status; returns the exit code the Status deserves: k_exit_usage for bad user
// input (invalid_argument), `otherwise` for anything else.
int report_error(const Status& s, int otherwise = k_exit_failure);

// ---- daemon and cache access -----------------------------------------------------------------

// The daemon when one answers on socket_path() and --embedded was not given, else nullptr. A socket
// that exists but does not answer in time is worth a warning: the caller falls back to the file.
std::unique_ptr<client::DaemonClient> try_daemon(const GlobalOptions& g);

// Opens the cache file only when it exists, so that read-only commands (ls, show, stats, verify)
// do not create an empty cache as a side effect. nullptr with an ok status: there is no cache yet.
Result<std::unique_ptr<cache::Store>> open_existing_store();

// The family names given on the command line, checked against the registry; all families when
// `names` is empty. invalid_argument names the unknown family and lists the known ones.
Result<std::vector<const Family*>> resolve_families(const std::vector<std::string>& names);
// Checks every arch with validate_arch and drops repeats (keeping the first).
Result<std::vector<std::string>> resolve_archs(const std::vector<std::string>& archs);

// ---- formatting ------------------------------------------------------------------------------

std::string human_bytes(std::int64_t bytes);   // "12.3 KiB"
std::string human_ms(double ms);               // "41 ms", "1.20 s"
std::string human_duration(double seconds);    // "3m 12s"
std::string format_time(std::int64_t unix_s);  // local "2025-01-31 14:02:11", "never" for 0
std::string format_age(std::int64_t unix_s);   // "12s ago", "never" for 0

// Entry metadata as JSON (never the blob). `full` adds key text and compile log.
nlohmann::json entry_json(const cache::Entry& e, bool full);
nlohmann::json stats_json(const cache::Stats& s);

// A plain text table: columns padded to their widest cell, numbers right-aligned.
class Table {
 public:
  explicit Table(std::vector<std::string> headers, std::vector<bool> right_aligned = {});
  void add(std::vector<std::string> row);
  std::string render() const;
  bool empty() const { return rows_.empty(); }

 private:
  std::vector<std::string> headers_;
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

// Indents every line of `text` by `indent`; an empty text gives `empty_note` (indented).
std::string indent_lines(const std::string& text, const std::string& indent,
                         const std::string& empty_note = {});

}  // namespace kiln::cli
