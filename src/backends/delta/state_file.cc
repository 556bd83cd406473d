#include "backends/delta/state_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <utility>

#include <fmt/format.h>
#include <xxhash.h>

#include "core/syscall.h"

namespace wsync::delta {
namespace {

constexpr char kMagic[8] = {'W', 'S', 'Y', 'N', 'C', 'T', 'S', 'T'};

// The header's fields, in file order (native byte order: the file never leaves its host).
struct HeaderFields {
  char magic[8];
  uint32_t format_version;
  uint32_t header_bytes;
  uint64_t file_bytes;
  uint64_t tensors;
  uint64_t layout_digest;
  int64_t version;
  uint64_t checksum;  // xxh3-64 of every field above
};
static_assert(sizeof(HeaderFields) == 56);

uint64_t FieldsChecksum(const HeaderFields& h) { return XXH3_64bits(&h, offsetof(HeaderFields, checksum)); }

uintptr_t PageSize() {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

void ReleaseFilePages(std::span<const std::byte> bytes) {
  if (bytes.empty()) return;
  uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) & ~(PageSize() - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(bytes.data() + bytes.size()) + PageSize() - 1) & ~(PageSize() - 1);
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

std::vector<StateTensor> TrainerStateFile::Layout(const std::vector<TensorMeta>& tensors, uint64_t* file_bytes) {
  std::vector<StateTensor> out;
  uint64_t at = kHeaderBytes;
  for (const TensorMeta& m : tensors) {
    out.push_back(StateTensor{m, at});
    at += (m.nbytes() + kStatePageBytes - 1) / kStatePageBytes * kStatePageBytes;
  }
  *file_bytes = at;
  return out;
}

Result<std::unique_ptr<TrainerStateFile>> TrainerStateFile::Create(const std::string& path,
                                                                   std::vector<StateTensor> tensors,
                                                                   uint64_t file_bytes, int64_t version) {
  std::unique_ptr<TrainerStateFile> f(new TrainerStateFile());
  XXH3_state_t* layout = XXH3_createState();
  XXH3_64bits_reset(layout);
  for (const StateTensor& t : tensors) {
    if (t.offset < kHeaderBytes || t.offset % kStatePageBytes != 0 || t.offset + t.meta.nbytes() > file_bytes) {
      XXH3_freeState(layout);
      return InvalidArgument(fmt::format("state file {}: {} at offset {} ({} bytes) does not fit a file of {} bytes",
                                         path, t.meta.name, t.offset, t.meta.nbytes(), file_bytes));
    }
    const uint64_t fields[] = {static_cast<uint64_t>(t.meta.dtype), t.meta.shape.size(), t.offset, t.meta.nbytes()};
    XXH3_64bits_update(layout, t.meta.name.data(), t.meta.name.size() + 1);  // with its terminator
    XXH3_64bits_update(layout, fields, sizeof(fields));
    XXH3_64bits_update(layout, t.meta.shape.data(), t.meta.shape.size() * sizeof(int64_t));
  }
  f->layout_digest_ = XXH3_64bits_digest(layout);
  XXH3_freeState(layout);
  f->path_ = path;
  f->file_bytes_ = file_bytes;
  f->tensors_ = std::move(tensors);
  f->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  WSYNC_SYSCALL(f->fd_, fmt::format("opening trainer state file {}", path));
  if (::flock(f->fd_, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    ::close(std::exchange(f->fd_, -1));
    f->path_.clear();  // not ours to remove
    if (err == EWOULDBLOCK) {
      return FailedPrecondition(fmt::format("trainer state file {} is held by another delta publisher; give each "
                                            "publisher its own sync directory", path));
    }
    return ErrnoStatus(err, fmt::format("locking trainer state file {}", path));
  }
  // Emptied first: no page of an earlier run's file survives into this one.
  WSYNC_SYSCALL(::ftruncate(f->fd_, 0), fmt::format("truncating trainer state file {}", path));
  WSYNC_SYSCALL(::ftruncate(f->fd_, static_cast<off_t>(file_bytes)),
                fmt::format("sizing trainer state file {} to {} bytes", path, file_bytes));
  WSYNC_RETURN_IF_ERROR(f->SetVersion(version));
  void* p = ::mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f->fd_, 0);
  if (p == MAP_FAILED) return ErrnoStatus(errno, fmt::format("mapping trainer state file {} read-write", path));
  f->data_ = static_cast<std::byte*>(p);
  return f;
}

TrainerStateFile::~TrainerStateFile() {
  if (data_ != nullptr) ::munmap(data_, file_bytes_);
  if (fd_ >= 0) ::close(fd_);
  if (!path_.empty()) {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
}

std::span<std::byte> TrainerStateFile::Region(size_t i) const {
  return {data_ + tensors_[i].offset, tensors_[i].meta.nbytes()};
}

Status TrainerStateFile::Write(size_t i, uint64_t offset, std::span<const std::byte> bytes) const {
  const StateTensor& t = tensors_[i];
  if (offset > t.meta.nbytes() || bytes.size() > t.meta.nbytes() - offset) {
    return Internal(fmt::format("state file {}: write of {} bytes at {} overruns {} ({} bytes)", path_, bytes.size(),
                                offset, t.meta.name, t.meta.nbytes()));
  }
  const char* p = reinterpret_cast<const char*>(bytes.data());
  size_t n = bytes.size();
  off_t at = static_cast<off_t>(t.offset + offset);
  while (n > 0) {
    ssize_t w = RetryOnEintr([&] { return ::pwrite(fd_, p, n, at); });
    WSYNC_SYSCALL(w, fmt::format("writing {} into trainer state file {}", t.meta.name, path_));
    p += w;
    n -= static_cast<size_t>(w);
    at += w;
  }
  return Status::Ok();
}

void TrainerStateFile::PrepareForWrite(std::span<std::byte> region) const {
  if (region.empty()) return;
  const uintptr_t page = PageSize();
  const uintptr_t end = reinterpret_cast<uintptr_t>(region.data() + region.size());
  // A locked add of 0: a write access that changes nothing.
  for (uintptr_t p = reinterpret_cast<uintptr_t>(region.data()) & ~(page - 1); p < end; p += page) {
    __atomic_fetch_add(reinterpret_cast<unsigned char*>(p), 0, __ATOMIC_RELAXED);
  }
}

void TrainerStateFile::Release(std::span<const std::byte> region) const { ReleaseFilePages(region); }

std::string TrainerStateFile::Header(int64_t version) const {
  HeaderFields h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.format_version = kFormatVersion;
  h.header_bytes = static_cast<uint32_t>(kHeaderBytes);
  h.file_bytes = file_bytes_;
  h.tensors = tensors_.size();
  h.layout_digest = layout_digest_;
  h.version = version;
  h.checksum = FieldsChecksum(h);
  std::string out(sizeof(h), '\0');
  std::memcpy(out.data(), &h, sizeof(h));
  return out;
}

Status TrainerStateFile::SetVersion(int64_t version) {
  std::string h = Header(version);
  ssize_t w = RetryOnEintr([&] { return ::pwrite(fd_, h.data(), h.size(), 0); });
  WSYNC_SYSCALL(w, fmt::format("writing the header of trainer state file {}", path_));
  if (static_cast<size_t>(w) != h.size()) {
    return Internal(fmt::format("short write of the header of trainer state file {}", path_));
  }
  return Status::Ok();
}

Status TrainerStateFile::Check(int64_t version) const {
  auto corrupt = [&](const std::string& what) {
    return DataLoss(fmt::format("trainer state file {} (the publisher's copy of version {}) {}; it was changed "
                                "outside the publisher: start a new chain (a fresh sync directory)",
                                path_, version, what));
  };
  struct stat st {};
  WSYNC_SYSCALL(::fstat(fd_, &st), fmt::format("stat of trainer state file {}", path_));
  if (static_cast<uint64_t>(st.st_size) != file_bytes_) {
    return corrupt(fmt::format("is {} bytes long, {} expected", st.st_size, file_bytes_));
  }
  HeaderFields got{};
  ssize_t r = RetryOnEintr([&] { return ::pread(fd_, &got, sizeof(got), 0); });
  WSYNC_SYSCALL(r, fmt::format("reading the header of trainer state file {}", path_));
  if (static_cast<size_t>(r) != sizeof(got)) return corrupt("has a short header");
  HeaderFields want{};
  std::string h = Header(version);
  std::memcpy(&want, h.data(), sizeof(want));
  if (std::memcmp(got.magic, kMagic, sizeof(kMagic)) != 0) return corrupt("has no state header (magic)");
  if (got.checksum != FieldsChecksum(got)) return corrupt("has a header whose checksum does not match its fields");
  if (got.format_version != want.format_version) {
    return corrupt(fmt::format("has format version {}, {} expected", got.format_version, want.format_version));
  }
  if (got.header_bytes != want.header_bytes || got.file_bytes != want.file_bytes || got.tensors != want.tensors ||
      got.layout_digest != want.layout_digest) {
    return corrupt(fmt::format("describes another layout ({} tensors, {} bytes; {} tensors, {} bytes expected)",
                               got.tensors, got.file_bytes, want.tensors, want.file_bytes));
  }
  if (got.version != version) return corrupt(fmt::format("says it holds version {}", got.version));
  return Status::Ok();
}

}  // namespace wsync::delta
