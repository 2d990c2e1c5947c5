// `kiln`: command-line parsing and dispatch. The commands live in the other files of cli/.
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>

#include "cli/cli.h"

namespace kiln::cli {
namespace {

// The core reads its locations from the environment (common/paths.h), so the global options are
// applied by setting those variables before any command opens a file or socket. Paths are made
// absolute because the daemon we may spawn changes its working directory.
Status apply_global_options(const GlobalOptions& g) {
  auto set = [](const char* var, const std::string& value) -> Status {
    std::error_code ec;
    auto abs = std::filesystem::absolute(value, ec);
    if (ec) return invalid_argument(std::string("bad path for ") + var + ": " + value, ec.message());
    if (::setenv(var, abs.c_str(), 1) != 0) return internal_error(std::string("setenv ") + var + " failed");
    return {};
  };
  if (!g.cache_dir.empty()) KILN_TRY(set("KILN_CACHE_DIR", g.cache_dir));
  if (!g.socket.empty()) KILN_TRY(set("KILN_SOCKET", g.socket));
  return {};
}

int run(int argc, char** argv) {
  CLI::App app{"kiln: prewarm and inspect kiln's kernel cache, and control the kilnd daemon"};
  app.name("kiln");
  app.set_version_flag("--version", std::string("kiln ") + KILN_VERSION);
  app.require_subcommand(1);
  // Global options may follow the subcommand too (`kiln ls --embedded`).
  app.fallthrough();

  GlobalOptions g;
  app.add_option("--cache-dir", g.cache_dir, "Cache directory (sets KILN_CACHE_DIR)");
  app.add_option("--socket", g.socket, "Daemon socket (sets KILN_SOCKET)");
  app.add_flag("--embedded", g.embedded, "Never use the daemon, even if it runs");

  PrewarmOptions pw;
  auto* prewarm = app.add_subcommand("prewarm", "Compile family catalogs for target architectures");
  prewarm->add_option("--arch", pw.archs, "Target architectures, e.g. sm_90a,sm_80 (required unless --problems)")
      ->delimiter(',');
  prewarm->add_option("--family", pw.families, "Families to compile (default: all)")->delimiter(',');
  prewarm->add_option("--jobs", pw.jobs, "Compile threads when compiling in-process")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  prewarm->add_flag("--json", pw.json, "Print the summary as JSON");
  prewarm->add_flag("--pin", pw.pin, "Pin the variants: the size cap never evicts them (see kiln evict)");
  prewarm->add_option("--model", pw.model,
                      "A Hugging Face config.json: compile only the variants that model's layers use");
  prewarm->add_option("--tokens", pw.tokens, "Token buckets for --model (default 1,16,128,1024,4096)")
      ->delimiter(',');
  prewarm->add_option("--sm-count", pw.sm_count,
                      "Multiprocessors the heuristics assume for --model (default: the arch's flagship GPU)")
      ->check(CLI::Range(1, 1024));
  prewarm->add_flag("--dry-run", pw.dry_run, "With --model: list the variants and what uses them, compile nothing");
  prewarm->add_option("--spec", pw.specs,
                      "Compile these variants ('family(k=v,...)', as kiln ls prints them) instead of catalogs");
  prewarm->add_option("--problems", pw.problems,
                      "Also tune the problems in FILE (one 'FAMILY DTYPE name=size,...' per line; needs a GPU)");

  ListOptions ls;
  auto* list = app.add_subcommand("ls", "List cached variants");
  list->add_option("--family", ls.family, "Only this family");
  list->add_option("--arch", ls.arch, "Only this architecture");
  list->add_flag("--json", ls.json, "Print a JSON array");
  list->add_flag("--tuned", ls.tuned, "List the tuning table (winners per problem signature and GPU)");

  TuneCliOptions tn;
  auto* tune = app.add_subcommand("tune", "Time every variant of a family for a problem on this GPU and keep the fastest");
  tune->add_option("--family", tn.family, "Kernel family, e.g. rmsnorm")->required();
  tune->add_option("--dtype", tn.dtype, "Element type: f32, f16 or bf16")->capture_default_str();
  tune->add_option("--shape", tn.shape, "Problem sizes by dim name, e.g. rows=4096,cols=4096");
  tune->add_flag("--all", tn.all, "Tune the family's benchmark shapes");
  tune->add_option("--device", tn.device, "CUDA device ordinal")->check(CLI::Range(0, 1024))->capture_default_str();
  tune->add_flag("--json", tn.json, "Print the tuning records as JSON");

  ShowOptions sh;
  auto* show = app.add_subcommand("show", "Show every detail of one cached entry");
  show->add_option("KEY", sh.key, "Cache key or a unique prefix of it")->required();
  show->add_flag("--json", sh.json, "Print JSON");

  WhyOptions wy;
  auto* why = app.add_subcommand("why", "Explain the cache key of a spec without compiling");
  why->add_option("SPEC", wy.spec, "Kernel spec, e.g. 'rmsnorm(block=256,bulk=0,dtype=bf16,row=0,vec=8)'")->required();
  why->add_option("--arch", wy.arch, "Target architecture, e.g. sm_90a")->required();
  why->add_flag("--json", wy.json, "Print JSON");

  bool stats_json = false;
  auto* stats = app.add_subcommand("stats", "Cache statistics, and the daemon's when it runs");
  stats->add_flag("--json", stats_json, "Print JSON");

  bool verify_json = false;
  auto* verify = app.add_subcommand("verify", "Check the cache file's integrity and every blob's checksum");
  verify->add_flag("--json", verify_json, "Print JSON");

  EvictOptions ev;
  auto* evict = app.add_subcommand("evict", "Shrink the cache (least recently used first), pin or unpin entries");
  evict->add_option("--max-mb", ev.max_mb, "Evict until the cubins total at most this many MiB (default: the cap)")
      ->check(CLI::Range(0.0, 1e9));
  evict->add_flag("--all", ev.all, "Evict every unpinned entry");
  evict->add_option("--pin", ev.pin, "Pin these keys (or unique prefixes): never evicted")->delimiter(',');
  evict->add_option("--unpin", ev.unpin, "Unpin these keys (or unique prefixes)")->delimiter(',');
  evict->add_flag("--json", ev.json, "Print JSON");

  bool plugins_json = false;
  auto* plugins = app.add_subcommand("plugins", "Family plugins loaded by this process, and the ones skipped with why");
  plugins->add_flag("--json", plugins_json, "Print JSON");

  auto* metrics = app.add_subcommand("metrics", "Counters in the Prometheus text format (the daemon's when it runs)");

  ExportOptions ex;
  auto* exp = app.add_subcommand("export", "Write the cache's kernels and tuning rows to a bundle signed with the fleet key");
  exp->add_option("--out", ex.out, "The bundle file to write")->required();
  exp->add_option("--family", ex.family, "Only this family");
  exp->add_option("--arch", ex.arch, "Only this architecture");
  exp->add_option("--fleet-key-file", ex.key_file, "The fleet key, mode 0600 (default: $KILN_FLEET_KEY_FILE)");
  exp->add_flag("--no-tuning", ex.no_tuning, "Leave the tuning table out");
  exp->add_flag("--json", ex.json, "Print JSON");

  ImportOptions im;
  auto* imp = app.add_subcommand("import", "Verify a bundle's every record and add the good ones to the cache");
  imp->add_option("BUNDLE", im.file, "A bundle written by kiln export")->required();
  imp->add_option("--fleet-key-file", im.key_file, "The fleet key, mode 0600 (default: $KILN_FLEET_KEY_FILE)");
  imp->add_flag("--json", im.json, "Print JSON");

  auto* daemon = app.add_subcommand("daemon", "Start, stop or query kilnd");
  daemon->require_subcommand(1);
  DaemonStartOptions ds;
  auto* dstart = daemon->add_subcommand("start", "Start kilnd in the background");
  dstart->add_option("--jobs", ds.jobs, "kilnd's compile threads")->check(CLI::Range(1, 256));
  dstart->add_flag("--no-pch", ds.no_pch, "Turn off NVRTC precompiled headers in kilnd");
  auto* dstop = daemon->add_subcommand("stop", "Stop kilnd and wait until it is gone");
  bool dstatus_json = false;
  auto* dstatus = daemon->add_subcommand("status", "Whether kilnd runs: pid, version, socket, uptime");
  dstatus->add_flag("--json", dstatus_json, "Print JSON");

  for (CLI::App* sub : {prewarm, list, tune, show, why, stats, verify, evict, plugins, metrics, exp, imp, daemon, dstart, dstop,
                     dstatus})
    sub->fallthrough();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0 in CLI11: let it print them.
    if (e.get_exit_code() == 0) return app.exit(e);
    print_error(e.what(), "run 'kiln --help' (or 'kiln <command> --help') for usage");
    return k_exit_usage;
  }

  if (Status s = apply_global_options(g); !s.ok()) return report_error(s, k_exit_usage);

  if (*prewarm) return run_prewarm(g, pw);
  if (*list) return ls.tuned ? run_ls_tuned(g, ls) : run_ls(g, ls);
  if (*tune) return run_tune(g, tn);
  if (*show) return run_show(g, sh);
  if (*why) return run_why(g, wy);
  if (*stats) return run_stats(g, stats_json);
  if (*verify) return run_verify(g, verify_json);
  if (*evict) return run_evict(g, ev);
  if (*plugins) return run_plugins(g, plugins_json);
  if (*metrics) return run_metrics(g);
  if (*exp) return run_export(g, ex);
  if (*imp) return run_import(g, im);
  if (*dstart) return run_daemon_start(g, ds);
  if (*dstop) return run_daemon_stop(g);
  if (*dstatus) return run_daemon_status(g, dstatus_json);
  print_error("no command given", "run 'kiln --help' for usage");
  return k_exit_usage;
}

}  // namespace
}  // namespace kiln::cli

int main(int argc, char** argv) {
  // The core reports through Status; an exception here is a bug, but it should still end with the
  // CLI's usual error line rather than std::terminate's.
  try {
    return kiln::cli::run(argc, argv);
  } catch (const std::exception& e) {
    kiln::cli::print_error(std::string("internal error: ") + e.what());
    return kiln::cli::k_exit_failure;
  }
}
