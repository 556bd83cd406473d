// ReceiverEngine: the receiving half of a backend for one inference worker that holds its
// own model (a Python worker's `load_weights`, a vLLM engine subclass), in place of the
// shards `wsync serve` keeps.
//
// It speaks the same data planes as `wsync serve` (the init_info and update_info a wsync
// trainer sends, the same wire: Gloo broadcast on CPU and NCCL on GPU for `nccl`, shared
// memory or CUDA IPC slots for `ipc`, a local checkpoint advanced by delta files for
// `delta`, Gloo or NCCL point-to-point slices for `sharded`), so a wsync trainer drives it
// unchanged. It has no control plane of its own:
// whoever serves the HTTP routes (python/wsync/worker_server.py) hands it each route's
// payload. The worker is rank `rank_offset + worker_rank` of the trainer's broadcast group
// (reader `reader_offset + worker_rank` of an ipc region), as vLLM numbers its workers.
//
// Receive() calls the caller's callback once per received chunk with the chunk's tensors
// as views into wsync's receive buffers (host memory, or the worker's GPU for NCCL and
// CUDA IPC), valid only during that call: the callback copies what it keeps, and work it
// queues on a GPU must have read the views when it returns (synchronize). The callback
// runs on one of the engine's threads, never concurrently with itself; an error it returns
// ends the receive with that error (the trainer's sync fails with its text) and the engine
// stays usable: the trainer initializes the data plane again for its next sync.
//
// `sharded` lands slices, not whole tensors: the engine plans them from the worker's model
// and tensor-parallel place (`model`, `tp_size`; the same sharding table `wsync serve`'s
// workers keep, model/sharding.h) and lends each chunk's slices to a SliceCallback, which
// copies each into the worker parameter the table names (no slicing of its own).
//
// Thread-safety: calls may come from any thread; one runs at a time (a call made while
// another runs fails at once with FailedPrecondition naming the call in flight, except
// that a session's update or finish waits up to `timeout_seconds` for a call outside the
// session to end, as `wsync serve` does). Every
// wait is bounded by `timeout_seconds` (or the trainer's init_info timeout, if shorter).
//
//   ReceiverEngineOptions o;
//   o.backend = "nccl";
//   WSYNC_ASSIGN_OR_RETURN(auto rx, ReceiverEngine::Create(o));
//   WSYNC_RETURN_IF_ERROR(rx->Init(init_info, peer_address));  // /init_weight_transfer_engine
//   WSYNC_RETURN_IF_ERROR(rx->Receive(update_info, [&](std::span<const TensorRef> chunk) {
//     for (const TensorRef& t : chunk) model.Load(t);
//     return Status::Ok();
//   }));
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/backend.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

struct ReceiverEngineOptions {
  std::string backend = kDefaultBackend;  // a backend the single-worker receiver hosts (nccl, ipc, delta, sharded)
  // This worker's index within its server (0 .. the server's world size - 1).
  int worker_rank = 0;
  // Where the worker's tensors live: cpu, or cuda:N (NCCL and CUDA IPC then receive into
  // that GPU's memory; the Gloo and shared-memory planes into host memory).
  Device device;
  double timeout_seconds = 300;  // bound on every wait
  // Backend settings, the keys `wsync serve` takes from its flags: nccl
  // {"allowed_store_hosts": [HOST, ...]}; ipc {"ipc_shm_dir": DIR}; delta
  // {"base_checkpoint": DIR, "local_checkpoint_dir": DIR, "sync_root": DIR}.
  nlohmann::json backend_config = nlohmann::json::object();
  // The tensors the worker expects (HF names, dtypes, shapes). Empty: any tensor list an
  // update names is accepted and receive buffers are reserved at the first update; set:
  // every update tensor must be one of these, and buffers are reserved at Init. Either
  // way a name the rule of model/dropped_names.h drops (rotary buffers, an MTP layer's
  // copies of embed_tokens and lm_head; lm_head.weight when metadata lists
  // model.embed_tokens.weight without it) is accepted and never lent to the callback,
  // unless metadata lists it.
  std::vector<TensorMeta> metadata;
  // An update whose tensors add up to more bytes is refused (update_info is the
  // trainer's word; this bounds what it can make the worker allocate). Default 1 TiB.
  uint64_t max_update_bytes = uint64_t{1} << 40;
  std::string label = "worker";  // names this worker in messages
  // Whole tensors are lent to the chunk callback as they arrive, in batches of whole
  // modules once a batch holds at least this many bytes (and at the end of each chunk).
  size_t lend_batch_bytes = size_t{16} << 20;
  // The worker's model and its place in its tensor-parallel group, for a backend that
  // lands slices (sharded, which needs them): a registered model name or a directory
  // holding config.json. The worker is TP rank worker_rank % tp_size of tp_size, and
  // holds an MTP drafter beside the target when mtp_drafter is set (the model must have
  // MTP layers). Empty model: the engine lands whole tensors only.
  std::string model;
  int tp_size = 1;
  bool mtp_drafter = false;
};

// The session state of a ReceiverEngine (ReceiverEngine::Session), as `wsync serve`'s
// /health reports its own.
struct ReceiverEngineSession {
  bool active = false;              // between StartWeightUpdate and FinishWeightUpdate
  bool weights_consistent = true;   // false: `inconsistent` says why
  std::string inconsistent;         // why the weights are not consistent; empty when they are
  std::string busy_with;            // the call in flight; empty when idle
  int expired_sessions = 0;         // sessions whose trainer vanished (the lease ran out)
  int taken_over_sessions = 0;      // sessions ended by a new trainer's Init
};

// Tensors of one received chunk, in the trainer's order, valid during the call: a chunk
// comes in one or more calls, each of whole modules (a decoder layer's tensors together),
// so that loading overlaps the rest of the chunk's receipt.
using ChunkCallback = std::function<Status(std::span<const TensorRef> chunk)>;

// One slice a sharded update lands: piece `piece` of parameter `param` of the worker's
// sharding table (ShardingTable::Build of the engine's model, tp rank and size; the
// binding's _wsync.sharding_table lists the same parameters and pieces), and its bytes:
// the HF tensor `hf_name`'s slice as a contiguous tensor of its own, of `shape` (the HF
// shape with the piece's dim cut to its length), on `device`.
struct SliceRef {
  int param = 0;
  int piece = 0;
  std::string_view hf_name;
  DType dtype = DType::kBF16;
  Shape shape;
  std::span<const std::byte> bytes;
  Device device;
};
// One received chunk's slices, valid during the call (as ChunkCallback's views).
using SliceCallback = std::function<Status(std::span<const SliceRef> slices)>;

class ReceiverEngine {
 public:
  // InvalidArgument for an unknown backend, a negative worker_rank or a bad setting;
  // Unimplemented for a backend this build lacks.
  static Result<std::unique_ptr<ReceiverEngine>> Create(const ReceiverEngineOptions& options);
  ~ReceiverEngine();
  ReceiverEngine(const ReceiverEngine&) = delete;
  ReceiverEngine& operator=(const ReceiverEngine&) = delete;

  const ReceiverEngineOptions& options() const;

  // The init_info of /init_weight_transfer_engine; for nccl, blocks until the trainer's
  // group has formed. `peer_address` is the IP address of the HTTP peer that sent it (the
  // nccl backend dials a Gloo store only there, or at allowed_store_hosts); empty: none.
  Status Init(const nlohmann::json& init_info, const std::string& peer_address = "");
  // The update_info of /update_weights: receives every chunk of the update, calling
  // `on_chunk` for each; returns once the last chunk's callback has returned. An update
  // this worker refuses (a bad tensor list, one that does not match `metadata`) is
  // InvalidArgument; for nccl the trainer is told through the group's preflight vote.
  // `on_slices` takes the slices of a backend that lands slices (sharded); such a receive
  // without one fails with FailedPrecondition.
  Status Receive(const nlohmann::json& update_info, const ChunkCallback& on_chunk,
                 const SliceCallback& on_slices = nullptr);

  // The session routes, for a front that keeps the session rules in the engine (the same
  // rules as `wsync serve`, receiver/session.h): /start_weight_update opens a session
  // (FailedPrecondition while one is active); UpdateWeights is Receive within it
  // (FailedPrecondition outside one, and a failed update ends the session);
  // /finish_weight_update ends it (FailedPrecondition without one). A session with no
  // call for `timeout_seconds` expires, and Init from a new trainer takes over an idle one.
  // Receive keeps working without a session, for a front that keeps its own.
  Status StartWeightUpdate();
  Status UpdateWeights(const nlohmann::json& update_info, const ChunkCallback& on_chunk,
                       const SliceCallback& on_slices = nullptr);
  Status FinishWeightUpdate();
  ReceiverEngineSession Session() const;

  // The body of /fetch_weights (delta: brings the local checkpoint to a target version;
  // the answer is the route's reply). Other backends: Unimplemented.
  Result<nlohmann::json> Fetch(const nlohmann::json& body);
  // The row ranges [begin, end) by which the trainer digests tensors no trainer rank holds
  // whole (sharded, from the last init: DTensor ranks' dim-0 parts), by HF name; empty for
  // other backends and before Init. A receiver that verifies in line digests those tensors
  // by these ranges.
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> RowDigestRanges() const;
  // Releases communicators and mappings; Init may be called again afterwards. While
  // another call runs it does nothing (that call ends at its own deadline).
  void Shutdown();

 private:
  struct State;  // receiver_engine.cc
  explicit ReceiverEngine(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace wsync
