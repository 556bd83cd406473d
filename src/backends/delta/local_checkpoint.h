// LocalCheckpoint: one host's mutable copy of the model checkpoint, advanced along a
// delta chain (the receiver half of the `delta` data plane; SkyRL's LocalCheckpointStore,
// reference/skyrl_weight_sync.md §5.2, with the same on-disk layout):
//
//   <root>/weights/                          copy of the base (reflink where possible),
//                                            made at the first non-empty delta
//   <root>/.skyrl_weight_sync/state.json     {"version", "write_in_progress",
//                                             "target_version", "base_model_path",
//                                             "sync_dir" (wsync)}
//   <root>/.skyrl_weight_sync/writer.lock    flock: writers exclusive, reloads shared
//
// Where files come from: `base_checkpoint` and `root` are the server's own (its flags);
// the sync directory a fetch names is confined below `sync_root` when one is set (the
// receiver always sets it: requests name sync dirs), and everything read from a sync
// directory is opened beneath it (ConfinedDir: no symlink out, regular files only, size
// limits). Nothing outside `root` is ever written or deleted.
//
// Fetch(target) runs under the exclusive lock, so of all the workers and processes of a
// host that share `root`, the first applies and the rest find the work done. It resets
// from the base when the state is missing, says write_in_progress (a crash or a checksum
// failure mid-apply), or names another sync directory (a new chain); refuses a target
// behind the local version; otherwise marks write_in_progress and replays every version
// from local+1 to target: manifest.version == v and base_version == the local version
// are checked, payload files are mapped from the sync directory, and each patch is XORed
// into the memory-mapped weights in place and its checksum verified, on `threads`
// threads. Only when every version verified does the state say `version = target`.
// A full version (a manifest with base_digest over base_version 0, base_digest.h) is
// checked against the base's own digests before anything is touched: when every record's
// checksum is its base tensor's digest the version leaves the base as it is and nothing
// is applied (nor copied); otherwise the fetch fails (FailedPrecondition) naming both
// bases' digests, the differing tensors and the fix.
// The weights' mappings are kept between fetches; a file found replaced at its path
// (a reset here or by another process of the host) is mapped again.
//
// Thread-safety: a LocalCheckpoint is used by one thread at a time; give each worker its
// own instance (each holds its own lock descriptor), which is what makes the flock
// exclude threads of one process too. Every wait (the lock) has a deadline.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backends/delta/base_digest.h"
#include "backends/delta/manifest.h"
#include "backends/delta/payload_file.h"
#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync::delta {

struct LocalCheckpointOptions {
  std::string base_checkpoint;  // version 0 (read-only; never modified)
  std::string root;             // the local checkpoint directory
  // Where sync dirs may lie: Fetch() refuses one that is not below it (after symlinks
  // are resolved). Empty: the caller vouches for the sync dir (library use, tests, bench).
  std::string sync_root;
  size_t threads = 0;           // apply threads; 0: every core
  // The base's digests, computed at the first use; a server shares one among its
  // workers' instances. Null: Open() makes one of its own.
  std::shared_ptr<BaseDigests> base_digests;
  // Test seam: called on an apply thread after each tensor is patched and verified
  // (crash-recovery tests end the process here).
  std::function<void(std::string_view tensor)> after_tensor_applied;
};

struct CheckpointState {
  int64_t version = 0;
  bool write_in_progress = false;
  std::optional<int64_t> target_version;
  std::string base_model_path;
  std::string sync_dir;  // the chain the version belongs to; "" before any fetch
};

struct FetchReport {
  int64_t from_version = 0;   // the local version found (after any reset)
  int64_t to_version = 0;
  bool applied = false;       // this call replayed at least one version
  bool reset = false;         // this call rebuilt from the base
  std::string reset_reason;   // why, when reset
  int versions = 0;           // versions replayed by this call
  size_t tensors = 0;         // patches applied
  size_t skipped = 0;         // records naming tensors the checkpoint lacks
  uint64_t tensor_bytes = 0;  // bytes of the patched tensors
  uint64_t payload_bytes = 0; // compressed bytes read
  double lock_wait_seconds = 0;
  double reset_seconds = 0;   // copying the base into weights/
  double fetch_seconds = 0;   // reading manifests and payloads
  double apply_seconds = 0;   // decompress + XOR + verify
  double apply_cpu_seconds = 0;  // CPU time of the apply threads (all of them)
  size_t libzstd_frames = 0;  // patches SparseApplier declined, applied through libzstd
  // Bytes of tensors whose pages were mapped again before the apply because the kernel
  // had written them back (see WritableMapping::PrepareForWrite).
  uint64_t remapped_bytes = 0;
  double seconds = 0;
};

// Parses state.json. Every field is type- and range-checked (a version is a
// non-negative integer, write_in_progress a boolean, paths strings); anything else is
// DataLoss, never an exception. Missing fields take CheckpointState's defaults.
Result<CheckpointState> ParseCheckpointState(std::string_view text);

class LocalCheckpoint {
 public:
  // Creates `root` and its state (version 0) if missing. InvalidArgument when the base
  // checkpoint has no safetensors files.
  static Result<std::unique_ptr<LocalCheckpoint>> Open(LocalCheckpointOptions options, Deadline deadline);
  ~LocalCheckpoint();

  // Brings the local checkpoint to `target` from `sync_dir` (see above). Errors name the
  // version, the file and the tensor: NotFound for an unpublished version,
  // FailedPrecondition for a target behind the local version or a manifest whose
  // version / base_version break the chain, DataLoss for a corrupt payload or a checksum
  // mismatch (the state keeps write_in_progress: the next fetch starts from the base).
  // A sync_dir outside options().sync_root is InvalidArgument, refused before anything
  // is touched.
  Result<FetchReport> Fetch(int64_t target, const std::string& sync_dir, Deadline deadline);

  // The state as on disk (no lock: the file is replaced atomically); DataLoss when it is
  // not a well-formed state (ParseCheckpointState), and then the next Fetch() resets.
  Result<CheckpointState> ReadState() const;
  // OK when the state is `target` and complete; FailedPrecondition otherwise, saying
  // what to call.
  Status ValidateReady(int64_t target) const;
  // The directory a reload reads: weights/ once a delta has landed, else the base.
  std::string CurrentDir() const;
  // Takes the lock shared, so that no fetch rewrites the files during a reload.
  Result<std::shared_ptr<void>> LockForReading(Deadline deadline) const;

  const LocalCheckpointOptions& options() const { return options_; }

 private:
  explicit LocalCheckpoint(LocalCheckpointOptions options);
  Status WriteState(const CheckpointState& state) const;
  Status ResetFromBase(const std::string& sync_dir);
  // The sync dir a fetch names, opened (below options_.sync_root when set), and the
  // name the state records for it.
  struct SyncDir;
  Result<SyncDir> OpenSyncDir(const std::string& sync_dir) const;
  Status ApplyVersion(int64_t version, const SyncDir& sync, FetchReport* report);
  // Checks a full version against the base (see above); true when it changes nothing.
  Result<bool> CheckFullVersion(const DeltaManifest& m, const std::string& dir, const std::string& sync_dir) const;

  LocalCheckpointOptions options_;
  uint64_t base_bytes_ = 0;  // tensor bytes of the base: bounds what a version may make us read
  // What a version's payload files are read into, kept from one version to the next.
  std::vector<PayloadBuffer> payload_buffers_;
  std::string weights_dir_, state_dir_, state_path_, lock_path_;
  struct Applier;
  std::unique_ptr<Applier> applier_;  // threads and codecs, made at the first apply
};

}  // namespace wsync::delta
