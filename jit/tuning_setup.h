// What a tuning result is keyed on besides the family and signature: the device (arch, name,
// driver) and a fingerprint of the toolchain that built the candidates. A result for another
// setup is never used.
#pragma once

#include <string>

#include "cache/tuning.h"
#include "kiln/family.h"
#include "kiln/status.h"

namespace kiln::jit {

// The toolchain fingerprint a family's tuning results depend on: NVRTC version, the family and
// its version, the hash of the templates its kernels include, and the base compile options.
Result<std::string> tuning_toolchain(const Family& family, const Problem& problem);
// The setup for lookups and records: the device's arch, name and driver plus the toolchain.
Result<cache::Setup> tuning_setup(const Family& family, const Problem& problem, const std::string& arch,
                                  const std::string& device_name, const std::string& driver_version);

}  // namespace kiln::jit
