// Signed records: what the remote tier and bundles (kiln export / import) hold.
//
// A sealed record is the payload followed by a 32-byte tag, HMAC-SHA256 under the fleet key of
// "kiln-signed 1\n" + name + "\n" + payload. The name (a kernel's cache key, a tuning row's
// identity) is bound into the tag, so a valid record moved under another name fails verification
// like a flipped byte does. A kernel entry's payload is a little-endian u32 length, that much JSON
// metadata (the cache::Entry fields), then the cubin.
#pragma once

#include <string>
#include <string_view>

#include "cache/store.h"
#include "cache/tuning.h"
#include "kiln/status.h"

namespace kiln::remote {

inline constexpr std::size_t k_tag_bytes = 32;

std::string seal(std::string_view fleet_key, std::string_view name, std::string_view payload);
// The payload of a sealed record, or corruption when it is too short or its tag does not match.
Result<std::string_view> unseal(std::string_view fleet_key, std::string_view name, std::string_view sealed);

// The record name of a kernel entry: "k/" + its cache key.
std::string entry_name(const std::string& key);

// The record name of a tuning row: "t/" + SHA-256 of its family, signature and whole setup.
std::string tuning_name(const std::string& family, const std::string& signature, const cache::Setup& setup);

// A kernel entry sealed under the fleet key (its counters and times are not included).
std::string seal_entry(std::string_view fleet_key, const cache::Entry& e);
// Verifies the tag, decodes, and checks that the entry is the one asked for: the key, the
// expected arch and toolchain (empty fields unchecked), and the cubin's size and SHA-256.
// corruption (with the reason) for anything that does not hold.
Result<cache::Entry> open_entry(std::string_view fleet_key, const std::string& key, std::string_view sealed,
                                const cache::Expected& expected = {});

}  // namespace kiln::remote
