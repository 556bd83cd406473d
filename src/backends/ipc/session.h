// IpcSession: one ipc session of one trainer rank, the region it publishes through.
//
// It owns the control region (rank 0 creates it, another publisher opens its own line of
// it by path), this rank's staging slots (GPU: device memory exported once per session;
// CPU: inside the region), the key of the device they live on, the labels of the readers
// (for messages) and the sequence numbers of the syncs and chunks this rank publishes.
// Rank 0 opens a session in two steps: Create() sets up the region and the init_info
// without telling the servers, Open() sends it to every server and keeps the region once
// every reader attached. A failed sync ends the session (Close); Init opens the next.
// Nothing here decides what a sync sends: the plane and its packer (packer.h) do.
// Not thread-safe: the plane's thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/ipc/device_plane.h"
#include "backends/ipc/protocol.h"
#include "backends/ipc/region.h"
#include "backends/ipc/trainer.h"
#include "control/session_driver.h"
#include "engine/data_plane.h"

namespace wsync {

class IpcSession {
 public:
  // What rank 0 sets up before the servers hear of it: the region, its own slots, and the
  // init_info (without the other publishers' buffers).
  struct Offer {
    std::unique_ptr<IpcRegion> region;
    std::unique_ptr<DeviceExport> staging;
    std::string device_key;
    IpcInitInfo info;
    std::vector<int> offsets;
  };

  // Both are kept by reference and must outlive the session.
  IpcSession(const TrainerOptions& options, const IpcTrainerOptions& ipc) : options_(options), ipc_(ipc) {}

  // Rank 0: sizes the region for `init.metadata` with one line per publisher, creates it
  // and this rank's slots, and learns the readers from the fleet's world sizes.
  Result<Offer> Create(const PlaneInit& init, int publishers);
  // Rank 0: sends `o.info` to every server through `driver`; the session is this rank's
  // once every reader attached.
  Status Open(Offer o, const SessionDriver& driver);
  // Another rank of a group: the region line it opened (null: it publishes nothing) and
  // its slots.
  void Join(std::unique_ptr<IpcRegion> region, std::unique_ptr<DeviceExport> staging, std::string device_key);
  // Ends the session: the region and the slots are released at once.
  void Close();

  IpcRegion* region() const { return region_.get(); }
  DeviceExport* staging() const { return staging_.get(); }  // GPU packed modes; else null
  const std::string& device_key() const { return device_key_; }
  // Publishers p > 0: whether any worker reads this rank's slots or tensors.
  bool has_readers() const { return has_readers_; }

  // The next sync's id (counted per session).
  uint64_t NextSync() { return ++sync_; }
  uint64_t sync() const { return sync_; }
  // Rank 0: the sequence number of the next sync's first chunk; Advance() moves it past a
  // sync that published `chunks`.
  uint64_t next_seq() const { return next_seq_; }
  void Advance(size_t chunks) { next_seq_ += chunks; }

  // Waits until the slot chunk `seq` goes into is free: every reader acknowledged the
  // chunk it held before. `check` runs between sleeps; its error ends the wait.
  Status WaitSlotFree(uint64_t seq, Deadline deadline, const std::function<Status()>& check) const;
  // Publishes chunk `seq` (`bytes` of payload) on this rank's line.
  void Publish(uint64_t seq, uint64_t bytes);

  // Before a failed sync frees the slots (or lets the caller write its tensors again),
  // for at most 2 s: no reader may still be copying from them. Rank 0 waits for every
  // server's answer to update_weights `http` (a server answers once all its workers
  // stopped); other publishers (`http` null) wait until their readers acknowledged every
  // chunk published (after an abort a reader still lands, and acknowledges, every chunk
  // already published, then stops); a reader that died or stopped for its own reason
  // ends this only at the bound.
  void Quiesce(SessionDriver::Pending* http) const;

  // Rank 0's exits while it waits for acknowledgements: a server that answered
  // update_weights `http` early, and with several publishers another rank that abandoned
  // `sync`.
  std::function<Status()> SenderCheck(SessionDriver::Pending& http, uint64_t sync) const;
  // Publishers p > 0 stop when another rank abandoned `sync` or rank 0 ended its session
  // (a lock probe, a system call: at most every 10 ms, as readers probe).
  std::function<Status()> PeerCheck(uint64_t sync) const;
  // Names reader r in messages (the worker it is).
  std::function<std::string(int)> ReaderDescriber() const;

 private:
  const TrainerOptions& options_;
  const IpcTrainerOptions& ipc_;
  std::unique_ptr<IpcRegion> region_;
  std::unique_ptr<DeviceExport> staging_;
  std::string device_key_;  // where this rank's buffers live
  std::vector<std::string> reader_labels_;
  bool has_readers_ = true;
  uint64_t next_seq_ = 1;
  uint64_t published_seq_ = 0;  // the last chunk this rank published in the session
  uint64_t sync_ = 0;
};

}  // namespace wsync
