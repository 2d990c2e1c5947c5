// Template files compiled into a library: the table cmake/embed_templates.cmake generates. A
// plugin built with kiln_add_plugin(... TEMPLATES <dir>) gets every *.cuh file under <dir> as
// plugin_templates(), named by its path relative to <dir> (the name its kernels include it by).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln {

struct EmbeddedFile {
  const char* path;        // '/'-separated, relative to the embedded folder: "softcap/softcap.cuh"
  std::string_view bytes;  // the file's contents
};

// The plugin's embedded templates, sorted by path; defined in the generated source.
const std::vector<EmbeddedFile>& plugin_templates();

// `files` as (path, source) pairs: what plugin_bridge::FamilyExport::templates takes.
inline std::vector<std::pair<std::string, std::string>> template_sources(const std::vector<EmbeddedFile>& files) {
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(files.size());
  for (const auto& f : files) out.emplace_back(f.path, std::string(f.bytes));
  return out;
}

}  // namespace kiln
