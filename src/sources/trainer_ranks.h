// Helpers that stand up the trainer ranks of one parallel layout inside a process: join
// a rank's trainer communicator (Gloo, through a rendezvous store) and build the rank's
// source by laying a full HF model out into that rank's shards. `wsync push
// --trainer-ranks`, `wsync bench sources` and the tests use them; a real trainer builds
// its sources from the shards it already holds instead.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/config.h"
#include "sources/layout.h"
#include "sources/sources.h"
#include "wsync/source.h"
#include "wsync/status.h"

namespace wsync {

struct TrainerGroupOptions {
  std::string store_host = "127.0.0.1";
  int store_port = 0;
  std::string prefix;  // unique per group and attempt
  double timeout_seconds = 300;
};

// Joins rank `rank` of `layout.world` trainer ranks; blocks until all joined or the timeout.
Result<std::shared_ptr<Communicator>> ConnectTrainerGroup(const TrainerGroupOptions& options,
                                                          const ParallelLayout& layout, int rank);

// The source of comm->rank() over `full` (tensors in `metadata` order), laid out per
// `layout` (the Megatron table comes from `config`; FSDP needs none). Collective.
Result<std::unique_ptr<WeightSource>> BuildRankSource(std::shared_ptr<Communicator> comm,
                                                      const ParallelLayout& layout,
                                                      const ModelConfig* config,
                                                      const std::vector<HostTensor>& full,
                                                      double timeout_seconds);

// Rewrites a source built by BuildRankSource from new full weights (a trainer step).
Status RefreshRankSource(WeightSource& source, const std::vector<HostTensor>& full);

}  // namespace wsync
