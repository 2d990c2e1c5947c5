#include "daemon/connections.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include "daemon/log.h"
#include "daemon/protocol.h"

namespace kiln::daemon {

namespace asio = boost::asio;
using asio::awaitable;
using asio::use_awaitable;
using Socket = asio::local::stream_protocol::socket;
using nlohmann::json;

struct Connections::Connection {
  explicit Connection(Socket s, std::uint64_t id_) : socket(std::move(s)), timer(socket.get_executor()), id(id_) {}
  Socket socket;
  asio::steady_timer timer;
  Clock::time_point deadline = Clock::time_point::max();
  std::uint64_t id;
  bool busy = false;       // a frame is being read or a request served
  bool serving = false;    // a whole request was read: it is being answered
  Clock::time_point since = Clock::now();  // start of the current wait for (or read of) a frame
  bool timed_out = false;
};

Connections::Connections(asio::io_context& io, const ServerOptions& options, Hooks hooks)
    : io_(io), options_(options), hooks_(std::move(hooks)), acceptor_(io) {}

Connections::~Connections() = default;

Status Connections::listen(int fd, const std::filesystem::path& socket) {
  boost::system::error_code ec;
  acceptor_.assign(asio::local::stream_protocol(), fd, ec);
  if (ec) {
    ::close(fd);
    return io_error("cannot listen on " + socket.string() + ": " + ec.message());
  }
  return {};
}

void Connections::start() { asio::co_spawn(io_, accept_loop(), asio::detached); }

void Connections::stop() {
  stopping_ = true;
  boost::system::error_code ec;
  acceptor_.close(ec);
  for (const auto& c : connections_)
    if (!c->busy) close_connection(*c);
}

void Connections::close_connection(Connection& c) {
  boost::system::error_code ec;
  c.socket.shutdown(Socket::shutdown_both, ec);
  c.socket.close(ec);
  c.timer.cancel();
}

void Connections::set_deadline(Connection& c, Clock::time_point when) {
  c.deadline = when;
  c.timer.cancel();  // wakes the watchdog so it sleeps until the new deadline
}

awaitable<void> Connections::accept_loop() {
  asio::steady_timer backoff(io_);
  while (!stopping_) {
    boost::system::error_code ec;
    Socket socket = co_await acceptor_.async_accept(asio::redirect_error(use_awaitable, ec));
    if (stopping_) co_return;
    if (ec) {
      if (ec == asio::error::operation_aborted) co_return;
      log_error("accept failed: " + ec.message());
      // Out of descriptors: back off instead of spinning on the error.
      backoff.expires_after(std::chrono::milliseconds(100));
      co_await backoff.async_wait(asio::redirect_error(use_awaitable, ec));
      continue;
    }
    // The peer's credentials are checked before a single byte is read from it.
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      log_warn(std::string("refused a connection: SO_PEERCRED failed: ") + std::strerror(errno));
      socket.close(ec);
      continue;
    }
    if (cred.uid != ::geteuid()) {
      log_warn("refused a connection from uid " + std::to_string(cred.uid) + " (pid " + std::to_string(cred.pid) +
               "): only uid " + std::to_string(::geteuid()) + " may use this daemon");
      socket.close(ec);
      continue;
    }
    if (connections_.size() >= options_.max_connections && !evict_one_waiting()) {
      log_warn("refused a connection from pid " + std::to_string(cred.pid) + ": " +
               std::to_string(connections_.size()) + " connections already open, all of them being served");
      socket.close(ec);
      continue;
    }
    auto conn = std::make_shared<Connection>(std::move(socket), next_id_++);
    connections_.insert(conn);
    ++counters_.connections;
    asio::co_spawn(io_, watchdog(conn), asio::detached);
    asio::co_spawn(io_, serve(conn), asio::detached);
  }
}

// At the connection cap, idle or slowly-sending peers must not lock out a new client: the
// connection that has waited longest without a request being served is closed (a kiln client
// reconnects transparently). Returns false when every connection is being served.
bool Connections::evict_one_waiting() {
  std::shared_ptr<Connection> oldest;
  for (const auto& c : connections_)
    if (!c->serving && c->socket.is_open() && (!oldest || c->since < oldest->since)) oldest = c;
  if (!oldest) return false;
  ++counters_.evicted;
  if (counters_.evicted == 1 || counters_.evicted % 1000 == 0)
    log_warn("at the connection cap (" + std::to_string(options_.max_connections) +
             "): closed the longest-waiting connection (" + std::to_string(counters_.evicted) + " so far)");
  close_connection(*oldest);
  // It stays in `connections_` until its coroutine ends; do not count it against the cap.
  oldest->serving = true;
  return true;
}

// Closes the connection when its deadline passes; a slow or silent peer cannot hold it open.
awaitable<void> Connections::watchdog(std::shared_ptr<Connection> c) {
  while (c->socket.is_open()) {
    if (c->deadline <= Clock::now()) {
      c->timed_out = true;
      close_connection(*c);
      co_return;
    }
    c->timer.expires_at(c->deadline);
    boost::system::error_code ec;
    co_await c->timer.async_wait(asio::redirect_error(use_awaitable, ec));
  }
}

awaitable<void> Connections::serve(std::shared_ptr<Connection> c) {
  const std::string who = "connection " + std::to_string(c->id);
  try {
    co_await serve_frames(*c);
  } catch (const boost::system::system_error& e) {
    const auto& ec = e.code();
    if (c->timed_out)
      log_info(who + ": closed after its deadline passed");
    else if (ec != asio::error::eof && ec != asio::error::operation_aborted && ec != asio::error::bad_descriptor &&
             ec != asio::error::connection_reset && ec != asio::error::broken_pipe)
      log_warn(who + ": " + ec.message());
  } catch (const std::exception& e) {
    log_error(who + ": unexpected exception: " + e.what());
  }
  close_connection(*c);
  connections_.erase(c);
  hooks_.closed();
}

awaitable<void> Connections::serve_frames(Connection& c) {
  for (;;) {
    if (stopping_) co_return;
    HeaderBytes raw{};
    c.busy = false;
    c.serving = false;
    c.since = Clock::now();
    set_deadline(c, Clock::now() + options_.idle_timeout);
    co_await asio::async_read(c.socket, asio::buffer(raw.data(), 1), use_awaitable);
    // From the first byte on, the whole frame must arrive within frame_timeout.
    c.busy = true;
    set_deadline(c, Clock::now() + options_.frame_timeout);
    co_await asio::async_read(c.socket, asio::buffer(raw.data() + 1, raw.size() - 1), use_awaitable);

    auto header = decode_header(raw);
    Status framing = header.ok() ? check_limits(*header, FrameKind::request) : header.status();
    if (!framing.ok()) {
      // The body was not read, so the stream cannot be resynchronized: answer and hang up.
      log_warn("connection " + std::to_string(c.id) + ": " + framing.message());
      ++counters_.errors;
      Reply r{error_reply(framing), {}, true};
      r.body["fatal"] = true;
      co_await write_reply(c, std::move(r));
      co_return;
    }
    std::string body = co_await read_body(c, header->json_len);
    c.serving = true;
    set_deadline(c, Clock::time_point::max());  // serving may take a compile's time

    Reply reply = co_await hooks_.dispatch(body);
    ++counters_.requests;
    if (reply.body.value("ok", false) == false) ++counters_.errors;
    const bool close_after = reply.close_after;
    const bool stop_after = reply.stop_after;
    co_await write_reply(c, std::move(reply));
    if (stop_after) hooks_.shutdown_requested();
    if (close_after) co_return;
  }
}

// Reads the body in steps so that memory follows the bytes that actually arrived: a peer that
// announces 1 MiB and trickles costs what it sent, not the announced size.
awaitable<std::string> Connections::read_body(Connection& c, std::size_t len) {
  constexpr std::size_t k_step = 64 * 1024;
  std::string body;
  while (body.size() < len) {
    const std::size_t old = body.size();
    body.resize(old + std::min(k_step, len - old));
    co_await asio::async_read(c.socket, asio::buffer(body.data() + old, body.size() - old), use_awaitable);
  }
  co_return body;
}

awaitable<void> Connections::write_reply(Connection& c, Reply reply) {
  std::string text = dump_json(reply.body);
  if (text.size() > k_max_reply_json || reply.blob.size() > k_max_reply_blob) {
    Status s = internal_error("reply too large for the protocol",
                              "json " + std::to_string(text.size()) + " bytes, blob " +
                                  std::to_string(reply.blob.size()) + " bytes");
    log_error(s.message() + ": " + s.details());
    json err = error_reply(s);
    if (reply.body.contains("id")) err["id"] = reply.body["id"];
    text = dump_json(err);
    reply.blob.clear();
  }
  FrameHeader h;
  h.json_len = static_cast<std::uint32_t>(text.size());
  h.blob_len = static_cast<std::uint32_t>(reply.blob.size());
  HeaderBytes hb = encode_header(h);
  std::vector<asio::const_buffer> bufs{asio::buffer(hb), asio::buffer(text), asio::buffer(reply.blob)};
  c.busy = true;
  set_deadline(c, Clock::now() + options_.write_timeout);
  co_await asio::async_write(c.socket, bufs, use_awaitable);
}

}  // namespace kiln::daemon
