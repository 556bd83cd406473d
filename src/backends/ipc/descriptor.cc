#include "backends/ipc/descriptor.h"

#include "backends/ipc/cost.h"
#include "backends/ipc/receiver.h"
#include "backends/ipc/trainer.h"

namespace wsync {

const BackendDescriptor& IpcBackend() {
  static const BackendDescriptor kIpc{
      .name = "ipc",
      .summary = "colocated: CUDA IPC or POSIX shared-memory slots on one host",
      .init_info_fields = {"wsync_ipc_protocol", "buffers", "control_path", "control_bytes", "num_slots",
                           "slot_bytes", "reader_offset", "reader_count", "session"},
      .update_info_fields = {"tensor_sizes", "tensor_offsets", "zero_copy"},
      .trainer_options = {{"mode", "choice", "auto", "auto, packed or zero_copy", "--ipc-mode"},
                          {"export_kind", "choice", "cuda_ipc", "on a GPU, cuda_ipc or cuda_fd", "--ipc-export-kind"},
                          {"backing", "choice", "memfd", "on a CPU, memfd or posix_shm"},
                          {"stall_after_chunks", "int", "", "tests: stop after publishing N chunks"}},
      .receiver_options = {{"ipc_shm_dir", "path", "",
                            "a directory whose wsync-ipc-* files of this user a trainer may name as its region"}},
      .trainer_group = TrainerGroupUse::kOnDevice,
      .create_receiver = CreateIpcReceiver,
      .create_trainer = CreateIpcTrainer,
      .cost = {.predict = PredictIpcCost, .describe_options = DescribeIpcCostOptions, .plan_order = 1},
  };
  return kIpc;
}

}  // namespace wsync
