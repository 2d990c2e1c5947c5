// The remote tier over TLS (rediss://) against real redis-server processes serving TLS only, with
// a throwaway certificate authority made by the openssl command: verified reads and writes; a
// server whose certificate another CA signed, or that names another host, is refused, counted,
// and the tier goes local-only; client certificates; and the settings' errors (unreadable or
// malformed files, a client key others can read, a key of another certificate, TLS options
// without rediss://).
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <thread>

#include "common/sha256.h"
#include "remote/config.h"
#include "remote/tier.h"
#include "remote/tls.h"
#include "tests/remote/redis_harness.h"
#include "tests/test_util.h"

namespace kiln::testing {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

cache::Entry entry(int i) {
  cache::Entry e;
  e.cubin = std::string("\x7f" "ELF", 4) + std::string(4096, char('a' + i % 26));
  e.key = sha256_hex("tls entry " + std::to_string(i));
  e.family = "rmsnorm";
  e.family_version = 1;
  e.params = "i=" + std::to_string(i);
  e.arch = "sm_90a";
  e.toolchain = sha256_hex("toolchain");
  e.lowered_name = "_Z1kv";
  return e;
}

// Skips where the openssl command cannot make the certificates (scripts/deps.sh installs it).
class WithPki : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    auto p = TestPki::make(tmp.path(), why);
    if (!p) GTEST_SKIP() << why;
    pki = *p;
    key = write_secret(tmp.path() / "fleet.key", "tls test fleet key, 0123456789abcdef\n");
  }
  remote::Settings settings(const std::string& url) {
    remote::Settings s;
    s.url = url;
    s.key_file = key;
    s.tls_ca_file = pki.ca;
    return s;
  }
  TempDir tmp;
  TestPki pki;
  fs::path key;
};

class Tls : public WithPki {
 protected:
  void SetUp() override {
    KILN_REQUIRE_REDIS();
    WithPki::SetUp();
    if (IsSkipped()) return;
    redis = RedisServer::start_tls(tmp.path(), pki);
    ASSERT_TRUE(redis) << "this redis-server did not serve TLS (Debian's is built with it)";
  }
  std::string url(const std::string& host = "127.0.0.1") const {
    return "rediss://" + host + ":" + std::to_string(redis->port());
  }
  std::unique_ptr<remote::Tier> tier(const remote::Settings& s) {
    auto c = remote::make_config(s);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    if (!c.ok()) return nullptr;
    return remote::Tier::create(std::move(c).value());
  }
  std::unique_ptr<RedisServer> redis;
};

TEST_F(Tls, WritesAndServesVerifiedEntries) {
  auto writer = tier(settings(url()));
  ASSERT_TRUE(writer);
  const cache::Entry e = entry(1);
  writer->put_entry(e);
  ASSERT_TRUE(writer->flush(5s));
  EXPECT_EQ(writer->counters().writes, 1);

  auto reader = tier(settings(url()));
  ASSERT_TRUE(reader);
  auto got = reader->get_entry(e.key, {e.arch, e.toolchain});
  ASSERT_TRUE(got);
  EXPECT_EQ(got->cubin, e.cubin);
  EXPECT_FALSE(reader->get_entry(entry(2).key, {}));
  const remote::Counters c = reader->counters();
  EXPECT_EQ(c.hits, 1);
  EXPECT_EQ(c.misses, 1);
  EXPECT_EQ(c.tls_errors, 0);
  EXPECT_EQ(c.errors, 0);
  EXPECT_EQ(c.connects, 1) << "the TLS connection is pooled and reused";
  EXPECT_TRUE(c.up);
  auto raw = redis->command({"EXISTS", "kiln:v1:k/" + e.key});
  ASSERT_TRUE(raw.ok()) << raw.status().to_string();
  EXPECT_EQ(raw->integer, 1);
}

TEST_F(Tls, AServerCertificateFromAnotherCaIsRefusedAndTheTierGoesLocalOnly) {
  auto seed = tier(settings(url()));
  seed->put_entry(entry(3));
  ASSERT_TRUE(seed->flush(5s));

  remote::Settings s = settings(url());
  s.tls_ca_file = pki.other_ca;
  auto c = remote::make_config(s);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto conn = remote::Connection::open(*c, remote::Clock::now() + 2s);
  ASSERT_FALSE(conn.ok());
  EXPECT_TRUE(remote::is_tls_failure(conn.status())) << conn.status().to_string();
  EXPECT_NE(conn.status().message().find("does not verify"), std::string::npos) << conn.status().message();

  auto t = remote::Tier::create(*c);
  const auto t0 = Clock::now();
  EXPECT_FALSE(t->get_entry(entry(3).key, {})) << "never served over an unverified connection";
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(t->get_entry(entry(3).key, {}));
  EXPECT_LT(ms_since(t0), 50 + 150) << "one refused handshake, then local only";
  const remote::Counters k = t->counters();
  // One handshake, or two on a machine slow enough for the 100 ms back-off to end meanwhile.
  EXPECT_GE(k.tls_errors, 1);
  EXPECT_LE(k.tls_errors, 2);
  EXPECT_EQ(k.errors, k.tls_errors);
  EXPECT_EQ(k.hits, 0);
  EXPECT_FALSE(k.up);
  EXPECT_EQ(k.outages, 1);
  EXPECT_EQ(k.skipped, 101 - k.tls_errors);
}

TEST_F(Tls, AServerCertificateForAnotherNameIsRefused) {
  // The certificate names redis.kiln.test and 127.0.0.1, not localhost.
  auto c = remote::make_config(settings(url("localhost")));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->tls_name, "localhost");
  auto conn = remote::Connection::open(*c, remote::Clock::now() + 2s);
  ASSERT_FALSE(conn.ok());
  EXPECT_TRUE(remote::is_tls_failure(conn.status())) << conn.status().to_string();
  EXPECT_NE(conn.status().message().find("mismatch"), std::string::npos) << conn.status().message();
  auto t = remote::Tier::create(*c);
  EXPECT_FALSE(t->get_entry(entry(4).key, {}));
  EXPECT_EQ(t->counters().tls_errors, 1);
  EXPECT_FALSE(t->counters().up);

  // Named by address, verified against a DNS name the certificate carries: accepted.
  remote::Settings by_name = settings(url());
  by_name.tls_name = "redis.kiln.test";
  auto ok = remote::make_config(by_name);
  ASSERT_TRUE(ok.ok());
  auto good = remote::Connection::open(*ok, remote::Clock::now() + 2s);
  EXPECT_TRUE(good.ok()) << good.status().to_string();
  by_name.tls_name = "other.kiln.test";
  auto wrong = remote::make_config(by_name);
  ASSERT_TRUE(wrong.ok());
  auto bad = remote::Connection::open(*wrong, remote::Clock::now() + 2s);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(remote::is_tls_failure(bad.status())) << bad.status().to_string();
}

TEST_F(Tls, APlainClientOnTheTlsPortFailsInsteadOfHanging) {
  remote::Settings s = settings("redis://127.0.0.1:" + std::to_string(redis->port()));
  s.tls_ca_file.clear();
  auto t = tier(s);
  ASSERT_TRUE(t);
  const auto t0 = Clock::now();
  EXPECT_FALSE(t->get_entry(entry(5).key, {}));
  EXPECT_LT(ms_since(t0), 50 + 150);
  EXPECT_GE(t->counters().errors + t->counters().timeouts, 1);
  EXPECT_FALSE(t->counters().up);
}

TEST_F(Tls, ClientCertificatesWhenTheServerAsksForThem) {
  auto strict = RedisServer::start_tls(tmp.path(), pki, /*client_certs=*/true);
  ASSERT_TRUE(strict);
  remote::Settings s = settings(strict->url());
  s.tls_cert_file = pki.client_cert;
  s.tls_key_file = pki.client_key;
  auto with_cert = tier(s);
  ASSERT_TRUE(with_cert);
  with_cert->put_entry(entry(6));
  ASSERT_TRUE(with_cert->flush(5s));
  EXPECT_EQ(with_cert->counters().writes, 1);
  EXPECT_TRUE(with_cert->get_entry(entry(6).key, {}));

  remote::Settings no_cert = settings(strict->url());
  auto without = tier(no_cert);
  ASSERT_TRUE(without);
  EXPECT_FALSE(without->get_entry(entry(6).key, {}));
  // TLS 1.3: the server's verdict comes after the client's handshake, as an alert (a TLS failure)
  // or, when the close overtakes it, a reset connection; either way nothing is served.
  const remote::Counters c = without->counters();
  EXPECT_EQ(c.errors, 1);
  EXPECT_EQ(c.hits, 0);
  EXPECT_FALSE(c.up);
  auto conn = remote::Connection::open(*remote::make_config(no_cert), remote::Clock::now() + 2s);
  ASSERT_TRUE(conn.ok()) << "the client's side of the handshake succeeds";
  auto r = (*conn)->command({"PING"}, remote::Clock::now() + 2s);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(remote::is_tls_failure(r.status()) ||
              r.status().message().find("requires client certificates") != std::string::npos)
      << r.status().message();
}

TEST_F(WithPki, TlsSettingsParse) {
  auto c = remote::make_config(settings("rediss://cache.example:6380/2"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->tls);
  EXPECT_EQ(c->tls_name, "cache.example");
  EXPECT_EQ(c->endpoint.port, 6380);
  EXPECT_EQ(c->db, 2);
  EXPECT_FALSE(c->tls->has_client_certificate());

  remote::Settings s = settings("rediss://10.0.0.5");
  s.tls_name = "cache.example";
  s.tls_cert_file = pki.client_cert;
  s.tls_key_file = pki.client_key;
  c = remote::make_config(s);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->tls_name, "cache.example");
  EXPECT_EQ(c->endpoint.port, 6379);
  EXPECT_TRUE(c->tls->has_client_certificate());

  remote::Settings plain = settings("redis://host");
  plain.tls_ca_file.clear();
  c = remote::make_config(plain);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_FALSE(c->tls) << "redis:// is plain TCP";
}

TEST_F(WithPki, RefusesBadTlsSettingsWithTheReason) {
  auto refused = [&](const remote::Settings& s, const std::string& words) {
    auto c = remote::make_config(s);
    if (c.ok()) return ::testing::AssertionFailure() << "accepted";
    if (c.status().code() != Code::invalid_argument)
      return ::testing::AssertionFailure() << "code " << code_name(c.status().code()) << ": " << c.status().message();
    if (c.status().message().find(words) == std::string::npos)
      return ::testing::AssertionFailure() << "'" << c.status().message() << "' does not say '" << words << "'";
    return ::testing::AssertionSuccess();
  };
  remote::Settings s = settings("redis://host");
  EXPECT_TRUE(refused(s, "does not use TLS")) << "a CA file with redis://";
  s = settings("unix:///run/redis.sock");
  EXPECT_TRUE(refused(s, "does not use TLS"));
  s = settings("redis://host");
  s.tls_ca_file.clear();
  s.tls_name = "cache.example";
  EXPECT_TRUE(refused(s, "does not use TLS"));

  s = settings("rediss://host");
  s.tls_ca_file = tmp.path() / "missing.pem";
  EXPECT_TRUE(refused(s, "cannot be read"));
  s.tls_ca_file = tmp.path();
  EXPECT_TRUE(refused(s, "not a regular file"));
  s.tls_ca_file = write_secret(tmp.path() / "garbage.pem", "not a certificate\n", 0644);
  EXPECT_TRUE(refused(s, "no usable PEM certificate"));

  s = settings("rediss://host");
  s.tls_cert_file = pki.client_cert;
  EXPECT_TRUE(refused(s, "needs both"));
  s.tls_cert_file.clear();
  s.tls_key_file = pki.client_key;
  EXPECT_TRUE(refused(s, "needs both"));

  s.tls_cert_file = pki.client_cert;
  ::chmod(pki.client_key.c_str(), 0644);
  EXPECT_TRUE(refused(s, "it must be 0600")) << "a client key others can read";
  ::chmod(pki.client_key.c_str(), 0600);
  s.tls_key_file = pki.server_key;
  EXPECT_TRUE(refused(s, "does not belong")) << "the key of another certificate";
  s.tls_key_file = write_secret(tmp.path() / "garbage.key", "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
  EXPECT_TRUE(refused(s, "no usable PEM private key"));
  s.tls_key_file = pki.client_key;
  s.tls_cert_file = write_secret(tmp.path() / "garbage.pem", "junk", 0644);
  EXPECT_TRUE(refused(s, "no usable PEM certificate"));
}

TEST_F(WithPki, TlsSettingsFromTheEnvironment) {
  ScopedEnv url("KILN_REMOTE", "rediss://127.0.0.1:1");
  ScopedEnv file("KILN_FLEET_KEY_FILE", key.string());
  ScopedEnv ca("KILN_REMOTE_CA_FILE", pki.ca.string());
  ScopedEnv cert("KILN_REMOTE_CERT_FILE", pki.client_cert.string());
  ScopedEnv ckey("KILN_REMOTE_KEY_FILE", pki.client_key.string());
  ScopedEnv name("KILN_REMOTE_TLS_NAME", "redis.kiln.test");
  ScopedEnv lock("KILN_REMOTE_LOCK_MS", "0");
  auto c = remote::config_from_env();
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ASSERT_TRUE(c->has_value());
  EXPECT_TRUE((*c)->tls);
  EXPECT_TRUE((*c)->tls->has_client_certificate());
  EXPECT_EQ((*c)->tls_name, "redis.kiln.test");
  EXPECT_EQ((*c)->lock_ttl.count(), 0);
  ScopedEnv bad_lock("KILN_REMOTE_LOCK_MS", "-1");
  EXPECT_EQ(remote::config_from_env().status().code(), Code::invalid_argument);
}

}  // namespace
}  // namespace kiln::testing
