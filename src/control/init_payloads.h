// Per-server rewrites of one init payload, as SkyRL's control plane expands them.
//
// A trainer builds ONE init_info; the fan-out client turns it into one payload per server.
// Servers are ordered [deployment0_dp0, deployment0_dp1, ..., deployment1_dp0, ...]; the DP
// servers of one deployment share a rank offset because each worker adds its own
// data_parallel_index * (TP*PP). Deployments may differ in size. Pure functions;
// thread-safe.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "wsync/status.h"

namespace wsync {

// The largest broadcast group (trainer rank 0 and every server worker) a trainer builds
// or a server joins; world sizes are checked against it before anything is allocated
// per rank. Far above any deployment.
inline constexpr int kMaxBroadcastWorldSize = 1 << 16;

// The broadcast group of a fleet: rank 0 is the trainer, then the workers of each
// deployment in server order.
struct NcclFleetLayout {
  int world_size = 0;             // base_rank_offset + every deployment's world size
  std::vector<int> rank_offsets;  // one per server
  friend bool operator==(const NcclFleetLayout&, const NcclFleetLayout&) = default;
};

// SkyRL's nccl_init_payloads, generalised to fleets whose deployments differ in size (a
// TP=2 deployment beside a TP=1 one). Servers form deployments of `data_parallel_size`
// consecutive servers (num_servers must divide by it); each server reports its whole
// deployment's world size (/get_world_size?include_dp=true), so the servers of one
// deployment must agree, else InvalidArgument naming the two servers and sizes. The
// offset of deployment d is base + the world sizes of deployments 0..d-1; every server
// of d gets it (each worker adds its own dp_index * TP + tp_rank). The sizes come from
// the servers' replies: every sum is checked, and a world over kMaxBroadcastWorldSize is
// refused before anything is allocated per rank.
// SkyRL's uniform formula is the special case: sizes [4, 4, 4, 4], dp 2 -> world 9,
// offsets [1, 1, 5, 5]. Heterogeneous: sizes [2, 1], dp 1 -> world 4, offsets [1, 3].
// `server_names` (the URLs, in the same order) name servers in errors; empty: "server i".
Result<NcclFleetLayout> NcclFleetRanks(const std::vector<int>& per_server_world_sizes, int data_parallel_size,
                                       int base_rank_offset = 1, std::span<const std::string> server_names = {});

struct ReplicaStamp {
  int replica_rank = 0;
  int num_replicas = 1;
  friend bool operator==(const ReplicaStamp&, const ReplicaStamp&) = default;
};

// SkyRL's rdt_init_payloads: replica_rank = index // dp, num_replicas = servers // dp.
Result<std::vector<ReplicaStamp>> RdtReplicaStamps(int num_servers, int data_parallel_size);

}  // namespace wsync
