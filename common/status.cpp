#include "kiln/status.h"

namespace kiln {
namespace {
constexpr const char* k_names[] = {"ok",          "invalid_argument", "device_error", "shape_mismatch",
                                   "unsupported_dtype", "not_found",  "corruption",   "compile_error",
                                   "driver_error", "io_error",        "unavailable",  "timeout",
                                   "shutting_down", "internal"};
}

const char* code_name(Code code) {
  auto i = static_cast<std::size_t>(code);
  return i < std::size(k_names) ? k_names[i] : "internal";
}

Code code_from_name(const std::string& name) {
  for (std::size_t i = 0; i < std::size(k_names); ++i)
    if (name == k_names[i]) return static_cast<Code>(i);
  return Code::internal;
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  std::string s = std::string(code_name(code_)) + ": " + message_;
  if (!details_.empty()) s += "\n" + details_;
  return s;
}

}  // namespace kiln
