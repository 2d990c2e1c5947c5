// Signed bundles of cache entries and tuning rows, for hosts that cannot reach the fleet's remote
// tier (air-gapped machines, container images): `kiln export` writes one, `kiln import` reads it.
//
// Layout: the line "kiln-bundle 1\n"; a little-endian u64 length and that much manifest JSON
// (format, creation time, and per record its name, kind, description, byte count and SHA-256);
// the manifest's 32-byte HMAC-SHA256 tag under the fleet key; then each record as a u64 length
// and the record sealed exactly as the remote tier stores it (remote/signed.h). A manifest that
// fails its tag refuses the whole bundle; a record that fails its own tag, its manifest digest or
// its entry checks is rejected alone and named, and the others are imported.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "cache/store.h"
#include "kiln/status.h"

namespace kiln::remote {

struct BundleContents {
  std::vector<cache::Entry> entries;
  // Tuning rows as (record name, JSON payload): the daemon protocol's tuning record codec.
  std::vector<std::pair<std::string, std::string>> tuning;
};

// Writes `contents` to `file` (replaced atomically: written aside, then renamed).
Status write_bundle(const std::filesystem::path& file, std::string_view fleet_key, const BundleContents& contents);

struct BundleReport {
  BundleContents verified;             // every record that passed
  std::vector<std::string> rejected;   // "name: why", one per record that did not
  std::int64_t created = 0;            // the manifest's creation time (unix seconds)
};

// Reads and verifies a bundle. corruption when the file is not a bundle, is truncated, or its
// manifest fails verification (another fleet's key, an altered manifest); io_error when it
// cannot be read.
Result<BundleReport> read_bundle(const std::filesystem::path& file, std::string_view fleet_key);

}  // namespace kiln::remote
