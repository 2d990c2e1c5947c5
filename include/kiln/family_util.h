// Helpers for families whose templates take a dtype and a vector width: kiln's built-in families
// use them, and so may a plugin's (header-only).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kiln/spec.h"
#include "kiln/status.h"
#include "kiln/types.h"

namespace kiln {

// The device type of a dtype parameter value ("f32", "f16", "bf16"), as the template header
// common/dtype.cuh names it.
inline const char* device_type(const std::string& dtype) {
  if (dtype == "f16") return "kiln::f16_t";
  if (dtype == "bf16") return "kiln::bf16_t";
  return "float";
}

// invalid_argument unless params' `vec` elements of `dtype` fit one access of at most 16 bytes.
// params must have an integer "vec" and a string "dtype" naming a kiln dtype (validated).
inline Status check_access_width(std::string_view family, const Params& params) {
  const auto vec = *params.get_int("vec");
  const auto dtype = *params.get_str("dtype");
  if (vec * std::int64_t(dtype_size(*parse_dtype(dtype))) > 16)
    return invalid_argument(std::string(family) + ": vec * sizeof(dtype) must be at most 16 bytes (got vec=" +
                            std::to_string(vec) + " for " + dtype + ")");
  return {};
}

}  // namespace kiln
