// `kiln` run as a child process for the tune CLI tests (CPU and GPU): a private cache and runtime
// directory, no daemon, stdout and stderr captured.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace kiln::testing {

namespace fs = std::filesystem;

struct Proc {
  int rc = -1;
  std::string out, err;
  std::string all() const { return "exit " + std::to_string(rc) + "\n--- stdout\n" + out + "--- stderr\n" + err; }
};

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

class TuneCli : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(dir_.path() / "run");
    ::chmod((dir_.path() / "run").c_str(), 0700);
  }
  fs::path cache_dir() const { return dir_.path() / "cache"; }

  Proc kiln(const std::vector<std::string>& args) {
    const fs::path out = dir_.path() / "stdout", err = dir_.path() / "stderr";
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("KILN_CACHE_DIR", cache_dir().c_str(), 1);
      ::setenv("XDG_RUNTIME_DIR", (dir_.path() / "run").c_str(), 1);
      ::setenv("KILN_SOCKET", (dir_.path() / "run" / "none.sock").c_str(), 1);
      exec_with_output(KILN_CLI_PATH, args, out, err);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    Proc r;
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }

  void expect_usage_error(const std::vector<std::string>& args, const std::string& message) {
    Proc p = kiln(args);
    EXPECT_EQ(p.rc, 2) << p.all();
    EXPECT_NE(p.err.find(message), std::string::npos) << "expected '" << message << "'\n" << p.all();
    EXPECT_FALSE(fs::exists(cache_dir() / "kernels.sqlite")) << "a bad command must not create the cache";
  }

  fs::path write_file(const std::string& name, const std::string& text) {
    const fs::path p = dir_.path() / name;
    std::ofstream(p) << text;
    return p;
  }

  TempDir dir_;
};

}  // namespace kiln::testing
