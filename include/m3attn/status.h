// Status: the one error mechanism of m3attn. Every fallible call returns one; the message names the
// rule that was broken and the offending values ("page stride 130 is not a multiple of 4").
#pragma once

#include <sstream>
#include <string>
#include <utility>

namespace m3attn {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // a caller broke a contract (shape, dtype, stride, range)
  kUnsupported,        // a valid request this build or dispatch table does not cover
  kOutOfRange,         // an index or size beyond what a buffer holds
  kResourceExhausted,  // out of pages, memory or capacity
  kIoError,            // a file could not be read or written
  kDataLoss,           // a file is truncated or inconsistent
  kCudaError,          // the CUDA runtime or a CUDA library reported an error
  kInternal,           // a bug in m3attn
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: page stride 130 is not a multiple of 4"
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Builders that stream their arguments: invalid_argument("page stride ", s, " is not a multiple of
// 4").
template <typename... Args>
Status make_status(StatusCode code, Args&&... args) {
  return Status(code, detail::concat(std::forward<Args>(args)...));
}
template <typename... Args>
Status invalid_argument(Args&&... args) {
  return make_status(StatusCode::kInvalidArgument, std::forward<Args>(args)...);
}
template <typename... Args>
Status unsupported(Args&&... args) {
  return make_status(StatusCode::kUnsupported, std::forward<Args>(args)...);
}
template <typename... Args>
Status out_of_range(Args&&... args) {
  return make_status(StatusCode::kOutOfRange, std::forward<Args>(args)...);
}
template <typename... Args>
Status resource_exhausted(Args&&... args) {
  return make_status(StatusCode::kResourceExhausted, std::forward<Args>(args)...);
}
template <typename... Args>
Status io_error(Args&&... args) {
  return make_status(StatusCode::kIoError, std::forward<Args>(args)...);
}
template <typename... Args>
Status data_loss(Args&&... args) {
  return make_status(StatusCode::kDataLoss, std::forward<Args>(args)...);
}
template <typename... Args>
Status internal_error(Args&&... args) {
  return make_status(StatusCode::kInternal, std::forward<Args>(args)...);
}

// StatusOr-lite: a value or the Status that explains its absence.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}          // NOLINT(runtime/explicit)
  Result(Status status) : status_(std::move(status)) {}  // NOLINT(runtime/explicit)
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return value_; }
  const T& value() const& { return value_; }
  T&& value() && { return std::move(value_); }

 private:
  Status status_;
  T value_{};
};

}  // namespace m3attn

#define M3_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::m3attn::Status m3_status_ = (expr);    \
    if (!m3_status_.ok()) return m3_status_; \
  } while (0)

// Returns invalid_argument(...) unless cond holds.
#define M3_CHECK_ARG(cond, ...)                                  \
  do {                                                           \
    if (!(cond)) return ::m3attn::invalid_argument(__VA_ARGS__); \
  } while (0)
