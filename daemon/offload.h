// Blocking work from the I/O thread's coroutines: async_offload runs jobs on a WorkPool and
// resumes the awaiting coroutine on the I/O thread with their results.
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>

#include "daemon/work_pool.h"
#include "kiln/status.h"

namespace kiln::daemon {

// What a job cancelled by a stopping pool answers.
inline Status shutting_down_status() { return Status(Code::shutting_down, "kilnd is shutting down"); }

// Runs `jobs` on `pool` and completes `token` with their results, in order, on the executor the
// token is associated with (the I/O thread). The work guard keeps the I/O loop alive while jobs
// are queued or running, which is what lets a graceful stop wait for in-flight compiles.
// T must be default-constructible and movable, with a `Status status` member (set when a job
// throws); job(false) produces the "cancelled" result.
template <class T, class Token>
auto async_offload(WorkPool& pool, WorkPool::Lane lane, std::vector<std::function<T(bool run)>> jobs,
                   Token&& token) {
  namespace asio = boost::asio;
  return asio::async_initiate<Token, void(std::vector<T>)>(
      [&pool, lane](auto handler, std::vector<std::function<T(bool)>> jobs) {
        using Handler = decltype(handler);
        using Executor = asio::associated_executor_t<Handler>;
        struct State {
          State(Handler h, std::size_t n)
              : handler(std::move(h)),
                work(asio::make_work_guard(asio::get_associated_executor(handler))),
                results(n),
                left(n) {}
          Handler handler;
          asio::executor_work_guard<Executor> work;
          std::vector<T> results;
          std::atomic<std::size_t> left;
        };
        auto state = std::make_shared<State>(std::move(handler), jobs.size());
        auto complete = [state] {
          Executor ex = state->work.get_executor();
          asio::post(ex, [state]() mutable {
            Handler h = std::move(state->handler);
            std::vector<T> results = std::move(state->results);
            state->work.reset();
            h(std::move(results));
          });
        };
        if (jobs.empty()) {
          complete();
          return;
        }
        for (std::size_t i = 0; i < jobs.size(); ++i) {
          pool.submit(lane, [state, complete, i, fn = std::move(jobs[i])](bool run) {
            // A job that throws must still be counted, or its client and the stop wait forever.
            try {
              state->results[i] = fn(run);
            } catch (const std::exception& e) {
              state->results[i].status = internal_error("request failed", e.what());
            } catch (...) {
              state->results[i].status = internal_error("request failed", "unknown exception");
            }
            if (state->left.fetch_sub(1) == 1) complete();
          });
        }
      },
      token, std::move(jobs));
}

}  // namespace kiln::daemon
