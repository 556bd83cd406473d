// RankOutcomes: how the ranks of a trainer learn each other's outcome of every sync, when
// their sources' collectives run outside wsync (a Python trainer's torch.distributed).
//
// Rank 0 serves a small rendezvous store (comm/store.h) on `store_host`:`store_port`;
// every rank reaches it there. Each sync is a round with a name every rank gives alike
// ("3/send", "3/verify"). Within a round:
//   Begin(round)        starts this rank's heartbeat (a key rewritten every second), so
//                       ranks waiting on it can tell a slow rank from a dead one.
//   Fail(round, cause)  posts this rank's failure at once, unless another rank's is
//                       already posted (then this failure is its consequence and the board
//                       keeps the root cause). Ranks waiting in End stop waiting at once.
//   End(round, mine)    posts this rank's outcome and returns the round's: a rank that
//                       failed returns at once (its own cause, or the root cause another
//                       rank posted before it, naming that rank); a rank that succeeded
//                       waits until every rank has posted an outcome (OK) or a failure is
//                       posted (that failure, naming its rank), or until a rank's
//                       heartbeat stays unchanged for `timeout_seconds` (DeadlineExceeded
//                       naming the rank). Heartbeats stop at End. Every rank but 0 then
//                       marks the round read.
//   ~RankOutcomes       a rank dropped between Begin and End posts that as its failure.
//                       Rank 0 keeps its store up until every other rank has read the
//                       last round (at most `timeout_seconds`, and less once the ranks yet
//                       to read it stop beating), so a rank 0 that fails, raises and shuts
//                       down at once does not take the root cause away from the others.
// One round at a time per object; not thread-safe (the heartbeat thread is internal).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "wsync/status.h"

namespace wsync {

struct RankOutcomesOptions {
  int rank = 0;
  int world_size = 1;
  std::string store_host = "127.0.0.1";  // where rank 0's store listens
  int store_port = 0;                    // rank 0: 0 picks a free port (port()); others: rank 0's
  double timeout_seconds = 300;          // how long a silent rank is waited for
};

class RankOutcomes {
 public:
  // Rank 0 starts its store here (kUnavailable when the address cannot be bound); other
  // ranks only remember where it is (they fail later, in Fail/End, if it never answers).
  static Result<std::unique_ptr<RankOutcomes>> Create(const RankOutcomesOptions& options);
  ~RankOutcomes();

  // The port rank 0's store listens on (other ranks: the one they were given).
  int port() const;

  void Begin(const std::string& round);
  void Fail(const std::string& round, const Status& cause);
  Status End(const std::string& round, const Status& mine);
  // The other ranks whose heartbeat for `round` stays absent or unchanged for `window`
  // seconds, ascending: after a connection to another rank failed, the ranks whose
  // process is gone. Blocks up to `window`, less once every other rank has beaten.
  std::vector<int> Silent(const std::string& round, double window);

 private:
  struct Impl;
  explicit RankOutcomes(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wsync
