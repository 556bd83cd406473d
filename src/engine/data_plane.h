// DataPlane: what a backend implements; the trainer engine (engine.h) does the rest.
//
// The engine owns the session with the servers (start -> update_weights in the
// background -> data plane -> finish, closing sessions on failure), the source checks,
// the one pass per sync (SyncPass), the timings, the weight version and the ranks that
// send nothing. A backend supplies only how bytes move, through the few steps every
// plane has:
//
//   Init       build the plane for the fleet (its group, its shared memory, its sync
//              directory) and send every server its init_info through the driver;
//   Ready      at the start of each sync: whether the plane can run it;
//   Prepare    before the session: plan this sync (bytes, chunks) and the update_weights
//              body; nothing reaches the servers;
//   Transfer   move the sync's one checked pass while update_weights is in flight;
//   Abort      the sync failed (in Prepare or later): stop the plane's side of it;
//   Shutdown   release everything.
//
// Everything else about how a plane's session runs is data: the SessionShape the plane
// returns once (Shape()), which the engine reads when it is built and follows for every
// sync: whether every trainer rank runs the plane, whether it can serve part of the
// fleet, whether there is a transfer phase, where the prefix caches are reset, and the
// optional steps before start and after the session (delta publishes, fetches and pauses
// before start and resumes after).
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
  // The held names this rank holds only rows of (WeightSource::HeldRowRanges); null: none.
  const std::vector<HeldRows>* held_rows = nullptr;
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
  // did. The engine calls it where SessionShape::prefix_cache_reset says.
  std::function<Status()> reset_prefix_cache = [] { return Status::Ok(); };
};

// Where the engine resets the prefix caches of the servers that keep one
// (SyncContext::reset_prefix_cache).
enum class PrefixCacheReset {
  // After the new weights have landed and before finish: no entry computed with the old
  // weights can enter a cache between the reset and finish (a server serves nothing
  // while a session is open), and from finish on every prefix uses the new version.
  kBeforeFinish,
  // Right after SessionShape::before_start succeeded, before start: the plane's own
  // pause holds generation from there to the end of the session (delta, SkyRL's order).
  kBeforeStart,
};

// How a plane's session runs; DataPlane::Shape() returns it once and the engine follows
// it for every sync. The steps capture the plane and are called from the engine's
// thread, like the plane's virtuals.
struct SessionShape {
  // Ranks other than 0 of a plane that every trainer rank runs: this rank's part of one
  // sync. Set: Init and each sync are collectives of the ranks' group (rank 0 runs the
  // session, the others this). Null: only rank 0 runs the plane, and each other rank
  // drains its source's one pass per sync.
  std::function<Result<SyncStats>(SyncContext&)> other_rank_sync;
  // Whether the plane can run a sync for part of the fleet (TrainerEngine::SendWeightsTo);
  // the engine then runs Init again, with PlaneInit::live, whenever the set changes.
  bool serves_part_of_fleet = false;
  // Whether bytes move while update_weights is in flight (DataPlane::Transfer). False:
  // update_weights carries the whole update (delta's servers reload what they fetched)
  // and the engine only waits for its answers.
  bool transfer = true;
  PrefixCacheReset prefix_cache_reset = PrefixCacheReset::kBeforeFinish;
  // Optional: work between Prepare and start_weight_update (delta fetches and pauses
  // here). A failure aborts the plane (Abort without an update) and starts nothing.
  std::function<Status(SyncContext&)> before_start;
  // Optional: always runs after before_start ran (delta resumes here), with the sync's
  // outcome so far; returns the outcome to report.
  std::function<Status(SyncContext&, Status outcome)> after_session;
  // Optional: after a successful sync, folds phase timings the plane keeps of its own
  // into the sync's stats (their seconds already set).
  std::function<void(SyncStats*)> account;

  bool all_ranks() const { return static_cast<bool>(other_rank_sync); }
};

class DataPlane {
 public:
  virtual ~DataPlane() = default;

  // The plane's session shape; the engine asks once, when it is built.
  virtual SessionShape Shape() = 0;
  virtual Status Init(const PlaneInit& init) = 0;
  // At the start of each sync, before its pass: whether the plane can run it (false: the
  // engine runs Init again first). `mine` is this rank's own verdict on the sync (the
  // source's metadata against Init's); an error fails the sync. On a plane every rank
  // runs this is a collective of every rank, and every rank gets the same answer: an
  // error on any rank fails the sync on all of them, naming that rank, and any rank's
  // plane being down re-initializes all of them.
  virtual Result<bool> Ready(const Status& mine) = 0;
  virtual Status Prepare(SyncContext& sync) = 0;
  // Only when SessionShape::transfer is set.
  virtual Status Transfer(SyncContext&, SessionDriver::Pending&) {
    return Internal("this data plane has no transfer phase");
  }
  // Returns the status to report: `cause`, or a server's own account of it. `update` is
  // null when the failure came before update_weights was posted.
  virtual Status Abort(const Status& cause, SessionDriver::Pending* update) = 0;
  virtual void Shutdown() = 0;
};

}  // namespace wsync
