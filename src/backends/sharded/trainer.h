// The `sharded` backend, trainer side: every trainer rank is a producer. At init the
// ranks agree on the model (metadata digest) and who holds what (one all-gather of held
// masks), rank 0 discovers the fleet and plans every worker's chunks (plan/sharded_plan.h),
// and all ranks and workers join one point-to-point group. Per sync each rank iterates
// its held pass once, group by group, packs each group's chunks for the workers that pull
// them from it and sends them, keeping at most `lookahead + 1` groups resident.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "wsync/status.h"
#include "wsync/trainer.h"

namespace wsync {

struct ShardedTrainerOptions {
  // The model the servers hold: a registered name or a directory with config.json (the
  // sharding tables are the model's). Option `model`.
  std::string model;
  // Groups packed ahead of the one whose sends are still in flight. Option `lookahead`.
  int lookahead = 1;
  // Whether each worker receives from every trainer rank it pulls from at once (one lane
  // and receive ring per rank, so pipeline stages send concurrently) or in plan order,
  // stage after stage. Concurrent costs each worker one ring of num_buffers chunks per
  // rank it pulls from instead of one ring in all (ReceiveStagingBytes); the trainer's
  // staging is the same. Gloo only: an NCCL group receives in plan order either way.
  // Option `concurrent_stages` (on|off).
  bool concurrent_stages = true;
  // A bound on each worker's receive staging with concurrent stages, in MB (1e6 bytes):
  // the lanes of neighbouring trainer ranks merge until it fits, down to plan order
  // (which needs num_buffers of the plan's largest chunk whatever the bound). 0: none.
  // Option `receive_staging_mb`.
  int64_t receive_staging_mb = 0;
  // Fault injection for tests, honest about what it fakes: trainer rank `stall_rank` reads
  // its pass but sends nothing, as a wedged producer would, until the sync's deadline or
  // an abort. -1: none. Option `stall_rank`.
  int stall_rank = -1;
};

Result<ShardedTrainerOptions> ParseShardedTrainerOptions(const std::map<std::string, std::string>& values);

Result<std::unique_ptr<TrainerEngine>> CreateShardedTrainer(const TrainerOptions& options);
Result<std::unique_ptr<TrainerEngine>> CreateShardedTrainerWith(const TrainerOptions& options,
                                                                const ShardedTrainerOptions& sharded);

}  // namespace wsync
