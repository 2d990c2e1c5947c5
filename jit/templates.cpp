#include "jit/templates.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "common/sha256.h"

namespace kiln::jit {
namespace {

// The quoted includes of a source: #include "x" only (angle includes are not templates).
std::vector<std::string> quoted_includes(std::string_view src) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos < src.size()) {
    std::size_t eol = src.find('\n', pos);
    if (eol == std::string_view::npos) eol = src.size();
    std::string_view line = src.substr(pos, eol - pos);
    std::size_t i = line.find_first_not_of(" \t");
    if (i != std::string_view::npos && line[i] == '#') {
      i = line.find_first_not_of(" \t", i + 1);
      if (i != std::string_view::npos && line.substr(i, 7) == "include") {
        std::size_t q = line.find('"', i + 7);
        std::size_t q2 = q == std::string_view::npos ? q : line.find('"', q + 1);
        if (q2 != std::string_view::npos) out.emplace_back(line.substr(q + 1, q2 - q - 1));
      }
    }
    pos = eol + 1;
  }
  return out;
}

}  // namespace

const TemplateSet& TemplateSet::active() {
  static const TemplateSet set = [] {
    const char* dir = std::getenv("KILN_TEMPLATE_DIR");
    if (dir && *dir) {
      auto r = from_directory(dir);
      if (r.ok()) return std::move(r).value();
      // An unreadable override must not silently fall back: every compile will report it.
      TemplateSet broken;
      broken.origin_ = "KILN_TEMPLATE_DIR=" + std::string(dir) + " (unreadable: " + r.status().message() + ")";
      return broken;
    }
    return embedded();
  }();
  return set;
}

TemplateSet TemplateSet::embedded() {
  TemplateSet s;
  for (const auto& f : embedded_templates()) s.files_.emplace(f.path, std::string(f.bytes));
  s.origin_ = "embedded";
  return s;
}

Result<TemplateSet> TemplateSet::from_directory(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return io_error("template directory " + dir + " does not exist");
  TemplateSet s;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (!it->is_regular_file() || it->path().extension() != ".cuh") continue;
    std::ifstream in(it->path(), std::ios::binary);
    std::ostringstream buf;
    buf << in.rdbuf();
    s.files_.emplace(fs::relative(it->path(), dir).generic_string(), buf.str());
  }
  if (ec) return io_error("reading template directory " + dir + ": " + ec.message());
  s.origin_ = "directory " + dir;
  return s;
}

const std::string* TemplateSet::find(const std::string& path, const Overlay* overlay) const {
  if (auto it = files_.find(path); it != files_.end()) return &it->second;
  if (overlay)
    if (auto o = overlay->find(path); o != overlay->end()) return &o->second;
  return nullptr;
}

Result<TemplateSet::Closure> TemplateSet::closure(std::string_view source, const Overlay* overlay) const {
  std::set<std::string> seen;
  std::vector<std::string> todo = quoted_includes(source);
  while (!todo.empty()) {
    std::string h = todo.back();
    todo.pop_back();
    if (!seen.insert(h).second) continue;
    const std::string* body = find(h, overlay);
    if (!body) return not_found("template header '" + h + "' not found in the " + origin_ + " templates");
    for (auto& inc : quoted_includes(*body)) todo.push_back(inc);
  }
  Closure c;
  c.headers.assign(seen.begin(), seen.end());
  Sha256 hash;
  for (const auto& h : c.headers) {
    const std::string& body = *find(h, overlay);
    std::string head = h + "\n" + std::to_string(body.size()) + "\n";
    hash.update(head);
    hash.update(body);
  }
  c.hash = hash.finish_hex();
  return c;
}

}  // namespace kiln::jit
