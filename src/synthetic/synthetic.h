// SyntheticTrainer: a stand-in for an RL trainer that owns a model's weights and changes
// them every step the way a real optimizer step does, so that syncs, deltas and
// benchmarks see realistic traffic without a GPU or a training framework.
//
// Weights are deterministic: every value is a pure function of (seed, tensor name,
// element index) and, for updates, the step number, so equal seeds give identical bytes
// whatever the thread count, and a tensor's values do not depend on which other tensors
// exist. BF16/F16/F32 tensors are trained: Step() applies w -= lr * u with u uniform in
// [-1, 1) (the shape of a normalized Adam update) and rounds the result back to the
// tensor's dtype stochastically (synthetic_kernels.h), so no fp32 master is kept and the
// trainer holds exactly one copy of the model. All other dtypes (fp8, f64, ints, bool)
// are generated once and never change.
//
// The model lives on the host or on one CUDA device. On a device it is generated, and
// stepped, through small per-thread host pieces (kChunkElements elements each), so the
// host never holds the model.
//
// Not thread-safe: call Step() and iterate source() from one thread, never at the same
// time (a stream's TensorRefs point into the tensors that Step() rewrites). Step() itself
// fans out over `threads` threads and blocks until they are done.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "format/safetensors.h"
#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

struct StepStats {
  uint64_t changed_elements = 0;  // model elements whose bytes differ after the step
  uint64_t total_elements = 0;    // elements of the trained (BF16/F16/F32) tensors
  double changed_fraction = 0;    // changed_elements / total_elements; 0 when there are none
  double seconds = 0;             // wall time of the step
};

class SyntheticTrainer {
 public:
  // Default learning rate: on N(0, 0.02) bf16 weights a few percent of values change per
  // step, as a small-lr RL step does to a bf16 model (synthetic_test.cc bounds the share).
  static constexpr float kDefaultLr = 2e-6f;
  // Standard deviation of generated weights; "*norm.weight" tensors get 1 + N(0, kInitStd).
  static constexpr float kInitStd = 0.02f;

  // Elements per work piece: small enough to balance threads and to bound a device
  // trainer's host staging, large enough to amortize the dispatch. A power of two
  // dividing 2^32, so no piece crosses a 2^32 hash block.
  static constexpr uint64_t kChunkElements = uint64_t{1} << 20;

  // Generates weights for `metas` (kept in this order as the source's metadata) from
  // `seed` on `device`, using up to `threads` threads. InvalidArgument for a negative
  // dimension or a repeated name; a CUDA device needs the installed runtime
  // (device_runtime.h).
  static Result<std::unique_ptr<SyntheticTrainer>> FromMetadata(std::vector<TensorMeta> metas,
                                                                uint64_t seed, size_t threads,
                                                                const Device& device = Device{});
  // Starts from a copy of a checkpoint's tensors, in CheckpointDir::tensors() order, on
  // `device`. `seed` keys the updates. `skip`, when given, names tensors left out (not
  // copied, not sent).
  static Result<std::unique_ptr<SyntheticTrainer>> FromCheckpoint(
      const CheckpointDir& ckpt, size_t threads, uint64_t seed = 0, const Device& device = Device{},
      const std::function<bool(std::string_view)>& skip = nullptr);

  SyntheticTrainer(const SyntheticTrainer&) = delete;
  SyntheticTrainer& operator=(const SyntheticTrainer&) = delete;

  // Applies the update of step `step` to every trained tensor. The update depends only on
  // (seed, step, tensor name, element), so replaying the same steps gives the same bytes.
  Result<StepStats> Step(uint64_t step);

  // A source over the current model tensors (zero-copy; valid until the next Step()):
  // host tensors, or the device source's.
  WeightSource& source();
  // The host model tensors, in metadata order; callers may read them (and write, at
  // their risk). Empty for a trainer on a device.
  std::vector<HostTensor>& tensors() { return host_.tensors(); }
  const std::vector<HostTensor>& tensors() const { return host_.tensors(); }
  const std::vector<TensorMeta>& metadata() const { return metadata_; }
  // Where the model lives, and the device source (null on the host).
  const Device& device() const { return device_; }
  DeviceTensorSource* device_source() const { return device_source_.get(); }

  float lr() const { return lr_; }
  void set_lr(float lr) { lr_ = lr; }
  uint64_t seed() const { return seed_; }
  size_t threads() const { return threads_; }

 private:
  // A contiguous range of one tensor's elements; never crosses a 2^32-element block.
  struct Chunk {
    size_t tensor;
    uint64_t begin;
    uint64_t end;
  };
  // What ForEachChunk does with a device tensor's range around fn.
  enum class Access { kWrite, kReadWrite };
  using ChunkFn = std::function<void(const Chunk&, std::byte* range, std::vector<float>& scratch)>;

  SyntheticTrainer(std::vector<TensorMeta> metadata, uint64_t seed, size_t threads, const Device& device);
  // Checks the metadata, allocates the model where it lives and lists the work chunks.
  Status Prepare();
  // Runs fn(chunk, bytes of the chunk's elements) for every chunk on up to threads_
  // threads, each with its own scratch. On a device the bytes are a per-thread host
  // piece: read from the device first for kReadWrite, written back after fn.
  Status ForEachChunk(const std::vector<Chunk>& chunks, Access access, const ChunkFn& fn);

  std::vector<TensorMeta> metadata_;
  Device device_;
  HostTensorSource host_;  // owns the model tensors on the host; empty on a device
  std::unique_ptr<DeviceTensorSource> device_source_;
  std::vector<uint64_t> name_keys_;  // NameKey of each tensor
  std::vector<Chunk> all_chunks_;    // every tensor
  std::vector<Chunk> train_chunks_;  // trained tensors only
  uint64_t trained_elements_ = 0;
  uint64_t seed_;
  size_t threads_;
  float lr_ = kDefaultLr;
};

// The initial values SyntheticTrainer::FromMetadata(..., seed, ...) gives elements
// [begin, end) of the tensor `meta`, written into `range` (element `begin` first);
// `scratch` is reused between calls. The range must not cross a 2^32-element block.
// Thread-safe on disjoint ranges.
void GenerateInitialRange(uint64_t seed, const TensorMeta& meta, uint64_t begin, uint64_t end, std::byte* range,
                          std::vector<float>& scratch);
// The same for the whole tensor (`out` holds meta.nbytes()), on up to `threads` threads:
// a server's synthetic weights equal a SyntheticTrainer's of the same seed.
void GenerateInitial(uint64_t seed, const TensorMeta& meta, std::span<std::byte> out, size_t threads);

}  // namespace wsync
