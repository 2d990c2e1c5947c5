#include "remote/config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "remote/tls.h"

namespace kiln::remote {
namespace {

std::optional<long long> parse_int(std::string_view s, long long lo, long long hi) {
  long long v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v < lo || v > hi) return std::nullopt;
  return v;
}

Status bad_url(const std::string& url, const std::string& why) {
  return invalid_argument("bad remote URL '" + url + "': " + why,
                          "expected redis://[user@]host[:port][/db], rediss://... (TLS) or "
                          "unix:///path/to/redis.sock[?db=N]");
}

Status parse_url(const std::string& url, Config& c, bool& tls) {
  std::string_view rest(url);
  if (rest.starts_with("unix://")) {
    rest.remove_prefix(7);
    std::string_view query;
    if (auto q = rest.find('?'); q != std::string_view::npos) {
      query = rest.substr(q + 1);
      rest = rest.substr(0, q);
    }
    if (rest.empty() || rest.front() != '/') return bad_url(url, "a Unix socket path must be absolute");
    c.endpoint.unix_path = std::string(rest);
    if (!query.empty()) {
      if (!query.starts_with("db=")) return bad_url(url, "the only query parameter is db=N");
      auto db = parse_int(query.substr(3), 0, 1 << 20);
      if (!db) return bad_url(url, "db must be a non-negative integer");
      c.db = int(*db);
    }
    return {};
  }
  if (rest.starts_with("rediss://")) {
    tls = true;
    rest.remove_prefix(9);
  } else if (rest.starts_with("redis://")) {
    rest.remove_prefix(8);
  } else {
    return bad_url(url, "the scheme must be redis://, rediss:// or unix://");
  }
  if (auto at = rest.rfind('@'); at != std::string_view::npos) {
    std::string_view userinfo = rest.substr(0, at);
    if (userinfo.find(':') != std::string_view::npos)
      return bad_url(url, "a password does not belong in the URL (it shows in process lists and logs); "
                          "put it in a file and name it with KILN_REMOTE_PASSWORD_FILE or --remote-password-file");
    if (userinfo.empty()) return bad_url(url, "empty user name before '@'");
    c.user = std::string(userinfo);
    rest = rest.substr(at + 1);
  }
  std::string_view hostport = rest;
  if (auto slash = rest.find('/'); slash != std::string_view::npos) {
    hostport = rest.substr(0, slash);
    std::string_view db = rest.substr(slash + 1);
    if (!db.empty()) {
      auto n = parse_int(db, 0, 1 << 20);
      if (!n) return bad_url(url, "the path must be a database number");
      c.db = int(*n);
    }
  }
  if (hostport.empty()) return bad_url(url, "no host");
  std::string_view host = hostport;
  if (hostport.front() == '[') {
    auto close = hostport.find(']');
    if (close == std::string_view::npos) return bad_url(url, "unclosed '[' in an IPv6 address");
    host = hostport.substr(1, close - 1);
    std::string_view after = hostport.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return bad_url(url, "junk after the IPv6 address");
      auto port = parse_int(after.substr(1), 1, 65535);
      if (!port) return bad_url(url, "the port must be 1..65535");
      c.endpoint.port = int(*port);
    }
  } else if (auto colon = hostport.rfind(':'); colon != std::string_view::npos) {
    host = hostport.substr(0, colon);
    auto port = parse_int(hostport.substr(colon + 1), 1, 65535);
    if (!port) return bad_url(url, "the port must be 1..65535");
    c.endpoint.port = int(*port);
  }
  if (host.empty()) return bad_url(url, "no host");
  c.endpoint.host = std::string(host);
  return {};
}

std::string trim_right(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '\t')) s.pop_back();
  return s;
}

}  // namespace

std::string Endpoint::describe() const {
  if (!unix_path.empty()) return "unix:" + unix_path;
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Result<std::string> read_secret_file(const std::filesystem::path& file, const std::string& what) {
  if (file.empty()) return invalid_argument("no " + what + " file given");
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0)
    return invalid_argument("cannot read the " + what + " file " + file.string() + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return invalid_argument("the " + what + " file " + file.string() + " is not a regular file");
  if (st.st_uid != ::getuid())
    return invalid_argument("the " + what + " file " + file.string() + " is owned by uid " + std::to_string(st.st_uid) +
                            ", not by this user");
  if ((st.st_mode & 0077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    return invalid_argument("the " + what + " file " + file.string() + " has mode " + mode +
                                "; it must be 0600 (readable by its owner only)",
                            "chmod 600 " + file.string());
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return invalid_argument("cannot open the " + what + " file " + file.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return trim_right(ss.str());
}

Result<Config> make_config(const Settings& s) {
  Config c;
  c.url = s.url;
  bool tls = false;
  KILN_TRY(parse_url(s.url, c, tls));
  if (s.timeout_ms) {
    if (*s.timeout_ms < 1 || *s.timeout_ms > 60'000)
      return invalid_argument("the remote timeout must be 1..60000 ms, not " + std::to_string(*s.timeout_ms));
    c.read_timeout = std::chrono::milliseconds(*s.timeout_ms);
  }
  if (s.lock_ms) {
    if (*s.lock_ms < 0 || *s.lock_ms > 600'000)
      return invalid_argument("the remote lock time must be 0..600000 ms, not " + std::to_string(*s.lock_ms));
    c.lock_ttl = c.lock_wait = std::chrono::milliseconds(*s.lock_ms);
  }
  const bool tls_options =
      !s.tls_ca_file.empty() || !s.tls_cert_file.empty() || !s.tls_key_file.empty() || !s.tls_name.empty();
  if (!tls) {
    if (tls_options)
      return invalid_argument("TLS options (CA file, client certificate or key, TLS name) are given but the remote URL '" +
                                  s.url + "' does not use TLS",
                              "name the server with rediss://host:port");
  } else {
    c.tls_name = s.tls_name.empty() ? c.endpoint.host : s.tls_name;
    KILN_ASSIGN_OR_RETURN(c.tls, TlsContext::create({s.tls_ca_file, s.tls_cert_file, s.tls_key_file}));
  }
  if (s.key_file.empty())
    return invalid_argument("a remote cache needs a fleet key file (KILN_FLEET_KEY_FILE or --fleet-key-file)",
                            "entries are signed with it; e.g. head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n' "
                            "> fleet.key && chmod 600 fleet.key, the same file on every host");
  KILN_ASSIGN_OR_RETURN(c.fleet_key, read_secret_file(s.key_file, "fleet key"));
  if (c.fleet_key.size() < k_min_fleet_key_bytes)
    return invalid_argument("the fleet key in " + s.key_file.string() + " is " + std::to_string(c.fleet_key.size()) +
                            " bytes; it must have at least " + std::to_string(k_min_fleet_key_bytes));
  if (!s.password_file.empty()) {
    KILN_ASSIGN_OR_RETURN(c.password, read_secret_file(s.password_file, "Redis password"));
  } else if (!c.user.empty()) {
    return invalid_argument("the remote URL names user '" + c.user + "' but no password file is given",
                            "KILN_REMOTE_PASSWORD_FILE or --remote-password-file");
  }
  return c;
}

Result<Settings> settings_from_env() {
  Settings s;
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? v : "";
  };
  auto number = [&](const char* name, long long lo, long long hi, std::optional<long long>& out) -> Status {
    const std::string t = env(name);
    if (t.empty()) return {};
    auto v = parse_int(t, lo, hi);
    if (!v)
      return invalid_argument(std::string(name) + " must be " + std::to_string(lo) + ".." + std::to_string(hi) +
                              ", not '" + t + "'");
    out = *v;
    return {};
  };
  s.url = env("KILN_REMOTE");
  s.key_file = env("KILN_FLEET_KEY_FILE");
  s.password_file = env("KILN_REMOTE_PASSWORD_FILE");
  s.tls_ca_file = env("KILN_REMOTE_CA_FILE");
  s.tls_cert_file = env("KILN_REMOTE_CERT_FILE");
  s.tls_key_file = env("KILN_REMOTE_KEY_FILE");
  s.tls_name = env("KILN_REMOTE_TLS_NAME");
  KILN_TRY(number("KILN_REMOTE_TIMEOUT_MS", 1, 60'000, s.timeout_ms));
  KILN_TRY(number("KILN_REMOTE_LOCK_MS", 0, 600'000, s.lock_ms));
  return s;
}

Result<std::optional<Config>> config_from_env() {
  KILN_ASSIGN_OR_RETURN(Settings s, settings_from_env());
  if (s.url.empty()) return std::optional<Config>();
  KILN_ASSIGN_OR_RETURN(Config c, make_config(s));
  return std::optional<Config>(std::move(c));
}

}  // namespace kiln::remote
