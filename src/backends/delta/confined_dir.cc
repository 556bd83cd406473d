#include "backends/delta/confined_dir.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "backends/delta/fs.h"

namespace wsync::delta {
namespace {

namespace fs = std::filesystem;

// Set once openat2 answered ENOSYS (or EPERM from a seccomp filter): the walk is used.
std::atomic<bool> no_openat2{false};

Status BeneathStatus(const std::string& dir, std::string_view rel, int err) {
  if (err == EXDEV || err == ELOOP) {
    return InvalidArgument(fmt::format("{}/{} leads outside {} (a symlink that leaves it, or '..')", dir, rel, dir));
  }
  if (err == ENOTDIR) return InvalidArgument(fmt::format("{}/{}: a component is not a directory", dir, rel));
  return ErrnoStatus(err, fmt::format("opening {}/{}", dir, rel));
}

// Opens `rel` beneath `dirfd` one component at a time, every one O_NOFOLLOW (a symlink
// anywhere is refused: ELOOP, or ENOTDIR for an O_DIRECTORY walk step).
int WalkNoFollow(int dirfd, std::string_view rel, int flags) {
  int cur = ::fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
  if (cur < 0) return -1;
  size_t at = 0;
  while (true) {
    size_t slash = rel.find('/', at);
    std::string part(rel.substr(at, slash == std::string_view::npos ? std::string_view::npos : slash - at));
    bool last = slash == std::string_view::npos;
    if (part == "..") {
      ::close(cur);
      errno = EXDEV;
      return -1;
    }
    if (part.empty() || part == ".") {
      if (last) {
        int fd = ::openat(cur, ".", flags | O_NOFOLLOW | O_CLOEXEC);
        int err = errno;
        ::close(cur);
        errno = err;
        return fd;
      }
      at = slash + 1;
      continue;
    }
    int next = ::openat(cur, part.c_str(), last ? (flags | O_NOFOLLOW | O_CLOEXEC)
                                                : (O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    int err = errno;
    ::close(cur);
    if (next < 0) {
      errno = err;
      return -1;
    }
    if (last) return next;
    cur = next;
    at = slash + 1;
  }
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

bool ConfinedDir::UseWalkForTesting(bool walk) { return no_openat2.exchange(walk); }

Result<ConfinedDir> ConfinedDir::Open(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    int err = errno;
    if (err == ENOTDIR) return InvalidArgument(fmt::format("{} is not a directory", path));
    return ErrnoStatus(err, fmt::format("opening directory {}", path));
  }
  return ConfinedDir(std::move(fd), path);
}

Result<UniqueFd> ConfinedDir::OpenBeneath(std::string_view rel, int flags) const {
  if (rel.starts_with('/')) {
    return InvalidArgument(fmt::format("{}: an absolute path where {} wants a relative one", rel, path_));
  }
  if (rel.find('\0') != std::string_view::npos) {
    return InvalidArgument(fmt::format("a path below {} holds a NUL byte", path_));
  }
  std::string name(rel.empty() ? "." : rel);
  if (!no_openat2.load(std::memory_order_relaxed)) {
    struct open_how how {};
    how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
    for (;;) {
      long fd = ::syscall(SYS_openat2, fd_.get(), name.c_str(), &how, sizeof(how));
      if (fd >= 0) return UniqueFd(static_cast<int>(fd));
      if (errno == EINTR || errno == EAGAIN) continue;  // EAGAIN: a rename raced the lookup
      if (errno != ENOSYS && errno != EPERM) return BeneathStatus(path_, name, errno);
      no_openat2.store(true, std::memory_order_relaxed);
      break;
    }
  }
  int fd = WalkNoFollow(fd_.get(), name, flags);
  if (fd < 0) return BeneathStatus(path_, name, errno);
  return UniqueFd(fd);
}

Result<ConfinedDir> ConfinedDir::OpenDir(std::string_view rel) const {
  WSYNC_ASSIGN_OR_RETURN(UniqueFd fd, OpenBeneath(rel, O_PATH | O_DIRECTORY));
  std::string path = rel.empty() || rel == "." ? path_ : (fs::path(path_) / rel).lexically_normal().string();
  return ConfinedDir(std::move(fd), std::move(path));
}

Result<RegularFile> ConfinedDir::OpenFile(std::string_view rel) const {
  std::string path = (fs::path(path_) / rel).string();
  WSYNC_ASSIGN_OR_RETURN(UniqueFd fd, OpenBeneath(rel, O_RDONLY | O_NONBLOCK | O_NOCTTY));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, fmt::format("stat of {}", path));
  if (!S_ISREG(st.st_mode)) return InvalidArgument(fmt::format("{} is not a regular file", path));
  return RegularFile{std::move(fd), static_cast<uint64_t>(st.st_size), std::move(path)};
}

Result<std::string> ConfinedDir::ReadFile(std::string_view rel, size_t max_bytes) const {
  WSYNC_ASSIGN_OR_RETURN(RegularFile f, OpenFile(rel));
  return ReadWhole(f, max_bytes);
}

Result<std::string> ReadWhole(const RegularFile& f, size_t max_bytes) {
  if (f.size > max_bytes) {
    return InvalidArgument(fmt::format("{} is {} bytes, over the {} byte limit", f.path, f.size, max_bytes));
  }
  std::string out(static_cast<size_t>(f.size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    ssize_t r = RetryOnEintr([&] { return ::pread(f.fd.get(), out.data() + done, out.size() - done, static_cast<off_t>(done)); });
    if (r < 0) return ErrnoStatus(errno, fmt::format("reading {}", f.path));
    if (r == 0) break;  // shrank since the fstat
    done += static_cast<size_t>(r);
  }
  out.resize(done);
  return out;
}

Result<std::string> ReadRegularFile(const std::string& path, size_t max_bytes) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC));
  if (fd.get() < 0) {
    int err = errno;
    if (err == ELOOP) return InvalidArgument(fmt::format("{} is a symlink (refused)", path));
    return ErrnoStatus(err, fmt::format("opening {}", path));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, fmt::format("stat of {}", path));
  if (!S_ISREG(st.st_mode)) return InvalidArgument(fmt::format("{} is not a regular file", path));
  RegularFile f{std::move(fd), static_cast<uint64_t>(st.st_size), path};
  return ReadWhole(f, max_bytes);
}

Result<std::string> PathBelow(const std::string& root, const std::string& requested) {
  if (requested.empty()) return InvalidArgument("an empty path");
  if (requested.find('\0') != std::string::npos) return InvalidArgument("a path holding a NUL byte");
  fs::path req = fs::path(requested).lexically_normal();
  if (!req.has_filename() && req.has_relative_path()) req = req.parent_path();  // "dir/" is "dir"
  auto below = [&](const fs::path& base) -> std::optional<std::string> {
    fs::path rel = req.lexically_relative(base);
    if (rel.empty()) return std::nullopt;
    std::string s = rel.string();
    if (s == ".") return std::string();
    if (s == ".." || s.starts_with("../")) return std::nullopt;
    return s;
  };
  if (req.is_relative()) {
    std::string s = req.string();
    if (s == ".") return std::string();
    if (s == ".." || s.starts_with("../")) {
      return InvalidArgument(fmt::format("{} climbs out of the sync root {}", requested, root));
    }
    return s;
  }
  std::error_code ec;
  fs::path abs = fs::absolute(root, ec).lexically_normal();
  if (!abs.has_filename() && abs.has_relative_path()) abs = abs.parent_path();
  if (auto r = below(abs)) return *r;
  fs::path real = fs::weakly_canonical(abs, ec);
  if (!ec) {
    if (auto r = below(real)) return *r;
  }
  return InvalidArgument(fmt::format("{} is not below this server's sync root {} (wsync serve --sync-root)",
                                     requested, root));
}

bool IsPlainFileName(std::string_view name) {
  return !name.empty() && name.size() <= 255 && name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos &&
         !name.starts_with('.');
}

}  // namespace wsync::delta
