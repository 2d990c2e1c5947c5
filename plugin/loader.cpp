#include "plugin/loader.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>

#include "common/sha256.h"
#include "jit/templates.h"
#include "plugin/adapter.h"

namespace kiln::plugin {
namespace {

namespace fs = std::filesystem;

bool valid_label(std::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-' || c == '+')) return false;
  return true;
}

// Relative, '/'-separated, no "." or ".." parts: a path NVRTC resolves inside the template set.
bool valid_template_path(std::string_view p) {
  if (p.empty() || p.size() > 200 || p.front() == '/' || p.back() == '/') return false;
  for (char c : p)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-' || c == '/')) return false;
  std::size_t start = 0;
  while (start <= p.size()) {
    std::size_t end = p.find('/', start);
    if (end == std::string_view::npos) end = p.size();
    std::string_view part = p.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

// Template text crosses into the compile workers' JSON, which takes well-formed UTF-8 only (no
// overlong forms, no surrogates), and NVRTC takes C strings: no NUL bytes either.
bool valid_utf8_text(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const unsigned c = static_cast<unsigned char>(s[i]);
    if (c == 0) return false;
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t n = 0;
    unsigned min = 0;
    if (c >= 0xc2 && c <= 0xdf) n = 1, min = 0x80;
    else if (c >= 0xe0 && c <= 0xef) n = 2, min = 0x800;
    else if (c >= 0xf0 && c <= 0xf4) n = 3, min = 0x10000;
    else return false;
    if (i + n >= s.size()) return false;
    unsigned cp = c & (0x3fu >> n);
    for (std::size_t k = 1; k <= n; ++k) {
      const unsigned b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xc0) != 0x80) return false;
      cp = cp << 6 | (b & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n + 1;
  }
  return true;
}

// Family i of the descriptor's array. The array's stride is the plugin's sizeof(kiln_family), its
// first entry's struct_size (checked by register_initialized): larger than kiln's for a plugin
// built against a newer header of the same API version.
const kiln_family& family_at(const kiln_plugin& desc, std::uint32_t i) {
  const std::size_t stride = desc.families[0].struct_size;
  return *reinterpret_cast<const kiln_family*>(reinterpret_cast<const char*>(desc.families) + i * stride);
}

// The plugin's template files from all its families (one path, one content), checked, and their
// hash. A file may not shadow one of kiln's templates with different bytes.
Status collect_templates(const kiln_plugin& desc, TemplateFiles& out, std::string& hash) {
  const jit::TemplateSet& kiln_templates = jit::TemplateSet::active();
  for (std::uint32_t i = 0; i < desc.family_count; ++i) {
    const kiln_family& f = family_at(desc, i);
    if (f.template_count && !f.templates) return invalid_argument("a family has a null template list");
    for (std::uint32_t j = 0; j < f.template_count; ++j) {
      const kiln_template_file& t = f.templates[j];
      if (!t.path || !valid_template_path(t.path))
        return invalid_argument(std::string("template path '") + (t.path ? t.path : "(null)") +
                                "' is not a relative path of [A-Za-z0-9_.-/] without '.' or '..' parts");
      if (!t.source) return invalid_argument(std::string("template '") + t.path + "' has no source");
      std::string body(t.source, t.size);
      if (!valid_utf8_text(body)) return invalid_argument(std::string("template '") + t.path + "' is not UTF-8 text");
      if (const std::string* own = kiln_templates.find(t.path); own && *own != body)
        return invalid_argument(std::string("template '") + t.path + "' would shadow kiln's own template of that path");
      auto [it, inserted] = out.emplace(t.path, body);
      if (!inserted && it->second != body)
        return invalid_argument(std::string("two families ship different templates at '") + t.path + "'");
    }
  }
  Sha256 h;
  for (const auto& [path, body] : out) {
    std::string head = path + "\n" + std::to_string(body.size()) + "\n";
    h.update(head);
    h.update(body);
  }
  hash = h.finish_hex();
  return {};
}

std::string owner_of(const Family& f) {
  const PluginInfo* p = f.plugin();
  return p ? "plugin '" + p->name + "' (" + p->path + ")" : "kiln";
}

// Everything after init: descriptor, families, conflicts. Registers all families or none.
Status register_initialized(Registry& registry, const kiln_plugin& desc, const std::string& path,
                            std::shared_ptr<const PluginInfo>& registered) {
  if (!desc.families || desc.family_count == 0) return invalid_argument("it provides no families");
  if (desc.family_count > 256) return invalid_argument("it provides more than 256 families");
  // Every entry of the array has the first one's size; a size kiln cannot stride by is refused
  // before any entry past the first is read.
  const std::uint32_t size = desc.families[0].struct_size;
  if (size < KILN_FAMILY_MIN_STRUCT_SIZE || size % alignof(kiln_family) != 0)
    return invalid_argument("its kiln_family struct_size " + std::to_string(size) + " is below this ABI's " +
                            std::to_string(KILN_FAMILY_MIN_STRUCT_SIZE) + " or not a multiple of " +
                            std::to_string(alignof(kiln_family)));
  auto info = std::make_shared<PluginInfo>();
  info->name = desc.name;
  info->version = desc.version;
  info->path = path;
  auto templates = std::make_shared<TemplateFiles>();
  KILN_TRY(collect_templates(desc, *templates, info->templates_hash));

  std::vector<std::shared_ptr<const Family>> families;
  for (std::uint32_t i = 0; i < desc.family_count; ++i) {
    const kiln_family& d = family_at(desc, i);
    if (d.struct_size != size)
      return invalid_argument("family #" + std::to_string(i) + " has struct_size " + std::to_string(d.struct_size) +
                              ", the first has " + std::to_string(size));
    auto f = adapt_family(d, info, templates);
    if (!f.ok()) return invalid_argument("family #" + std::to_string(i) + " is invalid: " + f.status().message());
    const std::string name((*f)->name());
    if (std::find(info->families.begin(), info->families.end(), name) != info->families.end())
      return invalid_argument("it provides family '" + name + "' twice");
    if (const Family* existing = registry.find(name))
      return invalid_argument("conflict: family '" + name + "' is already provided by " + owner_of(*existing) +
                              "; the first is kept");
    info->families.push_back(name);
    families.push_back(std::move(*f));
  }
  for (auto& f : families) KILN_TRY(registry.add(std::move(f)));
  registered = std::move(info);
  return {};
}

const kiln_plugin* call_entry(kiln_plugin_entry_fn entry) {
  try {
    return entry();
  } catch (...) {
    return nullptr;
  }
}

// Owned by this user or root, and writable by nobody else.
std::optional<std::string> unsafe(const struct stat& st) {
  if (st.st_uid != ::geteuid() && st.st_uid != 0)
    return "owned by uid " + std::to_string(st.st_uid) + ", neither this user (uid " + std::to_string(::geteuid()) +
           ") nor root";
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    return std::string("writable by group or others (mode ") + mode + ")";
  }
  return std::nullopt;
}

class Loader {
 public:
  Loader(Registry& registry, Report& report) : registry_(registry), report_(report) {}

  void entry(const std::string& e) {
    struct stat st{};
    if (::stat(e.c_str(), &st) != 0) return skip(e, "no such file or directory");
    if (S_ISDIR(st.st_mode)) return directory(e, st);
    file(e);
  }

 private:
  void skip(const std::string& path, std::string reason) { report_.skipped.push_back({path, std::move(reason)}); }

  void directory(const std::string& dir, const struct stat& st) {
    if (auto why = unsafe(st)) return skip(dir, "the directory is " + *why);
    std::error_code ec;
    std::vector<std::string> files;
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
      if (it->path().extension() == ".so" && it->is_regular_file(ec)) files.push_back(it->path().string());
    if (ec) return skip(dir, "cannot list the directory: " + ec.message());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) file(f);
  }

  void file(const std::string& given) {
    std::error_code ec;
    const fs::path real = fs::canonical(given, ec);
    if (ec) return skip(given, "cannot resolve the path: " + ec.message());
    const std::string path = real.string();
    if (!seen_.insert(path).second) return skip(given, "the same file is already listed (" + path + ")");
    struct stat st{}, dir_st{};
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return skip(path, "not a regular file");
    if (auto why = unsafe(st)) return skip(path, "the file is " + *why);
    if (::stat(real.parent_path().c_str(), &dir_st) != 0) return skip(path, "cannot stat its directory");
    if (auto why = unsafe(dir_st)) return skip(path, "its directory is " + *why);

    void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = ::dlerror();
      return skip(path, std::string("not a loadable shared library: ") + (e ? e : "dlopen failed"));
    }
    // A plugin is never unloaded: families, templates and bound variants point into it, and a
    // plugin rejected below may have started threads or registered atexit handlers.
    auto entry_fn = reinterpret_cast<kiln_plugin_entry_fn>(::dlsym(lib, KILN_PLUGIN_ENTRY_SYMBOL));
    if (!entry_fn) return skip(path, std::string("missing symbol ") + KILN_PLUGIN_ENTRY_SYMBOL + " (not a kiln plugin?)");
    Status s = register_plugin(registry_, call_entry(entry_fn), path, report_);
    (void)s;  // register_plugin recorded the reason
  }

  Registry& registry_;
  Report& report_;
  std::set<std::string> seen_;
};

Report& global_report() {
  static Report r;
  return r;
}

void log_skipped(const Report& report, std::size_t from) {
  for (std::size_t i = from; i < report.skipped.size(); ++i)
    std::fprintf(stderr, "kiln: plugin %s skipped: %s\n", report.skipped[i].path.c_str(),
                 report.skipped[i].reason.c_str());
}

}  // namespace

Status register_plugin(Registry& registry, const kiln_plugin* desc, const std::string& path, Report& report) {
  auto skip = [&](const std::string& reason) {
    report.skipped.push_back({path, reason});
    return invalid_argument(reason);
  };
  if (!desc) return skip("its entry point returned no descriptor");
  if (desc->api_version != KILN_PLUGIN_API_VERSION)
    return skip("built for plugin ABI version " + std::to_string(desc->api_version) + "; this kiln loads version " +
                std::to_string(KILN_PLUGIN_API_VERSION));
  if (desc->struct_size < sizeof(kiln_plugin))
    return skip("its kiln_plugin struct_size " + std::to_string(desc->struct_size) + " is below this ABI's " +
                std::to_string(sizeof(kiln_plugin)));
  if (!desc->name || !valid_label(desc->name) || !desc->version || !valid_label(desc->version))
    return skip("its name and version must be 1-64 characters of [A-Za-z0-9_.+-]");
  for (const Family* f : registry.all())
    if (f->plugin() && f->plugin()->name == desc->name)
      return skip(std::string("conflict: a plugin named '") + desc->name + "' is already loaded from " +
                  f->plugin()->path + "; the first is kept");
  if (desc->init) {
    const kiln_host host{KILN_PLUGIN_API_VERSION, sizeof(kiln_host), KILN_VERSION};
    kiln_plugin_error err;
    err.message[0] = '\0';
    const int rc = desc->init(desc->context, &host, &err);
    if (rc != KILN_OK)
      return skip("its init failed (code " + std::to_string(rc) + "): " +
                  std::string(err.message, strnlen(err.message, sizeof err.message)));
  }
  std::shared_ptr<const PluginInfo> info;
  Status s = register_initialized(registry, *desc, path, info);
  if (!s.ok()) {
    if (desc->shutdown) desc->shutdown(desc->context);
    return skip(s.message());
  }
  report.loaded.push_back(std::move(info));
  return {};
}

Report load(Registry& registry, const std::vector<std::string>& entries, bool quiet) {
  Report report;
  Loader loader(registry, report);
  for (const auto& e : entries)
    if (!e.empty()) loader.entry(e);
  if (!quiet) log_skipped(report, 0);
  return report;
}

std::string default_dir() {
  if (const char* x = std::getenv("XDG_DATA_HOME"); x && *x == '/') return std::string(x) + "/kiln/plugins";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.local/share/kiln/plugins";
  return {};
}

std::vector<std::string> search_path() {
  const char* env = std::getenv("KILN_PLUGIN_PATH");
  if (!env) return {default_dir()};
  std::vector<std::string> out;
  std::string s = env;
  std::size_t start = 0;
  while (start <= s.size()) {
    std::size_t end = s.find(':', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

void populate_global(Registry& registry) {
  Report& report = global_report();
  (void)register_plugin(registry, builtin_descriptor(), k_builtin_path, report);
  for (const OpDecl* op : builtin_ops()) (void)registry.add_op(*op);  // checked when the family added it
  std::vector<std::string> entries = search_path();
  // The default directory is optional; entries someone listed in KILN_PLUGIN_PATH are not.
  std::error_code ec;
  if (!std::getenv("KILN_PLUGIN_PATH") && (entries[0].empty() || !fs::exists(entries[0], ec))) entries.clear();
  Report found = load(registry, entries, true);
  for (auto& l : found.loaded) report.loaded.push_back(std::move(l));
  for (auto& s : found.skipped) report.skipped.push_back(std::move(s));
  log_skipped(report, 0);
}

const Report& process_report() {
  (void)Registry::global();
  return global_report();
}

}  // namespace kiln::plugin
