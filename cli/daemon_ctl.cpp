// `kiln daemon start|stop|status`: run kilnd in the background and ask it how it is.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <thread>

#include "cli/cli.h"
#include "common/paths.h"

namespace kiln::cli {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr auto k_start_timeout = 10s;
constexpr auto k_stop_timeout = 10s;
constexpr auto k_poll = 50ms;
// kilnd's exit code when another daemon already serves the socket (daemon/server.h).
constexpr int k_kilnd_already_running = 3;

std::filesystem::path log_file() { return runtime_dir() / "kilnd.log"; }

// What a running daemon says about itself. Its stats' "daemon" section carries these; fields a
// daemon does not report stay unset and are printed as unknown.
struct DaemonInfo {
  long pid = 0;
  std::string version;
  std::optional<double> uptime_s;
  nlohmann::json stats;
};

DaemonInfo describe(client::DaemonClient& c) {
  DaemonInfo info;
  auto st = c.stats();
  if (!st.ok()) return info;
  info.stats = *st;
  const auto d = st->value("daemon", nlohmann::json::object());
  if (!d.is_object()) return info;
  if (auto it = d.find("pid"); it != d.end() && it->is_number()) info.pid = it->get<long>();
  if (auto it = d.find("version"); it != d.end() && it->is_string()) info.version = it->get<std::string>();
  for (const char* k : {"uptime_s", "uptime_seconds", "uptime"})
    if (auto it = d.find(k); it != d.end() && it->is_number()) info.uptime_s = it->get<double>();
  if (auto it = d.find("uptime_ms"); !info.uptime_s && it != d.end() && it->is_number())
    info.uptime_s = it->get<double>() / 1000.0;
  if (auto it = d.find("started"); !info.uptime_s && it != d.end() && it->is_number())
    info.uptime_s = static_cast<double>(std::time(nullptr) - it->get<std::int64_t>());
  return info;
}

// kilnd next to this executable, unless $KILN_KILND names another.
Result<std::filesystem::path> find_kilnd() {
  std::filesystem::path p;
  if (const char* env = std::getenv("KILN_KILND"); env && *env) {
    p = env;
  } else {
    std::error_code ec;
    auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) return io_error("cannot find this executable through /proc/self/exe: " + ec.message(),
                            "set KILN_KILND to the kilnd executable");
    p = self.parent_path() / "kilnd";
  }
  if (::access(p.c_str(), X_OK) != 0)
    return not_found("kilnd not found or not executable at " + p.string() + ": " + std::strerror(errno),
                     "kilnd is looked for next to kiln; set KILN_KILND to use another");
  return p;
}

// Relative locations in the environment would change meaning once kilnd leaves our directory.
void absolutize_env(const char* var) {
  const char* v = std::getenv(var);
  if (!v || !*v || std::filesystem::path(v).is_absolute()) return;
  std::error_code ec;
  auto abs = std::filesystem::absolute(v, ec);
  if (!ec) ::setenv(var, abs.c_str(), 1);
}

constexpr const char* k_log_marker = "---- kiln daemon start ";

// The last lines kilnd wrote since our start marker: older runs' lines would only mislead.
std::string tail_of(const std::filesystem::path& file, std::size_t max_lines) {
  std::ifstream in(file);
  std::vector<std::string> lines;
  std::string l;
  while (std::getline(in, l)) {
    if (l.rfind(k_log_marker, 0) == 0) lines.clear();
    lines.push_back(l);
  }
  const std::size_t first = lines.size() > max_lines ? lines.size() - max_lines : 0;
  std::string out;
  for (std::size_t i = first; i < lines.size(); ++i) out += lines[i] + "\n";
  return out.empty() ? "(empty)\n" : out;
}

// Gone, or a zombie nobody reaps yet (a container's init may never reap): both no longer serve.
bool process_gone(long pid) {
  if (pid <= 0) return true;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  std::getline(stat, content);
  const auto close = content.rfind(')');
  return close != std::string::npos && close + 2 < content.size() && content[close + 2] == 'Z';
}

[[noreturn]] void exec_child(const std::filesystem::path& kilnd, std::vector<std::string>& args, int log_fd) {
  // A session of its own: the terminal's hangup and Ctrl-C must not reach the daemon.
  ::setsid();
  int null_fd = ::open("/dev/null", O_RDONLY);
  if (null_fd >= 0) ::dup2(null_fd, 0);
  ::dup2(log_fd, 1);
  ::dup2(log_fd, 2);
  // Descriptors inherited from whoever ran kiln (a test harness's pipes, say) would keep those
  // alive for the daemon's whole life.
#ifdef SYS_close_range
  if (::syscall(SYS_close_range, 3u, ~0u, 0u) != 0)
#endif
    for (int fd = 3; fd < 1024; ++fd) ::close(fd);
  if (::chdir("/") != 0) { /* harmless: only keeps a directory busy */ }
  ::umask(077);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execv(kilnd.c_str(), argv.data());
  const std::string msg = "kiln: cannot execute " + kilnd.string() + ": " + std::strerror(errno) + "\n";
  (void)!::write(2, msg.data(), msg.size());
  ::_exit(127);
}

}  // namespace

int run_daemon_start(const GlobalOptions& g, const DaemonStartOptions& o) {
  const auto socket = socket_path();
  if (auto c = client::DaemonClient::connect(socket); c.ok()) {
    const auto info = describe(**c);
    std::cout << "kilnd is already running (pid " << (info.pid ? std::to_string(info.pid) : "?")
              << ") at " << socket.string() << "\n";
    return k_exit_ok;
  }

  auto kilnd = find_kilnd();
  if (!kilnd.ok()) return report_error(kilnd.status());
  if (Status s = ensure_private_dir(runtime_dir()); !s.ok()) return report_error(s);
  for (const char* v : {"KILN_CACHE_DIR", "KILN_SOCKET", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR", "HOME"})
    absolutize_env(v);

  const auto log = log_file();
  int log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (log_fd < 0) return report_error(io_error("cannot open " + log.string() + ": " + std::strerror(errno)));
  {
    // A marker so that one start's lines can be told from the previous run's in an appended log.
    const std::string mark = k_log_marker + format_time(std::time(nullptr)) + " ----\n";
    (void)!::write(log_fd, mark.data(), mark.size());
  }

  std::vector<std::string> args = {kilnd->string()};
  if (o.jobs) {
    args.push_back("--jobs");
    args.push_back(std::to_string(*o.jobs));
  }
  if (o.no_pch) args.push_back("--no-pch");

  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log_fd);
    return report_error(internal_error(std::string("fork failed: ") + std::strerror(errno)));
  }
  if (pid == 0) exec_child(*kilnd, args, log_fd);
  ::close(log_fd);

  // kilnd is our child until we exit (then init adopts it), so an early death is seen here with
  // its exit status rather than as a silent timeout.
  const auto deadline = Clock::now() + k_start_timeout;
  while (Clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      if (WIFEXITED(status) && WEXITSTATUS(status) == k_kilnd_already_running) {
        std::cout << "kilnd is already running at " << socket.string() << "\n";
        return k_exit_ok;
      }
      const std::string how = WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                                : "was killed by signal " + std::to_string(WTERMSIG(status));
      print_error("kilnd " + how + " before it answered",
                  "last lines of " + log.string() + ":\n" + tail_of(log, 20));
      return k_exit_failure;
    }
    if (auto c = client::DaemonClient::connect(socket, 500ms); c.ok()) {
      const auto info = describe(**c);
      std::cout << "kilnd started: pid " << pid << ", socket " << socket.string() << ", log "
                << log.string() << "\n";
      if (info.pid && info.pid != pid)
        print_warning("the daemon answering reports pid " + std::to_string(info.pid));
      return k_exit_ok;
    }
    std::this_thread::sleep_for(k_poll);
  }
  // A daemon that does not answer within the timeout is of no use and would hold the socket's
  // lock: stop it rather than leave it behind.
  ::kill(pid, SIGTERM);
  print_error("kilnd did not answer on " + socket.string() + " within " +
                  std::to_string(std::chrono::duration_cast<std::chrono::seconds>(k_start_timeout).count()) +
                  " s; stopped it",
              "last lines of " + log.string() + ":\n" + tail_of(log, 20));
  return k_exit_failure;
}

int run_daemon_stop(const GlobalOptions& g) {
  const auto socket = socket_path();
  auto c = client::DaemonClient::connect(socket);
  if (!c.ok()) {
    if (c.status().code() != Code::unavailable) return report_error(c.status());
    std::cout << "kilnd is not running (" << socket.string() << ")\n";
    return k_exit_ok;
  }
  const auto info = describe(**c);
  if (Status s = (*c)->shutdown(); !s.ok()) return report_error(s);
  c->reset();  // drop our connection so that it does not delay the drain

  const auto deadline = Clock::now() + k_stop_timeout;
  while (Clock::now() < deadline) {
    std::error_code ec;
    const bool socket_gone = !std::filesystem::exists(socket, ec);
    if (socket_gone && process_gone(info.pid)) {
      std::cout << "kilnd stopped (pid " << (info.pid ? std::to_string(info.pid) : "?") << ")\n";
      return k_exit_ok;
    }
    std::this_thread::sleep_for(k_poll);
  }
  print_error("kilnd acknowledged the shutdown but is still there after " +
                  std::to_string(std::chrono::duration_cast<std::chrono::seconds>(k_stop_timeout).count()) + " s",
              "it may be finishing long compiles; socket " + socket.string() +
                  (info.pid ? ", pid " + std::to_string(info.pid) : std::string()));
  return k_exit_failure;
}

int run_daemon_status(const GlobalOptions& g, bool json) {
  const auto socket = socket_path();
  auto c = client::DaemonClient::connect(socket);
  if (!c.ok()) {
    const bool plain_absence = c.status().code() == Code::unavailable;
    if (json) {
      nlohmann::json j = {{"running", false}, {"socket", socket.string()}};
      if (!plain_absence) j["error"] = c.status().to_string();
      std::cout << j.dump(2) << "\n";
    } else {
      std::cout << "kilnd is not running (" << socket.string() << ")\n";
    }
    // A socket that exists but does not answer is a problem, not just an absence.
    if (!plain_absence) return report_error(c.status());
    return k_exit_not_running;
  }
  const auto info = describe(**c);
  if (json) {
    nlohmann::json j = {{"running", true},
                        {"pid", info.pid ? nlohmann::json(info.pid) : nlohmann::json()},
                        {"version", info.version.empty() ? nlohmann::json() : nlohmann::json(info.version)},
                        {"socket", socket.string()},
                        {"uptime_s", info.uptime_s ? nlohmann::json(*info.uptime_s) : nlohmann::json()},
                        {"log", log_file().string()},
                        {"stats", info.stats}};
    std::cout << j.dump(2) << "\n";
    return k_exit_ok;
  }
  std::cout << "kilnd is running\n"
            << "  pid      " << (info.pid ? std::to_string(info.pid) : "unknown") << "\n"
            << "  version  " << (info.version.empty() ? "unknown" : info.version) << "\n"
            << "  socket   " << socket.string() << "\n"
            << "  uptime   " << (info.uptime_s ? human_duration(*info.uptime_s) : "unknown") << "\n"
            << "  log      " << log_file().string() << "\n";
  return k_exit_ok;
}

}  // namespace kiln::cli
