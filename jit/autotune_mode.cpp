#include "jit/autotune_mode.h"

#include <cstdlib>

namespace kiln::jit {

Result<AutotuneMode> autotune_mode_from_env() {
  const char* v = std::getenv("KILN_AUTOTUNE");
  if (!v || !*v) return AutotuneMode::off;
  if (auto m = parse_autotune_mode(v)) return *m;
  return invalid_argument(std::string("KILN_AUTOTUNE must be 0, 1 or wait (got '") + v + "')");
}

const char* autotune_mode_name(AutotuneMode m) {
  switch (m) {
    case AutotuneMode::off: return "off";
    case AutotuneMode::background: return "background";
    case AutotuneMode::wait: return "wait";
  }
  return "off";
}

std::optional<AutotuneMode> parse_autotune_mode(const std::string& name) {
  if (name == "0" || name == "off") return AutotuneMode::off;
  if (name == "1" || name == "background") return AutotuneMode::background;
  if (name == "wait") return AutotuneMode::wait;
  return std::nullopt;
}

}  // namespace kiln::jit
