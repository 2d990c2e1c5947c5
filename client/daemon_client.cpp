#include "client/daemon_client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/sha256.h"
#include "daemon/protocol.h"

namespace kiln::client {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// The quick ops (list, stats, shutdown) may wait on SQLite's busy timeout in the daemon.
constexpr std::chrono::milliseconds k_min_query_timeout{30'000};

struct IoError {
  Status status;
  bool peer_gone = false;  // EOF, EPIPE or ECONNRESET
};

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return left > 1'000'000'000 ? 1'000'000'000 : static_cast<int>(left);
}

// Waits until fd is ready for `events`; false with *err set on timeout or failure.
bool wait_ready(int fd, short events, Clock::time_point deadline, IoError* err) {
  for (;;) {
    pollfd p{fd, events, 0};
    int ms = remaining_ms(deadline);
    int rc = ::poll(&p, 1, ms);
    if (rc > 0) return true;  // readiness, or POLLHUP/POLLERR that the next call reports
    if (rc == 0) {
      err->status = Status(Code::timeout, "kilnd did not answer in time");
      return false;
    }
    if (errno == EINTR) continue;
    err->status = io_error(std::string("poll: ") + std::strerror(errno));
    return false;
  }
}

bool send_all(int fd, const char* data, std::size_t n, Clock::time_point deadline, IoError* err) {
  while (n > 0) {
    ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL);
    if (w > 0) {
      data += w;
      n -= static_cast<std::size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_ready(fd, POLLOUT, deadline, err)) return false;
      continue;
    }
    int e = errno;
    err->peer_gone = e == EPIPE || e == ECONNRESET;
    err->status = unavailable(std::string("lost the connection to kilnd: ") + std::strerror(e));
    return false;
  }
  return true;
}

// Reads exactly n bytes. *got counts what arrived (to tell "no reply at all" from a cut reply).
bool recv_all(int fd, char* data, std::size_t n, Clock::time_point deadline, IoError* err, std::size_t* got) {
  while (n > 0) {
    ssize_t r = ::recv(fd, data, n, 0);
    if (r > 0) {
      data += r;
      n -= static_cast<std::size_t>(r);
      if (got) *got += static_cast<std::size_t>(r);
      continue;
    }
    if (r == 0) {
      err->peer_gone = true;
      err->status = unavailable("kilnd closed the connection");
      return false;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_ready(fd, POLLIN, deadline, err)) return false;
      continue;
    }
    int e = errno;
    err->peer_gone = e == ECONNRESET;
    err->status = unavailable(std::string("lost the connection to kilnd: ") + std::strerror(e));
    return false;
  }
  return true;
}

// A non-blocking connected socket, or why there is none.
Result<int> open_socket(const std::filesystem::path& path, Clock::time_point deadline) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string& s = path.native();
  if (s.empty() || s.size() >= sizeof addr.sun_path)
    return invalid_argument("bad kilnd socket path '" + s + "' (empty or longer than " +
                            std::to_string(sizeof addr.sun_path - 1) + " bytes)");
  std::memcpy(addr.sun_path, s.data(), s.size());

  for (;;) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return io_error(std::string("socket(): ") + std::strerror(errno));
    int rc;
    do rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    while (rc != 0 && errno == EINTR);
    if (rc == 0) return fd;
    int e = errno;
    ::close(fd);
    // A full listen backlog: the daemon is alive but busy accepting; try again until the deadline.
    if (e == EAGAIN && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    if (e == EAGAIN) return Status(Code::timeout, "kilnd did not accept the connection in time", s);
    if (e == ENOENT) return unavailable("kilnd is not running (no socket at " + s + ")");
    if (e == ECONNREFUSED) return unavailable("kilnd is not running (nothing listens on " + s + ")");
    return unavailable("cannot connect to kilnd at " + s + ": " + std::strerror(e));
  }
}

// True when the daemon has closed an idle connection (or, against the protocol, written to it
// unprompted): either way the stream cannot carry a new request.
bool connection_is_stale(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

}  // namespace

Result<std::unique_ptr<DaemonClient>> DaemonClient::connect(const std::filesystem::path& socket,
                                                             std::chrono::milliseconds timeout) {
  auto fd = open_socket(socket, Clock::now() + timeout);
  if (!fd.ok()) return fd.status();
  std::unique_ptr<DaemonClient> c(new DaemonClient(*fd, socket, timeout));
  KILN_TRY(c->ping());
  return c;
}

DaemonClient::~DaemonClient() { close_fd(); }

void DaemonClient::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Result<json> DaemonClient::call(const json& request, std::chrono::milliseconds timeout, std::string* blob) {
  const Clock::time_point deadline = Clock::now() + timeout;
  const std::string body = daemon::dump_json(request);
  if (body.size() > daemon::k_max_request_json)
    return invalid_argument("request too large for the kilnd protocol (" + std::to_string(body.size()) + " bytes)");
  daemon::FrameHeader h;
  h.json_len = static_cast<std::uint32_t>(body.size());
  const daemon::HeaderBytes hb = daemon::encode_header(h);
  std::string frame(reinterpret_cast<const char*>(hb.data()), hb.size());
  frame += body;

  for (int attempt = 0;; ++attempt) {
    bool reused = fd_ >= 0;
    if (reused && connection_is_stale(fd_)) {
      close_fd();
      reused = false;
    }
    if (fd_ < 0) {
      auto fd = open_socket(socket_, deadline);
      if (!fd.ok()) return fd.status();
      fd_ = *fd;
    }

    IoError err;
    std::size_t got = 0;
    daemon::HeaderBytes rh{};
    bool sent = send_all(fd_, frame.data(), frame.size(), deadline, &err);
    bool header = sent && recv_all(fd_, reinterpret_cast<char*>(rh.data()), rh.size(), deadline, &err, &got);
    if (!header) {
      close_fd();
      // The daemon closes idle connections: a reused one may have been closed just before we
      // wrote. Nothing of a reply arrived, so the daemon did not serve the request; every op is
      // idempotent, so one retry on a fresh connection is safe.
      if (reused && attempt == 0 && err.peer_gone && got == 0) continue;
      return err.status;
    }

    // From here on any failure leaves the stream out of step: the connection is dropped.
    auto decoded = daemon::decode_header(rh);
    Status framing = decoded.ok() ? daemon::check_limits(*decoded, daemon::FrameKind::reply) : decoded.status();
    if (!framing.ok()) {
      close_fd();
      return io_error("kilnd sent a malformed reply: " + framing.message(), framing.details());
    }
    std::string text(decoded->json_len, '\0');
    std::string payload(decoded->blob_len, '\0');
    if (!recv_all(fd_, text.data(), text.size(), deadline, &err, &got) ||
        !recv_all(fd_, payload.data(), payload.size(), deadline, &err, &got)) {
      close_fd();
      return err.status;
    }
    auto reply = daemon::parse_json(text);
    if (!reply.ok()) {
      close_fd();
      return io_error("kilnd sent a malformed reply: " + reply.status().message(), reply.status().details());
    }
    if (auto f = reply->find("fatal"); f != reply->end() && f->is_boolean() && f->get<bool>())
      close_fd();  // the daemon hangs up after a fatal error
    KILN_TRY(daemon::reply_status(*reply));
    if (blob)
      *blob = std::move(payload);
    else if (!payload.empty())
      return io_error("kilnd sent an unexpected blob of " + std::to_string(payload.size()) + " bytes");
    return std::move(reply).value();
  }
}

Status DaemonClient::ping() {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = call(json{{"op", "ping"}}, timeout_);
  if (!r.ok()) return r.status();
  auto proto = r->find("protocol");
  if (proto == r->end() || !proto->is_number_integer() || proto->get<int>() != daemon::k_protocol_version)
    return unavailable("kilnd speaks a different protocol version", r->dump());
  return {};
}

Result<jit::Artifact> DaemonClient::get_kernel(const KernelSpec& spec, const std::string& arch,
                                               std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string blob;
  const std::string canonical = spec.canonical();
  auto r = call(json{{"op", "get"}, {"spec", canonical}, {"arch", arch}}, timeout, &blob);
  if (!r.ok()) return r.status();

  auto it = r->find("entry");
  if (it == r->end()) return io_error("kilnd's get reply has no entry");
  auto entry = daemon::entry_from_json(*it);
  if (!entry.ok())
    return io_error("kilnd's get reply has a malformed entry: " + entry.status().message());
  jit::Artifact art;
  art.entry = std::move(entry).value();
  art.source = jit::ArtifactSource::cache;
  if (auto src = r->find("source"); src != r->end() && src->is_string()) {
    auto s = daemon::parse_source(src->get<std::string>());
    if (s.ok()) art.source = *s;
  }

  // Integrity before load: the driver accepts a damaged cubin silently, so nothing unverified
  // leaves this function.
  if (static_cast<std::int64_t>(blob.size()) != art.entry.size)
    return corruption("cubin from kilnd has " + std::to_string(blob.size()) + " bytes, metadata says " +
                          std::to_string(art.entry.size),
                      canonical + " @ " + arch);
  const std::string sum = sha256_hex(blob);
  if (sum != art.entry.checksum)
    return corruption("cubin from kilnd fails its checksum", "expected " + art.entry.checksum + ", got " + sum);
  if (art.entry.family != spec.family || art.entry.params != spec.params.canonical() || art.entry.arch != arch)
    return internal_error("kilnd answered with a different kernel",
                          "asked " + canonical + " @ " + arch + ", got " + art.entry.family + "(" +
                              art.entry.params + ") @ " + art.entry.arch);
  art.entry.cubin = std::move(blob);
  return art;
}

Result<PrewarmResult> DaemonClient::prewarm(const std::vector<std::string>& archs,
                                            const std::vector<std::string>& families,
                                            std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = call(json{{"op", "prewarm"}, {"archs", archs}, {"families", families}}, timeout);
  if (!r.ok()) return r.status();
  PrewarmResult out;
  try {
    out.requested = r->value("requested", std::int64_t{0});
    out.compiled = r->value("compiled", std::int64_t{0});
    out.cached = r->value("cached", std::int64_t{0});
    out.remote = r->value("remote", std::int64_t{0});
    out.failed = r->value("failed", std::int64_t{0});
    if (auto e = r->find("errors"); e != r->end() && e->is_array())
      for (const auto& m : *e)
        if (m.is_string()) out.errors.push_back(m.get<std::string>());
  } catch (const json::exception& e) {
    return io_error("kilnd's prewarm reply is malformed", e.what());
  }
  return out;
}

Result<std::vector<cache::Entry>> DaemonClient::list(const cache::ListFilter& filter) {
  std::lock_guard<std::mutex> lock(mu_);
  json req{{"op", "list"}};
  if (!filter.family.empty()) req["family"] = filter.family;
  if (!filter.arch.empty()) req["arch"] = filter.arch;
  auto r = call(req, std::max(timeout_, k_min_query_timeout));
  if (!r.ok()) return r.status();
  auto it = r->find("entries");
  if (it == r->end() || !it->is_array()) return io_error("kilnd's list reply has no entries array");
  std::vector<cache::Entry> out;
  out.reserve(it->size());
  for (const auto& j : *it) {
    auto e = daemon::entry_from_json(j);
    if (!e.ok()) return io_error("kilnd's list reply has a malformed entry: " + e.status().message());
    out.push_back(std::move(e).value());
  }
  return out;
}

Result<json> DaemonClient::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = call(json{{"op", "stats"}}, std::max(timeout_, k_min_query_timeout));
  if (!r.ok()) return r.status();
  json out = std::move(r).value();
  out.erase("ok");
  return out;
}

Result<std::string> DaemonClient::metrics() {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = call(json{{"op", "metrics"}}, std::max(timeout_, k_min_query_timeout));
  if (!r.ok()) return r.status();
  auto text = r->find("text");
  if (text == r->end() || !text->is_string()) return invalid_argument("metrics reply without text");
  return text->get<std::string>();
}

Status same_family_build(const Family& family, const cache::Entry& entry) {
  const PluginInfo* p = family.plugin();
  const std::string plugin = p ? p->name + " " + p->version : "-";
  const std::string hash = p ? p->templates_hash : "-";
  if (entry.family_version == family.version() && entry.key_text.find("\nplugin " + plugin + "\n") != std::string::npos &&
      entry.key_text.find("\nplugin_templates " + hash + "\n") != std::string::npos)
    return {};
  auto line = [&](const std::string& name) {
    const auto at = entry.key_text.find("\n" + name + " ");
    return at == std::string::npos ? std::string("(none)")
                                   : entry.key_text.substr(at + 1, entry.key_text.find('\n', at + 1) - at - 1);
  };
  return unavailable("kilnd serves another build of family '" + std::string(family.name()) + "' (" + line("plugin") +
                     ", " + line("plugin_templates").substr(0, 29) + ", family_version " +
                     std::to_string(entry.family_version) + "; this process: plugin " + plugin + ", templates " +
                     hash.substr(0, 12) + ", family_version " + std::to_string(family.version()) + ")");
}

Status DaemonClient::shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = call(json{{"op", "shutdown"}}, std::max(timeout_, k_min_query_timeout));
  close_fd();  // the daemon hangs up after acknowledging
  return r.ok() ? Status{} : r.status();
}

}  // namespace kiln::client

namespace kiln::client {

Result<Resolved> DaemonClient::resolve(const Family& family, const Problem& problem, const ResolveTarget& target,
                                       jit::AutotuneMode mode, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  json req{{"op", "resolve"},
           {"family", std::string(family.name())},
           {"problem", daemon::problem_to_json(family, problem)},
           {"arch", target.arch},
           {"device_name", target.device_name},
           {"driver_version", target.driver_version},
           {"pci_bus_id", target.pci_bus_id},
           {"autotune", jit::autotune_mode_name(mode)}};
  auto r = call(req, timeout);
  if (!r.ok()) return r.status();
  Resolved out;
  try {
    auto params = Params::parse(r->value("params", std::string()));
    if (!params.ok()) return io_error("kilnd's resolve reply has malformed params: " + params.status().message());
    out.params = std::move(params).value();
    out.tuned = r->value("tuned", false);
    out.queued = r->value("queued", false);
    out.signature = r->value("signature", std::string());
  } catch (const json::exception& e) {
    return io_error("kilnd's resolve reply is malformed", e.what());
  }
  return out;
}

Result<cache::TuningRecord> DaemonClient::tune(const Family& family, const Problem& problem, int device,
                                               const std::string& pci_bus_id, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  json req{{"op", "tune"},
           {"family", std::string(family.name())},
           {"problem", daemon::problem_to_json(family, problem)},
           {"device", device}};
  if (!pci_bus_id.empty()) req["pci_bus_id"] = pci_bus_id;
  auto r = call(req, timeout);
  if (!r.ok()) return r.status();
  auto it = r->find("record");
  if (it == r->end()) return io_error("kilnd's tune reply has no record");
  auto rec = daemon::tuning_record_from_json(*it);
  if (!rec.ok()) return io_error("kilnd's tune reply has a malformed record: " + rec.status().message());
  return std::move(rec).value();
}

}  // namespace kiln::client
