// The Family base's defaults: schema validation, signatures with a power-of-two bucket, the
// problem a bucket is tuned on, problems from named sizes, and catalogs per arch. Part of the family SDK that plugins
// link (kiln_family_sdk), so nothing here may reach the registry.
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

Result<std::vector<Params>> catalog_for(const Family& family, std::string_view arch) {
  KILN_ASSIGN_OR_RETURN(const GpuArch a, parse_arch(arch));
  std::vector<Params> out;
  for (Params& p : family.catalog())
    if (family.runs_on(p, a)) out.push_back(std::move(p));
  return out;
}

std::int64_t tuning_bucket(std::int64_t n) {
  if (n <= 0) return 0;
  std::int64_t b = 1;
  while (b < n && b < (std::int64_t(1) << 62)) b <<= 1;
  return b;
}

std::string Family::signature(const Problem& p) const {
  const auto names = problem_dims();
  const int bucketed = bucketed_dim();
  std::string s = std::string("dtype=") + dtype_name(p.dtype) + ",align=" + std::to_string(p.alignment);
  for (std::size_t i = 0; i < names.size() && i < std::size_t(Problem::k_max_dims); ++i) {
    if (int(i) == bucketed)
      s += "," + names[i] + "<=" + std::to_string(tuning_bucket(p.dims[i]));
    else
      s += "," + names[i] + "=" + std::to_string(p.dims[i]);
  }
  return s;
}

Problem Family::tuning_problem(const Problem& p) const {
  Problem out = p;
  const int bucketed = bucketed_dim();
  if (bucketed >= 0 && bucketed < Problem::k_max_dims) out.dims[bucketed] = tuning_bucket(p.dims[bucketed]);
  return out;
}

Result<Problem> Family::problem_from_shape(DType dtype,
                                           const std::vector<std::pair<std::string, std::int64_t>>& shape) const {
  const auto names = problem_dims();
  std::string known;
  for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
  Problem p;
  p.dtype = dtype;
  p.alignment = 16;
  std::vector<bool> given(names.size(), false);
  for (const auto& [name, value] : shape) {
    auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end())
      return invalid_argument(std::string(this->name()) + ": no dim named '" + name + "'", "its dims: " + known);
    const auto i = std::size_t(it - names.begin());
    if (given[i]) return invalid_argument(std::string(this->name()) + ": dim '" + name + "' given twice");
    given[i] = true;
    p.dims[i] = value;
  }
  for (std::size_t i = 0; i < names.size(); ++i)
    if (!given[i])
      return invalid_argument(std::string(this->name()) + ": the shape must name every dim; '" + names[i] +
                                  "' is missing",
                              "its dims: " + known);
  return p;
}

}  // namespace kiln
