#include "backends/ipc/region.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/futex.h>
#include <linux/openat2.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/ipc/sigbus_guard.h"
#include "core/checked_math.h"
#include "core/syscall.h"

namespace wsync {
namespace {

constexpr uint64_t kMagic = 0x4350494353595357ull;  // "WSYNCIPC" in little-endian bytes
constexpr uint32_t kLayoutVersion = 3;  // 2: the announced sync; 3: publisher lines
constexpr uint64_t kHeaderPage = 4096;
constexpr uint64_t kReaderLine = 64;
constexpr uint64_t kCacheLine = 64;
constexpr uint64_t kPublisherLine = kCacheLine * (kIpcMaxSlots + 1);  // slot words, then pid
constexpr uint64_t kSlotAlign = uint64_t{2} << 20;  // 2 MiB: huge-page friendly slots
constexpr auto kMaxSleep = std::chrono::milliseconds(10);
constexpr int kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW;
constexpr std::string_view kShmPrefix = "wsync-ipc-";

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// errno as a Status naming the call, the thing and the place. A region the request
// named that cannot be opened is the request's fault (InvalidArgument).
Status Errno(std::string_view what, int err, const char* file, int line) {
  StatusCode code = err == ENOENT || err == EACCES || err == EPERM || err == ENOTDIR || err == ENXIO
                        ? StatusCode::kInvalidArgument
                        : ErrnoCode(err);
  return ErrnoStatus(err, fmt::format("{} ({}:{})", what, file, line), code);
}
#define WSYNC_IPC_SYSCALL(expr, what) \
  do {                                \
    if ((expr) < 0) return Errno((what), errno, __FILE__, __LINE__); \
  } while (0)

template <typename T>
std::atomic_ref<T> A(T* p) {
  return std::atomic_ref<T>(*p);
}

// Text another process wrote in shared memory, for a message: up to its NUL within
// `max` bytes, every byte outside printable ASCII as '?' (it may change while it is
// read, and must not make a message that is not UTF-8).
std::string SharedText(const char* p, size_t max) {
  std::string out;
  for (size_t i = 0; i < max; ++i) {
    char c = A(const_cast<char*>(p + i)).load(std::memory_order_relaxed);
    if (c == '\0') break;
    out.push_back(c >= ' ' && c < 127 ? c : '?');
  }
  return out;
}

}  // namespace

struct IpcRegion::Header {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t num_slots;
  uint64_t slot_bytes;
  uint64_t slot_stride;
  uint64_t header_bytes;
  uint64_t total_bytes;
  uint32_t reader_count;
  uint32_t trainer_pid;
  uint32_t publisher_count;
  char session[32];
  alignas(64) uint32_t publish_futex;
  alignas(64) uint32_t ack_futex;
  alignas(64) uint64_t aborted_sync;
  char abort_reason[248];
  alignas(64) uint64_t announced_sync;  // written last by Announce, read first and last by Announced
  uint64_t announced_first_seq;
};

static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free);

IpcRegion::Header* IpcRegion::header() const {
  static_assert(sizeof(Header) <= kHeaderPage);
  return reinterpret_cast<Header*>(base_);
}
// Publisher line p: slot k's {seq, bytes} at + 64 k, the pid at + 64 num_slots_max, the
// liveness lock on the line's last byte.
uint64_t* IpcRegion::slot_seq(int p, int k) const {
  return reinterpret_cast<uint64_t*>(base_ + kHeaderPage + kPublisherLine * p + kCacheLine * k);
}
uint64_t* IpcRegion::slot_bytes_word(int p, int k) const { return slot_seq(p, k) + 1; }
uint32_t* IpcRegion::publisher_pid(int p) const {
  return reinterpret_cast<uint32_t*>(base_ + kHeaderPage + kPublisherLine * p + kCacheLine * kIpcMaxSlots);
}
uint64_t IpcRegion::publisher_lock_byte(int p) const { return kHeaderPage + kPublisherLine * (p + 1) - 1; }
uint64_t IpcRegion::readers_begin() const { return kHeaderPage + kPublisherLine * publisher_count_; }
// Reader line r: {acked seq (u64), pid (u32), publisher (u32)}.
uint64_t* IpcRegion::reader_acked(int r) const {
  return reinterpret_cast<uint64_t*>(base_ + readers_begin() + kReaderLine * r);
}

Result<std::unique_ptr<IpcRegion>> IpcRegion::Create(const IpcRegionOptions& o) {
  if (o.num_slots < 1 || o.num_slots > kIpcMaxSlots) {
    return InvalidArgument(fmt::format("ipc region: num_slots {} must be within 1..{}", o.num_slots, kIpcMaxSlots));
  }
  if (o.reader_count < 1 || o.reader_count > kIpcMaxReaders) {
    return InvalidArgument(fmt::format("ipc region: reader_count {} must be within 1..{}", o.reader_count,
                                       kIpcMaxReaders));
  }
  if (o.slot_bytes == 0) return InvalidArgument("ipc region: slot size must be positive");
  if (o.publisher_count < 1 || o.publisher_count > kIpcMaxPublishers) {
    return InvalidArgument(fmt::format("ipc region: publisher_count {} must be within 1..{}", o.publisher_count,
                                       kIpcMaxPublishers));
  }
  std::unique_ptr<IpcRegion> r(new IpcRegion());
  r->owner_ = true;
  r->session_ = o.session;
  r->num_slots_ = o.num_slots;
  r->slot_bytes_ = o.slot_bytes;
  r->reader_count_ = o.reader_count;
  r->publisher_count_ = o.publisher_count;
  r->slots_in_region_ = o.slots_in_region;
  uint64_t control = kHeaderPage + kPublisherLine * o.publisher_count + kReaderLine * o.reader_count;
  if (o.slot_bytes > kIpcMaxRegionBytes) {
    return InvalidArgument(fmt::format("ipc region: slot size {} exceeds {} bytes", o.slot_bytes, kIpcMaxRegionBytes));
  }
  r->slot_stride_ = AlignUp(o.slot_bytes, kSlotAlign);
  if (o.slots_in_region) {
    r->header_bytes_ = AlignUp(control, kSlotAlign);
    std::optional<uint64_t> total = CheckedMulAdd(r->slot_stride_, o.num_slots, r->header_bytes_);
    if (!total || *total > kIpcMaxRegionBytes) {
      return InvalidArgument(fmt::format("ipc region: {} slot(s) of {} bytes exceed {} bytes", o.num_slots,
                                         o.slot_bytes, kIpcMaxRegionBytes));
    }
    r->bytes_ = *total;
  } else {
    r->header_bytes_ = AlignUp(control, kHeaderPage);
    r->bytes_ = r->header_bytes_;
  }
  std::string label = fmt::format("wsync-ipc-{}", o.session.substr(0, 12));
  if (o.backing == ShmBacking::kMemfd) {
    r->fd_ = memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    WSYNC_IPC_SYSCALL(r->fd_, "memfd_create for the ipc staging region");
    r->path_ = fmt::format("/proc/{}/fd/{}", getpid(), r->fd_);
  } else {
    r->shm_name_ = "/" + label;
    r->fd_ = shm_open(r->shm_name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    WSYNC_IPC_SYSCALL(r->fd_, fmt::format("shm_open {}", r->shm_name_));
    r->path_ = "/dev/shm" + r->shm_name_;
  }
  WSYNC_IPC_SYSCALL(flock(r->fd_, LOCK_EX | LOCK_NB), "locking the ipc region (trainer liveness)");
  WSYNC_IPC_SYSCALL(ftruncate(r->fd_, static_cast<off_t>(r->bytes_)),
                    fmt::format("sizing the ipc region to {} bytes", r->bytes_));
  if (o.backing == ShmBacking::kMemfd) {
    // Receivers keep the region mapped across syncs and refuse one whose size could
    // change under them (a shrink would turn their next read into SIGBUS).
    WSYNC_IPC_SYSCALL(fcntl(r->fd_, F_ADD_SEALS, kRequiredSeals | F_SEAL_SEAL), "sealing the ipc region's memfd");
  }
  void* p = mmap(nullptr, r->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd_, 0);
  if (p == MAP_FAILED) return Errno(fmt::format("mapping {} bytes of {}", r->bytes_, r->path_), errno, __FILE__, __LINE__);
  r->base_ = static_cast<std::byte*>(p);
  if (o.slots_in_region) madvise(r->base_ + r->header_bytes_, r->bytes_ - r->header_bytes_, MADV_HUGEPAGE);

  Header* h = r->header();
  h->layout_version = kLayoutVersion;
  h->num_slots = o.num_slots;
  h->slot_bytes = o.slot_bytes;
  h->slot_stride = r->slot_stride_;
  h->header_bytes = r->header_bytes_;
  h->total_bytes = r->bytes_;
  h->reader_count = o.reader_count;
  h->trainer_pid = static_cast<uint32_t>(getpid());
  h->publisher_count = static_cast<uint32_t>(o.publisher_count);
  *r->publisher_pid(0) = h->trainer_pid;
  std::memcpy(h->session, o.session.data(), std::min<size_t>(o.session.size(), sizeof(h->session)));
  A(&h->magic).store(kMagic, std::memory_order_release);  // last: the header is complete
  return r;
}

namespace {

// Closes the fd it holds.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int release() { return std::exchange(fd, -1); }
};

bool AllDigits(std::string_view s, size_t max_len) {
  return !s.empty() && s.size() <= max_len && (s == "0" || s.front() != '0') &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Whether `path` is exactly /proc/<pid>/fd/<n>: a process's open file, never a name in a
// directory tree.
bool IsProcFdPath(std::string_view path) {
  constexpr std::string_view kProc = "/proc/";
  if (!path.starts_with(kProc)) return false;
  path.remove_prefix(kProc.size());
  size_t slash = path.find('/');
  if (slash == std::string_view::npos || !AllDigits(path.substr(0, slash), 10) || path.substr(0, slash) == "0") {
    return false;
  }
  path.remove_prefix(slash);
  return path.starts_with("/fd/") && AllDigits(path.substr(4), 10);
}

// NAME when `path` is `dir`/NAME, NAME one component carrying the wsync prefix and
// only [A-Za-z0-9._-].
std::optional<std::string> ShmName(std::string_view path, std::string_view dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.remove_suffix(1);
  if (dir.empty() || dir.front() != '/' || !path.starts_with(dir)) return std::nullopt;
  path.remove_prefix(dir.size());
  if (dir != "/" && !path.starts_with("/")) return std::nullopt;
  if (path.starts_with("/")) path.remove_prefix(1);
  if (!path.starts_with(kShmPrefix) || path.size() > 255) return std::nullopt;
  bool ok = std::all_of(path.begin(), path.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
  return ok ? std::optional<std::string>(path) : std::nullopt;
}

// Opens `name` beneath the directory `dir_fd` as an O_PATH fd: no symlink anywhere, no
// magic link, no other mount (openat2; where the kernel lacks it, the single component
// with O_NOFOLLOW is the same).
int OpenBeneath(int dir_fd, const std::string& name) {
  open_how how{};
  how.flags = O_PATH | O_NOFOLLOW | O_CLOEXEC;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
  int fd = static_cast<int>(syscall(SYS_openat2, dir_fd, name.c_str(), &how, sizeof(how)));
  if (fd < 0 && errno == ENOSYS) fd = openat(dir_fd, name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
  return fd;
}

}  // namespace

// The control path is untrusted (an HTTP body names it). What may be opened: a sealed
// memfd named /proc/<pid>/fd/<n>, or (only where the server's flags name a directory for
// POSIX shm) a regular file of this user directly in that directory, carrying the wsync
// prefix. Everything is first opened O_PATH (no side effect on a FIFO or a device) and
// checked to be a regular file of a plausible size before it is opened for reading and
// writing. Until the file proves to be a wsync region, every refusal reads the same, so
// that nothing tells whether a path outside those places exists, or its size.
Result<IpcRegion::Opened> IpcRegion::OpenControl(const std::string& path, const IpcOpenPolicy& policy) {
  std::string shown = IpcClip(path, 256);
  auto refused = [&] {
    return InvalidArgument(fmt::format(
        "init_info control_path '{}' is not a wsync ipc region this server may open: it must be /proc/<pid>/fd/<n> "
        "naming the trainer's sealed memfd (the trainer running on this host, in a PID namespace this server can "
        "see, and alive){}", shown,
        policy.shm_dir.empty()
            ? std::string("; POSIX shm names are refused unless `wsync serve --ipc-shm-dir DIR` allows a directory")
            : fmt::format(", or a file {}/{}* of this server's user", policy.shm_dir, kShmPrefix)));
  };
  bool in_shm_dir = false;
  Fd opath(-1);
  if (IsProcFdPath(path)) {
    opath.fd = open(path.c_str(), O_PATH | O_CLOEXEC);  // follows only the fd's magic link
  } else if (std::optional<std::string> name = ShmName(path, policy.shm_dir)) {
    Fd dir(open(policy.shm_dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (dir.fd < 0) return refused();
    opath.fd = OpenBeneath(dir.fd, *name);
    in_shm_dir = true;
  }
  if (opath.fd < 0) return refused();
  struct stat st {};
  if (fstat(opath.fd, &st) != 0 || !S_ISREG(st.st_mode) || (in_shm_dir && st.st_uid != geteuid()) ||
      st.st_size < static_cast<off_t>(kHeaderPage) || static_cast<uint64_t>(st.st_size) > kIpcMaxRegionBytes) {
    return refused();
  }
  Fd fd(open(fmt::format("/proc/self/fd/{}", opath.fd).c_str(), O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC));
  struct stat again {};
  if (fd.fd < 0 || fstat(fd.fd, &again) != 0 || again.st_ino != st.st_ino || again.st_dev != st.st_dev) {
    return refused();
  }
  int seals = fcntl(fd.fd, F_GET_SEALS);
  bool sealed = seals >= 0 && (seals & kRequiredSeals) == kRequiredSeals;
  if (!sealed && !in_shm_dir) {
    uint64_t magic = 0;
    if (pread(fd.fd, &magic, sizeof(magic), 0) != static_cast<ssize_t>(sizeof(magic)) || magic != kMagic) {
      return refused();
    }
    return InvalidArgument(fmt::format(
        "ipc control region '{}' is not sealed (it needs F_SEAL_SHRINK|F_SEAL_GROW, it has {:#x}): this server maps "
        "only memfds whose size cannot change under the mapping; use a trainer that seals its region", shown,
        seals < 0 ? 0 : seals));
  }
  int flags = fcntl(fd.fd, F_GETFL);
  if (flags >= 0) fcntl(fd.fd, F_SETFL, flags & ~O_NONBLOCK);
  return Opened{fd.release(), sealed};
}

// Maps the control region `path` names and checks that it is a region of this layout and
// `session`. The header is copied once and only the copy is checked and used: the peer
// may rewrite the shared words at any time, so the geometry kept in the members is all
// this process ever relies on.
Result<std::unique_ptr<IpcRegion>> IpcRegion::Map(const std::string& path, const std::string& session,
                                                  const IpcOpenPolicy& policy) {
  WSYNC_ASSIGN_OR_RETURN(Opened opened, OpenControl(path, policy));
  std::unique_ptr<IpcRegion> r(new IpcRegion());
  r->path_ = path;
  r->fd_ = opened.fd;
  r->sealed_ = opened.sealed;
  std::string where = fmt::format("ipc control region '{}'", IpcClip(path, 256));
  struct stat st {};
  WSYNC_IPC_SYSCALL(fstat(r->fd_, &st), fmt::format("fstat {}", where));
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kHeaderPage || size > kIpcMaxRegionBytes) {  // an unsealed file may have changed since
    return InvalidArgument(fmt::format("{} has {} bytes, outside {}..{}", where, size, kHeaderPage, kIpcMaxRegionBytes));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd_, 0);
  if (p == MAP_FAILED) return Errno(fmt::format("mapping {}", where), errno, __FILE__, __LINE__);
  r->base_ = static_cast<std::byte*>(p);
  r->bytes_ = size;
  if (!r->sealed_) {
    WSYNC_ASSIGN_OR_RETURN(r->guard_, SigbusGuard::Register(r->base_, size));
  }
  Header h;
  std::memcpy(&h, r->base_, sizeof(h));
  WSYNC_RETURN_IF_ERROR(r->CheckStillMapped());
  if (h.magic != kMagic) return InvalidArgument(where + " is not a wsync ipc region (bad magic)");
  if (h.layout_version != kLayoutVersion) {
    return InvalidArgument(fmt::format("{} has layout version {}, this process reads {}", where, h.layout_version,
                                       kLayoutVersion));
  }
  std::string got(h.session, sizeof(h.session));
  if (got != session) {
    return InvalidArgument(fmt::format("{} belongs to another session than init_info's {} (stale path?)", where,
                                       session));
  }
  auto bad = [&](std::string what) { return InvalidArgument(fmt::format("{}: header {}", where, what)); };
  if (h.total_bytes != size) return bad(fmt::format("total_bytes {} differs from the file's {} bytes", h.total_bytes, size));
  if (h.num_slots < 1 || h.num_slots > kIpcMaxSlots) {
    return bad(fmt::format("num_slots {} is outside 1..{}", h.num_slots, kIpcMaxSlots));
  }
  if (h.publisher_count < 1 || h.publisher_count > static_cast<uint32_t>(kIpcMaxPublishers)) {
    return bad(fmt::format("publisher_count {} is outside 1..{}", h.publisher_count, kIpcMaxPublishers));
  }
  if (h.reader_count < 1 || h.reader_count > static_cast<uint32_t>(kIpcMaxReaders)) {
    return bad(fmt::format("reader_count {} is outside 1..{}", h.reader_count, kIpcMaxReaders));
  }
  uint64_t lines = kHeaderPage + kPublisherLine * h.publisher_count + kReaderLine * h.reader_count;  // bounded above
  if (h.header_bytes < lines || h.header_bytes > size) {
    return bad(fmt::format("header_bytes {} is outside {}..{} (its publisher and reader lines, the file's size)",
                           h.header_bytes, lines, size));
  }
  if (h.slot_bytes == 0 || h.slot_stride < h.slot_bytes) {
    return bad(fmt::format("slot_stride {} is below slot_bytes {} (or slot_bytes is 0)", h.slot_stride, h.slot_bytes));
  }
  std::optional<uint64_t> slots_end = CheckedMulAdd(h.slot_stride, h.num_slots, h.header_bytes);
  if (!slots_end) {
    return bad(fmt::format("slot_stride {} x num_slots {} + header_bytes {} overflows 64 bits", h.slot_stride,
                           h.num_slots, h.header_bytes));
  }
  r->session_ = got;
  r->num_slots_ = static_cast<int>(h.num_slots);
  r->slot_bytes_ = h.slot_bytes;
  r->slot_stride_ = h.slot_stride;
  r->header_bytes_ = h.header_bytes;
  r->reader_count_ = static_cast<int>(h.reader_count);
  r->publisher_count_ = static_cast<int>(h.publisher_count);
  r->slots_in_region_ = *slots_end <= size;
  return r;
}

Status IpcRegion::CheckStillMapped() const {
  if (sealed_ || owner_ || base_ == nullptr) return Status::Ok();
  struct stat st {};
  if (fstat(fd_, &st) != 0) return Errno(fmt::format("fstat {}", path_), errno, __FILE__, __LINE__);
  if (static_cast<uint64_t>(st.st_size) < bytes_ || (guard_ && guard_->tripped())) {
    return DataLoss(fmt::format("ipc control region '{}' shrank to {} bytes while mapped ({} bytes at init): the "
                                "session is released; the trainer must init again", IpcClip(path_, 256), st.st_size,
                                bytes_));
  }
  return Status::Ok();
}

Result<std::unique_ptr<IpcRegion>> IpcRegion::Open(const IpcInitInfo& info, const IpcOpenPolicy& policy) {
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<IpcRegion> r, Map(info.control_path, info.session, policy));
  if (r->bytes_ < info.control_bytes) {
    return InvalidArgument(fmt::format("ipc control region '{}' has {} bytes, init_info says {}: not a wsync ipc region",
                                       info.control_path, r->bytes_, info.control_bytes));
  }
  if (r->num_slots_ != info.num_slots || r->slot_bytes_ != info.slot_bytes || r->reader_count_ != info.reader_count) {
    return InvalidArgument(fmt::format(
        "ipc control region '{}' describes {} slot(s) of {} bytes for {} reader(s) in {} bytes; init_info says {} "
        "slot(s) of {} bytes for {} reader(s)", info.control_path, r->num_slots_, r->slot_bytes_, r->reader_count_,
        r->bytes_, info.num_slots, info.slot_bytes, info.reader_count));
  }
  for (const auto& [key, b] : info.buffers) {
    if (b.publisher >= r->publisher_count_) {
      return InvalidArgument(fmt::format("init_info buffers['{}'] names publisher {}, but the region '{}' has {}",
                                         key, b.publisher, info.control_path, r->publisher_count_));
    }
  }
  return r;
}

Result<std::unique_ptr<IpcRegion>> IpcRegion::OpenPublisher(const std::string& path, const std::string& session,
                                                             int publisher) {
  // The trainer's own ranks: rank 0's region is a memfd or a POSIX shm name (Create).
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<IpcRegion> r, Map(path, session, IpcOpenPolicy{"/dev/shm"}));
  if (publisher < 1 || publisher >= r->publisher_count_) {
    return InvalidArgument(fmt::format("ipc control region '{}' has publishers 0..{}, not {}", path,
                                       r->publisher_count_ - 1, publisher));
  }
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = static_cast<off_t>(r->publisher_lock_byte(publisher));
  lock.l_len = 1;
  WSYNC_IPC_SYSCALL(fcntl(r->fd_, F_OFD_SETLK, &lock),
                    fmt::format("locking publisher {} of {} (is another trainer rank publisher {}?)", publisher, path,
                                publisher));
  r->publisher_ = publisher;
  A(r->publisher_pid(publisher)).store(static_cast<uint32_t>(getpid()), std::memory_order_release);
  return r;
}

IpcRegion::~IpcRegion() {
  guard_.reset();  // before the range is unmapped
  if (base_ != nullptr) munmap(base_, bytes_);
  if (owner_ && slots_in_region_ && fd_ >= 0 && bytes_ > header_bytes_) {
    // Frees the staging pages now, even while a server still maps the file; the header
    // stays, so a late reader sees no new sequence numbers, only the trainer's exit.
    fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(header_bytes_),
              static_cast<off_t>(bytes_ - header_bytes_));
  }
  UnlinkName();
  if (fd_ >= 0) close(fd_);  // the trainer's close drops its liveness lock
}

std::span<std::byte> IpcRegion::slot(int k) {
  if (!slots_in_region_ || k < 0 || k >= num_slots_) return {};
  return {base_ + header_bytes_ + slot_stride_ * k, slot_bytes_};
}

IpcBufferDesc IpcRegion::ShmBuffer() const {
  IpcBufferDesc d;
  d.kind = "shm";
  d.offset = header_bytes_;
  d.stride = slot_stride_;
  return d;
}

void IpcRegion::UnlinkName() {
  if (!shm_name_.empty()) {
    shm_unlink(shm_name_.c_str());
    shm_name_.clear();
  }
}

void IpcRegion::FutexWait(uint32_t* word, uint32_t seen, std::chrono::microseconds max_wait) {
  timespec ts{static_cast<time_t>(max_wait.count() / 1000000), static_cast<long>(max_wait.count() % 1000000) * 1000};
  syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, nullptr, 0);  // shared: not FUTEX_PRIVATE
}

void IpcRegion::FutexBump(uint32_t* word) {
  A(word).fetch_add(1, std::memory_order_release);
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void IpcRegion::Announce(uint64_t sync, uint64_t first_seq) {
  Header* h = header();
  A(&h->announced_sync).store(0, std::memory_order_release);  // readers retry until both words are new
  A(&h->announced_first_seq).store(first_seq, std::memory_order_release);
  A(&h->announced_sync).store(sync, std::memory_order_release);
  if (publisher_count_ > 1) FutexBump(&h->publish_futex);  // publishers p > 0 wait for it
}

Result<uint64_t> IpcRegion::WaitAnnounced(uint64_t sync, Deadline deadline) {
  Header* h = header();
  auto last_probe = Deadline::Clock::now();
  for (;;) {
    uint32_t seen = A(&h->publish_futex).load(std::memory_order_acquire);
    Announcement a = Announced();
    if (a.sync == sync) return a.first_seq;
    if (a.sync > sync) {
      return FailedPrecondition(fmt::format("publisher {} expected sync {}, the trainer announced sync {}", publisher_,
                                            sync, a.sync));
    }
    if (auto reason = AbortedReason(sync)) {
      return Aborted(fmt::format("sync {} was abandoned before it started: {}", sync, *reason));
    }
    auto now = Deadline::Clock::now();
    if (now - last_probe >= kMaxSleep) {
      last_probe = now;
      if (!PublisherAlive(0)) {
        return Unavailable(fmt::format("the trainer (rank 0, pid {}) exited before announcing sync {} (session {})",
                                       h->trainer_pid, sync, session_));
      }
    }
    if (deadline.expired()) {
      return DeadlineExceeded(fmt::format("the trainer (rank 0, pid {}) did not announce sync {} in time",
                                          h->trainer_pid, sync));
    }
    FutexWait(&h->publish_futex, seen, std::min<std::chrono::microseconds>(kMaxSleep, deadline.remaining()));
  }
}

IpcRegion::Announcement IpcRegion::Announced() const {
  Header* h = header();
  // A trainer announces once per sync; one that rewrites the words without end gets
  // "nothing announced" rather than a reader spinning here.
  for (int attempt = 0; attempt < 4096; ++attempt) {
    Announcement a;
    a.sync = A(&h->announced_sync).load(std::memory_order_acquire);
    a.first_seq = A(&h->announced_first_seq).load(std::memory_order_acquire);
    if (A(&h->announced_sync).load(std::memory_order_acquire) == a.sync) return a;
  }
  return Announcement{};
}

void IpcRegion::Publish(uint64_t seq, uint64_t bytes) {
  Header* h = header();
  int k = static_cast<int>(seq % num_slots_);
  A(slot_bytes_word(publisher_, k)).store(bytes, std::memory_order_relaxed);
  A(slot_seq(publisher_, k)).store(seq, std::memory_order_release);
  FutexBump(&h->publish_futex);
}

uint64_t IpcRegion::acked(int reader) const {
  return A(reader_acked(reader)).load(std::memory_order_acquire);
}

Status IpcRegion::WaitAcked(uint64_t seq, Deadline deadline, const std::function<Status()>& check,
                            const std::function<std::string(int)>& describe_reader) {
  if (seq == 0) return Status::Ok();
  Header* h = header();
  int spins = 0;
  for (;;) {
    uint32_t seen = A(&h->ack_futex).load(std::memory_order_acquire);
    bool all = true;
    for (int r = 0; r < reader_count_ && all; ++r) all = acked(r) >= seq || reader_publisher(r) != publisher_;
    if (all) return Status::Ok();
    if (check) WSYNC_RETURN_IF_ERROR(check());
    if (deadline.expired()) {
      std::vector<std::string> late;
      int mine = 0;
      for (int r = 0; r < reader_count_; ++r) {
        mine += reader_publisher(r) == publisher_;
        if (acked(r) < seq && reader_publisher(r) == publisher_) late.push_back(describe_reader ? describe_reader(r) : fmt::format("reader {}", r));
      }
      return DeadlineExceeded(fmt::format("{} of {} receiving worker(s) did not finish chunk seq {} in time: {}{}",
                                          late.size(), mine, seq,
                                          fmt::join(late.begin(), late.begin() + std::min<size_t>(late.size(), 4), ", "),
                                          late.size() > 4 ? ", ..." : ""));
    }
    if (++spins < 64) {
      std::this_thread::yield();
      continue;
    }
    FutexWait(&h->ack_futex, seen, std::min<std::chrono::microseconds>(kMaxSleep, deadline.remaining()));
  }
}

void IpcRegion::Abort(uint64_t sync, std::string_view reason) {
  Header* h = header();
  // The first rank to abandon a sync names the root cause; later ones only follow it.
  if (A(&h->aborted_sync).load(std::memory_order_acquire) == sync) return;
  size_t n = std::min(reason.size(), sizeof(h->abort_reason) - 1);
  std::memcpy(h->abort_reason, reason.data(), n);
  h->abort_reason[n] = '\0';
  A(&h->aborted_sync).store(sync, std::memory_order_release);
  FutexBump(&h->publish_futex);
}

bool IpcRegion::HasReaders() const {
  for (int r = 0; r < reader_count_; ++r) {
    if (reader_publisher(r) == publisher_) return true;
  }
  return false;
}

std::optional<std::string> IpcRegion::AbortedReason(uint64_t sync) const {
  const Header* h = header();
  if (A(const_cast<uint64_t*>(&h->aborted_sync)).load(std::memory_order_acquire) != sync) return std::nullopt;
  return SharedText(h->abort_reason, sizeof(h->abort_reason));
}

bool IpcRegion::PublisherAlive(int p) {
  if (p == 0) return TrainerAlive();
  if (p == publisher_ && !owner_) return true;
  struct flock probe {};
  probe.l_type = F_RDLCK;
  probe.l_whence = SEEK_SET;
  probe.l_start = static_cast<off_t>(publisher_lock_byte(p));
  probe.l_len = 1;
  if (fcntl(fd_, F_OFD_GETLK, &probe) != 0) return true;  // cannot tell: the deadline decides
  return probe.l_type != F_UNLCK;
}

void IpcRegion::Attach(int reader, uint32_t pid, int publisher) {
  A(reinterpret_cast<uint32_t*>(reader_acked(reader) + 1) + 1).store(static_cast<uint32_t>(publisher),
                                                                       std::memory_order_relaxed);
  A(reinterpret_cast<uint32_t*>(reader_acked(reader) + 1)).store(pid, std::memory_order_release);
}

int IpcRegion::reader_publisher(int reader) const {
  return static_cast<int>(
      A(reinterpret_cast<uint32_t*>(reader_acked(reader) + 1) + 1).load(std::memory_order_relaxed));
}

uint32_t IpcRegion::reader_pid(int reader) const {
  return A(reinterpret_cast<uint32_t*>(reader_acked(reader) + 1)).load(std::memory_order_relaxed);
}

void IpcRegion::Ack(int reader, uint64_t seq) {
  A(reader_acked(reader)).store(seq, std::memory_order_release);
  FutexBump(&header()->ack_futex);
}

bool IpcRegion::TrainerAlive() {
  if (owner_) return true;
  if (flock(fd_, LOCK_SH | LOCK_NB) == 0) {
    flock(fd_, LOCK_UN);
    return false;  // nobody holds the trainer's exclusive lock any more
  }
  return errno == EWOULDBLOCK || errno == EINTR;
}

uint32_t IpcRegion::trainer_pid() const { return header()->trainer_pid; }

Status IpcRegion::WaitPublished(uint64_t seq, uint64_t sync, Deadline deadline, std::string_view what,
                                int publisher) {
  Header* h = header();
  if (publisher < 0 || publisher >= publisher_count_) {
    return InvalidArgument(fmt::format("{}: the region has no publisher {}", what, publisher));
  }
  int k = static_cast<int>(seq % num_slots_);
  auto last_probe = Deadline::Clock::now();
  int spins = 0;
  for (;;) {
    uint32_t seen = A(&h->publish_futex).load(std::memory_order_acquire);
    uint64_t got = A(slot_seq(publisher, k)).load(std::memory_order_acquire);
    if (guard_ && guard_->tripped()) return CheckStillMapped().WithContext(what);
    if (got == seq) return Status::Ok();
    if (got > seq) {
      return DataLoss(fmt::format("{}: slot {} already carries chunk seq {} (wanted {}): this reader fell behind the trainer",
                                  what, k, got, seq));
    }
    if (A(&h->aborted_sync).load(std::memory_order_acquire) == sync) {
      return Aborted(fmt::format("{}: the trainer abandoned sync {}: {}", what, sync,
                                 SharedText(h->abort_reason, sizeof(h->abort_reason))));
    }
    auto now = Deadline::Clock::now();
    if (now - last_probe >= kMaxSleep) {
      last_probe = now;
      if (!TrainerAlive()) {
        return Unavailable(fmt::format("{}: the trainer (pid {}) exited during the sync (session {})", what,
                                       h->trainer_pid, session_));
      }
      if (publisher != 0 && !PublisherAlive(publisher)) {
        return Unavailable(fmt::format("{}: trainer publisher {} (pid {}) exited during the sync (session {})", what,
                                       publisher, A(publisher_pid(publisher)).load(std::memory_order_relaxed),
                                       session_));
      }
    }
    if (deadline.expired()) {
      if (publisher != 0) {
        return DeadlineExceeded(fmt::format("{}: trainer publisher {} (pid {}) did not publish chunk seq {} in time",
                                            what, publisher,
                                            A(publisher_pid(publisher)).load(std::memory_order_relaxed), seq));
      }
      return DeadlineExceeded(fmt::format("{}: the trainer (pid {}) did not publish chunk seq {} in time", what,
                                          h->trainer_pid, seq));
    }
    if (++spins < 64) {
      std::this_thread::yield();
      continue;
    }
    FutexWait(&h->publish_futex, seen, std::min<std::chrono::microseconds>(kMaxSleep, deadline.remaining()));
  }
}

}  // namespace wsync
