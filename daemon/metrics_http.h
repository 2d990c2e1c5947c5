// kilnd's optional HTTP listener for Prometheus (kilnd --metrics-listen HOST:PORT).
//
// It answers `GET /metrics` with the metrics text (daemon/metrics.h) and anything else with 404
// (405 for other methods); one request per connection, which is closed after the reply. A request
// must arrive within five seconds and within 8 KiB. It runs on the daemon's I/O thread; the
// listener serves no kernels and reads nothing but the request line. Bind it to a loopback or
// otherwise private address: the counters say what a host compiles.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "kiln/status.h"

namespace kiln::daemon {

class MetricsHttp {
 public:
  using Render = std::function<boost::asio::awaitable<std::string>()>;

  // Binds `host_port` ("127.0.0.1:9464", "[::1]:9464"; port 0 picks a free one). invalid_argument
  // for a malformed address, io_error when it cannot be bound.
  static Result<std::unique_ptr<MetricsHttp>> bind(boost::asio::io_context& io, const std::string& host_port,
                                                   Render render);
  ~MetricsHttp();
  void start();
  void stop();
  // The address it listens on, with the port it got.
  const std::string& address() const { return address_; }
  std::int64_t requests() const { return requests_; }

 private:
  MetricsHttp(boost::asio::io_context& io, Render render);
  boost::asio::awaitable<void> accept_loop();
  boost::asio::awaitable<void> serve(boost::asio::ip::tcp::socket socket);

  boost::asio::io_context& io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  Render render_;
  std::string address_;
  std::int64_t requests_ = 0;  // touched on the I/O thread only
};

// "HOST:PORT" -> address and port; invalid_argument when malformed.
Status parse_listen_address(const std::string& host_port, std::string& host, unsigned short& port);

}  // namespace kiln::daemon
