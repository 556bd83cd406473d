// Fleet: the trainer and the inference servers a plan is made for, and where each GPU sits.
//
// The command line describes a fleet in two strings:
//   --trainer LAYOUT[:RANKS]@HW   fsdp:16@h100, tp4pp2ep8:16@h100, tp2pp1@h200 (RANKS
//                                 defaults to tp*pp for Megatron, 1 for fsdp)
//   --servers N×(TP,DP,EP)@HW     2x(8,1,1)@h800 ('x' or '×'): N deployments of TP*DP
//                                 workers each; EP is 1 (experts TP-split) or TP*DP
//                                 (vLLM's expert parallelism over the whole deployment)
// Megatron layouts here follow Megatron-Core's MoE parallel folding: a pipeline stage has
// world/pp ranks, numbered tp fastest; its experts are laid out etp fastest, then ep, then
// expert-dp over the same ranks, so ep*etp must divide world/pp. For layouts wsync's own
// sources accept (sources/layout.h) the owners this gives are exactly theirs.
//
// Placement: trainer rank r sits on GPU r of the trainer's nodes (gpus_per_node to a
// node); worker w of the fleet (deployment-major, then dp index, then tp rank) on GPU w of
// the servers' nodes, which come after the trainer's (Placement::kDisaggregated), or the
// servers' GPUs follow the trainer's on the same nodes (kPacked: one host holding both,
// as in wsync's own 2-GPU runs), or worker w shares trainer rank w's GPU (kColocated).
// Pure values; thread-safe.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "model/sharding.h"
#include "plan/sharded_plan.h"
#include "planner/hardware.h"
#include "wsync/status.h"

namespace wsync::planner {

struct TrainerSpec {
  bool fsdp = true;
  int tp = 1, pp = 1, ep = 1, etp = 1;
  int world = 1;
  std::string hardware;  // profile name or path
  std::string ToString() const;
};

struct ServerSpec {
  int count = 1;
  int tp = 1, dp = 1, ep = 1;
  std::string hardware;
  int workers_per_deployment() const { return tp * dp; }
  std::string ToString() const;
};

// Strict parsers: InvalidArgument quoting the text and saying what was expected.
Result<TrainerSpec> ParseTrainerSpec(std::string_view text);
Result<ServerSpec> ParseServerSpec(std::string_view text);

enum class Placement { kDisaggregated, kPacked, kColocated };

struct Fleet {
  TrainerSpec trainer;
  ServerSpec servers;
  HardwareProfile trainer_hw;
  HardwareProfile server_hw;
  Placement placement = Placement::kDisaggregated;

  int num_workers() const { return servers.count * servers.workers_per_deployment(); }
  // Node of trainer rank r and of worker w (CPU-only hosts: everything on node 0).
  int trainer_node(int rank) const;
  int worker_node(int worker) const;
  // Whether worker w shares its GPU with trainer rank w (kColocated).
  bool colocated() const { return placement == Placement::kColocated; }
  int trainer_nodes() const;
  int server_nodes() const;
};

// Parses both specs and loads their hardware profiles from `hardware_dir`.
Result<Fleet> BuildFleet(std::string_view trainer, std::string_view servers, Placement placement,
                         const std::string& hardware_dir);

// "disaggregated", "packed" or "colocated".
Result<Placement> ParsePlacement(std::string_view text);
std::string_view PlacementName(Placement p);

// Checks the fleet against the model: the trainer layout fits (heads, experts, layers),
// every server's sharding table can be built, colocation has a GPU per worker.
Status CheckFleet(const ModelConfig& model, const Fleet& fleet);
Status CheckFleet(const HfCatalog& catalog, const Fleet& fleet);

// Which trainer ranks hold each HF tensor (HfTensors order) under the trainer's layout,
// as owner classes (sharded_plan.h); FSDP: every rank holds everything.
Result<Ownership> TrainerOwnership(const ModelConfig& model, const TrainerSpec& trainer);
Result<Ownership> TrainerOwnership(const HfCatalog& catalog, const TrainerSpec& trainer);

// The sharding table of worker `w` of the fleet (its TP rank, and EP rank when ep > 1).
Result<ShardingTable> WorkerTable(const ModelConfig& model, const ServerSpec& servers, int w);
Result<ShardingTable> WorkerTable(std::shared_ptr<const HfCatalog> catalog, const ServerSpec& servers, int w);

}  // namespace wsync::planner
