// When tuning happens for a shape that has no tuned winner yet: the KILN_AUTOTUNE setting and the
// names the protocol and the tools use for it.
#pragma once

#include <optional>
#include <string>

#include "kiln/status.h"

namespace kiln::jit {

// How a first call for a shape treats tuning: KILN_AUTOTUNE unset or "0" reads tuned winners only;
// "1" also asks kilnd to tune missing signatures in the background; "wait" tunes a missing
// signature before answering (in kilnd, or in-process when embedded).
enum class AutotuneMode { off, background, wait };
Result<AutotuneMode> autotune_mode_from_env();
const char* autotune_mode_name(AutotuneMode m);
std::optional<AutotuneMode> parse_autotune_mode(const std::string& name);

}  // namespace kiln::jit
