#include "jit/tuning_setup.h"

#include <map>
#include <mutex>

#include "common/sha256.h"
#include "jit/nvrtc.h"
#include "jit/templates.h"

namespace kiln::jit {

Result<std::string> tuning_toolchain(const Family& family, const Problem& problem) {
  static std::mutex mu;
  static std::map<std::string, std::string> memo;  // family name + rendered source -> fingerprint
  KILN_ASSIGN_OR_RETURN(Rendered rendered, family.render(family.heuristic(problem)));
  const std::string memo_key = std::string(family.name()) + "\n" + rendered.source;
  {
    std::lock_guard lock(mu);
    if (auto it = memo.find(memo_key); it != memo.end()) return it->second;
  }
  KILN_ASSIGN_OR_RETURN(Nvrtc * nvrtc, Nvrtc::get());
  KILN_ASSIGN_OR_RETURN(auto closure, TemplateSet::active().closure(rendered.source));
  std::string text = "kiln-tune 1\nnvrtc " + nvrtc->version() + "\nfamily " + std::string(family.name()) + " " +
                     std::to_string(family.version()) + "\ntemplates " + closure.hash + "\noptions";
  for (const auto& o : Nvrtc::base_options()) text += " " + o;
  std::string fp = sha256_hex(text + "\n");
  std::lock_guard lock(mu);
  memo.emplace(memo_key, fp);
  return fp;
}

Result<cache::Setup> tuning_setup(const Family& family, const Problem& problem, const std::string& arch,
                                  const std::string& device_name, const std::string& driver_version) {
  KILN_ASSIGN_OR_RETURN(std::string toolchain, tuning_toolchain(family, problem));
  return cache::Setup{arch, device_name, driver_version, std::move(toolchain)};
}

}  // namespace kiln::jit
