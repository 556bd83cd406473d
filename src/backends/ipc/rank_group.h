// IpcRankGroup: the ipc trainer's ranks when TrainerOptions::comm has several
// (docs/protocol_ipc.md): who publishes, the collective Init, and the exchange that
// starts every sync.
//
// Init is a fixed sequence of collectives that every rank runs whatever fails, so that a
// failure anywhere ends every rank's Init with the same error instead of a hang:
//   1. all-gather each rank's device key; every rank derives the same publishers (the
//      lowest rank on each GPU; only rank 0 on a CPU trainer, whose shm slots serve the
//      host);
//   2. rank 0 queries the servers, creates the region (one line per publisher) and its
//      own slots, and broadcasts the region's path and session;
//   3. every other publisher opens the region by path, allocates and exports its slots
//      on its GPU (same count and stride); all-gather of the descriptors;
//   4. rank 0 sends the merged `buffers` to the servers and broadcasts the outcome.
// Each sync starts with Ready (a rank without a session, or with an error, ends the sync
// on every rank) and Exchange (one small all-gather before anything moves; with several
// publishers that may send zero-copy, each offers its tensors' export and layout).
// It owns this rank's place (its publisher line, or none) and whether its session is up;
// the session itself is an IpcSession, the exports a ZeroCopyPlanner. Not thread-safe:
// the plane's thread.
#pragma once

#include <map>
#include <string>

#include "backends/ipc/protocol.h"
#include "backends/ipc/session.h"
#include "backends/ipc/trainer.h"
#include "backends/ipc/zero_copy_plan.h"
#include "comm/communicator.h"
#include "engine/data_plane.h"
#include "engine/sync_pass.h"

namespace wsync {

// What the ranks of a group agree on before each sync.
struct GroupSync {
  bool zero_copy = false;
  std::map<std::string, IpcBufferDesc> buffers;  // zero-copy: every publisher's tensors
};

class IpcRankGroup {
 public:
  // Both are kept by reference and must outlive the group.
  IpcRankGroup(const TrainerOptions& options, const IpcTrainerOptions& ipc) : options_(options), ipc_(ipc) {}

  // Whether the trainer has several ranks (then every rank runs the plane).
  bool several() const { return options_.comm && options_.comm->size() > 1; }
  // Forgets the last Init: no group, rank 0 the only publisher.
  void Reset();
  // The collective Init of every rank (above); on success `session` is this rank's.
  Status Init(const PlaneInit& init, IpcSession& session);
  // Every rank answers together (one small all-gather): any rank's error in `mine` fails
  // the sync on every rank, naming it, and every rank initializes again when any lacks a
  // session.
  Result<bool> Ready(const Status& mine);
  // The exchange that starts every sync of a group, before the pass and before anything
  // reaches the servers (an all-gather of one small message per rank; every rank calls
  // it, whatever failed). `mine` is this rank's state: an error on any rank (no session)
  // fails the sync on every rank at once, naming that rank, where the others would
  // otherwise wait for a sync that never comes. With several publishers that may send
  // zero-copy, each publisher with readers offers its tensors' export and layout; the
  // sync is zero-copy when every one offers the same layout, and every rank starts a new
  // generation when any export changed, so all derive the same decision from the same
  // messages.
  Result<GroupSync> Exchange(SyncPass& pass, Status mine, const IpcSession& session, ZeroCopyPlanner& zero_copy);
  // A group in mode zero_copy: every rank reads its pass before the exchange
  // (ZeroCopyPlanner::ReadPassFirst); otherwise nothing.
  Status ReadPassFirst(SyncPass& pass, const IpcSession& session, ZeroCopyPlanner& zero_copy) const;

  // Init of several ranks succeeded: every sync starts with the exchange, until the
  // next Init.
  bool active() const { return active_; }
  // ...in which every publisher may offer its own tensors.
  bool zero_copy() const { return zero_copy_; }
  // This rank's line in the region; -1: packs nothing (drains).
  int publisher() const { return publisher_; }
  // A rank of a group: Init succeeded and no failed sync ended the session since.
  bool up() const { return up_; }
  void set_down() { up_ = false; }

 private:
  // The ranks' group as a communicator (every group wsync builds is one).
  Result<Communicator*> RankComm() const;

  const TrainerOptions& options_;
  const IpcTrainerOptions& ipc_;
  bool active_ = false;
  bool zero_copy_ = false;
  int publisher_ = 0;
  bool up_ = false;
};

}  // namespace wsync
