// Test harness for kilnd: real daemon processes on real sockets in a private temp directory, and a
// raw socket for sending hand-made (and malformed) frames.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "client/daemon_client.h"
#include "daemon/protocol.h"
#include "tests/test_util.h"

extern char** environ;

namespace kiln::testing {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

// A kilnd child process. Its stdout and stderr go to a log file next to the socket's directory.
class Kilnd {
 public:
  struct Options {
    fs::path socket;     // passed as KILN_SOCKET unless empty
    fs::path cache_dir;  // passed as KILN_CACHE_DIR unless empty
    std::vector<std::string> args;
    std::map<std::string, std::string> env;  // extra variables (a value "" unsets)
    fs::path log;
  };

  static std::unique_ptr<Kilnd> spawn(const Options& o) {
    std::unique_ptr<Kilnd> k(new Kilnd);
    k->socket_ = o.socket;
    k->log_ = o.log;

    std::map<std::string, std::string> env;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      auto eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    env.erase("KILN_SOCKET");
    env.erase("KILN_CACHE_DIR");
    if (!o.socket.empty()) env["KILN_SOCKET"] = o.socket.string();
    if (!o.cache_dir.empty()) env["KILN_CACHE_DIR"] = o.cache_dir.string();
    for (const auto& [name, value] : o.env) {
      if (value.empty()) env.erase(name);
      else env[name] = value;
    }
    std::vector<std::string> env_strings;
    for (const auto& [name, value] : env) env_strings.push_back(name + "=" + value);
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);

    std::vector<std::string> arg_strings{KILN_KILND_PATH};
    arg_strings.insert(arg_strings.end(), o.args.begin(), o.args.end());
    std::vector<char*> argv;
    for (auto& s : arg_strings) argv.push_back(s.data());
    argv.push_back(nullptr);

    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, o.log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    int rc = posix_spawn(&k->pid_, KILN_KILND_PATH, &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) k->pid_ = -1;
    return k;
  }

  ~Kilnd() {
    if (running()) {
      ::kill(pid_, SIGKILL);
      wait_exit(5s);
    }
  }

  pid_t pid() const { return pid_; }
  const fs::path& socket() const { return socket_; }

  bool running() {
    if (pid_ <= 0 || exited_) return false;
    poll_exit();
    return !exited_;
  }

  // Waits until the daemon answers a ping (or exits). True when it answers.
  bool wait_ready(std::chrono::milliseconds timeout = 10s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (!running()) return false;
      auto c = client::DaemonClient::connect(socket_, 500ms);
      if (c.ok()) return true;
      std::this_thread::sleep_for(10ms);
    }
    return false;
  }

  // The exit code (128+signal for a signal death), or nullopt if still running after `timeout`.
  std::optional<int> wait_exit(std::chrono::milliseconds timeout = 10s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      poll_exit();
      if (exited_) return exit_code_;
      if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(5ms);
    }
  }

  void signal(int sig) {
    if (running()) ::kill(pid_, sig);
  }

  std::string log() const { return read_file(log_); }

  static std::string read_file(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  Kilnd() = default;
  void poll_exit() {
    if (pid_ <= 0 || exited_) return;
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      exit_code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
  }

  pid_t pid_ = -1;
  bool exited_ = false;
  int exit_code_ = -1;
  fs::path socket_;
  fs::path log_;
};

// A temp directory laid out for one daemon: <tmp>/run/kilnd.sock, <tmp>/cache, <tmp>/kilnd.log.
class DaemonEnv {
 public:
  DaemonEnv() {
    std::error_code ec;
    fs::create_directories(cache_dir(), ec);
  }
  fs::path root() const { return tmp_.path(); }
  fs::path run_dir() const { return tmp_.path() / "run"; }
  fs::path socket() const { return run_dir() / "kilnd.sock"; }
  fs::path cache_dir() const { return tmp_.path() / "cache"; }
  fs::path log() const { return tmp_.path() / "kilnd.log"; }

  Kilnd::Options options(std::vector<std::string> args = {}) const {
    Kilnd::Options o;
    o.socket = socket();
    o.cache_dir = cache_dir();
    o.args = std::move(args);
    o.log = log();
    return o;
  }

  // Starts a daemon and waits for it to answer; nullptr (with the log printed) if it does not.
  std::unique_ptr<Kilnd> start(std::vector<std::string> args = {"--jobs", "2"}) const {
    auto k = Kilnd::spawn(options(std::move(args)));
    if (!k->wait_ready()) {
      ADD_FAILURE() << "kilnd did not come up; log:\n" << k->log();
      return nullptr;
    }
    return k;
  }

 private:
  TempDir tmp_;
};

// A raw connection for hand-made frames.
class RawConn {
 public:
  explicit RawConn(const fs::path& socket) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket.c_str(), sizeof addr.sun_path - 1);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawConn() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  int fd() const { return fd_; }

  bool send_bytes(const std::string& bytes) {
    std::size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<std::size_t>(n);
    }
    return true;
  }

  static std::string header(std::uint32_t json_len, std::uint32_t blob_len = 0, std::uint16_t version = 1,
                            std::uint16_t flags = 0, const char* magic = "KILN") {
    daemon::FrameHeader h;
    h.version = version;
    h.flags = flags;
    h.json_len = json_len;
    h.blob_len = blob_len;
    auto b = daemon::encode_header(h);
    std::string s(reinterpret_cast<const char*>(b.data()), b.size());
    std::memcpy(s.data(), magic, 4);
    return s;
  }

  static std::string frame(const std::string& json_text) {
    return header(static_cast<std::uint32_t>(json_text.size())) + json_text;
  }

  // Reads n bytes; false on EOF, error or timeout.
  bool recv_exact(char* out, std::size_t n, std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    std::size_t got = 0;
    while (got < n) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
      ssize_t r = ::recv(fd_, out + got, n - got, 0);
      if (r <= 0) return false;
      got += static_cast<std::size_t>(r);
    }
    return true;
  }

  // The next reply's JSON (its blob is read and dropped), or nullopt on EOF/timeout.
  std::optional<nlohmann::json> read_reply(std::chrono::milliseconds timeout = 5s) {
    daemon::HeaderBytes hb{};
    if (!recv_exact(reinterpret_cast<char*>(hb.data()), hb.size(), timeout)) return std::nullopt;
    auto h = daemon::decode_header(hb);
    if (!h.ok()) return std::nullopt;
    std::string body(h->json_len + h->blob_len, '\0');
    if (!recv_exact(body.data(), body.size(), timeout)) return std::nullopt;
    auto j = daemon::parse_json(std::string_view(body).substr(0, h->json_len));
    if (!j.ok()) return std::nullopt;
    return *j;
  }

  // True when the peer closes the connection within `timeout` (any pending bytes are drained).
  bool closed_within(std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    char buf[4096];
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
      ssize_t r = ::recv(fd_, buf, sizeof buf, 0);
      if (r == 0) return true;
      if (r < 0) return errno == ECONNRESET;
    }
  }

 private:
  int fd_ = -1;
};

inline std::string error_code_of(const nlohmann::json& reply) {
  if (!reply.contains("error") || !reply["error"].is_object()) return "";
  return reply["error"].value("code", "");
}

inline nlohmann::json stats_of(const fs::path& socket) {
  auto c = client::DaemonClient::connect(socket);
  if (!c.ok()) return {};
  auto s = (*c)->stats();
  return s.ok() ? *s : nlohmann::json{};
}

}  // namespace kiln::testing
