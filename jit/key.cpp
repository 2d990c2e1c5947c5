#include "jit/key.h"

#include <algorithm>

#include "common/sha256.h"

namespace kiln::jit {

std::vector<std::string> canonical_options(const std::vector<std::string>& options) {
  std::vector<std::string> out;
  for (const auto& o : options) {
    if (o == "-pch" || o.rfind("--pch", 0) == 0 || o.rfind("-pch-", 0) == 0 || o == "-Xptxas=-v" ||
        o == "--ptxas-options=-v")
      continue;
    out.push_back(o);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

Key make_key(const KeyInputs& in) {
  std::string opts;
  for (const auto& o : canonical_options(in.options)) opts += (opts.empty() ? "" : " ") + o;
  std::string toolchain_text = "nvrtc " + in.nvrtc_version + "\ntemplates " + in.template_hash + "\noptions " +
                               opts + "\narch " + in.arch + "\n";
  Key k;
  k.toolchain = sha256_hex(toolchain_text);
  k.text = "kiln-key 2\nfamily " + in.family + "\nfamily_version " + std::to_string(in.family_version) +
           "\nplugin " + in.plugin + "\nplugin_templates " + in.plugin_templates + "\nparams " + in.params +
           "\n" + toolchain_text;
  k.hex = sha256_hex(k.text);
  return k;
}

}  // namespace kiln::jit
