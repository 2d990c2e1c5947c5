// SHA-256, for cache keys and cubin checksums.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t n);
  void update(std::string_view s) { update(s.data(), s.size()); }
  std::array<std::uint8_t, 32> finish();
  std::string finish_hex();

 private:
  void block(const std::uint8_t* p);
  std::uint32_t h_[8];
  std::uint8_t buf_[64];
  std::size_t buf_len_ = 0;
  std::uint64_t total_ = 0;
};

std::string sha256_hex(std::string_view data);

// Whether blocks are hashed with the x86 SHA extensions (detected once; the portable code
// otherwise). sha256_set_accelerated(false) forces the portable code (tests compare the two);
// true takes effect only where the CPU has them. Returns the setting now in force.
bool sha256_accelerated();
bool sha256_set_accelerated(bool on);

}  // namespace kiln
