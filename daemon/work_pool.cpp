#include "daemon/work_pool.h"

#include <exception>

#include "daemon/log.h"

namespace kiln::daemon {
namespace {

// A job that throws must not take the worker (and with it the daemon) down.
void call_job(const WorkPool::Job& job, bool run, const std::string& pool) {
  try {
    job(run);
  } catch (const std::exception& e) {
    log_error(pool + ": job threw: " + e.what());
  } catch (...) {
    log_error(pool + ": job threw an unknown exception");
  }
}

}  // namespace

WorkPool::WorkPool(std::size_t threads, std::string name) : name_(std::move(name)) {
  if (threads == 0) threads = 1;
  workers_.reserve(threads);
  for (std::size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

WorkPool::~WorkPool() {
  stop();
  join();
}

void WorkPool::submit(Lane lane, Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      (lane == Lane::interactive ? interactive_ : background_).push_back(std::move(job));
      cv_.notify_one();
      return;
    }
  }
  call_job(job, false, name_);
}

void WorkPool::stop() {
  std::deque<Job> cancelled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto& j : interactive_) cancelled.push_back(std::move(j));
    for (auto& j : background_) cancelled.push_back(std::move(j));
    interactive_.clear();
    background_.clear();
  }
  cv_.notify_all();
  for (auto& j : cancelled) call_job(j, false, name_);
}

void WorkPool::join() {
  for (auto& t : workers_)
    if (t.joinable()) t.join();
}

std::size_t WorkPool::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return interactive_.size() + background_.size();
}

std::size_t WorkPool::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

void WorkPool::worker_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !interactive_.empty() || !background_.empty(); });
      auto& q = !interactive_.empty() ? interactive_ : background_;
      if (q.empty()) return;  // stopping and nothing left
      job = std::move(q.front());
      q.pop_front();
      ++running_;
    }
    call_job(job, true, name_);
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
  }
}

}  // namespace kiln::daemon
