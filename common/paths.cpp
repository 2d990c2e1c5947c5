#include "common/paths.h"

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kiln {
namespace {

std::filesystem::path env_path(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::filesystem::path(v) : std::filesystem::path();
}

std::filesystem::path home_dir() {
  if (auto h = env_path("HOME"); !h.empty()) return h;
  if (passwd* pw = getpwuid(getuid())) return pw->pw_dir;
  return "/tmp";
}

}  // namespace

std::filesystem::path cache_dir() {
  if (auto p = env_path("KILN_CACHE_DIR"); !p.empty()) return p;
  if (auto p = env_path("XDG_CACHE_HOME"); !p.empty()) return p / "kiln";
  return home_dir() / ".cache" / "kiln";
}

std::filesystem::path cache_file() { return cache_dir() / "kernels.sqlite"; }

std::filesystem::path runtime_dir() {
  if (auto p = env_path("XDG_RUNTIME_DIR"); !p.empty()) return p / "kiln";
  return std::filesystem::path("/tmp") / ("kiln-" + std::to_string(getuid()));
}

std::filesystem::path socket_path() {
  if (auto p = env_path("KILN_SOCKET"); !p.empty()) return p;
  return runtime_dir() / "kilnd.sock";
}

Status ensure_private_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (dir.has_parent_path()) std::filesystem::create_directories(dir.parent_path(), ec);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return io_error("cannot create directory " + dir.string() + ": " + std::strerror(errno));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0)
    return io_error("cannot stat " + dir.string() + ": " + std::strerror(errno));
  if (S_ISLNK(st.st_mode)) return io_error(dir.string() + " is a symbolic link; refusing to use it");
  if (!S_ISDIR(st.st_mode)) return io_error(dir.string() + " is not a directory");
  if (st.st_uid != getuid())
    return io_error(dir.string() + " is owned by uid " + std::to_string(st.st_uid) + ", not by this user");
  if ((st.st_mode & 0077) != 0)
  {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%03o", unsigned(st.st_mode & 0777));
    return io_error(dir.string() + " has mode " + mode + "; it must be 0700 (no group or other access)");
  }
  return {};
}

}  // namespace kiln
