// DeltaPublisher: the trainer half of the `delta` backend's data plane. Each Publish()
// drains one pass of a WeightSource and writes the next version of the chain into the
// sync directory (layout: manifest.h): per tensor, the XOR of the new bytes against the
// previous version's bytes (the "snapshot") in the checkpoint's on-disk dtype, one zstd
// frame per changed tensor, unchanged tensors omitted, the xxh3-128 of the new bytes as
// the checksum. Payload files roll over at `max_file_bytes`; manifest.json is written
// last, by atomic rename, so a reader that sees a manifest sees complete payloads.
//
// The snapshot is the trainer's own last published state on disk, not a copy in its
// heap: a TrainerStateFile (state_file.h) in `state_dir`, memory-mapped, which each
// tensor's encode reads and advances in place, mapped a few MiB ahead of the encode and
// dropped from the trainer's page tables behind it (a tensor encoded in parts: a part at
// a time). So the trainer holds its model once plus those windows, the frames and the
// staging buffers. Before a pass reads the file, its size
// and header are checked, and every tensor's snapshot bytes are hashed while they are
// XORed and compared with the digest this publisher recorded when it wrote them (for a
// tensor encoded in parts, per part): a file changed behind the publisher's back fails
// the publish with DataLoss naming the file and the tensor, before any manifest names
// the wrong patch, and every later Publish() fails too (start a new chain).
//
// Version 0 is the base checkpoint. With `base_checkpoint` set, the snapshot starts as
// its bytes (written into the state file at Create), tensors are cast to its on-disk
// dtype (bf16/f16/f32 among themselves) and checked against its shapes, and names it
// lacks are skipped with a warning, as SkyRL does. Without it, version 0 is the source's
// FIRST pass: the first Publish() copies it into the snapshot and publishes a "full
// version" 1 that changes nothing but names every byte: a record per tensor with an
// all-zero patch and the checksum of the first pass's bytes, and the manifest's
// base_digest (base_digest.h).
// That is right exactly when the trainer starts from the servers' base checkpoint
// (`wsync push --checkpoint BASE`, or synthetic weights written as the base); a server
// on any other base fails that version's checks instead of serving its own base.
// base_digest() is version 0's digest, for the init of wsync servers.
//
// The hot loops run on a pool of `threads` threads (DeltaCodec, one per thread): the
// calling thread iterates the source and stages each tensor (a copy into one of a few
// reusable buffers, or a dtype cast), a pool thread hashes, XORs, updates the snapshot
// and compresses it in one cache-blocked pass. Same-dtype tensors of a source whose
// TensorRefs stay valid for the whole pass (WeightSource::StableRefs: host tensors, a
// storage block, a checkpoint) are read in place instead of staged, unless
// `borrow_source_bytes` is off; a source of temporaries is always staged, as the
// TensorStream contract requires.
//
// A Publish() that fails (source error, disk full) restores the snapshot by XORing the
// already-encoded patches back and removes the partial version directory, so the next
// call publishes the same version again. Not thread-safe: one Publish() at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "backends/delta/manifest.h"
#include "core/deadline.h"
#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/trainer.h"

namespace wsync {
class TaskGroup;
}  // namespace wsync

namespace wsync::delta {

inline constexpr size_t kMinThreadsForParts = 4;

struct DeltaPublisherOptions {
  std::string sync_dir;             // required; created if missing
  std::string base_checkpoint;      // "" : version 0 is the first pass (see above)
  // Where the snapshot's state file lives (created if missing): the file is
  // `.wsync-trainer-rank<rank>.state`, as large as the model in on-disk dtypes, and is
  // rewritten in place every publish, so it belongs on the trainer's local disk, not in
  // a sync dir on NFS. "": DefaultTrainerStateDir(sync_dir).
  std::string state_dir;
  uint64_t max_file_bytes = uint64_t{1} << 30;  // payload files roll over past this (SkyRL: 1 GiB)
  size_t threads = 0;               // encode threads; 0: every core
  bool borrow_source_bytes = true;  // read a stable source's same-dtype tensors in place (see above)
  size_t staging_buffers = 0;       // reusable staging buffers of the largest tensor; 0: threads + 1
  int rank = 0;                     // trainer rank in payload file names
  // With at least kMinThreadsForParts threads, tensors of more than twice this many
  // bytes are encoded in parts of this size, each on any pool thread, and joined into
  // one frame (DeltaCodec::EncodePart), so that the largest tensor (an embedding: a
  // quarter of qwen3-0.6b) does not hold the publish on one thread. The frame depends on this
  // size only, not on how many threads (4 or more) there are. 0: never split.
  size_t part_bytes = size_t{16} << 20;
  // Called from the calling thread after each tensor is handed to the pool.
  std::function<void(const SyncProgress&)> progress;
};

struct PublishStats {
  int64_t version = 0;
  int64_t base_version = 0;
  size_t tensors = 0;             // tensors processed
  size_t changed_tensors = 0;     // records in the manifest
  bool full_version = false;      // a record for every tensor, all-zero patches (see above)
  size_t skipped_tensors = 0;     // absent from the base checkpoint
  uint64_t model_bytes = 0;       // bytes processed, in on-disk dtypes
  uint64_t changed_bytes = 0;     // nonzero bytes of all patches
  uint64_t uncompressed_bytes = 0;  // patch bytes of the records
  uint64_t compressed_bytes = 0;
  size_t payload_files = 0;
  size_t threads = 0;
  double seconds = 0;             // the whole Publish()
  double cpu_seconds = 0;         // CPU time of this process during Publish(), all threads
  double stage_seconds = 0;       // calling thread: source iteration and staging copies
  double encode_cpu_seconds = 0;  // wall time of the encode tasks, summed over pool threads
  double write_seconds = 0;       // payload files and manifest, fsynced
};

// $TMPDIR (else /tmp) / "wsync_delta_state" / NAME, where NAME is the sync dir's last
// path component with every byte outside [A-Za-z0-9._-] replaced by '_', "_" and the
// first 16 hex digits of the SHA-256 of the whole sync dir: one directory per chain on
// the trainer's own disk.
std::string DefaultTrainerStateDir(const std::string& sync_dir);

class DeltaPublisher {
 public:
  // `metadata` is the source's model (every pass must match it). Opens the base
  // checkpoint and fills the snapshot from it when one is given.
  static Result<std::unique_ptr<DeltaPublisher>> Create(DeltaPublisherOptions options,
                                                        const std::vector<TensorMeta>& metadata);
  ~DeltaPublisher();

  // Publishes version() + 1 and returns what it did.
  // `digests`, when given, receives {name: xxh3-128 hex} of every tensor the pass yielded
  // and published in its own dtype: the checksum its encoding takes of the new bytes
  // anyway (in-line verification costs the trainer nothing more). Tensors converted to
  // another on-disk dtype, or absent from the base, are left out.
  Result<PublishStats> Publish(WeightSource& source, std::map<std::string, std::string>* digests = nullptr);
  // Whether Publish()'s `digests` cover every tensor of a pass: none is converted to
  // another dtype or absent from the base.
  bool DigestsEveryTensor() const;

  int64_t version() const { return version_; }
  // The digest of version 0 (base_digest.h): over every tensor of the base checkpoint
  // (known from Create()), or without one over every tensor of the source's first pass
  // ("" until the first Publish()).
  const std::string& base_digest() const { return base_digest_; }
  const DeltaPublisherOptions& options() const { return options_; }
  // The snapshot's state file (state_file.h) and what the publisher holds in its heap
  // besides the source: the staging buffers (touched only when tensors are staged).
  const std::string& state_path() const;
  uint64_t state_bytes() const;
  uint64_t staging_bytes() const;

 private:
  struct Plan;
  struct Pass;
  explicit DeltaPublisher(DeltaPublisherOptions options);
  Status InitSnapshotFromFirstPass(WeightSource& source, PublishStats* stats);
  // The records of the full version 1 (see above): every tensor's digest and zero frame.
  void EncodeFullVersion(Pass& pass, PublishStats* stats);
  // Publish()'s `digests`, from the pass's checksums.
  void SourceDigests(const Pass& pass, std::map<std::string, std::string>* digests) const;
  Status WritePayloads(Pass& pass, const std::string& dir, DeltaManifest* manifest, PublishStats* stats);
  Status WriteManifest(const std::string& dir, const DeltaManifest& manifest, PublishStats* stats);
  void Rollback(Pass& pass);
  void SubmitParts(TaskGroup& group, Pass& pass, size_t i, std::span<const std::byte> next,
                   std::optional<size_t> staged);

  DeltaPublisherOptions options_;
  std::unique_ptr<Plan> plan_;
  int64_t version_ = 0;
  bool snapshot_ready_ = false;
  std::string base_digest_;
  // Not OK once the snapshot can no longer be trusted (an encode failed mid-tensor, or
  // the state file was found changed); every later Publish() returns it.
  Status broken_;
};

}  // namespace wsync::delta
