// The trainer engine every backend shares: one skeleton around a backend's DataPlane.
//
// The engine reads the plane's SessionShape once and drives every sync from it. Rank 0
// (or every rank of a plane whose shape has all ranks take part) runs:
//   Init:  discover the fleet (GET /health; the backend each server runs must be the one
//          asked for), then DataPlane::Init; the metadata is kept for re-inits.
//   SendWeights: the source's metadata must list Init's tensors, in any order (a mismatch
//          names the tensor; nothing reaches the servers), re-init when a failure tore the
//          plane down, Prepare, the shape's before_start, start, update in the background
//          + Transfer (when the shape has a transfer phase), wait, the prefix-cache reset
//          (before finish, or before start when the shape says so), finish (with
//          weight_version), the shape's after_session. On a failure after start the
//          plane aborts and the servers' sessions are closed (best effort). The sync fails
//          on this rank without finishing its pass: the other ranks' passes (collectives)
//          fail at their own deadlines, or at once when the trainer stops its group
//          (sources/trainer_ranks.h).
// Other ranks run the shape's other_rank_sync, or without one drain their source's one
// pass per sync.
// Not thread-safe: one call at a time.
#pragma once

#include <memory>
#include <string>

#include "engine/data_plane.h"
#include "wsync/trainer.h"

namespace wsync {

// A server URL: [http://]HOST:PORT with an optional trailing '/'; else InvalidArgument.
Status CheckServerUrl(const std::string& url);

// Checks what every backend's options need (rank, servers on rank 0, timeout, bucket).
Status CheckTrainerOptions(const TrainerOptions& options, bool servers_required = true);

Result<std::unique_ptr<TrainerEngine>> NewTrainerEngine(const TrainerOptions& options,
                                                        std::unique_ptr<DataPlane> plane);

}  // namespace wsync
