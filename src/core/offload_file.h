// OffloadFile: an unlinked temporary file that holds bytes moved out of memory while a
// server sleeps (vLLM's sleep level 1 keeps the weights in a slower tier), read back when
// it wakes.
//
// The file is created in a directory the server's own flags name (`wsync serve
// --offload-dir`), unlinked at once (O_TMPFILE where the filesystem has it), and its
// space is reserved up front (posix_fallocate), so a full disk is an error before any
// byte is written, never a short write halfway. Closing it (the destructor) frees the
// space; nothing is left behind however the process ends.
//
// Thread-safety: Write and Read use pread/pwrite at explicit offsets, so disjoint ranges
// may be written or read from many threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "wsync/status.h"

namespace wsync {

// Bytes an unprivileged process may still write under `dir` (statvfs f_bavail).
Result<uint64_t> FreeBytes(const std::string& dir);

class OffloadFile {
 public:
  // An unlinked file of `bytes` bytes in `dir`. FailedPrecondition naming the directory,
  // the bytes free and the bytes needed when they do not fit (checked, then reserved);
  // the errno error naming the directory when it cannot be created.
  static Result<std::unique_ptr<OffloadFile>> Create(const std::string& dir, uint64_t bytes);
  ~OffloadFile();
  OffloadFile(const OffloadFile&) = delete;
  OffloadFile& operator=(const OffloadFile&) = delete;

  // Writes `data` at `offset`; the range must lie inside size().
  Status Write(uint64_t offset, std::span<const std::byte> data);
  // Reads exactly out.size() bytes from `offset`; DataLoss when the file is shorter.
  Status Read(uint64_t offset, std::span<std::byte> out) const;
  uint64_t size() const { return size_; }
  const std::string& dir() const { return dir_; }

 private:
  OffloadFile(int fd, std::string dir, uint64_t size) : fd_(fd), dir_(std::move(dir)), size_(size) {}
  int fd_;
  std::string dir_;
  uint64_t size_;
};

}  // namespace wsync
