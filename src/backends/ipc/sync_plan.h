// IpcSyncPlan: rank 0's ipc sync under way, from its plan to its end.
//
// Plan() decides whether the sync is zero-copy or packed (with several publishers as the
// ranks agreed; with one, mode zero_copy always and mode auto once a pass has shown where
// the tensors lie in the storage the source offers now), plans its chunks, builds the
// update_weights body and announces the sync to the other publishers. It owns that plan,
// the update it sends, whether the sync has begun (other ranks then wait on it) and the
// serialized body of the last sync: the same bytes when nothing changed, so that the
// servers find them in their cache of parsed bodies. Not thread-safe: the plane's thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/ipc/protocol.h"
#include "backends/ipc/rank_group.h"
#include "backends/ipc/session.h"
#include "backends/ipc/trainer.h"
#include "backends/ipc/zero_copy_plan.h"
#include "engine/data_plane.h"

namespace wsync {

class IpcSyncPlan {
 public:
  // Both are kept by reference and must outlive the plan.
  IpcSyncPlan(const TrainerOptions& options, const IpcTrainerOptions& ipc) : options_(options), ipc_(ipc) {}

  // A new sync: nothing planned, not begun.
  void Reset() { begun_ = false; }
  // From here on a failure aborts the sync for the other publishers, which are already
  // waiting for its announcement.
  void Begin() { begun_ = true; }
  bool begun() const { return begun_; }

  // Plans `sync` after the ranks' exchange (`group`; `zero_copy_group`: the ranks decide
  // zero-copy together): sets its update body, bytes and chunks, then announces it on
  // `session`'s region.
  Status Plan(SyncContext& sync, const GroupSync& group, bool zero_copy_group, IpcSession& session,
              ZeroCopyPlanner& zero_copy);

  const IpcPlan& plan() const { return plan_; }
  const IpcUpdateInfo& update() const { return update_; }
  bool zero_copy() const { return zero_copy_; }

  // Forgets the cached body (a new session).
  void Clear() { body_ = CachedBody{}; }

 private:
  // The serialized {"update_info": ...} of `u` (whose sync fields are not on the wire).
  std::shared_ptr<const std::string> UpdateBody(const std::vector<TensorMeta>& meta, const IpcUpdateInfo& u);

  const TrainerOptions& options_;
  const IpcTrainerOptions& ipc_;
  IpcPlan plan_;
  IpcUpdateInfo update_;
  bool zero_copy_ = false;
  bool begun_ = false;
  struct CachedBody {
    std::vector<TensorMeta> meta;
    IpcUpdateInfo update;  // sync and first_seq 0
    std::shared_ptr<const std::string> bytes;
  } body_;
};

}  // namespace wsync
