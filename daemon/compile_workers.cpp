#include "daemon/compile_workers.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <string>

#include <nlohmann/json.hpp>

extern char** environ;

namespace kiln::daemon {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// Upper bounds on what a worker may send back, checked before allocating.
constexpr std::uint32_t k_max_reply_json = 64u << 20;
constexpr std::uint32_t k_max_cubin = 256u << 20;

bool write_all(int fd, const void* data, std::size_t n) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= std::size_t(w);
  }
  return true;
}

bool write_chunk(int fd, const std::string& bytes) {
  const std::uint32_t n = std::uint32_t(bytes.size());
  const unsigned char len[4] = {std::uint8_t(n), std::uint8_t(n >> 8), std::uint8_t(n >> 16), std::uint8_t(n >> 24)};
  return write_all(fd, len, 4) && write_all(fd, bytes.data(), bytes.size());
}

// Reads exactly n bytes before `until` (Clock::time_point::max(): no deadline). 1: done,
// 0: EOF, -1: error, -2: deadline.
int read_exact(int fd, char* out, std::size_t n, Clock::time_point until) {
  std::size_t got = 0;
  while (got < n) {
    if (until != Clock::time_point::max()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
      if (left <= 0) return -2;
      pollfd p{fd, POLLIN, 0};
      int pr = ::poll(&p, 1, int(std::min<long long>(left, 1 << 30)));
      if (pr < 0 && errno == EINTR) continue;
      if (pr < 0) return -1;
      if (pr == 0) return -2;
    }
    ssize_t r = ::read(fd, out + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) return 0;
    got += std::size_t(r);
  }
  return 1;
}

int read_chunk(int fd, std::string& out, std::uint32_t max, Clock::time_point until) {
  unsigned char len[4];
  int r = read_exact(fd, reinterpret_cast<char*>(len), 4, until);
  if (r != 1) return r;
  const std::uint32_t n = std::uint32_t(len[0]) | std::uint32_t(len[1]) << 8 | std::uint32_t(len[2]) << 16 |
                          std::uint32_t(len[3]) << 24;
  if (n > max) return -1;
  out.assign(n, '\0');
  return read_exact(fd, out.data(), n, until);
}

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + std::to_string(WTERMSIG(status));
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  return "ended";
}

}  // namespace

CompileWorkers::CompileWorkers(std::filesystem::path exe, std::chrono::milliseconds deadline)
    : exe_(std::move(exe)), deadline_(deadline) {}

CompileWorkers::~CompileWorkers() {
  std::lock_guard lock(mu_);
  for (auto& w : idle_) discard(w);
}

void CompileWorkers::discard(Worker& w) {
  if (w.to_child >= 0) ::close(w.to_child);
  if (w.from_child >= 0) ::close(w.from_child);
  if (w.pid > 0) {
    ::kill(w.pid, SIGKILL);
    int st = 0;
    while (::waitpid(w.pid, &st, 0) < 0 && errno == EINTR) {
    }
    // Killed, the worker could not remove its precompiled-header directory itself.
    jit::remove_dead_pch_dirs();
  }
  w = Worker{};
}

Result<CompileWorkers::Worker> CompileWorkers::spawn() {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return io_error(std::string("pipe for a compile worker: ") + std::strerror(errno));
  if (::pipe2(out, O_CLOEXEC) != 0) {
    ::close(in[0]);
    ::close(in[1]);
    return io_error(std::string("pipe for a compile worker: ") + std::strerror(errno));
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  std::string exe = exe_.string(), flag = "--compile-worker";
  char* argv[] = {exe.data(), flag.data(), nullptr};
  Worker w;
  int rc = ::posix_spawn(&w.pid, exe.c_str(), &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(in[0]);
  ::close(out[1]);
  w.to_child = in[1];
  w.from_child = out[0];
  if (rc != 0) {
    w.pid = -1;
    discard(w);
    return unavailable("cannot start a compile worker " + exe + ": " + std::strerror(rc));
  }
  ++started_;
  return w;
}

Result<jit::CompileOutput> CompileWorkers::compile(const jit::CompileRequest& req) {
  Worker w;
  {
    std::lock_guard lock(mu_);
    if (!idle_.empty()) {
      w = idle_.back();
      idle_.pop_back();
    }
  }
  // An idle worker never writes: if its pipe is readable or hung up, it died while waiting
  // (killed from outside). That is not this compile's fault: start a fresh one.
  if (w.pid >= 0) {
    pollfd p{w.from_child, POLLIN, 0};
    if (::poll(&p, 1, 0) != 0) {
      discard(w);
      ++deaths_;
    }
  }
  if (w.pid < 0) {
    KILN_ASSIGN_OR_RETURN(w, spawn());
  }

  const json request = {{"source", req.source},   {"name_expression", req.name_expression},
                        {"options", req.options}, {"arch", req.arch},
                        {"use_pch", req.use_pch},
                        {"overlay", req.overlay ? *req.overlay : std::map<std::string, std::string>{}}};
  const auto until = Clock::now() + deadline_;
  std::string reply_text, cubin;
  int r = write_chunk(w.to_child, request.dump()) ? 1 : -1;
  if (r == 1) r = read_chunk(w.from_child, reply_text, k_max_reply_json, until);
  if (r == 1) r = read_chunk(w.from_child, cubin, k_max_cubin, until);
  if (r == -2) {
    discard(w);
    ++timeouts_;
    return Status(Code::timeout,
                  "compiling " + req.name_expression + " for " + req.arch + " took longer than the " +
                      std::to_string(deadline_.count()) + " ms compile deadline; the compile was cancelled",
                  "kilnd --compile-timeout-ms sets the deadline");
  }
  if (r != 1) {
    // The worker died (NVRTC crashed, out of memory ...) or broke the pipe format.
    const pid_t pid = w.pid;
    ::close(w.to_child);
    ::close(w.from_child);
    int st = 0;
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    ++deaths_;
    return internal_error("the compile worker for " + req.name_expression + " failed: " + describe_exit(st));
  }

  json reply = json::parse(reply_text, nullptr, false);
  if (reply.is_discarded() || !reply.is_object()) {
    discard(w);
    ++deaths_;
    return internal_error("the compile worker answered malformed JSON");
  }
  {
    std::lock_guard lock(mu_);
    idle_.push_back(w);
  }
  if (!reply.value("ok", false))
    return Status(static_cast<Code>(reply.value("code", int(Code::internal))), reply.value("message", std::string()),
                  reply.value("details", std::string()));
  jit::CompileOutput o;
  o.cubin = std::move(cubin);
  o.lowered_name = reply.value("lowered_name", std::string());
  o.log = reply.value("log", std::string());
  o.options = reply.value("options", std::vector<std::string>{});
  o.compile_ms = reply.value("compile_ms", 0.0);
  o.registers = reply.value("registers", -1);
  o.shared_bytes = reply.value("shared_bytes", -1);
  o.spill_bytes = reply.value("spill_bytes", -1);
  return o;
}

int run_compile_worker() {
  // A worker never outlives its daemon: a SIGKILLed kilnd must not leave a runaway compile behind.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 1;  // the daemon died before the line above
  std::signal(SIGPIPE, SIG_IGN);
  for (;;) {
    std::string text;
    int r = read_chunk(0, text, 64u << 20, Clock::time_point::max());
    if (r == 0) return 0;  // the daemon closed the pipe: done
    if (r != 1) return 1;
    json q = json::parse(text, nullptr, false);
    if (q.is_discarded() || !q.is_object()) return 1;
    jit::CompileRequest req;
    req.source = q.value("source", std::string());
    req.name_expression = q.value("name_expression", std::string());
    req.options = q.value("options", std::vector<std::string>{});
    req.arch = q.value("arch", std::string());
    req.use_pch = q.value("use_pch", false);
    const auto overlay = q.value("overlay", std::map<std::string, std::string>{});
    if (!overlay.empty()) req.overlay = &overlay;
    json reply;
    std::string cubin;
    auto nvrtc = jit::Nvrtc::get();
    Result<jit::CompileOutput> out = nvrtc.ok() ? (*nvrtc)->compile(req) : Result<jit::CompileOutput>(nvrtc.status());
    if (!out.ok()) {
      reply = {{"ok", false},
               {"code", int(out.status().code())},
               {"message", out.status().message()},
               {"details", out.status().details()}};
    } else {
      reply = {{"ok", true},
               {"lowered_name", out->lowered_name},
               {"log", out->log},
               {"options", out->options},
               {"compile_ms", out->compile_ms},
               {"registers", out->registers},
               {"shared_bytes", out->shared_bytes},
               {"spill_bytes", out->spill_bytes}};
      cubin = std::move(out->cubin);
    }
    // A compile log can hold any byte: replace invalid UTF-8 rather than throw.
    const std::string text_out = reply.dump(-1, ' ', false, json::error_handler_t::replace);
    if (!write_chunk(1, text_out) || !write_chunk(1, cubin)) return 1;
  }
}

}  // namespace kiln::daemon
