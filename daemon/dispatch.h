// Routing one request: parses the body, picks the handler by its "op", answers `ping` and
// `shutdown` itself, turns an exception into an internal error reply, and echoes the request's id.
#pragma once

#include <string>
#include <utility>

#include <boost/asio/awaitable.hpp>

#include "daemon/build_handlers.h"
#include "daemon/connections.h"
#include "daemon/query_handlers.h"
#include "daemon/tuning_service.h"

namespace kiln::daemon {

struct Handlers {
  BuildHandlers& build;
  QueryHandlers& query;
  TuningService& tuning;
};

boost::asio::awaitable<Reply> dispatch(Handlers handlers, const std::string& body);

}  // namespace kiln::daemon
