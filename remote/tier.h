// The remote cache tier: signed records in a Redis server that a fleet of hosts shares.
//
// The builder asks the tier after a local cache miss and before compiling (get_entry), and hands
// it what it compiled (put_entry). A read waits at most Config::read_timeout, connecting
// included; write-backs are queued and sent by a thread of the tier's own, so neither ever holds
// a launch for long. Every record is verified (remote/signed.h) before it is returned: one that
// fails is never handed out, is counted as rejected and logged, and the caller compiles instead.
//
// Failures (refused connections, timeouts, malformed replies) put the tier into back-off: it is
// skipped (local only, counted) for Config::backoff_initial, doubling up to backoff_max while the
// server keeps failing; after each interval one request probes it, and the first success makes it
// used again. Nothing connects before the first request. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cache/store.h"
#include "kiln/status.h"
#include "remote/config.h"
#include "remote/resp.h"

namespace kiln::remote {

struct Counters {
  std::int64_t lookups = 0;         // reads the server answered (hit or miss)
  std::int64_t hits = 0;            // reads that returned a verified record
  std::int64_t misses = 0;          // reads the server had nothing for
  std::int64_t rejected = 0;        // records that failed verification (never returned)
  std::int64_t timeouts = 0;        // reads or writes past their deadline
  std::int64_t errors = 0;          // refused or broken connections, malformed or error replies
  std::int64_t skipped = 0;         // reads not sent because the tier was backing off
  std::int64_t writes = 0;          // records stored
  std::int64_t write_errors = 0;    // writes that failed (not counting `full`)
  std::int64_t writes_dropped = 0;  // writes not sent: queue full, backing off, or stopped
  std::int64_t full = 0;            // writes the server refused for want of memory
  std::int64_t connects = 0;        // connections opened
  std::int64_t outages = 0;         // times the tier went local-only
  std::int64_t pending_writes = 0;  // queued now
  std::int64_t tls_errors = 0;      // failed TLS handshakes or sessions (counted in errors too)
  bool up = true;                   // false while backing off
};

class Tier {
 public:
  // Starts the writer thread; no connection is made yet.
  static std::unique_ptr<Tier> create(Config config);
  // Waits up to two seconds for queued writes, then drops the rest (counted).
  ~Tier();
  Tier(const Tier&) = delete;
  Tier& operator=(const Tier&) = delete;

  // The verified entry for `key`, or nullopt: not there, rejected, or the server did not answer.
  std::optional<cache::Entry> get_entry(const std::string& key, const cache::Expected& expected);
  // Queues the entry's write-back.
  void put_entry(const cache::Entry& e);

  // Any signed record by name (tuning rows): the verified payload, or nullopt as for get_entry.
  std::optional<std::string> get_record(const std::string& name);
  void put_record(const std::string& name, const std::string& payload);

  // Waits until every queued write was sent (or failed). False when `within` passed first.
  bool flush(std::chrono::milliseconds within);

  Counters counters() const;
  const Config& config() const { return config_; }
  std::string describe() const { return config_.endpoint.describe(); }

 private:
  explicit Tier(Config config);
  // The raw value stored under `name`: nullopt when absent or the server failed (counted).
  std::optional<std::string> fetch(const std::string& name);
  // A pooled connection (reused = true) unless `fresh`, else a new one; null with `error` set.
  std::unique_ptr<Connection> take_connection(Clock::time_point deadline, Status& error, bool& reused,
                                              bool fresh = false);
  void give_back(std::unique_ptr<Connection> c);
  // True when a request may go to the server now; false while backing off.
  bool admit();
  void failed(const Status& s);
  // A request sent at `sent` was answered. One sent before the last failure says nothing about
  // the server now, so it does not end a back-off.
  void succeeded(Clock::time_point sent);
  void write_loop();
  void enqueue(std::string name, std::string sealed);

  const Config config_;
  mutable std::mutex mu_;  // counters_, the back-off state and idle_
  Counters counters_;
  Clock::time_point retry_at_{};
  Clock::time_point failed_at_{};  // the last failure
  std::chrono::milliseconds backoff_;
  std::vector<std::unique_ptr<Connection>> idle_;

  mutable std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::pair<std::string, std::string>> queue_;
  bool writing_ = false;
  bool stop_ = false;
  std::thread writer_;
};

}  // namespace kiln::remote
