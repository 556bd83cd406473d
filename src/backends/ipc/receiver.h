// The `ipc` backend's receiving half: maps the trainer's staging region once per session
// and lands every chunk in the workers' shards straight from the shared slots.
//
// Init: parses the init_info (protocol.h), picks the buffer entry of the workers' device
// (this host's key for CPU workers; a missing key is a 400 naming the keys offered), opens
// and checks the control region (a missing, foreign or garbage path is a 400), and
// replaces any previous session's mapping only once the new one is good. Update: checks
// the update against the mapping (session, sizes, a chunk larger than the slots: 400;
// another session or an already consumed sequence: 409), then every worker, on its own
// thread, waits for chunk after chunk (region.h), loads its shards from the slot and
// acknowledges it. A trainer that exits or abandons the sync ends the wait at once; a
// mapping whose trainer has exited is released (by the next call, or within a second by a
// watcher thread), so a dead trainer's staging memory is never pinned. Shutdown releases
// everything.
#pragma once

#include <memory>

#include "wsync/receiver.h"

namespace wsync {

Result<std::unique_ptr<ReceiverBackend>> CreateIpcReceiver(ReceiverContext* context);

}  // namespace wsync
