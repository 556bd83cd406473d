// WorkerSink: where a receiving backend lands the HF tensors of an update, for one worker.
//
// Every receiver (src/backends/*/receiver.cc) hands the bytes it receives to its worker's
// sink, tensor by tensor, and tells the sink when a chunk is complete. Two sinks exist:
// WorkerStore (model/worker_store.h), which copies each tensor's pieces into the worker's
// own shards (`wsync serve`), and the ReceiverEngine's (receiver/receiver_engine.cc),
// which lends each chunk's tensors to a caller's callback (a Python worker's
// load_weights).
//
// The views a backend passes to Load() stay valid until its ChunkLanded() returns: a
// backend reuses a receive buffer only after that. Called from the worker's threads, one
// call at a time per sink.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

class ShardingTable;  // model/sharding.h

class WorkerSink {
 public:
  virtual ~WorkerSink() = default;

  // One contiguous copy a planned load makes (PlanLoad).
  struct ByteCopy {
    const std::byte* src = nullptr;
    std::byte* dst = nullptr;
    size_t bytes = 0;
  };

  // The HF tensors this worker expects, in the model's order; empty when the sink learns
  // them from each update (backends then reserve receive buffers at the first update).
  virtual const std::vector<TensorMeta>& hf_tensors() const = 0;
  // Lands one full HF tensor; `hf.bytes` is valid until the chunk's ChunkLanded returns.
  virtual Status Load(const TensorRef& hf) = 0;
  // Whether the sink hashes what it lands (WorkerStore::BeginLandingDigests): a backend
  // that would otherwise land through planned copies calls LoadEach instead, so that
  // every byte lands through the sink's own hashing copies.
  virtual bool HashesLandings() const { return false; }
  // Load() of each tensor, possibly on up to `threads` threads; the first error.
  virtual Status LoadEach(std::span<const TensorRef> hf, size_t threads) {
    for (const TensorRef& t : hf) WSYNC_RETURN_IF_ERROR(Load(t));
    return Status::Ok();
  }
  // Whether PlanLoad works: a backend that batches a chunk's copies into one launch plans
  // them; otherwise it calls Load per tensor.
  virtual bool PlansCopies() const { return false; }
  // The copies Load(hf) would make, appended to `out`.
  virtual Status PlanLoad(const TensorRef& hf, std::vector<ByteCopy>* out) const {
    return Unimplemented("this worker sink does not plan copies");
  }
  // A backend that runs copies it planned (possibly planned at an earlier update and
  // replayed) calls this every time they have run, with the HF tensors they landed, so
  // that the sink knows what this update landed.
  virtual void PlannedCopiesRan(std::span<const TensorMeta> tensors) {}
  // Slices (the sharded backend): a worker that keeps shards says which (its sharding
  // table; null when it takes whole HF tensors only).
  virtual const ShardingTable* sharding() const { return nullptr; }
  // Lands one piece of one parameter: table.params()[param].pieces[piece], its byte runs
  // (ShardingTable::Runs) packed back to back in `packed`, which lies on `where` (host
  // memory, or the sink's own device). InvalidArgument for an index outside the table or
  // a length other than the piece's; nothing is written then. The copies may complete
  // asynchronously until the chunk's ChunkLanded() returns.
  virtual Status LoadPiece(int param, int piece, std::span<const std::byte> packed, const Device& where) {
    return Unimplemented("this worker sink does not take slices");
  }
  // Every tensor of the current chunk has been loaded; its views are released after this
  // returns. An error fails the update as a Load error does.
  virtual Status ChunkLanded() { return Status::Ok(); }
};

}  // namespace wsync
