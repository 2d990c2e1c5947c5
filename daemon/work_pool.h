// A fixed set of worker threads for blocking work (NVRTC compiles, SQLite queries) so that the
// daemon's I/O thread never blocks.
//
// Two lanes: interactive jobs (a client waiting on one kernel) are always taken before background
// jobs (prewarm), so a long prewarm never queues a `get` behind hundreds of compiles.
// Each job is called exactly once: job(true) on a worker, or job(false) when the pool stops before
// the job started, so the submitter can always answer its client. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kiln::daemon {

class WorkPool {
 public:
  enum class Lane { interactive, background };
  // `run` is true when the job may do its work, false when it is being cancelled.
  using Job = std::function<void(bool run)>;

  WorkPool(std::size_t threads, std::string name);
  ~WorkPool();  // stop() then join()
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  // Queues a job. After stop() the job is cancelled at once (called with false on this thread).
  void submit(Lane lane, Job job);
  // Cancels every queued job (each is called with false) and refuses new ones; jobs already
  // running finish. Does not wait: join() does.
  void stop();
  // Waits for the workers to exit (call after stop()).
  void join();

  std::size_t threads() const { return workers_.size(); }
  std::size_t queued() const;
  std::size_t running() const;

 private:
  void worker_loop();

  std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> interactive_;
  std::deque<Job> background_;
  std::size_t running_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace kiln::daemon
