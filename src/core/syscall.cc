#include "core/syscall.h"

#include <cstring>

namespace wsync {

StatusCode ErrnoCode(int err) {
  return err == ENOENT ? StatusCode::kNotFound : StatusCode::kInternal;
}

Status ErrnoStatus(int err, std::string_view what) { return ErrnoStatus(err, what, ErrnoCode(err)); }

Status ErrnoStatus(int err, std::string_view what, StatusCode code) {
  return Status(code, fmt::format("{}: {}", what, std::strerror(err)));
}

}  // namespace wsync
