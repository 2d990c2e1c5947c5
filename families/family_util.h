// Small helpers every built-in family uses when validating and rendering.
#pragma once

#include <string>
#include <string_view>

#include "kiln/spec.h"
#include "kiln/status.h"
#include "kiln/types.h"

namespace kiln::families {

// The device type of a dtype parameter value ("f32", "f16", "bf16"), as templates/common/dtype.cuh
// names it.
inline const char* device_type(const std::string& dtype) {
  if (dtype == "f16") return "kiln::f16_t";
  if (dtype == "bf16") return "kiln::bf16_t";
  return "float";
}

// invalid_argument unless params' `vec` elements of `dtype` fit one access of at most 16 bytes.
inline Status check_access_width(std::string_view family, const Params& params) {
  const auto vec = *params.get_int("vec");
  const auto dtype = *params.get_str("dtype");
  if (vec * std::int64_t(dtype_size(*parse_dtype(dtype))) > 16)
    return invalid_argument(std::string(family) + ": vec * sizeof(dtype) must be at most 16 bytes (got vec=" +
                            std::to_string(vec) + " for " + dtype + ")");
  return {};
}

}  // namespace kiln::families
