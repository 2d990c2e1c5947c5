// Cache keys: a semantic part (family, family version, the plugin that provides the family and the
// hash of its template files, canonical params) and a toolchain
// fingerprint (NVRTC version, hash of the template closure, canonical options, exact arch).
// No absolute paths, no mtimes: the same inputs give the same key on every machine.
#pragma once

#include <string>
#include <vector>

#include "kiln/status.h"

namespace kiln::jit {

struct KeyInputs {
  std::string family;
  int family_version = 0;
  std::string params;       // canonical
  std::string plugin;            // "name version" of the plugin that registered the family, or "-"
  std::string plugin_templates;  // its PluginInfo::templates_hash, or "-"
  std::string arch;
  std::string nvrtc_version;
  std::string template_hash;
  std::vector<std::string> options;  // as rendered; canonicalized here
};

struct Key {
  std::string hex;        // sha256 of `text`
  std::string toolchain;  // sha256 of the toolchain lines alone
  std::string text;       // the lines hashed, one "name value" per line: `kiln why` prints them
};

Key make_key(const KeyInputs& in);

// Options in a canonical order with duplicates removed; options that do not change the produced
// code (-pch and its friends, -Xptxas=-v) are dropped.
std::vector<std::string> canonical_options(const std::vector<std::string>& options);

}  // namespace kiln::jit
