// `wsync push --trainer-ranks N --trainer-layout L`: N trainer ranks as threads of the
// push process. Each rank joins its own trainer communicator (Gloo, through a store this
// process hosts), holds its shards of the model as laid out by L, and runs its own
// TrainerEngine: rank 0 is the sender, the others only drain their sources. A rank whose
// sync fails stops the trainer group (TrainerGroup::Stop), so the others fail at once
// with kAborted "trainer rank R (...) stopped: <cause>" rather than at the timeout.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/trainer.h"

namespace wsync::cli {

class TrainerRanks {
 public:
  // Builds ranks 1..N-1 (engine and source) and rank 0's source from the full weights.
  static Result<std::unique_ptr<TrainerRanks>> Start(int ranks, const std::string& layout,
                                                     const ModelConfig* config,
                                                     const std::vector<HostTensor>& full,
                                                     const TrainerOptions& options);
  ~TrainerRanks();
  // Rank 0's source, for the sender's engine.
  WeightSource& sender_source() { return *sources_[0]; }
  // Re-lays every rank's shards out from new full weights.
  Status Refresh(const std::vector<HostTensor>& full);
  // One sync on every rank: `sender` (rank 0's engine) here, the others on their threads.
  // The sender's error wins; otherwise the first failing rank's. After a failure the
  // trainer group is aborted: later syncs fail (restart the ranks to recover).
  Result<SyncStats> Sync(TrainerEngine& sender, const std::optional<std::string>& version);

 private:
  TrainerRanks() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<std::unique_ptr<WeightSource>> sources_;
  std::vector<std::unique_ptr<TrainerEngine>> engines_;  // [0] unused
};

}  // namespace wsync::cli
