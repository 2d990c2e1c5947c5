// kiln::Status and kiln::Result<T>: the error currency at every module boundary.
//
// No exception crosses a module boundary or the C ABI. A Status carries a code, a one-line message
// for humans, and details (an NVRTC log, the options used, the offending value) for diagnosis.
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace kiln {

// Codes are stable: their numeric values are part of the C ABI and the daemon protocol.
enum class Code : int {
  ok = 0,
  invalid_argument = 1,   // a parameter, spec or option is malformed or out of range
  device_error = 2,       // a tensor is not where the op needs it (host vs CUDA, wrong device)
  shape_mismatch = 3,     // tensor shapes or strides are inconsistent
  unsupported_dtype = 4,  // a dtype the op or variant does not accept
  not_found = 5,          // no such family, key or entry
  corruption = 6,         // stored data failed its size or checksum check
  compile_error = 7,      // NVRTC rejected the source (details hold the log and options)
  driver_error = 8,       // the CUDA driver failed or is missing
  io_error = 9,           // file system, SQLite or socket failure
  unavailable = 10,       // a component (daemon, NVRTC, driver) cannot be reached or loaded
  timeout = 11,           // a deadline passed
  shutting_down = 12,     // the daemon is stopping and did not serve the request
  internal = 13,          // a bug in kiln
};

const char* code_name(Code code);
// Inverse of code_name; Code::internal for an unknown name.
Code code_from_name(const std::string& name);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message, std::string details = {})
      : code_(code), message_(std::move(message)), details_(std::move(details)) {}

  bool ok() const { return code_ == Code::ok; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  const std::string& details() const { return details_; }
  // "compile_error: <message>" plus the details on following lines.
  std::string to_string() const;

 private:
  Code code_ = Code::ok;
  std::string message_;
  std::string details_;
};

inline Status ok_status() { return {}; }
inline Status invalid_argument(std::string m, std::string d = {}) { return {Code::invalid_argument, std::move(m), std::move(d)}; }
inline Status device_error(std::string m, std::string d = {}) { return {Code::device_error, std::move(m), std::move(d)}; }
inline Status shape_mismatch(std::string m, std::string d = {}) { return {Code::shape_mismatch, std::move(m), std::move(d)}; }
inline Status unsupported_dtype(std::string m, std::string d = {}) { return {Code::unsupported_dtype, std::move(m), std::move(d)}; }
inline Status not_found(std::string m, std::string d = {}) { return {Code::not_found, std::move(m), std::move(d)}; }
inline Status corruption(std::string m, std::string d = {}) { return {Code::corruption, std::move(m), std::move(d)}; }
inline Status io_error(std::string m, std::string d = {}) { return {Code::io_error, std::move(m), std::move(d)}; }
inline Status unavailable(std::string m, std::string d = {}) { return {Code::unavailable, std::move(m), std::move(d)}; }
inline Status internal_error(std::string m, std::string d = {}) { return {Code::internal, std::move(m), std::move(d)}; }

// A value or the Status that explains why there is none.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}
  Result(Status status) : status_(std::move(status)) {
    if (status_.ok()) status_ = Status(Code::internal, "Result built from an ok Status without a value");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace kiln

#define KILN_CONCAT_INNER(a, b) a##b
#define KILN_CONCAT(a, b) KILN_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function when `expr` (a Status) is not ok.
#define KILN_TRY(expr)                         \
  do {                                         \
    ::kiln::Status kiln_try_s_ = (expr);       \
    if (!kiln_try_s_.ok()) return kiln_try_s_; \
  } while (0)

// `KILN_ASSIGN_OR_RETURN(auto x, make_x());` declares x from a Result or returns its Status.
#define KILN_ASSIGN_OR_RETURN(lhs, expr) KILN_ASSIGN_OR_RETURN_IMPL(KILN_CONCAT(kiln_r_, __LINE__), lhs, expr)
#define KILN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
