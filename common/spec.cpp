#include "kiln/spec.h"

#include <charconv>
#include <regex>

namespace kiln {
namespace {

bool valid_name(std::string_view s) {
  if (s.empty() || s.size() > 64 || !(s[0] >= 'a' && s[0] <= 'z')) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

bool valid_string_value(std::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.'))
      return false;
  return true;
}

}  // namespace

std::optional<std::int64_t> Params::get_int(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  if (auto* v = std::get_if<std::int64_t>(&it->second)) return *v;
  return std::nullopt;
}

std::optional<std::string> Params::get_str(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  if (auto* v = std::get_if<std::string>(&it->second)) return *v;
  return std::nullopt;
}

std::string Params::canonical() const {
  std::string s;
  for (const auto& [name, value] : values_) {
    if (!s.empty()) s += ',';
    s += name;
    s += '=';
    if (auto* i = std::get_if<std::int64_t>(&value)) s += std::to_string(*i);
    else s += std::get<std::string>(value);
  }
  return s;
}

Result<Params> Params::parse(std::string_view text) {
  Params p;
  if (text.empty()) return p;
  if (text.size() > 4096) return invalid_argument("parameter list longer than 4096 characters");
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view item = text.substr(pos, end - pos);
    std::size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      return invalid_argument("parameter '" + std::string(item) + "' is not name=value");
    std::string_view name = item.substr(0, eq), value = item.substr(eq + 1);
    if (!valid_name(name))
      return invalid_argument("bad parameter name '" + std::string(name) + "' (expected [a-z][a-z0-9_]*)");
    if (p.has(std::string(name))) return invalid_argument("parameter '" + std::string(name) + "' given twice");
    bool is_int = !value.empty() && (value[0] == '-' || (value[0] >= '0' && value[0] <= '9'));
    if (is_int) {
      std::int64_t v = 0;
      auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
      if (ec != std::errc() || ptr != value.data() + value.size())
        return invalid_argument("parameter '" + std::string(name) + "' has a bad integer value '" +
                                std::string(value) + "'");
      p.set(std::string(name), v);
    } else {
      if (!valid_string_value(value))
        return invalid_argument("parameter '" + std::string(name) + "' has a bad value '" + std::string(value) +
                                "' (expected [A-Za-z0-9_.]+)");
      p.set(std::string(name), std::string(value));
    }
    pos = end + 1;
  }
  return p;
}

std::string KernelSpec::canonical() const { return family + "(" + params.canonical() + ")"; }

Result<KernelSpec> KernelSpec::parse(std::string_view text) {
  KernelSpec spec;
  std::size_t open = text.find('(');
  std::string_view fam = open == std::string_view::npos ? text : text.substr(0, open);
  if (!valid_name(fam)) return invalid_argument("bad family name '" + std::string(fam) + "'");
  spec.family = std::string(fam);
  if (open != std::string_view::npos) {
    if (text.back() != ')') return invalid_argument("kernel spec '" + std::string(text) + "' lacks a closing ')'");
    KILN_ASSIGN_OR_RETURN(spec.params, Params::parse(text.substr(open + 1, text.size() - open - 2)));
  }
  return spec;
}

Status validate_arch(std::string_view arch) {
  static const std::regex k_arch("sm_[1-9][0-9]{1,2}[af]?");
  if (arch.size() > 8 || !std::regex_match(arch.begin(), arch.end(), k_arch))
    return invalid_argument("bad GPU architecture '" + std::string(arch) +
                            "' (expected sm_<major><minor> with an optional a/f suffix, e.g. sm_80, sm_90a)");
  return {};
}

Result<GpuArch> parse_arch(std::string_view arch) {
  KILN_TRY(validate_arch(arch));
  GpuArch out;
  std::string_view digits = arch.substr(3);
  if (digits.back() == 'a' || digits.back() == 'f') {
    out.suffix = digits.back();
    digits.remove_suffix(1);
  }
  for (char c : digits) out.capability = out.capability * 10 + (c - '0');
  return out;
}

std::string arch_for_capability(int major, int minor) {
  std::string arch = "sm_" + std::to_string(major) + std::to_string(minor);
  // Hopper and Blackwell datacenter parts: compile for the arch-specific feature set.
  if ((major == 9 && minor == 0) || (major == 10 && (minor == 0 || minor == 3))) arch += "a";
  return arch;
}

}  // namespace kiln
