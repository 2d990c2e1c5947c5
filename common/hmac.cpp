#include "common/hmac.h"

#include <algorithm>

namespace kiln {

HmacSha256::HmacSha256(std::string_view key) {
  std::array<std::uint8_t, 64> block{};
  if (key.size() > block.size()) {
    Sha256 h;
    h.update(key);
    const auto d = h.finish();
    std::copy(d.begin(), d.end(), block.begin());
  } else {
    std::copy(key.begin(), key.end(), block.begin());
  }
  std::array<std::uint8_t, 64> inner_pad{};
  for (std::size_t i = 0; i < block.size(); ++i) {
    inner_pad[i] = block[i] ^ 0x36;
    outer_pad_[i] = block[i] ^ 0x5c;
  }
  inner_.update(inner_pad.data(), inner_pad.size());
}

Tag HmacSha256::finish() {
  const auto inner = inner_.finish();
  Sha256 outer;
  outer.update(outer_pad_.data(), outer_pad_.size());
  outer.update(inner.data(), inner.size());
  return outer.finish();
}

Tag hmac_sha256(std::string_view key, std::string_view data) {
  HmacSha256 h(key);
  h.update(data);
  return h.finish();
}

bool equal_constant_time(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace kiln
