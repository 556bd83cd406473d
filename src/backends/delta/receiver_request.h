// The request bodies of the `delta` receiver, parsed into values before anything is
// opened: /init_weight_transfer_engine's init_info and /fetch_weights' body (and the
// target version of /update_weights' update_info). Every field is type- and range-
// checked here and nothing throws; paths are only carried, never opened (the receiver
// resolves sync_dir below its --sync-root, and takes its other directories from its own
// flags alone: see docs/security.md). Pure functions; any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "wsync/status.h"

namespace wsync::delta {

// The longest path a request may name (PATH_MAX).
inline constexpr size_t kMaxRequestPathBytes = 4096;

struct DeltaInitRequest {
  std::optional<std::string> sync_dir;
  // SkyRL's keys; a server only compares them with its own flags (never opens them).
  std::optional<std::string> base_model_path;
  std::optional<std::string> local_checkpoint_dir;
  int64_t format_version = 1;
  // wsync's: the digest of the trainer's base checkpoint (base_digest.h).
  std::optional<std::string> base_digest;
};

// init_info must be an object; each known key, when present and not null, must have its
// type (strings of at most kMaxRequestPathBytes, an integer format_version no newer than
// this build reads: FailedPrecondition, a base_digest of 32 lowercase hex digits).
// Unknown keys are ignored, so SkyRL's exact init
// ({base_model_path, local_checkpoint_dir, cloud_download_workers, checkpoint_load_format,
// multi_thread_safetensors_max_workers}: no sync_dir) is accepted; the sync dir then comes
// with each fetch.
Result<DeltaInitRequest> ParseDeltaInit(const nlohmann::json& init_info);

struct DeltaFetchRequest {
  int64_t target_version = 0;
  std::optional<std::string> sync_dir;
  std::optional<std::string> uri;
};

// {"target_version" (or "version"): integer in [0, 2^63), "sync_dir"?, "uri"?}.
Result<DeltaFetchRequest> ParseDeltaFetch(const nlohmann::json& body);

// /update_weights' update_info, SkyRL's DeltaTransferUpdateInfo: the same fields as a
// fetch ("version" is an alias of target_version); the errors name update_weights.
Result<DeltaFetchRequest> ParseDeltaUpdate(const nlohmann::json& update_info);

// A lora session's update_info over delta (docs/lora.md), beside its tensor list:
// "sync_dir"? (a string) and "wsync_lora_file", the adapter's safetensors file relative
// to the sync dir: 1 to 1024 bytes of plain names (confined_dir.h IsPlainFileName)
// joined by '/', ending in ".safetensors".
struct DeltaAdapterRequest {
  std::optional<std::string> sync_dir;
  std::string file;
};
Result<DeltaAdapterRequest> ParseDeltaAdapterUpdate(const nlohmann::json& update_info);

// The non-negative integer "target_version" (or "version") of `body`; `what` names the
// call in errors.
Result<int64_t> ParseTargetVersion(const nlohmann::json& body, const char* what);

}  // namespace wsync::delta
