// Fuzz target: SkyRL's per-server init rewrites on numbers a trainer learns from servers'
// replies (world sizes, server counts, dp). The bytes are read as little-endian int32s:
// dp, then per-server world sizes. Every answer is a refusal or a world inside
// [2, kMaxBroadcastWorldSize] whose rank offsets lie inside it (UBSan flags any overflow).
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
  wsync::Result<int> world = wsync::BroadcastWorldSize(sizes, dp);
  if (world.ok()) {
    if (*world < 2 || *world > wsync::kMaxBroadcastWorldSize) std::abort();
    auto offsets = wsync::NcclRankOffsets(*world, static_cast<int>(sizes.size()), dp);
    if (offsets.ok()) {
      for (int o : *offsets) {
        if (o < 1 || o >= *world) std::abort();
      }
    }
  }
  // Any world and base for this many servers (the server count is the trainer's own).
  if (sizes.size() >= 2) (void)wsync::NcclRankOffsets(sizes[0], static_cast<int>(sizes.size()), dp, sizes[1]);
  (void)wsync::RdtReplicaStamps(static_cast<int>(sizes.size()), dp);
  return 0;
}
