// Compiles in child processes, under a deadline (docs/reliability.md, item 7).
//
// NVRTC cannot be interrupted from another thread: a compile that runs away (a template that
// instantiates without end, a pathological unroll) would hold a compile thread, its memory and
// every waiter for as long as it likes. So kilnd hands each compile to a worker process
// (`kilnd --compile-worker`, started with posix_spawn) over a pipe, and SIGKILLs the worker when
// the deadline passes: the caller gets Code::timeout, the thread is free at once, and the next
// compile starts a fresh worker. Workers are kept between compiles (NVRTC loaded, its automatic
// PCH warm), one per compile running at a time. A worker that crashes costs that one compile, not
// the daemon.
//
// Pipe format, both directions: u32 little-endian length, then that many bytes of JSON; a reply
// is followed by u32 length + the cubin bytes.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <vector>

#include "jit/nvrtc.h"
#include "kiln/status.h"

namespace kiln::daemon {

class CompileWorkers {
 public:
  // `exe`: the kilnd binary (started as `exe --compile-worker`). `deadline`: per compile.
  CompileWorkers(std::filesystem::path exe, std::chrono::milliseconds deadline);
  ~CompileWorkers();
  CompileWorkers(const CompileWorkers&) = delete;
  CompileWorkers& operator=(const CompileWorkers&) = delete;

  // Thread-safe. Code::timeout when the deadline passed (the worker is killed), internal when the
  // worker died or answered nonsense, else what NVRTC said.
  Result<jit::CompileOutput> compile(const jit::CompileRequest& req);

  std::int64_t timeouts() const { return timeouts_; }
  std::int64_t worker_deaths() const { return deaths_; }
  std::int64_t workers_started() const { return started_; }

 private:
  struct Worker {
    pid_t pid = -1;
    int to_child = -1;    // its stdin
    int from_child = -1;  // its stdout
  };
  Result<Worker> spawn();
  static void discard(Worker& w);

  std::filesystem::path exe_;
  std::chrono::milliseconds deadline_;
  std::mutex mu_;
  std::vector<Worker> idle_;
  std::atomic<std::int64_t> timeouts_{0}, deaths_{0}, started_{0};
};

// The body of `kilnd --compile-worker`: serves requests from stdin until EOF. Returns the exit code.
int run_compile_worker();

}  // namespace kiln::daemon
