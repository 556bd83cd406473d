// TrainerStateFile: the delta publisher's previous version, kept on the trainer's disk
// instead of in its heap. It holds the bytes of the last version the publisher
// published, every tensor in its on-disk dtype at a page-aligned offset, behind one
// header page:
//
//   offset 0     header (kHeaderBytes): magic "WSYNCTST", format version, header bytes,
//                file bytes, tensor count, layout digest (xxh3-64 over every tensor's
//                name, dtype, shape, offset and size), the version the body holds, and
//                an xxh3-64 of the header's fields before it
//   offset 4096  tensor bytes, each starting on a page boundary
//
// The publisher XORs each new tensor against its region of a shared read-write mapping
// and stores the new bytes into it in the same pass (DeltaCodec::Encode), so the file
// is advanced in place, one read and one write of each byte, never copied whole. Pages
// live in the page cache, not in the trainer's anonymous memory: PrepareForWrite() maps
// a region writable just before its encode and Release() drops its page-table entries
// right after, so the trainer's RSS holds only the tensors being encoded. Write() (pwrite,
// no mapping) fills the file at the start. The kernel writes dirty pages back in its own
// time; nothing is fsynced, because no other process and no later run reads the file: a
// chain is never resumed (a trainer refuses a sync directory that holds versions), and
// the file is removed when its owner closes.
//
// The file is the trainer's own, yet what it holds is checked before it is trusted:
// Check() compares the file's size and header with what this object wrote (a truncated
// file would also fault the mapping, so it is checked before any region is read), and
// the publisher hashes each region while it XORs it and compares the digest with the
// one it recorded when it wrote that version (publisher.h). Errors name the file.
//
// An exclusive flock on the file keeps a second publisher from sharing it. Thread-safe
// for disjoint regions; Check() and SetVersion() from one thread between passes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync::delta {

// One tensor's place in the state file.
struct StateTensor {
  TensorMeta meta;      // name, on-disk dtype, shape
  uint64_t offset = 0;  // from the start of the file; a multiple of kStatePageBytes
};

class TrainerStateFile {
 public:
  static constexpr uint64_t kHeaderBytes = 4096;
  static constexpr uint64_t kStatePageBytes = 4096;
  static constexpr uint32_t kFormatVersion = 1;

  // Offsets for `tensors` (in order) after the header, each page-aligned, and the file's
  // size; *file_bytes is set. The layout depends only on the tensors' sizes.
  static std::vector<StateTensor> Layout(const std::vector<TensorMeta>& tensors, uint64_t* file_bytes);

  // Creates (or truncates) `path` at `file_bytes` with the header of version `version`,
  // takes the lock and maps it. FailedPrecondition when another publisher holds it.
  static Result<std::unique_ptr<TrainerStateFile>> Create(const std::string& path, std::vector<StateTensor> tensors,
                                                          uint64_t file_bytes, int64_t version);
  // Unmaps, closes and removes the file.
  ~TrainerStateFile();
  TrainerStateFile(const TrainerStateFile&) = delete;
  TrainerStateFile& operator=(const TrainerStateFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_bytes() const { return file_bytes_; }
  const std::vector<StateTensor>& tensors() const { return tensors_; }

  // Tensor i's bytes in the shared mapping.
  std::span<std::byte> Region(size_t i) const;
  // Writes `bytes` at `offset` within tensor i's region with pwrite (no mapping, no RSS).
  Status Write(size_t i, uint64_t offset, std::span<const std::byte> bytes) const;
  // Maps the pages under `region` (a span of a Region() whose entries were Released)
  // writable ahead of an encode, with one write access per page. The encode reads each
  // byte before it stores it: on a shared mapping a read fault maps a page read-only, and
  // the store then takes a second fault that calls the file system's page_mkwrite, on
  // ext4 with large folios over every buffer of the folio (WritableMapping::
  // PrepareForWrite in fs.h has the same cause); a write fault on an absent entry is the
  // cheaper of the two, and pwrite of the new bytes costs more again (a copy through the
  // file system's write path; docs/benchmarks.md, "delta trainer memory").
  void PrepareForWrite(std::span<std::byte> region) const;
  // Drops the page-table entries under `region` (a span of a Region()): the data stays
  // in the page cache and the next access maps it again. Best effort.
  void Release(std::span<const std::byte> region) const;

  // DataLoss naming the file and the field when its size or header is not what this
  // object wrote for `version`.
  Status Check(int64_t version) const;
  // Records that the body now holds `version` (pwrite of the header).
  Status SetVersion(int64_t version);

 private:
  TrainerStateFile() = default;
  std::string Header(int64_t version) const;

  std::string path_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
  uint64_t file_bytes_ = 0;
  uint64_t layout_digest_ = 0;
  std::vector<StateTensor> tensors_;
};

// Drops the page-table entries under `bytes`, rounded out to whole pages, of any shared
// or read-only file mapping: the data stays in the page cache. Best effort.
void ReleaseFilePages(std::span<const std::byte> bytes);

}  // namespace wsync::delta
