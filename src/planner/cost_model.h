// The cost model's shared part: what a backend's cost hook (BackendDescriptor::cost,
// src/backends/<name>/cost.h) reads and fills, and the arithmetic every hook uses.
//
// The planner (planner/cost.h) prepares the model on the fleet once (its tensors, the
// workers' shard sizes, the trainer's owners and, when a hook asks, the workers' consumer
// plans) and hands each hook a CostInput. A hook walks what its backend would move,
// charges each step's bytes to the link or copy engine that carries them (hardware
// profiles, calibration constants) and combines the steps as its plane overlaps them:
// pipelined steps cost their maximum, sequential ones their sum. Steps: gather (the trainer
// assembling what it sends), pack, wire, unpack, post-process, control plane.
//
// Assumptions that hold for every backend (each prediction lists its own as well):
//   - links run at calibration's link_efficiency of their per-direction rate; a GPU has
//     nics_per_node / gpus_per_node NICs; nothing else shares a link during the sync;
//   - copies run at hbm_copy_efficiency of half the HBM bandwidth (each byte read and
//     written); on CPU-only hosts a thread copies at the profile's core_copy_gb_per_s and
//     all cores together at most half the host memory bandwidth;
//   - --dtype fp8 moves one byte per element of every tensor (block scales, < 0.03% of
//     the bytes, and tensors kept in bf16 are not counted separately);
//   - deployments of one shape route identically, so one deployment's plans stand for all.
// Planning a 1T-parameter fleet keeps one deployment's consumer plans at a time and
// aggregates them per (group, producer), so memory does not grow with the fleet.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "plan/sharded_plan.h"
#include "planner/calibration.h"
#include "planner/fleet.h"
#include "sources/groups.h"
#include "wsync/status.h"

namespace wsync::planner {

inline constexpr double kGB = 1e9;

struct PlanOptions {
  // Packed buffer size for nccl and ipc (vLLM's default 1 GiB).
  int64_t bucket_bytes = int64_t{1} << 30;
  // Layer groups the sharded plane stages ahead; 0 runs gather, wire and unpack of each
  // group one after the other.
  int lookahead = 1;
  // sharded: every worker receives from all the trainer ranks it pulls from at once
  // (ShardedTrainerOptions::concurrent_stages), so pipeline stages send concurrently;
  // false: groups go in plan order and stages take turns.
  bool concurrent_stages = true;
  // ipc: pack into slots even where zero-copy is possible (one trainer rank).
  bool ipc_packed = false;
};

// One step of a sync: bytes through a resource at a rate, and the time charged.
struct Step {
  std::string name;      // gather, pack, wire, unpack, post-process, control
  std::string resource;  // "NIC egress of trainer rank 0", "HBM copy on worker 3"
  double bytes = 0;
  double gb_per_s = 0;   // raw rate of the resource (0: not a link)
  double seconds = 0;
};

struct Prediction {
  std::string backend;  // its BackendDescriptor::name
  bool applicable = true;
  std::string not_applicable;  // why, when !applicable
  double seconds = 0;
  int64_t sent_per_trainer_rank_max = 0;
  int64_t sent_per_trainer_rank_min = 0;
  int64_t received_per_worker_max = 0;
  int64_t trainer_extra_bytes = 0;  // peak memory beside the trainer's weights, per rank
  int64_t worker_extra_bytes = 0;   // peak memory beside the worker's shard, per worker
  std::string bottleneck;           // the resource that bounds the sync
  double utilisation = 0;           // its achieved / raw rate over the whole sync
  std::vector<Step> steps;
  std::vector<std::string> assumptions;
};

// The model's tensors as they travel: HfTensors with config.dtype (and DType::kF8E4M3
// when `fp8`).
ModelConfig TravelConfig(const ModelConfig& model, bool fp8);

// What every backend's prediction reads of the model on the fleet, made once.
struct PreparedModel {
  std::shared_ptr<const HfCatalog> catalog;
  const std::vector<TensorMeta>& tensors() const { return catalog->tensors(); }
  int64_t bytes = 0;
  std::vector<int64_t> shard_bytes;  // by worker index within one deployment
  Ownership own;
  // With consumer plans: the layer groups and one deployment's consumer plans (chunk
  // sizes only, slices dropped), by worker index; empty otherwise.
  std::vector<LayerGroup> groups;
  std::vector<ConsumerPlan> plans;
};

// Builds each worker table of one deployment once (a worker of an EP-less deployment
// shares its TP rank's table) and, with `with_plans`, plans every worker of it on the way.
Result<PreparedModel> PrepareModel(const ModelConfig& travel, const Fleet& fleet, bool with_plans);

// What a cost hook reads: the model as it travels, prepared on the fleet, and the planning
// options and constants. Valid for the duration of the hook's call.
struct CostInput {
  const PreparedModel& model;
  const ModelConfig& travel;
  const Fleet& fleet;
  const PlanOptions& options;
  const Constants& k;
};

// Per-direction rates in bytes per second, after calibration's efficiencies.
struct Rates {
  bool cpu = false;
  int cores = 1;
  double copy = 0;         // one GPU's HBM copy; on a CPU host, one thread's memcpy
  double host_copy = 0;    // a CPU host's memcpy on all its cores at once
  double nvlink = 0;
  double nic = 0;          // per GPU (nics / gpus of the node); per host when CPU-only
  double pcie = 0;
  double raw_nvlink = 0, raw_nic = 0, raw_copy = 0, raw_host_copy = 0;  // GB/s, for utilisation
};
Rates RatesOf(const HardwareProfile& hw, const Constants& k);

// What a trainer rank must receive from other ranks, by the link that carries it.
struct Gather {
  double nvlink_bytes = 0;
  double nic_bytes = 0;
};

// The share of a tensor that Megatron trainer rank `rank`, one of its owners, receives from
// its TP peers in the held pass (held_plan.h): none of what it holds whole (norms, its own
// experts at etp 1), the peers' part of what its TP group splits.
double HeldMissing(const TrainerSpec& t, const ModelConfig& model, int rank, const TensorMeta& m);

// What trainer rank `rank` must receive to hold every tensor whole (a plane that drains a
// pass of the whole model on one rank): for FSDP the other ranks' shards; for Megatron its
// TP peers' shards of what its group holds, and whole tensors it holds nothing of from an
// owner (on its node when one is there).
Gather GatherInto(int rank, const std::vector<TensorMeta>& tensors, const Ownership& own,
                  const ModelConfig& model, const Fleet& f);

// bytes / rate, 0 when the rate is (a missing link).
double Seconds(double bytes, double rate);
void AddStep(Prediction& p, std::string name, std::string resource, double bytes, double gb_per_s, double seconds);
// Names the longest of the overlapped steps (indices into p.steps) as the bottleneck and
// sets its utilisation over p.seconds.
void NameBottleneck(Prediction& p, const std::vector<size_t>& overlapped);

// The largest worker shard of a deployment; worker `w`'s shard (any deployment).
int64_t MaxShard(const PreparedModel& m);
int64_t ShardOf(const PreparedModel& m, const Fleet& f, int w);

}  // namespace wsync::planner
