#include "daemon/server.h"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "cache/store.h"
#include "daemon/build_handlers.h"
#include "daemon/compile_workers.h"
#include "daemon/connections.h"
#include "daemon/dispatch.h"
#include "daemon/instance.h"
#include "daemon/log.h"
#include "daemon/metrics_http.h"
#include "daemon/protocol.h"
#include "daemon/query_handlers.h"
#include "daemon/tuning_service.h"
#include "daemon/work_pool.h"
#include "jit/builder.h"
#include "kiln/family.h"
#include "remote/tier.h"

namespace kiln::daemon {

namespace asio = boost::asio;
using asio::awaitable;
using asio::use_awaitable;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

// Owns every part of the daemon and its lifecycle: start, the signals, the graceful stop.
struct Server::Impl {
  // Declared first so it is destroyed last: the pools (destroyed, and joined, first) post their
  // completions to it.
  asio::io_context io{1};
  asio::signal_set signals{io};

  ServerOptions options;
  std::unique_ptr<Instance> instance;
  std::unique_ptr<cache::Store> store;
  std::unique_ptr<CompileWorkers> workers;  // null: compiles run in-process; outlives builder
  std::unique_ptr<remote::Tier> remote;     // null: no remote tier; outlives builder
  std::unique_ptr<jit::Builder> builder;
  std::unique_ptr<TuningService> tuning;  // destroyed after the pools: cache pool jobs read its table
  std::unique_ptr<WorkPool> compile_pool;
  std::unique_ptr<WorkPool> aux_pool;  // SQLite queries that are not compiles (list, stats, tuning lookups)
  std::unique_ptr<BuildHandlers> build;
  std::unique_ptr<QueryHandlers> query;
  std::unique_ptr<Connections> connections;
  std::unique_ptr<MetricsHttp> metrics_http;  // null: no HTTP listener

  // Touched on the I/O thread only.
  bool stopping = false;
  bool finished = false;
  Clock::time_point started = Clock::now();

  void begin_stop(const std::string& why) {
    if (stopping) return;
    stopping = true;
    log_info("stopping (" + why + "): " + std::to_string(connections->open()) + " connection(s) open, " +
             std::to_string(compile_pool->running()) + " compile(s) running, " +
             std::to_string(compile_pool->queued()) + " queued");
    // Queued jobs complete at once with shutting_down; running compiles finish normally.
    connections->stop();
    if (metrics_http) metrics_http->stop();
    compile_pool->stop();
    aux_pool->stop();
    tuning->stop();
    maybe_finish();
  }

  // The I/O loop ends once nothing is left: the signal wait is the last thing holding it.
  void maybe_finish() {
    if (!stopping || finished || connections->open() != 0) return;
    finished = true;
    boost::system::error_code ec;
    signals.cancel(ec);
  }

  awaitable<void> wait_signals() {
    // begin_stop() may finish the stop from inside this loop: check before waiting again.
    while (!finished) {
      boost::system::error_code ec;
      int sig = co_await signals.async_wait(asio::redirect_error(use_awaitable, ec));
      if (ec) co_return;  // cancelled: the stop is complete
      if (!stopping) {
        begin_stop(std::string("signal ") + (sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : std::to_string(sig)));
      } else {
        // A second signal while draining: the operator does not want to wait for the compiles.
        log_warn("second signal while stopping: exiting without waiting for running compiles");
        instance->remove_socket();
        std::_Exit(k_exit_error);
      }
    }
  }

  // The "daemon" object of a stats reply.
  json daemon_stats() const {
    const Connections::Counters& c = connections->counters();
    return {
        {"version", KILN_VERSION},
        {"protocol", k_protocol_version},
        {"pid", static_cast<std::int64_t>(::getpid())},
        {"uptime_s", std::chrono::duration<double>(Clock::now() - started).count()},
        {"connections", c.connections},
        {"active_connections", static_cast<std::int64_t>(connections->open())},
        {"requests", c.requests},
        {"errors", c.errors},
        {"evicted_connections", c.evicted},
        {"pch", options.use_pch},
        {"jobs", static_cast<std::int64_t>(compile_pool->threads())},
        {"compiles_running", static_cast<std::int64_t>(compile_pool->running())},
        {"compiles_queued", static_cast<std::int64_t>(compile_pool->queued())},
        {"compile_timeout_ms", static_cast<std::int64_t>(options.compile_timeout.count())},
        {"compile_timeouts", workers ? workers->timeouts() : 0},
        {"compile_worker_deaths", workers ? workers->worker_deaths() : 0},
        {"compile_workers_started", workers ? workers->workers_started() : 0},
        {"socket", instance->socket_path().string()},
        {"tuning_runs", tuning->counters().runs},
        {"tuning_failures", tuning->counters().run_failures},
        {"tuning_remote_hits", tuning->counters().remote_hits},
        {"remote", remote ? remote_counters_to_json(*remote) : json(nullptr)},
        {"metrics_listen", metrics_http ? json(metrics_http->address()) : json(nullptr)},
    };
  }
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() {
  if (impl_ && impl_->compile_pool) {
    impl_->compile_pool->stop();
    impl_->aux_pool->stop();
    impl_->tuning->stop();
  }
}

Result<std::unique_ptr<Server>> Server::create(const ServerOptions& options, bool* already_running) {
  if (already_running) *already_running = false;
  if (options.socket.empty()) return invalid_argument("no socket path");
  if (options.cache_file.empty()) return invalid_argument("no cache file");

  auto impl = std::make_unique<Impl>();
  Impl* s = impl.get();
  s->options = options;
  if (s->options.jobs == 0) s->options.jobs = std::max(1u, std::thread::hardware_concurrency());

  ClaimError claim_error;
  s->instance = Instance::claim(options.socket, claim_error);
  if (!s->instance) {
    if (already_running) *already_running = claim_error.already_running;
    return claim_error.status;
  }

  std::filesystem::path moved_to;
  auto store = cache::Store::open_recovering(options.cache_file, &moved_to);
  if (!moved_to.empty())
    log_error("the cache " + options.cache_file.string() + " was damaged; moved it to " + moved_to.string() +
              " and started an empty one");
  if (!store.ok())
    return Status(store.status().code(), "cannot open the cache " + options.cache_file.string() + ": " +
                                             store.status().message(),
                  store.status().details());
  s->store = std::move(store).value();
  if (s->store->read_only())
    log_warn("the cache " + options.cache_file.string() +
             " is read-only: cached kernels are served, new ones are compiled but not stored");
  jit::BuilderOptions bo;
  bo.use_pch = options.use_pch;
  if (options.compile_timeout.count() > 0) {
    // /proc/self/exe, not its target: the running image, even after kilnd is replaced on disk,
    // so a worker always speaks its daemon's pipe format.
    s->workers = std::make_unique<CompileWorkers>("/proc/self/exe", options.compile_timeout);
    bo.compiler = [w = s->workers.get()](const jit::CompileRequest& r) { return w->compile(r); };
  }
  if (options.remote) {
    s->remote = remote::Tier::create(*options.remote);
    bo.remote = s->remote.get();
  }
  s->builder = std::make_unique<jit::Builder>(s->store.get(), &Registry::global(), bo);

  Connections::Hooks hooks;
  hooks.dispatch = [s](const std::string& body) {
    return dispatch(Handlers{*s->build, *s->query, *s->tuning}, body);
  };
  hooks.shutdown_requested = [s] { s->begin_stop("shutdown request"); };
  hooks.closed = [s] { s->maybe_finish(); };
  s->connections = std::make_unique<Connections>(s->io, s->options, std::move(hooks));
  KILN_TRY(s->connections->listen(s->instance->release_listen_fd(), options.socket));
  s->compile_pool = std::make_unique<WorkPool>(s->options.jobs, "compile pool");
  s->aux_pool = std::make_unique<WorkPool>(1, "cache pool");
  KILN_ASSIGN_OR_RETURN(s->tuning, TuningService::create(*s->store, *s->builder, *s->aux_pool, options.autotune,
                                                              s->remote.get()));
  s->build = std::make_unique<BuildHandlers>(*s->builder, *s->compile_pool);
  s->query = std::make_unique<QueryHandlers>(*s->store, *s->builder, *s->aux_pool, [s] { return s->daemon_stats(); });
  if (!options.metrics_listen.empty()) {
    auto http = MetricsHttp::bind(s->io, options.metrics_listen, [s]() -> awaitable<std::string> {
      json r = co_await s->query->metrics();
      co_return r.value("ok", false) ? r.value("text", std::string()) : "# metrics unavailable: " + r.dump() + "\n";
    });
    if (!http.ok()) return http.status();
    s->metrics_http = std::move(http).value();
  }
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

int Server::run() {
  Impl& s = *impl_;
  boost::system::error_code ec;
  s.signals.add(SIGTERM, ec);
  s.signals.add(SIGINT, ec);
  // A client that hangs up mid-reply must be an error code on that socket, not a dead daemon.
  std::signal(SIGPIPE, SIG_IGN);
  // Past a file size limit (RLIMIT_FSIZE) a write must fail with EFBIG, which the store counts
  // and survives, instead of SIGXFSZ ending the daemon.
  std::signal(SIGXFSZ, SIG_IGN);

  s.started = Clock::now();
  log_info(std::string("kilnd ") + KILN_VERSION + " listening on " + s.instance->socket_path().string() +
           " (protocol " + std::to_string(k_protocol_version) + ", jobs " + std::to_string(s.compile_pool->threads()) +
           ", pch " + (s.options.use_pch ? "on" : "off") + ", cache " + s.store->path().string() +
           (s.remote ? ", remote " + s.remote->describe() : std::string()) + ")");
  asio::co_spawn(s.io, s.wait_signals(), asio::detached);
  s.connections->start();
  if (s.metrics_http) {
    s.metrics_http->start();
    log_info("serving metrics on http://" + s.metrics_http->address() + "/metrics");
  }
  int code = k_exit_ok;
  for (;;) {
    try {
      s.io.run();
      break;
    } catch (const std::exception& e) {
      // Handlers catch their own errors; this is a last line so one bad connection cannot end
      // the daemon.
      log_error(std::string("I/O loop exception: ") + e.what());
    }
  }
  s.compile_pool->join();
  s.aux_pool->join();
  s.tuning->join();
  // Nothing writes any more: fold the WAL into the database so the file stands alone.
  if (Status cs = s.store->checkpoint(); !cs.ok()) log_warn("WAL checkpoint at stop failed: " + cs.to_string());
  s.instance->remove_socket();
  const double up = std::chrono::duration<double>(Clock::now() - s.started).count();
  const Connections::Counters& c = s.connections->counters();
  log_info("stopped after " + format_ms(up * 1000.0) + " ms: " + std::to_string(c.connections) + " connection(s), " +
           std::to_string(c.requests) + " request(s), " + std::to_string(c.errors) + " error(s)");
  return code;
}

void Server::request_stop() {
  Impl* s = impl_.get();
  asio::post(s->io, [s] { s->begin_stop("stop requested"); });
}

}  // namespace kiln::daemon
