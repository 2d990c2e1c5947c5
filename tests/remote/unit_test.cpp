// The remote tier's parts that need no server: HMAC-SHA256, the configuration and its secret
// files, signed records, and the RESP reply parser.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include "common/hmac.h"
#include "common/sha256.h"
#include "remote/config.h"
#include "remote/resp.h"
#include "remote/signed.h"
#include "tests/remote/redis_harness.h"
#include "tests/test_util.h"

namespace kiln::testing {
namespace {

std::string hex(const Tag& t) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (auto b : t) {
    out += d[b >> 4];
    out += d[b & 15];
  }
  return out;
}

// RFC 4231, test cases 1, 2 and 6 (a key longer than the block is hashed first).
TEST(Hmac, MatchesRfc4231) {
  EXPECT_EQ(hex(hmac_sha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex(hmac_sha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hex(hmac_sha256(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  HmacSha256 pieces("Jefe");
  pieces.update("what do ya want ");
  pieces.update("for nothing?");
  EXPECT_EQ(hex(pieces.finish()), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_TRUE(equal_constant_time("abc", "abc"));
  EXPECT_FALSE(equal_constant_time("abc", "abd"));
  EXPECT_FALSE(equal_constant_time("abc", "ab"));
}

class RemoteConfig : public ::testing::Test {
 protected:
  TempDir tmp;
  fs::path key = write_secret(tmp.path() / "fleet.key", "0123456789abcdef0123456789abcdef\n");
  remote::Settings settings(const std::string& url) {
    remote::Settings s;
    s.url = url;
    s.key_file = key;
    return s;
  }
};

TEST_F(RemoteConfig, ParsesUrls) {
  auto c = remote::make_config(settings("redis://10.0.0.5:7000/3"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->endpoint.host, "10.0.0.5");
  EXPECT_EQ(c->endpoint.port, 7000);
  EXPECT_EQ(c->db, 3);
  EXPECT_EQ(c->fleet_key, "0123456789abcdef0123456789abcdef") << "trailing newline removed";
  EXPECT_EQ(c->read_timeout, std::chrono::milliseconds(50));

  c = remote::make_config(settings("redis://cachehost"));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->endpoint.port, 6379);

  c = remote::make_config(settings("redis://[::1]:6380"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->endpoint.host, "::1");
  EXPECT_EQ(c->endpoint.port, 6380);

  c = remote::make_config(settings("unix:///run/redis/redis.sock?db=2"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->endpoint.unix_path, "/run/redis/redis.sock");
  EXPECT_EQ(c->db, 2);

  auto s = settings("redis://kiln@host:6379");
  s.password_file = write_secret(tmp.path() / "pw", "secret\n");
  c = remote::make_config(s);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->user, "kiln");
  EXPECT_EQ(c->password, "secret");
}

TEST_F(RemoteConfig, RefusesBadUrlsAndTimeouts) {
  for (const char* url : {"http://host", "redis://", "redis://host:0", "redis://host:70000", "redis://host:x",
                          "redis://host/db", "unix://relative.sock", "rediss://", "redis://:@host",
                          "redis://user:secret@host"}) {
    auto c = remote::make_config(settings(url));
    ASSERT_FALSE(c.ok()) << url;
    EXPECT_EQ(c.status().code(), Code::invalid_argument) << url;
  }
  auto pw = remote::make_config(settings("redis://user:secret@host"));
  EXPECT_NE(pw.status().message().find("password does not belong in the URL"), std::string::npos);
  auto user_only = remote::make_config(settings("redis://kiln@host"));
  EXPECT_EQ(user_only.status().code(), Code::invalid_argument) << "a user needs a password file";
  auto s = settings("redis://host");
  s.timeout_ms = 0;
  EXPECT_EQ(remote::make_config(s).status().code(), Code::invalid_argument);
}

TEST_F(RemoteConfig, RefusesAFleetKeyOthersCanRead) {
  for (mode_t mode : {0644, 0640, 0604, 0660, 0666}) {
    ::chmod(key.c_str(), mode);
    auto c = remote::make_config(settings("redis://host"));
    ASSERT_FALSE(c.ok()) << std::oct << mode;
    EXPECT_EQ(c.status().code(), Code::invalid_argument);
    EXPECT_NE(c.status().message().find("it must be 0600"), std::string::npos) << c.status().message();
  }
  ::chmod(key.c_str(), 0400);
  EXPECT_TRUE(remote::make_config(settings("redis://host")).ok()) << "owner read-only is private too";

  auto s = settings("redis://host");
  s.key_file.clear();
  EXPECT_EQ(remote::make_config(s).status().code(), Code::invalid_argument) << "the key is required";
  s.key_file = tmp.path() / "missing.key";
  EXPECT_EQ(remote::make_config(s).status().code(), Code::invalid_argument);
  s.key_file = write_secret(tmp.path() / "short.key", "tooshort");
  EXPECT_EQ(remote::make_config(s).status().code(), Code::invalid_argument);
  s.key_file = tmp.path();
  EXPECT_EQ(remote::make_config(s).status().code(), Code::invalid_argument) << "a directory is not a key file";

  auto p = settings("redis://kiln@host");
  p.password_file = write_secret(tmp.path() / "pw", "secret", 0644);
  EXPECT_EQ(remote::make_config(p).status().code(), Code::invalid_argument) << "the password file too";
}

TEST_F(RemoteConfig, FromTheEnvironment) {
  {
    ScopedEnv url("KILN_REMOTE", "");
    auto c = remote::config_from_env();
    ASSERT_TRUE(c.ok());
    EXPECT_FALSE(c->has_value());
  }
  ScopedEnv url("KILN_REMOTE", "redis://127.0.0.1:1");
  ScopedEnv file("KILN_FLEET_KEY_FILE", key.string());
  ScopedEnv timeout("KILN_REMOTE_TIMEOUT_MS", "20");
  auto c = remote::config_from_env();
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ASSERT_TRUE(c->has_value());
  EXPECT_EQ((*c)->read_timeout, std::chrono::milliseconds(20));
  ScopedEnv bad("KILN_REMOTE_TIMEOUT_MS", "soon");
  EXPECT_EQ(remote::config_from_env().status().code(), Code::invalid_argument);
}

cache::Entry sample_entry() {
  cache::Entry e;
  e.cubin = std::string("\x7f" "ELF", 4) + std::string(1000, 'x');
  e.key = sha256_hex("a key");
  e.family = "rmsnorm";
  e.family_version = 1;
  e.params = "block=256,bulk=0,dtype=f32,row=0,vec=4";
  e.arch = "sm_90a";
  e.toolchain = sha256_hex("a toolchain");
  e.key_text = "kiln-key 1\n";
  e.size = std::int64_t(e.cubin.size());
  e.checksum = sha256_hex(e.cubin);
  e.lowered_name = "_Z6kernelv";
  e.compile_ms = 12.5;
  e.registers = 32;
  return e;
}

TEST(Signed, RoundTripsAndRejectsEveryAlteration) {
  const std::string key = "0123456789abcdef0123456789abcdef";
  const cache::Entry e = sample_entry();
  const std::string sealed = remote::seal_entry(key, e);
  auto back = remote::open_entry(key, e.key, sealed, {e.arch, e.toolchain});
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->cubin, e.cubin);
  EXPECT_EQ(back->lowered_name, e.lowered_name);
  EXPECT_EQ(back->params, e.params);
  EXPECT_EQ(back->registers, 32);

  // Every single flipped byte, metadata, cubin or tag, fails verification.
  for (std::size_t i = 0; i < sealed.size(); i += 7) {
    std::string bad = sealed;
    bad[i] = char(bad[i] ^ 0x01);
    auto r = remote::open_entry(key, e.key, bad);
    ASSERT_FALSE(r.ok()) << "byte " << i;
    EXPECT_EQ(r.status().code(), Code::corruption);
  }
  EXPECT_FALSE(remote::open_entry(key, e.key, sealed.substr(0, sealed.size() - 1)).ok()) << "truncated";
  EXPECT_FALSE(remote::open_entry(key, e.key, "").ok());
  EXPECT_FALSE(remote::open_entry("another fleet key of some length", e.key, sealed).ok()) << "wrong key";
  EXPECT_FALSE(remote::open_entry(key, sha256_hex("another"), sealed).ok()) << "moved under another name";
  EXPECT_FALSE(remote::open_entry(key, e.key, sealed, {"sm_80", ""}).ok()) << "other arch";
  EXPECT_FALSE(remote::open_entry(key, e.key, sealed, {"", sha256_hex("x")}).ok()) << "other toolchain";

  // A record signed with the right key but lying about its cubin is still refused.
  cache::Entry lying = e;
  lying.cubin += "tail";
  std::string payload = std::string(remote::unseal(key, remote::entry_name(e.key), remote::seal_entry(key, lying)).value());
  payload.resize(payload.size() - 4);
  auto r = remote::open_entry(key, e.key, remote::seal(key, remote::entry_name(e.key), payload));
  EXPECT_EQ(r.status().code(), Code::corruption);
}

TEST(Resp, ParsesRepliesAndRefusesMalformedOnes) {
  remote::Reply r;
  std::size_t used = 0;
  EXPECT_EQ(remote::parse_reply("+OK\r\n", r, used), 1);
  EXPECT_EQ(r.type, remote::Reply::Type::status);
  EXPECT_EQ(used, 5u);
  EXPECT_EQ(remote::parse_reply("$5\r\nhel", r, used), 0) << "incomplete";
  EXPECT_EQ(remote::parse_reply("$5\r\nhello\r\n", r, used), 1);
  EXPECT_EQ(r.text, "hello");
  EXPECT_EQ(remote::parse_reply("$-1\r\n", r, used), 1);
  EXPECT_EQ(r.type, remote::Reply::Type::nil);
  EXPECT_EQ(remote::parse_reply("-OOM command not allowed\r\n", r, used), 1);
  EXPECT_TRUE(r.is_error());
  EXPECT_EQ(remote::parse_reply("*2\r\n:1\r\n$1\r\nx\r\n", r, used), 1);
  ASSERT_EQ(r.elements.size(), 2u);
  EXPECT_EQ(r.elements[0].integer, 1);
  EXPECT_EQ(remote::parse_reply("*2\r\n:1\r\n", r, used), 0);
  for (const char* bad : {"?x\r\n", "$abc\r\n", "$5\r\nhelloXX", ":12z\r\n", "$-5\r\n", "\r\n", "$999999999999\r\n"})
    EXPECT_EQ(remote::parse_reply(bad, r, used), -1) << bad;
  EXPECT_EQ(remote::parse_reply(std::string(100, '*'), r, used), 0) << "no line end yet";
  EXPECT_EQ(remote::parse_reply(std::string(70 * 1024, '+'), r, used), -1) << "a line that never ends";
}

}  // namespace
}  // namespace kiln::testing
