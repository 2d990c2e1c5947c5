// kilnd's wire protocol: frame layout, limits and the JSON codecs shared by server and client.
//
// A frame is a 16-byte little-endian header {magic "KILN", u16 version, u16 flags, u32 json_len,
// u32 blob_len}, then json_len bytes of UTF-8 JSON, then blob_len raw bytes. docs/protocol.md is
// the full specification. Nothing here does I/O and nothing here throws: codecs return
// Status/Result so that both ends can turn any malformed input into an error reply.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "cache/store.h"
#include "cache/tuning.h"
#include "jit/builder.h"
#include "kiln/family.h"
#include "kiln/status.h"
#include "remote/tier.h"

namespace kiln::daemon {

inline constexpr std::array<char, 4> k_magic = {'K', 'I', 'L', 'N'};
inline constexpr std::uint16_t k_protocol_version = 1;
inline constexpr std::size_t k_header_size = 16;

// Limits. A header announcing more is refused before any body byte is read or allocated.
inline constexpr std::uint32_t k_max_request_json = 1u << 20;  // 1 MiB
inline constexpr std::uint32_t k_max_request_blob = 0;         // requests carry no blob
inline constexpr std::uint32_t k_max_reply_json = 64u << 20;   // 64 MiB (large `list` replies)
inline constexpr std::uint32_t k_max_reply_blob = 256u << 20;  // 256 MiB (a cubin)

// No flag is defined in version 1; a frame with any flag bit set is refused so that a future flag
// can never be silently misread by an old peer.
inline constexpr std::uint16_t k_known_flags = 0;

enum class FrameKind { request, reply };

struct FrameHeader {
  std::uint16_t version = k_protocol_version;
  std::uint16_t flags = 0;
  std::uint32_t json_len = 0;
  std::uint32_t blob_len = 0;
};

using HeaderBytes = std::array<std::uint8_t, k_header_size>;

HeaderBytes encode_header(const FrameHeader& h);
// Checks magic, version and flags. invalid_argument names what is wrong.
Result<FrameHeader> decode_header(const HeaderBytes& bytes);
// Checks the announced lengths against the limits for `kind`.
Status check_limits(const FrameHeader& h, FrameKind kind);

// JSON text for the wire. Invalid UTF-8 (a compiler log can hold any byte) is replaced, never
// thrown about.
std::string dump_json(const nlohmann::json& j);
// Parses a frame body; malformed text is invalid_argument with the parser's reason as details.
Result<nlohmann::json> parse_json(std::string_view text);

// Replies.
nlohmann::json ok_reply();
nlohmann::json error_reply(const Status& status);
// The Status a reply carries: ok for {"ok":true}, the decoded error otherwise. A reply that is not
// shaped like one is invalid_argument.
Status reply_status(const nlohmann::json& reply);

// Cache entry metadata, without the blob (it travels as the frame's blob).
nlohmann::json entry_to_json(const cache::Entry& e);
Result<cache::Entry> entry_from_json(const nlohmann::json& j);

const char* source_name(jit::ArtifactSource s);
Result<jit::ArtifactSource> parse_source(std::string_view name);

nlohmann::json builder_stats_to_json(const jit::BuilderStats& s);
nlohmann::json store_stats_to_json(const cache::Stats& s);
// The remote tier's endpoint and counters (the "remote" object of a stats reply).
nlohmann::json remote_counters_to_json(const remote::Tier& tier);

// A problem of `family` as {"dtype", "alignment", "cc", "sm_count", "fields": {name: value}}
// (resolve and tune); reading needs every field named and refuses unknown ones.
nlohmann::json problem_to_json(const Family& family, const Problem& p);
Result<Problem> problem_from_json(const Family& family, const nlohmann::json& j);
// A tuning record with every candidate (tune replies, `kiln tune --json`, `kiln ls --tuned --json`).
nlohmann::json tuning_record_to_json(const cache::TuningRecord& r);
Result<cache::TuningRecord> tuning_record_from_json(const nlohmann::json& j);

}  // namespace kiln::daemon
