// Fuzz target: the JSON bodies the delta receiver takes (init_info, /fetch_weights,
// update_info, a lora session's update_info), and the sync_dir they name placed below a
// sync root. Nothing throws or crashes; a target version that parses is non-negative; a
// path that PathBelow accepts is relative and never climbs ("..") out of the root; an
// adapter file that parses is relative, of plain names (none empty, none hidden).
#include <cstdint>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "backends/delta/confined_dir.h"
#include "backends/delta/receiver_request.h"
#include "core/json_limits.h"

namespace {

void CheckBelow(const std::string& requested) {
  wsync::Result<std::string> rel = wsync::delta::PathBelow("/srv/wsync/sync", requested);
  if (!rel.ok()) return;
  if (rel->starts_with('/') || *rel == ".." || rel->starts_with("../") || rel->find("/../") != std::string::npos ||
      rel->ends_with("/..")) {
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The bounded parser every request body goes through (core/json_limits.h).
  wsync::Result<nlohmann::json> parsed =
      wsync::ParseUntrustedJson(std::string_view(reinterpret_cast<const char*>(data), size), "body");
  if (!parsed.ok()) {
    CheckBelow(std::string(reinterpret_cast<const char*>(data), size));
    return 0;
  }
  const nlohmann::json& j = *parsed;
  auto init = wsync::delta::ParseDeltaInit(j);
  if (init.ok() && init->sync_dir) CheckBelow(*init->sync_dir);
  auto fetch = wsync::delta::ParseDeltaFetch(j);
  if (fetch.ok()) {
    if (fetch->target_version < 0) std::abort();
    if (fetch->sync_dir) CheckBelow(*fetch->sync_dir);
  }
  auto update = wsync::delta::ParseDeltaUpdate(j);
  if (update.ok()) {
    if (update->target_version < 0) std::abort();
    if (update->sync_dir) CheckBelow(*update->sync_dir);
  }
  auto adapter = wsync::delta::ParseDeltaAdapterUpdate(j);
  if (adapter.ok()) {
    const std::string& f = adapter->file;
    if (f.empty() || f.starts_with('/') || f.starts_with('.') || f.find("/.") != std::string::npos ||
        f.find("//") != std::string::npos || !f.ends_with(".safetensors") || f.size() > 1024) {
      std::abort();
    }
    if (adapter->sync_dir) CheckBelow(*adapter->sync_dir);
  }
  auto v = wsync::delta::ParseTargetVersion(j, "update_weights");
  if (v.ok() && *v < 0) std::abort();
  return 0;
}
