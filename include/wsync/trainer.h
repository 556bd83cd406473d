// TrainerEngine: the trainer side of one weight-transfer backend.
//
// Built once per trainer rank from TrainerOptions; Init() discovers the servers (each
// must run the backend asked for: a server whose /health names another is refused,
// naming both) and builds the data plane (for `nccl`: the broadcast group, with every
// server joining concurrently); SendWeights() runs one whole sync: start -> update
// (concurrently with the data plane) -> finish, on every server, and returns its timings.
// Only rank 0 talks to servers; every other rank drains its source. Each sync makes ONE
// pass over the source on every rank (a pass may be a collective among the ranks).
// Every wait is bounded by `timeout_seconds`. A failed sync closes every server's session
// and never leaves a half-open one; when the failure tore the data plane down, the next
// SendWeights() builds it again by itself (no Init() needed). Not thread-safe: one call
// at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "wsync/backend.h"
#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// The trainer ranks' own group: one rank's membership in the group of every rank of
// the trainer, as the trainer's parallel setup built it (for example through the
// rendezvous helpers wsync's tools use). The engine sees only this handle; backends that
// need collectives among the ranks use the group behind it. Thread-safe.
class RankGroup {
 public:
  virtual ~RankGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
};

struct SyncProgress {
  size_t bytes_done = 0;
  size_t bytes_total = 0;
  size_t chunks_done = 0;
  size_t chunks_total = 0;
};

// A LoRA adapter the trainer syncs instead of the model (docs/lora.md): PEFT's A and B
// matrices of `target_modules` in every decoder layer, unscaled, named
// base_model.model.<module>.lora_A.weight / .lora_B.weight. The servers apply vLLM's
// PEFTHelper scaling, alpha / r (alpha / sqrt(r) with use_rslora).
struct LoraAdapterOptions {
  std::string name;                         // what requests name in "model"; [A-Za-z0-9._-], at most 64
  int64_t r = 0;                            // rank, 1..1024
  double alpha = 0;                         // PEFT's lora_alpha, > 0
  bool use_rslora = false;
  std::vector<std::string> target_modules;  // leaf names: q_proj, v_proj, ...
  std::string dtype;                        // torch name of every A/B matrix; empty: the servers' model dtype
};

struct TrainerOptions {
  std::vector<std::string> servers;  // base URLs, deployment-major: [dep0_dp0, dep0_dp1, ...]
  std::string backend = kDefaultBackend;
  int data_parallel_size = 1;        // servers per deployment (SkyRL's data_parallel_size)
  double bucket_gb = 1.0;            // packed buffer = max(bucket, largest tensor)
  bool packed = true;
  int num_buffers = 2;               // packing overlaps the broadcast of the previous chunk
  double timeout_seconds = 300;      // bound on every wait
  std::string api_key;               // `Authorization: Bearer` on every call
  // Open each sync with /start_draft_weight_update (SkyRL's draft session): the servers'
  // MTP drafter alone, so the source must hold only MTP-layer tensors. wsync's servers
  // reload the drafter in the ordinary session already; this is for trainers that send it
  // apart.
  bool draft_session = false;
  // Set: every sync is a lora session for this adapter (/start_weight_update with
  // "wsync_lora"), its version the sync's weight_version (required), and the source holds
  // exactly the adapter's tensors. The servers stage it beside the version they serve and
  // install it at finish; a failed sync leaves them serving the previous version. Every
  // backend: nccl and ipc as for full weights, sharded over an adapter group (rank 0
  // sends, Gloo only), delta through one file below the sync dir (docs/lora.md).
  std::optional<LoraAdapterOptions> lora;
  std::string store_host = "127.0.0.1";  // where the rendezvous store listens (servers dial it)
  Device device;
  int rank = 0;                      // trainer rank; rank 0 is the sender
  // The trainer ranks' own group: each rank passes its membership (comm->rank() == rank),
  // for backends whose ranks agree on something at Init. `ipc`: each rank on a GPU no
  // lower rank is on exports its own staging slots there and rank 0 sends the merged map;
  // Init is then a collective of every rank (call it on all ranks at once, with no other
  // collective on `comm` in flight); no collective runs per sync. Empty (the default), or a
  // group of one: rank 0 alone exports, the others only drain their sources. Other
  // backends ignore it.
  std::shared_ptr<RankGroup> comm;
  // The chosen backend's own settings as KEY=VALUE text (`wsync push --backend-option
  // KEY=VALUE`); each backend documents its keys with its options struct and refuses keys
  // it does not know. `nccl`: piece_mb. `ipc`: mode, export_kind, backing,
  // stall_after_chunks. `delta`: sync_dir, max_file_gb, publish_threads, base_checkpoint.
  std::map<std::string, std::string> backend_options;
  // In-line verification of every sync: the trainer hashes (xxh3-128) each host tensor of
  // its pass as its data plane copies it (`sharded` with several ranks: each hashes its
  // share of what it holds and rank 0 gathers), and on a GPU `nccl` and `ipc` digest what
  // they send, and `sharded` ranks what they hold, on the device (large tensors by row
  // ranges), and sends the digests with
  // finish_weight_update to the servers whose /health declares "inline_verification"
  // (a vLLM server running wsync's plugin counts as declaring it, and takes them by
  // collective RPC just before finish: see SessionDriver::FinishVerified);
  // such a server hashes what it lands as it lands it and refuses to finish when that
  // differs (the sync fails naming the tensors; the server keeps its previous weight
  // version and reports weights_consistent: false). SyncStats says what was verified.
  // Every trainer rank must be given the same value. `push --no-inline-verify` turns it
  // off.
  bool inline_verify = true;
  // Called from the sending thread after every chunk.
  std::function<void(const SyncProgress&)> progress;
};

struct SyncStats {
  size_t bytes = 0;
  size_t tensors = 0;
  size_t chunks = 0;
  double seconds = 0;           // start_weight_update .. finish_weight_update answered
  double start_seconds = 0;     // POST /start_weight_update
  double transfer_seconds = 0;  // update_weights + data plane
  double finish_seconds = 0;    // POST /finish_weight_update
  // Every server's read-back digests matched the source's (set by the callers that
  // verify: `push --verify`, Python's send_weights(verify=True)); false when not checked.
  bool verified = false;
  double verify_seconds = 0;    // the read-back verification, when verified
  // In-line verification (TrainerOptions::inline_verify). inline_digests: the tensors
  // this sync's pass hashed as it read them (host tensors; 0 when off or when no server
  // declared support); each server that declares "inline_verification" in its /health
  // gets them with finish and compares them with what it holds before it finishes.
  // inline_verified_servers: those servers (every digest either matched or was named
  // unverifiable by the server, e.g. a tensor it does not hold; a mismatch fails the
  // sync); inline_unverified_servers: the servers that do not declare support (vLLM
  // with its own engines, the Python worker server), whose sync is not verified in-line.
  // inline_verified_tensors: the tensors the first verified server matched.
  size_t inline_digests = 0;
  size_t inline_verified_servers = 0;
  size_t inline_unverified_servers = 0;
  size_t inline_verified_tensors = 0;
};

class TrainerEngine {
 public:
  virtual ~TrainerEngine() = default;
  // `metadata` is the model the source will send; it sizes the packed buffers.
  virtual Status Init(const std::vector<TensorMeta>& metadata) = 0;
  // Init from the source this rank will send: its metadata, and for a backend whose
  // ranks each send only what they hold (`sharded`), its HeldNames(), which every later
  // sync's source must then hold too (else the sync fails on every rank, naming the
  // rank). Default: Init(source.metadata()).
  virtual Status Init(const WeightSource& source) { return Init(source.metadata()); }
  // Syncs `source` to every server in one pass over it. Its metadata must list the
  // tensors Init() saw, in any order (else InvalidArgument naming a differing tensor,
  // before anything reaches the servers). Each tensor is checked against the metadata as it streams: a
  // mismatch (name, dtype, shape or byte count) fails the sync with InvalidArgument
  // naming the tensor, aborts it on every server (their /health says
  // weights_consistent: false until a sync completes); other ranks' passes then fail at
  // their sources' own deadlines, or at once when the trainer stops its ranks' group.
  virtual Result<SyncStats> SendWeights(WeightSource& source,
                                        const std::optional<std::string>& weight_version) = 0;
  // A degraded sync: the same, but only the servers `live` names (indices into
  // TrainerOptions::servers, ascending; empty: all) take part; the others are left as
  // they are, neither contacted nor waited for. The plan made for the whole fleet stays
  // (worker ids, routing): a backend that can run it for a part of the fleet (`sharded`)
  // rebuilds its group with the live servers' workers when the set changes, and a later
  // sync to every server (SendWeights, or `live` empty) brings the whole fleet back,
  // re-initializing servers that restarted. Every trainer rank passes the same `live`.
  // Backends that broadcast to the whole fleet answer Unimplemented.
  virtual Result<SyncStats> SendWeightsTo(WeightSource& source, const std::optional<std::string>& weight_version,
                                          const std::vector<int>& live) {
    if (!live.empty()) return Unimplemented("this backend syncs every server: it has no degraded sync");
    return SendWeights(source, weight_version);
  }
  virtual void Shutdown() {}
};

Result<std::unique_ptr<TrainerEngine>> CreateTrainerEngine(const TrainerOptions& options);
std::vector<std::string> TrainerBackendNames();

}  // namespace wsync
