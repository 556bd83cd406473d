// SigbusGuard: keeps a process alive when a file it maps shared is truncated under it.
//
// A receiver maps the trainer's control region once per session and reads it across
// syncs. A sealed memfd (F_SEAL_SHRINK) cannot shrink, so its mappings need no guard. A
// POSIX shm file cannot be sealed: whoever can write it may truncate it, and the next
// read of a page past the new end raises SIGBUS, which kills the process by default.
// While a guard is registered for a mapping, a SIGBUS at an address inside it replaces
// the whole mapping with private zero pages (MAP_FIXED, as Wayland compositors do for
// client shm pools), so that the faulting read completes and returns zeros, and marks the
// guard tripped; the owner checks tripped() after reading and discards what it read. A
// SIGBUS anywhere else goes to the disposition that was there before the first guard.
//
// Thread-safety: construction and destruction from any thread; tripped() from any thread
// and from the handler. Destroy the guard before unmapping the range. At most 64 guards
// are registered at once (Register fails beyond).
#pragma once

#include <cstddef>
#include <memory>

#include "wsync/status.h"

namespace wsync {

class SigbusGuard {
 public:
  // Guards [base, base + bytes), a MAP_SHARED mapping of a file that may shrink.
  static Result<std::unique_ptr<SigbusGuard>> Register(void* base, size_t bytes);
  ~SigbusGuard();
  SigbusGuard(const SigbusGuard&) = delete;
  SigbusGuard& operator=(const SigbusGuard&) = delete;

  // True once a SIGBUS hit the range: the mapping now holds zeros, not the file.
  bool tripped() const;

 private:
  explicit SigbusGuard(int slot) : slot_(slot) {}
  int slot_;
};

}  // namespace wsync
