// kilnd: the kiln daemon. Always runs in the foreground; `kiln daemon start` detaches it.
//
// Exit codes: 0 after a graceful stop, 1 on bad flags or a startup failure, 3 when another kilnd
// already serves the socket.
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "common/paths.h"
#include "daemon/compile_workers.h"
#include "daemon/metrics_http.h"
#include "daemon/server.h"
#include "kiln/family.h"
#include "remote/config.h"

namespace {

constexpr const char* k_usage =
    "usage: kilnd [--socket PATH] [--cache-dir DIR] [--jobs N] [--no-pch] [--autotune] [--foreground]\n"
    "             [--idle-timeout-ms MS] [--frame-timeout-ms MS] [--max-connections N]\n"
    "             [--compile-timeout-ms MS] [--remote URL --fleet-key-file FILE\n"
    "             [--remote-password-file FILE] [--remote-timeout-ms MS] [--remote-lock-ms MS]\n"
    "             [--remote-ca-file FILE] [--remote-cert-file FILE --remote-key-file FILE]\n"
    "             [--remote-tls-name NAME]] [--metrics-listen HOST:PORT]\n"
    "\n"
    "Serves compiled CUDA kernels to kiln clients over a Unix socket.\n"
    "\n"
    "  --socket PATH          socket to listen on (default: $KILN_SOCKET, else\n"
    "                         $XDG_RUNTIME_DIR/kiln/kilnd.sock, else /tmp/kiln-<uid>/kilnd.sock)\n"
    "  --cache-dir DIR        kernel cache directory (default: $KILN_CACHE_DIR, else\n"
    "                         $XDG_CACHE_HOME/kiln, else ~/.cache/kiln)\n"
    "  --jobs N               compile worker threads (default: number of CPUs)\n"
    "  --no-pch               disable NVRTC precompiled headers\n"
    "  --autotune             tune every problem a client resolves that has no tuned winner yet, in\n"
    "                         the background (docs/autotune.md)\n"
    "  --foreground           accepted for compatibility; kilnd never detaches itself\n"
    "  --idle-timeout-ms MS   close connections idle this long (default 60000)\n"
    "  --frame-timeout-ms MS  a request frame must arrive within this time (default 10000)\n"
    "  --compile-timeout-ms MS  a compile running longer is cancelled (its worker process killed)\n"
    "                         and fails with a timeout error (default 60000; 0: compile in the\n"
    "                         daemon's own process, without a deadline)\n"
    "  --max-connections N    open connections at most; at the cap the longest-waiting one that\n"
    "                         is not being served is closed for a new one (default 256)\n"
    "  --remote URL           a Redis server shared by a fleet: redis://[user@]host[:port][/db],\n"
    "                         rediss://... (TLS) or unix:///path/redis.sock; asked on a local cache\n"
    "                         miss before compiling, given what is compiled and tuned here\n"
    "                         (default: $KILN_REMOTE; none)\n"
    "  --fleet-key-file FILE  the key entries are signed with, mode 0600 (default: $KILN_FLEET_KEY_FILE)\n"
    "  --remote-password-file FILE  Redis AUTH password (with the URL's user), mode 0600\n"
    "                         (default: $KILN_REMOTE_PASSWORD_FILE)\n"
    "  --remote-timeout-ms MS how long a miss waits for the remote (default: $KILN_REMOTE_TIMEOUT_MS, else 50)\n"
    "  --remote-lock-ms MS    hosts missing the same kernel: one compiles under a lock this long, the\n"
    "                         others wait at most this long for its record (default:\n"
    "                         $KILN_REMOTE_LOCK_MS, else 30000; 0: every host compiles)\n"
    "  --remote-ca-file FILE  rediss://: the CA certificates (PEM) the server's must chain to\n"
    "                         (default: $KILN_REMOTE_CA_FILE, else the system's)\n"
    "  --remote-cert-file FILE, --remote-key-file FILE  rediss://: a client certificate (PEM) and its\n"
    "                         key, mode 0600 (default: $KILN_REMOTE_CERT_FILE, $KILN_REMOTE_KEY_FILE)\n"
    "  --remote-tls-name NAME rediss://: the name the server's certificate must carry (default:\n"
    "                         $KILN_REMOTE_TLS_NAME, else the URL's host)\n"
    "  --metrics-listen HOST:PORT  also serve GET /metrics (Prometheus text) over HTTP there, e.g.\n"
    "                         127.0.0.1:9464 (port 0: any free port; see kiln stats)\n"
    "  --help, --version\n";

int bad_usage(const std::string& message) {
  std::fprintf(stderr, "kilnd: %s\n(run 'kilnd --help' for usage)\n", message.c_str());
  return kiln::daemon::k_exit_error;
}

std::optional<long long> parse_positive(std::string_view text, long long max) {
  long long v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || v <= 0 || v > max) return std::nullopt;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kiln::daemon;
  // The compile worker kilnd starts for itself (daemon/compile_workers.h); not for people.
  if (argc == 2 && std::string_view(argv[1]) == "--compile-worker") return run_compile_worker();
  ServerOptions options;
  std::string socket_flag, cache_dir_flag;
  // The remote tier: the environment, each setting overridden by its flag.
  auto remote_env = kiln::remote::settings_from_env();
  if (!remote_env.ok()) return bad_usage(remote_env.status().message());
  kiln::remote::Settings remote = std::move(remote_env).value();
  bool remote_flags = false;

  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::optional<std::string> inline_value;
    if (arg.rfind("--", 0) == 0) {
      if (auto eq = arg.find('='); eq != std::string::npos) {
        inline_value = arg.substr(eq + 1);
        arg = arg.substr(0, eq);
      }
    }
    auto value = [&](std::string& out) -> bool {
      if (inline_value) {
        out = *inline_value;
      } else {
        if (i + 1 >= argc) return false;
        out = argv[++i];
      }
      return true;
    };
    auto flag_only = [&]() { return !inline_value.has_value(); };

    std::string v;
    if (arg == "--help" || arg == "-h") {
      std::fputs(k_usage, stdout);
      return k_exit_ok;
    } else if (arg == "--version") {
      std::printf("kilnd %s\n", KILN_VERSION);
      return k_exit_ok;
    } else if (arg == "--socket") {
      if (!value(v) || v.empty()) return bad_usage("--socket needs a path");
      socket_flag = v;
    } else if (arg == "--cache-dir") {
      if (!value(v) || v.empty()) return bad_usage("--cache-dir needs a directory");
      cache_dir_flag = v;
    } else if (arg == "--jobs" || arg == "-j") {
      if (!value(v)) return bad_usage("--jobs needs a number");
      auto n = parse_positive(v, 1024);
      if (!n) return bad_usage("--jobs must be an integer between 1 and 1024, not '" + v + "'");
      options.jobs = static_cast<std::size_t>(*n);
    } else if (arg == "--idle-timeout-ms" || arg == "--frame-timeout-ms") {
      if (!value(v)) return bad_usage(arg + " needs a number of milliseconds");
      auto n = parse_positive(v, 24LL * 3600 * 1000);
      if (!n) return bad_usage(arg + " must be a positive number of milliseconds, not '" + v + "'");
      (arg == "--idle-timeout-ms" ? options.idle_timeout : options.frame_timeout) = std::chrono::milliseconds(*n);
    } else if (arg == "--compile-timeout-ms") {
      if (!value(v)) return bad_usage("--compile-timeout-ms needs a number of milliseconds");
      auto n = v == "0" ? std::optional<long long>(0) : parse_positive(v, 24LL * 3600 * 1000);
      if (!n) return bad_usage("--compile-timeout-ms must be 0 or a positive number of milliseconds, not '" + v + "'");
      options.compile_timeout = std::chrono::milliseconds(*n);
    } else if (arg == "--max-connections") {
      if (!value(v)) return bad_usage("--max-connections needs a number");
      auto n = parse_positive(v, 100000);
      if (!n) return bad_usage("--max-connections must be an integer between 1 and 100000, not '" + v + "'");
      options.max_connections = static_cast<std::size_t>(*n);
    } else if (arg == "--remote") {
      if (!value(v) || v.empty()) return bad_usage("--remote needs a URL");
      remote.url = v;
    } else if (arg == "--fleet-key-file" || arg == "--remote-password-file" || arg == "--remote-ca-file" ||
               arg == "--remote-cert-file" || arg == "--remote-key-file") {
      if (!value(v) || v.empty()) return bad_usage(arg + " needs a file");
      (arg == "--fleet-key-file"         ? remote.key_file
       : arg == "--remote-password-file" ? remote.password_file
       : arg == "--remote-ca-file"       ? remote.tls_ca_file
       : arg == "--remote-cert-file"     ? remote.tls_cert_file
                                         : remote.tls_key_file) = v;
      remote_flags = true;
    } else if (arg == "--remote-tls-name") {
      if (!value(v) || v.empty()) return bad_usage("--remote-tls-name needs a host name or IP address");
      remote.tls_name = v;
      remote_flags = true;
    } else if (arg == "--remote-timeout-ms") {
      if (!value(v)) return bad_usage("--remote-timeout-ms needs a number of milliseconds");
      auto n = parse_positive(v, 60'000);
      if (!n) return bad_usage("--remote-timeout-ms must be 1..60000, not '" + v + "'");
      remote.timeout_ms = *n;
      remote_flags = true;
    } else if (arg == "--remote-lock-ms") {
      if (!value(v)) return bad_usage("--remote-lock-ms needs a number of milliseconds");
      auto n = v == "0" ? std::optional<long long>(0) : parse_positive(v, 600'000);
      if (!n) return bad_usage("--remote-lock-ms must be 0..600000, not '" + v + "'");
      remote.lock_ms = *n;
      remote_flags = true;
    } else if (arg == "--metrics-listen") {
      if (!value(v) || v.empty()) return bad_usage("--metrics-listen needs HOST:PORT");
      std::string host;
      unsigned short port = 0;
      if (kiln::Status s = parse_listen_address(v, host, port); !s.ok()) return bad_usage(s.message());
      options.metrics_listen = v;
    } else if (arg == "--no-pch") {
      if (!flag_only()) return bad_usage("--no-pch takes no value");
      options.use_pch = false;
    } else if (arg == "--autotune") {
      if (!flag_only()) return bad_usage("--autotune takes no value");
      options.autotune = true;
    } else if (arg == "--foreground") {
      if (!flag_only()) return bad_usage("--foreground takes no value");
    } else {
      return bad_usage("unknown argument '" + std::string(argv[i]) + "'");
    }
  }

  options.socket = socket_flag.empty() ? kiln::socket_path() : std::filesystem::path(socket_flag);
  options.cache_file = cache_dir_flag.empty() ? kiln::cache_file()
                                              : std::filesystem::path(cache_dir_flag) / "kernels.sqlite";

  // A bad URL, an unsafe key file or an unusable certificate stops kilnd here, before it serves
  // anything.
  if (!remote.url.empty()) {
    auto c = kiln::remote::make_config(remote);
    if (!c.ok()) return bad_usage(c.status().message() + (c.status().details().empty() ? "" : " (" + c.status().details() + ")"));
    options.remote = std::move(c).value();
  } else if (remote_flags) {
    return bad_usage("the --remote-* and --fleet-key-file flags need --remote (or KILN_REMOTE)");
  }

  // Plugins load now, once: a skipped one is in the log from the start, and none can surprise a
  // request later (docs/plugins.md).
  (void)kiln::Registry::global();

  bool already_running = false;
  auto server = Server::create(options, &already_running);
  if (!server.ok()) {
    const kiln::Status& s = server.status();
    std::fprintf(stderr, "kilnd: %s\n", s.message().c_str());
    if (!s.details().empty()) std::fprintf(stderr, "kilnd: %s\n", s.details().c_str());
    return already_running ? k_exit_already_running : k_exit_error;
  }
  return (*server)->run();
}
