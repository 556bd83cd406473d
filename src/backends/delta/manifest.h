// The on-storage layout of a delta chain, byte-compatible with SkyRL's
// (reference/skyrl_weight_sync.md §5.1):
//
//   <sync_dir>/delta-00000007/
//     delta-rank00000-file000000.safetensors   {tensor name: uint8[compressed bytes]}
//     manifest.json                            written LAST, by atomic rename
//
// manifest.json: {"version", "base_version", "tensors": [{"name", "dtype" (torch name),
// "shape", "uncompressed_num_bytes", "compressed_num_bytes", "payload_file",
// "payload_key", "checksum", "checksum_algorithm"}], "total_uncompressed_num_bytes",
// "total_compressed_num_bytes", "payload_files"} plus wsync's "format_version" and, on
// a full version, "base_digest" (base_digest.h). SkyRL's reader ignores unknown
// top-level keys (and fails on unknown record keys, so records carry none); a manifest
// without "format_version" is SkyRL's, read as version 1.
// Version 0 is the base checkpoint and has no directory. Pure functions and value types;
// thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "backends/delta/confined_dir.h"
#include "core/digest.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync::delta {

inline constexpr int kManifestFormatVersion = 1;
inline constexpr char kManifestName[] = "manifest.json";
// SkyRL's name for xxh3-128 in records ("xxh3-128"; wsync's digest.h says "xxh3_128").
inline constexpr char kXxh3RecordName[] = "xxh3-128";

// "delta-00000007".
std::string VersionDirName(int64_t version);
// "<sync_dir>/delta-00000007".
std::string VersionDir(const std::string& sync_dir, int64_t version);
// "delta-rank00000-file000003.safetensors".
std::string PayloadFileName(int rank, int file_index);

struct DeltaTensorRecord {
  std::string name;
  DType dtype = DType::kBF16;  // the checkpoint's on-disk dtype the patch is in
  Shape shape;
  uint64_t uncompressed_num_bytes = 0;
  uint64_t compressed_num_bytes = 0;
  std::string payload_file;
  std::string payload_key;
  std::string checksum;  // hex digest of the full new bytes
  DigestAlgorithm checksum_algorithm = DigestAlgorithm::kXxh3_128;
};

struct DeltaManifest {
  int64_t version = 0;
  int64_t base_version = 0;
  std::vector<DeltaTensorRecord> tensors;
  uint64_t total_uncompressed_num_bytes = 0;
  uint64_t total_compressed_num_bytes = 0;
  std::vector<std::string> payload_files;
  int format_version = kManifestFormatVersion;
  // "" (absent), or on a version with base_version 0: the digest of the trainer's base
  // over the tensors of the records, each an all-zero patch whose checksum is that
  // tensor's digest (base_digest.h). Written only when set.
  std::string base_digest;

  // Keys in SkyRL's order (dataclass field order), plus "format_version" last.
  std::string ToJson() const;
  // Checks every field's type and range (never throws); errors name the field and record.
  // A format_version newer than this build reads is FailedPrecondition; a record's
  // unknown checksum algorithm or dtype, a shape whose byte size overflows, a tensor
  // with two records, and a payload file that is not a plain file name of the version
  // directory (IsPlainFileName), and a base_digest that is not 32 lowercase hex digits
  // are InvalidArgument.
  static Result<DeltaManifest> Parse(const std::string& text);
};

// Reads manifest.json of a version directory opened beneath its sync dir: a regular file
// (no FIFO, device or symlink out of the directory) of at most kMaxManifestBytes.
// NotFound when the version is not published (no manifest yet); errors name the file.
Result<DeltaManifest> ReadManifest(const ConfinedDir& version_dir);
// The same for <sync_dir>/delta-<version>/manifest.json.
Result<DeltaManifest> ReadManifest(const std::string& sync_dir, int64_t version);

// Versions published in `sync_dir` (directories with a manifest), ascending.
Result<std::vector<int64_t>> PublishedVersions(const std::string& sync_dir);

}  // namespace wsync::delta
