// Fuzz target: the nccl backend's init_info as JSON text from a request body. Parse()
// either refuses it or yields fields inside their documented ranges, and what it yields
// survives ToJson() -> Parse() unchanged.
#include <cstdint>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "backends/nccl/init_info.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  wsync::Result<wsync::NcclInitInfo> info = wsync::NcclInitInfo::Parse(j);
  if (!info.ok()) {
    (void)info.status().message();
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
