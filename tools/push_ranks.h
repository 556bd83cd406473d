// `wsync push --trainer-ranks N --trainer-layout L`: N trainer ranks as threads of the
// push process. Each rank joins its own trainer communicator (Gloo, through a store this
// process hosts), holds its shards of the model as laid out by L, and runs its own
// TrainerEngine, initialized from its source on every rank at once (Init may be a
// collective of the ranks): rank 0 is the sender, the others drain their sources, or, for
// a backend whose ranks all send (`sharded`, which also gets the ranks' communicator as
// TrainerOptions::comm), send what they hold. A rank whose
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
  // Builds every rank's source from the full weights and its engine from `options` (rank
  // 0's reaches the servers), and initializes the engines, all ranks at once.
  static Result<std::unique_ptr<TrainerRanks>> Start(int ranks, const std::string& layout,
                                                     const ModelConfig* config,
                                                     const std::vector<HostTensor>& full,
                                                     const TrainerOptions& options);
  ~TrainerRanks();
  // Rank 0's source and engine.
  WeightSource& sender_source() { return *sources_[0]; }
  TrainerEngine& sender() { return *engines_[0]; }
  // Re-lays every rank's shards out from new full weights.
  Status Refresh(const std::vector<HostTensor>& full);
  // One sync on every rank: rank 0 here, the others on their threads. Rank 0's error
  // wins; otherwise the first failing rank's. After a failure the trainer group is
  // aborted: later syncs fail (restart the ranks to recover).
  Result<SyncStats> Sync(const std::optional<std::string>& version);

 private:
  TrainerRanks() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<std::unique_ptr<WeightSource>> sources_;
  std::vector<std::unique_ptr<TrainerEngine>> engines_;
};

}  // namespace wsync::cli
