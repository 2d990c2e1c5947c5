#include "remote/tls.h"

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "remote/config.h"

namespace kiln::remote {
namespace {

SSL_CTX* as_ctx(void* p) { return static_cast<SSL_CTX*>(p); }
SSL* as_ssl(void* p) { return static_cast<SSL*>(p); }
BIO* as_bio(void* p) { return static_cast<BIO*>(p); }

// OpenSSL's error queue for this thread, as text, emptied.
std::string drain_errors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out;
}

Status bad_file(const std::string& what, const std::filesystem::path& file, const std::string& why) {
  return invalid_argument("the TLS " + what + " file " + file.string() + " " + why);
}

// A readable regular file (OpenSSL's own errors for a missing file are hard to read).
Status check_readable(const std::string& what, const std::filesystem::path& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return bad_file(what, file, std::string("cannot be read: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return bad_file(what, file, "is not a regular file");
  return {};
}

bool is_ip_address(const std::string& s) {
  unsigned char buf[sizeof(in6_addr)];
  return ::inet_pton(AF_INET, s.c_str(), buf) == 1 || ::inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

}  // namespace

Result<std::shared_ptr<TlsContext>> TlsContext::create(const TlsFiles& files) {
  ERR_clear_error();
  std::shared_ptr<TlsContext> t(new TlsContext);
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (!ctx) return internal_error("SSL_CTX_new failed: " + drain_errors());
  t->ctx_ = ctx;
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  if (!files.ca_file.empty()) {
    KILN_TRY(check_readable("CA", files.ca_file));
    if (SSL_CTX_load_verify_locations(ctx, files.ca_file.c_str(), nullptr) != 1)
      return bad_file("CA", files.ca_file, "holds no usable PEM certificate: " + drain_errors());
  } else if (SSL_CTX_set_default_verify_paths(ctx) != 1) {
    return unavailable("cannot load the system's trusted CA certificates: " + drain_errors(),
                       "name a CA file (KILN_REMOTE_CA_FILE or --remote-ca-file)");
  }
  if (files.cert_file.empty() != files.key_file.empty())
    return invalid_argument("a TLS client certificate needs both a certificate file and its key file",
                            "KILN_REMOTE_CERT_FILE and KILN_REMOTE_KEY_FILE, or --remote-cert-file and --remote-key-file");
  if (!files.cert_file.empty()) {
    KILN_TRY(check_readable("client certificate", files.cert_file));
    if (SSL_CTX_use_certificate_chain_file(ctx, files.cert_file.c_str()) != 1)
      return bad_file("client certificate", files.cert_file, "holds no usable PEM certificate: " + drain_errors());
    // The key is read like the fleet key (owner only), then parsed from memory: the file checked
    // is the file read.
    KILN_ASSIGN_OR_RETURN(std::string pem, read_secret_file(files.key_file, "TLS client key"));
    BIO* mem = BIO_new_mem_buf(pem.data(), int(pem.size()));
    EVP_PKEY* key = mem ? PEM_read_bio_PrivateKey(mem, nullptr, nullptr, nullptr) : nullptr;
    BIO_free(mem);
    if (!key) return bad_file("client key", files.key_file, "holds no usable PEM private key: " + drain_errors());
    const int used = SSL_CTX_use_PrivateKey(ctx, key);
    EVP_PKEY_free(key);
    if (used != 1 || SSL_CTX_check_private_key(ctx) != 1)
      return invalid_argument("the TLS client key " + files.key_file.string() + " does not belong to the certificate " +
                              files.cert_file.string() + ": " + drain_errors());
    t->client_cert_ = true;
  }
  return t;
}

TlsContext::~TlsContext() { SSL_CTX_free(as_ctx(ctx_)); }

Result<std::unique_ptr<TlsSession>> TlsSession::create(const TlsContext& context, const std::string& server_name) {
  ERR_clear_error();
  std::unique_ptr<TlsSession> s(new TlsSession);
  s->server_name_ = server_name;
  SSL* ssl = SSL_new(as_ctx(context.ctx_));
  if (!ssl) return internal_error("SSL_new failed: " + drain_errors());
  s->ssl_ = ssl;
  BIO* in = BIO_new(BIO_s_mem());
  BIO* out = BIO_new(BIO_s_mem());
  if (!in || !out) {
    BIO_free(in);
    BIO_free(out);
    return internal_error("BIO_new failed: " + drain_errors());
  }
  // An empty input buffer means "more to come", not end of stream.
  BIO_set_mem_eof_return(in, -1);
  SSL_set_bio(ssl, in, out);  // the session owns both now
  s->in_ = in;
  s->out_ = out;
  SSL_set_connect_state(ssl);
  if (is_ip_address(server_name)) {
    if (X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), server_name.c_str()) != 1)
      return invalid_argument("cannot verify against the IP address " + server_name);
  } else {
    SSL_set_hostflags(ssl, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    if (SSL_set1_host(ssl, server_name.c_str()) != 1 || SSL_set_tlsext_host_name(ssl, server_name.c_str()) != 1)
      return invalid_argument("cannot verify against the host name '" + server_name + "'");
  }
  return s;
}

TlsSession::~TlsSession() { SSL_free(as_ssl(ssl_)); }

void TlsSession::give_input(std::string_view bytes) {
  if (!bytes.empty()) BIO_write(as_bio(in_), bytes.data(), int(bytes.size()));
}

std::string TlsSession::take_output() {
  std::string out;
  const std::size_t n = BIO_ctrl_pending(as_bio(out_));
  if (n == 0) return out;
  out.resize(n);
  const int got = BIO_read(as_bio(out_), out.data(), int(n));
  out.resize(got > 0 ? std::size_t(got) : 0);
  return out;
}

Status TlsSession::failure(const char* step, int ret) {
  SSL* ssl = as_ssl(ssl_);
  const int err = SSL_get_error(ssl, ret);
  const long verify = SSL_get_verify_result(ssl);
  std::string why;
  if (verify != X509_V_OK) {
    why = std::string("the server's certificate does not verify: ") + X509_verify_cert_error_string(verify);
    drain_errors();
  } else if (err == SSL_ERROR_SSL) {
    why = drain_errors();
    if (why.empty()) why = "protocol error";
  } else {
    why = "SSL error " + std::to_string(err) + " " + drain_errors();
  }
  return unavailable("TLS " + std::string(step) + " with " + server_name_ + " failed: " + why);
}

Result<bool> TlsSession::handshake() {
  ERR_clear_error();
  const int r = SSL_connect(as_ssl(ssl_));
  if (r == 1) return true;
  const int err = SSL_get_error(as_ssl(ssl_), r);
  if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) return false;
  return failure("handshake", r);
}

Status TlsSession::write(std::string_view plain) {
  ERR_clear_error();
  std::size_t off = 0;
  while (off < plain.size()) {
    const int r = SSL_write(as_ssl(ssl_), plain.data() + off, int(plain.size() - off));
    if (r <= 0) return failure("write", r);
    off += std::size_t(r);
  }
  return {};
}

Result<std::size_t> TlsSession::read(char* buf, std::size_t size) {
  ERR_clear_error();
  const int r = SSL_read(as_ssl(ssl_), buf, int(size));
  if (r > 0) return std::size_t(r);
  const int err = SSL_get_error(as_ssl(ssl_), r);
  if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) return std::size_t(0);
  if (err == SSL_ERROR_ZERO_RETURN) return unavailable("the remote cache closed the connection");
  return failure("read", r);
}

bool is_tls_failure(const Status& s) { return !s.ok() && s.message().rfind("TLS ", 0) == 0; }

}  // namespace kiln::remote
