// Fuzz target: the sharded backend's init_info as JSON text from a request body. Parse()
// either refuses it or yields fields inside their documented ranges and consistent with
// each other (an adapter group with no model at all), and what it yields survives
// ToJson() -> Parse() unchanged.
#include <cstdint>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "backends/sharded/init_info.h"
#include "core/json_limits.h"

namespace {

using wsync::ShardedInitInfo;

bool InRange(int64_t v, int64_t lo, int64_t hi) { return v >= lo && v <= hi; }

bool Consistent(const ShardedInitInfo& info) {
  const int64_t n = static_cast<int64_t>(info.tensors.size());
  if (!InRange(info.num_producers, 1, wsync::kMaxShardedRanks)) return false;
  if (!InRange(info.num_consumers, 1, wsync::kMaxShardedRanks)) return false;
  if (info.world_size != info.num_producers + info.num_consumers) return false;
  if (!InRange(info.num_buffers, 1, wsync::kMaxShardedBuffers)) return false;
  if (info.consumer_offset < 0 || info.deployment_workers < 1 ||
      info.consumer_offset + info.deployment_workers > info.num_consumers) {
    return false;
  }
  if (!InRange(info.replica_rank, 0, info.num_replicas - 1)) return false;
  if (!info.rank_labels.empty() && info.rank_labels.size() != static_cast<size_t>(info.world_size)) return false;
  if (info.uses_gloo() == info.nccl_unique_id_b64.has_value()) return false;
  if (info.adapters_only) {  // an adapter group: no model, no plan
    return info.tensors.empty() && info.group_lens.empty() && info.owner_sets.empty() &&
           info.name_owner_class.empty() && info.tensor_parts.empty() && info.plan_digests.empty();
  }
  if (info.plan_digests.size() != static_cast<size_t>(info.deployment_workers)) return false;
  if (n < 1 || n > wsync::kMaxShardedTensors) return false;
  int64_t sum = 0;
  for (int g : info.group_lens) {
    if (g < 1) return false;
    sum += g;
  }
  if (sum != n || info.name_owner_class.size() != info.tensors.size()) return false;
  for (int c : info.name_owner_class) {
    if (c < 0 || static_cast<size_t>(c) >= info.owner_sets.size()) return false;
  }
  for (const auto& set : info.owner_sets) {
    if (set.empty()) return false;
    for (int r : set) {
      if (!InRange(r, 0, info.num_producers - 1)) return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The bounded parser every request body goes through (core/json_limits.h).
  wsync::Result<nlohmann::json> j =
      wsync::ParseUntrustedJson(std::string_view(reinterpret_cast<const char*>(data), size), "init_info");
  if (!j.ok()) return 0;
  wsync::Result<ShardedInitInfo> info = ShardedInitInfo::Parse(*j);
  if (!info.ok()) {
    (void)nlohmann::json(info.status().message()).dump();  // throws on a message that is not UTF-8
    return 0;
  }
  if (!Consistent(*info)) std::abort();
  wsync::Result<ShardedInitInfo> again = ShardedInitInfo::Parse(info->ToJson());
  if (!again.ok() || again->ToJson() != info->ToJson()) std::abort();
  return 0;
}
