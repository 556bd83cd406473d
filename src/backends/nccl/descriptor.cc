#include "backends/nccl/descriptor.h"

#include "backends/nccl/cost.h"
#include "backends/nccl/receiver.h"
#include "backends/nccl/trainer.h"
#include "backends/receiver_group.h"

namespace wsync {

const BackendDescriptor& NcclBackend() {
  static const BackendDescriptor kNccl{
      .name = "nccl",
      .summary = "broadcast of packed chunks to every worker: NCCL on GPU, Gloo on CPU",
      .init_info_fields = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
                           "gloo_store_host", "gloo_store_port", "gloo_prefix", "gloo_rank_labels", "wsync_protocol",
                           "packed_buffer_size_bytes", "packed_num_buffers", "wsync_broadcast_piece_bytes"},
      .trainer_options = {{"piece_mb", "int", "256", "on a GPU, the broadcast piece size in MiB", "--nccl-piece-mb"}},
      .receiver_options = GroupReceiverOptions(),
      .create_receiver = CreateNcclReceiver,
      .create_trainer = CreateNcclTrainer,
      .cost = {.predict = PredictNcclCost, .plan_order = 0},
  };
  return kNccl;
}

}  // namespace wsync
