#include <algorithm>

#include "kiln/family.h"

namespace kiln {

Status Family::validate(const Params& params) const {
  const auto& defs = schema();
  for (const auto& [name, value] : params.values()) {
    // Captured through a reference: clang before 16 (the fuzz build) cannot capture a structured binding.
    const std::string& wanted = name;
    auto def = std::find_if(defs.begin(), defs.end(), [&](const ParamDef& d) { return d.name == wanted; });
    if (def == defs.end())
      return invalid_argument(std::string(this->name()) + ": unknown parameter '" + name + "'");
    if (def->is_int()) {
      auto v = params.get_int(name);
      if (!v || std::find(def->ints.begin(), def->ints.end(), *v) == def->ints.end()) {
        std::string allowed;
        for (auto i : def->ints) allowed += (allowed.empty() ? "" : ", ") + std::to_string(i);
        return invalid_argument(std::string(this->name()) + ": parameter '" + name + "' must be one of {" +
                                allowed + "}");
      }
    } else {
      auto v = params.get_str(name);
      if (!v || std::find(def->choices.begin(), def->choices.end(), *v) == def->choices.end()) {
        std::string allowed;
        for (const auto& c : def->choices) allowed += (allowed.empty() ? "" : ", ") + c;
        return invalid_argument(std::string(this->name()) + ": parameter '" + name + "' must be one of {" +
                                allowed + "}");
      }
    }
  }
  for (const auto& d : defs)
    if (!params.has(d.name))
      return invalid_argument(std::string(this->name()) + ": missing parameter '" + d.name + "'");
  return {};
}

Registry& Registry::global() {
  static Registry* r = [] {
    auto* reg = new Registry;
    register_builtin_families(*reg);
    return reg;
  }();
  return *r;
}

Status Registry::add(std::shared_ptr<const Family> family) {
  std::lock_guard lock(mu_);
  for (const auto& f : families_)
    if (f->name() == family->name())
      return invalid_argument("a family named '" + std::string(family->name()) + "' is already registered");
  families_.push_back(std::move(family));
  return {};
}

const Family* Registry::find(std::string_view name) const {
  std::lock_guard lock(mu_);
  for (const auto& f : families_)
    if (f->name() == name) return f.get();
  return nullptr;
}

std::vector<const Family*> Registry::all() const {
  std::lock_guard lock(mu_);
  std::vector<const Family*> out;
  for (const auto& f : families_) out.push_back(f.get());
  return out;
}

Result<const Family*> Registry::resolve(const KernelSpec& spec) const {
  const Family* f = find(spec.family);
  if (!f) return not_found("no kernel family named '" + spec.family + "'");
  KILN_TRY(f->validate(spec.params));
  return f;
}

}  // namespace kiln
