#include "remote/signed.h"

#include <cstdint>

#include <nlohmann/json.hpp>

#include "common/hmac.h"
#include "common/sha256.h"

namespace kiln::remote {
namespace {

using nlohmann::json;

constexpr std::string_view k_domain = "kiln-signed 1\n";
constexpr std::size_t k_max_meta = 64u << 20;

Tag tag_of(std::string_view fleet_key, std::string_view name, std::string_view payload) {
  HmacSha256 h(fleet_key);
  h.update(k_domain);
  h.update(name);
  h.update("\n");
  h.update(payload);
  return h.finish();
}

}  // namespace

std::string seal(std::string_view fleet_key, std::string_view name, std::string_view payload) {
  const Tag t = tag_of(fleet_key, name, payload);
  std::string out;
  out.reserve(payload.size() + t.size());
  out.append(payload);
  out.append(reinterpret_cast<const char*>(t.data()), t.size());
  return out;
}

Result<std::string_view> unseal(std::string_view fleet_key, std::string_view name, std::string_view sealed) {
  if (sealed.size() < k_tag_bytes) return corruption("signed record " + std::string(name) + " is too short to hold a tag");
  const std::string_view payload = sealed.substr(0, sealed.size() - k_tag_bytes);
  const Tag t = tag_of(fleet_key, name, payload);
  const std::string_view want(reinterpret_cast<const char*>(t.data()), t.size());
  if (!equal_constant_time(want, sealed.substr(payload.size())))
    return corruption("signed record " + std::string(name) + " failed HMAC verification",
                      "altered, damaged, or signed with another fleet key");
  return payload;
}

std::string entry_name(const std::string& key) { return "k/" + key; }

std::string tuning_name(const std::string& family, const std::string& signature, const cache::Setup& setup) {
  return "t/" + sha256_hex(family + "\n" + signature + "\n" + setup.arch + "\n" + setup.device_name + "\n" +
                           setup.driver_version + "\n" + setup.toolchain);
}

std::string seal_entry(std::string_view fleet_key, const cache::Entry& e) {
  const json meta = {{"key", e.key},
                     {"family", e.family},
                     {"family_version", e.family_version},
                     {"params", e.params},
                     {"arch", e.arch},
                     {"toolchain", e.toolchain},
                     {"key_text", e.key_text},
                     {"size", static_cast<std::int64_t>(e.cubin.size())},
                     {"checksum", sha256_hex(e.cubin)},
                     {"lowered_name", e.lowered_name},
                     {"compile_log", e.compile_log},
                     {"compile_ms", e.compile_ms},
                     {"registers", e.registers},
                     {"shared_bytes", e.shared_bytes},
                     {"spill_bytes", e.spill_bytes}};
  const std::string text = meta.dump(-1, ' ', false, json::error_handler_t::replace);
  const std::uint32_t n = std::uint32_t(text.size());
  std::string payload;
  payload.reserve(4 + text.size() + e.cubin.size());
  for (int i = 0; i < 4; ++i) payload.push_back(char((n >> (8 * i)) & 0xff));
  payload += text;
  payload += e.cubin;
  return seal(fleet_key, entry_name(e.key), payload);
}

Result<cache::Entry> open_entry(std::string_view fleet_key, const std::string& key, std::string_view sealed,
                                const cache::Expected& expected) {
  KILN_ASSIGN_OR_RETURN(std::string_view payload, unseal(fleet_key, entry_name(key), sealed));
  auto bad = [&](const std::string& why) { return corruption("signed entry " + key + ": " + why); };
  if (payload.size() < 4) return bad("no metadata");
  std::uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= std::uint32_t(static_cast<unsigned char>(payload[std::size_t(i)])) << (8 * i);
  if (n > k_max_meta || n > payload.size() - 4) return bad("metadata length out of range");
  json meta = json::parse(payload.substr(4, n), nullptr, false);
  if (meta.is_discarded() || !meta.is_object()) return bad("metadata is not a JSON object");
  cache::Entry e;
  try {
    e.key = meta.at("key").get<std::string>();
    e.family = meta.at("family").get<std::string>();
    e.family_version = meta.at("family_version").get<int>();
    e.params = meta.at("params").get<std::string>();
    e.arch = meta.at("arch").get<std::string>();
    e.toolchain = meta.at("toolchain").get<std::string>();
    e.key_text = meta.value("key_text", std::string());
    e.size = meta.at("size").get<std::int64_t>();
    e.checksum = meta.at("checksum").get<std::string>();
    e.lowered_name = meta.at("lowered_name").get<std::string>();
    e.compile_log = meta.value("compile_log", std::string());
    e.compile_ms = meta.value("compile_ms", 0.0);
    e.registers = meta.value("registers", -1);
    e.shared_bytes = meta.value("shared_bytes", -1);
    e.spill_bytes = meta.value("spill_bytes", -1);
  } catch (const std::exception& ex) {
    return bad(std::string("metadata: ") + ex.what());
  }
  e.cubin = std::string(payload.substr(4 + n));
  if (e.key != key) return bad("it holds the entry of key " + e.key);
  if (!expected.arch.empty() && e.arch != expected.arch) return bad("built for " + e.arch + ", not " + expected.arch);
  if (!expected.toolchain.empty() && e.toolchain != expected.toolchain) return bad("built by another toolchain");
  if (e.size != std::int64_t(e.cubin.size()) || e.checksum != sha256_hex(e.cubin)) return bad("cubin size or checksum");
  if (e.cubin.empty() || e.lowered_name.empty()) return bad("no cubin or kernel name");
  return e;
}

}  // namespace kiln::remote
