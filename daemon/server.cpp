#include "daemon/server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include "cache/store.h"
#include "cache/tuning.h"
#include "daemon/compile_workers.h"
#include "daemon/instance.h"
#include "daemon/log.h"
#include "daemon/protocol.h"
#include "daemon/work_pool.h"
#include "jit/autotune.h"
#include "jit/autotune_mode.h"
#include "jit/builder.h"
#include "jit/device_info.h"
#include "jit/tuning_setup.h"
#include "kiln/family.h"
#include "kiln/spec.h"

namespace kiln::daemon {

namespace asio = boost::asio;
using asio::awaitable;
using asio::use_awaitable;
using Socket = asio::local::stream_protocol::socket;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

// Runs `jobs` on `pool` and completes `token` with their results, in order, on the executor the
// token is associated with (the I/O thread). The work guard keeps the I/O loop alive while jobs
// are queued or running, which is what lets a graceful stop wait for in-flight compiles.
// T must be default-constructible and movable, with a `Status status` member (set when a job
// throws); job(false) produces the "cancelled" result.
template <class T, class Token>
auto async_offload(WorkPool& pool, WorkPool::Lane lane, std::vector<std::function<T(bool run)>> jobs,
                   Token&& token) {
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

struct BuildOutcome {
  Status status;
  jit::Artifact artifact;
};

struct ListOutcome {
  Status status;
  std::vector<cache::Entry> entries;
};

struct StatsOutcome {
  Status status;
  cache::Stats stats;
};

Status shutting_down_status() { return Status(Code::shutting_down, "kilnd is shutting down"); }

std::string short_key(const std::string& key) { return key.substr(0, std::min<std::size_t>(12, key.size())); }

std::string format_ms(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", ms);
  return buf;
}

// Fields of a request, read without exceptions.
Status optional_string(const json& req, const char* name, std::string& out) {
  auto it = req.find(name);
  if (it == req.end() || it->is_null()) return {};
  if (!it->is_string()) return invalid_argument(std::string("field '") + name + "' must be a string");
  out = it->get<std::string>();
  return {};
}

Status required_string(const json& req, const char* name, std::string& out) {
  auto it = req.find(name);
  if (it == req.end()) return invalid_argument(std::string("missing field '") + name + "'");
  if (!it->is_string()) return invalid_argument(std::string("field '") + name + "' must be a string");
  out = it->get<std::string>();
  return {};
}

Status string_array(const json& req, const char* name, std::vector<std::string>& out) {
  auto it = req.find(name);
  if (it == req.end() || it->is_null()) return {};
  if (!it->is_array()) return invalid_argument(std::string("field '") + name + "' must be an array of strings");
  for (const auto& v : *it) {
    if (!v.is_string()) return invalid_argument(std::string("field '") + name + "' must be an array of strings");
    out.push_back(v.get<std::string>());
  }
  return {};
}

constexpr std::size_t k_max_prewarm_errors = 200;

struct LookupOutcome {
  Status status;
  cache::Setup setup;
  std::optional<cache::TuningRecord> record;
};

struct TuneOutcome {
  Status status;
  cache::TuningRecord record;
};

// Signatures (with their setup) whose background tuning is queued or running, and those whose
// tuning failed: a failure is not retried until kilnd restarts, so a family that cannot be tuned
// here costs one attempt, not one per client.
struct TuneQueue {
  std::mutex mu;
  std::set<std::string> pending;
  std::set<std::string> failed;
};

// The tuned winner as params for `problem`, when it still parses, validates and accepts the
// problem (a bucket's members share a winner, so each member is checked on its own).
std::optional<Params> usable_winner(const Family& family, const std::string& winner, const Problem& problem) {
  auto params = Params::parse(winner);
  if (!params.ok() || !family.validate(*params).ok() || !family.check_problem(*params, problem).ok())
    return std::nullopt;
  return std::move(params).value();
}

}  // namespace

struct Server::Impl {
  struct Reply {
    json body;
    std::string blob;
    bool close_after = false;  // the connection ends after this reply (fatal frame error)
    bool stop_after = false;   // the server stops after this reply is written (shutdown)
  };

  struct Connection {
    explicit Connection(Socket s, std::uint64_t id_)
        : socket(std::move(s)), timer(socket.get_executor()), id(id_) {}
    Socket socket;
    asio::steady_timer timer;
    Clock::time_point deadline = Clock::time_point::max();
    std::uint64_t id;
    bool busy = false;       // a frame is being read or a request served
    bool serving = false;    // a whole request was read: it is being answered
    Clock::time_point since = Clock::now();  // start of the current wait for (or read of) a frame
    bool timed_out = false;
  };

  // Declared first so it is destroyed last: the pools (destroyed, and joined, first) post their
  // completions to it.
  asio::io_context io{1};
  asio::local::stream_protocol::acceptor acceptor{io};
  asio::signal_set signals{io};

  ServerOptions options;
  std::unique_ptr<Instance> instance;
  std::unique_ptr<cache::Store> store;
  std::unique_ptr<CompileWorkers> workers;  // null: compiles run in-process; outlives builder
  std::unique_ptr<jit::Builder> builder;
  std::unique_ptr<cache::TuningTable> tuning;
  std::unique_ptr<jit::Tuner> tuner;
  std::unique_ptr<WorkPool> compile_pool;
  std::unique_ptr<WorkPool> aux_pool;  // SQLite queries that are not compiles (list, stats)
  // One thread: tuning jobs run one at a time (the GPU lock would serialize them anyway), `tune`
  // requests and resolve-and-wait on the interactive lane, queued background tuning behind them.
  std::unique_ptr<WorkPool> tune_pool;
  TuneQueue tune_queue;

  // Touched on the I/O thread only.
  std::set<std::shared_ptr<Connection>> connections;
  bool stopping = false;
  bool finished = false;
  std::uint64_t next_connection_id = 1;
  std::int64_t connections_total = 0;
  std::int64_t requests_total = 0;
  std::int64_t errors_total = 0;
  std::int64_t evicted_total = 0;  // connections closed at the cap to admit a new one
  Clock::time_point started = Clock::now();

  // ---- lifecycle -------------------------------------------------------------------------------

  void begin_stop(const std::string& why) {
    if (stopping) return;
    stopping = true;
    log_info("stopping (" + why + "): " + std::to_string(connections.size()) + " connection(s) open, " +
             std::to_string(compile_pool->running()) + " compile(s) running, " +
             std::to_string(compile_pool->queued()) + " queued");
    boost::system::error_code ec;
    acceptor.close(ec);
    // Queued jobs complete at once with shutting_down; running compiles finish normally.
    compile_pool->stop();
    aux_pool->stop();
    tune_pool->stop();
    for (const auto& c : connections)
      if (!c->busy) close_connection(*c);
    maybe_finish();
  }

  // The I/O loop ends once nothing is left: the signal wait is the last thing holding it.
  void maybe_finish() {
    if (!stopping || finished || !connections.empty()) return;
    finished = true;
    boost::system::error_code ec;
    signals.cancel(ec);
  }

  static void close_connection(Connection& c) {
    boost::system::error_code ec;
    c.socket.shutdown(Socket::shutdown_both, ec);
    c.socket.close(ec);
    c.timer.cancel();
  }

  void set_deadline(Connection& c, Clock::time_point when) {
    c.deadline = when;
    c.timer.cancel();  // wakes the watchdog so it sleeps until the new deadline
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

  // ---- connections -----------------------------------------------------------------------------

  awaitable<void> accept_loop() {
    asio::steady_timer backoff(io);
    while (!stopping) {
      boost::system::error_code ec;
      Socket socket = co_await acceptor.async_accept(asio::redirect_error(use_awaitable, ec));
      if (stopping) co_return;
      if (ec) {
        if (ec == asio::error::operation_aborted) co_return;
        log_error("accept failed: " + ec.message());
        // Out of descriptors: back off instead of spinning on the error.
        backoff.expires_after(std::chrono::milliseconds(100));
        co_await backoff.async_wait(asio::redirect_error(use_awaitable, ec));
        continue;
      }
      // The peer's credentials are checked before a single byte is read from it.
      ucred cred{};
      socklen_t len = sizeof cred;
      if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        log_warn(std::string("refused a connection: SO_PEERCRED failed: ") + std::strerror(errno));
        socket.close(ec);
        continue;
      }
      if (cred.uid != ::geteuid()) {
        log_warn("refused a connection from uid " + std::to_string(cred.uid) + " (pid " + std::to_string(cred.pid) +
                 "): only uid " + std::to_string(::geteuid()) + " may use this daemon");
        socket.close(ec);
        continue;
      }
      if (connections.size() >= options.max_connections && !evict_one_waiting()) {
        log_warn("refused a connection from pid " + std::to_string(cred.pid) + ": " +
                 std::to_string(connections.size()) + " connections already open, all of them being served");
        socket.close(ec);
        continue;
      }
      auto conn = std::make_shared<Connection>(std::move(socket), next_connection_id++);
      connections.insert(conn);
      ++connections_total;
      asio::co_spawn(io, watchdog(conn), asio::detached);
      asio::co_spawn(io, serve(conn), asio::detached);
    }
  }

  // At the connection cap, idle or slowly-sending peers must not lock out a new client: the
  // connection that has waited longest without a request being served is closed (a kiln client
  // reconnects transparently). Returns false when every connection is being served.
  bool evict_one_waiting() {
    std::shared_ptr<Connection> oldest;
    for (const auto& c : connections)
      if (!c->serving && c->socket.is_open() && (!oldest || c->since < oldest->since)) oldest = c;
    if (!oldest) return false;
    ++evicted_total;
    if (evicted_total == 1 || evicted_total % 1000 == 0)
      log_warn("at the connection cap (" + std::to_string(options.max_connections) + "): closed the longest-waiting connection (" +
               std::to_string(evicted_total) + " so far)");
    close_connection(*oldest);
    // It stays in `connections` until its coroutine ends; do not count it against the cap.
    oldest->serving = true;
    return true;
  }

  // Closes the connection when its deadline passes; a slow or silent peer cannot hold it open.
  awaitable<void> watchdog(std::shared_ptr<Connection> c) {
    while (c->socket.is_open()) {
      if (c->deadline <= Clock::now()) {
        c->timed_out = true;
        close_connection(*c);
        co_return;
      }
      c->timer.expires_at(c->deadline);
      boost::system::error_code ec;
      co_await c->timer.async_wait(asio::redirect_error(use_awaitable, ec));
    }
  }

  awaitable<void> serve(std::shared_ptr<Connection> c) {
    const std::string who = "connection " + std::to_string(c->id);
    try {
      co_await serve_frames(*c);
    } catch (const boost::system::system_error& e) {
      const auto& ec = e.code();
      if (c->timed_out)
        log_info(who + ": closed after its deadline passed");
      else if (ec != asio::error::eof && ec != asio::error::operation_aborted && ec != asio::error::bad_descriptor &&
               ec != asio::error::connection_reset && ec != asio::error::broken_pipe)
        log_warn(who + ": " + ec.message());
    } catch (const std::exception& e) {
      log_error(who + ": unexpected exception: " + e.what());
    }
    close_connection(*c);
    connections.erase(c);
    maybe_finish();
  }

  awaitable<void> serve_frames(Connection& c) {
    for (;;) {
      if (stopping) co_return;
      HeaderBytes raw{};
      c.busy = false;
      c.serving = false;
      c.since = Clock::now();
      set_deadline(c, Clock::now() + options.idle_timeout);
      co_await asio::async_read(c.socket, asio::buffer(raw.data(), 1), use_awaitable);
      // From the first byte on, the whole frame must arrive within frame_timeout.
      c.busy = true;
      set_deadline(c, Clock::now() + options.frame_timeout);
      co_await asio::async_read(c.socket, asio::buffer(raw.data() + 1, raw.size() - 1), use_awaitable);

      auto header = decode_header(raw);
      Status framing = header.ok() ? check_limits(*header, FrameKind::request) : header.status();
      if (!framing.ok()) {
        // The body was not read, so the stream cannot be resynchronized: answer and hang up.
        log_warn("connection " + std::to_string(c.id) + ": " + framing.message());
        ++errors_total;
        Reply r{error_reply(framing), {}, true};
        r.body["fatal"] = true;
        co_await write_reply(c, std::move(r));
        co_return;
      }
      std::string body = co_await read_body(c, header->json_len);
      c.serving = true;
      set_deadline(c, Clock::time_point::max());  // serving may take a compile's time

      Reply reply = co_await dispatch(body);
      ++requests_total;
      if (reply.body.value("ok", false) == false) ++errors_total;
      const bool close_after = reply.close_after;
      const bool stop_after = reply.stop_after;
      co_await write_reply(c, std::move(reply));
      if (stop_after) begin_stop("shutdown request");
      if (close_after) co_return;
    }
  }

  // Reads the body in steps so that memory follows the bytes that actually arrived: a peer that
  // announces 1 MiB and trickles costs what it sent, not the announced size.
  awaitable<std::string> read_body(Connection& c, std::size_t len) {
    constexpr std::size_t k_step = 64 * 1024;
    std::string body;
    while (body.size() < len) {
      const std::size_t old = body.size();
      body.resize(old + std::min(k_step, len - old));
      co_await asio::async_read(c.socket, asio::buffer(body.data() + old, body.size() - old), use_awaitable);
    }
    co_return body;
  }

  awaitable<void> write_reply(Connection& c, Reply reply) {
    std::string text = dump_json(reply.body);
    if (text.size() > k_max_reply_json || reply.blob.size() > k_max_reply_blob) {
      Status s = internal_error("reply too large for the protocol",
                                "json " + std::to_string(text.size()) + " bytes, blob " +
                                    std::to_string(reply.blob.size()) + " bytes");
      log_error(s.message() + ": " + s.details());
      json err = error_reply(s);
      if (reply.body.contains("id")) err["id"] = reply.body["id"];
      text = dump_json(err);
      reply.blob.clear();
    }
    FrameHeader h;
    h.json_len = static_cast<std::uint32_t>(text.size());
    h.blob_len = static_cast<std::uint32_t>(reply.blob.size());
    HeaderBytes hb = encode_header(h);
    std::vector<asio::const_buffer> bufs{asio::buffer(hb), asio::buffer(text), asio::buffer(reply.blob)};
    c.busy = true;
    set_deadline(c, Clock::now() + options.write_timeout);
    co_await asio::async_write(c.socket, bufs, use_awaitable);
  }

  // ---- requests --------------------------------------------------------------------------------

  awaitable<Reply> dispatch(const std::string& body) {
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
          reply.body = handle_ping();
        } else if (op == "get") {
          reply = co_await handle_get(req);
        } else if (op == "prewarm") {
          reply.body = co_await handle_prewarm(req);
        } else if (op == "list") {
          reply.body = co_await handle_list(req);
        } else if (op == "stats") {
          reply.body = co_await handle_stats();
        } else if (op == "resolve") {
          reply.body = co_await handle_resolve(req);
        } else if (op == "tune") {
          reply.body = co_await handle_tune(req);
        } else if (op == "shutdown") {
          reply.body = ok_reply();
          reply.body["stopping"] = true;
          reply.stop_after = true;
          reply.close_after = true;
        } else {
          reply.body = error_reply(invalid_argument("unknown op '" + op + "'",
                                                    "known ops: ping, get, prewarm, list, stats, resolve, tune, shutdown"));
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

  json handle_ping() {
    json r = ok_reply();
    r["version"] = KILN_VERSION;
    r["protocol"] = k_protocol_version;
    r["pid"] = static_cast<std::int64_t>(::getpid());
    return r;
  }

  awaitable<Reply> handle_get(const json& req) {
    Reply reply;
    std::string spec_text, arch;
    Status s = required_string(req, "spec", spec_text);
    if (s.ok()) s = required_string(req, "arch", arch);
    auto spec = KernelSpec::parse(spec_text);
    if (s.ok() && !spec.ok()) s = spec.status();
    if (s.ok()) s = validate_arch(arch);
    // Bad specs fail here, on the I/O thread, before anything is queued or compiled.
    if (s.ok()) {
      auto family = Registry::global().resolve(*spec);
      if (!family.ok()) s = family.status();
    }
    if (!s.ok()) {
      reply.body = error_reply(s);
      co_return reply;
    }

    std::vector<std::function<BuildOutcome(bool)>> jobs;
    jobs.push_back([this, spec = *spec, arch](bool run) { return build(spec, arch, run); });
    std::vector<BuildOutcome> out =
        co_await async_offload<BuildOutcome>(*compile_pool, WorkPool::Lane::interactive, std::move(jobs), use_awaitable);
    BuildOutcome& o = out.front();
    if (!o.status.ok()) {
      reply.body = error_reply(o.status);
      co_return reply;
    }
    reply.body = ok_reply();
    reply.body["entry"] = entry_to_json(o.artifact.entry);
    reply.body["source"] = source_name(o.artifact.source);
    reply.blob = std::move(o.artifact.entry.cubin);
    co_return reply;
  }

  // Runs on a compile worker.
  BuildOutcome build(const KernelSpec& spec, const std::string& arch, bool run) {
    BuildOutcome o;
    if (!run) {
      o.status = shutting_down_status();
      return o;
    }
    auto r = builder->get(spec, arch);
    if (!r.ok()) {
      o.status = r.status();
      log_warn("build " + spec.canonical() + " @ " + arch + " failed: " + code_name(o.status.code()) + ": " +
               o.status.message());
      return o;
    }
    o.artifact = std::move(r).value();
    if (o.artifact.source == jit::ArtifactSource::compiled)
      log_info("compiled " + spec.canonical() + " @ " + arch + " in " + format_ms(o.artifact.entry.compile_ms) +
               " ms (" + std::to_string(o.artifact.entry.cubin.size()) + " bytes, key " +
               short_key(o.artifact.entry.key) + ")");
    return o;
  }

  awaitable<json> handle_prewarm(const json& req) {
    std::vector<std::string> archs, families;
    Status s = string_array(req, "archs", archs);
    if (s.ok()) s = string_array(req, "families", families);
    if (s.ok() && archs.empty()) s = invalid_argument("prewarm needs at least one arch");
    for (const auto& a : archs)
      if (s.ok()) s = validate_arch(a);
    std::vector<const Family*> chosen;
    if (s.ok()) {
      if (families.empty()) {
        chosen = Registry::global().all();
      } else {
        for (const auto& name : families) {
          const Family* f = Registry::global().find(name);
          if (!f) {
            s = not_found("no kernel family named '" + name + "'");
            break;
          }
          chosen.push_back(f);
        }
      }
    }
    if (!s.ok()) co_return error_reply(s);

    std::vector<std::function<BuildOutcome(bool)>> jobs;
    std::vector<std::string> labels;
    for (const auto& arch : archs)
      for (const Family* f : chosen)
        for (const Params& p : f->catalog()) {
          KernelSpec spec{std::string(f->name()), p};
          labels.push_back(spec.canonical() + " @ " + arch);
          jobs.push_back([this, spec, arch](bool run) { return build(spec, arch, run); });
        }
    log_info("prewarm: " + std::to_string(jobs.size()) + " variant(s) for " + std::to_string(archs.size()) +
             " arch(s)");
    const auto t0 = Clock::now();
    std::vector<BuildOutcome> out =
        co_await async_offload<BuildOutcome>(*compile_pool, WorkPool::Lane::background, std::move(jobs), use_awaitable);

    std::int64_t compiled = 0, cached = 0, failed = 0;
    json errors = json::array();
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (!out[i].status.ok()) {
        ++failed;
        if (errors.size() < k_max_prewarm_errors)
          errors.push_back(labels[i] + ": " + code_name(out[i].status.code()) + ": " + out[i].status.message());
      } else if (out[i].artifact.source == jit::ArtifactSource::compiled) {
        ++compiled;
      } else {
        ++cached;
      }
    }
    if (failed > static_cast<std::int64_t>(errors.size()))
      errors.push_back("... and " + std::to_string(failed - static_cast<std::int64_t>(errors.size())) +
                       " more failure(s)");
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    log_info("prewarm done in " + format_ms(ms) + " ms: " + std::to_string(compiled) + " compiled, " +
             std::to_string(cached) + " cached, " + std::to_string(failed) + " failed");
    json r = ok_reply();
    r["requested"] = static_cast<std::int64_t>(out.size());
    r["compiled"] = compiled;
    r["cached"] = cached;
    r["failed"] = failed;
    r["errors"] = std::move(errors);
    r["elapsed_ms"] = ms;
    co_return r;
  }

  awaitable<json> handle_list(const json& req) {
    cache::ListFilter filter;
    Status s = optional_string(req, "family", filter.family);
    if (s.ok()) s = optional_string(req, "arch", filter.arch);
    if (!s.ok()) co_return error_reply(s);

    std::vector<std::function<ListOutcome(bool)>> jobs;
    jobs.push_back([this, filter](bool run) {
      ListOutcome o;
      if (!run) {
        o.status = shutting_down_status();
        return o;
      }
      auto r = store->list(filter);
      if (r.ok())
        o.entries = std::move(r).value();
      else
        o.status = r.status();
      return o;
    });
    auto out = co_await async_offload<ListOutcome>(*aux_pool, WorkPool::Lane::interactive, std::move(jobs), use_awaitable);
    if (!out.front().status.ok()) co_return error_reply(out.front().status);
    json entries = json::array();
    for (const auto& e : out.front().entries) entries.push_back(entry_to_json(e));
    json r = ok_reply();
    r["entries"] = std::move(entries);
    co_return r;
  }

  // ---- tuning (docs/autotune.md) ---------------------------------------------------------------

  // Reads the family, problem and the other named string fields of a resolve or tune request, and
  // checks the problem against the family before anything is queued.
  Status read_tuning_request(const json& req, const Family*& family, Problem& problem) {
    std::string name;
    KILN_TRY(required_string(req, "family", name));
    family = Registry::global().find(name);
    if (!family) return not_found("no kernel family named '" + name + "'");
    auto it = req.find("problem");
    if (it == req.end()) return invalid_argument("missing field 'problem'");
    KILN_ASSIGN_OR_RETURN(problem, problem_from_json(*it));
    return family->check_problem(family->heuristic(problem), problem);
  }

  // Runs on the tune pool.
  TuneOutcome tune_now(const Family& family, const Problem& problem, int device, const std::string& pci, bool run) {
    TuneOutcome o;
    if (!run) {
      o.status = shutting_down_status();
      return o;
    }
    jit::TuneOptions opts;
    opts.device = device;
    if (!pci.empty()) {
      auto d = jit::device_by_pci(pci);
      if (!d.ok()) {
        o.status = d.status();
        return o;
      }
      opts.device = *d;
    }
    auto r = tuner->tune(family, problem, opts);
    if (!r.ok()) {
      o.status = r.status();
      log_warn("tuning " + std::string(family.name()) + " " + family.signature(problem) + " failed: " +
               o.status.message());
      return o;
    }
    o.record = std::move(r).value();
    log_info("tuned " + o.record.family + " " + o.record.signature + ": " +
             (o.record.winner.empty() ? std::string("no candidate ran ok") : o.record.winner + " " +
              format_ms(o.record.winner_ms * 1000.0) + " us (heuristic " + format_ms(o.record.heuristic_ms * 1000.0) +
              " us)") + ", " + std::to_string(o.record.candidates.size()) + " candidates, compile " +
             format_ms(o.record.compile_ms) + " ms, measure " + format_ms(o.record.measure_ms) + " ms");
    return o;
  }

  awaitable<TuneOutcome> run_tune(const Family* family, const Problem& problem, int device, const std::string& pci) {
    std::vector<std::function<TuneOutcome(bool)>> jobs;
    jobs.push_back([this, family, problem, device, pci](bool run) { return tune_now(*family, problem, device, pci, run); });
    auto out = co_await async_offload<TuneOutcome>(*tune_pool, WorkPool::Lane::interactive, std::move(jobs), use_awaitable);
    co_return std::move(out.front());
  }

  // Queues background tuning unless it is queued, running or failed already. True when queued.
  bool queue_tuning(const Family* family, const Problem& problem, const std::string& pci, const std::string& key) {
    {
      std::lock_guard lock(tune_queue.mu);
      if (tune_queue.pending.count(key)) return true;
      if (tune_queue.failed.count(key)) return false;
      tune_queue.pending.insert(key);
    }
    tune_pool->submit(WorkPool::Lane::background, [this, family, problem, pci, key](bool run) {
      TuneOutcome o = tune_now(*family, problem, 0, pci, run);
      std::lock_guard lock(tune_queue.mu);
      tune_queue.pending.erase(key);
      if (run && (!o.status.ok() || o.record.winner.empty())) tune_queue.failed.insert(key);
    });
    return true;
  }

  struct ResolveRequest {
    const Family* family = nullptr;
    Problem problem;
    std::string arch, device_name, driver_version, pci;
    jit::AutotuneMode mode = jit::AutotuneMode::off;
  };

  Status read_resolve_request(const json& req, ResolveRequest& out) {
    std::string mode_name = "off";
    KILN_TRY(read_tuning_request(req, out.family, out.problem));
    KILN_TRY(required_string(req, "arch", out.arch));
    KILN_TRY(validate_arch(out.arch));
    KILN_TRY(optional_string(req, "device_name", out.device_name));
    KILN_TRY(optional_string(req, "driver_version", out.driver_version));
    KILN_TRY(optional_string(req, "pci_bus_id", out.pci));
    KILN_TRY(optional_string(req, "autotune", mode_name));
    auto mode = jit::parse_autotune_mode(mode_name);
    if (!mode) return invalid_argument("autotune must be off, background or wait (got '" + mode_name + "')");
    out.mode = *mode;
    return {};
  }

  // The winner of a tuning run made now (resolve with autotune wait); nullopt if there is none.
  awaitable<std::optional<Params>> tune_for_resolve(const ResolveRequest& q, json& reply) {
    TuneOutcome t = co_await run_tune(q.family, q.problem, 0, q.pci);
    if (!t.status.ok()) {
      reply["tune_error"] = t.status.message();
      co_return std::nullopt;
    }
    co_return usable_winner(*q.family, t.record.winner, q.problem);
  }

  // GCC 12 warns here that asio's coroutine frame is freed by a mismatched operator delete: a false
  // positive of its inliner on class-specific frame allocators (the pair does match).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
  awaitable<json> handle_resolve(const json& req) {
    ResolveRequest q;
    if (Status s = read_resolve_request(req, q); !s.ok()) co_return error_reply(s);
    LookupOutcome found = co_await lookup_tuned(q.family, q.problem, q.arch, q.device_name, q.driver_version);
    if (!found.status.ok()) co_return error_reply(found.status);

    const std::string signature = q.family->signature(q.problem);
    json r = ok_reply();
    r["signature"] = signature;
    std::optional<Params> tuned;
    if (found.record) tuned = usable_winner(*q.family, found.record->winner, q.problem);
    bool queued = false;
    if (!tuned && q.mode == jit::AutotuneMode::wait) {
      tuned = co_await tune_for_resolve(q, r);
    } else if (!tuned && (q.mode == jit::AutotuneMode::background || options.autotune)) {
      const auto& st = found.setup;
      queued = queue_tuning(q.family, q.problem, q.pci,
                            std::string(q.family->name()) + "|" + signature + "|" + st.arch + "|" + st.device_name +
                                "|" + st.driver_version + "|" + st.toolchain);
    }
    r["params"] = (tuned ? *tuned : q.family->heuristic(q.problem)).canonical();
    r["tuned"] = tuned.has_value();
    r["queued"] = queued;
    co_return r;
  }
#pragma GCC diagnostic pop

  // The setup's fingerprint and the table row for problem's signature, on the cache pool.
  awaitable<LookupOutcome> lookup_tuned(const Family* family, const Problem& problem, const std::string& arch,
                                        const std::string& device_name, const std::string& driver_version) {
    const std::string signature = family->signature(problem);
    std::vector<std::function<LookupOutcome(bool)>> jobs;
    jobs.push_back([this, family, problem, arch, device_name, driver_version, signature](bool run) {
      LookupOutcome o;
      if (!run) {
        o.status = shutting_down_status();
        return o;
      }
      auto setup = jit::tuning_setup(*family, problem, arch, device_name, driver_version);
      if (!setup.ok()) {
        o.status = setup.status();
        return o;
      }
      o.setup = *setup;
      auto r = tuning->lookup(std::string(family->name()), signature, o.setup);
      if (r.ok())
        o.record = std::move(r).value();
      else
        o.status = r.status();
      return o;
    });
    auto out = co_await async_offload<LookupOutcome>(*aux_pool, WorkPool::Lane::interactive, std::move(jobs), use_awaitable);
    co_return std::move(out.front());
  }

  awaitable<json> handle_tune(const json& req) {
    const Family* family = nullptr;
    Problem problem;
    std::string pci;
    int device = 0;
    Status s = read_tuning_request(req, family, problem);
    if (s.ok()) s = optional_string(req, "pci_bus_id", pci);
    if (s.ok())
      if (auto it = req.find("device"); it != req.end()) {
        if (!it->is_number_integer() || it->get<std::int64_t>() < 0 || it->get<std::int64_t>() > 1024)
          s = invalid_argument("field 'device' must be a device ordinal");
        else
          device = it->get<int>();
      }
    if (!s.ok()) co_return error_reply(s);
    TuneOutcome t = co_await run_tune(family, problem, device, pci);
    if (!t.status.ok()) co_return error_reply(t.status);
    json r = ok_reply();
    r["record"] = tuning_record_to_json(t.record);
    co_return r;
  }

  awaitable<json> handle_stats() {
    std::vector<std::function<StatsOutcome(bool)>> jobs;
    jobs.push_back([this](bool run) {
      StatsOutcome o;
      if (!run) {
        o.status = shutting_down_status();
        return o;
      }
      auto r = store->stats();
      if (r.ok())
        o.stats = *r;
      else
        o.status = r.status();
      return o;
    });
    auto out = co_await async_offload<StatsOutcome>(*aux_pool, WorkPool::Lane::interactive, std::move(jobs), use_awaitable);
    if (!out.front().status.ok()) co_return error_reply(out.front().status);

    json r = ok_reply();
    r["daemon"] = {
        {"version", KILN_VERSION},
        {"protocol", k_protocol_version},
        {"pid", static_cast<std::int64_t>(::getpid())},
        {"uptime_s", std::chrono::duration<double>(Clock::now() - started).count()},
        {"connections", connections_total},
        {"active_connections", static_cast<std::int64_t>(connections.size())},
        {"requests", requests_total},
        {"errors", errors_total},
        {"evicted_connections", evicted_total},
        {"pch", options.use_pch},
        {"jobs", static_cast<std::int64_t>(compile_pool->threads())},
        {"compiles_running", static_cast<std::int64_t>(compile_pool->running())},
        {"compiles_queued", static_cast<std::int64_t>(compile_pool->queued())},
        {"compile_timeout_ms", static_cast<std::int64_t>(options.compile_timeout.count())},
        {"compile_timeouts", workers ? workers->timeouts() : 0},
        {"compile_worker_deaths", workers ? workers->worker_deaths() : 0},
        {"compile_workers_started", workers ? workers->workers_started() : 0},
        {"socket", instance->socket_path().string()},
    };
    r["builder"] = builder_stats_to_json(builder->stats());
    json cache_json = store_stats_to_json(out.front().stats);
    cache_json["path"] = store->path().string();
    r["cache"] = std::move(cache_json);
    co_return r;
  }
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() {
  if (impl_ && impl_->compile_pool) {
    impl_->compile_pool->stop();
    impl_->aux_pool->stop();
    impl_->tune_pool->stop();
  }
}

Result<std::unique_ptr<Server>> Server::create(const ServerOptions& options, bool* already_running) {
  if (already_running) *already_running = false;
  if (options.socket.empty()) return invalid_argument("no socket path");
  if (options.cache_file.empty()) return invalid_argument("no cache file");

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (impl->options.jobs == 0) impl->options.jobs = std::max(1u, std::thread::hardware_concurrency());

  ClaimError claim_error;
  impl->instance = Instance::claim(options.socket, claim_error);
  if (!impl->instance) {
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
  impl->store = std::move(store).value();
  if (impl->store->read_only())
    log_warn("the cache " + options.cache_file.string() +
             " is read-only: cached kernels are served, new ones are compiled but not stored");
  jit::BuilderOptions bo;
  bo.use_pch = options.use_pch;
  if (options.compile_timeout.count() > 0) {
    // /proc/self/exe, not its target: the running image, even after kilnd is replaced on disk,
    // so a worker always speaks its daemon's pipe format.
    impl->workers = std::make_unique<CompileWorkers>("/proc/self/exe", options.compile_timeout);
    bo.compiler = [w = impl->workers.get()](const jit::CompileRequest& r) { return w->compile(r); };
  }
  impl->builder = std::make_unique<jit::Builder>(impl->store.get(), &Registry::global(), bo);

  boost::system::error_code ec;
  int fd = impl->instance->release_listen_fd();
  impl->acceptor.assign(asio::local::stream_protocol(), fd, ec);
  if (ec) {
    ::close(fd);
    return io_error("cannot listen on " + options.socket.string() + ": " + ec.message());
  }
  impl->compile_pool = std::make_unique<WorkPool>(impl->options.jobs, "compile pool");
  impl->aux_pool = std::make_unique<WorkPool>(1, "cache pool");
  auto tuning = cache::TuningTable::open(*impl->store);
  if (!tuning.ok()) return tuning.status();
  impl->tuning = std::move(tuning).value();
  impl->tuner = std::make_unique<jit::Tuner>(impl->builder.get(), impl->tuning.get());
  impl->tune_pool = std::make_unique<WorkPool>(1, "tune pool");
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
           ", pch " + (s.options.use_pch ? "on" : "off") + ", cache " + s.store->path().string() + ")");
  asio::co_spawn(s.io, s.wait_signals(), asio::detached);
  asio::co_spawn(s.io, s.accept_loop(), asio::detached);
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
  s.tune_pool->join();
  // Nothing writes any more: fold the WAL into the database so the file stands alone.
  if (Status cs = s.store->checkpoint(); !cs.ok()) log_warn("WAL checkpoint at stop failed: " + cs.to_string());
  s.instance->remove_socket();
  const double up = std::chrono::duration<double>(Clock::now() - s.started).count();
  log_info("stopped after " + format_ms(up * 1000.0) + " ms: " + std::to_string(s.connections_total) +
           " connection(s), " + std::to_string(s.requests_total) + " request(s), " + std::to_string(s.errors_total) +
           " error(s)");
  return code;
}

void Server::request_stop() {
  Impl* s = impl_.get();
  asio::post(s->io, [s] { s->begin_stop("stop requested"); });
}

}  // namespace kiln::daemon
