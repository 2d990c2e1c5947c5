#include "daemon/metrics_http.h"

#include <charconv>
#include <chrono>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include "daemon/log.h"
#include "daemon/metrics.h"

namespace kiln::daemon {

namespace asio = boost::asio;
using asio::awaitable;
using asio::use_awaitable;
using asio::ip::tcp;

namespace {

constexpr std::size_t k_max_request = 8 * 1024;
constexpr auto k_request_timeout = std::chrono::seconds(5);

// The reply; a HEAD request gets the head alone, with the length the body would have.
std::string response(const char* status, const char* content_type, const std::string& body, bool head = false) {
  return std::string("HTTP/1.1 ") + status + "\r\nContent-Type: " + content_type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" +
         (head ? std::string() : body);
}

}  // namespace

Status parse_listen_address(const std::string& host_port, std::string& host, unsigned short& port) {
  auto bad = [&](const std::string& why) {
    return invalid_argument("bad metrics address '" + host_port + "': " + why, "expected HOST:PORT, e.g. 127.0.0.1:9464");
  };
  const auto colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0) return bad("no port");
  host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string p = host_port.substr(colon + 1);
  unsigned v = 0;
  auto [ptr, ec] = std::from_chars(p.data(), p.data() + p.size(), v);
  if (ec != std::errc() || ptr != p.data() + p.size() || p.empty() || v > 65535) return bad("the port must be 0..65535");
  boost::system::error_code aec;
  asio::ip::make_address(host, aec);
  if (aec) return bad("the host must be an IP address");
  port = static_cast<unsigned short>(v);
  return {};
}

MetricsHttp::MetricsHttp(asio::io_context& io, Render render) : io_(io), acceptor_(io), render_(std::move(render)) {}

MetricsHttp::~MetricsHttp() { stop(); }

Result<std::unique_ptr<MetricsHttp>> MetricsHttp::bind(asio::io_context& io, const std::string& host_port,
                                                       Render render) {
  std::string host;
  unsigned short port = 0;
  KILN_TRY(parse_listen_address(host_port, host, port));
  std::unique_ptr<MetricsHttp> m(new MetricsHttp(io, std::move(render)));
  boost::system::error_code ec;
  const tcp::endpoint ep(asio::ip::make_address(host), port);
  m->acceptor_.open(ep.protocol(), ec);
  if (!ec) m->acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) m->acceptor_.bind(ep, ec);
  if (!ec) m->acceptor_.listen(64, ec);
  if (ec) return io_error("cannot listen for metrics on " + host_port + ": " + ec.message());
  const tcp::endpoint bound = m->acceptor_.local_endpoint(ec);
  const std::string addr = bound.address().to_string();
  m->address_ = (bound.address().is_v6() ? "[" + addr + "]" : addr) + ":" + std::to_string(bound.port());
  return m;
}

void MetricsHttp::start() { asio::co_spawn(io_, accept_loop(), asio::detached); }

void MetricsHttp::stop() {
  boost::system::error_code ec;
  acceptor_.close(ec);
}

awaitable<void> MetricsHttp::accept_loop() {
  for (;;) {
    boost::system::error_code ec;
    tcp::socket s = co_await acceptor_.async_accept(asio::redirect_error(use_awaitable, ec));
    if (ec) {
      if (!acceptor_.is_open()) co_return;
      continue;
    }
    asio::co_spawn(io_, serve(std::move(s)), asio::detached);
  }
}

awaitable<void> MetricsHttp::serve(tcp::socket socket) {
  auto sock = std::make_shared<tcp::socket>(std::move(socket));
  // A peer that sends nothing (or too slowly) is cut off by the timer.
  auto timer = std::make_shared<asio::steady_timer>(io_, k_request_timeout);
  timer->async_wait([sock](const boost::system::error_code& ec) {
    if (!ec) {
      boost::system::error_code ignored;
      sock->close(ignored);
    }
  });
  std::string buf;
  boost::system::error_code ec;
  co_await asio::async_read_until(*sock, asio::dynamic_buffer(buf, k_max_request), "\r\n\r\n",
                                  asio::redirect_error(use_awaitable, ec));
  std::string reply;
  if (ec) {
    if (!sock->is_open()) co_return;
    reply = response("400 Bad Request", "text/plain", "bad request\n");
  } else {
    ++requests_;
    const std::string line = buf.substr(0, buf.find("\r\n"));
    const auto sp1 = line.find(' '), sp2 = line.find(' ', sp1 == std::string::npos ? 0 : sp1 + 1);
    const std::string method = line.substr(0, sp1);
    const std::string target = sp1 == std::string::npos ? "" : line.substr(sp1 + 1, sp2 - sp1 - 1);
    if (method != "GET" && method != "HEAD") {
      reply = response("405 Method Not Allowed", "text/plain", "only GET\n");
    } else if (target != "/metrics" && target.rfind("/metrics?", 0) != 0) {
      reply = response("404 Not Found", "text/plain", "kilnd serves /metrics only\n");
    } else {
      reply = response("200 OK", k_metrics_content_type, co_await render_(), method == "HEAD");
    }
  }
  co_await asio::async_write(*sock, asio::buffer(reply), asio::redirect_error(use_awaitable, ec));
  timer->cancel();
  sock->shutdown(tcp::socket::shutdown_both, ec);
  sock->close(ec);
}

}  // namespace kiln::daemon
