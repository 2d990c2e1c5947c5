// Family plugins (kiln/plugin.h): loading shared libraries, checking their descriptors, and
// registering their families through one path that kiln's built-in families take too.
//
// descriptor -> checks (ABI version, struct sizes, init, schema, catalog, templates, names) ->
// adapter (a kiln::Family over the C vtable) -> Registry. A plugin that fails any step is skipped
// with one log line on stderr and listed with its reason; nothing a plugin does at load takes the
// process down short of crashing in its own code. Two plugins providing one family name: the
// first is kept and the second skipped as a conflict.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kiln/family.h"
#include "kiln/plugin.h"

namespace kiln::plugin {

struct Skipped {
  std::string path;
  std::string reason;
};

struct Report {
  std::vector<std::shared_ptr<const PluginInfo>> loaded;
  std::vector<Skipped> skipped;
};

// Checks `desc` and registers its families into `registry` (all or none); `path` names its origin
// in the report and in PluginInfo. Returns the reason it was skipped, if it was.
Status register_plugin(Registry& registry, const kiln_plugin* desc, const std::string& path, Report& report);

// Loads every entry: a file is loaded whatever its name; a directory contributes its *.so files in
// name order. Files and the directories holding them must be owned by this user or root and not
// writable by group or others. Logs one line per skipped plugin unless `quiet`.
Report load(Registry& registry, const std::vector<std::string>& entries, bool quiet = false);

// KILN_PLUGIN_PATH split at ':' when set (empty: no plugins), else {default_dir()}.
std::vector<std::string> search_path();
// $XDG_DATA_HOME/kiln/plugins, else ~/.local/share/kiln/plugins.
std::string default_dir();

// What Registry::global() loaded: the built-in plugin, then search_path(). Once per process.
const Report& process_report();
// Called by Registry::global() (common/registry.cpp) to fill it.
void populate_global(Registry& registry);

// The built-in families as a plugin descriptor (plugin/builtin.cpp).
const kiln_plugin* builtin_descriptor();
// The ops the built-in families declare (families/*/ops.cpp), copied into the global registry.
std::vector<const OpDecl*> builtin_ops();
inline constexpr const char* k_builtin_path = "(built in)";

}  // namespace kiln::plugin
