#include "jit/device_info.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include "jit/driver.h"
#include "kiln/spec.h"

namespace kiln::jit {
namespace {

// The NVIDIA kernel module's version ("580.65.06"): cuDriverGetVersion alone does not change
// between driver releases of one CUDA version, and those can change code generation in the JIT.
std::string kernel_module_version() {
  std::ifstream f("/proc/driver/nvidia/version");
  std::string line;
  if (!std::getline(f, line)) return "unknown";
  std::istringstream words(line);
  std::string w, prev;
  while (words >> w) {
    if (prev == "Module" && !w.empty() && std::isdigit(static_cast<unsigned char>(w[0]))) return w;
    prev = w;
  }
  return "unknown";
}

Result<DeviceInfo> read_device(int ordinal) {
  KILN_ASSIGN_OR_RETURN(const Driver* d, Driver::get());
  CUdevice dev;
  KILN_TRY(d->check(d->device_get(&dev, ordinal), "cuDeviceGet"));
  DeviceInfo info;
  info.ordinal = ordinal;
  auto attr = [&](CUdevice_attribute a, int& out) {
    return d->check(d->device_get_attribute(&out, a, dev), "cuDeviceGetAttribute");
  };
  int domain = 0, bus = 0, slot = 0, l2 = 0;
  KILN_TRY(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, info.major));
  KILN_TRY(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, info.minor));
  KILN_TRY(attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, info.sm_count));
  KILN_TRY(attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, info.max_shared_optin));
  KILN_TRY(attr(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, domain));
  KILN_TRY(attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, bus));
  KILN_TRY(attr(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, slot));
  KILN_TRY(attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, l2));
  // Older drivers do not know the attribute: no clusters then.
  int cluster_launch = 0;
  if (d->device_get_attribute(&cluster_launch, CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH, dev) != CUDA_SUCCESS)
    cluster_launch = 0;
  info.cluster_launch = cluster_launch != 0;
  info.compute_capability = info.major * 10 + info.minor;
  info.arch = arch_for_capability(info.major, info.minor);
  char name[256] = {};
  KILN_TRY(d->check(d->device_get_name(name, sizeof name - 1, dev), "cuDeviceGetName"));
  info.name = name;
  int cuda_version = 0;
  KILN_TRY(d->check(d->driver_get_version(&cuda_version), "cuDriverGetVersion"));
  info.driver_version = kernel_module_version() + " cuda " + std::to_string(cuda_version);
  char pci[32];
  std::snprintf(pci, sizeof pci, "%04x:%02x:%02x", domain, bus, slot);
  info.pci_bus_id = pci;
  info.l2_bytes = std::size_t(std::max(l2, 0));
  return info;
}

// The lock-free table covers the ordinals a machine has in practice; the map owns every entry and
// serves the rest under the mutex.
constexpr int k_fast_devices = 64;
std::array<std::atomic<const DeviceInfo*>, k_fast_devices> g_fast{};
std::mutex g_mu;
std::map<int, std::unique_ptr<const DeviceInfo>> g_devices;

}  // namespace

Result<const DeviceInfo*> device_info(int ordinal) {
  if (ordinal < 0) return device_error("negative device ordinal");
  if (ordinal < k_fast_devices)
    if (const DeviceInfo* known = g_fast[ordinal].load(std::memory_order_acquire)) return known;
  std::lock_guard lock(g_mu);
  if (auto it = g_devices.find(ordinal); it != g_devices.end()) return it->second.get();
  KILN_ASSIGN_OR_RETURN(DeviceInfo info, read_device(ordinal));
  const DeviceInfo* entry =
      g_devices.emplace(ordinal, std::make_unique<const DeviceInfo>(std::move(info))).first->second.get();
  if (ordinal < k_fast_devices) g_fast[ordinal].store(entry, std::memory_order_release);
  return entry;
}

Result<int> device_by_pci(const std::string& pci_bus_id) {
  KILN_ASSIGN_OR_RETURN(const Driver* d, Driver::get());
  int count = 0;
  KILN_TRY(d->check(d->device_get_count(&count), "cuDeviceGetCount"));
  for (int i = 0; i < count; ++i) {
    auto info = device_info(i);
    if (info.ok() && (*info)->pci_bus_id == pci_bus_id) return i;
  }
  return not_found("no CUDA device with PCI bus id " + pci_bus_id);
}

}  // namespace kiln::jit
