#include "backends/delta/receiver_request.h"

#include <fmt/format.h>

#include "backends/delta/base_digest.h"
#include "backends/delta/confined_dir.h"
#include "backends/delta/manifest.h"
#include "core/json_limits.h"

namespace wsync::delta {
namespace {

using nlohmann::json;

// A string field: absent or null gives nullopt; anything but a string of at most
// kMaxRequestPathBytes (without NUL) is InvalidArgument.
Result<std::optional<std::string>> OptionalPath(const json& j, const char* key, const char* what) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<std::string>();
  if (!it->is_string()) return InvalidArgument(fmt::format("{}: field '{}' must be a string", what, key));
  const std::string& s = it->get_ref<const std::string&>();
  if (s.size() > kMaxRequestPathBytes) {
    return InvalidArgument(fmt::format("{}: field '{}' is longer than {} bytes", what, key, kMaxRequestPathBytes));
  }
  if (s.find('\0') != std::string::npos) {
    return InvalidArgument(fmt::format("{}: field '{}' holds a NUL byte", what, key));
  }
  return std::optional<std::string>(s);
}

}  // namespace

Result<int64_t> ParseTargetVersion(const json& body, const char* what) {
  if (!body.is_object()) return InvalidArgument(fmt::format("{}: the body must be an object", what));
  for (const char* key : {"target_version", "version"}) {
    auto it = body.find(key);
    if (it == body.end() || it->is_null()) continue;
    if (it->is_number_unsigned()) {
      if (it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        return InvalidArgument(fmt::format("{}: field '{}' is out of range", what, key));
      }
      return static_cast<int64_t>(it->get<uint64_t>());
    }
    if (!it->is_number_integer()) return InvalidArgument(fmt::format("{}: field '{}' must be an integer", what, key));
    int64_t v = it->get<int64_t>();
    if (v < 0) return InvalidArgument(fmt::format("{}: field '{}' is negative ({})", what, key, v));
    return v;
  }
  return InvalidArgument(fmt::format("{} needs an integer 'target_version'", what));
}

Result<DeltaInitRequest> ParseDeltaInit(const json& init_info) {
  if (!init_info.is_object()) return InvalidArgument("init_info must be an object");
  DeltaInitRequest r;
  if (auto it = init_info.find("format_version"); it != init_info.end() && !it->is_null()) {
    if (!it->is_number_integer()) return InvalidArgument("init_info: field 'format_version' must be an integer");
    if (it->is_number_unsigned() ? it->get<uint64_t>() > static_cast<uint64_t>(kManifestFormatVersion)
                                 : it->get<int64_t>() > kManifestFormatVersion) {
      return FailedPrecondition(fmt::format("init_info format_version {} is newer than this server reads ({})",
                                            JsonExcerpt(*it), kManifestFormatVersion));
    }
    r.format_version = it->is_number_unsigned() ? static_cast<int64_t>(it->get<uint64_t>()) : it->get<int64_t>();
    if (r.format_version < 1) {
      return InvalidArgument(fmt::format("init_info format_version {} is not >= 1", r.format_version));
    }
  }
  WSYNC_ASSIGN_OR_RETURN(r.sync_dir, OptionalPath(init_info, "sync_dir", "init_info"));
  WSYNC_ASSIGN_OR_RETURN(r.base_model_path, OptionalPath(init_info, "base_model_path", "init_info"));
  WSYNC_ASSIGN_OR_RETURN(r.local_checkpoint_dir, OptionalPath(init_info, "local_checkpoint_dir", "init_info"));
  if (auto it = init_info.find("base_digest"); it != init_info.end() && !it->is_null()) {
    if (!it->is_string() || !IsDigestHex(it->get_ref<const std::string&>())) {
      return InvalidArgument(fmt::format("init_info: field 'base_digest' must be {} lowercase hex digits (xxh3-128)",
                                         kDigestHexChars));
    }
    r.base_digest = it->get<std::string>();
  }
  return r;
}

namespace {

Result<DeltaFetchRequest> ParseVersionedPaths(const json& body, const char* what) {
  DeltaFetchRequest r;
  WSYNC_ASSIGN_OR_RETURN(r.target_version, ParseTargetVersion(body, what));
  WSYNC_ASSIGN_OR_RETURN(r.sync_dir, OptionalPath(body, "sync_dir", what));
  WSYNC_ASSIGN_OR_RETURN(r.uri, OptionalPath(body, "uri", what));
  return r;
}

}  // namespace

Result<DeltaFetchRequest> ParseDeltaFetch(const json& body) { return ParseVersionedPaths(body, "fetch_weights"); }

Result<DeltaFetchRequest> ParseDeltaUpdate(const json& update_info) {
  return ParseVersionedPaths(update_info, "update_weights");
}

Result<DeltaAdapterRequest> ParseDeltaAdapterUpdate(const json& update_info) {
  if (!update_info.is_object()) return InvalidArgument("update_info must be an object");
  DeltaAdapterRequest out;
  if (auto it = update_info.find("sync_dir"); it != update_info.end() && !it->is_null()) {
    if (!it->is_string()) return InvalidArgument("update_info 'sync_dir' must be a string");
    out.sync_dir = it->get<std::string>();
  }
  auto f = update_info.find("wsync_lora_file");
  if (f == update_info.end() || !f->is_string()) {
    return InvalidArgument("a lora session over backend delta needs update_info 'wsync_lora_file': the adapter's "
                           "safetensors file, relative to the sync dir");
  }
  const std::string& rel = f->get_ref<const std::string&>();
  bool plain = !rel.empty() && rel.size() <= 1024 && rel.ends_with(".safetensors");
  for (size_t begin = 0; plain && begin <= rel.size();) {
    const size_t end = std::min(rel.find('/', begin), rel.size());
    plain = IsPlainFileName(std::string_view(rel).substr(begin, end - begin));
    begin = end + 1;
  }
  if (!plain) {
    return InvalidArgument("update_info 'wsync_lora_file' must be a relative path of plain names (no '..', no "
                           "leading '.', no empty component) ending in .safetensors, at most 1024 bytes");
  }
  out.file = rel;
  return out;
}

}  // namespace wsync::delta
