#include "backends/delta/manifest.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <set>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backends/delta/base_digest.h"
#include "backends/delta/confined_dir.h"
#include "backends/delta/fs.h"
#include "core/checked_math.h"
#include "core/json_limits.h"

namespace wsync::delta {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

std::string_view RecordAlgorithmName(DigestAlgorithm a) {
  return a == DigestAlgorithm::kSha256 ? "sha256" : kXxh3RecordName;
}

Result<uint64_t> U64Field(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !(it->is_number_unsigned() || (it->is_number_integer() && it->get<int64_t>() >= 0))) {
    return InvalidArgument(fmt::format("{}: field '{}' must be a non-negative integer", where, key));
  }
  return it->is_number_unsigned() ? it->get<uint64_t>() : static_cast<uint64_t>(it->get<int64_t>());
}

// A non-negative integer that fits int64 (versions), or InvalidArgument naming the field.
Result<int64_t> VersionField(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer() ||
      (it->is_number_unsigned() ? it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) : it->get<int64_t>() < 0)) {
    return InvalidArgument(fmt::format("field '{}' must be a non-negative integer", key));
  }
  return it->is_number_unsigned() ? static_cast<int64_t>(it->get<uint64_t>()) : it->get<int64_t>();
}

// A string field of a record: at most kMaxManifestStringBytes, so that messages which
// name a tensor, a key or a dtype stay short.
constexpr size_t kMaxManifestStringBytes = kMaxNameBytes;

Result<std::string> StringField(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) {
    return InvalidArgument(fmt::format("{}: field '{}' must be a string", where, key));
  }
  if (it->get_ref<const std::string&>().size() > kMaxManifestStringBytes) {
    return InvalidArgument(fmt::format("{}: field '{}' is longer than {} bytes", where, key, kMaxManifestStringBytes));
  }
  return it->get<std::string>();
}

Result<DeltaTensorRecord> ParseRecord(const json& r, size_t index) {
  std::string where = fmt::format("tensors[{}]", index);
  if (!r.is_object()) return InvalidArgument(where + " is not an object");
  DeltaTensorRecord rec;
  WSYNC_ASSIGN_OR_RETURN(rec.name, StringField(r, "name", where));
  where = fmt::format("tensors[{}] ({})", index, rec.name);
  WSYNC_ASSIGN_OR_RETURN(std::string dtype, StringField(r, "dtype", where));
  Result<DType> dt = DTypeFromTorchName(dtype);
  if (!dt.ok()) dt = DTypeFromSafetensorsName(dtype);
  if (!dt.ok()) return InvalidArgument(fmt::format("{}: unknown dtype '{}'", where, dtype));
  rec.dtype = *dt;
  auto shape = r.find("shape");
  if (shape == r.end() || !shape->is_array()) return InvalidArgument(where + ": field 'shape' must be a list");
  uint64_t bytes = ItemSize(rec.dtype);
  for (const auto& d : *shape) {
    if (!d.is_number_integer() ||
        (d.is_number_unsigned() ? d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) : d.get<int64_t>() < 0)) {
      return InvalidArgument(where + ": shape has a bad dimension");
    }
    int64_t dim = d.is_number_unsigned() ? static_cast<int64_t>(d.get<uint64_t>()) : d.get<int64_t>();
    std::optional<uint64_t> b = CheckedMul(bytes, static_cast<uint64_t>(dim));
    if (!b) return InvalidArgument(where + ": shape's byte size overflows 64 bits");
    bytes = *b;
    rec.shape.push_back(dim);
  }
  WSYNC_ASSIGN_OR_RETURN(rec.uncompressed_num_bytes, U64Field(r, "uncompressed_num_bytes", where));
  WSYNC_ASSIGN_OR_RETURN(rec.compressed_num_bytes, U64Field(r, "compressed_num_bytes", where));
  WSYNC_ASSIGN_OR_RETURN(rec.payload_file, StringField(r, "payload_file", where));
  WSYNC_ASSIGN_OR_RETURN(rec.payload_key, StringField(r, "payload_key", where));
  // SkyRL's oldest manifests carry "sha256" instead of checksum + algorithm.
  std::string algorithm = kXxh3RecordName;
  if (r.contains("checksum")) {
    WSYNC_ASSIGN_OR_RETURN(rec.checksum, StringField(r, "checksum", where));
    if (r.contains("checksum_algorithm")) {
      WSYNC_ASSIGN_OR_RETURN(algorithm, StringField(r, "checksum_algorithm", where));
    }
  } else {
    WSYNC_ASSIGN_OR_RETURN(rec.checksum, StringField(r, "sha256", where));
    algorithm = "sha256";
  }
  Result<DigestAlgorithm> alg = ParseDigestAlgorithm(algorithm);
  if (!alg.ok()) return InvalidArgument(fmt::format("{}: {}", where, alg.status().message()));
  rec.checksum_algorithm = *alg;
  if (!IsPlainFileName(rec.payload_file)) {
    return InvalidArgument(fmt::format("{}: payload_file '{}' must be a plain file name", where, rec.payload_file));
  }
  return rec;
}

}  // namespace

std::string VersionDirName(int64_t version) { return fmt::format("delta-{:08d}", version); }

std::string VersionDir(const std::string& sync_dir, int64_t version) {
  return (std::filesystem::path(sync_dir) / VersionDirName(version)).string();
}

std::string PayloadFileName(int rank, int file_index) {
  return fmt::format("delta-rank{:05d}-file{:06d}.safetensors", rank, file_index);
}

std::string DeltaManifest::ToJson() const {
  ordered_json records = ordered_json::array();
  for (const DeltaTensorRecord& r : tensors) {
    records.push_back(ordered_json{{"name", r.name},
                                   {"dtype", TorchName(r.dtype)},
                                   {"shape", r.shape},
                                   {"uncompressed_num_bytes", r.uncompressed_num_bytes},
                                   {"compressed_num_bytes", r.compressed_num_bytes},
                                   {"payload_file", r.payload_file},
                                   {"payload_key", r.payload_key},
                                   {"checksum", r.checksum},
                                   {"checksum_algorithm", RecordAlgorithmName(r.checksum_algorithm)}});
  }
  ordered_json j{{"version", version},
                 {"base_version", base_version},
                 {"tensors", std::move(records)},
                 {"total_uncompressed_num_bytes", total_uncompressed_num_bytes},
                 {"total_compressed_num_bytes", total_compressed_num_bytes},
                 {"payload_files", payload_files},
                 {"format_version", format_version}};
  if (!base_digest.empty()) j["base_digest"] = base_digest;
  return j.dump();
}

Result<DeltaManifest> DeltaManifest::Parse(const std::string& text) {
  // The depth bound of all untrusted JSON (core/json_limits.h); malformed text keeps this
  // file's wording, which never quotes the parser (and with it, the sync directory).
  WSYNC_RETURN_IF_ERROR(CheckJsonDepth(text, "manifest"));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return InvalidArgument("manifest is not a JSON object");
  DeltaManifest m;
  m.format_version = 1;
  if (auto it = j.find("format_version"); it != j.end()) {
    if (!it->is_number_integer()) return InvalidArgument("field 'format_version' must be an integer");
    bool known = it->is_number_unsigned() ? it->get<uint64_t>() >= 1 && it->get<uint64_t>() <= kManifestFormatVersion
                                          : it->get<int64_t>() >= 1 && it->get<int64_t>() <= kManifestFormatVersion;
    if (!known) {
      return FailedPrecondition(fmt::format("manifest format_version {} is not one this wsync reads (1..{})",
                                            JsonExcerpt(*it), kManifestFormatVersion));
    }
    m.format_version = static_cast<int>(it->get<int64_t>());
  }
  WSYNC_ASSIGN_OR_RETURN(m.version, VersionField(j, "version"));
  WSYNC_ASSIGN_OR_RETURN(m.base_version, VersionField(j, "base_version"));
  if (auto it = j.find("tensors"); it != j.end()) {
    if (!it->is_array()) return InvalidArgument("field 'tensors' must be a list");
    for (size_t i = 0; i < it->size(); ++i) {
      WSYNC_ASSIGN_OR_RETURN(DeltaTensorRecord r, ParseRecord((*it)[i], i));
      m.tensors.push_back(std::move(r));
    }
  }
  if (j.contains("total_uncompressed_num_bytes")) {
    WSYNC_ASSIGN_OR_RETURN(m.total_uncompressed_num_bytes, U64Field(j, "total_uncompressed_num_bytes", "manifest"));
  }
  if (j.contains("total_compressed_num_bytes")) {
    WSYNC_ASSIGN_OR_RETURN(m.total_compressed_num_bytes, U64Field(j, "total_compressed_num_bytes", "manifest"));
  }
  if (auto it = j.find("payload_files"); it != j.end()) {
    if (!it->is_array()) return InvalidArgument("field 'payload_files' must be a list");
    for (size_t i = 0; i < it->size(); ++i) {
      const json& f = (*it)[i];
      if (!f.is_string()) return InvalidArgument(fmt::format("payload_files[{}] is not a string", i));
      // One component of the version directory: never a path out of it.
      if (!IsPlainFileName(f.get_ref<const std::string&>())) {
        return InvalidArgument(fmt::format("payload_files[{}] must be a plain file name of the version directory",
                                           i));
      }
      m.payload_files.push_back(f.get<std::string>());
    }
  }
  if (auto it = j.find("base_digest"); it != j.end()) {
    if (!it->is_string() || !IsDigestHex(it->get_ref<const std::string&>())) {
      return InvalidArgument(fmt::format("field 'base_digest' must be {} lowercase hex digits (xxh3-128)",
                                         kDigestHexChars));
    }
    m.base_digest = it->get<std::string>();
  }
  std::set<std::string_view> names;
  for (const DeltaTensorRecord& r : m.tensors) {
    if (!names.insert(r.name).second) {
      return InvalidArgument(
          fmt::format("tensor {} has two records (each tensor is patched once per version)", r.name));
    }
  }
  for (const DeltaTensorRecord& r : m.tensors) {
    if (std::find(m.payload_files.begin(), m.payload_files.end(), r.payload_file) == m.payload_files.end()) {
      return InvalidArgument(fmt::format("{} lives in payload file {}, which payload_files does not list",
                                         r.name, r.payload_file));
    }
  }
  return m;
}

Result<DeltaManifest> ReadManifest(const ConfinedDir& version_dir) {
  Result<std::string> text = version_dir.ReadFile(kManifestName, kMaxManifestBytes);
  std::string path = (std::filesystem::path(version_dir.path()) / kManifestName).string();
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) {
      return NotFound(fmt::format("{} does not exist: the version is not published (yet)", path));
    }
    return text.status();
  }
  Result<DeltaManifest> m = DeltaManifest::Parse(*text);
  if (!m.ok()) return m.status().WithContext(path);
  return m;
}

Result<DeltaManifest> ReadManifest(const std::string& sync_dir, int64_t version) {
  WSYNC_ASSIGN_OR_RETURN(ConfinedDir sync, ConfinedDir::Open(sync_dir));
  Result<ConfinedDir> dir = sync.OpenDir(VersionDirName(version));
  if (!dir.ok()) {
    if (dir.status().code() == StatusCode::kNotFound) {
      return NotFound(fmt::format("version {} is not published in {} (no {})", version, sync_dir,
                                  VersionDirName(version)));
    }
    return dir.status();
  }
  return ReadManifest(*dir);
}

Result<std::vector<int64_t>> PublishedVersions(const std::string& sync_dir) {
  namespace fs = std::filesystem;
  std::vector<int64_t> out;
  std::error_code ec;
  if (!fs::exists(sync_dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(sync_dir, ec)) {
    std::string name = e.path().filename().string();
    if (name.size() != 14 || !name.starts_with("delta-")) continue;
    if (!std::all_of(name.begin() + 6, name.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (!fs::exists(e.path() / kManifestName, ec)) continue;
    out.push_back(std::stoll(name.substr(6)));
  }
  if (ec) return Internal(fmt::format("listing {}: {}", sync_dir, ec.message()));
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace wsync::delta
