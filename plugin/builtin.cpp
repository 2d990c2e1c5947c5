// kiln's built-in families as a plugin: exported through the C++ bridge (kiln/plugin_cpp.h) and
// registered by the loader like any shared-library plugin, so the whole plugin path runs under
// every built-in family's tests.
#include "jit/templates.h"
#include "kiln/plugin_cpp.h"
#include "plugin/loader.h"

namespace kiln::plugin {

namespace {

// The families and ops as families/*/ register them (cmake/builtin_families.cpp.in); kept for the
// process's life, like a loaded plugin's.
const Registry* staging_registry() {
  static Registry* staging = [] {
    auto* r = new Registry;
    register_builtin_families(*r);
    return r;
  }();
  return staging;
}

}  // namespace

std::vector<const OpDecl*> builtin_ops() { return staging_registry()->ops(); }

const kiln_plugin* builtin_descriptor() {
  static plugin_bridge::ExportedPlugin plugin("builtin", KILN_VERSION, [] {
    const Registry* staging = staging_registry();
    // They ship kiln's template set (embedded, or KILN_TEMPLATE_DIR): its hash is in their keys.
    std::vector<std::pair<std::string, std::string>> templates(jit::TemplateSet::active().files().begin(),
                                                               jit::TemplateSet::active().files().end());
    std::vector<plugin_bridge::FamilyExport> out;
    for (const Family* f : staging->all())
      out.push_back({std::shared_ptr<const Family>(std::shared_ptr<const Family>(), f), templates});
    return out;
  });
  return plugin.descriptor();
}

}  // namespace kiln::plugin
