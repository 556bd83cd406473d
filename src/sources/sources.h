// Trainer-rank weight sources for parallel training: FSDP-style and Megatron-style.
//
// Each trainer rank builds one source over the shards it holds and a communicator that
// joins it to the OTHER TRAINER RANKS (Gloo on CPU; not the broadcast group that reaches
// the servers). Building a source is a collective (CheckRanksAgree: metadata digests and
// held names), and so is every pass: each rank must drain Iterate() in the same order,
// and every rank yields the WHOLE model in HF names and layouts, so rank 0 can send it
// while the others only iterate.
//
//   FsdpSource      every rank holds an even dim-0 shard (zero-padded at the tail) of
//                   every tensor; Next() all-gathers one full tensor, so memory holds
//                   one tensor at a time.
//   MegatronSource  every rank holds its Megatron parameters (layout.h); a pass goes one
//                   layer group at a time: each rank holding primary pieces of the group
//                   broadcasts them, every rank assembles the group's HF tensors and
//                   yields them. Memory holds one group plus one rank's packed pieces.
//                   Its held pass (IterateHeld) yields only HeldNames(), the names its
//                   TP group holds, and involves that TP group only: per layer group,
//                   each member sends the slices a static plan picked from it
//                   (held_plan.h) to the other members, point to point, and every member
//                   assembles the group's held tensors. Other TP groups run their own
//                   held passes at the same time; nothing crosses stages or expert
//                   owners. Memory holds one group's held tensors plus their packed
//                   slices. FsdpSource holds everything, so its held pass is Iterate().
//
// A collective (or a held pass's exchange) waits at most `timeout_seconds` for a peer; a
// rank that stops iterating makes the others fail with DeadlineExceeded naming it, and a
// stream destroyed before its pass is through aborts the trainer communicator so the
// others fail at once (build new sources to recover). A rank that fails outside its
// source posts why and aborts (TrainerGroup::Stop, trainer_ranks.h): the others'
// collectives then fail at once, and with `peer_stopped` set their error is kAborted
// "trainer rank R (...) stopped: <cause>".
// Not thread-safe: one pass at a time per source.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "sources/groups.h"
#include "sources/held_plan.h"
#include "sources/layout.h"
#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

struct SourceOptions {
  // Longest any collective of a pass or of construction may take, in seconds.
  double timeout_seconds = 300;
  // Names trainer ranks in errors; empty means "rank N".
  DescribeRank describe_rank;
  // Asked when a collective of a pass fails: a non-OK answer says why a peer stopped
  // (TrainerGroup::PeerStoppedFn) and replaces the transport's error, e.g. "connection
  // closed by peer". Empty: the transport's error stands. Called from the iterating thread.
  std::function<Status()> peer_stopped;
};

// `failure` (of a collective, with `what` the source was doing as context), unless
// options.peer_stopped knows that a peer stopped: then that reason, as kAborted.
inline Status ExplainCollectiveFailure(const SourceOptions& options, const Status& failure,
                                       const std::string& what, const std::string& hint) {
  if (options.peer_stopped) {
    Status why = options.peer_stopped();
    if (!why.ok()) return Aborted(why.message()).WithContext(what);
  }
  return failure.WithContext(what + hint);
}

// Largest resident footprint of the buffers a source allocates for passes (gather,
// group and staging buffers), in bytes; the rank's own shards are not counted.
class SourceMemory {
 public:
  size_t peak_buffer_bytes() const { return peak_; }

 protected:
  void Note(size_t bytes) { peak_ = std::max(peak_, bytes); }

 private:
  size_t peak_ = 0;
};

class FsdpSource : public WeightSource, public SourceMemory {
 public:
  // The dim-0 shard of `full` held by each of `world` ranks: ceil(rows / world) rows.
  static TensorMeta ShardMeta(const TensorMeta& full, int world);
  // Collective over `comm` (every trainer rank). `shards[i]` must have
  // ShardMeta(metadata[i], comm->size()); metadata must be group-contiguous.
  static Result<std::unique_ptr<FsdpSource>> Create(std::shared_ptr<Communicator> comm,
                                                    std::vector<TensorMeta> metadata,
                                                    std::vector<HostTensor> shards,
                                                    SourceOptions options = {});

  const std::vector<TensorMeta>& metadata() const override { return metadata_; }
  Result<std::unique_ptr<TensorStream>> Iterate() override;
  const std::vector<LayerGroup>& groups() const { return groups_; }
  // This rank's shards, writable (a trainer step updates them in place).
  std::vector<HostTensor>& shards() { return shards_; }
  int rank() const { return comm_->rank(); }
  int world() const { return comm_->size(); }

 private:
  class Stream;
  FsdpSource() = default;

  std::shared_ptr<Communicator> comm_;
  std::vector<TensorMeta> metadata_;
  std::vector<HostTensor> shards_;
  std::vector<LayerGroup> groups_;
  SourceOptions options_;
  HostBuffer gathered_;  // world * largest shard
};

// Rank `rank`'s shards of the full model `full` (zero-padded tail rows).
Result<std::vector<HostTensor>> FsdpShards(const std::vector<HostTensor>& full, int rank, int world);
// The same into existing shards.
Status FsdpShardsInto(const std::vector<HostTensor>& full, int rank, int world,
                      std::vector<HostTensor>& shards);

class MegatronSource : public WeightSource, public SourceMemory {
 public:
  // Collective over `comm`, whose size must be the layout's world and whose rank picks
  // this rank's table; `params` must match layout->params(rank) (LayOutMegatron makes them).
  static Result<std::unique_ptr<MegatronSource>> Create(std::shared_ptr<Communicator> comm,
                                                        std::shared_ptr<const MegatronLayout> layout,
                                                        std::vector<HostTensor> params,
                                                        SourceOptions options = {});

  // The whole model, on every rank.
  const std::vector<TensorMeta>& metadata() const override { return layout_->hf_tensors(); }
  Result<std::unique_ptr<TensorStream>> Iterate() override;
  // What this rank's TP group holds: its stage's dense tensors and its members' experts.
  std::optional<std::vector<std::string>> HeldNames() const override { return held_; }
  // The held names only, bit-identical to what Iterate() yields for them; a collective of
  // this rank's TP group (every member must drain it), one point-to-point exchange per
  // layer group the TP group holds anything of.
  Result<std::unique_ptr<TensorStream>> IterateHeld() override;
  const std::vector<LayerGroup>& groups() const { return groups_; }
  std::vector<HostTensor>& params() { return params_; }
  int rank() const { return comm_->rank(); }
  const MegatronLayout& layout() const { return *layout_; }

 private:
  class Stream;
  class HeldStream;
  // What one rank contributes to one group: its primary pieces, packed back to back.
  struct Contribution {
    std::vector<ExportPiece> pieces;
    size_t bytes = 0;
  };
  MegatronSource() = default;
  Status LoadGroup(size_t g, Deadline deadline);
  // Plans the held pass of this rank's TP group (and checks every other TP group's).
  Status PlanHeld();
  // Assembles held_plan_[k] into group_; `tag` marks its messages.
  Status LoadHeldGroup(size_t k, uint32_t tag, Deadline deadline);
  // Grows group_ and staging_ to at least these sizes before a pass starts.
  Status Reserve(size_t group_bytes, size_t staging_bytes);
  // Fails a new pass when the communicator is aborted.
  Status CheckNotAborted() const;

  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<const MegatronLayout> layout_;
  std::vector<HostTensor> params_;
  std::vector<LayerGroup> groups_;
  std::vector<std::string> held_;
  SourceOptions options_;
  std::vector<std::vector<Contribution>> plan_;  // [group][rank]
  std::vector<size_t> offset_in_group_;          // by HF index
  size_t max_group_ = 0, max_contribution_ = 0;  // buffer sizes a full pass needs
  // The held pass: this rank's TP group (ranks by tp coordinate), its place in it, the
  // plan per held layer group, the buffer sizes the pass needs, and the passes started.
  std::vector<int> tp_group_;
  int tp_member_ = 0;
  std::vector<HeldGroupPlan> held_plan_;
  size_t max_held_group_ = 0, max_held_staging_ = 0;
  uint32_t held_passes_ = 0;
  HostBuffer group_;    // the group being yielded
  HostBuffer staging_;  // packed pieces: one rank's (full pass), or a TP group's (held pass)
};

}  // namespace wsync
