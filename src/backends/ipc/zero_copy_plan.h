// ZeroCopyPlanner: what the ipc trainer knows of its source's storage, for zero-copy
// syncs (trainer.h: receivers copy straight from the trainer's tensors).
//
// It owns the export of the allocation behind the source's storage() (made again, under
// a new generation, whenever the block changes), whether every server of the session has
// been sent that export, where the last source with a storage held its tensors (learned
// from a pass) and the layout of the sync under way. It plans a zero-copy sync's update
// (one chunk, the tensors where they lie, the exports when new) and checks a zero-copy
// pass: a tensor outside the storage, or moved, fails the sync naming it. The rank
// group (rank_group.h) reads and sets the layout and the generation in its exchange;
// packed passes teach it the layout through Learn(). Not thread-safe: the plane's thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "backends/ipc/device_plane.h"
#include "backends/ipc/protocol.h"
#include "backends/ipc/storage_layout.h"
#include "backends/ipc/trainer.h"
#include "engine/sync_pass.h"

namespace wsync {

class ZeroCopyPlanner {
 public:
  // Kept by reference; must outlive the planner.
  explicit ZeroCopyPlanner(const TrainerOptions& options) : options_(options) {}

  // The storage of `source` when zero-copy could export it (on this trainer's GPU);
  // otherwise nullopt, and `why` says why not.
  std::optional<SourceStorage> Exportable(const WeightSource& source, std::string* why) const;

  // Exports the allocation behind `storage` when it is new to this session or changed
  // since the last export (returns whether it did), as publisher `publisher`'s buffer.
  // Exporting is cheap and names the allocation: a new one at the same address has
  // another handle, so a receiver never reads through a stale mapping.
  Result<bool> Export(const SourceStorage& storage, int publisher);
  // What was last exported.
  const IpcBufferDesc& exported() const { return exported_; }

  // The update of a zero-copy sync into `u`, and where the tensors lie: the source's
  // tensors where they are, one chunk, and the exports of their allocations when they
  // are new to this session or have changed: this rank's own (`group` null, under
  // `device_key`), or with several publishers every publisher's (`group`, exchanged).
  // `in_group`: the layout was agreed among the ranks before the pass.
  Result<IpcPlan> Plan(SyncPass& pass, const std::map<std::string, IpcBufferDesc>* group,
                       const std::string& device_key, bool in_group, IpcUpdateInfo* u);
  // The pass of a zero-copy sync, unless ReadPassFirst read it: where every tensor lies
  // in the sync's layout's storage, which a group's ranks (`in_group`) agreed on before
  // the pass (each rank's tensors must be where it said). A tensor outside the storage,
  // or moved, fails the sync naming it, and what was learned of the storage is forgotten
  // (mode auto packs the next sync).
  Result<IpcPlan> Layout(SyncPass& pass, bool in_group);

  // A group in mode zero_copy: every rank reads its pass before the ranks' exchange (the
  // pass is only a check there, and may be a collective, so every rank reads it at the
  // same point); `learns` (a publisher with readers) learns where its tensors lie.
  // `applies` false: reads nothing. Sets pass_read().
  Status ReadPassFirst(SyncPass& pass, bool applies, bool learns);
  // Whether ReadPassFirst read this sync's pass.
  bool pass_read() const { return pass_read_; }
  // A sync that reads no pass first.
  void NewPass() { pass_read_ = false; }

  // Whether a pass has shown where the tensors of `storage`'s block lie.
  bool Knows(const SourceStorage& storage) const { return learned_ && learned_->SameBlock(storage); }
  // This sync uses what was learned of the source's block (Knows() must hold).
  void UseLearned() { sync_layout_ = learned_; }
  // This sync uses `storage`, its offsets read from the sync's own pass.
  void UseStorage(const SourceStorage& storage) { sync_layout_ = StorageLayout{storage, {}}; }
  const std::optional<StorageLayout>& sync_layout() const { return sync_layout_; }
  // What a packed pass showed of the source's storage (`had_storage`: the source offered
  // one); a source without one leaves what an earlier source showed.
  void Learn(Result<StorageLayout> learned, bool had_storage);

  // The exports change: servers must be sent them again, under the next generation.
  void NewGeneration();
  // Every server has mapped this generation.
  void MarkSent() { sent_ = true; }
  // A new session maps the source again.
  void ForgetSent() { sent_ = false; }

 private:
  const TrainerOptions& options_;
  IpcBufferDesc exported_;
  std::unique_ptr<DeviceExport> export_;
  const std::byte* exported_data_ = nullptr;
  size_t exported_bytes_ = 0;
  uint64_t generation_ = 0;
  bool sent_ = false;
  std::optional<StorageLayout> learned_;
  std::optional<StorageLayout> sync_layout_;
  bool pass_read_ = false;
};

}  // namespace wsync
