// Reading the fields of a request object without exceptions: a missing or mistyped field is an
// invalid_argument naming the field.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kiln/status.h"

namespace kiln::daemon {

// Leaves `out` alone when the field is absent or null.
Status optional_string(const nlohmann::json& req, const char* name, std::string& out);
Status required_string(const nlohmann::json& req, const char* name, std::string& out);
// Appends the strings of an array field to `out`; absent or null is an empty array.
Status string_array(const nlohmann::json& req, const char* name, std::vector<std::string>& out);

}  // namespace kiln::daemon
