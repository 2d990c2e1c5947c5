// A minimal Redis client: RESP2 over a TCP or Unix socket, or TLS over TCP (remote/tls.h), one
// command at a time, every step under a deadline.
//
// A Connection is not thread-safe; the tier keeps a pool of them. After any error other than an
// error reply (a timeout, a closed socket, a malformed reply) the stream may be out of step and
// the connection must be dropped.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/status.h"
#include "remote/config.h"

namespace kiln::remote {

class TlsSession;
using Clock = std::chrono::steady_clock;

struct Reply {
  enum class Type { status, error, integer, bulk, nil, array };
  Type type = Type::nil;
  std::string text;  // status, error and bulk
  long long integer = 0;
  std::vector<Reply> elements;
  bool is_error() const { return type == Type::error; }
};

// Replies larger than this are refused as malformed (a cubin is far smaller).
inline constexpr std::size_t k_max_bulk_bytes = 256u << 20;

class Connection {
 public:
  // Connects (with the TLS handshake, and AUTHs and SELECTs when the config says so) before
  // `deadline`. timeout when the deadline passes, unavailable when the server cannot be reached,
  // its certificate does not verify (is_tls_failure) or it refuses the credentials.
  static Result<std::unique_ptr<Connection>> open(const Config& config, Clock::time_point deadline);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Sends one command and reads its reply. An error reply is a Reply, not a failed Status.
  Result<Reply> command(const std::vector<std::string_view>& args, Clock::time_point deadline);

 private:
  explicit Connection(int fd);
  Status handshake(Clock::time_point deadline);
  Status send_all(const std::string& bytes, Clock::time_point deadline);
  Status fill(Clock::time_point deadline);
  // The socket itself: every byte of `bytes`; what one recv returns, appended to `out`.
  Status send_raw(const std::string& bytes, Clock::time_point deadline);
  Status recv_raw(std::string& out, Clock::time_point deadline);

  int fd_ = -1;
  std::unique_ptr<TlsSession> tls_;  // set: bytes on the socket are TLS records
  std::string no_client_cert_hint_;  // added to a close before the first reply (TLS, no certificate)
  bool answered_ = false;            // a reply has been read
  std::string in_;  // bytes received (decrypted) and not yet parsed
};

// Parses one reply from the front of `buf`. 1: parsed (consumed bytes in `used`), 0: incomplete,
// -1: malformed. Exposed for tests.
int parse_reply(std::string_view buf, Reply& out, std::size_t& used, int depth = 0);

}  // namespace kiln::remote
