// The file-system pieces of the `delta` backend: an flock(2) writer lock with a
// deadline, atomic small-file writes, copy-on-write file clones, writable mappings, and
// the byte layout of a safetensors file (where each tensor's bytes sit).
//
// Everything here wraps one foreign call or a short sequence of them, and every failure
// comes back as a Status naming the path and the libc error. FileLock locks belong to an
// open file description, so two FileLock objects exclude each other even inside one
// process (threads of one server) as well as across processes (servers of one host);
// the kernel drops a lock when its holder dies. Types are move-only and not synchronized.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "core/deadline.h"
#include "core/syscall.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync::delta {

// An exclusive or shared flock(2) on a lock file, released on destruction.
class FileLock {
 public:
  enum class Mode { kShared, kExclusive };
  // Creates the lock file if needed and polls (every few ms) until the lock is granted or
  // `deadline` passes: DeadlineExceeded names the file and the mode.
  static Result<FileLock> Acquire(const std::string& path, Mode mode, Deadline deadline);

  FileLock(FileLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock();

 private:
  explicit FileLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

// Writes `data` to `path` atomically: a temp file beside it, fsync, rename, fsync of the
// directory. Readers see the old file or the new one, never a torn one.
Status WriteFileAtomic(const std::string& path, std::string_view data);
// The whole file as a string; NotFound when absent.
Result<std::string> ReadFile(const std::string& path);

// Copies `src` to `dst` (created or truncated): a reflink (FICLONE) where the file
// system shares extents, else reads and writes of 2 MiB, not copy_file_range: the page
// cache keeps folios as large as the writes, and large folios make every later apply
// after a write-back cheaper (docs/benchmarks.md, "The local copy in large folios"). The
// copy is writable by its owner whatever the source's mode. Sets *reflinked when
// extents are shared.
Status CloneFile(const std::string& src, const std::string& dst, bool* reflinked = nullptr);

// A whole file mapped read-write and shared: stores reach the file (and every other
// mapping of it) through the page cache. Unmaps on destruction.
class WritableMapping {
 public:
  static Result<WritableMapping> Open(const std::string& path);
  WritableMapping(WritableMapping&& other) noexcept;
  WritableMapping& operator=(WritableMapping&& other) noexcept;
  WritableMapping(const WritableMapping&) = delete;
  WritableMapping& operator=(const WritableMapping&) = delete;
  ~WritableMapping();

  std::span<std::byte> bytes() { return {data_, size_}; }
  const std::string& path() const { return path_; }
  // Whether `path` still names the mapped file (same device, inode and size): false once
  // it was replaced, e.g. by a reset that copied the base again.
  bool StillMaps(const std::string& path) const;

  // Called once before a version's writes through this mapping (single-threaded): notes
  // whether it last wrote longer ago than the kernel keeps pages dirty
  // (vm.dirty_expire_centisecs), in which case the flusher has most likely written its
  // pages back since, and PrepareForWrite re-maps every region.
  void BeginVersion();

  // How PrepareForWrite found a region's page-table entries.
  enum class Prepared {
    kMapped,    // first dense write through this mapping: every page mapped writable
    kWarm,      // still writable from this mapping's last write: left as they are
    kRemapped,  // write-protected by a write-back: dropped and mapped writable again
  };

  // Maps the pages under `region` (a span of bytes()) writable ahead of a dense patch,
  // so that the apply loop takes no page fault. Every page becomes dirty, so callers use
  // it only for regions whose patch touches most pages. Thread-safe for disjoint regions.
  //
  // The apply loop reads each byte before writing it, and a read fault maps a page
  // read-only; the write that follows is a second fault per page. On a shared mapping
  // each write fault on a present read-only entry calls the file system's page_mkwrite
  // for the page's whole folio: on ext4 with large folios (Linux 6.16+) that walks every
  // buffer of the folio once per 4 KiB page. Write faults on ABSENT entries cost far
  // less. So this drops the region's entries (MADV_DONTNEED; a shared mapping's data
  // stays in the page cache) and then adds 0 to one byte of every page with a locked add,
  // a write access: cheaper than MADV_POPULATE_WRITE (get_user_pages visits every page)
  // and far cheaper than no drop (docs/benchmarks.md, "Steps further apart than the
  // kernel keeps pages dirty", has the CPU seconds per GB of each).
  //
  // The kernel's flusher writes pages back once they are dirty for 30 s, i.e. between
  // most RL steps, and that write-protects every mapping's entries again. A region that
  // this mapping prepared before is left as it is (kWarm) when BeginVersion did not
  // find the mapping stale, every page of it is still dirty (cachestat, Linux 6.5+) and
  // touching its first 256 KiB is fast (slow means another mapping re-dirtied the pages
  // after a write-back), since re-touching or re-populating it would cost CPU for nothing.
  // On tmpfs and ramfs, which never write back (and whose pages cachestat never counts
  // dirty), and where cachestat is refused or missing, the probe alone decides.
  Prepared PrepareForWrite(std::span<std::byte> region);
  // Makes AllPagesDirty answer "cannot tell", as on a kernel without cachestat (tests;
  // not thread-safe against running applies).
  static void DisableCachestatForTesting(bool disable);

 private:
  WritableMapping() = default;
  void Release();
  // Whether every page of the file range under `region` is in the page cache and dirty;
  // nullopt when the kernel cannot tell (no cachestat before Linux 6.5, or a seccomp
  // filter that refuses it), and then the probe alone decides.
  std::optional<bool> AllPagesDirty(std::span<const std::byte> region) const;
  std::string path_;
  int fd_ = -1;  // kept open for cachestat
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  bool stale_ = true;  // set by BeginVersion
  std::chrono::steady_clock::time_point last_version_{};
  bool wrote_ = false;
  bool written_back_ = true;  // false on tmpfs and ramfs, which keep pages in memory only
  // Offsets of the regions PrepareForWrite mapped writable (kept while they stay so).
  std::unique_ptr<std::mutex> prepared_mu_ = std::make_unique<std::mutex>();
  std::unordered_set<size_t> prepared_;  // GUARDED_BY(*prepared_mu_)
  uint64_t dev_ = 0, ino_ = 0;
};

// Where one tensor's bytes sit in a safetensors file.
struct TensorLocation {
  TensorMeta meta;
  std::string path;     // the file
  uint64_t offset = 0;  // absolute offset of the first byte in the file
  uint64_t nbytes = 0;
};

// Reads only the header of a safetensors file (8-byte length + JSON) and returns every
// tensor's location, checked to lie inside the file (format/safetensors.h's parser under
// kUntrustedHeader: sizes overflow-checked, no overlaps). Errors name the file and
// tensor, never its bytes.
Result<std::vector<TensorLocation>> ReadSafetensorsLayout(const std::string& path);

// Copies the directory tree `src` to `dst` (which must not exist) with CloneFile for
// every file. Sets *reflinked when every file shared extents.
Status CloneTree(const std::string& src, const std::string& dst, bool* reflinked = nullptr);

// Writes every file under `dir` back to disk (fdatasync) and waits: what the kernel's
// flusher does by itself to pages dirty for longer than vm.dirty_expire_centisecs. It
// leaves the pages clean and every process's mapping of them write-protected again
// (benchmarks and tests of the apply after a write-back).
Status WriteBackTree(const std::string& dir);

}  // namespace wsync::delta
