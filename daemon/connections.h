// kilnd's connections: accepting on the listening socket, the peer's uid check, the connection
// cap, per-connection deadlines, and reading request frames and writing their replies.
//
// What a request means is not decided here: each complete request body goes to the dispatch hook
// and its Reply is written back. Everything runs on the I/O thread; nothing here is thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <nlohmann/json.hpp>

#include "daemon/server.h"
#include "kiln/status.h"

namespace kiln::daemon {

struct Reply {
  nlohmann::json body;
  std::string blob;
  bool close_after = false;  // the connection ends after this reply (fatal frame error)
  bool stop_after = false;   // the server stops after this reply is written (shutdown)
};

class Connections {
 public:
  struct Hooks {
    // Answers one request body.
    std::function<boost::asio::awaitable<Reply>(const std::string& body)> dispatch;
    // A reply with stop_after was written.
    std::function<void()> shutdown_requested;
    // A connection ended (after stop(), the server waits for the last one).
    std::function<void()> closed;
  };
  struct Counters {
    std::int64_t connections = 0;  // accepted since the start
    std::int64_t requests = 0;
    std::int64_t errors = 0;       // requests answered with an error, and fatal frame errors
    std::int64_t evicted = 0;      // connections closed at the cap to admit a new one
  };

  // Deadlines and the cap come from `options`, which must outlive this.
  Connections(boost::asio::io_context& io, const ServerOptions& options, Hooks hooks);
  ~Connections();
  Connections(const Connections&) = delete;
  Connections& operator=(const Connections&) = delete;

  // Takes ownership of the listening socket `fd` (closed on failure); `socket` names it in errors.
  Status listen(int fd, const std::filesystem::path& socket);
  // Starts accepting.
  void start();
  // Stops accepting and closes every connection that is not reading a frame or being served;
  // those finish their current request and then close.
  void stop();

  std::size_t open() const { return connections_.size(); }
  const Counters& counters() const { return counters_; }

 private:
  struct Connection;
  using Clock = std::chrono::steady_clock;

  boost::asio::awaitable<void> accept_loop();
  bool evict_one_waiting();
  boost::asio::awaitable<void> watchdog(std::shared_ptr<Connection> c);
  boost::asio::awaitable<void> serve(std::shared_ptr<Connection> c);
  boost::asio::awaitable<void> serve_frames(Connection& c);
  boost::asio::awaitable<std::string> read_body(Connection& c, std::size_t len);
  boost::asio::awaitable<void> write_reply(Connection& c, Reply reply);
  void set_deadline(Connection& c, Clock::time_point when);
  static void close_connection(Connection& c);

  boost::asio::io_context& io_;
  const ServerOptions& options_;
  Hooks hooks_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  std::set<std::shared_ptr<Connection>> connections_;
  bool stopping_ = false;
  std::uint64_t next_id_ = 1;
  Counters counters_;
};

}  // namespace kiln::daemon
