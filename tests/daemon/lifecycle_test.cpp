// kilnd's life: start, refuse a second instance, replace a stale socket, stop on request or
// signal, and keep its socket private.
#include <gtest/gtest.h>

#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <thread>

#include "daemon/instance.h"
#include "tests/daemon/kilnd_harness.h"

namespace kiln::testing {
namespace {

mode_t mode_of(const fs::path& p) {
  struct stat st {};
  if (::lstat(p.c_str(), &st) != 0) return 0;
  return st.st_mode;
}

TEST(KilndLifecycle, StartsAndAnswersPing) {
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE((*c)->ping().ok());

  // The raw reply carries version, protocol and pid.
  RawConn raw(env.socket());
  ASSERT_TRUE(raw.ok());
  ASSERT_TRUE(raw.send_bytes(RawConn::frame(R"({"op":"ping","id":7})")));
  auto reply = raw.read_reply();
  ASSERT_TRUE(reply);
  EXPECT_EQ((*reply)["ok"], true);
  EXPECT_EQ((*reply)["protocol"], 1);
  EXPECT_EQ((*reply)["version"], KILN_VERSION);
  EXPECT_EQ((*reply)["pid"], k->pid());
  EXPECT_EQ((*reply)["id"], 7);
}

TEST(KilndLifecycle, SocketIsPrivate) {
  // The default location: $XDG_RUNTIME_DIR/kiln/kilnd.sock, created 0700 / 0600.
  TempDir tmp;
  fs::path xdg = tmp.path() / "xdg";
  fs::create_directories(xdg);
  Kilnd::Options o;
  o.cache_dir = tmp.path() / "cache";
  o.env["XDG_RUNTIME_DIR"] = xdg.string();
  o.args = {"--jobs", "1"};
  o.log = tmp.path() / "kilnd.log";
  o.socket = xdg / "kiln" / "kilnd.sock";  // for the harness only
  Kilnd::Options spawn_opts = o;
  spawn_opts.socket.clear();  // no KILN_SOCKET: the daemon must find the path itself
  auto k = Kilnd::spawn(spawn_opts);
  // The harness pings the path it expects.
  auto deadline = std::chrono::steady_clock::now() + 10s;
  bool up = false;
  while (!up && std::chrono::steady_clock::now() < deadline && k->running()) {
    up = client::DaemonClient::connect(o.socket, 500ms).ok();
    if (!up) std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(up) << k->log();

  mode_t dir = mode_of(xdg / "kiln");
  mode_t sock = mode_of(o.socket);
  EXPECT_TRUE(S_ISDIR(dir));
  EXPECT_EQ(dir & 07777, 0700u);
  EXPECT_TRUE(S_ISSOCK(sock));
  EXPECT_EQ(sock & 07777, 0600u);
  EXPECT_TRUE(fs::exists(xdg / "kiln" / "kilnd.lock"));
}

TEST(KilndLifecycle, RefusesGroupReadableDirectory) {
  DaemonEnv env;
  fs::create_directories(env.run_dir());
  ASSERT_EQ(::chmod(env.run_dir().c_str(), 0755), 0);
  auto k = Kilnd::spawn(env.options());
  auto code = k->wait_exit();
  ASSERT_TRUE(code);
  EXPECT_EQ(*code, 1);
  EXPECT_NE(k->log().find("mode 755"), std::string::npos) << k->log();
  EXPECT_FALSE(fs::exists(env.socket()));
}

TEST(KilndLifecycle, RefusesSymlinkedDirectory) {
  DaemonEnv env;
  fs::path real = env.root() / "real";
  fs::create_directories(real);
  ASSERT_EQ(::chmod(real.c_str(), 0700), 0);
  fs::create_directory_symlink(real, env.run_dir());
  auto k = Kilnd::spawn(env.options());
  auto code = k->wait_exit();
  ASSERT_TRUE(code);
  EXPECT_EQ(*code, 1);
  EXPECT_NE(k->log().find("symbolic link"), std::string::npos) << k->log();
  EXPECT_FALSE(fs::exists(real / "kilnd.sock"));
}

TEST(KilndLifecycle, LeavesANonSocketFileAlone) {
  DaemonEnv env;
  fs::create_directories(env.run_dir());
  ::chmod(env.run_dir().c_str(), 0700);
  { std::ofstream(env.socket()) << "not a socket"; }
  auto k = Kilnd::spawn(env.options());
  auto code = k->wait_exit();
  ASSERT_TRUE(code);
  EXPECT_EQ(*code, 1);
  EXPECT_EQ(Kilnd::read_file(env.socket()), "not a socket");
}

TEST(KilndLifecycle, BadFlagsExitOne) {
  DaemonEnv env;
  for (std::vector<std::string> args : {std::vector<std::string>{"--jobs", "zero"}, {"--jobs"}, {"--bogus"},
                                        {"--no-pch=1"}, {"--jobs", "0"}}) {
    auto k = Kilnd::spawn(env.options(args));
    auto code = k->wait_exit();
    ASSERT_TRUE(code);
    EXPECT_EQ(*code, 1) << args[0];
  }
  EXPECT_NE(Kilnd::read_file(env.log()).find("unknown argument '--bogus'"), std::string::npos);
  EXPECT_FALSE(fs::exists(env.socket()));
}

TEST(KilndLifecycle, SecondDaemonRefusesAndFirstKeepsServing) {
  DaemonEnv env;
  auto first = env.start();
  ASSERT_TRUE(first);
  auto second = Kilnd::spawn(env.options());
  auto code = second->wait_exit();
  ASSERT_TRUE(code) << "second kilnd did not exit";
  EXPECT_EQ(*code, 3);
  EXPECT_NE(Kilnd::read_file(env.log()).find("already running"), std::string::npos);
  ASSERT_TRUE(fs::exists(env.socket()));
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(stats_of(env.socket())["daemon"]["pid"], first->pid());
}

TEST(KilndLifecycle, SimultaneousStartsLeaveExactlyOneDaemon) {
  DaemonEnv env;
  std::vector<std::unique_ptr<Kilnd>> ks;
  for (int i = 0; i < 4; ++i) ks.push_back(Kilnd::spawn(env.options({"--jobs", "1"})));
  // Wait until all but one have exited (or a generous deadline passes).
  int exited = 0, refused = 0;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    exited = refused = 0;
    for (auto& k : ks) {
      if (k->running()) continue;
      ++exited;
      if (k->wait_exit(0ms) == 3) ++refused;
    }
    if (exited >= 3) break;
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(exited, 3) << Kilnd::read_file(env.log());
  EXPECT_EQ(refused, 3) << Kilnd::read_file(env.log());
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto s = stats_of(env.socket());
  bool found = false;
  for (auto& k : ks)
    if (k->running()) found = found || s["daemon"]["pid"] == k->pid();
  EXPECT_TRUE(found);
}

TEST(KilndLifecycle, ReplacesAStaleSocket) {
  DaemonEnv env;
  fs::create_directories(env.run_dir());
  ::chmod(env.run_dir().c_str(), 0700);
  // A socket file nobody listens on: what a crashed daemon leaves behind.
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, env.socket().c_str(), sizeof addr.sun_path - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ::close(fd);
  ASSERT_TRUE(fs::is_socket(env.socket()));
  EXPECT_FALSE(client::DaemonClient::connect(env.socket()).ok());

  auto k = env.start();
  ASSERT_TRUE(k);
  EXPECT_TRUE(client::DaemonClient::connect(env.socket()).ok());
}

TEST(KilndLifecycle, ShutdownRequestStopsAndRemovesSocket) {
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE((*c)->shutdown().ok());
  auto code = k->wait_exit();
  ASSERT_TRUE(code) << "kilnd did not exit after shutdown";
  EXPECT_EQ(*code, 0) << k->log();
  EXPECT_FALSE(fs::exists(env.socket()));
  EXPECT_NE(k->log().find("stopped"), std::string::npos);
  // The lock is released: a new daemon starts on the same socket.
  auto again = env.start();
  EXPECT_TRUE(again);
}

TEST(KilndLifecycle, SigtermAndSigintStopGracefully) {
  for (int sig : {SIGTERM, SIGINT}) {
    DaemonEnv env;
    auto k = env.start();
    ASSERT_TRUE(k);
    // An idle client connection must not hold the stop up.
    RawConn idle(env.socket());
    ASSERT_TRUE(idle.ok());
    k->signal(sig);
    auto code = k->wait_exit();
    ASSERT_TRUE(code) << "kilnd did not exit on signal " << sig;
    EXPECT_EQ(*code, 0) << k->log();
    EXPECT_FALSE(fs::exists(env.socket()));
    EXPECT_TRUE(idle.closed_within(2s));
  }
}

TEST(KilndLifecycle, DoesNotRemoveASocketItDoesNotOwn) {
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  // Someone replaces the socket file (e.g. after declaring this daemon dead).
  fs::path moved = env.run_dir() / "old.sock";
  fs::rename(env.socket(), moved);
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, env.socket().c_str(), sizeof addr.sun_path - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  k->signal(SIGTERM);
  auto code = k->wait_exit();
  ASSERT_TRUE(code);
  EXPECT_EQ(*code, 0);
  EXPECT_TRUE(fs::exists(env.socket()));  // the new file is not ours to remove
  ::close(fd);
}

TEST(KilndLifecycle, RefusesPeersWithAnotherUid) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  passwd* nobody = ::getpwnam("nobody");
  if (!nobody) GTEST_SKIP() << "no 'nobody' user";
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  // Open the path up so that only the SO_PEERCRED check stands between the other user and kilnd.
  ::chmod(env.root().c_str(), 0755);
  ::chmod(env.run_dir().c_str(), 0755);
  ::chmod(env.socket().c_str(), 0666);

  pid_t child = ::fork();
  if (child == 0) {
    if (::setgid(nobody->pw_gid) != 0 || ::setuid(nobody->pw_uid) != 0) _exit(10);
    RawConn c(env.socket());
    if (!c.ok()) _exit(11);
    // Send a valid ping; the daemon must close without answering.
    (void)c.send_bytes(RawConn::frame(R"({"op":"ping"})"));
    auto reply = c.read_reply(3s);
    _exit(reply ? 12 : 0);
  }
  int st = 0;
  ASSERT_EQ(::waitpid(child, &st, 0), child);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0) << "10/11: setup failed, 12: the daemon answered another uid";
  EXPECT_NE(k->log().find("refused a connection from uid"), std::string::npos) << k->log();
  ::chmod(env.run_dir().c_str(), 0700);
  EXPECT_TRUE(client::DaemonClient::connect(env.socket()).ok());
}

TEST(KilndInstance, LockPathSitsNextToTheSocket) {
  EXPECT_EQ(daemon::Instance::lock_path_for("/r/kilnd.sock"), fs::path("/r/kilnd.lock"));
  EXPECT_EQ(daemon::Instance::lock_path_for("/r/sock"), fs::path("/r/sock.lock"));
  EXPECT_EQ(daemon::Instance::lock_path_for("/r/x.lock"), fs::path("/r/x.lock.lock"));
}

}  // namespace
}  // namespace kiln::testing
