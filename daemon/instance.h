// The daemon's claim on its socket path: the directory check, the instance lock, and the bound
// listening socket.
//
// claim() makes the socket's directory private (kiln::ensure_private_dir), takes an exclusive
// flock on "<dir>/<socket stem>.lock" (kilnd.sock -> kilnd.lock) for the daemon's whole life, so
// two daemons started at the same moment cannot both pass the checks, then looks at the socket
// path: a live daemon there means already_running; a stale socket (connection refused) is
// unlinked; anything that is not a socket is left alone and refused. The new socket is bound with
// mode 0600. The destructor removes the socket file only if it is still the one this process
// bound, and releases the lock.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <memory>
#include <string>

#include "kiln/status.h"

namespace kiln::daemon {

struct ClaimError {
  Status status;
  bool already_running = false;  // another daemon holds the socket or the lock
};

class Instance {
 public:
  // On failure the ClaimError says why; nothing on disk that belongs to someone else is touched.
  static std::unique_ptr<Instance> claim(const std::filesystem::path& socket, ClaimError& error);
  ~Instance();
  Instance(const Instance&) = delete;
  Instance& operator=(const Instance&) = delete;

  // The listening socket (non-blocking, close-on-exec). Ownership passes to the caller.
  int release_listen_fd();
  const std::filesystem::path& socket_path() const { return socket_; }
  const std::filesystem::path& lock_path() const { return lock_; }
  // Unlinks the socket file if it is still the inode this process bound. Idempotent.
  void remove_socket();

  // "<dir>/<stem>.lock" for a socket path.
  static std::filesystem::path lock_path_for(const std::filesystem::path& socket);

 private:
  Instance() = default;

  std::filesystem::path socket_;
  std::filesystem::path lock_;
  int lock_fd_ = -1;
  int listen_fd_ = -1;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  bool bound_ = false;
};

}  // namespace kiln::daemon
