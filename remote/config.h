// Configuration of the remote cache tier (a Redis server shared by a fleet of hosts).
//
// A tier is named by a URL, its entries are signed with a fleet key read from a file, and an
// optional password (with the URL's user, Redis AUTH/ACL) is read from another file. Both files
// must be private to their owner (no group or other permission bits, e.g. mode 0600): a key that
// others can read is a key anyone on the host can forge entries with, so it is refused with
// invalid_argument before anything connects. A rediss:// URL speaks TLS (remote/tls.h): the CA
// file, client certificate and key are loaded here, so a bad one is refused before anything
// connects too. Nothing here does network I/O.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "kiln/status.h"

namespace kiln::remote {

class TlsContext;

// Where the server listens: a TCP host and port, or a Unix socket path.
struct Endpoint {
  std::string host;
  int port = 6379;
  std::string unix_path;  // set: a Unix socket, host and port unused
  std::string describe() const;
};

struct Settings {
  std::string url;                      // redis[s]://[user@]host[:port][/db] or unix:///path[?db=N]
  std::filesystem::path key_file;       // the fleet key (required)
  std::filesystem::path password_file;  // Redis AUTH password (optional)
  std::optional<long long> timeout_ms;  // how long a cache miss waits for the remote (default 50)
  // rediss:// only: CA certificates (default: the system's), a client certificate and its key
  // (mode 0600), and the name the server's certificate must carry (default: the URL's host).
  std::filesystem::path tls_ca_file;
  std::filesystem::path tls_cert_file;
  std::filesystem::path tls_key_file;
  std::string tls_name;
  // How long a compile lock lives and a host waits for another's compile (0: no coordination).
  std::optional<long long> lock_ms;
};

struct Config {
  std::string url;  // as given (never holds a password)
  Endpoint endpoint;
  std::string user;      // ACL user; empty: the default user
  std::string password;  // empty: no AUTH
  int db = 0;            // SELECT n when not 0
  std::shared_ptr<const TlsContext> tls;  // set: TLS (rediss://)
  std::string tls_name;                   // the host name or IP address the certificate must name
  std::string key_prefix = "kiln:v1:";
  std::string fleet_key;  // the HMAC-SHA256 key
  // A read (a local cache miss) waits at most read_timeout for the remote, connecting included.
  std::chrono::milliseconds read_timeout{50};
  // Write-backs run on a thread of their own, never on a request's path.
  std::chrono::milliseconds write_timeout{1000};
  // After a failure the tier is skipped (local only) for backoff_initial, doubling up to
  // backoff_max while the server keeps failing; the first success resets it.
  std::chrono::milliseconds backoff_initial{100};
  std::chrono::milliseconds backoff_max{2000};
  std::size_t max_pending_writes = 512;  // write-backs queued beyond this are dropped and counted
  // Compile coordination (Tier::claim): a host that misses a kernel takes a lock for it in Redis
  // that lives lock_ttl, and a host that finds it taken waits at most lock_wait for the record,
  // asking every lock_poll. lock_ttl 0: no locks, every host compiles what it misses.
  std::chrono::milliseconds lock_ttl{30'000};
  std::chrono::milliseconds lock_wait{30'000};
  std::chrono::milliseconds lock_poll{20};
};

// The shortest fleet key accepted, in bytes (after trailing whitespace is removed).
inline constexpr std::size_t k_min_fleet_key_bytes = 16;

// Parses the URL and reads the files. invalid_argument for a malformed URL, timeout or lock time,
// a password inside the URL, a key file that is missing, not a regular file, not owned by this
// user, open to group or others, or shorter than k_min_fleet_key_bytes; TLS options without a
// rediss:// URL; a CA file, client certificate or key that cannot be read or used (the key file
// is checked like the fleet key).
Result<Config> make_config(const Settings& settings);

// Reads a secret file (fleet key or password): regular, owned by this user, no group or other
// permission bits; trailing whitespace removed. `what` names it in errors.
Result<std::string> read_secret_file(const std::filesystem::path& file, const std::string& what);

// The settings in the environment: KILN_REMOTE (the URL; unset or empty: no remote tier),
// KILN_FLEET_KEY_FILE, KILN_REMOTE_PASSWORD_FILE, KILN_REMOTE_TIMEOUT_MS, KILN_REMOTE_CA_FILE,
// KILN_REMOTE_CERT_FILE, KILN_REMOTE_KEY_FILE, KILN_REMOTE_TLS_NAME, KILN_REMOTE_LOCK_MS.
// invalid_argument for a number out of range.
Result<Settings> settings_from_env();
// make_config(settings_from_env()); nullopt without KILN_REMOTE.
Result<std::optional<Config>> config_from_env();

}  // namespace kiln::remote
