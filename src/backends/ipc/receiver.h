// The `ipc` backend's receiving half: maps the trainer's staging region once per session
// and lands every chunk in the workers' shards straight from the shared slots.
//
// Init: parses the init_info (protocol.h), opens and checks the control region (a
// missing, foreign or garbage path is a 400; only what IpcOpenPolicy allows is opened: a
// sealed memfd, or a POSIX shm file in the directory ReceiverContext::backend_config
// "ipc_shm_dir" names, `wsync serve --ipc-shm-dir`), picks each worker's buffer entry (this
// host's key for CPU workers; a CUDA worker's own "GPU-<uuid>", or the host's slots when
// the trainer stages on this host's CPU; a missing key is a 400 naming the keys offered),
// opens a GPU's slots once on the thread of its first worker (a handle that does not open
// is a 400), and replaces any previous session's mapping only once the new one is good.
// CUDA workers land each chunk with one batched copy, built on the first sync of a layout
// and reused while the update's tensors and offsets stay the same; zero-copy updates map
// the trainer's own tensors once per generation and land the whole model in one batched
// copy after the trainer's go (protocol.h). Update: checks
// the update against the mapping (session, sizes, a chunk larger than the slots: 400;
// another session or an already consumed sequence: 409; an unsealed region that shrank
// since init: 500, and the session is released), then every worker, on its own
// thread, waits for chunk after chunk (region.h), loads its shards from the slot and
// acknowledges it. A trainer that exits or abandons the sync ends the wait at once; a
// mapping whose trainer has exited is released (by the next call, or within a second by a
// watcher thread), so a dead trainer's staging memory is never pinned. Shutdown releases
// everything, device mappings and copy plans included.
#pragma once

#include <memory>

#include "receiver/backend.h"

namespace wsync {

Result<std::unique_ptr<ReceiverBackend>> CreateIpcReceiver(ReceiverContext* context);

}  // namespace wsync
