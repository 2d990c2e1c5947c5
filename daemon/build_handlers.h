// The requests that produce kernels: `get` (one kernel, from the cache or compiled now) and
// `prewarm` (every catalog variant of some families for some archs). Requests are checked on the
// I/O thread; the builds run on the compile pool.
#pragma once

#include <utility>

#include <boost/asio/awaitable.hpp>
#include <nlohmann/json.hpp>

#include "daemon/connections.h"
#include "daemon/work_pool.h"
#include "jit/builder.h"

namespace kiln::daemon {

class BuildHandlers {
 public:
  // Neither is owned; both must outlive every request.
  BuildHandlers(jit::Builder& builder, WorkPool& compile_pool) : builder_(builder), compile_pool_(compile_pool) {}

  // The reply carries the entry as JSON and the cubin as its blob.
  boost::asio::awaitable<Reply> get(const nlohmann::json& req);
  boost::asio::awaitable<nlohmann::json> prewarm(const nlohmann::json& req);

 private:
  jit::Builder& builder_;
  WorkPool& compile_pool_;
};

}  // namespace kiln::daemon
