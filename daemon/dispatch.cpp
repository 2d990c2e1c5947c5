#include "daemon/dispatch.h"

#include <unistd.h>

#include <cstdint>
#include <exception>

#include "daemon/log.h"
#include "daemon/protocol.h"
#include "daemon/request_fields.h"

namespace kiln::daemon {

using nlohmann::json;

namespace {

json ping_reply() {
  json r = ok_reply();
  r["version"] = KILN_VERSION;
  r["protocol"] = k_protocol_version;
  r["pid"] = static_cast<std::int64_t>(::getpid());
  return r;
}

}  // namespace

boost::asio::awaitable<Reply> dispatch(Handlers handlers, const std::string& body) {
  Reply reply;
  json id;
  try {
    auto parsed = parse_json(body);
    if (!parsed.ok()) {
      reply.body = error_reply(parsed.status());
    } else if (!parsed->is_object()) {
      reply.body = error_reply(invalid_argument("request must be a JSON object"));
    } else {
      const json& req = *parsed;
      if (auto it = req.find("id"); it != req.end()) id = *it;
      std::string op;
      if (Status s = required_string(req, "op", op); !s.ok()) {
        reply.body = error_reply(s);
      } else if (op == "ping") {
        reply.body = ping_reply();
      } else if (op == "get") {
        reply = co_await handlers.build.get(req);
      } else if (op == "prewarm") {
        reply.body = co_await handlers.build.prewarm(req);
      } else if (op == "list") {
        reply.body = co_await handlers.query.list(req);
      } else if (op == "stats") {
        reply.body = co_await handlers.query.stats();
      } else if (op == "metrics") {
        reply.body = co_await handlers.query.metrics();
      } else if (op == "resolve") {
        reply.body = co_await handlers.tuning.resolve(req);
      } else if (op == "tune") {
        reply.body = co_await handlers.tuning.tune(req);
      } else if (op == "shutdown") {
        reply.body = ok_reply();
        reply.body["stopping"] = true;
        reply.stop_after = true;
        reply.close_after = true;
      } else {
        reply.body = error_reply(invalid_argument("unknown op '" + op + "'",
                                                  "known ops: ping, get, prewarm, list, stats, metrics, resolve, tune, shutdown"));
      }
    }
  } catch (const std::exception& e) {
    // nlohmann or the standard library threw: the request fails, the daemon does not.
    log_error(std::string("request failed with an exception: ") + e.what());
    reply = Reply{};
    reply.body = error_reply(internal_error("request failed", e.what()));
  }
  if (!id.is_null()) reply.body["id"] = id;
  co_return reply;
}

}  // namespace kiln::daemon
