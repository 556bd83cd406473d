// The `sharded` backend's wire format: the init payload a trainer sends each server.
//
// The fields follow SkyRL's ShardedRDTWeightTransferInitInfo (reference/
// skyrl_weight_sync.md §2.3) where they carry the same facts: the model as the trainer
// streams it (`names`, `dtype_names`, `shapes`, `group_lens`), who holds what
// (`owner_sets`, `name_owner_class`), `num_consumers`, `workers_per_replica`, and the
// per-server stamps `replica_rank` / `num_replicas` (RdtReplicaStamps). Ray's actor names
// and NIXL buffers have no counterpart: wsync's data plane is a point-to-point group of
// every trainer rank (ranks 0..num_producers-1) and every worker of the fleet (rank
// num_producers + consumer id), met through the trainer's rendezvous store (Gloo, CPU) or
// an NCCL unique id (GPU), as the nccl backend's (nccl/init_info.h).
//
// wsync's own fields:
//   consumer_offset     fleet id of worker 0 of this server's deployment (SkyRL's
//                       replica_rank * workers_per_replica when every deployment has the
//                       same size; per-deployment sums otherwise)
//   deployment_workers  workers of this server's deployment (tp * dp): its routing block
//   plan_digests        the trainer's ConsumerPlan digest of every worker of the
//                       deployment, by deployment index (dp_index * tp + tp_rank)
//   world_size          num_producers + num_consumers (or + live consumers)
//   live_consumers      a degraded sync's live workers (below); absent: all
//   num_buffers         receive buffers per worker (chunks in flight), >= 1; per lane
//                       when concurrent_stages
//   concurrent_stages   true: a worker receives from every trainer rank it pulls from at
//                       once, one lane and buffer ring per rank (lanes.h); false: in plan
//                       order through one ring, so pipeline stages take turns. Absent:
//                       true (sent only when false). Gloo only; an NCCL group receives in
//                       plan order either way
//   receive_staging_mb  a bound on each worker's receive staging with concurrent stages,
//                       in MB (1e6 bytes): lanes of neighbouring ranks merge until it fits
//                       (lanes.h SplitLanesWithin). Absent or 0: none
//   tensor_parts        the tensors no trainer rank holds whole (FSDP's dim-0 shards):
//                       [[tensor index, row_begin, row_end, owner class], ...], by tensor
//                       then row, each split tensor's parts covering its dim 0
//                       (ShardedStream::parts). Absent: every tensor is held whole
//   gloo_* / nccl_unique_id_b64, rank_labels, timeout_seconds, wsync_protocol
//   wsync_device_digests true: the trainer ranks digest on their GPUs, a tensor held whole
//                       and over 32 MiB by row ranges (engine/device_digests.h). NCCL
//                       groups only; absent: false
//   wsync_split_digests true: every tensor held whole by several trainer ranks, of at
//                       least kSplitDigestMinBytes, is digested in line by row ranges,
//                       one per holder (SplitDigestRows), so that ranks that all read it
//                       share its hashing. Gloo groups only; absent: false
//   wsync_lora          true: an adapter group (a LoRA trainer's, docs/lora.md). It
//                       carries no model: names, dtype_names, shapes, group_lens,
//                       owner_sets, name_owner_class, tensor_parts and plan_digests are
//                       absent, and its sessions are lora sessions, whose tensors trainer
//                       rank 0 sends every consumer in ShardedLoraBuckets. Absent: false
//
// Untrusted: every integer is range-checked before it sizes anything (names and owner
// sets are bounded by the model the server holds; the server checks them against it).
// Unknown fields are rejected. Pure data and functions; thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "plan/sharded_plan.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

inline constexpr int kShardedProtocolVersion = 1;
// Bounds on the counts init_info carries, far above any real fleet or model.
inline constexpr int64_t kMaxShardedRanks = int64_t{1} << 16;     // producers, consumers
inline constexpr int64_t kMaxShardedTensors = int64_t{1} << 22;   // names
inline constexpr int64_t kMaxShardedBuffers = 16;

// A lora session over the sharded group: trainer rank 0 sends every consumer the
// update's tensors, in the order of its update_info, packed into buckets of at most
// kShardedLoraBucketBytes (a larger tensor alone in its bucket); message tag = bucket
// index. Both sides cut the buckets from the tensor list alone.
inline constexpr size_t kShardedLoraBucketBytes = size_t{16} << 20;
struct LoraBucket {
  size_t first = 0, end = 0;  // tensors [first, end)
  size_t bytes = 0;
};
std::vector<LoraBucket> ShardedLoraBuckets(const std::vector<TensorMeta>& tensors);

// wsync_split_digests: a tensor held whole by `holders` > 1 trainer ranks, of at least
// kSplitDigestMinBytes and `holders` rows, is digested in line by `holders` row ranges,
// range k = [k * rows / holders, (k + 1) * rows / holders), each hashed by another of its
// holders. An FSDP trainer's held pass all-gathers tensor by tensor, so every rank waits
// at the next gather for the one hashing this tensor; split, each hashes a share. Returns
// the ranges, or none (digested whole).
inline constexpr size_t kSplitDigestMinBytes = size_t{1} << 20;
std::vector<std::pair<int64_t, int64_t>> SplitDigestRows(const TensorMeta& tensor, size_t holders);

// The group rank of consumer `consumer` in a group of `producers` trainer ranks and, when
// `live` (ascending) is not empty, only those consumers: producers + its place among them;
// -1 when it is not among them.
inline int ShardedGroupRank(int producers, const std::vector<int>& live, int consumer) {
  if (live.empty()) return producers + consumer;
  auto it = std::lower_bound(live.begin(), live.end(), consumer);
  if (it == live.end() || *it != consumer) return -1;
  return producers + static_cast<int>(it - live.begin());
}

struct ShardedInitInfo {
  // The model as the trainer streams it.
  std::vector<TensorMeta> tensors;  // names, dtype_names, shapes
  std::vector<int> group_lens;
  // Who holds what.
  std::vector<std::vector<int>> owner_sets;
  std::vector<int> name_owner_class;
  // By tensor, its parts (ShardedStream::parts); empty: every tensor held whole.
  std::vector<std::vector<TensorPart>> tensor_parts;
  int num_producers = 1;
  int num_consumers = 1;
  int workers_per_replica = 0;  // SkyRL's; 0 when deployments differ in size
  int replica_rank = 0;
  int num_replicas = 1;
  // wsync's.
  int consumer_offset = 0;
  int deployment_workers = 1;
  std::vector<std::string> plan_digests;  // by deployment index
  int world_size = 2;
  int num_buffers = 2;
  bool concurrent_stages = true;
  int receive_staging_mb = 0;
  // A degraded sync's group: the consumer ids of the live servers' workers, ascending;
  // empty: every consumer. Consumer c is then group rank num_producers + (its position
  // here), and world_size = num_producers + live_consumers.size().
  std::vector<int> live_consumers;
  // Data plane rendezvous: exactly one of the store (Gloo) and the unique id (NCCL).
  std::optional<std::string> gloo_store_host;
  std::optional<int> gloo_store_port;
  std::optional<std::string> gloo_prefix;
  std::optional<std::string> nccl_unique_id_b64;
  std::vector<std::string> rank_labels;  // names of ranks, for error messages
  std::optional<double> timeout_seconds;
  int wsync_protocol = kShardedProtocolVersion;
  bool adapters_only = false;  // wsync_lora
  bool wsync_device_digests = false;
  bool wsync_split_digests = false;

  bool uses_gloo() const { return gloo_store_host.has_value(); }
  // The group rank of consumer `consumer`; -1 when it is not in a degraded group.
  int RankOf(int consumer) const { return ShardedGroupRank(num_producers, live_consumers, consumer); }
  nlohmann::json ToJson() const;
  // InvalidArgument naming the field for a missing, mistyped, unknown or out-of-range one:
  // counts within the bounds above, world_size == num_producers + num_consumers,
  // consumer_offset + deployment_workers <= num_consumers, plan_digests of
  // deployment_workers hex entries, owner sets of distinct members in [0, num_producers)
  // in ascending order, class ids within owner_sets, group_lens positive and summing to
  // the tensor count, names unique, one rendezvous, wsync_protocol ==
  // kShardedProtocolVersion. With workers_per_replica > 0 (deployments of one size) it
  // divides num_consumers, deployment_workers equals it and consumer_offset is
  // replica_rank * workers_per_replica. Required: the tensor lists, group_lens,
  // owner_sets, name_owner_class, num_producers, num_consumers, consumer_offset,
  // deployment_workers, plan_digests, world_size, wsync_protocol; the rest default as
  // above.
  static Result<ShardedInitInfo> Parse(const nlohmann::json& j);
};

}  // namespace wsync
