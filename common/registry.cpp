#include <algorithm>

#include "kiln/family.h"
#include "plugin/loader.h"

namespace kiln {

Registry& Registry::global() {
  static Registry* r = [] {
    // The built-in families, then KILN_PLUGIN_PATH's (or the default directory's) plugins, all
    // through one loader (plugin/loader.h).
    auto* reg = new Registry;
    plugin::populate_global(*reg);
    return reg;
  }();
  return *r;
}

Status Registry::add(std::shared_ptr<const Family> family) {
  std::lock_guard lock(mu_);
  for (const auto& f : families_)
    if (f->name() == family->name())
      return invalid_argument("a family named '" + std::string(family->name()) + "' is already registered");
  if (Status s = check_problem_fields(family->problem_fields()); !s.ok())
    return invalid_argument(std::string(family->name()) + ": " + s.message());
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

Status Registry::add_op(OpDecl op) {
  KILN_TRY(op.check());
  std::lock_guard lock(mu_);
  for (const auto& o : ops_)
    if (o->name == op.name) return invalid_argument("an op named '" + op.name + "' is already registered");
  ops_.push_back(std::make_unique<const OpDecl>(std::move(op)));
  return {};
}

const OpDecl* Registry::find_op(std::string_view name) const {
  std::lock_guard lock(mu_);
  for (const auto& o : ops_)
    if (o->name == name) return o.get();
  return nullptr;
}

std::vector<const OpDecl*> Registry::ops() const {
  std::lock_guard lock(mu_);
  std::vector<const OpDecl*> out;
  for (const auto& o : ops_) out.push_back(o.get());
  return out;
}

}  // namespace kiln
