// Helpers that stand up the trainer ranks of one parallel layout: join a rank's trainer
// group (a Gloo communicator through a rendezvous store, plus the group's stop board) and
// build the rank's source by laying a full HF model out into that rank's shards. `wsync
// push --trainer-ranks`, `wsync bench sources` and the tests use them; a real trainer
// builds its sources from the shards it already holds instead.
#pragma once

#include <functional>
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
  // Where this rank's Gloo connections listen (an address every peer reaches); empty:
  // store_host, which suits ranks on one host.
  std::string bind_host;
  std::string prefix;  // unique per group and attempt
  double timeout_seconds = 300;
};

// One trainer rank's membership in its group: the trainer communicator and the group's
// stop board, keys under "<prefix>/stop/" in the rendezvous store the ranks met through
// (so ranks in other processes and hosts read it too).
//
// Every pass of a multi-rank source is a collective, so a rank that fails OUTSIDE its
// source (a server refused the update, its sync failed) would leave the others blocked in
// their next collective until the timeout. Stop(cause) posts the cause on the board and
// then aborts this rank's communicator: its connections close, the others' collectives
// fail at once, and sources built from the group (BuildRankSource below) read the board
// and fail with kAborted "trainer rank R (...) stopped: <cause>" instead of a bare
// transport error. Thread-safe; Stop() may run while another thread is in a collective.
class TrainerGroup {
 public:
  // Joins rank `rank` of `layout.world`; blocks until all joined or the timeout.
  static Result<std::shared_ptr<TrainerGroup>> Connect(const TrainerGroupOptions& options,
                                                       const ParallelLayout& layout, int rank);

  const std::shared_ptr<Communicator>& comm() const { return comm_; }
  int rank() const { return comm_->rank(); }
  // Posts `cause` for this rank, then aborts the communicator. When another rank posted
  // first, this failure is a consequence of that one: only the abort happens, so the
  // board keeps the root cause. Blocks at most ~2 s on the store.
  void Stop(const Status& cause);
  // kAborted "trainer rank R (...) stopped: <cause>" for the lowest-numbered OTHER rank
  // on the board; OK when none posted or the board cannot be read. At most ~2 s.
  Status PeerStopped() const;
  // PeerStopped() as a callable that outlives the group (SourceOptions::peer_stopped).
  std::function<Status()> PeerStoppedFn() const;

 private:
  struct Board;
  TrainerGroup() = default;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<const Board> board_;
};

// The communicator of a trainer group alone, without its stop board.
Result<std::shared_ptr<Communicator>> ConnectTrainerGroup(const TrainerGroupOptions& options,
                                                          const ParallelLayout& layout, int rank);

// The source of comm->rank() over `full` (tensors in `metadata` order), laid out per
// `layout` (the Megatron table comes from `config`; FSDP needs none). Collective.
// `peer_stopped` explains a failed collective (SourceOptions::peer_stopped).
Result<std::unique_ptr<WeightSource>> BuildRankSource(std::shared_ptr<Communicator> comm,
                                                      const ParallelLayout& layout,
                                                      const ModelConfig* config,
                                                      const std::vector<HostTensor>& full,
                                                      double timeout_seconds,
                                                      std::function<Status()> peer_stopped = nullptr);
// The same on a group's communicator, its failures explained by the group's stop board.
Result<std::unique_ptr<WeightSource>> BuildRankSource(const TrainerGroup& group,
                                                      const ParallelLayout& layout,
                                                      const ModelConfig* config,
                                                      const std::vector<HostTensor>& full,
                                                      double timeout_seconds);

// Rewrites a source built by BuildRankSource from new full weights (a trainer step).
Status RefreshRankSource(WeightSource& source, const std::vector<HostTensor>& full);

}  // namespace wsync
