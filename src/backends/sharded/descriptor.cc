#include "backends/sharded/descriptor.h"

#include "backends/receiver_group.h"
#include "backends/sharded/cost.h"
#include "backends/sharded/receiver.h"
#include "backends/sharded/trainer.h"

namespace wsync {

const BackendDescriptor& ShardedBackend() {
  static const BackendDescriptor kSharded{
      .name = "sharded",
      .summary = "each server worker receives only the slices it holds, from every trainer rank",
      .init_info_fields = {"names", "dtype_names", "shapes", "group_lens", "owner_sets", "name_owner_class",
                           "num_producers", "num_consumers", "workers_per_replica", "replica_rank", "num_replicas",
                           "consumer_offset", "deployment_workers", "plan_digests", "num_buffers",
                           "concurrent_stages", "receive_staging_mb", "rank_labels"},
      // The sharded backend meets its group as the nccl backend does.
      .shared_init_info_fields = {"world_size", "nccl_unique_id_b64", "gloo_store_host", "gloo_store_port",
                                  "gloo_prefix", "wsync_protocol"},
      .trainer_options = {{"model", "string", "", "the servers' model, a registered name or config.json directory "
                           "(wsync push: default --model)"},
                          {"lookahead", "int", "1",
                           "layer groups a trainer rank packs ahead of the one still on the wire", "--lookahead"},
                          {"stall_rank", "int", "-1", "tests: rank R sends nothing"},
                          {"concurrent_stages", "choice", "on", "on or off: receive from every pipeline stage at once"},
                          {"receive_staging_mb", "int", "0", "bound on each worker's receive staging in MB (0: none)"}},
      .receiver_options = GroupReceiverOptions(),
      .trainer_group = TrainerGroupUse::kAlways,
      .model_option = "model",
      // A ReceiverEngine hosts it given the worker's model and TP place (its sharding table).
      .single_worker_receiver = true,
      .create_receiver = CreateShardedReceiver,
      .create_trainer = CreateShardedTrainer,
      .cost = {.predict = PredictShardedCost,
               .reads_plans = ShardedCostReadsPlans,
               .describe_options = DescribeShardedCostOptions,
               .plan_order = 3},
  };
  return kSharded;
}

}  // namespace wsync
