#include "jit/gpu_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>

#include "common/paths.h"

namespace kiln::jit {
namespace {

std::mutex g_gpu_mu;  // the process-wide half of GpuLock

}  // namespace

Result<std::unique_ptr<GpuLock>> GpuLock::acquire(const DeviceInfo& device) {
  const auto dir = runtime_dir();
  KILN_TRY(ensure_private_dir(dir));
  std::string name = "gpu-" + device.pci_bus_id + ".lock";
  std::replace(name.begin(), name.end(), ':', '-');
  const auto path = dir / name;
  std::unique_ptr<GpuLock> lock(new GpuLock);
  g_gpu_mu.lock();
  lock->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock->fd_ < 0) {
    Status s = io_error("cannot open the GPU lock " + path.string() + ": " + std::strerror(errno));
    g_gpu_mu.unlock();
    lock->fd_ = -2;  // nothing to release
    return s;
  }
  int rc;
  do rc = ::flock(lock->fd_, LOCK_EX);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) return io_error("cannot lock " + path.string() + ": " + std::strerror(errno));
  return lock;
}

GpuLock::~GpuLock() {
  if (fd_ == -2) return;
  if (fd_ >= 0) ::close(fd_);  // releases the flock
  g_gpu_mu.unlock();
}

}  // namespace kiln::jit
