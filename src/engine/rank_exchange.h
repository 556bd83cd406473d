// Strings over a Communicator, for the few messages trainer ranks exchange when a data
// plane starts (ipc: device keys, the region rank 0 created, staging descriptors; sharded:
// metadata digests, held names, the fleet's plan) and once at the start of each sync
// (each rank's state). Collective: every rank of `comm` calls the same function in the
// same order. Each is two collectives (the lengths, then the bytes); never used per chunk.
// Errors are the communicator's (see communicator.h), with context.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include <nlohmann/json.hpp>

#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync {

// Every rank's `mine`, in rank order, on every rank.
Result<std::vector<std::string>> AllGatherStrings(Communicator& comm, const std::string& mine, Deadline deadline);

// Rank `root`'s `mine` on every rank (other ranks' `mine` is ignored).
Result<std::string> BroadcastString(Communicator& comm, const std::string& mine, int root, Deadline deadline);

// A rank's failure as JSON ({"error": message, "code": code}), for the messages above, and
// back: the status another rank put on the wire, its message prefixed with `who` (none
// when empty).
nlohmann::json StatusToJson(const Status& s);
Status StatusFromJson(const nlohmann::json& j, const std::string& who);

// DataPlane::Ready of a plane every rank runs, as one all-gather: `mine` is this rank's
// verdict on the sync, `down` whether its plane needs Init again, `self` its rank (its
// own error goes unnamed). Every rank gets the same answer: the lowest rank's error,
// else whether no rank is down.
Result<bool> AllRanksReady(Communicator& comm, const Status& mine, bool down, int self, Deadline deadline);

}  // namespace wsync
