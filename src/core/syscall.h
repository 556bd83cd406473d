// Foreign errors from libc and the kernel as Status values, in one place.
//
// ErrnoStatus turns an errno value into a Status whose message names what was being
// done and the libc error text ("opening /x/y: No such file or directory"). The code
// follows ErrnoCode unless the caller knows better (a path that a request named is the
// request's fault, say, and the caller passes kInvalidArgument). WSYNC_SYSCALL checks a
// call that returns -1 and sets errno, returning the Status with the expression and
// file:line added. RetryOnEintr repeats a call that an interrupting signal cut short.
// All of it is thread-safe (errno is per thread).
#pragma once

#include <cerrno>
#include <string_view>

#include <fmt/format.h>

#include "wsync/status.h"

namespace wsync {

// ENOENT -> kNotFound; everything else kInternal (a libc failure wsync did not expect).
StatusCode ErrnoCode(int err);

// "what: strerror(err)" with code ErrnoCode(err), or with `code` when given.
Status ErrnoStatus(int err, std::string_view what);
Status ErrnoStatus(int err, std::string_view what, StatusCode code);

// Calls `call` again while it fails with EINTR; returns its last result. `call` returns
// a signed integer that is negative on failure with errno set (read, write, waitpid...).
template <typename Call>
auto RetryOnEintr(Call&& call) {
  for (;;) {
    auto r = call();
    if (!(r < 0 && errno == EINTR)) return r;
  }
}

}  // namespace wsync

// Evaluates `expr` (a libc call returning -1 on failure); on failure returns from the
// enclosing function an ErrnoStatus naming `what`, the expression and its file:line.
#define WSYNC_SYSCALL(expr, what)                                                            \
  do {                                                                                       \
    if ((expr) < 0) {                                                                        \
      int wsync_errno_ = errno;                                                              \
      return ::wsync::ErrnoStatus(                                                           \
          wsync_errno_, ::fmt::format("{} ({} at {}:{})", (what), #expr, __FILE__, __LINE__)); \
    }                                                                                        \
  } while (0)
