#include "remote/tier.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <random>

#include "remote/signed.h"
#include "remote/tls.h"

namespace kiln::remote {
namespace {

constexpr std::size_t k_max_idle = 8;
constexpr auto k_drain_at_exit = std::chrono::seconds(2);

std::string short_key(const std::string& key) { return key.substr(0, std::min<std::size_t>(12, key.size())); }

std::string ms_text(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

// Deletes the lock only while it still holds this holder's token: a lock that expired and was
// taken by another host is not this host's to release.
constexpr const char* k_release_script =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

std::string random_token() {
  unsigned char b[16];
  std::size_t got = 0;
  while (got < sizeof b) {
    const ssize_t n = ::getrandom(b + got, sizeof b - got, 0);
    if (n > 0) got += std::size_t(n);
    else if (n < 0 && errno != EINTR) break;
  }
  if (got < sizeof b) {
    std::random_device rd;
    for (; got < sizeof b; ++got) b[got] = static_cast<unsigned char>(rd());
  }
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : b) {
    out += d[c >> 4];
    out += d[c & 15];
  }
  return out;
}

}  // namespace

std::unique_ptr<Tier> Tier::create(Config config) {
  std::unique_ptr<Tier> t(new Tier(std::move(config)));
  t->writer_ = std::thread([p = t.get()] { p->write_loop(); });
  return t;
}

Tier::Tier(Config config) : config_(std::move(config)), backoff_(config_.backoff_initial) {}

Tier::~Tier() {
  if (!flush(k_drain_at_exit)) {
    std::lock_guard lock(queue_mu_);
    if (!queue_.empty())
      std::fprintf(stderr, "kiln: remote: %zu write-back(s) to %s not sent before exit\n", queue_.size(),
                   describe().c_str());
  }
  {
    std::lock_guard lock(queue_mu_);
    stop_ = true;
    std::lock_guard clock(mu_);
    counters_.writes_dropped += std::int64_t(queue_.size());
    queue_.clear();
  }
  queue_cv_.notify_all();
  writer_.join();
}

Counters Tier::counters() const {
  Counters c;
  {
    std::lock_guard lock(mu_);
    c = counters_;
  }
  std::lock_guard lock(queue_mu_);
  c.pending_writes = std::int64_t(queue_.size()) + (writing_ ? 1 : 0);
  return c;
}

bool Tier::admit() {
  std::lock_guard lock(mu_);
  if (counters_.up) return true;
  const auto now = Clock::now();
  if (now < retry_at_) return false;
  // This request probes the server; the others stay local until it answers or fails.
  retry_at_ = now + backoff_;
  return true;
}

void Tier::failed(const Status& s) {
  std::lock_guard lock(mu_);
  if (s.code() == Code::timeout) ++counters_.timeouts;
  else ++counters_.errors;
  if (is_tls_failure(s)) ++counters_.tls_errors;
  const bool was_up = counters_.up;
  if (!was_up) backoff_ = std::min(backoff_ * 2, config_.backoff_max);
  counters_.up = false;
  failed_at_ = Clock::now();
  retry_at_ = failed_at_ + backoff_;
  idle_.clear();
  if (was_up) {
    ++counters_.outages;
    std::fprintf(stderr, "kiln: remote: %s failed (%s); local cache only, retrying after %s\n", describe().c_str(),
                 s.message().c_str(), ms_text(backoff_).c_str());
  }
}

void Tier::succeeded(Clock::time_point sent) {
  std::lock_guard lock(mu_);
  if (!counters_.up && sent <= failed_at_) return;
  if (!counters_.up) std::fprintf(stderr, "kiln: remote: %s answers again\n", describe().c_str());
  counters_.up = true;
  backoff_ = config_.backoff_initial;
}

std::unique_ptr<Connection> Tier::take_connection(Clock::time_point deadline, Status& error, bool& reused,
                                                  bool fresh) {
  reused = false;
  if (!fresh) {
    std::lock_guard lock(mu_);
    if (!idle_.empty()) {
      auto c = std::move(idle_.back());
      idle_.pop_back();
      reused = true;
      return c;
    }
  }
  auto c = Connection::open(config_, deadline);
  if (!c.ok()) {
    error = c.status();
    return nullptr;
  }
  std::lock_guard lock(mu_);
  ++counters_.connects;
  return std::move(c).value();
}

void Tier::give_back(std::unique_ptr<Connection> c) {
  std::lock_guard lock(mu_);
  if (idle_.size() < k_max_idle) idle_.push_back(std::move(c));
}

std::optional<Reply> Tier::round_trip(const std::vector<std::string_view>& args, bool& skipped) {
  skipped = false;
  if (!admit()) {
    skipped = true;
    return std::nullopt;
  }
  const auto sent = Clock::now();
  const auto deadline = sent + config_.read_timeout;
  Status error;
  bool reused = false;
  auto c = take_connection(deadline, error, reused);
  if (!c) {
    failed(error);
    return std::nullopt;
  }
  auto r = c->command(args, deadline);
  // A pooled connection may have been closed by the server since (a restart, an idle timeout):
  // that is not the server failing now, so it gets one fresh connection.
  if (!r.ok() && reused && r.status().code() == Code::unavailable) {
    c = take_connection(deadline, error, reused, /*fresh=*/true);
    if (!c) {
      failed(error);
      return std::nullopt;
    }
    r = c->command(args, deadline);
  }
  if (!r.ok()) {
    failed(r.status());
    return std::nullopt;
  }
  give_back(std::move(c));
  if (r->is_error()) {
    failed(unavailable(std::string(args.front()) + " answered " + r->text));
    return std::nullopt;
  }
  succeeded(sent);
  return std::move(r).value();
}

std::optional<std::string> Tier::fetch(const std::string& name) {
  bool skipped = false;
  auto r = round_trip({"GET", config_.key_prefix + name}, skipped);
  if (r && r->type != Reply::Type::bulk && r->type != Reply::Type::nil) {
    failed(unavailable("GET answered an unexpected reply"));
    return std::nullopt;
  }
  std::lock_guard lock(mu_);
  if (skipped) ++counters_.skipped;
  if (!r) return std::nullopt;
  ++counters_.lookups;
  if (r->type == Reply::Type::nil) {
    ++counters_.misses;
    return std::nullopt;
  }
  return std::move(r->text);
}

std::optional<cache::Entry> Tier::open_checked(const std::string& key, const std::string& raw,
                                               const cache::Expected& expected, bool count_rejected) {
  auto e = open_entry(config_.fleet_key, key, raw, expected);
  std::lock_guard lock(mu_);
  if (!e.ok()) {
    if (!count_rejected) return std::nullopt;
    ++counters_.rejected;
    std::fprintf(stderr, "kiln: remote: rejected the entry for key %s from %s (%s%s%s); compiling it locally\n",
                 short_key(key).c_str(), describe().c_str(), e.status().message().c_str(),
                 e.status().details().empty() ? "" : ": ", e.status().details().c_str());
    return std::nullopt;
  }
  ++counters_.hits;
  return std::move(e).value();
}

std::optional<cache::Entry> Tier::get_entry(const std::string& key, const cache::Expected& expected) {
  auto raw = fetch(entry_name(key));
  if (!raw) return std::nullopt;
  return open_checked(key, *raw, expected);
}

Claim Tier::claim(const std::string& key, const cache::Expected& expected) {
  Claim out;
  if (config_.lock_ttl.count() <= 0) return out;
  const std::string record = config_.key_prefix + entry_name(key);
  const std::string lock_name = config_.key_prefix + "l/" + key;
  const std::string token = random_token();
  const std::string ttl = std::to_string(config_.lock_ttl.count());
  const auto wait_until = Clock::now() + config_.lock_wait;
  bool waited = false;
  bool skipped = false;
  for (;;) {
    auto r = round_trip({"SET", lock_name, token, "NX", "PX", ttl}, skipped);
    if (!r) return out;
    if (r->type != Reply::Type::status && r->type != Reply::Type::nil) {
      failed(unavailable("SET NX answered an unexpected reply"));
      return out;
    }
    if (r->type == Reply::Type::status) {
      out.lock.tier_ = this;
      out.lock.name_ = lock_name;
      out.lock.token_ = token;
      {
        std::lock_guard lock(mu_);
        ++counters_.locks_won;
      }
      // The record may have landed (and its lock gone) between the caller's miss and this lock.
      // One the caller's lookup just rejected is not counted again.
      auto again = round_trip({"GET", record}, skipped);
      if (again && again->type == Reply::Type::bulk) {
        out.entry = open_checked(key, again->text, expected, /*count_rejected=*/false);
        if (out.entry) release(out.lock);
      }
      return out;
    }
    // Another host holds the lock: wait for its record, or for the lock to go.
    if (!waited) {
      waited = true;
      std::lock_guard lock(mu_);
      ++counters_.locks_waited;
    }
    for (;;) {
      if (Clock::now() + config_.lock_poll > wait_until) {
        std::lock_guard lock(mu_);
        ++counters_.lock_timeouts;
        std::fprintf(stderr, "kiln: remote: waited %s for another host to compile key %s; compiling it here\n",
                     ms_text(config_.lock_wait).c_str(), short_key(key).c_str());
        return out;
      }
      std::this_thread::sleep_for(config_.lock_poll);
      auto m = round_trip({"MGET", record, lock_name}, skipped);
      if (!m) return out;
      if (m->type != Reply::Type::array || m->elements.size() != 2) {
        failed(unavailable("MGET answered an unexpected reply"));
        return out;
      }
      if (m->elements[0].type == Reply::Type::bulk) {
        out.entry = open_checked(key, m->elements[0].text, expected);
        if (out.entry) {
          std::lock_guard lock(mu_);
          ++counters_.lock_wait_hits;
        }
        return out;
      }
      if (m->elements[1].type == Reply::Type::nil) break;  // released or expired without a record
    }
  }
}

std::optional<std::string> Tier::get_record(const std::string& name) {
  auto raw = fetch(name);
  if (!raw) return std::nullopt;
  auto p = unseal(config_.fleet_key, name, *raw);
  std::lock_guard lock(mu_);
  if (!p.ok()) {
    ++counters_.rejected;
    std::fprintf(stderr, "kiln: remote: rejected record %s from %s (%s)\n", name.c_str(), describe().c_str(),
                 p.status().message().c_str());
    return std::nullopt;
  }
  ++counters_.hits;
  return std::string(*p);
}

void Tier::put_entry(const cache::Entry& e, CompileLock lock) {
  Write w{entry_name(e.key), seal_entry(config_.fleet_key, e), {}, {}};
  if (lock.held()) {
    w.lock_name = std::move(lock.name_);
    w.token = std::move(lock.token_);
    lock.tier_ = nullptr;
  }
  enqueue(std::move(w));
}

void Tier::put_record(const std::string& name, const std::string& payload) {
  enqueue(Write{name, seal(config_.fleet_key, name, payload), {}, {}});
}

void Tier::release(CompileLock& lock) {
  if (!lock.held()) return;
  enqueue(Write{{}, {}, std::move(lock.name_), std::move(lock.token_)});
  lock.tier_ = nullptr;
}

CompileLock& CompileLock::operator=(CompileLock&& o) noexcept {
  if (this != &o) {
    if (tier_) tier_->release(*this);
    tier_ = o.tier_;
    name_ = std::move(o.name_);
    token_ = std::move(o.token_);
    o.tier_ = nullptr;
  }
  return *this;
}

CompileLock::~CompileLock() {
  if (tier_) tier_->release(*this);
}

void Tier::enqueue(Write w) {
  {
    std::lock_guard lock(queue_mu_);
    if (!stop_) {
      if (queue_.size() < config_.max_pending_writes) {
        queue_.push_back(std::move(w));
        queue_cv_.notify_all();
        return;
      }
      // A full queue drops the record, never a lock's release: waiting hosts would wait it out.
      if (!w.lock_name.empty()) {
        queue_.push_back(Write{{}, {}, std::move(w.lock_name), std::move(w.token)});
        queue_cv_.notify_all();
        if (w.name.empty()) return;
      }
    }
  }
  std::lock_guard lock(mu_);
  ++counters_.writes_dropped;
}

bool Tier::flush(std::chrono::milliseconds within) {
  std::unique_lock lock(queue_mu_);
  return queue_cv_.wait_for(lock, within, [&] { return queue_.empty() && !writing_; });
}

void Tier::write_loop() {
  std::unique_ptr<Connection> conn;
  std::unique_lock lock(queue_mu_);
  for (;;) {
    queue_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    Write w = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    lock.unlock();

    if (!admit()) {
      conn.reset();
      std::lock_guard c(mu_);
      if (!w.name.empty()) ++counters_.writes_dropped;
    } else {
      send_write(w, conn);
    }

    lock.lock();
    writing_ = false;
    queue_cv_.notify_all();
  }
}

void Tier::send_write(const Write& w, std::unique_ptr<Connection>& conn) {
  const auto sent = Clock::now();
  const auto deadline = sent + config_.write_timeout;
  // One command; a connection kept from an earlier write may have been closed by the server
  // since, so an unavailable one gets a single fresh connection.
  auto run = [&](const std::vector<std::string_view>& args) -> Result<Reply> {
    for (int attempt = 0;; ++attempt) {
      if (!conn) {
        auto c = Connection::open(config_, deadline);
        if (!c.ok()) return c.status();
        conn = std::move(c).value();
        std::lock_guard g(mu_);
        ++counters_.connects;
      }
      auto r = conn->command(args, deadline);
      if (r.ok()) return r;
      conn.reset();
      if (attempt > 0 || r.status().code() != Code::unavailable) return r;
    }
  };
  Status error;
  if (!w.name.empty()) {
    const std::string full_name = config_.key_prefix + w.name;
    auto r = run({"SET", full_name, w.sealed});
    if (!r.ok()) {
      error = r.status();
    } else if (r->is_error()) {
      // A full server (maxmemory with noeviction) refuses writes but still serves reads.
      std::lock_guard g(mu_);
      if (r->text.rfind("OOM", 0) == 0) ++counters_.full;
      else ++counters_.write_errors;
    } else {
      succeeded(sent);
      std::lock_guard g(mu_);
      ++counters_.writes;
    }
  }
  if (error.ok() && !w.lock_name.empty()) {
    auto r = run({"EVAL", k_release_script, "1", w.lock_name, w.token});
    if (!r.ok()) {
      error = r.status();
    } else if (r->is_error()) {
      // The lock expires by itself; until then hosts that miss the key wait for a record.
      std::lock_guard g(mu_);
      ++counters_.write_errors;
      if (!warned_release_) {
        warned_release_ = true;
        std::fprintf(stderr, "kiln: remote: %s refused to release a compile lock (%s); it expires after %s\n",
                     describe().c_str(), r->text.c_str(), ms_text(config_.lock_ttl).c_str());
      }
    }
  }
  if (!error.ok()) {
    {
      std::lock_guard g(mu_);
      ++counters_.write_errors;
    }
    failed(error);
  }
}

}  // namespace kiln::remote
