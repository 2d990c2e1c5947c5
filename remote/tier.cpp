#include "remote/tier.h"

#include <cstdio>

#include "remote/signed.h"
#include "remote/tls.h"

namespace kiln::remote {
namespace {

constexpr std::size_t k_max_idle = 8;
constexpr auto k_drain_at_exit = std::chrono::seconds(2);

std::string short_key(const std::string& key) { return key.substr(0, std::min<std::size_t>(12, key.size())); }

std::string ms_text(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

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

std::optional<std::string> Tier::fetch(const std::string& name) {
  if (!admit()) {
    std::lock_guard lock(mu_);
    ++counters_.skipped;
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
  const std::string full_name = config_.key_prefix + name;
  auto r = c->command({"GET", full_name}, deadline);
  // A pooled connection may have been closed by the server since (a restart, an idle timeout):
  // that is not the server failing now, so it gets one fresh connection.
  if (!r.ok() && reused && r.status().code() == Code::unavailable) {
    c = take_connection(deadline, error, reused, /*fresh=*/true);
    if (!c) {
      failed(error);
      return std::nullopt;
    }
    r = c->command({"GET", full_name}, deadline);
  }
  if (!r.ok()) {
    failed(r.status());
    return std::nullopt;
  }
  if (r->is_error() || (r->type != Reply::Type::bulk && r->type != Reply::Type::nil)) {
    give_back(std::move(c));
    failed(unavailable("GET answered " + (r->is_error() ? r->text : std::string("an unexpected reply"))));
    return std::nullopt;
  }
  give_back(std::move(c));
  succeeded(sent);
  std::lock_guard lock(mu_);
  ++counters_.lookups;
  if (r->type == Reply::Type::nil) {
    ++counters_.misses;
    return std::nullopt;
  }
  return std::move(r->text);
}

std::optional<cache::Entry> Tier::get_entry(const std::string& key, const cache::Expected& expected) {
  auto raw = fetch(entry_name(key));
  if (!raw) return std::nullopt;
  auto e = open_entry(config_.fleet_key, key, *raw, expected);
  std::lock_guard lock(mu_);
  if (!e.ok()) {
    ++counters_.rejected;
    std::fprintf(stderr, "kiln: remote: rejected the entry for key %s from %s (%s%s%s); compiling it locally\n",
                 short_key(key).c_str(), describe().c_str(), e.status().message().c_str(),
                 e.status().details().empty() ? "" : ": ", e.status().details().c_str());
    return std::nullopt;
  }
  ++counters_.hits;
  return std::move(e).value();
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

void Tier::put_entry(const cache::Entry& e) { enqueue(entry_name(e.key), seal_entry(config_.fleet_key, e)); }

void Tier::put_record(const std::string& name, const std::string& payload) {
  enqueue(name, seal(config_.fleet_key, name, payload));
}

void Tier::enqueue(std::string name, std::string sealed) {
  {
    std::lock_guard lock(queue_mu_);
    if (!stop_ && queue_.size() < config_.max_pending_writes) {
      queue_.emplace_back(std::move(name), std::move(sealed));
      queue_cv_.notify_all();
      return;
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
    auto [name, sealed] = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    lock.unlock();

    if (!admit()) {
      conn.reset();
      std::lock_guard c(mu_);
      ++counters_.writes_dropped;
    } else {
      const auto sent = Clock::now();
      const auto deadline = sent + config_.write_timeout;
      Status error;
      if (!conn) {
        auto c = Connection::open(config_, deadline);
        if (c.ok()) {
          conn = std::move(c).value();
          std::lock_guard g(mu_);
          ++counters_.connects;
        } else {
          error = c.status();
        }
      }
      if (conn) {
        const std::string full_name = config_.key_prefix + name;
        auto r = conn->command({"SET", full_name, sealed}, deadline);
        if (!r.ok() && r.status().code() == Code::unavailable) {
          // Kept from an earlier write, the connection may have been closed by the server since.
          auto c = Connection::open(config_, deadline);
          if (c.ok()) {
            conn = std::move(c).value();
            {
              std::lock_guard g(mu_);
              ++counters_.connects;
            }
            r = conn->command({"SET", full_name, sealed}, deadline);
          }
        }
        if (!r.ok()) {
          error = r.status();
          conn.reset();
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
      if (!error.ok()) {
        {
          std::lock_guard g(mu_);
          ++counters_.write_errors;
        }
        failed(error);
      }
    }

    lock.lock();
    writing_ = false;
    queue_cv_.notify_all();
  }
}

}  // namespace kiln::remote
