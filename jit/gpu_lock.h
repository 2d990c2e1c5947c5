// The tuner's GPU lock: threads of one process and every kiln process (kilnd, `kiln tune`,
// embedded clients) take the same lock per device, so no two of them time kernels on it at once.
#pragma once

#include <memory>

#include "jit/device_info.h"
#include "kiln/status.h"

namespace kiln::jit {

// Exclusive use of one GPU for timing. Blocks until both the process-wide mutex and the flock on
// runtime_dir()/gpu-<pci bus id>.lock are held; released by the destructor.
class GpuLock {
 public:
  static Result<std::unique_ptr<GpuLock>> acquire(const DeviceInfo& device);
  ~GpuLock();
  GpuLock(const GpuLock&) = delete;
  GpuLock& operator=(const GpuLock&) = delete;

 private:
  GpuLock() = default;
  int fd_ = -1;
};

}  // namespace kiln::jit
