// HMAC-SHA256 (RFC 2104) over common/sha256, and a comparison whose time does not depend on where
// two tags differ.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "common/sha256.h"

namespace kiln {

using Tag = std::array<std::uint8_t, 32>;

// Feeds the message in pieces; finish() gives the tag. The key may have any length.
class HmacSha256 {
 public:
  explicit HmacSha256(std::string_view key);
  void update(std::string_view data) { inner_.update(data); }
  Tag finish();

 private:
  Sha256 inner_;
  std::array<std::uint8_t, 64> outer_pad_{};
};

Tag hmac_sha256(std::string_view key, std::string_view data);

// True when the byte strings are equal; the time depends on their lengths only.
bool equal_constant_time(std::string_view a, std::string_view b);

}  // namespace kiln
