// SyncPass: the one pass over a WeightSource that one sync makes.
//
// A sync iterates its source exactly once: every trainer rank's pass may be a collective
// (an FSDP all-gather, a Megatron export), and the most expensive step of a trainer's
// sync. The pass is checked tensor by tensor against the metadata as it streams
// (CheckedStream): an extra, missing or mismatched tensor ends it with InvalidArgument
// naming the tensor, and the pass stays over (later reads fail). Not thread-safe: the
// stream is read by one thread at a time.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// The in-line digests of one pass: {HF name: xxh3-128 hex} of the tensors some trainer
// rank read whole, and, for a tensor no rank holds whole (FSDP's dim-0 shards), digests
// of its row ranges [begin, end) of dim 0, each taken by a rank that holds those rows.
// Record() and RecordRows() are thread-safe; read the rest once the pass's readers are
// done.
class PassDigests;

// Copies host tensor `t` to `dst`; with `digests`, hashes it as it copies (core/digest.h
// CopyAndHash) and records its xxh3-128 digest under its name.
void CopyRecordingDigest(std::byte* dst, const TensorRef& t, PassDigests* digests);

class PassDigests {
 public:
  struct Rows {
    int64_t begin = 0;
    int64_t end = 0;
    std::string hex;
  };
  void Record(std::string_view name, std::string hex);
  void RecordRows(std::string_view name, int64_t begin, int64_t end, std::string hex);
  const std::map<std::string, std::string>& map() const { return digests_; }
  // Whether `name` has a whole digest, or row digests that cover [0, dim0) without gaps.
  bool Covers(const std::string& name, int64_t dim0) const;
  size_t size() const;
  // The finish body's "wsync_digests" (docs/protocol.md): a whole tensor's hex, or
  // {"rows": [[begin, end, hex], ...]} for a tensor digested by row ranges.
  nlohmann::json Json() const;
  // Records what another PassDigests' Json() holds (another trainer rank's share);
  // InvalidArgument naming the tensor of an entry of another shape.
  Status Merge(const nlohmann::json& j);

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::string> digests_;
  std::map<std::string, std::vector<Rows>> rows_;
};

class SyncPass {
 public:
  explicit SyncPass(WeightSource& source);
  ~SyncPass();
  SyncPass(const SyncPass&) = delete;
  SyncPass& operator=(const SyncPass&) = delete;

  // The source, to look at (its type, its metadata); never Iterate() it: use Stream().
  WeightSource& source() { return source_; }
  const std::vector<TensorMeta>& metadata() const { return source_.metadata(); }

  // The checked stream of the pass; it starts the pass on the first call and returns the
  // same stream on later ones. A caller may keep it past the sync (a data plane whose
  // thread outlives an abort).
  Result<std::shared_ptr<TensorStream>> Stream();
  // The pass over the held names instead (WeightSource::IterateHeld), checked against
  // `held`: the metadata of the names the source holds, in metadata order. A sync makes
  // one pass: either Stream() or HeldStream(), not both.
  Result<std::shared_ptr<TensorStream>> HeldStream(const std::vector<TensorMeta>& held);
  // A WeightSource over the same pass (the source's metadata; Iterate() hands out the
  // stream once), for code that takes a source.
  WeightSource& AsSource();

  // Reads the whole pass, checked, discarding the tensors (a rank that sends nothing).
  Status ReadAll();

  // In-line verification: from the start of the pass on, every tensor the pass yields
  // from host memory is hashed with xxh3-128 as it is handed out (before the reader
  // sees it), into digests(). The pass itself hashes no tensor on a device (reading it
  // back would cost a copy the data plane does not make): only a reader that took the
  // hashing over digests those, on the device (engine/device_digests.h); a device
  // tensor nobody digested leaves the digests incomplete, so the sync is reported
  // unverified, never verified. Call before the pass starts.
  void CollectDigests() { collect_digests_ = true; }
  bool collects_digests() const { return collect_digests_; }
  // A reader that copies every host tensor it reads (a data plane's packer) takes the
  // hashing over (it may also record digests of tensors other ranks read), so that each
  // tensor is hashed while its bytes are in cache for the copy (core/digest.h
  // CopyAndHash): from then on the pass hashes nothing itself, and the reader records
  // every host tensor it reads, under its name, before it reads the next, and the device
  // tensors it can digest on the device. Null when the pass collects no digests. Call
  // before the pass starts.
  std::shared_ptr<PassDigests> TakeDigests();
  // {HF name: xxh3-128 hex} of the host tensors the pass has yielded so far; all of its
  // digests, row digests of split tensors too, are in digest_set().
  const std::map<std::string, std::string>& digests() const;
  const PassDigests& digest_set() const { return *digests_; }
  // Whether the digests cover every tensor the pass yielded, on the host or a device,
  // whole or by row ranges (a reader that took the hashing over may have stopped short;
  // it may also have recorded digests other trainer ranks took); false when none are
  // collected.
  bool digests_complete() const;

  bool started() const { return outer_ != nullptr; }
  // Whether the pass has yielded every tensor of the metadata.
  bool complete() const;

 private:
  class Outer;
  class View;
  WeightSource& source_;
  std::shared_ptr<Outer> outer_;  // the pass's stream, once started
  std::unique_ptr<View> view_;
  bool collect_digests_ = false;
  bool digests_taken_ = false;
  std::shared_ptr<PassDigests> digests_ = std::make_shared<PassDigests>();
};

}  // namespace wsync
