// WorkerStore: one inference worker's parameters, filled from HF tensors.
//
// It is the WorkerSink (model/worker_sink.h) of `wsync serve`'s workers.
//
// A WorkerStore is what a vLLM worker holds (fused, TP-sharded parameters, laid out by
// the ShardingTable) backed by zeroed memory on its device: host memory (one buffer per
// parameter, resident from Create() on: see core/prefault.h) or, on `cuda:N`, one device allocation holding every parameter at 256-byte
// aligned offsets (device memory goes through the installed DeviceRuntime; it comes from
// the virtual memory API where the runtime has it, so that sleep can release it in place). Load() takes one full HF tensor and
// copies its pieces into the parameters in place: parameter storage never moves, so
// addresses handed out stay valid across syncs. The free functions read a whole TP group
// back into HF tensors (from primary pieces only) for checksums and debugging, and check
// that replicated copies agree.
//
// Thread-safety: Load() on different stores may run concurrently on different threads;
// one store is not synchronized (no Load concurrently with another Load or a read-back of
// the same store). Read-back functions only read, so they may run concurrently with each
// other; they read host stores (a CUDA store is read back through CopyToHost()). Load()
// on a CUDA store must run on a thread whose current device is the store's.
//
// Sleep and wake (the server's /sleep and /wake_up): Offload() keeps the parameters'
// bytes in a slower tier and releases their memory, Discard() releases it and drops the
// bytes, Restore() brings the memory back (with the offloaded bytes, or zeros). The
// parameters' addresses never change: a host store's buffers are anonymous mappings
// whose pages are released with madvise(MADV_DONTNEED) and faulted back in; a CUDA
// store's allocation keeps its reserved address range while its physical memory is
// released and mapped back (DeviceRuntime::ReleasePhysical / RestorePhysical). These run
// like Load() (not concurrently with any other call on the store; a CUDA store's on a
// thread whose current device is the store's); a store that is not resident refuses
// Load, PlanLoad and CopyToHost (FailedPrecondition). residency() and the byte counts
// may be read from any thread at any time.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/digest.h"
#include "core/offload_file.h"
#include "model/config.h"
#include "model/group_landing.h"
#include "model/layer_tracker.h"
#include "model/sharding.h"
#include "model/worker_sink.h"
#include "wsync/device_runtime.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

class WorkerStore final : public WorkerSink {
 public:
  // Builds the table of worker tp_rank of tp_size and allocates its zeroed parameters on
  // `device`. Host parameters are prefaulted here, so the first Load() into them costs
  // no more than any later one (Create takes the time instead).
  // Drafter::kMtp adds the MTP drafter's own parameters; its embed_tokens and
  // shared_head.head are the target's (drafter_param_data()).
  static Result<std::unique_ptr<WorkerStore>> Create(const ModelConfig& config, int tp_rank,
                                                     int tp_size, const Device& device = {},
                                                     Drafter drafter = Drafter::kNone);
  WorkerStore(const WorkerStore&) = delete;
  WorkerStore& operator=(const WorkerStore&) = delete;

  const ModelConfig& config() const { return table_.config(); }
  int tp_rank() const { return table_.tp_rank(); }
  int tp_size() const { return table_.tp_size(); }
  const ShardingTable& table() const { return table_; }
  const std::vector<TensorMeta>& hf_tensors() const override { return table_.hf_tensors(); }
  const Device& device() const { return device_; }
  // The parameters of a host store, in table().params() order (empty on a CUDA store).
  const std::vector<HostTensor>& params() const { return params_; }
  // Address of parameter i's bytes on device(), for any store; stable for its lifetime.
  std::byte* param_data(size_t i) const { return param_data_[i]; }
  // The drafter's parameters as the drafter sees them: its own (table().IsDrafterParam)
  // and its aliases of target parameters, each with the address it reads; an alias's
  // address is the target parameter's. Empty without a drafter.
  struct DrafterParam {
    std::string name;
    std::byte* data = nullptr;
    size_t bytes = 0;
    int shares = -1;  // the target parameter an alias is; -1 for the drafter's own
  };
  std::vector<DrafterParam> drafter_params() const;
  // Drafter reload tracking (model/layer_tracker.h over the drafter's own parameters):
  // every landing (Load, LoadPiece, PlannedCopiesRan) marks its pieces. BeginDrafterUpdate
  // forgets the marks; FinishDrafterUpdate answers whether this update reloaded every
  // drafter layer whole (false: it touched none), FailedPrecondition naming each drafter
  // layer it touched but did not complete. A store without a drafter answers false.
  void BeginDrafterUpdate();
  Result<bool> FinishDrafterUpdate();
  // Writable bytes of params()[i] of a host store (post-processing, fault-injection tests).
  std::span<std::byte> mutable_param_bytes(size_t i) { return params_[i].storage.span(); }

  // InvalidArgument unless the model has an HF tensor of this name, dtype and shape:
  // "model qwen3-tiny has no tensor X", "shape of X is [3072, 1024], update says [1024, 3072]".
  Status CheckHf(const TensorMeta& hf) const;
  // Copies every piece of one full HF tensor into the parameters. Checks name, dtype,
  // shape and byte count first; on error nothing is written. A host store loads host
  // tensors; a CUDA store loads host or CUDA tensors, with its copies complete on return.
  // A name model/dropped_names.h drops lands nothing and is no error (PlanLoad plans no
  // copy of it).
  Status Load(const TensorRef& hf) override;

  // One contiguous copy Load() makes.
  using ByteCopy = WorkerSink::ByteCopy;
  // The copies Load(hf) would make, appended to `out` after the same checks (for
  // backends that run a whole chunk's copies in one batched device launch).
  bool PlansCopies() const override { return true; }
  Status PlanLoad(const TensorRef& hf, std::vector<ByteCopy>* out) const override;
  void PlannedCopiesRan(std::span<const TensorMeta> tensors) override;

  // Landing digests (the server's in-line verification), for host stores. From
  // BeginLandingDigests(true) on, Load() and LoadEach() hash, with xxh3-128, the bytes
  // they have just written into the parameters for every HF tensor whose primary pieces
  // this store holds whole (every tensor of a TP=1 store; the replicated ones of a TP
  // rank), block by block right after copying each (core/digest.h CopyAndHash), in HF
  // order: the digest is of what landed in the parameters, not of what the update said.
  // LandedDigest() answers the digest of the last landing of `hf_name` since the last
  // BeginLandingDigests, or nullopt (not landed since, not held whole, a device store, or
  // a LoadPiece into one of its parameters since). Called like Load(); LandedDigest only
  // while no Load runs.
  void BeginLandingDigests(bool on);
  // The TP group's landing tracker (model/group_landing.h), told of every landing of this
  // host store from now on; null: none. Not owned: it must outlive the landings. Set while
  // no Load runs.
  void set_group_landing(GroupLandingDigests* group) { group_landing_ = group; }
  const GroupLandingDigests* group_landing() const { return group_landing_; }
  bool HashesLandings() const override { return hash_landings_; }
  std::optional<std::string> LandedDigest(std::string_view hf_name) const;
  // Load() of each tensor, on up to `threads` threads (whole tensors per thread, so that a
  // tensor's digest is taken in order); as Load(), nothing is written for a tensor that
  // fails its checks, and the first error is returned.
  Status LoadEach(std::span<const TensorRef> hf, size_t threads) override;
  // Bytes [begin, end) of HF tensor `hf_name` in HF order, where this store holds them
  // as one contiguous range of its memory (device memory for a device store: what the
  // device digest kernel reads), else nullopt (not held whole, or held in pieces that
  // are not adjacent). Not thread-safe: call while no Load runs, from one thread.
  std::optional<std::span<const std::byte>> HeldRun(std::string_view hf_name, int64_t begin, int64_t end) const;
  // Fault injection for tests (`wsync serve --fault corrupt-landed`): every landing of
  // `hf_name` (Load, LoadEach) writes its first byte with one bit flipped, as does each
  // host LoadPiece of it (the piece's first byte).
  void set_fault_corrupt_landing(std::string hf_name) { fault_corrupt_landing_ = std::move(hf_name); }

  // The sharded backend's slices (worker_sink.h). A CUDA store's copies complete in
  // ChunkLanded().
  const ShardingTable* sharding() const override { return &table_; }
  Status LoadPiece(int param, int piece, std::span<const std::byte> packed, const Device& where) override;
  Status ChunkLanded() override;

  // A host store with the same table and a copy of every parameter's bytes (for
  // read-back and checksums of a CUDA store; for a host store, a plain copy).
  Result<std::unique_ptr<WorkerStore>> CopyToHost() const;

  enum class Residency { kResident, kOffloaded, kDiscarded };
  // Sleep level 1: writes the parameters' bytes to the slower tier (a host store: an
  // unlinked file in `offload_dir`, written on up to `threads` threads; a CUDA store:
  // host memory), then releases their memory. On failure nothing is released and the
  // store stays resident; the error names the directory or the device. A store that is
  // not resident stays as it is.
  Status Offload(const std::string& offload_dir, size_t threads);
  // Sleep level 2: releases the parameters' memory and any offloaded copy.
  Status Discard();
  // Wake: maps memory back behind the parameters, with the offloaded bytes, or zeros
  // after Discard(). A failure after the memory is back (the offload file cannot be read)
  // leaves the store resident with incomplete bytes and answers DataLoss saying so; the
  // caller must treat the weights as discarded.
  Status Restore(size_t threads);
  Residency residency() const { return residency_.load(std::memory_order_acquire); }
  // Bytes of every parameter; of those, the bytes backed by memory now (a host store asks
  // the kernel: mincore) and the bytes kept in the slower tier.
  size_t param_bytes() const { return param_bytes_; }
  size_t resident_bytes() const;
  size_t offloaded_bytes() const { return offloaded_bytes_.load(std::memory_order_acquire); }

 private:
  explicit WorkerStore(ShardingTable table)
      : table_(std::move(table)), landing_runs_(table_.hf_tensors().size()) {}
  Status CheckHf(std::string_view name, DType dtype, std::span<const int64_t> shape) const;
  // A name the model has no tensor of and the rule of model/dropped_names.h drops.
  bool IsDropped(std::string_view hf_name) const;
  Status CheckLoad(const TensorRef& hf) const;
  // Load() after its checks, with the drafter's marks left to the caller.
  Status LoadChecked(const TensorRef& hf);
  // The byte runs of the primary pieces of HF tensor `hf_index` in this store, in HF
  // order, when they tile the whole tensor (empty otherwise): what a landing digest hashes.
  struct LandingRun {
    int64_t hf_offset;
    std::byte* dst;
    int64_t bytes;
  };
  const std::vector<LandingRun>& LandingRuns(int hf_index) const;
  // `wsync serve --fault corrupt-landed` on a device store: flips one bit of the first
  // landed byte of `hf_name`.
  Status CorruptDeviceLanding(std::string_view hf_name);
  // FailedPrecondition naming `what` while the parameters sleep.
  Status CheckResident(std::string_view what) const;

  ShardingTable table_;
  // The drafter's layers landed in this update, and the HF name prefixes of its layers
  // ("model.layers.N."): a name without one lands nothing of the drafter.
  std::unique_ptr<LayerTracker> drafter_tracker_;
  std::vector<std::string> drafter_prefixes_;
  void MarkDrafter(std::string_view hf_name);
  Device device_;
  std::vector<HostTensor> params_;     // host stores
  DeviceBuffer device_storage_;        // CUDA stores: every parameter
  std::vector<std::byte*> param_data_;
  size_t param_bytes_ = 0;
  std::atomic<Residency> residency_{Residency::kResident};
  std::atomic<size_t> offloaded_bytes_{0};
  std::unique_ptr<OffloadFile> offload_file_;  // host stores, while offloaded
  HostBuffer offload_host_;                    // CUDA stores, while offloaded
  bool pending_device_copies_ = false;         // LoadPiece copies not yet synchronized
  bool hash_landings_ = false;
  GroupLandingDigests* group_landing_ = nullptr;
  void NoteGroupLanded(std::string_view hf_name);
  std::vector<std::string> landed_;            // per HF index: its landing digest, or ""
  // Per HF index: its landing runs, built on first use (addresses never move); a cache,
  // so LandingRuns() is const. Declared after table_, which sizes it.
  mutable std::vector<std::optional<std::vector<LandingRun>>> landing_runs_;
  std::string fault_corrupt_landing_;
};

// A TP group is the stores of one model replica, indexed by tp_rank. OK when every entry
// is set, store i has tp_rank i and tp_size group.size(), all share one config and, unless
// `devices`, all are host stores. ReadBackHf takes host stores only; HfDigest,
// AllHfDigests and CheckReplicas take CUDA stores too and read them back in bounded blocks
// (no copy of a whole store), on the calling thread's stream of each store's device.
Status CheckTpGroup(std::span<const WorkerStore* const> tp_group, bool devices = false);

// Reassembles the full HF tensor `hf_name` from the group's primary pieces into `out`,
// which must be exactly its size in bytes.
Status ReadBackHf(std::span<const WorkerStore* const> tp_group, std::string_view hf_name,
                  std::span<std::byte> out);

// The digest of the HF tensor as ReadBackHf would produce it, streamed: it hashes a host
// store's parameter memory directly where every piece is one block of whole rows, and
// otherwise (and always for CUDA stores) assembles blocks of rows of at most
// `block_bytes` (at least one row) in a host scratch buffer, so no full-size copy is made.
Result<std::string> HfDigest(std::span<const WorkerStore* const> tp_group,
                             std::string_view hf_name, DigestAlgorithm algorithm,
                             size_t block_bytes = size_t{64} << 20);

// The digest of rows [row_begin, row_end) of dim 0 of the HF tensor (0 <= row_begin <
// row_end <= its dim 0, else InvalidArgument naming it), as HfDigest would hash those
// bytes alone; assembled in blocks of at most `block_bytes` (at least one row) in
// `scratch`, reused across calls.
Result<std::string> HfRowsDigest(std::span<const WorkerStore* const> tp_group, std::string_view hf_name,
                                 int64_t row_begin, int64_t row_end, DigestAlgorithm algorithm,
                                 std::vector<std::byte>* scratch, size_t block_bytes = size_t{64} << 20);

// HfRowsDigest of each range of `ranges`, in order, joined by ',' (the form the server
// compares a trainer's row digests in).
Result<std::string> HfRangesDigest(std::span<const WorkerStore* const> tp_group, std::string_view hf_name,
                                   const std::vector<std::pair<int64_t, int64_t>>& ranges,
                                   DigestAlgorithm algorithm, std::vector<std::byte>* scratch);

// The xxh3-128 digests HfDigest (or, for a tensor in `row_ranges`, HfRangesDigest) would
// give of `tensors`, for those a TP group of device stores holds in one contiguous run of
// a worker's memory (WorkerStore::HeldRun: the whole tensor, or each of its ranges),
// taken on the devices by the digest kernel (DeviceRuntime::Xxh3Digests) instead of read
// back; the others are absent from the answer. Call while no Load runs, from one thread.
Result<std::map<std::string, std::string>> DeviceHeldDigests(
    std::span<const WorkerStore* const> tp_group, std::span<const TensorMeta> tensors,
    const std::map<std::string, std::vector<std::pair<int64_t, int64_t>>>& row_ranges);

// HfDigest of every HF tensor of the model, keyed by name, on up to `threads` threads;
// xxh3-128 of a device group's tensors held in one run through DeviceHeldDigests, so
// call it, as that, while no Load runs, from one thread at a time.
Result<std::map<std::string, std::string>> AllHfDigests(
    std::span<const WorkerStore* const> tp_group, DigestAlgorithm algorithm, size_t threads);

// Runs `digest` for every tensor of `tensors` on up to `threads` threads (largest first;
// each thread passes its own scratch buffer, reused across tensors) and keys the results
// by name; the first error otherwise.
using TensorDigestFn = std::function<Result<std::string>(const TensorMeta&, std::vector<std::byte>* scratch)>;
Result<std::map<std::string, std::string>> DigestEach(std::span<const TensorMeta> tensors, size_t threads,
                                                      const TensorDigestFn& digest);

// Checks that every non-primary copy (replicated tensors, replicated KV heads) equals its
// primary; DataLoss naming the tensor, the slice and both ranks otherwise.
Status CheckReplicas(std::span<const WorkerStore* const> tp_group);

}  // namespace wsync
