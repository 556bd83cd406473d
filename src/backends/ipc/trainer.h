// The `ipc` backend's data plane, trainer side, for trainers colocated with their servers
// (same host on CPU; same GPUs on CUDA). The engine skeleton (src/engine) runs the
// session (start -> update -> finish, closing sessions on failure) and the sync's one
// pass over the source; this plane exports the staging and packs.
//
// Init() sizes ONE staging region from the metadata (num_buffers slots of max(bucket,
// largest tensor), capped at what the whole model needs), exports it once (protocol.h)
// and hands every server its reader numbers; the servers map it and keep it mapped.
// Each sync is ONE update_weights carrying the whole tensor list, while the plane packs
// chunk after chunk of the pass into the slots, publishing each through
// the region (region.h): the receivers copy chunk k out while chunk k+1 is packed. Every
// wait is bounded by timeout_seconds and watches the servers' HTTP replies, so a server
// that refuses or dies ends it at once with that server's message; a failed sync aborts
// the readers and ends the plane's session (the engine initializes it again for the next
// sync).
// Shutdown() (and destruction) releases the region: its staging pages are freed at once,
// even while a server still maps it. The only staging memory is the slots: no copy of the
// model stays resident.
//
// On a GPU (TrainerOptions::device cuda:N) the slots are device memory on that GPU,
// exported once per session (cuda_ipc, or cuda_fd) and listed under its "GPU-<uuid>"
// key; the control region stays in host shared memory. Each chunk is packed with ONE
// batched copy: for tensors inside the storage() their source offers on the trainer's
// GPU (source.h: one block holding every tensor at fixed offsets) the copy list of every
// (chunk, slot) is built once and reused while the block stays put; other tensors (host
// tensors, device tensors that may move between Next() calls) are copied tensor by
// tensor. In zero-copy mode the trainer packs nothing: it exports the source's storage
// block once per session (again whenever the block changes, under a new generation
// number) with the mechanism its memory takes (device_plane.h: the cudaMalloc allocation
// around it through CUDA IPC, a cuMemCreate one through its POSIX fd, at the block's
// offset inside it), and a sync is one "go" after which every receiver copies straight
// from the trainer's tensors (see protocol.h). The tensors' offsets inside the block
// come from the sync's own pass, read before the update is planned. Mode zero_copy
// sends every sync so, and fails one whose source offers no storage on the trainer's GPU
// or yields a tensor outside it, naming the tensor. Mode auto sends zero-copy once a
// pass (a packed sync reads every tensor anyway) has shown that the source's current
// block holds every tensor, and packs until then or when it does not. The caller's
// writes to the tensors must be complete when SendWeights is called; the trainer
// synchronizes its device before the go.
//
// Several trainer ranks (TrainerOptions::comm, the ranks' group; see
// docs/protocol_ipc.md): Init is a collective of every rank. The lowest rank on each GPU
// is a publisher: it opens rank 0's control region by path, exports slots of its own on
// its GPU (same count and size), and rank 0 sends the merged `buffers` map; each sync,
// every publisher packs every chunk into its own slots for the workers on its GPU
// (waiting for rank 0's announcement of the sync, then for its own readers'
// acknowledgements), with no collective and no HTTP per chunk. A rank that fails a sync
// aborts it for every rank and reader; all ranks then need Init again (together: one rank
// cannot rejoin the others' collectives alone). Each sync starts with one small
// all-gather before the pass: a rank without a session fails the sync on every rank
// before anything moves, and with several publishers each offers the export of its
// source's storage and where its tensors lie in it (kAuto: as its last pass showed,
// checked as this pass streams; kZeroCopy: every rank reads its pass before the
// all-gather): the sync is zero-copy (each publisher sends the go for its GPU's
// workers, who copy from that rank's tensors) when all offered the same layout,
// otherwise kAuto packs and kZeroCopy fails it on every rank. Without `comm` (or a group of one),
// and for ranks that publish nothing (a GPU a lower rank serves; every rank but 0 of a CPU
// trainer, whose shm slots serve the host), ranks other than 0 only drain their source's
// one pass per sync (it may be a collective) and return.
//
// The plane (trainer.cc) composes one class per job: the region session (session.h), the
// ranks' group (rank_group.h), the zero-copy exports and layouts (zero_copy_plan.h), rank
// 0's sync under way (sync_plan.h) and the packing (packer.h).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "backends/ipc/region.h"
#include "wsync/trainer.h"

namespace wsync {

// Knobs of the ipc trainer that TrainerOptions does not carry; TrainerOptions::
// backend_options sets them as mode=auto|packed|zero_copy, export_kind=cuda_ipc|cuda_fd,
// backing=memfd|posix_shm and stall_after_chunks=N.
struct IpcTrainerOptions {
  ShmBacking backing = ShmBacking::kMemfd;
  // GPU trainers: how the staging slots are exported, "cuda_ipc" (cudaMalloc + CUDA IPC
  // handle) or "cuda_fd" (cuMem* with a POSIX fd; receivers need ptrace rights over the
  // trainer to take it).
  std::string export_kind = "cuda_ipc";
  // GPU trainers: kAuto sends zero-copy once a pass has shown that the storage() the
  // source offers on the trainer's device holds every tensor, and packs otherwise (it
  // exports staging slots either way); kPacked always packs; kZeroCopy exports no slots
  // (no staging memory at all) and refuses sources without such storage.
  enum class Mode { kAuto, kPacked, kZeroCopy };
  Mode mode = Mode::kAuto;
  // Fault injection for tests: after publishing this many chunks (counted over the
  // engine's life), stop and sleep until killed, as a trainer wedged mid-sync.
  std::optional<size_t> stall_after_chunks;
};

Result<IpcTrainerOptions> ParseIpcTrainerOptions(const std::map<std::string, std::string>& values);

Result<std::unique_ptr<TrainerEngine>> CreateIpcTrainer(const TrainerOptions& options);
Result<std::unique_ptr<TrainerEngine>> CreateIpcTrainerWith(const TrainerOptions& options,
                                                            const IpcTrainerOptions& ipc);

}  // namespace wsync
