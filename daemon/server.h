// kilnd's server: the Unix socket listener, the framed protocol, the compile pool.
//
// One I/O thread runs Boost.Asio (C++20 coroutines): it accepts, checks the peer's uid, reads
// frames under deadlines and writes replies. Everything that can block (NVRTC compiles through
// jit::Builder, SQLite queries) runs on worker pools and completes the reply asynchronously, so
// a slow compile never stalls other clients. A shutdown request, SIGTERM or SIGINT stops the
// server gracefully: no new connections, queued work is answered with shutting_down, compiles
// already running finish and are answered, then the socket file is removed and the lock released.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <optional>

#include "kiln/status.h"
#include "remote/config.h"

namespace kiln::daemon {

struct ServerOptions {
  std::filesystem::path socket;      // required
  std::filesystem::path cache_file;  // required
  std::size_t jobs = 0;              // compile workers; 0: hardware concurrency
  bool use_pch = true;               // NVRTC automatic PCH (BuilderOptions::use_pch)
  // A connection with no frame in progress is closed after idle_timeout; a frame must arrive
  // completely within frame_timeout of its first byte; a reply must be taken by the peer within
  // write_timeout.
  std::chrono::milliseconds idle_timeout{60'000};
  std::chrono::milliseconds frame_timeout{10'000};
  std::chrono::milliseconds write_timeout{60'000};
  // At the cap, the connection waiting longest without being served is closed to admit a new
  // one; only when every connection is being served is the new one refused.
  std::size_t max_connections = 256;
  // Each compile runs in a worker process that is killed when it takes longer than this: the
  // request fails with Code::timeout (daemon/compile_workers.h). Zero: compile in-process, with no
  // deadline. Below the client library's 120 s for a get, so that a client hears why.
  std::chrono::milliseconds compile_timeout{60'000};
  // Queue background tuning for every resolve whose signature has no tuned winner, whatever the
  // client asked (kilnd --autotune; docs/autotune.md).
  bool autotune = false;
  // The fleet's remote cache tier (remote/tier.h); unset: local cache only.
  std::optional<remote::Config> remote;
  // Also serve GET /metrics over HTTP on this address (daemon/metrics_http.h); empty: not.
  std::string metrics_listen;
};

// Process exit codes of kilnd.
inline constexpr int k_exit_ok = 0;
inline constexpr int k_exit_error = 1;            // bad flags, unusable directory, store, ...
inline constexpr int k_exit_already_running = 3;  // another kilnd serves this socket

class Server {
 public:
  // Claims the socket (see daemon/instance.h), opens the cache and starts the workers. Serves
  // nothing until run(). On failure `already_running` tells "another daemon" from other errors.
  static Result<std::unique_ptr<Server>> create(const ServerOptions& options, bool* already_running = nullptr);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Serves until stopped, then drains and cleans up. Returns the process exit code. Installs the
  // SIGTERM/SIGINT handlers for its duration.
  int run();
  // Starts a graceful stop. Thread-safe; may be called before or during run().
  void request_stop();

 private:
  struct Impl;
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::daemon
