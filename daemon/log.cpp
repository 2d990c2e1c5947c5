#include "daemon/log.h"

#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <ctime>
#include <string>

namespace kiln::daemon {

void log_line(LogLevel level, std::string_view message) {
  timeval tv{};
  ::gettimeofday(&tv, nullptr);
  std::tm tm{};
  ::gmtime_r(&tv.tv_sec, &tm);
  char stamp[64];
  std::snprintf(stamp, sizeof stamp, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ kilnd[%d] ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, int(tv.tv_usec / 1000),
                int(::getpid()));
  const char* tag = level == LogLevel::error ? "error: " : level == LogLevel::warn ? "warn: " : "info: ";

  std::string line;
  try {
    line.reserve(message.size() + 64);
    line += stamp;
    line += tag;
    // One event, one line: embedded newlines (compiler logs) would break line-oriented readers.
    for (char c : message) line += (c == '\n' || c == '\r') ? ' ' : c;
    line += '\n';
  } catch (...) {
    return;  // out of memory: losing a log line beats crashing the daemon
  }
  const char* p = line.data();
  std::size_t left = line.size();
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

std::string format_ms(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", ms);
  return buf;
}

}  // namespace kiln::daemon
