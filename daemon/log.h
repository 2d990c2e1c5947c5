// kilnd's log: one line per event on stderr, "2025-01-31T12:00:00.123Z kilnd[pid] level: message".
//
// Each line goes out in a single write(2) so lines from the I/O thread and the compile workers
// never interleave. Thread-safe, never throws.
#pragma once

#include <string>
#include <string_view>

namespace kiln::daemon {

enum class LogLevel { info, warn, error };

void log_line(LogLevel level, std::string_view message);
inline void log_info(std::string_view m) { log_line(LogLevel::info, m); }
inline void log_warn(std::string_view m) { log_line(LogLevel::warn, m); }
inline void log_error(std::string_view m) { log_line(LogLevel::error, m); }

// A duration for a log line: milliseconds with one decimal ("12.5").
std::string format_ms(double ms);

}  // namespace kiln::daemon
