// The safetensors pieces the `delta` receiver reads itself: ReadSafetensorsLayout (where
// each tensor of a local checkpoint or payload file sits, through format/safetensors.h's
// header parser under kUntrustedHeader) and PayloadFile, one payload file of a version
// ({tensor name: uint8[compressed bytes]}) opened beneath its version directory and read
// into a PayloadBuffer (not mapped: a file that another process truncates under a
// mapping would kill this one with SIGBUS). The
// caller keeps its buffers from one version to the next: first touches of fresh memory
// cost more than the copy (a page fault per 4 KiB page; docs/benchmarks.md).
//
// Both read untrusted bytes (a payload file is whatever the sync directory holds): every
// size and offset is overflow-checked and checked against the file's size, a header is
// at most kMaxSafetensorsHeaderBytes, and errors name the file and tensor but never quote
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
#include "format/safetensors.h"
#include "wsync/status.h"

namespace wsync::delta {

// Longer tensor names are refused (errors name the tensor).
inline constexpr size_t kMaxTensorNameBytes = 1024;

// How the delta backend parses a header from the sync directory: at most
// kMaxSafetensorsHeaderBytes, names of at most kMaxTensorNameBytes, and errors that
// never quote the file.
inline constexpr SafetensorsHeaderOptions kUntrustedHeader{kMaxSafetensorsHeaderBytes, kMaxTensorNameBytes,
                                                           /*quote_file=*/false};

// Reads the 8-byte length and the header of an open file of `size` bytes, then parses it
// under kUntrustedHeader. Locations name `path`.
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
