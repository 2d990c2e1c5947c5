// `kiln prewarm`: compile family catalogs ahead of time, through the daemon or in-process.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <thread>

#include "cli/cli.h"
#include "cli/model_plan.h"
#include "common/paths.h"
#include "jit/builder.h"
#include "kiln/spec.h"
#include "remote/config.h"
#include "remote/tier.h"

namespace kiln::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct WorkItem {
  KernelSpec spec;
  std::string arch;
};

enum class Outcome { pending, compiled, cached, remote, failed, skipped };

struct ItemResult {
  Outcome outcome = Outcome::pending;
  std::string key;
  double ms = 0;  // NVRTC time for a compile, lookup time for a hit
  Status error;
};

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::compiled: return "compiled";
    case Outcome::cached: return "cached";
    case Outcome::remote: return "remote";
    case Outcome::failed: return "failed";
    case Outcome::skipped: return "skipped";
    case Outcome::pending: break;
  }
  return "pending";
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<std::string> family_names(const std::vector<const Family*>& fams) {
  std::vector<std::string> out;
  for (const Family* f : fams) out.emplace_back(f->name());
  return out;
}

int prewarm_via_daemon(client::DaemonClient& daemon, const PrewarmOptions& o,
                       const std::vector<std::string>& archs, const std::vector<const Family*>& fams,
                       std::size_t variants, bool all_families) {
  const auto socket = socket_path();
  std::fprintf(stderr, "kiln: prewarm: %zu variants sent to kilnd at %s (it compiles them; --jobs is "
               "the daemon's own setting)\n", variants, socket.c_str());
  const auto t0 = Clock::now();
  // An empty family list means "all" to the daemon: it may know plugins this process does not.
  auto r = daemon.prewarm(archs, all_families ? std::vector<std::string>{} : family_names(fams));
  const double secs = seconds_since(t0);
  if (!r.ok()) return report_error(r.status());
  const auto& p = *r;

  if (o.json) {
    nlohmann::json j = {{"via", "daemon"},         {"socket", socket.string()},
                        {"archs", archs},          {"families", family_names(fams)},
                        {"requested", p.requested}, {"compiled", p.compiled},
                        {"cached", p.cached},      {"remote", p.remote},
                        {"failed", p.failed},
                        {"seconds", secs},         {"errors", p.errors}};
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("prewarm (via kilnd): %lld requested, %lld compiled, %lld already cached, %lld from the remote "
                "tier, %lld failed in %s\n", static_cast<long long>(p.requested), static_cast<long long>(p.compiled),
                static_cast<long long>(p.cached), static_cast<long long>(p.remote), static_cast<long long>(p.failed),
                human_ms(secs * 1000).c_str());
  }
  if (p.failed > 0) {
    std::string details;
    for (const auto& e : p.errors) details += e + "\n";
    print_error(std::to_string(p.failed) + " of " + std::to_string(p.requested) + " variants failed",
                details);
    return k_exit_failure;
  }
  return k_exit_ok;
}

using Getter = std::function<Result<jit::Artifact>(const WorkItem&, int worker)>;

// Runs `get` for every item on `jobs` threads, printing progress and the summary. `via` and
// `where` ("embedded" and the cache file, or "kilnd" and the socket) go into the summary.
int run_items(const PrewarmOptions& o, const std::string& via, const std::string& where,
              const std::vector<std::string>& archs, const std::vector<std::string>& families,
              const std::vector<WorkItem>& items, int jobs, const Getter& get) {
  std::vector<ItemResult> results(items.size());
  std::atomic<std::size_t> next{0};
  std::atomic<bool> abort{false};
  std::mutex out_mu;
  std::size_t done = 0;
  const auto t0 = Clock::now();

  auto worker = [&](int worker_index) {
    for (;;) {
      const std::size_t i = next.fetch_add(1);
      if (i >= items.size()) return;
      ItemResult& res = results[i];
      if (abort.load()) {
        res.outcome = Outcome::skipped;
        continue;
      }
      const auto t = Clock::now();
      auto a = get(items[i], worker_index);
      const double elapsed_ms = seconds_since(t) * 1000;
      if (a.ok()) {
        res.key = a->entry.key;
        if (a->source == jit::ArtifactSource::compiled) {
          res.outcome = Outcome::compiled;
          res.ms = a->entry.compile_ms > 0 ? a->entry.compile_ms : elapsed_ms;
        } else {
          res.outcome = a->source == jit::ArtifactSource::remote ? Outcome::remote : Outcome::cached;
          res.ms = elapsed_ms;
        }
      } else {
        res.outcome = Outcome::failed;
        res.error = a.status();
        // Without NVRTC every remaining compile fails the same way: stop rather than repeat it.
        if (a.status().code() == Code::unavailable) abort.store(true);
      }
      std::lock_guard lock(out_mu);
      ++done;
      std::string line = "[" + std::to_string(done) + "/" + std::to_string(items.size()) + "] " +
                         items[i].spec.canonical() + " " + items[i].arch + " ";
      if (res.outcome == Outcome::compiled)
        line += "compiled " + human_ms(res.ms);
      else if (res.outcome == Outcome::cached)
        line += "cached";
      else if (res.outcome == Outcome::remote)
        line += "from the remote tier";
      else
        line += "FAILED: " + res.error.message();
      std::fputs((line + "\n").c_str(), stderr);
      std::fflush(stderr);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < jobs; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto& t : pool) t.join();
  const double secs = seconds_since(t0);

  std::int64_t compiled = 0, cached = 0, remote = 0, failed = 0, skipped = 0;
  for (const auto& r : results) {
    compiled += r.outcome == Outcome::compiled;
    cached += r.outcome == Outcome::cached;
    remote += r.outcome == Outcome::remote;
    failed += r.outcome == Outcome::failed;
    skipped += r.outcome == Outcome::skipped;
  }

  if (o.json) {
    nlohmann::json variants = nlohmann::json::array();
    for (std::size_t i = 0; i < items.size(); ++i) {
      const auto& r = results[i];
      nlohmann::json v = {{"spec", items[i].spec.canonical()},
                          {"arch", items[i].arch},
                          {"result", outcome_name(r.outcome)},
                          {"key", r.key.empty() ? nlohmann::json() : nlohmann::json(r.key)},
                          {"ms", r.ms}};
      if (r.outcome == Outcome::failed) v["error"] = r.error.to_string();
      variants.push_back(std::move(v));
    }
    nlohmann::json j = {{"via", via},
                        {via == "embedded" ? "cache_file" : "socket", where},
                        {"archs", archs},
                        {"families", families},
                        {"jobs", jobs},
                        {"requested", static_cast<std::int64_t>(items.size())},
                        {"compiled", compiled},
                        {"cached", cached},
                        {"remote", remote},
                        {"failed", failed},
                        {"skipped", skipped},
                        {"seconds", secs},
                        {"variants", std::move(variants)}};
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("prewarm: %zu requested, %lld compiled, %lld already cached, %lld from the remote tier, %lld failed",
                items.size(), static_cast<long long>(compiled), static_cast<long long>(cached),
                static_cast<long long>(remote), static_cast<long long>(failed));
    if (skipped) std::printf(", %lld skipped", static_cast<long long>(skipped));
    std::printf(" in %s\n", human_ms(secs * 1000).c_str());
  }

  if (failed + skipped == 0) return k_exit_ok;
  // One error line, then every failure with its log: the compile log is what the user needs.
  std::string details;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto& r = results[i];
    if (r.outcome != Outcome::failed) continue;
    details += items[i].spec.canonical() + " " + items[i].arch + ": " + r.error.message() + "\n";
    if (!r.error.details().empty()) details += indent_lines(r.error.details(), "  ");
  }
  if (skipped) details += std::to_string(skipped) + " variants were skipped after NVRTC could not be loaded\n";
  print_error(std::to_string(failed) + " of " + std::to_string(items.size()) + " variants failed",
              details);
  return k_exit_failure;
}

int prewarm_in_process(const PrewarmOptions& o, const std::vector<std::string>& archs,
                       const std::vector<std::string>& families, const std::vector<WorkItem>& items) {
  const auto file = cache_file();
  auto remote_config = remote::config_from_env();
  if (!remote_config.ok()) return report_error(remote_config.status(), k_exit_usage);
  auto store = cache::Store::open(file);
  if (!store.ok()) return report_error(store.status());
  // Declared before the builder so that it outlives it; its destructor sends the write-backs
  // still queued when the prewarm ends.
  std::unique_ptr<remote::Tier> tier;
  if (*remote_config) tier = remote::Tier::create(std::move(**remote_config));
  // PCH pays for itself after the first compile of a process, which a prewarm always has.
  jit::Builder builder(store->get(), &Registry::global(), jit::BuilderOptions{.use_pch = true, .remote = tier.get()});
  const int jobs = std::max(1, std::min<int>(o.jobs, static_cast<int>(items.size())));
  std::fprintf(stderr, "kiln: prewarm: %zu variants in-process with %d job%s into %s%s\n", items.size(), jobs,
               jobs == 1 ? "" : "s", file.c_str(), tier ? (" (remote tier " + tier->describe() + ")").c_str() : "");
  // Builder::get rather than a bare key lookup: it verifies the stored blob, so a corrupt row is
  // recompiled here instead of being reported as cached.
  return run_items(o, "embedded", file.string(), archs, families, items, jobs,
                   [&](const WorkItem& it, int) { return builder.get(it.spec, it.arch); });
}

// Single variants through kilnd: one connection per job, one `get` per variant.
int prewarm_specs_via_daemon(const PrewarmOptions& o, const std::vector<std::string>& archs,
                             const std::vector<std::string>& families, const std::vector<WorkItem>& items) {
  const int jobs = std::max(1, std::min<int>(o.jobs, static_cast<int>(items.size())));
  std::vector<std::unique_ptr<client::DaemonClient>> clients;
  for (int i = 0; i < jobs; ++i) {
    auto c = client::DaemonClient::connect(socket_path());
    if (!c.ok()) return report_error(c.status());
    clients.push_back(std::move(c).value());
  }
  std::fprintf(stderr, "kiln: prewarm: %zu variants sent to kilnd at %s over %d connection%s\n", items.size(),
               socket_path().c_str(), jobs, jobs == 1 ? "" : "s");
  return run_items(o, "kilnd", socket_path().string(), archs, families, items, jobs,
                   [&](const WorkItem& it, int w) { return clients[std::size_t(w)]->get_kernel(it.spec, it.arch); });
}

int print_model_plan(const PrewarmOptions& o, const ModelShape& m, const std::vector<std::int64_t>& tokens,
                     const ModelPlan& plan) {
  if (o.json) {
    nlohmann::json vs = nlohmann::json::array();
    for (const auto& v : plan.variants)
      vs.push_back({{"spec", v.spec.canonical()}, {"family", v.spec.family}, {"arch", v.arch}, {"uses", v.uses}});
    nlohmann::json j = {{"model", m.name},
                        {"dtype", dtype_name(m.dtype)},
                        {"hidden_size", m.hidden},
                        {"intermediate_size", m.intermediate},
                        {"heads", m.heads},
                        {"kv_heads", m.kv_heads},
                        {"head_dim", m.head_dim},
                        {"experts", m.experts},
                        {"archs", o.archs},
                        {"tokens", tokens},
                        {"variants", std::move(vs)},
                        {"skipped", plan.skipped}};
    std::cout << j.dump(2) << "\n";
    return k_exit_ok;
  }
  Table t({"SPEC", "ARCH", "USED BY"});
  for (const auto& v : plan.variants) {
    std::string uses;
    for (const auto& u : v.uses) uses += (uses.empty() ? "" : ", ") + u;
    t.add({v.spec.canonical(), v.arch, uses});
  }
  std::printf("%s (%s, hidden %lld, %lld heads / %lld KV heads of %lld%s): %zu variants\n", m.name.c_str(),
              dtype_name(m.dtype), static_cast<long long>(m.hidden), static_cast<long long>(m.heads),
              static_cast<long long>(m.kv_heads), static_cast<long long>(m.head_dim),
              m.experts ? (", " + std::to_string(m.experts) + " experts").c_str() : "", plan.variants.size());
  std::fputs(t.render().c_str(), stdout);
  for (const auto& s : plan.skipped) std::printf("skipped: %s\n", s.c_str());
  return k_exit_ok;
}

// Compiles single variants (a model's, or named by --spec) through kilnd when it runs, in-process
// otherwise, and pins them with --pin.
int compile_variants(const GlobalOptions& g, const PrewarmOptions& o, const std::vector<std::string>& archs,
                     const std::vector<std::string>& families, const std::vector<WorkItem>& items) {
  const int rc = try_daemon(g) ? prewarm_specs_via_daemon(o, archs, families, items)
                               : prewarm_in_process(o, archs, families, items);
  if (rc == k_exit_ok && o.pin) {
    std::vector<std::pair<KernelSpec, std::string>> variants;
    for (const auto& it : items) variants.emplace_back(it.spec, it.arch);
    if (Status s = pin_variants(variants); !s.ok()) return report_error(s);
  }
  return rc;
}

int prewarm_model(const GlobalOptions& g, const PrewarmOptions& o) {
  // Everything is checked before anything is opened or compiled.
  if (o.archs.empty()) return report_error(invalid_argument("prewarm --model needs --arch"), k_exit_usage);
  if (!o.families.empty())
    return report_error(invalid_argument("--model picks the families itself; leave --family out"), k_exit_usage);
  auto archs = resolve_archs(o.archs);
  if (!archs.ok()) return report_error(archs.status(), k_exit_usage);
  std::vector<std::int64_t> tokens = o.tokens.empty() ? default_token_buckets() : o.tokens;
  for (auto t : tokens)
    if (t <= 0 || t > (std::int64_t(1) << 24))
      return report_error(invalid_argument("--tokens must be positive token counts (at most 2^24), not " +
                                           std::to_string(t)),
                          k_exit_usage);
  auto model = read_model_config(o.model);
  if (!model.ok()) return report_error(model.status(), k_exit_usage);
  auto plan = plan_model(*model, *archs, tokens, o.sm_count);
  if (!plan.ok()) return report_error(plan.status(), k_exit_usage);
  if (o.dry_run) return print_model_plan(o, *model, tokens, *plan);
  if (plan->variants.empty()) {
    print_error("nothing to compile: no variant serves this model's layers on these archs",
                [&] {
                  std::string d;
                  for (const auto& s : plan->skipped) d += s + "\n";
                  return d;
                }());
    return k_exit_failure;
  }
  std::vector<WorkItem> items;
  std::vector<std::string> families;
  for (const auto& v : plan->variants) {
    items.push_back({v.spec, v.arch});
    if (std::find(families.begin(), families.end(), v.spec.family) == families.end()) families.push_back(v.spec.family);
  }
  return compile_variants(g, o, *archs, families, items);
}

// --spec: exactly the variants named, for every --arch they run on.
int prewarm_specs(const GlobalOptions& g, const PrewarmOptions& o) {
  // Everything is checked before anything is opened or compiled.
  if (o.archs.empty()) return report_error(invalid_argument("prewarm --spec needs --arch"), k_exit_usage);
  if (!o.families.empty() || !o.model.empty() || !o.problems.empty())
    return report_error(invalid_argument("--spec names the variants itself; leave --family, --model and --problems out"),
                        k_exit_usage);
  auto archs = resolve_archs(o.archs);
  if (!archs.ok()) return report_error(archs.status(), k_exit_usage);
  std::vector<WorkItem> items;
  std::vector<std::string> families;
  for (const auto& text : o.specs) {
    auto spec = KernelSpec::parse(text);
    if (!spec.ok())
      return report_error(invalid_argument("bad spec '" + text + "': " + spec.status().message()), k_exit_usage);
    const Family* f = Registry::global().find(spec->family);
    if (!f) return report_error(not_found("unknown kernel family '" + spec->family + "'"), k_exit_usage);
    if (Status s = f->validate(spec->params); !s.ok())
      return report_error(invalid_argument("spec '" + text + "': " + s.message()), k_exit_usage);
    bool runs = false;
    for (const auto& arch : *archs) {
      auto parsed = parse_arch(arch);
      if (!parsed.ok() || !f->runs_on(spec->params, *parsed)) continue;
      items.push_back({*spec, arch});
      runs = true;
    }
    if (!runs)
      return report_error(invalid_argument("spec '" + text + "' runs on none of the architectures given"),
                          k_exit_usage);
    if (std::find(families.begin(), families.end(), spec->family) == families.end()) families.push_back(spec->family);
  }
  return compile_variants(g, o, *archs, families, items);
}

}  // namespace

int run_prewarm(const GlobalOptions& g, const PrewarmOptions& o) {
  if (!o.specs.empty()) return prewarm_specs(g, o);
  if (!o.model.empty()) {
    if (!o.problems.empty())
      return report_error(invalid_argument("--model and --problems do not go together"), k_exit_usage);
    return prewarm_model(g, o);
  }
  if (o.dry_run || !o.tokens.empty() || o.sm_count)
    return report_error(invalid_argument("--dry-run, --tokens and --sm-count go with --model"), k_exit_usage);
  if (o.archs.empty() && o.problems.empty())
    return report_error(invalid_argument("prewarm needs --arch (catalogs to compile) or --problems (problems to tune)"),
                        k_exit_usage);
  // Tuning compiles what it needs; with no --arch there is no catalog to compile first.
  if (o.archs.empty()) return run_tune_problems(g, o.problems, o.json);
  // All input is checked before anything is opened or compiled: a typo costs nothing.
  auto archs = resolve_archs(o.archs);
  if (!archs.ok()) return report_error(archs.status(), k_exit_usage);
  auto fams = resolve_families(o.families);
  if (!fams.ok()) return report_error(fams.status(), k_exit_usage);
  if (fams->empty()) {
    print_error("no kernel families are registered");
    return k_exit_failure;
  }

  // Each arch gets the variants that run on it (catalog_for), not the whole catalog.
  std::vector<WorkItem> items;
  for (const Family* f : *fams) {
    if (f->catalog().empty()) print_warning("family " + std::string(f->name()) + " has an empty catalog");
    for (const auto& arch : *archs) {
      auto catalog = catalog_for(*f, arch);
      if (!catalog.ok()) return report_error(catalog.status(), k_exit_usage);
      for (const auto& params : *catalog) items.push_back({KernelSpec{std::string(f->name()), params}, arch});
    }
  }
  if (items.empty()) {
    print_error("nothing to compile: the selected families have no catalog variants");
    return k_exit_failure;
  }

  if (!o.problems.empty()) {
    // Checked before the catalog compile starts, so a typo in the file costs nothing.
    auto lines = read_problem_lines(o.problems);
    if (!lines.ok()) return report_error(lines.status(), k_exit_usage);
  }
  const int rc = [&] {
    if (auto daemon = try_daemon(g))
      return prewarm_via_daemon(*daemon, o, *archs, *fams, items.size(), o.families.empty());
    return prewarm_in_process(o, *archs, family_names(*fams), items);
  }();
  if (rc == k_exit_ok && o.pin) {
    std::vector<std::pair<KernelSpec, std::string>> variants;
    for (const auto& it : items) variants.emplace_back(it.spec, it.arch);
    if (Status s = pin_variants(variants); !s.ok()) return report_error(s);
  }
  if (rc != k_exit_ok || o.problems.empty()) return rc;
  return run_tune_problems(g, o.problems, o.json);
}

}  // namespace kiln::cli
