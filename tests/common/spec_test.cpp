#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/half.h"
#include "common/sha256.h"
#include "kiln/spec.h"

namespace kiln {
namespace {

TEST(Params, CanonicalIsSortedAndStable) {
  Params a{{"vec", std::int64_t(8)}, {"dtype", std::string("bf16")}, {"block", std::int64_t(256)}};
  EXPECT_EQ(a.canonical(), "block=256,dtype=bf16,vec=8");
  auto b = Params::parse("vec=8,block=256,dtype=bf16");
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b->canonical(), a.canonical());
  EXPECT_EQ(*b, a);
}

TEST(Params, RejectsHostileText) {
  for (const char* bad : {"dtype=float);}", "dtype=#include \"/etc/passwd\"", "block=99999999999999999999999",
                          "Block=1", "block", "=3", "block=1,block=2", "dtype=a b", "dtype=", "x=1;y=2",
                          "dtype=f16\n#define"}) {
    auto r = Params::parse(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), Code::invalid_argument) << bad;
    }
  }
}

TEST(KernelSpec, ParseRoundTrip) {
  auto s = KernelSpec::parse("rmsnorm(vec=4,dtype=f32,block=128)");
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->family, "rmsnorm");
  EXPECT_EQ(s->canonical(), "rmsnorm(block=128,dtype=f32,vec=4)");
  EXPECT_FALSE(KernelSpec::parse("rmsnorm(block=128").ok());
  EXPECT_FALSE(KernelSpec::parse("../etc(block=1)").ok());
}

TEST(Arch, ValidatesExactNames) {
  for (const char* ok : {"sm_80", "sm_86", "sm_90", "sm_90a", "sm_100a", "sm_120f"}) EXPECT_TRUE(validate_arch(ok).ok()) << ok;
  for (const char* bad : {"sm_9x", "sm_90;rm", "compute_90", "sm_", "SM_90", "sm_90ab", "sm_1000", "sm_08", ""})
    EXPECT_EQ(validate_arch(bad).code(), Code::invalid_argument) << bad;
  EXPECT_EQ(arch_for_capability(9, 0), "sm_90a");
  EXPECT_EQ(arch_for_capability(8, 0), "sm_80");
  EXPECT_EQ(arch_for_capability(8, 9), "sm_89");
}

TEST(Arch, ParsesIntoCapabilityAndSuffix) {
  auto parsed = [](const char* arch) {
    auto a = parse_arch(arch);
    EXPECT_TRUE(a.ok()) << arch;
    return std::pair{a->capability, a->suffix};
  };
  EXPECT_EQ(parsed("sm_80"), (std::pair{80, '\0'}));
  EXPECT_EQ(parsed("sm_90"), (std::pair{90, '\0'}));
  EXPECT_EQ(parsed("sm_90a"), (std::pair{90, 'a'}));
  EXPECT_EQ(parsed("sm_100a"), (std::pair{100, 'a'}));
  EXPECT_EQ(parsed("sm_120f"), (std::pair{120, 'f'}));
  EXPECT_EQ(parse_arch("sm_9x").status().code(), Code::invalid_argument);
  // The inverse of arch_for_capability.
  for (auto [major, minor] : {std::pair{8, 0}, {8, 6}, {8, 9}, {9, 0}, {10, 0}, {12, 0}}) {
    auto a = parse_arch(arch_for_capability(major, minor));
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->capability, major * 10 + minor);
  }
}

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  Sha256 h;  // incremental updates across block boundaries agree with one-shot
  std::string s(1000, 'a');
  for (std::size_t i = 0; i < s.size(); i += 7) h.update(s.substr(i, 7));
  EXPECT_EQ(h.finish_hex(), sha256_hex(s));
}

// The SHA-extension path (where the CPU has it) and the portable one agree, on the known vectors
// and on every length across several blocks.
TEST(Sha256, AcceleratedAndPortableAgree) {
  const bool accelerated = sha256_accelerated();
  std::string data;
  for (int i = 0; i < 300; ++i) data += char((i * 131 + 7) & 0xff);
  std::vector<std::string> portable;
  ASSERT_FALSE(sha256_set_accelerated(false));
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  for (std::size_t n = 0; n <= data.size(); ++n) portable.push_back(sha256_hex(std::string_view(data).substr(0, n)));
  if (!sha256_set_accelerated(true)) GTEST_SKIP() << "this CPU has no SHA extensions; the portable path was checked";
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  for (std::size_t n = 0; n <= data.size(); ++n)
    ASSERT_EQ(sha256_hex(std::string_view(data).substr(0, n)), portable[n]) << n;
  sha256_set_accelerated(accelerated);
}

TEST(Half, ConversionsRoundToNearestEven) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(f16_to_float(0x3555), 0.333251953125f);
  EXPECT_EQ(float_to_f16(1.0f + 1.0f / 2048), 0x3c00);  // tie -> even
  EXPECT_EQ(float_to_f16(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x4049), 3.140625f);
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);  // tie -> even
  for (int i = 0; i < 0x7c00; i += 37) EXPECT_EQ(float_to_f16(f16_to_float(std::uint16_t(i))), i) << i;
}

}  // namespace
}  // namespace kiln
