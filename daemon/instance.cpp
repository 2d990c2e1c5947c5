#include "daemon/instance.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "client/daemon_client.h"
#include "common/paths.h"

namespace kiln::daemon {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

Status fill_address(const std::filesystem::path& path, sockaddr_un& addr) {
  std::memset(&addr, 0, sizeof addr);
  addr.sun_family = AF_UNIX;
  const std::string& s = path.native();
  if (s.size() >= sizeof addr.sun_path)
    return invalid_argument("socket path is too long (" + std::to_string(s.size()) + " bytes; the limit is " +
                                std::to_string(sizeof addr.sun_path - 1) + ")",
                            s);
  std::memcpy(addr.sun_path, s.data(), s.size());
  return {};
}

enum class Probe { live, stale, error };

// Connects to an existing socket file to tell a live daemon from a leftover of a dead one.
Probe probe_socket(const std::filesystem::path& path, int& err) {
  sockaddr_un addr{};
  if (!fill_address(path, addr).ok()) return Probe::error;
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    err = errno;
    return Probe::error;
  }
  int rc;
  do rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  while (rc != 0 && errno == EINTR);
  err = rc == 0 ? 0 : errno;
  ::close(fd);
  if (rc == 0) return Probe::live;
  // A full listen backlog (EAGAIN) also means someone is listening.
  if (err == EAGAIN) return Probe::live;
  if (err == ECONNREFUSED) return Probe::stale;
  return Probe::error;
}

// "pid 1234, version 0.1.0" when a daemon answers a ping; empty otherwise.
std::string describe_live_daemon(const std::filesystem::path& path) {
  auto c = client::DaemonClient::connect(path, std::chrono::milliseconds(1000));
  if (!c.ok()) return {};
  auto st = (*c)->stats();
  if (!st.ok()) return {};
  try {
    const auto& d = (*st)["daemon"];
    return "pid " + std::to_string(d.value("pid", 0)) + ", version " + d.value("version", std::string("?"));
  } catch (...) {
    return {};
  }
}

}  // namespace

std::filesystem::path Instance::lock_path_for(const std::filesystem::path& socket) {
  std::filesystem::path lock = socket;
  // Never let the lock file and the socket be the same path.
  if (socket.extension() == ".lock")
    lock += ".lock";
  else
    lock.replace_extension(".lock");
  return lock;
}

std::unique_ptr<Instance> Instance::claim(const std::filesystem::path& socket, ClaimError& error) {
  error = {};
  std::unique_ptr<Instance> inst(new Instance());
  inst->socket_ = socket;
  inst->lock_ = lock_path_for(socket);

  sockaddr_un addr{};
  if (Status s = fill_address(socket, addr); !s.ok()) {
    error.status = s;
    return nullptr;
  }
  const std::filesystem::path dir = socket.has_parent_path() ? socket.parent_path() : std::filesystem::path(".");
  if (Status s = ensure_private_dir(dir); !s.ok()) {
    error.status = Status(s.code(), "refusing to use socket directory: " + s.message(), s.details());
    return nullptr;
  }

  inst->lock_fd_ = ::open(inst->lock_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (inst->lock_fd_ < 0) {
    error.status = io_error("cannot open lock file " + inst->lock_.string() + ": " + errno_text(errno));
    return nullptr;
  }
  if (::flock(inst->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    if (err == EWOULDBLOCK) {
      error.already_running = true;
      std::string who = describe_live_daemon(socket);
      error.status = unavailable(
          who.empty() ? "another kilnd holds " + inst->lock_.string() + " (it is starting or stopping)"
                      : "kilnd is already running on " + socket.string() + " (" + who + ")");
    } else {
      error.status = io_error("cannot lock " + inst->lock_.string() + ": " + errno_text(err));
    }
    return nullptr;
  }

  // Holding the lock, no other kilnd is between its checks and its bind: what is at the socket
  // path now is either a daemon that does not use the lock (live) or a leftover (stale).
  struct stat st {};
  if (::lstat(socket.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      error.status = io_error(socket.string() + " exists and is not a socket; refusing to replace it");
      return nullptr;
    }
    int err = 0;
    switch (probe_socket(socket, err)) {
      case Probe::live: {
        error.already_running = true;
        std::string who = describe_live_daemon(socket);
        error.status = unavailable("kilnd is already running on " + socket.string() +
                                   (who.empty() ? std::string() : " (" + who + ")"));
        return nullptr;
      }
      case Probe::stale:
        if (::unlink(socket.c_str()) != 0 && errno != ENOENT) {
          error.status = io_error("cannot remove stale socket " + socket.string() + ": " + errno_text(errno));
          return nullptr;
        }
        break;
      case Probe::error:
        if (err == ENOENT) break;  // vanished meanwhile
        error.status = io_error("cannot tell whether " + socket.string() + " is in use: " + errno_text(err));
        return nullptr;
    }
  } else if (errno != ENOENT) {
    error.status = io_error("cannot stat " + socket.string() + ": " + errno_text(errno));
    return nullptr;
  }

  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    error.status = io_error(std::string("socket(): ") + errno_text(errno));
    return nullptr;
  }
  // The umask makes the socket 0600 from the moment it exists; the chmod below is belt and braces
  // for file systems that ignore the umask on sockets.
  mode_t old_mask = ::umask(0177);
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  int bind_err = errno;
  ::umask(old_mask);
  if (rc != 0) {
    ::close(fd);
    error.status = io_error("cannot bind " + socket.string() + ": " + errno_text(bind_err));
    return nullptr;
  }
  inst->bound_ = true;
  if (::lstat(socket.c_str(), &st) == 0) {
    inst->dev_ = st.st_dev;
    inst->ino_ = st.st_ino;
  }
  if (::chmod(socket.c_str(), 0600) != 0 || ::listen(fd, 128) != 0) {
    int err = errno;
    ::close(fd);
    inst->remove_socket();
    error.status = io_error("cannot set up " + socket.string() + ": " + errno_text(err));
    return nullptr;
  }
  inst->listen_fd_ = fd;

  // The pid in the lock file is for people reading it; the lock itself is the flock.
  if (::ftruncate(inst->lock_fd_, 0) == 0) {
    std::string pid = std::to_string(::getpid()) + "\n";
    (void)!::pwrite(inst->lock_fd_, pid.data(), pid.size(), 0);
  }
  return inst;
}

Instance::~Instance() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
  remove_socket();
  // The lock file stays: unlinking a flock'ed file lets a waiter lock an inode nobody else sees.
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

int Instance::release_listen_fd() {
  int fd = listen_fd_;
  listen_fd_ = -1;
  return fd;
}

void Instance::remove_socket() {
  if (!bound_) return;
  bound_ = false;
  struct stat st {};
  if (::lstat(socket_.c_str(), &st) != 0) return;
  // Someone may have replaced the file (a second daemon after ours was declared dead): not ours.
  if (st.st_dev != dev_ || st.st_ino != ino_) return;
  ::unlink(socket_.c_str());
}

}  // namespace kiln::daemon
