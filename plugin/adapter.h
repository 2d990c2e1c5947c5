// A kiln::Family over a plugin's C descriptor (kiln/plugin.h).
#pragma once

#include <memory>

#include "kiln/family.h"
#include "kiln/plugin.h"

namespace kiln::plugin {

// Checks the family descriptor (struct sizes, required functions, name, schema, problem slots,
// catalog: every entry must pass the schema and the family's validate) and wraps it. `templates`:
// the plugin's template files, shared by its families. invalid_argument says what is wrong.
Result<std::shared_ptr<const Family>> adapt_family(const kiln_family& desc, std::shared_ptr<const PluginInfo> info,
                                                   std::shared_ptr<const TemplateFiles> templates);

// Names that specs and plugins may use: [a-z][a-z0-9_]* for families and parameters.
bool valid_identifier(std::string_view s);

}  // namespace kiln::plugin
