// Per-server rewrites of one init payload, as SkyRL's control plane expands them.
//
// A trainer builds ONE init_info; the fan-out client turns it into one payload per server.
// Servers are ordered [deployment0_dp0, deployment0_dp1, ..., deployment1_dp0, ...]; the DP
// servers of one deployment share a rank offset because each worker adds its own
// data_parallel_index * (TP*PP). Pure functions; thread-safe.
#pragma once

#include <vector>

#include "wsync/status.h"

namespace wsync {

// The largest broadcast group (trainer rank 0 and every server worker) a trainer builds
// or a server joins; world sizes are checked against it before anything is allocated
// per rank. Far above any deployment.
inline constexpr int kMaxBroadcastWorldSize = 1 << 16;

// The broadcast world: 1 (the trainer) + per_server * num_servers / data_parallel_size.
// All servers must report the same world size and num_servers must divide by dp; the
// world must not exceed kMaxBroadcastWorldSize (the sizes come from the servers'
// replies: the arithmetic is checked).
Result<int> BroadcastWorldSize(const std::vector<int>& per_server_world_sizes,
                               int data_parallel_size);

// SkyRL's nccl_init_payloads: the rank_offset of every server.
// world 9, 4 servers, dp 2 -> [1, 1, 5, 5]; world 8, 3 servers -> error.
Result<std::vector<int>> NcclRankOffsets(int world_size, int num_servers,
                                         int data_parallel_size, int base_rank_offset = 1);

struct ReplicaStamp {
  int replica_rank = 0;
  int num_replicas = 1;
  friend bool operator==(const ReplicaStamp&, const ReplicaStamp&) = default;
};

// SkyRL's rdt_init_payloads: replica_rank = index // dp, num_replicas = servers // dp.
Result<std::vector<ReplicaStamp>> RdtReplicaStamps(int num_servers, int data_parallel_size);

}  // namespace wsync
