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
//
// Compile coordination: after a miss, claim() takes a short-lived lock for the key in Redis
// (SET NX PX with a random token). The host that gets it compiles; the others wait, asking for
// the record every Config::lock_poll, at most Config::lock_wait, and compile themselves when the
// wait runs out or the lock goes away without a record (its holder failed, or died and the lock
// expired: then one of them takes it). The holder's lock is released (compare-and-delete: only
// its own token) right after its write-back lands, or at once when it compiled nothing.
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
  std::int64_t locks_won = 0;       // compile locks taken: this host compiled for the fleet
  std::int64_t locks_waited = 0;    // claims that found another host's lock and waited
  std::int64_t lock_wait_hits = 0;  // waits that ended with the other host's record (counted in hits)
  std::int64_t lock_timeouts = 0;   // waits that ran out: compiled here
  bool up = true;                   // false while backing off
};

class Tier;

// This host's lock on compiling one key for the fleet (Tier::claim). Move-only. Handed to
// Tier::put_entry with the compiled entry, it is released after the write-back; destroyed
// otherwise (no entry to share), it is released at once so that waiting hosts stop waiting.
class CompileLock {
 public:
  CompileLock() = default;
  CompileLock(CompileLock&& o) noexcept { *this = std::move(o); }
  CompileLock& operator=(CompileLock&& o) noexcept;
  ~CompileLock();
  bool held() const { return tier_ != nullptr; }

 private:
  friend class Tier;
  Tier* tier_ = nullptr;
  std::string name_;   // the lock's Redis key
  std::string token_;  // this holder's random value
};

struct Claim {
  std::optional<cache::Entry> entry;  // another host compiled it meanwhile (verified): use this
  CompileLock lock;                   // otherwise compile; held when this host took the lock
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
  // Queues the entry's write-back; `lock`, if held, is released once the record is written.
  void put_entry(const cache::Entry& e, CompileLock lock = {});

  // After get_entry missed `key`: the lock to compile it (or none: coordination is off, the
  // server failed, or a wait ran out), or the entry another host compiled while this one waited.
  // Waits at most Config::lock_wait, plus one read timeout.
  Claim claim(const std::string& key, const cache::Expected& expected);

  // Any signed record by name (tuning rows): the verified payload, or nullopt as for get_entry.
  std::optional<std::string> get_record(const std::string& name);
  void put_record(const std::string& name, const std::string& payload);

  // Waits until every queued write was sent (or failed). False when `within` passed first.
  bool flush(std::chrono::milliseconds within);

  Counters counters() const;
  const Config& config() const { return config_; }
  std::string describe() const { return config_.endpoint.describe(); }

 private:
  friend class CompileLock;
  // One queued write: a record to SET, a lock to release after it, or both.
  struct Write {
    std::string name, sealed;  // name empty: none
    std::string lock_name, token;  // lock_name empty: none
  };

  explicit Tier(Config config);
  // One command on a pooled connection under the read timeout; nullopt when the tier is backing
  // off (`skipped` set) or the server failed (counted, back-off begun).
  std::optional<Reply> round_trip(const std::vector<std::string_view>& args, bool& skipped);
  // The raw value stored under `name`: nullopt when absent or the server failed (counted).
  std::optional<std::string> fetch(const std::string& name);
  // Verifies a kernel record; counts and logs a rejected one unless told not to.
  std::optional<cache::Entry> open_checked(const std::string& key, const std::string& raw,
                                           const cache::Expected& expected, bool count_rejected = true);
  void release(CompileLock& lock);
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
  // Sends one queued write on `conn` (opened or reopened as needed).
  void send_write(const Write& w, std::unique_ptr<Connection>& conn);
  void enqueue(Write w);

  const Config config_;
  mutable std::mutex mu_;  // counters_, the back-off state and idle_
  Counters counters_;
  Clock::time_point retry_at_{};
  Clock::time_point failed_at_{};  // the last failure
  std::chrono::milliseconds backoff_;
  std::vector<std::unique_ptr<Connection>> idle_;
  bool warned_release_ = false;

  mutable std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Write> queue_;
  bool writing_ = false;
  bool stop_ = false;
  std::thread writer_;
};

}  // namespace kiln::remote
