#include "control/init_payloads.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <optional>

#include "core/checked_math.h"

namespace wsync {
namespace {

Status CheckDpDividesServers(int num_servers, int dp) {
  if (dp < 1) return InvalidArgument(fmt::format("data_parallel_size must be >= 1, got {}", dp));
  if (num_servers < 1) return InvalidArgument("no servers given");
  if (num_servers % dp != 0) {
    return InvalidArgument(fmt::format(
        "data_parallel_size {} does not divide the number of servers {}", dp, num_servers));
  }
  return Status::Ok();
}

}  // namespace

Result<NcclFleetLayout> NcclFleetRanks(const std::vector<int>& sizes, int dp, int base,
                                       std::span<const std::string> names) {
  WSYNC_RETURN_IF_ERROR(CheckDpDividesServers(static_cast<int>(sizes.size()), dp));
  if (base < 1 || base >= kMaxBroadcastWorldSize) {
    return InvalidArgument(fmt::format("rank_offset {} of the first server is outside [1, {})", base,
                                       kMaxBroadcastWorldSize));
  }
  auto name = [&](size_t i) { return i < names.size() ? names[i] : fmt::format("server {}", i); };
  const size_t per = static_cast<size_t>(dp);
  NcclFleetLayout layout;
  int64_t offset = base;
  for (size_t first = 0; first < sizes.size(); first += per) {
    const int world = sizes[first];
    for (size_t i = first; i < first + per; ++i) {
      if (sizes[i] < 1) return InvalidArgument(fmt::format("{} reports world size {}", name(i), sizes[i]));
      if (sizes[i] != world) {
        return InvalidArgument(fmt::format(
            "{} and {} form one deployment (data_parallel_size {}) but report world sizes {} and {}: the "
            "servers of one deployment must run the same layout",
            name(first), name(i), dp, world, sizes[i]));
      }
      layout.rank_offsets.push_back(static_cast<int>(offset));
    }
    std::optional<int64_t> next = CheckedAdd<int64_t>(offset, world);
    if (!next || *next > kMaxBroadcastWorldSize) {
      return InvalidArgument(fmt::format(
          "the deployment of {} (world size {}) takes the broadcast world from {} ranks past the limit of {}",
          name(first), world, offset, kMaxBroadcastWorldSize));
    }
    offset = *next;
  }
  layout.world_size = static_cast<int>(offset);
  return layout;
}

Result<std::vector<ReplicaStamp>> RdtReplicaStamps(int num_servers, int dp) {
  WSYNC_RETURN_IF_ERROR(CheckDpDividesServers(num_servers, dp));
  std::vector<ReplicaStamp> stamps;
  for (int i = 0; i < num_servers; ++i) stamps.push_back({i / dp, num_servers / dp});
  return stamps;
}

}  // namespace wsync
