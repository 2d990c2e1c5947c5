// The frame codec, and kilnd's behaviour on malformed, oversized, truncated and slow frames.
#include <gtest/gtest.h>

#include "tests/daemon/kilnd_harness.h"

namespace kiln::testing {
namespace {

using daemon::FrameHeader;
using daemon::FrameKind;

TEST(ProtocolCodec, HeaderRoundTripsLittleEndian) {
  FrameHeader h;
  h.json_len = 0x01020304;
  h.blob_len = 0xA0B0C0D0;
  auto b = daemon::encode_header(h);
  const std::uint8_t expect[16] = {'K', 'I', 'L', 'N', 1, 0, 0, 0, 4, 3, 2, 1, 0xD0, 0xC0, 0xB0, 0xA0};
  EXPECT_EQ(std::memcmp(b.data(), expect, 16), 0);
  auto d = daemon::decode_header(b);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->version, 1);
  EXPECT_EQ(d->flags, 0);
  EXPECT_EQ(d->json_len, 0x01020304u);
  EXPECT_EQ(d->blob_len, 0xA0B0C0D0u);
}

TEST(ProtocolCodec, RejectsBadMagicVersionAndFlags) {
  auto b = daemon::encode_header({});
  b[0] = 'X';
  EXPECT_EQ(daemon::decode_header(b).status().code(), Code::invalid_argument);
  b = daemon::encode_header({});
  b[4] = 2;
  auto v = daemon::decode_header(b);
  EXPECT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("version 2"), std::string::npos);
  b = daemon::encode_header({});
  b[6] = 1;
  EXPECT_FALSE(daemon::decode_header(b).ok());
}

TEST(ProtocolCodec, EnforcesLimits) {
  FrameHeader h;
  h.json_len = 10;
  EXPECT_TRUE(daemon::check_limits(h, FrameKind::request).ok());
  h.json_len = 0;
  EXPECT_FALSE(daemon::check_limits(h, FrameKind::request).ok());
  h.json_len = daemon::k_max_request_json;
  EXPECT_TRUE(daemon::check_limits(h, FrameKind::request).ok());
  h.json_len = daemon::k_max_request_json + 1;
  EXPECT_FALSE(daemon::check_limits(h, FrameKind::request).ok());
  EXPECT_TRUE(daemon::check_limits(h, FrameKind::reply).ok());
  h.json_len = 10;
  h.blob_len = 1;
  EXPECT_FALSE(daemon::check_limits(h, FrameKind::request).ok());
  EXPECT_TRUE(daemon::check_limits(h, FrameKind::reply).ok());
  h.blob_len = daemon::k_max_reply_blob + 1;
  EXPECT_FALSE(daemon::check_limits(h, FrameKind::reply).ok());
  h.blob_len = 0xFFFFFFFFu;
  h.json_len = 0xFFFFFFFFu;
  EXPECT_FALSE(daemon::check_limits(h, FrameKind::reply).ok());
}

TEST(ProtocolCodec, EntryJsonRoundTrips) {
  cache::Entry e;
  e.key = std::string(64, 'a');
  e.family = "rmsnorm";
  e.family_version = 3;
  e.params = "block=256,bulk=0,dtype=f32,row=0,vec=4";
  e.arch = "sm_90a";
  e.toolchain = std::string(64, 'b');
  e.key_text = "kiln-key 1\nfamily rmsnorm\n";
  e.size = 1234;
  e.checksum = std::string(64, 'c');
  e.lowered_name = "_Z3fooPf";
  e.compile_log = "log \xff\xfe bytes";  // not UTF-8: must not throw on the way out
  e.compile_ms = 12.5;
  e.registers = 40;
  e.shared_bytes = 1024;
  e.spill_bytes = 0;
  e.created = 1700000000;
  e.last_used = 1700000100;
  e.hits = 9;
  std::string text = daemon::dump_json(daemon::entry_to_json(e));
  auto j = daemon::parse_json(text);
  ASSERT_TRUE(j.ok());
  auto back = daemon::entry_from_json(*j);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->key, e.key);
  EXPECT_EQ(back->family_version, 3);
  EXPECT_EQ(back->params, e.params);
  EXPECT_EQ(back->size, 1234);
  EXPECT_EQ(back->checksum, e.checksum);
  EXPECT_EQ(back->lowered_name, e.lowered_name);
  EXPECT_DOUBLE_EQ(back->compile_ms, 12.5);
  EXPECT_EQ(back->registers, 40);
  EXPECT_EQ(back->shared_bytes, 1024);
  EXPECT_EQ(back->spill_bytes, 0);
  EXPECT_EQ(back->hits, 9);
  EXPECT_EQ(back->key_text, e.key_text);

  auto bad = daemon::entry_from_json(nlohmann::json{{"key", 5}});
  EXPECT_EQ(bad.status().code(), Code::invalid_argument);
  EXPECT_FALSE(daemon::entry_from_json(nlohmann::json::array()).ok());
}

TEST(ProtocolCodec, ProblemsTravelByFieldName) {
  const Family& rope = *Registry::global().find("rope");
  Problem p;
  p.dtype = DType::bf16;
  p.alignment = 8;
  p.cc = 90;
  p.sm_count = 132;
  for (const auto& f : rope.problem_fields()) p.fields[f.slot].i = 10 + f.slot;
  const nlohmann::json j = daemon::problem_to_json(rope, p);
  EXPECT_EQ(j["fields"].size(), rope.problem_fields().size());
  EXPECT_EQ(j["fields"]["tokens"], p.fields[rope.problem_fields()[0].slot].i);
  auto back = daemon::problem_from_json(rope, daemon::parse_json(daemon::dump_json(j)).value());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->dtype, DType::bf16);
  EXPECT_EQ(back->alignment, 8u);
  EXPECT_EQ(back->cc, 90);
  EXPECT_EQ(back->sm_count, 132);
  for (const auto& f : rope.problem_fields()) EXPECT_EQ(back->fields[f.slot].i, p.fields[f.slot].i) << f.name;

  auto refused = [&](nlohmann::json bad, const char* why) {
    auto r = daemon::problem_from_json(rope, bad);
    ASSERT_FALSE(r.ok()) << why;
    EXPECT_EQ(r.status().code(), Code::invalid_argument);
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
  };
  nlohmann::json missing = j;
  missing["fields"].erase("tokens");
  refused(missing, "'tokens' is missing");
  nlohmann::json unknown = j;
  unknown["fields"]["sms"] = 132;
  refused(unknown, "no problem field 'sms'");
  nlohmann::json real = j;
  real["fields"]["tokens"] = 1.5;
  refused(real, "must be an integer");
  nlohmann::json no_fields = j;
  no_fields.erase("fields");
  refused(no_fields, "fields must be a JSON object");
  nlohmann::json big_cc = j;
  big_cc["cc"] = 300;
  refused(big_cc, "out of range");
}

TEST(ProtocolCodec, ErrorRepliesCarryCodes) {
  auto j = daemon::error_reply(Status(Code::compile_error, "boom", "log"));
  EXPECT_EQ(j["error"]["code"], "compile_error");
  Status s = daemon::reply_status(j);
  EXPECT_EQ(s.code(), Code::compile_error);
  EXPECT_EQ(s.message(), "boom");
  EXPECT_EQ(s.details(), "log");
  EXPECT_TRUE(daemon::reply_status(daemon::ok_reply()).ok());
  EXPECT_FALSE(daemon::reply_status(nlohmann::json{{"ok", false}}).ok());
  EXPECT_FALSE(daemon::reply_status(nlohmann::json{{"ok", false}, {"error", {{"code", "ok"}}}}).ok());
  EXPECT_FALSE(daemon::reply_status(nlohmann::json::array()).ok());
  EXPECT_FALSE(daemon::parse_json("{nope").ok());
}

class KilndMalformed : public ::testing::Test {
 protected:
  void SetUp() override {
    k_ = env_.start({"--jobs", "1", "--frame-timeout-ms", "400", "--idle-timeout-ms", "1500"});
    ASSERT_TRUE(k_);
  }
  void TearDown() override {
    // Whatever was thrown at it, the daemon still serves a good client.
    if (!k_) return;
    EXPECT_TRUE(k_->running()) << k_->log();
    auto c = client::DaemonClient::connect(env_.socket());
    ASSERT_TRUE(c.ok()) << c.status().to_string() << "\n" << k_->log();
    EXPECT_TRUE((*c)->ping().ok());
  }

  // Sends `bytes` and expects an error reply with `code`, then a hang-up.
  void expect_fatal(const std::string& bytes, const std::string& code, const std::string& what) {
    RawConn raw(env_.socket());
    ASSERT_TRUE(raw.ok());
    ASSERT_TRUE(raw.send_bytes(bytes));
    auto reply = raw.read_reply();
    ASSERT_TRUE(reply) << what << ": no error frame";
    EXPECT_EQ((*reply)["ok"], false);
    EXPECT_EQ(error_code_of(*reply), code) << what << ": " << reply->dump();
    EXPECT_EQ((*reply)["fatal"], true);
    EXPECT_TRUE(raw.closed_within(2s)) << what << ": connection left open";
  }

  // Sends one frame and expects an error reply with `code` on a connection that stays usable.
  void expect_recoverable(const std::string& json_text, const std::string& code) {
    RawConn raw(env_.socket());
    ASSERT_TRUE(raw.ok());
    ASSERT_TRUE(raw.send_bytes(RawConn::frame(json_text)));
    auto reply = raw.read_reply();
    ASSERT_TRUE(reply) << json_text.substr(0, 80);
    EXPECT_EQ((*reply)["ok"], false);
    EXPECT_EQ(error_code_of(*reply), code) << reply->dump();
    ASSERT_TRUE(raw.send_bytes(RawConn::frame(R"({"op":"ping"})")));
    auto pong = raw.read_reply();
    ASSERT_TRUE(pong) << "connection not kept after a recoverable error";
    EXPECT_EQ((*pong)["ok"], true);
  }

  DaemonEnv env_;
  std::unique_ptr<Kilnd> k_;
};

TEST_F(KilndMalformed, BadMagic) {
  expect_fatal(RawConn::header(2, 0, 1, 0, "HTTP") + "{}", "invalid_argument", "bad magic");
  // Text protocols sent by mistake hit the same wall.
  expect_fatal("GET / HTTP/1.1\r\nHost: x\r\n\r\n", "invalid_argument", "http");
}

TEST_F(KilndMalformed, UnsupportedVersionAndFlags) {
  RawConn raw(env_.socket());
  ASSERT_TRUE(raw.send_bytes(RawConn::header(2, 0, 7) + "{}"));
  auto reply = raw.read_reply();
  ASSERT_TRUE(reply);
  EXPECT_NE((*reply)["error"]["message"].get<std::string>().find("version 7"), std::string::npos);
  EXPECT_TRUE(raw.closed_within(2s));
  expect_fatal(RawConn::header(2, 0, 1, 0x8000) + "{}", "invalid_argument", "unknown flag");
}

TEST_F(KilndMalformed, HugeLengthsAreRefusedBeforeAllocation) {
  expect_fatal(RawConn::header(0xFFFFFFFFu), "invalid_argument", "4 GiB json");
  expect_fatal(RawConn::header(daemon::k_max_request_json + 1), "invalid_argument", "1 MiB + 1 json");
  expect_fatal(RawConn::header(2, 0xFFFFFFFFu) + "{}", "invalid_argument", "4 GiB blob");
  expect_fatal(RawConn::header(2, 1) + "{}x", "invalid_argument", "request blob");
  expect_fatal(RawConn::header(0), "invalid_argument", "empty json");
}

TEST_F(KilndMalformed, LargestAllowedRequestIsRead) {
  // Exactly 1 MiB of JSON: a string padded to the limit, read and answered (unknown op).
  std::string text = R"({"op":"pad","pad":")";
  text += std::string(daemon::k_max_request_json - text.size() - 2, 'x');
  text += "\"}";
  ASSERT_EQ(text.size(), daemon::k_max_request_json);
  expect_recoverable(text, "invalid_argument");
}

TEST_F(KilndMalformed, TruncatedHeaderThenHangUp) {
  {
    RawConn raw(env_.socket());
    ASSERT_TRUE(raw.send_bytes(RawConn::header(13).substr(0, 7)));
  }
  {
    RawConn raw(env_.socket());
    ASSERT_TRUE(raw.send_bytes(RawConn::header(100) + "{\"op\":"));  // truncated body
  }
}

TEST_F(KilndMalformed, SlowPeerIsCutOffAtTheFrameDeadline) {
  RawConn raw(env_.socket());
  ASSERT_TRUE(raw.send_bytes(RawConn::header(13).substr(0, 5)));
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(raw.closed_within(3s));
  auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(ms, 300);
  // Also when the header was complete and the body trickles.
  RawConn raw2(env_.socket());
  ASSERT_TRUE(raw2.send_bytes(RawConn::header(100) + "{\"op\""));
  EXPECT_TRUE(raw2.closed_within(3s));
}

TEST_F(KilndMalformed, IdleConnectionsAreClosedAndClientsReconnect) {
  RawConn raw(env_.socket());
  ASSERT_TRUE(raw.ok());
  EXPECT_TRUE(raw.closed_within(4s));
  // DaemonClient notices the closed connection and reconnects on its own.
  auto c = client::DaemonClient::connect(env_.socket());
  ASSERT_TRUE(c.ok());
  std::this_thread::sleep_for(1800ms);
  EXPECT_TRUE((*c)->ping().ok());
}

TEST_F(KilndMalformed, GarbageJsonKeepsTheConnection) {
  expect_recoverable("{\"op\": \"ping\"", "invalid_argument");
  expect_recoverable("not json at all", "invalid_argument");
  expect_recoverable(std::string("\xff\xfe\x00\x01", 4), "invalid_argument");
  expect_recoverable("[1,2,3]", "invalid_argument");
  expect_recoverable("\"op\"", "invalid_argument");
  expect_recoverable("{}", "invalid_argument");
  expect_recoverable(R"({"op":17})", "invalid_argument");
  expect_recoverable(R"({"op":"list","family":5})", "invalid_argument");
  expect_recoverable(R"({"op":"prewarm","archs":"sm_90a"})", "invalid_argument");
  // Deep nesting must not exhaust the daemon's stack.
  expect_recoverable(std::string(100000, '[') + std::string(100000, ']'), "invalid_argument");
  expect_recoverable(std::string(500000, '['), "invalid_argument");
}

TEST_F(KilndMalformed, UnknownOpKeepsTheConnection) {
  expect_recoverable(R"({"op":"format_disk"})", "invalid_argument");
  expect_recoverable(R"({"op":"PING"})", "invalid_argument");
}

TEST_F(KilndMalformed, PipelinedRequestsAreAnsweredInOrder) {
  RawConn raw(env_.socket());
  std::string frames;
  for (int i = 0; i < 20; ++i) frames += RawConn::frame(R"({"op":"ping","id":)" + std::to_string(i) + "}");
  frames += RawConn::frame("garbage");
  frames += RawConn::frame(R"({"op":"ping","id":"last"})");
  ASSERT_TRUE(raw.send_bytes(frames));
  for (int i = 0; i < 20; ++i) {
    auto r = raw.read_reply();
    ASSERT_TRUE(r);
    EXPECT_EQ((*r)["id"], i);
  }
  auto g = raw.read_reply();
  ASSERT_TRUE(g);
  EXPECT_EQ((*g)["ok"], false);
  auto last = raw.read_reply();
  ASSERT_TRUE(last);
  EXPECT_EQ((*last)["id"], "last");
}

TEST_F(KilndMalformed, ManyAbruptClientsDoNotHurt) {
  for (int i = 0; i < 50; ++i) {
    RawConn raw(env_.socket());
    ASSERT_TRUE(raw.ok());
    (void)raw.send_bytes(RawConn::frame(R"({"op":"stats"})").substr(0, static_cast<std::size_t>(i % 30)));
  }
  auto s = stats_of(env_.socket());
  EXPECT_GE(s["daemon"]["connections"].get<int>(), 50);
}

}  // namespace
}  // namespace kiln::testing
