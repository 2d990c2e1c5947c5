// The properties of a CUDA device that kiln reads from the driver, in one place.
//
// Each device is read once per process through the dlopen'ed driver (jit/driver.h); after that a
// lookup is one atomic load, so the typed ops may ask on every launch. The entries live until the
// process exits, so the pointers handed out stay valid. A failed read is not remembered: the next
// call asks the driver again. Thread-safe.
#pragma once

#include <cstddef>
#include <string>

#include "kiln/problem.h"
#include "kiln/status.h"

namespace kiln::jit {

struct DeviceInfo {
  int ordinal = 0;
  std::string arch;            // "sm_90a"
  std::string name;            // "NVIDIA H100 80GB HBM3"
  std::string driver_version;  // "580.65.06 cuda 13000"
  std::string pci_bus_id;      // "0000:1b:00"
  std::size_t l2_bytes = 0;
  int sm_count = 0;
  int major = 0;               // compute capability
  int minor = 0;
  int compute_capability = 0;  // major * 10 + minor
  int max_shared_optin = 0;    // dynamic shared memory one block may opt into, in bytes
  bool cluster_launch = false; // thread block clusters; false when the driver does not know the attribute
};

// Writes the device facts a problem carries (kiln/problem.h) from `d`.
inline void set_device(Problem& p, const DeviceInfo& d) {
  p.cc = std::uint8_t(d.compute_capability);
  p.sm_count = std::uint16_t(d.sm_count);
}

// Device `ordinal`'s properties. Errors: a negative ordinal (device_error), no driver, a device
// the driver does not know.
Result<const DeviceInfo*> device_info(int ordinal);
// The ordinal of the device with this PCI bus id (as device_info reports it).
Result<int> device_by_pci(const std::string& pci_bus_id);

}  // namespace kiln::jit
