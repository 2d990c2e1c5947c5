#include "daemon/request_fields.h"

namespace kiln::daemon {

using nlohmann::json;

Status optional_string(const json& req, const char* name, std::string& out) {
  auto it = req.find(name);
  if (it == req.end() || it->is_null()) return {};
  if (!it->is_string()) return invalid_argument(std::string("field '") + name + "' must be a string");
  out = it->get<std::string>();
  return {};
}

Status required_string(const json& req, const char* name, std::string& out) {
  auto it = req.find(name);
  if (it == req.end()) return invalid_argument(std::string("missing field '") + name + "'");
  if (!it->is_string()) return invalid_argument(std::string("field '") + name + "' must be a string");
  out = it->get<std::string>();
  return {};
}

Status string_array(const json& req, const char* name, std::vector<std::string>& out) {
  auto it = req.find(name);
  if (it == req.end() || it->is_null()) return {};
  if (!it->is_array()) return invalid_argument(std::string("field '") + name + "' must be an array of strings");
  for (const auto& v : *it) {
    if (!v.is_string()) return invalid_argument(std::string("field '") + name + "' must be an array of strings");
    out.push_back(v.get<std::string>());
  }
  return {};
}

}  // namespace kiln::daemon
