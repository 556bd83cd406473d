#include "control/init_payloads.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

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

Result<int> BroadcastWorldSize(const std::vector<int>& sizes, int dp) {
  WSYNC_RETURN_IF_ERROR(CheckDpDividesServers(static_cast<int>(sizes.size()), dp));
  for (int s : sizes) {
    if (s != sizes[0]) {
      return InvalidArgument(fmt::format(
          "servers report different world sizes {}: every server must run the same layout", sizes));
    }
  }
  if (sizes[0] < 1) return InvalidArgument(fmt::format("server reports world size {}", sizes[0]));
  // In int64: sizes[0] * servers overflows int for sizes that a server may report.
  const int64_t world = 1 + int64_t{sizes[0]} * static_cast<int64_t>(sizes.size()) / dp;
  if (world > kMaxBroadcastWorldSize) {
    return InvalidArgument(fmt::format("{} servers of world size {} (dp {}) make a broadcast world of {}, over {}",
                                       sizes.size(), sizes[0], dp, world, kMaxBroadcastWorldSize));
  }
  return static_cast<int>(world);
}

Result<std::vector<int>> NcclRankOffsets(int world_size, int num_servers, int dp, int base) {
  WSYNC_RETURN_IF_ERROR(CheckDpDividesServers(num_servers, dp));
  if (world_size > kMaxBroadcastWorldSize || base < 1) {
    return InvalidArgument(fmt::format("world_size {} with rank_offset {}: need rank_offset >= 1 and world_size <= {}",
                                       world_size, base, kMaxBroadcastWorldSize));
  }
  const int64_t workers_total = int64_t{world_size} - base;  // any ints: no overflow
  int deployments = num_servers / dp;
  if (workers_total <= 0) {
    return InvalidArgument(fmt::format(
        "world_size {} with rank_offset {} leaves no inference workers", world_size, base));
  }
  if (workers_total % deployments != 0) {
    return InvalidArgument(fmt::format(
        "{} deployments ({} servers / dp {}) does not divide the {} inference workers of world {}",
        deployments, num_servers, dp, workers_total, world_size));
  }
  const int per_deployment = static_cast<int>(workers_total / deployments);
  std::vector<int> offsets;
  int offset = base;
  for (int i = 0; i < num_servers; ++i) {
    offsets.push_back(offset);
    if ((i + 1) % dp == 0) offset += per_deployment;
  }
  return offsets;
}

Result<std::vector<ReplicaStamp>> RdtReplicaStamps(int num_servers, int dp) {
  WSYNC_RETURN_IF_ERROR(CheckDpDividesServers(num_servers, dp));
  std::vector<ReplicaStamp> stamps;
  for (int i = 0; i < num_servers; ++i) stamps.push_back({i / dp, num_servers / dp});
  return stamps;
}

}  // namespace wsync
