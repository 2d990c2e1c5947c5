// Kernel specifications: a family name plus canonical parameters, and GPU architecture names.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "kiln/status.h"

namespace kiln {

using ParamValue = std::variant<std::int64_t, std::string>;

// An ordered set of named parameters. Names match [a-z][a-z0-9_]*; string values match
// [A-Za-z0-9_.]+. The syntax alone keeps source text out of parameters: a family's schema then
// narrows each value to its allowed set before anything is rendered.
class Params {
 public:
  Params() = default;
  Params(std::initializer_list<std::pair<const std::string, ParamValue>> init) : values_(init) {}

  Params& set(const std::string& name, std::int64_t v) { values_[name] = v; return *this; }
  Params& set(const std::string& name, std::string v) { values_[name] = std::move(v); return *this; }
  Params& set(const std::string& name, const char* v) { values_[name] = std::string(v); return *this; }
  std::optional<std::int64_t> get_int(const std::string& name) const;
  std::optional<std::string> get_str(const std::string& name) const;
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  const std::map<std::string, ParamValue>& values() const { return values_; }

  // "block=256,dtype=bf16,vec=8": names sorted, integers in decimal. Same set, same string.
  std::string canonical() const;
  // Parses the canonical form (and any order of it). Rejects bad syntax with invalid_argument.
  static Result<Params> parse(std::string_view text);

  bool operator==(const Params&) const = default;

 private:
  std::map<std::string, ParamValue> values_;
};

struct KernelSpec {
  std::string family;
  Params params;
  // "rmsnorm(block=256,dtype=bf16,vec=8)"
  std::string canonical() const;
  // Parses "family(k=v,...)" or "family" with no parameters.
  static Result<KernelSpec> parse(std::string_view text);
};

// Checks an architecture name: "sm_80", "sm_90a", "sm_100a", "sm_120f" ... (exact strings: sm_90a is
// not sm_90). Returns invalid_argument for anything else.
Status validate_arch(std::string_view arch);
// The arch string kiln compiles for on a device of this compute capability (9.0 -> "sm_90a").
std::string arch_for_capability(int major, int minor);

// An architecture name taken apart: "sm_90a" -> {90, 'a'}, "sm_80" -> {80, 0}.
struct GpuArch {
  int capability = 0;  // compute capability as major * 10 + minor
  // 'a': the arch-specific feature set (sm_90a's wgmma and setmaxnreg; code runs on that exact
  // capability only), 'f': the family-specific one, 0: the baseline.
  char suffix = 0;
};
// Parses a name that validate_arch accepts; invalid_argument for anything else.
Result<GpuArch> parse_arch(std::string_view arch);

}  // namespace kiln
