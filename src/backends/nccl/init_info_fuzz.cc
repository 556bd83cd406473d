// Fuzz target: the nccl backend's init_info as JSON text from a request body. Parse()
// either refuses it or yields fields inside their documented ranges, and what it yields
// survives ToJson() -> Parse() unchanged.
#include <cstdint>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "backends/nccl/init_info.h"
#include "core/json_limits.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The bounded parser every request body goes through (core/json_limits.h).
  wsync::Result<nlohmann::json> j =
      wsync::ParseUntrustedJson(std::string_view(reinterpret_cast<const char*>(data), size), "init_info");
  if (!j.ok()) return 0;
  wsync::Result<wsync::NcclInitInfo> info = wsync::NcclInitInfo::Parse(*j);
  if (!info.ok()) {
    (void)nlohmann::json(info.status().message()).dump();  // throws on a message that is not UTF-8
    return 0;
  }
  if (info->world_size < 2 || info->world_size > wsync::kMaxNcclWorldSize) std::abort();
  if (info->rank_offset < 1 || info->rank_offset >= info->world_size) std::abort();
  if (info->gloo_store_port && (*info->gloo_store_port < 1 || *info->gloo_store_port > 65535)) std::abort();
  if (info->packed_num_buffers < 1 || info->packed_buffer_size_bytes < 1) std::abort();
  if (!info->gloo_rank_labels.empty() &&
      info->gloo_rank_labels.size() != static_cast<size_t>(info->world_size)) {
    std::abort();
  }
  wsync::Result<wsync::NcclInitInfo> again = wsync::NcclInitInfo::Parse(info->ToJson());
  if (!again.ok() || again->ToJson() != info->ToJson()) std::abort();
  return 0;
}
