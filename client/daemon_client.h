// A connection to kilnd over its Unix socket (protocol: docs/protocol.md).
//
// One request at a time per DaemonClient (calls are serialized by a mutex). Every call has a
// deadline; a dead or wedged daemon is Code::unavailable or Code::timeout, never a hang.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache/store.h"
#include "cache/tuning.h"
#include "jit/autotune_mode.h"
#include "jit/builder.h"
#include "kiln/family.h"
#include "kiln/spec.h"
#include "kiln/status.h"

namespace kiln::client {

struct PrewarmResult {
  std::int64_t requested = 0;
  std::int64_t compiled = 0;
  std::int64_t cached = 0;
  std::int64_t remote = 0;  // from the remote tier (daemons that have one)
  std::int64_t failed = 0;
  std::vector<std::string> errors;  // "spec @ arch: message", one per failure
};

// The device a resolve is for, as the client's driver reports it.
struct ResolveTarget {
  std::string arch;
  std::string device_name;
  std::string driver_version;
  std::string pci_bus_id;  // lets kilnd tune on the same physical GPU
};

struct Resolved {
  Params params;
  bool tuned = false;   // params are a tuning winner (else the heuristic's choice)
  bool queued = false;  // kilnd queued background tuning for this signature
  std::string signature;
};

class DaemonClient {
 public:
  // Connects and exchanges a ping. Code::unavailable when nothing listens on `socket`.
  static Result<std::unique_ptr<DaemonClient>> connect(
      const std::filesystem::path& socket,
      std::chrono::milliseconds timeout = std::chrono::milliseconds(2000));
  ~DaemonClient();

  Status ping();
  // The cubin and metadata for spec on arch; the daemon compiles on a miss (single-flight).
  Result<jit::Artifact> get_kernel(const KernelSpec& spec, const std::string& arch,
                                   std::chrono::milliseconds timeout = std::chrono::seconds(120));
  // Compiles every catalog variant of `families` (empty: all) for each arch.
  Result<PrewarmResult> prewarm(const std::vector<std::string>& archs,
                                const std::vector<std::string>& families,
                                std::chrono::milliseconds timeout = std::chrono::minutes(30));
  Result<std::vector<cache::Entry>> list(const cache::ListFilter& filter);
  // The variant to run for a problem (docs/autotune.md): the tuned winner for the problem's
  // signature on this setup, else the heuristic's choice (and, with mode background, tuning queued
  // in kilnd; with mode wait, kilnd tunes before answering).
  Result<Resolved> resolve(const Family& family, const Problem& problem, const ResolveTarget& target,
                           jit::AutotuneMode mode, std::chrono::milliseconds timeout = std::chrono::minutes(2));
  // Tunes a problem now on the daemon's device `device` (ordinal, or pci_bus_id when not empty).
  Result<cache::TuningRecord> tune(const Family& family, const Problem& problem, int device,
                                   const std::string& pci_bus_id = {},
                                   std::chrono::milliseconds timeout = std::chrono::minutes(10));
  // Daemon stats as JSON: {"daemon": {...}, "builder": {...}, "cache": {...}}.
  Result<nlohmann::json> stats();
  // The daemon's counters in the Prometheus text format.
  Result<std::string> metrics();
  // Asks the daemon to stop; returns once it has acknowledged.
  Status shutdown();

 private:
  DaemonClient(int fd, std::filesystem::path socket, std::chrono::milliseconds timeout)
      : fd_(fd), socket_(std::move(socket)), timeout_(timeout) {}
  // One request/reply exchange under `timeout`; `blob` receives the reply's blob. Transparently
  // reconnects (once) when the daemon had closed this connection while it was idle.
  Result<nlohmann::json> call(const nlohmann::json& request, std::chrono::milliseconds timeout,
                              std::string* blob = nullptr);
  void close_fd();

  int fd_;  // -1 once the connection is broken; the next call reconnects
  std::filesystem::path socket_;
  std::chrono::milliseconds timeout_;  // for the quick ops (ping, list, stats, shutdown)
  std::mutex mu_;
};

// ok when `entry`, served by kilnd, was built from this process's build of `family`: the same
// family version, and the same plugin name, version and template hash in its key. kilnd loads its
// plugins from its own environment, so the two can differ; a kernel of another build must not be
// launched with this build's geometry and arguments. Code::unavailable says what differs.
Status same_family_build(const Family& family, const cache::Entry& entry);

}  // namespace kiln::client
