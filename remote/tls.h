// TLS for the remote tier (rediss://), over OpenSSL.
//
// A TlsContext is made once from the configuration: the CAs the server's certificate must chain
// to (a PEM file, else the system's trust store), TLS 1.2 at least, and optionally a client
// certificate with its private key (a file private to its owner, like the fleet key). A TlsSession
// is one connection's TLS state; it never touches a socket: the connection feeds it what it
// received and sends what it produced, under its own deadlines and without SIGPIPE. Every session
// verifies the server's certificate and that it names the expected host (a DNS name, or an IP
// address when the server is named by one).
//
// Errors: create() returns invalid_argument for unreadable, malformed or mismatched files;
// sessions return unavailable with a message starting "TLS " (is_tls_failure) for a failed
// handshake, a certificate that does not verify, or a protocol error. A TlsContext is
// thread-safe; a TlsSession is not.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "kiln/status.h"

namespace kiln::remote {

struct TlsFiles {
  std::filesystem::path ca_file;    // PEM CA certificates; empty: the system's default trust store
  std::filesystem::path cert_file;  // PEM client certificate (chain); empty: none
  std::filesystem::path key_file;   // PEM private key of cert_file; owner-only mode required
};

class TlsContext {
 public:
  static Result<std::shared_ptr<TlsContext>> create(const TlsFiles& files);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;
  bool has_client_certificate() const { return client_cert_; }

 private:
  friend class TlsSession;
  TlsContext() = default;
  void* ctx_ = nullptr;  // SSL_CTX*
  bool client_cert_ = false;
};

class TlsSession {
 public:
  // A client session that will verify the server against `server_name` (host name or IP address).
  static Result<std::unique_ptr<TlsSession>> create(const TlsContext& context, const std::string& server_name);
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // Bytes received from the server.
  void give_input(std::string_view bytes);
  // Bytes to send to the server now (handshake records, encrypted data, alerts); drains them.
  std::string take_output();

  // Advances the handshake: true when done, false when it needs more input.
  Result<bool> handshake();
  // Encrypts `plain` into the output.
  Status write(std::string_view plain);
  // Decrypts into `buf`: the byte count, 0 when more input is needed; unavailable when the server
  // closed the session.
  Result<std::size_t> read(char* buf, std::size_t size);

 private:
  TlsSession() = default;
  Status failure(const char* step, int ret);
  void* ssl_ = nullptr;   // SSL*
  void* in_ = nullptr;    // BIO*: received, not yet decrypted
  void* out_ = nullptr;   // BIO*: produced, not yet sent
  std::string server_name_;
};

// True for a Status a TlsSession produced (the tier counts these apart from other failures).
bool is_tls_failure(const Status& s);

}  // namespace kiln::remote
