// The `nccl` backend's sending half (trainer rank 0): discovers the servers' worker
// counts, assigns rank offsets (SkyRL's nccl_init_payloads), builds the broadcast group
// while every server joins it, and per sync packs the source's tensors into chunks cut
// exactly as vLLM's packed producer cuts them and broadcasts them, packing chunk k+1 while
// chunk k is on the wire. Every blocking step is watched against the servers' HTTP
// replies, so a server that refuses (or dies) ends the wait at once with its own message
// instead of at the deadline.
#pragma once

#include <memory>

#include "wsync/trainer.h"

namespace wsync {

Result<std::unique_ptr<TrainerEngine>> CreateNcclTrainer(const TrainerOptions& options);

}  // namespace wsync
