// NonSenderTrainer: the engine of a trainer rank other than 0 in a backend where rank 0
// alone touches the wire and the control plane (nccl, delta). Each sync it drains the
// passes the sender makes over its source, because every pass of a multi-rank source is a
// collective among the trainer ranks (an FSDP all-gather, a Megatron export): a rank that
// skipped one would leave the others waiting. The source's collectives bound every wait
// and name the rank that stopped. Not thread-safe (one sync at a time, as every engine).
#pragma once

#include <memory>

#include "wsync/trainer.h"

namespace wsync {

// `passes_per_sync`: how many passes rank 0's engine makes per SendWeights (nccl: the
// check pass and the transfer pass; delta: the one publishing pass).
std::unique_ptr<TrainerEngine> NewNonSenderTrainer(int rank, int passes_per_sync);

}  // namespace wsync
