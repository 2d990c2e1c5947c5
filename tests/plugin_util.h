// Plugins for tests: private copies of the built plugins, and registering the example plugin and
// the C fixture plugin into the process-wide registry (the conformance tests cover every family).
#pragma once

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "kiln/family.h"
#include "plugin/loader.h"
#include "tests/test_util.h"

namespace kiln::testing {

// A problem of `family` from named field values, the way a caller that only knows the family by
// name (a plugin's user) builds one: i64 fields take the value as an integer, f64 fields as is.
// Every field must be named.
inline Problem named_problem(const Family& family, DType dtype, std::uint32_t alignment,
                             const std::vector<std::pair<std::string, double>>& values) {
  Problem p;
  p.dtype = dtype;
  p.alignment = alignment;
  EXPECT_EQ(values.size(), family.problem_fields().size()) << family.name() << ": name every field";
  for (const auto& [name, v] : values) {
    bool found = false;
    for (const ProblemField& f : family.problem_fields()) {
      if (f.name != name) continue;
      found = true;
      if (f.type == FieldType::i64) p.fields[f.slot].i = std::int64_t(v);
      else p.fields[f.slot].f = v;
    }
    EXPECT_TRUE(found) << family.name() << " has no field " << name;
  }
  return p;
}

// A built plugin: next to this test binary's build tree first (build/tests/<bin> ->
// build/<relative>), so a build folder carried to another machine finds its own; else the path
// CMake configured.
inline std::string built_plugin(const std::string& relative, const std::string& configured) {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto p = exe.parent_path().parent_path() / relative;
    if (std::filesystem::exists(p, ec)) return p.string();
  }
  return configured;
}

inline std::string example_plugin() {
  return built_plugin("plugins/softcap/libkiln_softcap.so", KILN_SOFTCAP_PLUGIN);
}
// The example rebuilt with an edited template (tests/CMakeLists.txt).
inline std::string example_plugin_changed() {
  return built_plugin("tests/test_plugins/libkiln_softcap_changed.so", KILN_SOFTCAP_CHANGED_PLUGIN);
}
// The C fixture, built as "ok" or broken in one way (tests/plugins/fixtures/c_plugin.c).
inline std::string c_plugin(const std::string& kind) {
  return built_plugin("tests/test_plugins/libc_" + kind + ".so",
                      std::string(KILN_TEST_PLUGIN_DIR) + "/libc_" + kind + ".so");
}

// Copies `file` into `dir` (mode 0755; mkdtemp made the directory 0700), so the loader's
// ownership and permission checks pass whatever the build folder's modes are.
inline std::string private_copy(const std::string& file, const std::filesystem::path& dir,
                                const std::string& name = {}) {
  const auto to = dir / (name.empty() ? std::filesystem::path(file).filename() : std::filesystem::path(name));
  std::filesystem::copy_file(file, to, std::filesystem::copy_options::overwrite_existing);
  ::chmod(to.c_str(), 0755);
  return to.string();
}

// Registers the example plugin and the C fixture in Registry::global() once per process, unless
// KILN_PLUGIN_PATH already brought them. Returns the loader's report of this call.
inline const plugin::Report& register_test_plugins() {
  static TempDir dir;
  static const plugin::Report report = [] {
    std::vector<std::string> entries;
    if (!Registry::global().find("softcap")) entries.push_back(private_copy(example_plugin(), dir.path()));
    if (!Registry::global().find("c_scale")) entries.push_back(private_copy(c_plugin("ok"), dir.path()));
    return plugin::load(Registry::global(), entries);
  }();
  return report;
}

}  // namespace kiln::testing
