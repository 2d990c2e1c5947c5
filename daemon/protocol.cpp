#include "daemon/protocol.h"

#include <cstdio>
#include <cstring>
#include <exception>

namespace kiln::daemon {
namespace {

void put_u16(std::uint8_t* p, std::uint16_t v) {
  p[0] = static_cast<std::uint8_t>(v);
  p[1] = static_cast<std::uint8_t>(v >> 8);
}

void put_u32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

std::uint16_t get_u16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}

std::uint32_t get_u32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Field readers that report a missing or mistyped field as invalid_argument instead of throwing.
Status read_string(const nlohmann::json& j, const char* name, std::string& out, bool required = true) {
  auto it = j.find(name);
  if (it == j.end()) return required ? invalid_argument(std::string("missing field '") + name + "'") : Status{};
  if (!it->is_string()) return invalid_argument(std::string("field '") + name + "' must be a string");
  out = it->get<std::string>();
  return {};
}

template <class Int>
Status read_int(const nlohmann::json& j, const char* name, Int& out, bool required = true) {
  auto it = j.find(name);
  if (it == j.end()) return required ? invalid_argument(std::string("missing field '") + name + "'") : Status{};
  if (!it->is_number_integer()) return invalid_argument(std::string("field '") + name + "' must be an integer");
  out = static_cast<Int>(it->get<std::int64_t>());
  return {};
}

Status read_double(const nlohmann::json& j, const char* name, double& out) {
  auto it = j.find(name);
  if (it == j.end()) return {};
  if (!it->is_number()) return invalid_argument(std::string("field '") + name + "' must be a number");
  out = it->get<double>();
  return {};
}

}  // namespace

HeaderBytes encode_header(const FrameHeader& h) {
  HeaderBytes b{};
  std::memcpy(b.data(), k_magic.data(), 4);
  put_u16(b.data() + 4, h.version);
  put_u16(b.data() + 6, h.flags);
  put_u32(b.data() + 8, h.json_len);
  put_u32(b.data() + 12, h.blob_len);
  return b;
}

Result<FrameHeader> decode_header(const HeaderBytes& b) {
  if (std::memcmp(b.data(), k_magic.data(), 4) != 0)
    return invalid_argument("bad frame: wrong magic (expected \"KILN\")");
  FrameHeader h;
  h.version = get_u16(b.data() + 4);
  h.flags = get_u16(b.data() + 6);
  h.json_len = get_u32(b.data() + 8);
  h.blob_len = get_u32(b.data() + 12);
  if (h.version != k_protocol_version)
    return invalid_argument("bad frame: protocol version " + std::to_string(h.version) + " is not supported",
                            "this peer speaks protocol version " + std::to_string(k_protocol_version));
  if ((h.flags & ~k_known_flags) != 0)
    return invalid_argument("bad frame: unknown flags 0x" + [&] {
      char buf[8];
      std::snprintf(buf, sizeof buf, "%04x", unsigned(h.flags));
      return std::string(buf);
    }());
  return h;
}

Status check_limits(const FrameHeader& h, FrameKind kind) {
  const bool req = kind == FrameKind::request;
  const std::uint32_t max_json = req ? k_max_request_json : k_max_reply_json;
  const std::uint32_t max_blob = req ? k_max_request_blob : k_max_reply_blob;
  const char* what = req ? "request" : "reply";
  if (h.json_len == 0) return invalid_argument(std::string("bad frame: ") + what + " has an empty JSON body");
  if (h.json_len > max_json)
    return invalid_argument(std::string("bad frame: ") + what + " JSON body of " + std::to_string(h.json_len) +
                            " bytes exceeds the limit of " + std::to_string(max_json));
  if (h.blob_len > max_blob)
    return invalid_argument(std::string("bad frame: ") + what + " blob of " + std::to_string(h.blob_len) +
                            " bytes exceeds the limit of " + std::to_string(max_blob));
  return {};
}

std::string dump_json(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Result<nlohmann::json> parse_json(std::string_view text) {
  try {
    nlohmann::json j = nlohmann::json::parse(text.begin(), text.end());
    return j;
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument("malformed JSON body", e.what());
  } catch (const std::exception& e) {
    return invalid_argument("malformed JSON body", e.what());
  }
}

nlohmann::json ok_reply() { return nlohmann::json{{"ok", true}}; }

nlohmann::json error_reply(const Status& s) {
  return nlohmann::json{
      {"ok", false},
      {"error", {{"code", code_name(s.code())}, {"message", s.message()}, {"details", s.details()}}}};
}

Status reply_status(const nlohmann::json& reply) {
  if (!reply.is_object()) return invalid_argument("daemon reply is not a JSON object");
  auto ok = reply.find("ok");
  if (ok == reply.end() || !ok->is_boolean()) return invalid_argument("daemon reply has no boolean 'ok'");
  if (ok->get<bool>()) return {};
  auto err = reply.find("error");
  if (err == reply.end() || !err->is_object()) return internal_error("daemon reported a failure without an error");
  std::string code = "internal", message, details;
  (void)read_string(*err, "code", code, false);
  (void)read_string(*err, "message", message, false);
  (void)read_string(*err, "details", details, false);
  Code c = code_from_name(code);
  if (c == Code::ok) c = Code::internal;  // a failed reply must never read as success
  return Status(c, message.empty() ? "daemon error" : message, details);
}

nlohmann::json entry_to_json(const cache::Entry& e) {
  return nlohmann::json{
      {"key", e.key},
      {"family", e.family},
      {"family_version", e.family_version},
      {"params", e.params},
      {"arch", e.arch},
      {"toolchain", e.toolchain},
      {"key_text", e.key_text},
      {"size", e.size},
      {"checksum", e.checksum},
      {"lowered_name", e.lowered_name},
      {"compile_log", e.compile_log},
      {"compile_ms", e.compile_ms},
      {"registers", e.registers},
      {"shared_bytes", e.shared_bytes},
      {"spill_bytes", e.spill_bytes},
      {"created", e.created},
      {"last_used", e.last_used},
      {"hits", e.hits},
      {"pinned", e.pinned},
  };
}

Result<cache::Entry> entry_from_json(const nlohmann::json& j) {
  if (!j.is_object()) return invalid_argument("entry is not a JSON object");
  cache::Entry e;
  KILN_TRY(read_string(j, "key", e.key));
  KILN_TRY(read_string(j, "family", e.family));
  KILN_TRY(read_int(j, "family_version", e.family_version, false));
  KILN_TRY(read_string(j, "params", e.params));
  KILN_TRY(read_string(j, "arch", e.arch));
  KILN_TRY(read_string(j, "toolchain", e.toolchain, false));
  KILN_TRY(read_string(j, "key_text", e.key_text, false));
  KILN_TRY(read_int(j, "size", e.size));
  KILN_TRY(read_string(j, "checksum", e.checksum));
  KILN_TRY(read_string(j, "lowered_name", e.lowered_name, false));
  KILN_TRY(read_string(j, "compile_log", e.compile_log, false));
  KILN_TRY(read_double(j, "compile_ms", e.compile_ms));
  KILN_TRY(read_int(j, "registers", e.registers, false));
  KILN_TRY(read_int(j, "shared_bytes", e.shared_bytes, false));
  KILN_TRY(read_int(j, "spill_bytes", e.spill_bytes, false));
  KILN_TRY(read_int(j, "created", e.created, false));
  KILN_TRY(read_int(j, "last_used", e.last_used, false));
  KILN_TRY(read_int(j, "hits", e.hits, false));
  if (auto p = j.find("pinned"); p != j.end() && !p->is_null()) {
    if (!p->is_boolean()) return invalid_argument("entry field 'pinned' must be a boolean");
    e.pinned = p->get<bool>();
  }
  if (e.size < 0) return invalid_argument("entry size is negative");
  return e;
}

const char* source_name(jit::ArtifactSource s) {
  switch (s) {
    case jit::ArtifactSource::compiled: return "compiled";
    case jit::ArtifactSource::remote: return "remote";
    case jit::ArtifactSource::cache: break;
  }
  return "cache";
}

Result<jit::ArtifactSource> parse_source(std::string_view name) {
  if (name == "cache") return jit::ArtifactSource::cache;
  if (name == "compiled") return jit::ArtifactSource::compiled;
  if (name == "remote") return jit::ArtifactSource::remote;
  return invalid_argument("unknown artifact source '" + std::string(name) + "'");
}

nlohmann::json builder_stats_to_json(const jit::BuilderStats& s) {
  return nlohmann::json{
      {"requests", s.requests},
      {"cache_hits", s.cache_hits},
      {"cache_misses", s.cache_misses},
      {"compiles", s.compiles},
      {"compile_failures", s.compile_failures},
      {"coalesced", s.coalesced},
      {"store_failures", s.store_failures},
      {"negative_hits", s.negative_hits},
      {"remote_hits", s.remote_hits},
      {"remote_misses", s.remote_misses},
      {"compile_seconds",
       {{"buckets", std::vector<double>(std::begin(jit::k_compile_seconds_buckets), std::end(jit::k_compile_seconds_buckets))},
        {"counts", s.compile_seconds_counts},
        {"sum", s.compile_seconds_sum}}},
  };
}

nlohmann::json remote_counters_to_json(const remote::Tier& tier) {
  const remote::Counters c = tier.counters();
  return nlohmann::json{
      {"endpoint", tier.describe()},   {"up", c.up},
      {"lookups", c.lookups},          {"hits", c.hits},
      {"misses", c.misses},            {"rejected", c.rejected},
      {"timeouts", c.timeouts},        {"errors", c.errors},
      {"skipped", c.skipped},          {"writes", c.writes},
      {"write_errors", c.write_errors}, {"writes_dropped", c.writes_dropped},
      {"full", c.full},                {"connects", c.connects},
      {"outages", c.outages},          {"pending_writes", c.pending_writes},
      {"tls", tier.config().tls != nullptr}, {"tls_errors", c.tls_errors},
      {"locks_won", c.locks_won},      {"locks_waited", c.locks_waited},
      {"lock_wait_hits", c.lock_wait_hits}, {"lock_timeouts", c.lock_timeouts},
  };
}

nlohmann::json store_stats_to_json(const cache::Stats& s) {
  return nlohmann::json{
      {"entries", s.entries}, {"bytes", s.bytes},   {"hits", s.hits},
      {"misses", s.misses},   {"corrupt", s.corrupt}, {"stores", s.stores},
      {"store_errors", s.store_errors},
      {"evictions", s.evictions}, {"pinned_entries", s.pinned_entries},
      {"pinned_bytes", s.pinned_bytes}, {"max_bytes", s.max_bytes},
  };
}

}  // namespace kiln::daemon

namespace kiln::daemon {

nlohmann::json problem_to_json(const Family& family, const Problem& p) {
  nlohmann::json fields = nlohmann::json::object();
  for (const ProblemField& f : family.problem_fields()) {
    if (f.type == FieldType::i64) fields[f.name] = p.fields[f.slot].i;
    else fields[f.name] = p.fields[f.slot].f;
  }
  return nlohmann::json{{"dtype", dtype_name(p.dtype)},
                        {"alignment", p.alignment},
                        {"cc", p.cc},
                        {"sm_count", p.sm_count},
                        {"fields", fields}};
}

Result<Problem> problem_from_json(const Family& family, const nlohmann::json& j) {
  if (!j.is_object()) return invalid_argument("problem is not a JSON object");
  Problem p;
  std::string dtype;
  KILN_TRY(read_string(j, "dtype", dtype));
  auto t = parse_dtype(dtype);
  if (!t) return invalid_argument("problem has an unknown dtype '" + dtype + "'");
  p.dtype = *t;
  std::int64_t alignment = 0;
  KILN_TRY(read_int(j, "alignment", alignment));
  if (alignment < 1 || alignment > 256 || (alignment & (alignment - 1)))
    return invalid_argument("problem alignment must be a power of two from 1 to 256");
  p.alignment = std::uint32_t(alignment);
  std::int64_t cc = 0, sms = 0;
  if (j.contains("cc")) KILN_TRY(read_int(j, "cc", cc));
  if (j.contains("sm_count")) KILN_TRY(read_int(j, "sm_count", sms));
  if (cc < 0 || cc > 255 || sms < 0 || sms > 65535) return invalid_argument("problem cc or sm_count out of range");
  p.cc = std::uint8_t(cc);
  p.sm_count = std::uint16_t(sms);
  auto fields = j.find("fields");
  if (fields == j.end() || !fields->is_object()) return invalid_argument("problem fields must be a JSON object");
  const auto& decl = family.problem_fields();
  for (const auto& [name, value] : fields->items()) {
    const std::string& wanted = name;
    auto f = std::find_if(decl.begin(), decl.end(), [&](const ProblemField& d) { return d.name == wanted; });
    if (f == decl.end())
      return invalid_argument("family " + std::string(family.name()) + " has no problem field '" + name + "'");
    if (f->type == FieldType::i64) {
      if (!value.is_number_integer()) return invalid_argument("problem field '" + name + "' must be an integer");
      p.fields[f->slot].i = value.get<std::int64_t>();
    } else {
      if (!value.is_number()) return invalid_argument("problem field '" + name + "' must be a number");
      p.fields[f->slot].f = value.get<double>();
    }
  }
  for (const ProblemField& f : decl)
    if (!fields->contains(f.name)) return invalid_argument("problem field '" + f.name + "' is missing");
  return p;
}

nlohmann::json tuning_record_to_json(const cache::TuningRecord& r) {
  nlohmann::json cands = nlohmann::json::array();
  for (const auto& c : r.candidates) {
    nlohmann::json j{{"params", c.params},     {"status", cache::candidate_status_name(c.status)},
                     {"median_ms", c.median_ms}, {"spread", c.spread},
                     {"launches", c.launches}};
    if (!c.error.empty()) j["error"] = c.error;
    cands.push_back(std::move(j));
  }
  return nlohmann::json{{"family", r.family},
                        {"signature", r.signature},
                        {"problem", r.problem},
                        {"arch", r.setup.arch},
                        {"device_name", r.setup.device_name},
                        {"driver_version", r.setup.driver_version},
                        {"toolchain", r.setup.toolchain},
                        {"winner", r.winner},
                        {"winner_ms", r.winner_ms},
                        {"heuristic", r.heuristic},
                        {"heuristic_ms", r.heuristic_ms},
                        {"noise_band", r.noise_band},
                        {"compile_ms", r.compile_ms},
                        {"measure_ms", r.measure_ms},
                        {"created", r.created},
                        {"candidates", std::move(cands)}};
}

Result<cache::TuningRecord> tuning_record_from_json(const nlohmann::json& j) {
  if (!j.is_object()) return invalid_argument("tuning record is not a JSON object");
  cache::TuningRecord r;
  KILN_TRY(read_string(j, "family", r.family));
  KILN_TRY(read_string(j, "signature", r.signature));
  KILN_TRY(read_string(j, "problem", r.problem, false));
  KILN_TRY(read_string(j, "arch", r.setup.arch));
  KILN_TRY(read_string(j, "device_name", r.setup.device_name, false));
  KILN_TRY(read_string(j, "driver_version", r.setup.driver_version, false));
  KILN_TRY(read_string(j, "toolchain", r.setup.toolchain, false));
  KILN_TRY(read_string(j, "winner", r.winner, false));
  KILN_TRY(read_double(j, "winner_ms", r.winner_ms));
  KILN_TRY(read_string(j, "heuristic", r.heuristic, false));
  KILN_TRY(read_double(j, "heuristic_ms", r.heuristic_ms));
  KILN_TRY(read_double(j, "noise_band", r.noise_band));
  KILN_TRY(read_double(j, "compile_ms", r.compile_ms));
  KILN_TRY(read_double(j, "measure_ms", r.measure_ms));
  KILN_TRY(read_int(j, "created", r.created, false));
  auto cands = j.find("candidates");
  if (cands != j.end()) {
    if (!cands->is_array()) return invalid_argument("tuning record candidates must be an array");
    for (const auto& c : *cands) {
      if (!c.is_object()) return invalid_argument("a tuning candidate is not a JSON object");
      cache::CandidateResult cr;
      std::string status;
      KILN_TRY(read_string(c, "params", cr.params));
      KILN_TRY(read_string(c, "status", status));
      auto st = cache::parse_candidate_status(status);
      if (!st) return invalid_argument("unknown candidate status '" + status + "'");
      cr.status = *st;
      KILN_TRY(read_double(c, "median_ms", cr.median_ms));
      KILN_TRY(read_double(c, "spread", cr.spread));
      KILN_TRY(read_int(c, "launches", cr.launches, false));
      KILN_TRY(read_string(c, "error", cr.error, false));
      r.candidates.push_back(std::move(cr));
    }
  }
  return r;
}

}  // namespace kiln::daemon
