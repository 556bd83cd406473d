// Safetensors checkpoints: reading one file, writing one file, and a Hugging Face
// checkpoint directory (one or more *.safetensors files, optionally indexed by
// model.safetensors.index.json).
//
// The format: an 8-byte little-endian u64 header length N, N bytes of UTF-8 JSON
//   {"<name>": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<value>"}}            (the metadata entry is optional)
// then the data; offsets count from the first byte after the header.
//
// Files are mapped read-only; the spans that Bytes() returns borrow the mapping and stay
// valid for the life of the SafetensorsFile / CheckpointDir / source they came from
// (moving the owner keeps them valid). Every type here is immutable after Open(), so
// const methods may be called from many threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// The reference implementation refuses headers over 100 MB; so does wsync.
inline constexpr size_t kMaxSafetensorsHeaderBytes = 100'000'000;

// The one safetensors header parser, behind SafetensorsFile and the `delta` backend's
// payload and local-checkpoint readers. It checks the header length against the file and
// a limit, then every entry: well-formed JSON, a known dtype, a shape whose element count
// fits int64 and whose byte size equals its data_offsets span, offsets inside the data,
// and no two tensors overlapping. Errors name the file and the tensor: DataLoss for a
// truncated file or offsets past its end, InvalidArgument for a malformed header.
struct SafetensorsHeaderOptions {
  uint64_t max_header_bytes = kMaxSafetensorsHeaderBytes;
  size_t max_name_bytes = 0;  // longer tensor names are refused; 0 for no limit
  // Whether errors may quote what the file says (its header length, offsets, dtype
  // names, the JSON parser's complaint). False for files from an untrusted place (the
  // `delta` sync directory, docs/security.md): errors then name the file and tensor only.
  bool quote_file = true;
};

// Where one tensor's bytes sit in a safetensors file.
struct SafetensorsEntry {
  TensorMeta meta;
  uint64_t offset = 0;  // absolute offset of the first byte in the file
  uint64_t nbytes = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // ascending offset (ties by size, then name)
  std::map<std::string, std::string> metadata;  // "__metadata__"; empty when absent
};

// The header length from the first bytes of a file of `file_size` bytes (`file_start`
// holds at least its first 8 bytes), checked against the file and the limit.
Result<uint64_t> SafetensorsHeaderLength(std::span<const std::byte> file_start, uint64_t file_size,
                                         std::string_view path, const SafetensorsHeaderOptions& options = {});
// Parses `header_json`, the header of a file of `file_size` bytes (the data starts at
// 8 + header_json.size()).
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view header_json, uint64_t file_size,
                                                 std::string_view path, const SafetensorsHeaderOptions& options = {});
// Reads the length and the header of an open file of `file_size` bytes with pread (the
// file offset is left alone), then parses it.
Result<SafetensorsHeader> ReadSafetensorsHeader(int fd, uint64_t file_size, std::string_view path,
                                                const SafetensorsHeaderOptions& options = {});

// One safetensors file, memory-mapped. Move-only; unmaps in its destructor.
class SafetensorsFile {
 public:
  // Maps `path` and validates its header (ParseSafetensorsHeader, quoting the file in
  // errors). NotFound when the file does not exist.
  static Result<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Every tensor of the file, in ascending data-offset order (ties by name).
  const std::vector<TensorMeta>& tensors() const { return tensors_; }
  // The "__metadata__" entry; empty when the file has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool Contains(std::string_view name) const { return index_.find(name) != index_.end(); }
  // The tensor's bytes inside the mapping; NotFound naming the file when absent.
  Result<std::span<const std::byte>> Bytes(std::string_view name) const;
  // Bytes of tensors()[i]; i must be < tensors().size().
  std::span<const std::byte> BytesAt(size_t i) const;
  // A zero-copy view of tensors()[i] (shape borrows tensors()[i].shape).
  TensorRef RefAt(size_t i) const;

 private:
  SafetensorsFile() = default;
  void Unmap();

  std::string path_;
  std::byte* map_ = nullptr;  // whole file, PROT_READ
  size_t map_size_ = 0;
  std::vector<TensorMeta> tensors_;
  std::vector<size_t> file_offsets_;  // absolute offset of tensors_[i]'s first byte
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` to `path` atomically: to `path + ".tmp"`, fsync, rename, fsync of the
// directory (without `durable`: no fsync, for a file read once and removed, whose
// readers need it whole but not on disk). Tensors are laid out contiguously by item size, largest first, then in the
// given order, so every tensor's data is aligned to its item size (the header is padded
// with spaces to a multiple of 8 bytes, as the reference implementation does). Names must
// be unique and non-empty, bytes must match numel * itemsize, and data must be on the CPU.
Status WriteSafetensors(const std::string& path, std::span<const TensorRef> tensors,
                        const std::map<std::string, std::string>& metadata = {}, bool durable = true);

// A Hugging Face checkpoint directory.
//
// With model.safetensors.index.json, the files are those its "weight_map" names, and
// every tensor the map lists must be in the file it names. Without it, every
// *.safetensors file in the directory is used. Either way, tensors() lists all tensors
// of those files ordered by file name, then by data offset within a file, and a name
// found in two files is an error naming both.
class CheckpointDir {
 public:
  static Result<CheckpointDir> Open(const std::string& dir);

  CheckpointDir(CheckpointDir&&) noexcept = default;
  CheckpointDir& operator=(CheckpointDir&&) noexcept = default;

  const std::string& dir() const { return dir_; }
  const std::vector<TensorMeta>& tensors() const { return tensors_; }
  // The open files, sorted by file name.
  const std::vector<SafetensorsFile>& files() const { return files_; }
  bool Contains(std::string_view name) const { return where_.find(name) != where_.end(); }
  // NotFound naming the directory when the tensor is absent.
  Result<std::span<const std::byte>> Bytes(std::string_view name) const;
  Result<TensorRef> Ref(std::string_view name) const;
  // The file that holds `name`, or NotFound.
  Result<const SafetensorsFile*> FileOf(std::string_view name) const;

 private:
  CheckpointDir() = default;
  struct Location {
    size_t file;
    size_t tensor;  // position in files_[file].tensors()
  };

  std::string dir_;
  std::vector<SafetensorsFile> files_;
  std::vector<TensorMeta> tensors_;
  std::map<std::string, Location, std::less<>> where_;
};

// A WeightSource over a checkpoint directory that yields zero-copy TensorRefs into the
// mapped files. By default it iterates in CheckpointDir::tensors() order; `order`, when
// given, must name every tensor of the checkpoint exactly once (e.g. the model's own
// order), and the source iterates in that order. Errors name the first unknown, repeated
// or missing tensor.
Result<std::unique_ptr<WeightSource>> OpenCheckpointSource(
    const std::string& dir, std::optional<std::vector<std::string>> order = std::nullopt);

}  // namespace wsync
