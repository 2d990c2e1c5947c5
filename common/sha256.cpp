#include "common/sha256.h"

#include <atomic>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define KILN_SHA256_NI 1
#endif

namespace kiln {
namespace {

constexpr std::uint32_t k_round[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline std::uint32_t rotr(std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

#ifdef KILN_SHA256_NI
// The SHA extensions (SHA-NI) with the SSSE3 and SSE4.1 shuffles they need.
bool cpu_has_sha_ni() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool ssse3 = c & (1u << 9), sse41 = c & (1u << 19);
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return ssse3 && sse41 && (b & (1u << 29));
}

// One 64-byte block with the SHA extensions. The state is kept as the two halves the round
// instruction takes: state0 = (A, B, E, F) and state1 = (C, D, G, H), from the high lane down.
__attribute__((target("sha,sse4.1,ssse3"))) void block_sha_ni(std::uint32_t* h, const std::uint8_t* p) {
  const __m128i be = _mm_set_epi64x(0x0c0d0e0f08090a0bll, 0x0405060700010203ll);
  __m128i abcd = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)), 0xB1);
  __m128i efgh = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 4)), 0x1B);
  __m128i state0 = _mm_alignr_epi8(abcd, efgh, 8);
  __m128i state1 = _mm_blend_epi16(efgh, abcd, 0xF0);
  const __m128i save0 = state0, save1 = state1;
  __m128i w[4];
  for (int i = 0; i < 4; ++i)
    w[i] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i)), be);
  for (int g = 0; g < 16; ++g) {
    // Rounds 4g .. 4g+3: two at a time, each taking two words of w + k.
    __m128i wk = _mm_add_epi32(w[g & 3], _mm_loadu_si128(reinterpret_cast<const __m128i*>(k_round + 4 * g)));
    state1 = _mm_sha256rnds2_epu32(state1, state0, wk);
    state0 = _mm_sha256rnds2_epu32(state0, state1, _mm_shuffle_epi32(wk, 0x0E));
    if (g < 12) {
      // Words 4g+16 .. 4g+19 from w[t-16], w[t-15] (msg1), w[t-7] (the aligned middle) and w[t-2] (msg2).
      __m128i t7 = _mm_alignr_epi8(w[(g + 3) & 3], w[(g + 2) & 3], 4);
      __m128i next = _mm_add_epi32(_mm_sha256msg1_epu32(w[g & 3], w[(g + 1) & 3]), t7);
      w[g & 3] = _mm_sha256msg2_epu32(next, w[(g + 3) & 3]);
    }
  }
  state0 = _mm_add_epi32(state0, save0);
  state1 = _mm_add_epi32(state1, save1);
  const __m128i feba = _mm_shuffle_epi32(state0, 0x1B);
  const __m128i dchg = _mm_shuffle_epi32(state1, 0xB1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h), _mm_blend_epi16(feba, dchg, 0xF0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h + 4), _mm_alignr_epi8(dchg, feba, 8));
}

std::atomic<bool> g_use_sha_ni{cpu_has_sha_ni()};
#endif

}  // namespace

bool sha256_accelerated() {
#ifdef KILN_SHA256_NI
  return g_use_sha_ni.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

bool sha256_set_accelerated(bool on) {
#ifdef KILN_SHA256_NI
  g_use_sha_ni.store(on && cpu_has_sha_ni(), std::memory_order_relaxed);
#endif
  return sha256_accelerated();
}

Sha256::Sha256()
    : h_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

void Sha256::block(const std::uint8_t* p) {
#ifdef KILN_SHA256_NI
  if (g_use_sha_ni.load(std::memory_order_relaxed)) {
    block_sha_ni(h_, p);
    return;
  }
#endif
  std::uint32_t w[64];
  for (int i = 0; i < 16; ++i)
    w[i] = std::uint32_t(p[4 * i]) << 24 | std::uint32_t(p[4 * i + 1]) << 16 |
           std::uint32_t(p[4 * i + 2]) << 8 | std::uint32_t(p[4 * i + 3]);
  for (int i = 16; i < 64; ++i) {
    std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  std::uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int i = 0; i < 64; ++i) {
    std::uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k_round[i] + w[i];
    std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
  }
  h_[0] += a; h_[1] += b; h_[2] += c; h_[3] += d; h_[4] += e; h_[5] += f; h_[6] += g; h_[7] += h;
}

void Sha256::update(const void* data, std::size_t n) {
  auto* p = static_cast<const std::uint8_t*>(data);
  total_ += n;
  if (buf_len_ > 0) {
    std::size_t take = std::min(n, sizeof(buf_) - buf_len_);
    std::memcpy(buf_ + buf_len_, p, take);
    buf_len_ += take; p += take; n -= take;
    if (buf_len_ < sizeof(buf_)) return;
    block(buf_);
    buf_len_ = 0;
  }
  for (; n >= 64; p += 64, n -= 64) block(p);
  std::memcpy(buf_, p, n);
  buf_len_ = n;
}

std::array<std::uint8_t, 32> Sha256::finish() {
  std::uint64_t bits = total_ * 8;
  std::uint8_t pad = 0x80;
  update(&pad, 1);
  std::uint8_t zero = 0;
  while (buf_len_ != 56) update(&zero, 1);
  std::uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = std::uint8_t(bits >> (56 - 8 * i));
  update(len, 8);
  std::array<std::uint8_t, 32> out;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) out[4 * i + j] = std::uint8_t(h_[i] >> (24 - 8 * j));
  return out;
}

std::string Sha256::finish_hex() {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::uint8_t b : finish()) { s += digits[b >> 4]; s += digits[b & 15]; }
  return s;
}

std::string sha256_hex(std::string_view data) {
  Sha256 h;
  h.update(data);
  return h.finish_hex();
}

}  // namespace kiln
