// The cost model: what one sync of a backend costs on a fleet, from the engine's own plan.
//
// Predict() walks what the backend would move: the nccl broadcast's packed chunks
// (plan/packing.h, vLLM's cut) to every worker; the ipc plane's slots on trainer rank 0's
// GPU, read by the colocated workers; the delta publisher's compressed payload, fetched
// and applied on every server node, then reloaded into the shards; the sharded plane's
// per-worker chunks (plan/sharded_plan.h, PlanConsumer / PlanProducer over the sharding
// tables and the trainer's owners). It charges each step's bytes to the link or copy
// engine that carries them (hardware profiles, calibration constants) and combines the
// steps as the plane overlaps them: pipelined steps cost their maximum, sequential ones
// their sum. Steps: gather (the trainer assembling what it sends), pack, wire, unpack,
// post-process, control plane.
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
#include <span>
#include <string>
#include <vector>

#include "model/config.h"
#include "planner/calibration.h"
#include "planner/fleet.h"
#include "wsync/status.h"

namespace wsync::planner {

enum class Backend { kNccl, kIpc, kDelta, kSharded };
std::string_view BackendName(Backend b);

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
  Backend backend = Backend::kNccl;
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

Result<Prediction> Predict(const ModelConfig& model, const Fleet& fleet, Backend backend,
                           const PlanOptions& options, const Constants& k);

// Predict() for each of `backends` in order, preparing the model on the fleet (its
// tensors, the workers' shard sizes, the trainer's owners) once for all of them.
Result<std::vector<Prediction>> PredictEach(const ModelConfig& model, const Fleet& fleet,
                                            std::span<const Backend> backends, const PlanOptions& options,
                                            const Constants& k);

}  // namespace wsync::planner
