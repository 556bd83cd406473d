// The `nccl` backend's data plane, trainer side (rank 0; the engine skeleton in
// src/engine runs the session and the other ranks): discovers the servers' worker counts,
// assigns rank offsets (SkyRL's nccl_init_payloads), builds the broadcast group while
// every server joins it, and per sync packs the pass's tensors into chunks cut exactly as
// vLLM's packed producer cuts them and broadcasts them, packing chunk k+1 while chunk k
// is on the wire. Every blocking step is watched against the servers' HTTP replies, so a
// server that refuses (or dies) ends the wait at once with its own message instead of at
// the deadline. A failed sync aborts the group; the engine builds a new one for the next.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "backends/nccl/init_info.h"
#include "wsync/trainer.h"

namespace wsync {

// Settings of the nccl trainer that TrainerOptions does not carry.
struct NcclTrainerOptions {
  // GPU trainers talking to wsync servers: each chunk is broadcast in pieces of this many
  // bytes, so that packing and unpacking overlap the wire inside a chunk. Smaller pieces
  // overlap sooner and cost one NCCL call each. Option `piece_mb` (MiB).
  int64_t broadcast_piece_bytes = kWsyncBroadcastPieceBytes;
};

// Reads `piece_mb` from TrainerOptions::backend_options.
Result<NcclTrainerOptions> ParseNcclTrainerOptions(const std::map<std::string, std::string>& values);

// The registry's factory (TrainerOptions only).
Result<std::unique_ptr<TrainerEngine>> CreateNcclTrainer(const TrainerOptions& options);
Result<std::unique_ptr<TrainerEngine>> CreateNcclTrainerWith(const TrainerOptions& options,
                                                             const NcclTrainerOptions& nccl);

}  // namespace wsync
