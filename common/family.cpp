// The Family base's defaults: schema validation, signatures with a power-of-two bucket, the
// problem a bucket is tuned on, problems from named fields, field-list checks, and catalogs per
// arch. Part of the family SDK that plugins link (kiln_family_sdk), so nothing here may reach the
// registry.
#include <algorithm>
#include <cstdio>

#include <nlohmann/json.hpp>

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

Status check_problem_fields(const std::vector<ProblemField>& fields) {
  if (fields.size() > std::size_t(Problem::k_max_fields))
    return invalid_argument("a problem has at most " + std::to_string(Problem::k_max_fields) + " fields, not " +
                            std::to_string(fields.size()));
  std::vector<bool> named(fields.size(), false);
  int bucketed = 0;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    const ProblemField& f = fields[i];
    bool good_name = !f.name.empty() && f.name[0] >= 'a' && f.name[0] <= 'z';
    for (char c : f.name) good_name = good_name && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_');
    if (!good_name) return invalid_argument("problem field name '" + f.name + "' is not [a-z][a-z0-9_]*");
    for (std::size_t j = 0; j < i; ++j)
      if (fields[j].name == f.name) return invalid_argument("problem field '" + f.name + "' is declared twice");
    if (f.type != FieldType::i64 && f.type != FieldType::f64)
      return invalid_argument("problem field '" + f.name + "' has an unknown type");
    if (f.slot >= fields.size() || named[f.slot])
      return invalid_argument("problem field '" + f.name + "' has slot " + std::to_string(f.slot) +
                              ": slots must be 0.." + std::to_string(fields.size() - 1) + ", each named once");
    named[f.slot] = true;
    if (f.bucketed) {
      if (!f.key || f.type != FieldType::i64)
        return invalid_argument("bucketed problem field '" + f.name + "' must be an i64 key");
      ++bucketed;
    }
  }
  if (bucketed > 1) return invalid_argument("a problem has at most one bucketed field");
  return {};
}

std::string field_value_text(const ProblemField& f, const Problem& p) {
  const kiln_problem_value v = p.fields[f.slot];
  if (f.type == FieldType::i64) return std::to_string(v.i);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v.f);
  return buf;
}

std::string describe_family(const Family& f) {
  nlohmann::json j;
  j["name"] = std::string(f.name());
  j["version"] = f.version();
  j["plugin"] = f.plugin() ? f.plugin()->name : std::string();
  j["fields"] = nlohmann::json::array();
  for (const ProblemField& pf : f.problem_fields())
    j["fields"].push_back({{"name", pf.name},
                           {"slot", pf.slot},
                           {"type", pf.type == FieldType::i64 ? "i64" : "f64"},
                           {"key", pf.key},
                           {"bucketed", pf.bucketed},
                           {"doc", pf.doc}});
  j["params"] = nlohmann::json::array();
  for (const ParamDef& d : f.schema()) {
    nlohmann::json p = {{"name", d.name}, {"doc", d.doc}};
    if (d.is_int()) p["ints"] = d.ints;
    else p["choices"] = d.choices;
    j["params"].push_back(std::move(p));
  }
  return j.dump();
}

std::string Family::signature(const Problem& p) const {
  std::string s = std::string("dtype=") + dtype_name(p.dtype) + ",align=" + std::to_string(p.alignment);
  for (const ProblemField& f : problem_fields()) {
    if (!f.key) continue;
    if (f.bucketed)
      s += "," + f.name + "<=" + std::to_string(tuning_bucket(p.fields[f.slot].i));
    else
      s += "," + f.name + "=" + field_value_text(f, p);
  }
  return s;
}

Problem Family::tuning_problem(const Problem& p) const {
  Problem out = p;
  for (const ProblemField& f : problem_fields())
    if (f.bucketed) out.fields[f.slot].i = tuning_bucket(p.fields[f.slot].i);
  return out;
}

Result<Problem> Family::problem_from_shape(DType dtype,
                                           const std::vector<std::pair<std::string, std::int64_t>>& shape) const {
  const auto& fields = problem_fields();
  std::string known;
  for (const auto& f : fields) known += (known.empty() ? "" : ", ") + f.name;
  Problem p;
  p.dtype = dtype;
  p.alignment = 16;
  std::vector<bool> given(fields.size(), false);
  for (const auto& f : fields) {
    if (f.type == FieldType::i64) p.fields[f.slot].i = f.default_i;
    else p.fields[f.slot].f = f.default_f;
  }
  for (const auto& [name, value] : shape) {
    const std::string& wanted = name;
    auto it = std::find_if(fields.begin(), fields.end(), [&](const ProblemField& f) { return f.name == wanted; });
    if (it == fields.end())
      return invalid_argument(std::string(this->name()) + ": no field named '" + name + "'", "its fields: " + known);
    const auto i = std::size_t(it - fields.begin());
    if (given[i]) return invalid_argument(std::string(this->name()) + ": field '" + name + "' given twice");
    given[i] = true;
    if (it->type == FieldType::i64) p.fields[it->slot].i = value;
    else p.fields[it->slot].f = double(value);
  }
  for (std::size_t i = 0; i < fields.size(); ++i)
    if (!given[i] && fields[i].key)
      return invalid_argument(std::string(this->name()) + ": the shape must name every key field; '" +
                                  fields[i].name + "' is missing",
                              "its fields: " + known);
  return p;
}

}  // namespace kiln
