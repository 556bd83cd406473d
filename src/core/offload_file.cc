#include "core/offload_file.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>

#include "core/syscall.h"

namespace wsync {

Result<uint64_t> FreeBytes(const std::string& dir) {
  struct statvfs st {};
  if (statvfs(dir.c_str(), &st) != 0) return ErrnoStatus(errno, fmt::format("statvfs of {}", dir));
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

Result<std::unique_ptr<OffloadFile>> OffloadFile::Create(const std::string& dir, uint64_t bytes) {
  WSYNC_ASSIGN_OR_RETURN(uint64_t free, FreeBytes(dir));
  if (free < bytes) {
    return FailedPrecondition(fmt::format("offload directory {} has {} bytes free, {} are needed (wsync serve "
                                          "--offload-dir names another)", dir, free, bytes));
  }
  int fd = RetryOnEintr([&] { return open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600); });
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    // A filesystem without O_TMPFILE: a named file, unlinked at once.
    std::string path = dir + "/wsync_offload_XXXXXX";
    std::vector<char> name(path.begin(), path.end());
    name.push_back('\0');
    fd = mkostemp(name.data(), O_CLOEXEC);
    if (fd >= 0) unlink(name.data());
  }
  if (fd < 0) return ErrnoStatus(errno, fmt::format("creating an offload file in {}", dir));
  std::unique_ptr<OffloadFile> f(new OffloadFile(fd, dir, bytes));
  if (bytes > 0) {
    int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (err == ENOSPC) {
      return FailedPrecondition(fmt::format("offload directory {} cannot hold {} bytes (no space left)", dir, bytes));
    }
    // A filesystem that cannot preallocate still takes the writes.
    if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
      return ErrnoStatus(err, fmt::format("reserving {} bytes for an offload file in {}", bytes, dir));
    }
  }
  return f;
}

OffloadFile::~OffloadFile() {
  if (fd_ >= 0) close(fd_);
}

Status OffloadFile::Write(uint64_t offset, std::span<const std::byte> data) {
  if (offset > size_ || data.size() > size_ - offset) {
    return Internal(fmt::format("offload write of {} bytes at {} passes the file's {} bytes", data.size(), offset, size_));
  }
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = RetryOnEintr([&] {
      return pwrite(fd_, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
    });
    if (n < 0) return ErrnoStatus(errno, fmt::format("writing {} bytes to an offload file in {}", data.size(), dir_));
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status OffloadFile::Read(uint64_t offset, std::span<std::byte> out) const {
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = RetryOnEintr(
        [&] { return pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done)); });
    if (n < 0) return ErrnoStatus(errno, fmt::format("reading {} bytes back from an offload file in {}", out.size(), dir_));
    if (n == 0) {
      return DataLoss(fmt::format("offload file in {} ends at {} bytes, {} were written", dir_, offset + done,
                                  offset + out.size()));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace wsync
