// IpcRegion: the shared-memory control region of one `ipc` session, and on a CPU host
// its staging slots too. Both halves map the same file; the trainer creates it, each
// receiving server opens it by path at init and keeps it mapped across syncs.
//
// Layout (every multi-byte word naturally aligned; hand-off words on their own cache
// lines; accessed only through std::atomic_ref):
//
//   [0, 4096)              header: magic "WSYNCIPC", layout version, session id, slot
//                          count/size/stride, reader and publisher counts, trainer pid;
//                          publish futex, ack futex, aborted sync + reason, the announced
//                          sync {sync, first seq}
//   [4096, 4096 + 320 P)   one line per publisher (a trainer rank that packs into slots of
//                          its own: rank 0 is publisher 0): per slot {seq, bytes} on its own
//                          cache line, then {pid}; its liveness lock covers the line's
//                          last byte
//   [.., .. + 64 R)        one line per reader (receiving worker): {acked seq, pid,
//                          publisher it reads}
//   [header_bytes, ...)    publisher 0's slot k at header_bytes + k * slot_stride (kind
//                          "shm" only); header_bytes and slot_stride are multiples of 2 MiB
//
// Hand-off (P writers, R readers, `num_slots`-deep rings; sequence numbers start at 1 and
// grow across the syncs of a session). Publisher p packs every chunk into ITS slots (on its
// own GPU); reader r reads the slots of the one publisher it attached to (its GPU's), so
// each (publisher, its readers) pair is the single-writer ring below, and the rings share
// the sequence numbers, the announcement and the abort word:
//   trainer  Announce(sync, first_seq) before it posts the sync's update_weights
//   reader   Announced() when the update arrives: which sync, and where its chunks start
//   pub. p>0 WaitAnnounced(sync): the first seq of the sync it is about to pack
//   pub. p   WaitAcked(seq - num_slots)   every reader OF p is done with the slot's old chunk
//            pack chunk into slot seq % num_slots
//            Publish(seq): p's slot.seq = seq (release), publish_futex++, FUTEX_WAKE
//   reader   WaitPublished(seq, publisher p): p's slot.seq == seq (acquire), else sleep on
//            publish_futex
//            copy out of the slot
//            Ack(reader, seq): acked = seq (release), ack_futex++, FUTEX_WAKE
// A reader never reads a slot before its own publisher has packed that chunk in it, and no
// publisher overwrites a slot before every reader of that slot has acknowledged what it
// held. No HTTP round trip per chunk: one update_weights call carries the whole tensor list.
//
// Faults: every wait takes a Deadline and sleeps on the futex at most 10 ms at a time so
// that it re-checks its exits. A trainer that fails a sync calls Abort(sync, reason) and
// its readers stop with that reason. A trainer that dies is seen through a lock: it holds
// flock(LOCK_EX) on the region for its whole life; a reader's LOCK_SH|LOCK_NB probe
// succeeds only once that process is gone (the kernel drops the lock with its last fd),
// which works across PID namespaces and needs no heartbeat. Any publisher may write the
// abort word (a rank that fails mid-sync stops every reader of that sync). Publishers
// p > 0 (other trainer ranks, OpenPublisher) hold an OFD write lock (F_OFD_SETLK) on the
// last byte of their line for their lives; a reader of p probes it (F_OFD_GETLK), so the
// death of the rank on its GPU ends its wait as fast as the trainer's does.
//
// Backing: a memfd (no name to leak when the trainer is SIGKILLed; receivers open
// /proc/PID/fd/N), sealed against shrinking and growing (F_SEAL_SHRINK|F_SEAL_GROW, then
// F_SEAL_SEAL) so that no receiver's mapping can turn into SIGBUS; or POSIX shm_open
// (receivers open /dev/shm/NAME, only where their IpcOpenPolicy allows that directory;
// the trainer unlinks the name once every server has mapped it, so a killed trainer leaks
// nothing after init). A receiver trusts nothing in the header beyond what Open checked
// and copied: the geometry lives in its members; the words read later (sequence numbers,
// the announcement, the abort reason) are only compared or bounded.
//
// Thread-safety: the hand-off calls are safe from any thread and process; Create/Open and
// destruction are not concurrent with anything else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "backends/ipc/protocol.h"
#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync {

enum class ShmBacking { kMemfd, kPosixShm };

// Where a receiver may open a control region from: the server's own flags decide, never
// the init_info (whose control_path is untrusted). A sealed memfd named
// /proc/<pid>/fd/<n> is always allowed; a POSIX shm file only directly inside `shm_dir`,
// named wsync-ipc-*, owned by this process's user. Such a file cannot be sealed: its
// mapping is guarded (sigbus_guard.h) and its size re-checked before every sync.
struct IpcOpenPolicy {
  std::string shm_dir;  // `wsync serve --ipc-shm-dir`, e.g. /dev/shm; empty: POSIX shm refused
};

class SigbusGuard;

struct IpcRegionOptions {
  std::string session;           // NewSessionId()
  int num_slots = kIpcDefaultSlots;
  uint64_t slot_bytes = 0;       // capacity of one slot
  int reader_count = 1;
  int publisher_count = 1;       // trainer ranks with slots of their own (see the layout)
  bool slots_in_region = true;   // false: the slots live elsewhere (GPU memory)
  ShmBacking backing = ShmBacking::kMemfd;
};

class IpcRegion {
 public:
  // Trainer: creates and sizes the file, writes the header, takes the liveness lock.
  static Result<std::unique_ptr<IpcRegion>> Create(const IpcRegionOptions& options);
  // Receiver: opens `info.control_path` as `policy` allows (see IpcOpenPolicy), maps it
  // and checks that it is the region the init_info describes (magic, layout, session,
  // slots, readers, size), every size sum overflow-checked. InvalidArgument naming the
  // path and what differs: "not a wsync ipc region", "header slot_stride ... overflows";
  // until the file proves to be a wsync region, one message for every refusal (it does
  // not tell whether a path exists, or its size).
  static Result<std::unique_ptr<IpcRegion>> Open(const IpcInitInfo& info, const IpcOpenPolicy& policy = {});
  // Trainer rank that is publisher `publisher` (>= 1) of the region `path` that rank 0
  // created on this host for `session`: opens and checks it as Open does, records this
  // process's pid in the publisher's line and takes its liveness lock. Publish and
  // WaitAcked then act on this publisher's slot words and readers.
  static Result<std::unique_ptr<IpcRegion>> OpenPublisher(const std::string& path, const std::string& session,
                                                          int publisher);
  ~IpcRegion();
  IpcRegion(const IpcRegion&) = delete;
  IpcRegion& operator=(const IpcRegion&) = delete;

  const std::string& path() const { return path_; }  // what receivers open
  uint64_t bytes() const { return bytes_; }
  const std::string& session() const { return session_; }
  int num_slots() const { return num_slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t slot_stride() const { return slot_stride_; }
  uint64_t header_bytes() const { return header_bytes_; }
  int reader_count() const { return reader_count_; }
  int publisher_count() const { return publisher_count_; }
  int publisher() const { return publisher_; }  // 0: the creator; OpenPublisher's index
  bool owner() const { return owner_; }
  // The staging bytes of slot `k` (kind "shm"); empty when the slots live elsewhere.
  std::span<std::byte> slot(int k);
  // This region's own staging slots as an init_info buffer entry (kind "shm").
  IpcBufferDesc ShmBuffer() const;

  // ---- trainer -------------------------------------------------------------------
  // POSIX shm: removes the name (mapped regions stay); no-op for a memfd.
  void UnlinkName();
  // Names the sync about to start and the sequence number of its first chunk. Called
  // before the sync's update_weights is posted, never while a sync is under way.
  void Announce(uint64_t sync, uint64_t first_seq);
  // Makes chunk `seq` in this publisher's slot seq % num_slots visible to its readers and
  // wakes them.
  void Publish(uint64_t seq, uint64_t bytes);
  // Waits until every reader of this publisher (those that attached to it; one not yet
  // attached counts as publisher 0's) has acknowledged `seq` (seq 0: returns at once). `check`
  // runs between sleeps; its error ends the wait. `describe_reader(r)` names reader r in
  // the DeadlineExceeded message.
  Status WaitAcked(uint64_t seq, Deadline deadline, const std::function<Status()>& check,
                   const std::function<std::string(int)>& describe_reader);
  // Whether any reader attached to this publisher.
  bool HasReaders() const;
  // Tells the readers of `sync` to stop with `reason`, and wakes them (any publisher).
  void Abort(uint64_t sync, std::string_view reason);
  // The reason `sync` was aborted, when it was.
  std::optional<std::string> AbortedReason(uint64_t sync) const;
  // Publishers p > 0: waits until the trainer announces `sync` (returns its first seq).
  // Aborted when `sync` was aborted, Unavailable when the trainer exited,
  // DeadlineExceeded at the deadline, FailedPrecondition when a later sync was announced.
  Result<uint64_t> WaitAnnounced(uint64_t sync, Deadline deadline);
  // False once publisher `p` (p > 0: the process holding its lock; 0: the trainer) exited.
  bool PublisherAlive(int p);
  uint64_t acked(int reader) const;
  // The pid a receiver recorded with Attach(), 0 before.
  uint32_t reader_pid(int reader) const;

  // ---- receiver ------------------------------------------------------------------
  struct Announcement {
    uint64_t sync = 0;       // 0: nothing announced yet
    uint64_t first_seq = 0;
  };
  // What the trainer last announced (a consistent pair; {0, 0} when the words keep
  // changing while read).
  Announcement Announced() const;
  // Records `pid` and the publisher whose slots it reads in the reader's line (for the
  // publisher's WaitAcked and the trainer's messages).
  void Attach(int reader, uint32_t pid, int publisher = 0);
  int reader_publisher(int reader) const;
  // Waits until `publisher`'s slot seq % num_slots carries `seq`. Aborted when a trainer
  // rank abandoned `sync`; Unavailable when the trainer or that publisher exited; DataLoss
  // when the slot already carries a later chunk (a reader that fell out of the ring);
  // DeadlineExceeded at the deadline. `what` names the wait in messages ("chunk 3/9 of
  // sync 2").
  Status WaitPublished(uint64_t seq, uint64_t sync, Deadline deadline, std::string_view what, int publisher = 0);
  void Ack(int reader, uint64_t seq);
  // False once the process that created the region has exited.
  bool TrainerAlive();
  // DataLoss when the mapped file shrank below the mapping (possible only for an unsealed
  // POSIX shm file, IpcOpenPolicy): a receiver calls it before each sync and after
  // reading a chunk, and drops the region on error. Ok for sealed regions and the trainer.
  Status CheckStillMapped() const;
  // Whether the region's size is pinned by seals (F_SEAL_SHRINK|F_SEAL_GROW).
  bool sealed() const { return sealed_; }
  uint32_t trainer_pid() const;

 private:
  IpcRegion() = default;
  struct Header;
  Header* header() const;
  uint64_t* slot_seq(int publisher, int k) const;
  uint64_t* slot_bytes_word(int publisher, int k) const;
  uint32_t* publisher_pid(int publisher) const;
  uint64_t publisher_lock_byte(int publisher) const;
  uint64_t* reader_acked(int r) const;
  uint64_t readers_begin() const;
  struct Opened {
    int fd = -1;
    bool sealed = false;
  };
  static Result<Opened> OpenControl(const std::string& path, const IpcOpenPolicy& policy);
  static Result<std::unique_ptr<IpcRegion>> Map(const std::string& path, const std::string& session,
                                                const IpcOpenPolicy& policy);
  // Sleeps until *word != seen, a wake-up, or at most `max_wait`.
  static void FutexWait(uint32_t* word, uint32_t seen, std::chrono::microseconds max_wait);
  static void FutexBump(uint32_t* word);

  int fd_ = -1;
  std::byte* base_ = nullptr;
  uint64_t bytes_ = 0;
  std::string path_;
  std::string shm_name_;  // POSIX shm name until unlinked
  std::string session_;
  int num_slots_ = 0;
  uint64_t slot_bytes_ = 0, slot_stride_ = 0, header_bytes_ = 0;
  int reader_count_ = 0;
  int publisher_count_ = 1;
  int publisher_ = 0;
  bool owner_ = false;
  bool slots_in_region_ = true;
  bool sealed_ = true;                  // false: an unsealed file, mapped under guard_
  std::unique_ptr<SigbusGuard> guard_;
};

}  // namespace wsync
