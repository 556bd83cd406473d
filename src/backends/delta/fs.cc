#include "backends/delta/fs.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <thread>
#include <utility>

#include "backends/delta/payload_file.h"

namespace wsync::delta {
namespace {

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

Status WriteAll(int fd, const char* p, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = RetryOnEintr([&] { return ::write(fd, p, n); });
    WSYNC_SYSCALL(w, fmt::format("writing {}", path));
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status FsyncDir(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  Fd d{::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY)};
  WSYNC_SYSCALL(d.fd, fmt::format("opening directory {}", dir));
  WSYNC_SYSCALL(::fsync(d.fd), fmt::format("fsync of directory {}", dir));
  return Status::Ok();
}

}  // namespace

Result<FileLock> FileLock::Acquire(const std::string& path, Mode mode, Deadline deadline) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  WSYNC_SYSCALL(fd, fmt::format("opening lock file {}", path));
  FileLock lock(fd);
  int op = (mode == Mode::kExclusive ? LOCK_EX : LOCK_SH) | LOCK_NB;
  for (auto pause = std::chrono::microseconds(200);; pause = std::min(pause * 2, decltype(pause)(20000))) {
    if (::flock(fd, op) == 0) return lock;
    if (errno != EWOULDBLOCK && errno != EINTR) {
      return ErrnoStatus(errno, fmt::format("flock of {}", path));
    }
    if (deadline.expired()) {
      return DeadlineExceeded(fmt::format("waited too long for the {} lock on {} (another worker or "
                                          "process of this host holds it)",
                                          mode == Mode::kExclusive ? "writer" : "reader", path));
    }
    std::this_thread::sleep_for(pause);
  }
}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

Status WriteFileAtomic(const std::string& path, std::string_view data) {
  std::string tmp = fmt::format("{}.{}.tmp", path, ::getpid());
  {
    Fd f{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
    WSYNC_SYSCALL(f.fd, fmt::format("creating {}", tmp));
    WSYNC_RETURN_IF_ERROR(WriteAll(f.fd, data.data(), data.size(), tmp));
    WSYNC_SYSCALL(::fsync(f.fd), fmt::format("fsync of {}", tmp));
  }
  WSYNC_SYSCALL(::rename(tmp.c_str(), path.c_str()), fmt::format("renaming {} to {}", tmp, path));
  return FsyncDir(path);
}

Result<std::string> ReadFile(const std::string& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  WSYNC_SYSCALL(f.fd, fmt::format("opening {}", path));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t r = RetryOnEintr([&] { return ::read(f.fd, buf, sizeof(buf)); });
    WSYNC_SYSCALL(r, fmt::format("reading {}", path));
    if (r == 0) return out;
    out.append(buf, static_cast<size_t>(r));
  }
}

Status CloneFile(const std::string& src, const std::string& dst, bool* reflinked) {
  if (reflinked) *reflinked = false;
  Fd in{::open(src.c_str(), O_RDONLY | O_CLOEXEC)};
  WSYNC_SYSCALL(in.fd, fmt::format("opening {}", src));
  struct stat st {};
  WSYNC_SYSCALL(::fstat(in.fd, &st), fmt::format("stat of {}", src));
  Fd out{::open(dst.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, (st.st_mode & 0777) | S_IWUSR)};
  WSYNC_SYSCALL(out.fd, fmt::format("creating {}", dst));
  if (::ioctl(out.fd, FICLONE, in.fd) == 0) {
    if (reflinked) *reflinked = true;
    return Status::Ok();
  }
  // Buffered writes of 2 MiB, not copy_file_range: the page cache keeps the folios the
  // writes made, and copy_file_range on ext4 makes 64 KiB ones. After each write-back
  // every apply pays a page_mkwrite per folio (see WritableMapping::PrepareForWrite).
  constexpr size_t kPiece = size_t{2} << 20;
  std::vector<char> buf(kPiece);
  for (off_t done = 0; done < st.st_size;) {
    ssize_t r = RetryOnEintr([&] { return ::pread(in.fd, buf.data(), std::min<size_t>(kPiece, static_cast<size_t>(st.st_size - done)), done); });
    WSYNC_SYSCALL(r, fmt::format("reading {}", src));
    if (r == 0) return DataLoss(fmt::format("{} shrank while being copied", src));
    WSYNC_RETURN_IF_ERROR(WriteAll(out.fd, buf.data(), static_cast<size_t>(r), dst));
    done += r;
  }
  return Status::Ok();
}

Status CloneTree(const std::string& src, const std::string& dst, bool* reflinked) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dst, ec);
  if (ec) return Internal(fmt::format("creating {}: {}", dst, ec.message()));
  bool all = true;
  for (auto it = fs::recursive_directory_iterator(src, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    // Error-code forms only: a throwing one would escape into the server's request thread.
    fs::path rel = it->path().lexically_relative(src);
    fs::path to = fs::path(dst) / rel;
    std::error_code type_ec;
    if (it->is_directory(type_ec)) {
      fs::create_directories(to, ec);
      if (ec) return Internal(fmt::format("creating {}: {}", to.string(), ec.message()));
    } else if (it->is_regular_file(type_ec)) {
      bool one = false;
      WSYNC_RETURN_IF_ERROR(CloneFile(it->path().string(), to.string(), &one));
      all = all && one;
    }
  }
  if (ec) return Internal(fmt::format("listing {}: {}", src, ec.message()));
  if (reflinked) *reflinked = all;
  return Status::Ok();
}

Result<WritableMapping> WritableMapping::Open(const std::string& path) {
  Fd f{::open(path.c_str(), O_RDWR | O_CLOEXEC)};
  WSYNC_SYSCALL(f.fd, fmt::format("opening {} for writing", path));
  struct stat st {};
  WSYNC_SYSCALL(::fstat(f.fd, &st), fmt::format("stat of {}", path));
  WritableMapping m;
  m.path_ = path;
  m.size_ = static_cast<size_t>(st.st_size);
  m.dev_ = static_cast<uint64_t>(st.st_dev);
  m.ino_ = static_cast<uint64_t>(st.st_ino);
  if (m.size_ == 0) return m;
  void* p = ::mmap(nullptr, m.size_, PROT_READ | PROT_WRITE, MAP_SHARED, f.fd, 0);
  if (p == MAP_FAILED) return ErrnoStatus(errno, fmt::format("mapping {} read-write", path));
  m.data_ = static_cast<std::byte*>(p);
  m.fd_ = std::exchange(f.fd, -1);
  struct statfs fs {};
  m.written_back_ = !(::fstatfs(m.fd_, &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC));
  return m;
}

bool WritableMapping::StillMaps(const std::string& path) const {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_dev) == dev_ &&
         static_cast<uint64_t>(st.st_ino) == ino_ && static_cast<size_t>(st.st_size) == size_;
}

namespace {

// How long the kernel lets a page stay dirty before its flusher writes it back.
std::chrono::steady_clock::duration DirtyExpiry() {
  static const std::chrono::steady_clock::duration expiry = [] {
    long centisecs = 3000;  // the kernel's default
    Result<std::string> text = ReadFile("/proc/sys/vm/dirty_expire_centisecs");
    if (text.ok()) {
      try {
        centisecs = std::stol(*text);
      } catch (const std::exception&) {
      }
    }
    return std::chrono::steady_clock::duration(std::chrono::milliseconds(10 * std::max(centisecs, 0L)));
  }();
  return expiry;
}

uintptr_t PageSize() {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// Adds 0 to one byte of every page in [from, to) with a locked add: a write access, so a
// page with no entry takes one write fault (not a read fault and then a write fault).
void TouchForWrite(uintptr_t from, uintptr_t to) {
  const uintptr_t page = PageSize();
  for (uintptr_t p = from; p < to; p += page) {
    __atomic_fetch_add(reinterpret_cast<unsigned char*>(p), 0, __ATOMIC_RELAXED);
  }
}

}  // namespace

void WritableMapping::BeginVersion() {
  auto now = std::chrono::steady_clock::now();
  stale_ = !wrote_ || now - last_version_ > DirtyExpiry();
  last_version_ = now;
  wrote_ = true;
}

namespace {
bool cachestat_disabled_for_testing = false;
}  // namespace

void WritableMapping::DisableCachestatForTesting(bool disable) { cachestat_disabled_for_testing = disable; }

std::optional<bool> WritableMapping::AllPagesDirty(std::span<const std::byte> region) const {
  if (cachestat_disabled_for_testing) return std::nullopt;
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
  // cachestat(2), Linux 6.5+, absent from older headers: one number on both ABIs.
  constexpr long kCachestat = 451;
  uint64_t off = static_cast<uint64_t>(region.data() - data_) & ~(PageSize() - 1);
  uint64_t end = static_cast<uint64_t>(region.data() + region.size() - data_);
  struct {
    uint64_t off, len;
  } range{off, end - off};
  struct {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
  } stat{};
  if (::syscall(kCachestat, fd_, &range, &stat, 0) != 0) return std::nullopt;
  uint64_t pages = (end - off + PageSize() - 1) / PageSize();
  return stat.nr_cache == pages && stat.nr_dirty == pages;
#else
  (void)region;
  return std::nullopt;
#endif
}

WritableMapping::Prepared WritableMapping::PrepareForWrite(std::span<std::byte> region) {
  if (region.empty()) return Prepared::kWarm;
  constexpr uintptr_t kProbeBytes = 256 << 10;
  // Touching a writable entry costs well under 0.1 us per page, a write-protected one 2-8 us.
  constexpr double kSlowProbeSecondsPerPage = 1e-6;
  uintptr_t begin = reinterpret_cast<uintptr_t>(region.data()) & ~(PageSize() - 1);
  uintptr_t end = reinterpret_cast<uintptr_t>(region.data() + region.size());
  bool seen;
  {
    std::lock_guard lock(*prepared_mu_);
    seen = !prepared_.insert(static_cast<size_t>(region.data() - data_)).second;
  }
  // tmpfs never writes pages back: entries stay writable until this mapping goes.
  if (seen && (!written_back_ || (!stale_ && AllPagesDirty(region).value_or(true)))) {
    uintptr_t probe_end = std::min(end, begin + kProbeBytes);
    auto t0 = std::chrono::steady_clock::now();
    TouchForWrite(begin, probe_end);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (seconds <= kSlowProbeSecondsPerPage * static_cast<double>((probe_end - begin) / PageSize())) {
      return Prepared::kWarm;
    }
  }
  (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  TouchForWrite(begin, end);
  return seen ? Prepared::kRemapped : Prepared::kMapped;
}

WritableMapping::WritableMapping(WritableMapping&& o) noexcept
    : path_(std::move(o.path_)),
      fd_(std::exchange(o.fd_, -1)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      stale_(o.stale_),
      last_version_(o.last_version_),
      wrote_(o.wrote_),
      written_back_(o.written_back_),
      prepared_mu_(std::move(o.prepared_mu_)),
      prepared_(std::move(o.prepared_)),
      dev_(o.dev_),
      ino_(o.ino_) {}

WritableMapping& WritableMapping::operator=(WritableMapping&& o) noexcept {
  if (this != &o) {
    Release();
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    stale_ = o.stale_;
    last_version_ = o.last_version_;
    wrote_ = o.wrote_;
    written_back_ = o.written_back_;
    prepared_mu_ = std::move(o.prepared_mu_);
    prepared_ = std::move(o.prepared_);
    dev_ = o.dev_;
    ino_ = o.ino_;
  }
  return *this;
}

WritableMapping::~WritableMapping() { Release(); }

void WritableMapping::Release() {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  size_ = 0;
  fd_ = -1;
}

Result<std::vector<TensorLocation>> ReadSafetensorsLayout(const std::string& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)};
  WSYNC_SYSCALL(f.fd, fmt::format("opening {}", path));
  struct stat st {};
  WSYNC_SYSCALL(::fstat(f.fd, &st), fmt::format("stat of {}", path));
  if (!S_ISREG(st.st_mode)) return InvalidArgument(fmt::format("{} is not a regular file", path));
  return ReadSafetensorsLayout(f.fd, static_cast<uint64_t>(st.st_size), path);
}

Status WriteBackTree(const std::string& dir) {
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code type_ec;
    if (!it->is_regular_file(type_ec)) continue;
    Fd f{::open(it->path().c_str(), O_RDONLY | O_CLOEXEC)};
    WSYNC_SYSCALL(f.fd, fmt::format("opening {} to write it back", it->path().string()));
    WSYNC_SYSCALL(::fdatasync(f.fd), fmt::format("writing {} back", it->path().string()));
  }
  if (ec) return Internal(fmt::format("listing {}: {}", dir, ec.message()));
  return Status::Ok();
}

}  // namespace wsync::delta
