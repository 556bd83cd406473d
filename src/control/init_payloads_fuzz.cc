// Fuzz target: SkyRL's per-server init rewrites on numbers a trainer learns from servers'
// replies (world sizes, server counts, dp). The bytes are read as little-endian int32s:
// dp, then per-server world sizes. Every answer is a refusal or a world inside
// [2, kMaxBroadcastWorldSize] that holds every server's workers at its rank offset
// (UBSan flags any overflow).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "control/init_payloads.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<int32_t> v(size / 4);
  if (!v.empty()) std::memcpy(v.data(), data, v.size() * 4);
  if (v.empty() || v.size() > 4097) return 0;
  const int dp = v[0];
  std::vector<int> sizes(v.begin() + 1, v.end());
  wsync::Result<wsync::NcclFleetLayout> layout = wsync::NcclFleetRanks(sizes, dp);
  if (layout.ok()) {
    // Offsets never decrease, and each deployment's workers fit inside the world.
    const int world = layout->world_size;
    if (world < 2 || world > wsync::kMaxBroadcastWorldSize) std::abort();
    if (layout->rank_offsets.size() != sizes.size()) std::abort();
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int o = layout->rank_offsets[i];
      if (o < 1 || int64_t{o} + sizes[i] > world) std::abort();
      if (i > 0 && o < layout->rank_offsets[i - 1]) std::abort();
    }
  }
  // Any first rank for these sizes.
  if (sizes.size() >= 2) (void)wsync::NcclFleetRanks(std::vector<int>(sizes.begin() + 1, sizes.end()), dp, sizes[0]);
  (void)wsync::RdtReplicaStamps(static_cast<int>(sizes.size()), dp);
  return 0;
}
