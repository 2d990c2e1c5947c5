// `kiln plugins`: the family plugins this process loads (built in, KILN_PLUGIN_PATH or the default
// directory) and the ones it skipped, with the reason.
#include <cstdio>
#include <iostream>

#include "cli/cli.h"
#include "plugin/loader.h"

namespace kiln::cli {

int run_plugins(const GlobalOptions&, bool json) {
  const plugin::Report& report = plugin::process_report();
  const auto path = plugin::search_path();
  if (json) {
    nlohmann::json loaded = nlohmann::json::array(), skipped = nlohmann::json::array();
    for (const auto& p : report.loaded) {
      // Each family as kiln_family_describe gives it: its problem fields and parameter schema.
      nlohmann::json described = nlohmann::json::array();
      for (const auto& name : p->families)
        if (const Family* f = Registry::global().find(name)) described.push_back(nlohmann::json::parse(describe_family(*f)));
      loaded.push_back({{"name", p->name},
                        {"version", p->version},
                        {"path", p->path},
                        {"families", p->families},
                        {"described", described},
                        {"templates_hash", p->templates_hash}});
    }
    for (const auto& s : report.skipped) skipped.push_back({{"path", s.path}, {"reason", s.reason}});
    std::cout << nlohmann::json{{"search_path", path}, {"loaded", loaded}, {"skipped", skipped}}.dump(2) << "\n";
    return k_exit_ok;
  }
  Table t({"PLUGIN", "VERSION", "FAMILIES", "TEMPLATES", "PATH"});
  for (const auto& p : report.loaded) {
    std::string families;
    for (const auto& f : p->families) families += (families.empty() ? "" : ",") + f;
    t.add({p->name, p->version, families, p->templates_hash.substr(0, 12), p->path});
  }
  std::cout << t.render();
  std::string where;
  for (const auto& e : path) where += (where.empty() ? "" : ":") + e;
  std::cout << report.loaded.size() << " plugin" << (report.loaded.size() == 1 ? "" : "s") << " loaded; search path "
            << (where.empty() ? "(empty)" : where) << (std::getenv("KILN_PLUGIN_PATH") ? " (KILN_PLUGIN_PATH)" : " (default)")
            << "\n";
  if (!report.skipped.empty()) {
    std::cout << "\nskipped:\n";
    Table s({"PATH", "REASON"});
    for (const auto& k : report.skipped) s.add({k.path, k.reason});
    std::cout << s.render();
  }
  // Skipped plugins are listed, not failed: the process runs without them.
  return k_exit_ok;
}

}  // namespace kiln::cli
