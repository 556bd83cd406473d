// FP8 serving (`wsync serve --quantization fp8`): a worker's quantized parameters, the
// tracking of which decoder layers have fully landed in the current update, and their
// layerwise quantization while the rest of the sync is still arriving.
//
// Memory: the worker's WorkerStore keeps every parameter in the model dtype as today; for
// a quantized parameter (IsFp8Param) that memory is the landing buffer of an update, and
// the permanent copy is the fp8 weight + float32 scale_inv held here. On a host store the
// landing buffer's pages are released (madvise(MADV_DONTNEED), the address kept) as soon
// as its parameter is quantized, so between syncs a quantized parameter costs its fp8
// bytes and scales only; the next update faults its pages back in as it lands. A CUDA
// store's parameters share one allocation, which is not released piecewise: there the
// landing buffers stay allocated (model dtype + fp8 for every quantized parameter).
// Embeddings, lm_head, norms and the MoE router stay in the model dtype only.
//
// Completion rule (partial updates included): a decoder layer (HF names
// "model.layers.N.") is touched by an update when any piece of any of its quantized
// parameters landed in it; a touched layer must land every piece of every quantized
// parameter it has on this worker (fused qkv / gate_up and stacked experts included,
// replicas too) within the same update. A layer is quantized once, as soon as the chunk
// that completed it has landed (ChunkLanded); a layer no update touched keeps its fp8
// bytes. FinishUpdate() waits for the quantization in flight and names every touched
// layer that never completed; the tracking then starts afresh (as at BeginUpdate()).
//
// Fp8LayerTracker is the rule alone (no memory); Fp8WorkerSink is the WorkerSink the
// backends land through on an fp8 server: it forwards each Load / LoadPiece /
// ChunkLanded to the store, marks the pieces, and quantizes completed layers on a thread
// pool (host stores: QuantizeFp8Param) or on a side stream of the store's device (CUDA
// stores, built with CUDA: QuantizeFp8ParamOnDevice). A CUDA sink plans copies like its
// store (a backend batches a chunk's copies into one launch and reports them through
// PlannedCopiesRan, which marks them and quantizes the layers they completed); a host
// sink plans none, so that every backend lands through Load or LoadPiece and
// every landed byte is seen. Called like any WorkerSink (worker_sink.h): from the
// worker's thread, one call at a time; FinishUpdate / BeginUpdate / QuantizeAll on the
// worker's thread too, outside the backend's calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/digest.h"
#include "core/parallel.h"
#include "model/layer_tracker.h"
#include "model/sharding.h"
#include "model/worker_sink.h"
#include "model/worker_store.h"
#include "quant/fp8_sharding.h"
#include "wsync/device_runtime.h"
#include "wsync/status.h"

namespace wsync {

// The completion rule over the quantized parameters (IsFp8Param).
class Fp8LayerTracker : public LayerTracker {
 public:
  explicit Fp8LayerTracker(const ShardingTable& table);
  // Marks nothing for a tensor that is not quantized.
  void MarkHf(std::string_view hf_name);
  // LayerTracker's error, prefixed "fp8: " and ending ", so they were not quantized".
  Status CheckComplete() const;
};

class Fp8WorkerSink final : public WorkerSink {
 public:
  // Refuses a model / tp that CheckFp8Sharding refuses, and allocates the zeroed fp8
  // weights and scales of `store` (on its device). `threads`: the host quantization pool.
  // `store` must outlive the sink.
  static Result<std::unique_ptr<Fp8WorkerSink>> Create(WorkerStore* store, size_t threads);
  ~Fp8WorkerSink() override;

  WorkerStore& store() const { return *store_; }
  const std::vector<TensorMeta>& hf_tensors() const override { return store_->hf_tensors(); }
  Status Load(const TensorRef& hf) override;
  bool PlansCopies() const override { return !store_->device().is_cpu(); }
  Status PlanLoad(const TensorRef& hf, std::vector<ByteCopy>* out) const override;
  // Marks the tensors and starts the quantization of the layers they completed; an error
  // is kept for FinishUpdate.
  void PlannedCopiesRan(std::span<const TensorMeta> tensors) override;
  const ShardingTable* sharding() const override { return &store_->table(); }
  Status LoadPiece(int param, int piece, std::span<const std::byte> packed, const Device& where) override;
  Status ChunkLanded() override;

  // Start of an update: forgets earlier marks.
  void BeginUpdate();
  // End of an update: waits for the quantization in flight, then CheckComplete's error if
  // a touched layer never completed; the marks are reset either way.
  Status FinishUpdate();
  // Waits for the quantization in flight (an update that failed may leave some); its
  // errors are dropped: that update already failed.
  void Settle() { (void)Wait(); }
  // Quantizes every quantized parameter from the store's current bytes (the weights at
  // start-up) and waits for it.
  Status QuantizeAll();

  // Parameter i's fp8 bytes and scales on the store's device (null when not quantized),
  // laid out as layout(i) says (null when not quantized). The mutable ones are for the
  // runtime weight checker's overwrite.
  const uint8_t* weight_data(size_t i) const { return weight_[i]; }
  const float* scale_data(size_t i) const { return scale_[i]; }
  uint8_t* mutable_weight_data(size_t i) { return weight_[i]; }
  float* mutable_scale_data(size_t i) { return scale_[i]; }
  const Fp8ParamLayout* layout(size_t i) const {
    return layouts_[i].weight.name.empty() ? nullptr : &layouts_[i];
  }
  // Bytes of every fp8 weight and scale held (beside the store's param_bytes()).
  size_t fp8_bytes() const { return fp8_bytes_; }
  // Landing buffers of quantized parameters whose pages are released (host stores).
  bool releases_landing_buffers() const { return store_->device().is_cpu(); }

 private:
  explicit Fp8WorkerSink(WorkerStore* store) : store_(store), tracker_(store->table()) {}
  // Starts the quantization of `params` (asynchronously); errors are kept for Wait().
  Status Quantize(const std::vector<int>& params);
  // Starts the quantization of the layers completed since the last call (Quantize).
  Status QuantizeCompleted();
  // Waits for every quantization started; their first error.
  Status Wait();

  WorkerStore* store_;
  Fp8LayerTracker tracker_;
  std::vector<Fp8ParamLayout> layouts_;  // per param (empty meta when not quantized)
  std::vector<uint8_t*> weight_;
  std::vector<float*> scale_;
  size_t fp8_bytes_ = 0;
  // Host stores.
  std::vector<std::vector<uint8_t>> host_weight_;
  std::vector<std::vector<float>> host_scale_;
  std::unique_ptr<TaskPool> pool_;
  std::unique_ptr<TaskGroup> group_;
  std::mutex mu_;
  Status first_error_;  // guarded by mu_
  // CUDA stores.
  DeviceBuffer device_fp8_;
  void* stream_ = nullptr;  // cudaStream_t, created at the first device quantization
  bool stream_pending_ = false;
};

// The FP8 HF checkpoint tensors' digests of a TP group (index tp_rank; sinks of one
// replica): Fp8HfTensors(config) order, NAME = e4m3 bytes in the HF shape, NAME_scale_inv
// = float32 scales, other tensors = their model-dtype bytes (AllHfDigests'). Read back in
// row blocks of at most `block_bytes` (at least one row; 0: 64 MiB for host sinks,
// kDeviceReadBackBlockBytes for device sinks); on up to `threads` threads.
Result<std::map<std::string, std::string>> AllFp8HfDigests(std::span<const Fp8WorkerSink* const> group,
                                                           DigestAlgorithm algorithm, size_t threads,
                                                           size_t block_bytes = 0);

}  // namespace wsync
