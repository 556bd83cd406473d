// DataPlane: what a backend implements; the trainer engine (engine.h) does the rest.
//
// The engine owns the session with the servers (start -> update_weights in the
// background -> data plane -> finish, closing sessions on failure), the source checks,
// the one pass per sync (SyncPass), the timings, the weight version and the ranks that
// send nothing. A backend supplies only how bytes move:
//
//   Init       build the plane for the fleet (its group, its shared memory, its sync
//              directory) and send every server its init_info through the driver;
//   Prepare    before the session: plan this sync (bytes, chunks) and the update_weights
//              body; nothing reaches the servers;
//   BeforeStart  optional: work between planning and start_weight_update (delta
//              publishes, fetches and pauses here);
//   Transfer   move the sync's one checked pass while update_weights is in flight;
//   Abort      the sync failed (in Prepare or later): stop the plane's side of it;
//   AfterSession optional: always after BeforeStart ran (delta resumes here);
//   Shutdown   release everything.
//
// The engine calls a plane from one thread at a time. A plane that cannot run another
// sync after a failure says so in Ready(); the engine then runs Init again (with the
// last metadata) before the sync.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "control/session_driver.h"
#include "engine/sync_pass.h"
#include "wsync/status.h"
#include "wsync/trainer.h"

namespace wsync {

// What Init gives a plane. On rank 0 `driver` talks to the fleet and `fleet` is what
// discovery found (backend already checked); on other ranks of an all-ranks plane both
// are null.
struct PlaneInit {
  const TrainerOptions& options;
  const std::vector<TensorMeta>& metadata;
  const SessionDriver* driver = nullptr;
  const Fleet* fleet = nullptr;
  // The names this rank holds (TrainerEngine::Init(source)); nullopt: all of them.
  const std::optional<std::vector<std::string>>& held;
  // A degraded sync's live servers (indices into TrainerOptions::servers, ascending);
  // empty: every server. On rank 0 `driver` and `fleet` then cover the live ones only.
  const std::vector<int>& live;
};

// One sync, as the engine runs it.
struct SyncContext {
  SyncPass& pass;
  const SessionDriver* driver = nullptr;  // null on ranks other than 0
  const std::optional<std::string>& weight_version;
  Deadline deadline;  // the trainer's bound for this sync
  // Prepare fills bytes and chunks; the engine fills tensors and the phase timings.
  SyncStats stats;
  // Prepare sets the serialized {"update_info": ...} the engine posts (UpdateBody()).
  std::shared_ptr<const std::string> update_body;
  // Reports progress to TrainerOptions::progress (when set).
  std::function<void(const SyncProgress&)> progress;
  // POSTs /reset_prefix_cache?reset_running_requests=true to the servers that said at
  // Init that they cache prefixes (SessionDriver::PrefixCaching); OK at once when none
  // did. The engine calls it before finish unless the plane ResetsPrefixCache() itself.
  std::function<Status()> reset_prefix_cache = [] { return Status::Ok(); };
};

class DataPlane {
 public:
  virtual ~DataPlane() = default;

  // Whether every trainer rank runs this plane: Init and each sync are then collectives
  // of the ranks' group (ranks other than 0 run SyncOtherRank). Otherwise only rank 0
  // does, and each other rank drains its source's one pass per sync.
  virtual bool AllRanks() const { return false; }
  virtual Status Init(const PlaneInit& init) = 0;
  // At the start of each sync, before its pass: whether the plane can run it (false: the
  // engine runs Init again first). `mine` is this rank's own verdict on the sync (the
  // source's metadata against Init's); an error fails the sync. On an AllRanks() plane
  // this is a collective of every rank, and every rank gets the same answer: an error on
  // any rank fails the sync on all of them, naming that rank, and any rank's plane being
  // down re-initializes all of them.
  virtual Result<bool> Ready(const Status& mine) = 0;
  virtual Status Prepare(SyncContext& sync) = 0;
  virtual Status BeforeStart(SyncContext&) { return Status::Ok(); }
  // Whether the plane calls SyncContext::reset_prefix_cache at a point of its own (delta:
  // inside its pause, before start); otherwise the engine calls it.
  virtual bool ResetsPrefixCache() const { return false; }
  virtual Status Transfer(SyncContext& sync, SessionDriver::Pending& update) = 0;
  // Returns the status to report: `cause`, or a server's own account of it. `update` is
  // null when the failure came before update_weights was posted.
  virtual Status Abort(const Status& cause, SessionDriver::Pending*) { return cause; }
  virtual Status AfterSession(SyncContext&, Status outcome) { return outcome; }
  // Phase timings a plane keeps of its own (delta), folded into the sync's stats.
  virtual void Account(SyncStats*) {}
  // Ranks other than 0 of an AllRanks() plane: this rank's part of one sync.
  virtual Result<SyncStats> SyncOtherRank(SyncContext&) { return Unimplemented("no part for this rank"); }
  // Whether the plane can run a sync for part of the fleet (TrainerEngine::SendWeightsTo);
  // the engine then runs Init again, with PlaneInit::live, whenever the set changes.
  virtual bool ServesPartOfFleet() const { return false; }
  virtual void Shutdown() = 0;
};

}  // namespace wsync
