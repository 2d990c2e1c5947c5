// A sandbox for end-to-end tests of the `kiln` executable: a private cache directory, runtime
// directory and socket, and a way to run kiln in them (bounded) and read what it said.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"

#ifndef KILN_CLI_PATH
#error "KILN_CLI_PATH must name the built kiln executable"
#endif
#ifndef KILN_KILND_PATH
#error "KILN_KILND_PATH must name the built kilnd executable"
#endif

namespace kiln::testing {

namespace fs = std::filesystem;
using nlohmann::json;

struct Proc {
  int rc = -1;
  std::string out;
  std::string err;
  // For failure messages: everything the process said.
  std::string all() const { return "exit " + std::to_string(rc) + "\n--- stdout\n" + out + "--- stderr\n" + err; }
};

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A private directory tree for one test: the cache, the runtime dir (socket, daemon log) and the
// environment that points kiln at them, so that no test sees a user's cache or daemon.
class Sandbox {
 public:
  Sandbox() {
    std::string tmpl = (fs::temp_directory_path() / "kiln-cli-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    root_ = tmpl;
    fs::create_directories(root_ / "run");
    ::chmod((root_ / "run").c_str(), 0700);
    env_["KILN_CACHE_DIR"] = cache_dir().string();
    env_["XDG_RUNTIME_DIR"] = (root_ / "run").string();
    env_["KILN_SOCKET"] = socket().string();
    // kilnd is found next to kiln unless the build put them apart.
    if (fs::path(KILN_CLI_PATH).parent_path() != fs::path(KILN_KILND_PATH).parent_path())
      env_["KILN_KILND"] = KILN_KILND_PATH;
  }
  ~Sandbox() {
    stop_daemon();
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  Sandbox(const Sandbox&) = delete;
  Sandbox& operator=(const Sandbox&) = delete;

  fs::path root() const { return root_; }
  fs::path cache_dir() const { return root_ / "cache"; }
  fs::path cache_file() const { return cache_dir() / "kernels.sqlite"; }
  fs::path socket() const { return root_ / "run" / "kiln" / "kilnd.sock"; }

  // Runs kiln with `args` in this sandbox's environment and waits (bounded) for it.
  Proc kiln(const std::vector<std::string>& args, int timeout_s = 300) {
    const fs::path out = root_ / "stdout", err = root_ / "stderr";
    const pid_t pid = ::fork();
    if (pid == 0) {
      for (const auto& [k, v] : env_) ::setenv(k.c_str(), v.c_str(), 1);
      ::unsetenv("KILN_MODE");
      if (!env_.count("KILN_KILND")) ::unsetenv("KILN_KILND");
      kiln::testing::exec_with_output(KILN_CLI_PATH, args, out, err);
    }
    Proc r;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    int status = 0;
    for (;;) {
      if (::waitpid(pid, &status, WNOHANG) == pid) break;
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        r.err = "(killed after " + std::to_string(timeout_s) + " s)\n";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.out = slurp(out);
    r.err += slurp(err);
    return r;
  }

  // `kiln ... --json`, parsed; a test failure (and null) if the output is not JSON.
  json kiln_json(const std::vector<std::string>& args, int* rc = nullptr) {
    Proc r = kiln(args);
    if (rc) *rc = r.rc;
    try {
      return json::parse(r.out);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not JSON from kiln: " << e.what() << "\n" << r.all();
      return json();
    }
  }

  void set_env(const std::string& name, const std::string& value) { env_[name] = value; }
  void remember_daemon_pid(long pid) { daemon_pid_ = pid; }

  // Leaves no daemon behind, even when a test failed half-way.
  void stop_daemon() {
    if (fs::exists(socket())) (void)kiln({"daemon", "stop"}, 30);
    if (daemon_pid_ > 0 && ::kill(static_cast<pid_t>(daemon_pid_), 0) == 0) ::kill(static_cast<pid_t>(daemon_pid_), SIGKILL);
    daemon_pid_ = 0;
  }

 private:
  fs::path root_;
  std::map<std::string, std::string> env_;
  long daemon_pid_ = 0;
};

}  // namespace kiln::testing
