// IpcPacker: how the ipc trainer moves one sync's bytes through its session's slots.
//
// A packed sync copies the pass's tensors chunk by chunk into the session's staging
// slots (host memory: tensor by tensor, on several threads for large tensors, hashing
// them for in-line verification; GPU: one cached batched copy per (chunk, slot) for the
// tensors inside the storage their source offers, tensor by tensor for the others) and
// publishes each chunk once its slot is free. A zero-copy sync is one go once the device
// is idle. The packer owns the batched-copy cache and the count of chunks published over
// the engine's life (the stall_after_chunks fault). Not thread-safe: the plane's thread.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>

#include "backends/ipc/device_plane.h"
#include "backends/ipc/protocol.h"
#include "backends/ipc/session.h"
#include "backends/ipc/storage_layout.h"
#include "backends/ipc/trainer.h"
#include "backends/ipc/zero_copy_plan.h"
#include "engine/sync_pass.h"

namespace wsync {

class IpcPacker {
 public:
  // Both are kept by reference and must outlive the packer.
  IpcPacker(const TrainerOptions& options, const IpcTrainerOptions& ipc) : options_(options), ipc_(ipc) {}

  // Packs and publishes every chunk of `u` (planned as `plan`) from `pass` through
  // `session`: chunk k goes into slot (first_seq + k) % num_slots once every reader is
  // done with what that slot held before. The tensors inside the storage the source
  // offers on the trainer's GPU go in the batched copies, and `zero_copy` learns where
  // they lie. Ends the pass: a source that yields more than its metadata fails the sync
  // naming the extra tensor. `check` runs while it waits; every wait ends by `deadline`.
  Status Pack(IpcSession& session, SyncPass& pass, const IpcPlan& plan, const IpcUpdateInfo& u,
              ZeroCopyPlanner& zero_copy, PassDigests* digests, const std::function<Status()>& check,
              Deadline deadline);
  // The one hand-off of a zero-copy sync on this rank's GPU: once the device is idle (the
  // tensors are final), publish the go on this rank's line; its readers copy `bytes` and
  // acknowledge it.
  Status Go(IpcSession& session, const IpcUpdateInfo& u, uint64_t bytes, const std::function<Status()>& check,
            Deadline deadline);
  // Drops the batched copies (they name a session's slots).
  void Clear() { pack_cache_.Clear(); }

 private:
  Status PackDevice(IpcSession& session, TensorStream& stream, const std::optional<SourceStorage>& storage,
                    StorageLayoutRecorder& learn, const std::vector<TensorMeta>& meta, const IpcPlan& plan,
                    size_t k, int slot, SyncProgress& p);
  // Counts a published chunk; the stall_after_chunks fault stops here.
  void Published();
  [[noreturn]] void Stall();

  const TrainerOptions& options_;
  const IpcTrainerOptions& ipc_;
  DeviceCopyCache pack_cache_;  // GPU: one batched copy per (chunk, slot)
  size_t chunks_published_ = 0;
};

}  // namespace wsync
