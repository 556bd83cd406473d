// Status and Result<T>: how every wsync module reports failure.
//
// Errors are values at module boundaries. A Status carries a code and a message that
// names the thing that failed (tensor, server, rank, field). Result<T> holds a T or a
// non-OK Status. The HTTP layer maps codes to status codes in one place
// (HttpStatusFor in src/control/http_routes.h). Both types are cheap to move and safe to pass between
// threads; a single instance is not synchronized.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace wsync {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // bad input: malformed JSON, unknown dtype, wrong shape (HTTP 400)
  kUnauthenticated,     // missing or wrong API key (401)
  kNotFound,            // unknown route, tensor or model (404)
  kFailedPrecondition,  // wrong session state: start while active, update outside (409)
  kPayloadTooLarge,     // request body over the limit (413)
  kDeadlineExceeded,    // a wait ran past its deadline
  kUnavailable,         // a peer or server could not be reached
  kDataLoss,            // checksum mismatch, truncated data
  kAborted,             // the operation was cancelled by a peer's failure
  kUnimplemented,       // a backend or feature not built in
  kInternal,            // a bug or an unexpected failure of a foreign library
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: shape of ... ".
  std::string ToString() const;
  // The same code with "context: " put before the message.
  Status WithContext(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status Unauthenticated(std::string m) { return {StatusCode::kUnauthenticated, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status PayloadTooLarge(std::string m) { return {StatusCode::kPayloadTooLarge, std::move(m)}; }
inline Status DeadlineExceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
inline Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// A T or the Status that explains why there is none. Constructing from an OK Status is
// a bug and becomes kInternal.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok()) v_ = Status(StatusCode::kInternal, "Result built from OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace wsync

#define WSYNC_CONCAT_INNER_(a, b) a##b
#define WSYNC_CONCAT_(a, b) WSYNC_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function if `expr` is not OK.
#define WSYNC_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ::wsync::Status wsync_status_ = (expr);          \
    if (!wsync_status_.ok()) return wsync_status_;   \
  } while (0)

// `lhs = value of expr`, or returns its Status. lhs may declare a variable.
#define WSYNC_ASSIGN_OR_RETURN(lhs, expr) \
  WSYNC_ASSIGN_OR_RETURN_IMPL_(WSYNC_CONCAT_(wsync_result_, __LINE__), lhs, expr)
#define WSYNC_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
