// The safetensors pieces the `delta` receiver reads itself: the header parser behind
// ReadSafetensorsLayout (where each tensor of a local checkpoint file sits) and
// PayloadFile, one payload file of a version ({tensor name: uint8[compressed bytes]})
// opened beneath its version directory and read into a PayloadBuffer (not mapped: a file
// that another process truncates under a mapping would kill this one with SIGBUS). The
// caller keeps its buffers from one version to the next: first touches of fresh memory
// cost more than the copy (a page fault per 4 KiB page; docs/benchmarks.md).
//
// Both read untrusted bytes (a payload file is whatever the sync directory holds): every
// size and offset is overflow-checked and checked against the file's size, a header is
// at most kMaxLayoutHeaderBytes, and errors name the file and tensor but never quote
// the file's bytes (not even the header length it claims). Immutable after creation;
// const methods are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backends/delta/confined_dir.h"
#include "backends/delta/fs.h"
#include "wsync/status.h"

namespace wsync::delta {

// The reference implementation refuses headers over 100 MB; so does this reader.
inline constexpr uint64_t kMaxLayoutHeaderBytes = 100'000'000;
// Longer tensor names are refused (errors name the tensor).
inline constexpr size_t kMaxTensorNameBytes = 1024;

// Parses a safetensors header: `header` is the JSON after the 8-byte length, of a file of
// `file_size` bytes (so the data starts at 8 + header.size()). Every entry needs a known
// dtype, a shape whose byte size fits 64 bits and equals its data_offsets span, and lies
// inside the file; no two entries overlap. Locations name `path`. InvalidArgument for
// a malformed header, DataLoss for offsets past the end of the file.
Result<std::vector<TensorLocation>> ParseSafetensorsHeader(std::string_view header, uint64_t file_size,
                                                           const std::string& path);

// Reads the 8-byte length and the header of an open file of `size` bytes, then parses it.
Result<std::vector<TensorLocation>> ReadSafetensorsLayout(int fd, uint64_t size, const std::string& path);

// Memory a PayloadFile is read into, grown as needed and reused. Not thread-safe.
struct PayloadBuffer {
  std::unique_ptr<std::byte[]> data;
  size_t capacity = 0;
};

class PayloadFile {
 public:
  // Parses the header of `file` and reads the whole file into `buffer` (which must
  // outlive the PayloadFile and is not used for another file meanwhile). The file must
  // hold at most `max_bytes`: InvalidArgument otherwise, before anything is allocated.
  static Result<PayloadFile> Read(const RegularFile& file, uint64_t max_bytes, PayloadBuffer* buffer);

  // The bytes stored under `key`, borrowed from the buffer; NotFound naming the file.
  Result<std::span<const std::byte>> Bytes(std::string_view key) const;
  const std::string& path() const { return path_; }

 private:
  PayloadFile() = default;
  std::string path_;
  const std::byte* data_ = nullptr;
  std::map<std::string, std::pair<uint64_t, uint64_t>, std::less<>> entries_;  // key -> (offset, bytes)
};

}  // namespace wsync::delta
