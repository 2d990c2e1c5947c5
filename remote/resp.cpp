#include "remote/resp.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

#include "remote/tls.h"

namespace kiln::remote {
namespace {

constexpr int k_max_depth = 8;

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return int(std::min<long long>((left + 999) / 1000, 1 << 30));
}

Status timed_out(const std::string& what) { return Status(Code::timeout, "the remote cache did not answer in time (" + what + ")"); }

// Waits until fd is ready for `events` or the deadline passes.
Status wait_fd(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    const int left = ms_left(deadline);
    if (left == 0) return timed_out(what);
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, left);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return io_error(std::string("poll: ") + std::strerror(errno));
    if (r == 0) return timed_out(what);
    return {};
  }
}

// A non-blocking connect to one address, finished before the deadline.
Result<int> connect_to(const sockaddr* addr, socklen_t len, int family, Clock::time_point deadline,
                       const std::string& name) {
  int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return io_error(std::string("socket: ") + std::strerror(errno));
  if (::connect(fd, addr, len) != 0) {
    if (errno != EINPROGRESS && errno != EAGAIN) {
      const int err = errno;
      ::close(fd);
      return unavailable("cannot connect to the remote cache at " + name + ": " + std::strerror(err));
    }
    Status s = wait_fd(fd, POLLOUT, deadline, "connect");
    if (!s.ok()) {
      ::close(fd);
      return s;
    }
    int err = 0;
    socklen_t elen = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen);
    if (err != 0) {
      ::close(fd);
      return unavailable("cannot connect to the remote cache at " + name + ": " + std::strerror(err));
    }
  }
  if (family != AF_UNIX) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  return fd;
}

Result<int> connect_endpoint(const Endpoint& ep, Clock::time_point deadline) {
  const std::string name = ep.describe();
  if (!ep.unix_path.empty()) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (ep.unix_path.size() >= sizeof addr.sun_path) return invalid_argument("Unix socket path too long: " + ep.unix_path);
    std::memcpy(addr.sun_path, ep.unix_path.data(), ep.unix_path.size());
    return connect_to(reinterpret_cast<sockaddr*>(&addr), sizeof addr, AF_UNIX, deadline, name);
  }
  // Numeric addresses resolve without DNS; a host name goes through the resolver, which has no
  // deadline of its own: name the server by address where latency matters.
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_family = AF_UNSPEC;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(ep.port);
  if (int rc = ::getaddrinfo(ep.host.c_str(), port.c_str(), &hints, &res); rc != 0)
    return unavailable("cannot resolve the remote cache host " + ep.host + ": " + ::gai_strerror(rc));
  Status last = unavailable("no address for " + name);
  for (addrinfo* a = res; a; a = a->ai_next) {
    auto fd = connect_to(a->ai_addr, a->ai_addrlen, a->ai_family, deadline, name);
    if (fd.ok()) {
      ::freeaddrinfo(res);
      return fd;
    }
    last = fd.status();
    if (last.code() == Code::timeout) break;
  }
  ::freeaddrinfo(res);
  return last;
}

std::string encode_command(const std::vector<std::string_view>& args) {
  std::string out = "*" + std::to_string(args.size()) + "\r\n";
  for (auto a : args) {
    out += "$" + std::to_string(a.size()) + "\r\n";
    out.append(a.data(), a.size());
    out += "\r\n";
  }
  return out;
}

}  // namespace

int parse_reply(std::string_view buf, Reply& out, std::size_t& used, int depth) {
  if (depth > k_max_depth) return -1;
  auto eol = buf.find("\r\n");
  if (eol == std::string_view::npos) return buf.size() > 64 * 1024 ? -1 : 0;
  if (eol == 0) return -1;
  const char type = buf[0];
  std::string_view line = buf.substr(1, eol - 1);
  std::size_t pos = eol + 2;
  auto number = [&](long long& v) {
    auto [p, ec] = std::from_chars(line.data(), line.data() + line.size(), v);
    return ec == std::errc() && p == line.data() + line.size();
  };
  out = Reply{};
  switch (type) {
    case '+': out.type = Reply::Type::status; out.text = std::string(line); break;
    case '-': out.type = Reply::Type::error; out.text = std::string(line); break;
    case ':':
      out.type = Reply::Type::integer;
      if (!number(out.integer)) return -1;
      break;
    case '$': {
      long long n = 0;
      if (!number(n) || n < -1 || n > static_cast<long long>(k_max_bulk_bytes)) return -1;
      if (n == -1) {
        out.type = Reply::Type::nil;
        break;
      }
      if (buf.size() < pos + std::size_t(n) + 2) return 0;
      if (buf.substr(pos + std::size_t(n), 2) != "\r\n") return -1;
      out.type = Reply::Type::bulk;
      out.text = std::string(buf.substr(pos, std::size_t(n)));
      pos += std::size_t(n) + 2;
      break;
    }
    case '*': {
      long long n = 0;
      if (!number(n) || n < -1 || n > (1 << 20)) return -1;
      if (n == -1) {
        out.type = Reply::Type::nil;
        break;
      }
      out.type = Reply::Type::array;
      for (long long i = 0; i < n; ++i) {
        Reply e;
        std::size_t u = 0;
        int r = parse_reply(buf.substr(pos), e, u, depth + 1);
        if (r != 1) return r;
        out.elements.push_back(std::move(e));
        pos += u;
      }
      break;
    }
    default: return -1;
  }
  used = pos;
  return 1;
}

Result<std::unique_ptr<Connection>> Connection::open(const Config& config, Clock::time_point deadline) {
  KILN_ASSIGN_OR_RETURN(int fd, connect_endpoint(config.endpoint, deadline));
  std::unique_ptr<Connection> c(new Connection(fd));
  if (config.tls) {
    KILN_ASSIGN_OR_RETURN(c->tls_, TlsSession::create(*config.tls, config.tls_name));
    KILN_TRY(c->handshake(deadline));
    if (!config.tls->has_client_certificate())
      c->no_client_cert_hint_ =
          " right after the TLS handshake (a server that requires client certificates closes such "
          "connections: see --remote-cert-file)";
  }
  if (!config.password.empty()) {
    std::vector<std::string_view> auth{"AUTH"};
    if (!config.user.empty()) auth.push_back(config.user);
    auth.push_back(config.password);
    KILN_ASSIGN_OR_RETURN(Reply r, c->command(auth, deadline));
    if (r.is_error()) return unavailable("the remote cache refused the credentials", r.text);
  }
  if (config.db != 0) {
    const std::string db = std::to_string(config.db);
    KILN_ASSIGN_OR_RETURN(Reply r, c->command({"SELECT", db}, deadline));
    if (r.is_error()) return unavailable("the remote cache refused SELECT " + db, r.text);
  }
  return c;
}

Connection::Connection(int fd) : fd_(fd) {}

Connection::~Connection() {
  if (fd_ >= 0) ::close(fd_);
}

Status Connection::handshake(Clock::time_point deadline) {
  for (;;) {
    KILN_ASSIGN_OR_RETURN(bool done, tls_->handshake());
    KILN_TRY(send_raw(tls_->take_output(), deadline));
    if (done) return {};
    std::string got;
    KILN_TRY(recv_raw(got, deadline));
    tls_->give_input(got);
  }
}

Status Connection::send_raw(const std::string& bytes, Clock::time_point deadline) {
  std::size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += std::size_t(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      KILN_TRY(wait_fd(fd_, POLLOUT, deadline, "send"));
      continue;
    }
    return unavailable(std::string("the remote cache connection failed: ") + std::strerror(errno));
  }
  return {};
}

Status Connection::recv_raw(std::string& out, Clock::time_point deadline) {
  char buf[64 * 1024];
  for (;;) {
    ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n > 0) {
      out.append(buf, std::size_t(n));
      return {};
    }
    if (n == 0) return unavailable("the remote cache closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      KILN_TRY(wait_fd(fd_, POLLIN, deadline, "reply"));
      continue;
    }
    return unavailable(std::string("the remote cache connection failed: ") + std::strerror(errno));
  }
}

Status Connection::send_all(const std::string& bytes, Clock::time_point deadline) {
  if (!tls_) return send_raw(bytes, deadline);
  KILN_TRY(tls_->write(bytes));
  return send_raw(tls_->take_output(), deadline);
}

Status Connection::fill(Clock::time_point deadline) {
  if (!tls_) return recv_raw(in_, deadline);
  char buf[16 * 1024];
  for (;;) {
    KILN_ASSIGN_OR_RETURN(std::size_t n, tls_->read(buf, sizeof buf));
    // Reading may produce records to send (a TLS 1.3 key update's answer, an alert).
    KILN_TRY(send_raw(tls_->take_output(), deadline));
    if (n > 0) {
      in_.append(buf, n);
      return {};
    }
    std::string got;
    KILN_TRY(recv_raw(got, deadline));
    tls_->give_input(got);
  }
}

Result<Reply> Connection::command(const std::vector<std::string_view>& args, Clock::time_point deadline) {
  // With TLS 1.3 the server judges the client's certificate after the client's handshake is done:
  // a server that requires one sends an alert and closes, and the close may arrive first.
  auto explained = [&](Status s) {
    if (!tls_ || answered_ || no_client_cert_hint_.empty() || s.code() != Code::unavailable || is_tls_failure(s))
      return s;
    return Status(s.code(), s.message() + no_client_cert_hint_, s.details());
  };
  if (Status s = send_all(encode_command(args), deadline); !s.ok()) return explained(s);
  for (;;) {
    Reply r;
    std::size_t used = 0;
    const int p = parse_reply(in_, r, used);
    if (p == 1) {
      in_.erase(0, used);
      answered_ = true;
      return r;
    }
    if (p < 0) return Status(Code::corruption, "the remote cache sent a malformed reply");
    if (Status s = fill(deadline); !s.ok()) return explained(s);
  }
}

}  // namespace kiln::remote
