// WeightSource: what a trainer rank gives wsync to send.
//
// A WeightSource produces the weights of one trainer rank, in Hugging Face names and
// layouts, one tensor at a time. metadata() is cheap and never moves data; Iterate()
// starts a fresh pass and may be a collective (FSDP all-gather, Megatron export), so
// every rank of the trainer must drain it. Not thread-safe: one pass at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "wsync/device_runtime.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// One pass over a source. The TensorRef filled by Next() stays valid until the next
// call to Next() or the stream's destruction.
class TensorStream {
 public:
  virtual ~TensorStream() = default;
  // Fills `out` and returns true, or returns false at the end of the pass.
  virtual Result<bool> Next(TensorRef* out) = 0;
};

// One block of memory that holds every tensor a source yields, at fixed offsets, for the
// life of the source (a trainer's flat parameter buffer).
struct SourceStorage {
  const std::byte* data = nullptr;
  size_t bytes = 0;
  Device device;
};

// The offset of `t` inside `storage`, or nullopt when `t` is on another device or not
// wholly inside the block.
std::optional<uint64_t> OffsetInStorage(const SourceStorage& storage, const TensorRef& t);

// Called by a packer that enqueued device copies from `t` (DeviceRuntime::Copy2D on this
// thread) before it asks the stream for its next tensor. `t` is valid only until then: its
// source may free the memory (an all-gathered or cast temporary) while a copy still reads
// it, so the copies are waited for, unless `t` lies in `stable`, the storage its source
// keeps for the life of the source. Returns whether it waited.
Result<bool> FinishCopiesFrom(DeviceRuntime& rt, const TensorRef& t, const std::optional<SourceStorage>& stable);

// Rows [begin, end) of dim 0 of tensor `name`: the part of it one rank holds.
struct HeldRows {
  std::string name;
  int64_t begin = 0;
  int64_t end = 0;
  friend bool operator==(const HeldRows&, const HeldRows&) = default;
};

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // The whole model, in iteration order.
  virtual const std::vector<TensorMeta>& metadata() const = 0;
  virtual Result<std::unique_ptr<TensorStream>> Iterate() = 0;
  // Names this rank can produce without help from other ranks; nullopt means all of them.
  virtual std::optional<std::vector<std::string>> HeldNames() const { return std::nullopt; }
  // A pass over the held names only (HeldNames(); every name when that is nullopt), in
  // metadata order: what a backend whose ranks each send only what they hold (`sharded`)
  // iterates, so that no rank assembles what it does not own. Like Iterate() it may be a
  // collective: every rank of the trainer runs its own held pass at the same time.
  // Default: Iterate() when HeldNames() is nullopt, else Unimplemented.
  virtual Result<std::unique_ptr<TensorStream>> IterateHeld();
  // The held names this rank holds only rows of (FSDP's dim-0 shards), each once, in
  // metadata order; every other held name is held whole. IterateHeld() yields such a
  // tensor as those rows alone (dim 0 of end - begin). Only a backend whose ranks each
  // send what they hold (`sharded`) reads it. Default: none.
  virtual std::vector<HeldRows> HeldRowRanges() const { return {}; }
  // The one block every yielded tensor lies in, when the source has one; nullopt otherwise.
  virtual std::optional<SourceStorage> storage() const { return std::nullopt; }
  // Whether every TensorRef a pass yields stays valid until the pass ends, not only until
  // the next Next(): the source yields tensors it keeps (host tensors, one storage block,
  // a mapped checkpoint), never temporaries (an all-gather, a cast). A consumer may then
  // read a tensor after asking for the next one. Default: the source has a storage().
  virtual bool StableRefs() const { return storage().has_value(); }
};

// Wraps a stream so that every tensor it yields is checked against `metadata`, in order:
// an extra, missing or mismatched tensor is an InvalidArgument naming it. Wire code sends
// only what this stream yields, so both sides cut chunks at the same boundaries.
std::unique_ptr<TensorStream> CheckedStream(std::unique_ptr<TensorStream> inner,
                                            const std::vector<TensorMeta>& metadata);

// One whole pass of `source` through CheckedStream, discarding the tensors: the trainer's
// check before anything is sent, and the pass a non-sending rank makes to join collectives.
Status DrainChecked(WeightSource& source);

// A source over tensors held in memory (tests, synthetic models, loaded checkpoints).
class HostTensorSource : public WeightSource {
 public:
  explicit HostTensorSource(std::vector<HostTensor> tensors);
  const std::vector<TensorMeta>& metadata() const override { return metadata_; }
  Result<std::unique_ptr<TensorStream>> Iterate() override;
  // The tensors live as long as the source (a caller that writes them between passes
  // does so while no pass is under way).
  bool StableRefs() const override { return true; }
  std::vector<HostTensor>& tensors() { return tensors_; }
  const std::vector<HostTensor>& tensors() const { return tensors_; }

 private:
  std::vector<HostTensor> tensors_;
  std::vector<TensorMeta> metadata_;
};

// A source over tensors on one CUDA device, all in ONE device allocation at 256-byte
// aligned offsets (as a trainer's flat parameter buffer keeps them), filled from host
// tensors by Upload(). Streams yield TensorRefs on device(); they read device memory,
// so only device-aware consumers (the GPU data planes) may dereference them.
class DeviceTensorSource : public WeightSource {
 public:
  // `allocator` kVirtualMemory: the one allocation comes from cuMemCreate, as a trainer
  // with expandable segments holds its weights (exported as cuda_fd, see DeviceBuffer).
  static Result<std::unique_ptr<DeviceTensorSource>> Create(
      const Device& device, std::vector<TensorMeta> metadata,
      DeviceAllocator allocator = DeviceAllocator::kRuntime);
  const std::vector<TensorMeta>& metadata() const override { return metadata_; }
  Result<std::unique_ptr<TensorStream>> Iterate() override;
  // Copies `tensors` (the same names, dtypes and shapes, in order) to the device; the
  // calling thread's current device becomes device().
  Status Upload(const std::vector<HostTensor>& tensors);
  const Device& device() const { return storage_.device(); }
  // The one allocation holding every tensor, and tensor i's offset inside it.
  const DeviceBuffer& device_buffer() const { return storage_; }
  // The same allocation, for data planes that export a source's memory (ipc zero-copy).
  std::optional<SourceStorage> storage() const override {
    return SourceStorage{storage_.data(), storage_.size(), storage_.device()};
  }
  size_t offset(size_t i) const { return offsets_[i]; }

 private:
  DeviceTensorSource() = default;
  std::vector<TensorMeta> metadata_;
  std::vector<size_t> offsets_;
  DeviceBuffer storage_;
};

}  // namespace wsync
