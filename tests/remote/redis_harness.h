// Test harness for the remote tier: real redis-server processes on free local ports (no mock),
// started, killed, stopped (SIGSTOP: a server that accepts and never answers) and restarted on
// the same port, in plain TCP or TLS; a throwaway certificate authority made with the openssl
// command; fleet key files with a chosen mode.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "remote/config.h"
#include "remote/resp.h"
#include "remote/tls.h"

extern char** environ;

namespace kiln::testing {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

// Skips the test (with why) where redis-server is not installed; CI installs it (scripts/deps.sh).
#define KILN_REQUIRE_REDIS()                                                                        \
  do {                                                                                              \
    if (::kiln::testing::RedisServer::binary().empty())                                             \
      GTEST_SKIP() << "redis-server is not installed (scripts/deps.sh installs it; KILN_REDIS_SERVER " \
                      "names another binary, as scripts/gpu_run.sh names gpu-dist/redis/bin/"       \
                      "redis-server)";                                                              \
  } while (0)

// Certificates for TLS tests, made in `dir` by the openssl command (EC P-256, valid two days): a
// CA, a server certificate it signed for DNS:redis.kiln.test and IP:127.0.0.1 (not "localhost"),
// a client certificate it signed, and a second CA that signed nothing here.
struct TestPki {
  fs::path ca, server_cert, server_key, client_cert, client_key, other_ca;

  // nullopt with `why` set when the openssl command is missing or fails.
  static std::optional<TestPki> make(const fs::path& dir, std::string& why) {
    TestPki p{dir / "ca.pem", dir / "server.pem", dir / "server.key", dir / "client.pem", dir / "client.key",
              dir / "other-ca.pem"};
    const std::string d = dir.string();
    const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string script =
        "set -e; cd '" + d + "'\n"
        "openssl req -x509" + ec + " -keyout ca.key -out ca.pem -days 2 -subj /CN=kiln-test-ca\n"
        "openssl req -x509" + ec + " -keyout other-ca.key -out other-ca.pem -days 2 -subj /CN=kiln-other-ca\n"
        "openssl req" + ec + " -keyout server.key -out server.csr -subj /CN=redis.kiln.test\n"
        "printf 'subjectAltName=DNS:redis.kiln.test,IP:127.0.0.1\\n' > server.ext\n"
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 "
        "-extfile server.ext\n"
        "openssl req" + ec + " -keyout client.key -out client.csr -subj /CN=kiln-client\n"
        "printf 'extendedKeyUsage=clientAuth\\n' > client.ext\n"
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2 "
        "-extfile client.ext\n"
        "chmod 600 client.key server.key\n";
    const fs::path sh = dir / "make_pki.sh";
    {
      std::ofstream out(sh);
      out << script;
    }
    const std::string cmd = "sh '" + sh.string() + "' > '" + d + "/make_pki.log' 2>&1";
    if (std::system(cmd.c_str()) != 0) {
      std::ifstream log(dir / "make_pki.log");
      std::stringstream ss;
      ss << log.rdbuf();
      why = "the openssl command could not make test certificates (scripts/deps.sh installs openssl): " + ss.str();
      return std::nullopt;
    }
    return p;
  }

  // TLS files for a client that trusts this CA, with or without its client certificate.
  remote::TlsFiles client_files(bool with_cert = false) const {
    remote::TlsFiles f;
    f.ca_file = ca;
    if (with_cert) {
      f.cert_file = client_cert;
      f.key_file = client_key;
    }
    return f;
  }
};

class RedisServer {
 public:
  // $KILN_REDIS_SERVER, else redis-server in /usr/bin, /usr/local/bin or /usr/sbin; "" if none.
  static std::string binary() {
    if (const char* e = std::getenv("KILN_REDIS_SERVER"); e && *e) return e;
    for (const char* p : {"/usr/bin/redis-server", "/usr/local/bin/redis-server", "/usr/sbin/redis-server"})
      if (::access(p, X_OK) == 0) return p;
    return "";
  }

  // A free TCP port on 127.0.0.1 (the kernel's pick; free again once this returns).
  static int free_port() {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ::close(fd);
    return ntohs(a.sin_port);
  }

  // Starts a server without persistence in `dir`, with `extra` arguments; nullptr (after
  // ADD_FAILURE) when it does not answer.
  static std::unique_ptr<RedisServer> start(const fs::path& dir, std::vector<std::string> extra = {}) {
    std::unique_ptr<RedisServer> r(new RedisServer);
    r->dir_ = dir;
    r->extra_ = std::move(extra);
    r->port_ = free_port();
    if (!r->launch()) return nullptr;
    return r;
  }

  // The same, serving TLS only (no plain port) with `pki`'s server certificate; clients must show
  // a certificate from its CA when `client_certs` is set.
  static std::unique_ptr<RedisServer> start_tls(const fs::path& dir, const TestPki& pki, bool client_certs = false,
                                                std::vector<std::string> extra = {}) {
    std::unique_ptr<RedisServer> r(new RedisServer);
    r->dir_ = dir;
    r->extra_ = {"--tls-cert-file", pki.server_cert.string(), "--tls-key-file", pki.server_key.string(),
                 "--tls-ca-cert-file", pki.ca.string(), "--tls-auth-clients", client_certs ? "yes" : "no"};
    r->extra_.insert(r->extra_.end(), extra.begin(), extra.end());
    auto tls = remote::TlsContext::create(pki.client_files(/*with_cert=*/true));
    if (!tls.ok()) {
      ADD_FAILURE() << tls.status().to_string();
      return nullptr;
    }
    r->tls_ = *tls;
    r->port_ = free_port();
    if (!r->launch()) return nullptr;
    return r;
  }

  ~RedisServer() { kill(); }

  int port() const { return port_; }
  std::string url() const { return (tls_ ? "rediss://127.0.0.1:" : "redis://127.0.0.1:") + std::to_string(port_); }
  pid_t pid() const { return pid_; }

  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGCONT);
    ::kill(pid_, SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
  }
  void pause() { ::kill(pid_, SIGSTOP); }
  void resume() { ::kill(pid_, SIGCONT); }
  // Kills and starts it again on the same port, empty (no persistence).
  bool restart() {
    kill();
    return launch();
  }

  // One command on a fresh connection (as the default user unless `config` says otherwise).
  Result<remote::Reply> command(const std::vector<std::string>& args, const remote::Config* config = nullptr) {
    remote::Config c;
    if (config) c = *config;
    c.endpoint.host = "127.0.0.1";
    c.endpoint.port = port_;
    if (tls_ && !c.tls) {
      c.tls = tls_;
      c.tls_name = "127.0.0.1";
    }
    auto conn = remote::Connection::open(c, remote::Clock::now() + 2s);
    if (!conn.ok()) return conn.status();
    std::vector<std::string_view> v(args.begin(), args.end());
    return (*conn)->command(v, remote::Clock::now() + 2s);
  }

 private:
  RedisServer() = default;

  bool launch() {
    std::vector<std::string> args = {binary(), "--port", tls_ ? "0" : std::to_string(port_), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no", "--dir", dir_.string(),
                                     "--daemonize", "no", "--logfile", (dir_ / "redis.log").string()};
    if (tls_) args.insert(args.end(), {"--tls-port", std::to_string(port_)});
    args.insert(args.end(), extra_.begin(), extra_.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    const int rc = ::posix_spawn(&pid_, args[0].c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      pid_ = -1;
      ADD_FAILURE() << "cannot start " << args[0];
      return false;
    }
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < until) {
      remote::Config c;
      c.endpoint.host = "127.0.0.1";
      c.endpoint.port = port_;
      c.tls = tls_;
      c.tls_name = "127.0.0.1";
      if (auto conn = remote::Connection::open(c, remote::Clock::now() + 200ms); conn.ok()) {
        auto r = (*conn)->command({"PING"}, remote::Clock::now() + 200ms);
        // NOAUTH also proves it is up (servers started with a password or ACL file).
        if (r.ok()) return true;
      }
      std::this_thread::sleep_for(10ms);
    }
    std::ifstream log(dir_ / "redis.log");
    std::stringstream ss;
    ss << log.rdbuf();
    const std::string text = ss.str();
    ADD_FAILURE() << "redis-server did not answer on port " << port_ << (tls_ ? " (TLS)" : "") << "; its log ends:\n"
                  << text.substr(text.size() > 1500 ? text.size() - 1500 : 0);
    kill();
    return false;
  }

  fs::path dir_;
  std::vector<std::string> extra_;
  std::shared_ptr<const remote::TlsContext> tls_;  // set: the server speaks TLS only
  int port_ = 0;
  pid_t pid_ = -1;
};

// Writes `content` to `file` with `mode`.
inline fs::path write_secret(const fs::path& file, const std::string& content, mode_t mode = 0600) {
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out << content;
  }
  ::chmod(file.c_str(), mode);
  return file;
}

// Polls `pred` until it holds or `timeout` passes.
inline bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout = 10s) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(10ms);
  }
}

}  // namespace kiln::testing
