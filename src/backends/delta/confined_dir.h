// ConfinedDir: a directory below which the `delta` receiver opens what a request or a
// manifest names, and nothing outside it.
//
// The trust boundary (docs/security.md): the server's flags choose its directories (the
// base checkpoint, the local checkpoint, the sync root); a request body, a manifest or a
// state file only names places below them. So every open here
//   - resolves relative to an open directory descriptor, beneath it: openat2(2) with
//     RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS, so a symlink may point within the
//     directory but never out of it (and /proc magic links are refused); where the kernel
//     lacks openat2 (Linux < 5.6, or a seccomp filter refuses it), a walk of openat(2)
//     with O_NOFOLLOW on every component, which refuses every symlink;
//   - opens files O_NONBLOCK, so that a FIFO cannot block the open, and then requires a
//     regular file (fstat), so that a FIFO, a device or a socket is refused at once;
//   - reads whole files only up to a stated limit, checked against fstat first.
// Errors name the path and the rule broken; they never quote a file's bytes.
//
// Types are move-only values (each owns a descriptor); const methods are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "wsync/status.h"

namespace wsync::delta {

// The largest manifest.json read (a record is ~300 bytes: ~800k tensors).
inline constexpr size_t kMaxManifestBytes = size_t{256} << 20;
// The largest state.json read (a few hundred bytes in practice).
inline constexpr size_t kMaxStateBytes = size_t{1} << 20;

// An owned file descriptor, closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

// A regular file opened read-only beneath a ConfinedDir.
struct RegularFile {
  UniqueFd fd;
  uint64_t size = 0;  // from fstat at open
  std::string path;   // for messages: the directory's path / the name
};

class ConfinedDir {
 public:
  // Opens a directory that the server's own flags name (the path is trusted; symlinks
  // in it are followed). NotFound when absent; InvalidArgument when not a directory.
  static Result<ConfinedDir> Open(const std::string& path);

  // The directory `rel` below this one (a relative path; "" or "." is this directory).
  // InvalidArgument when `rel` is absolute or leads outside (through "..", or a
  // symlink that leaves); NotFound when absent.
  Result<ConfinedDir> OpenDir(std::string_view rel) const;
  // The regular file `rel` below this one, read-only, O_NONBLOCK; InvalidArgument when
  // it is not a regular file or leads outside, NotFound when absent.
  Result<RegularFile> OpenFile(std::string_view rel) const;
  // The whole of OpenFile(rel); InvalidArgument when it holds more than `max_bytes`.
  Result<std::string> ReadFile(std::string_view rel, size_t max_bytes) const;

  const std::string& path() const { return path_; }
  int fd() const { return fd_.get(); }

  // Makes every later open take the O_NOFOLLOW walk, as where openat2 is missing (tests;
  // not thread-safe against running opens). Returns the previous setting.
  static bool UseWalkForTesting(bool walk);

 private:
  ConfinedDir(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  // openat2 beneath fd_ (or the O_NOFOLLOW walk); returns the descriptor or a Status.
  Result<UniqueFd> OpenBeneath(std::string_view rel, int flags) const;
  UniqueFd fd_;
  std::string path_;
};

// Where `requested` (from a request body) lies below `root` (from the server's flags):
// the relative path to open beneath root. A relative `requested` is taken relative to
// root; an absolute one must lie lexically below root, or below root's real path, after
// "." and ".." are folded. InvalidArgument, naming both, when it does not, or when a ".."
// would climb above root. Symlinks are left to ConfinedDir (which resolves beneath root).
Result<std::string> PathBelow(const std::string& root, const std::string& requested);

// Reads the regular file at a trusted `path` (the server's own state file): O_NOFOLLOW
// on the last component, O_NONBLOCK, a regular file of at most `max_bytes`.
Result<std::string> ReadRegularFile(const std::string& path, size_t max_bytes);

// Reads an open regular file whole, at most `max_bytes`; `path` names it in errors.
Result<std::string> ReadWhole(const RegularFile& file, size_t max_bytes);

// Whether `name` is a single path component a version directory may hold: 1 to 255
// bytes (NAME_MAX), no '/', no NUL, not "." or "..", and not hidden (a leading '.').
bool IsPlainFileName(std::string_view name);

}  // namespace wsync::delta
