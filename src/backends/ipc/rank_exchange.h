// Strings over a Communicator, for the few messages trainer ranks exchange when an ipc
// session starts (device keys, the region rank 0 created, each rank's staging
// descriptor, the outcome) and once at the start of each sync (each rank's state and
// zero-copy offer). Collective: every rank of `comm` calls the same function in the same
// order. Each is two collectives (the lengths, then the bytes); never used per chunk.
// Errors are the communicator's (see communicator.h), with context.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync {

// Every rank's `mine`, in rank order, on every rank.
Result<std::vector<std::string>> AllGatherStrings(Communicator& comm, const std::string& mine, Deadline deadline);

// Rank `root`'s `mine` on every rank (other ranks' `mine` is ignored).
Result<std::string> BroadcastString(Communicator& comm, const std::string& mine, int root, Deadline deadline);

}  // namespace wsync
