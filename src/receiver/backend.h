// ReceiverBackend: the seam a backend author implements on the inference side.
//
// An inference server (inference_server.h) owns the control-plane session state
// (start/update/finish, 409s, versions; session.h) and one ReceiverBackend, chosen by
// `wsync serve --backend`. The backend owns the data plane: it joins the trainer's
// communicator at Init and lands the bytes of each Update in every worker's shards.
// The server calls the backend from HTTP threads, one call at a time (it serializes
// them); the backend fans work out to the workers' own threads (worker_fanout.h) and
// lands bytes only through each worker's WorkerSink (model/worker_sink.h), so that the
// same backend also serves a single in-process worker (receiver/receiver_engine.h).
// Internal: users program against include/wsync/server.h; a new backend implements
// this interface in its folder and registers in src/backends/registry.cc.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

class WorkerSink;    // model/worker_sink.h
class WorkerThread;  // receiver/worker_thread.h
struct ModelConfig;  // model/config.h

// One inference worker: where its bytes land (its shards, or a ReceiverEngine's
// callback), its thread and where it sits in the server.
struct ReceiverWorker {
  WorkerSink* sink = nullptr;
  WorkerThread* thread = nullptr;
  int dp_index = 0;  // data-parallel index within the deployment
  int tp_rank = 0;
  Device device;
  std::string label;  // "http://127.0.0.1:8001 worker dp0/tp1", for messages
};

struct ReceiverContext {
  const ModelConfig* model = nullptr;  // null for a ReceiverEngine (which learns names per update)
  std::vector<ReceiverWorker> workers;
  int tp_size = 1;
  std::string server_url;
  double timeout_seconds = 300;  // the server's bound on any wait
  // A worker's place in the deployment, dp-major: dp_index * tp_size + tp_rank (the
  // offset of its rank in a trainer's group, or of its reader in a shared region).
  int DeploymentIndex(const ReceiverWorker& w) const { return w.dp_index * tp_size + w.tp_rank; }
  // The bound on the waits of a session: the server's timeout_seconds, or the trainer's
  // (init_info "timeout_seconds") when that is shorter.
  double TimeoutFor(std::optional<double> trainer_seconds) const {
    return std::min(timeout_seconds, trainer_seconds.value_or(timeout_seconds));
  }
  // Backend-specific settings from `wsync serve` flags, e.g. for `delta`:
  // {"base_checkpoint": DIR, "local_checkpoint_dir": DIR}; for `nccl`:
  // {"allowed_store_hosts": [HOST, ...]} (`--allow-store-host`). Unused keys are ignored.
  nlohmann::json backend_config = nlohmann::json::object();
};

// An update as the server hands it to the backend. `reject` is non-OK when the server
// refuses the update (bad payload, wrong session state); backends whose data plane is a
// collective still take part in it far enough to tell the trainer "no" instead of
// leaving it waiting, then return `reject`.
// `update_info` is the same object, update after update, while the trainer sends
// byte-identical bodies (so are `tensors`): a backend may keep what it derives from them
// keyed by the pointer, holding the shared_ptr so that the address stays theirs.
struct UpdateRequest {
  std::shared_ptr<const nlohmann::json> update_info;  // never null
  // Parsed and checked against the model when reject is OK; never null (empty when the
  // backend parses its own update_info or the update was rejected before parsing).
  std::shared_ptr<const std::vector<TensorMeta>> tensors;
  Status reject;
  // A lora session's update (docs/lora.md): `tensors` is the adapter's admitted list and
  // the workers' sinks stage the adapter.
  bool lora = false;
};

class ReceiverBackend {
 public:
  virtual ~ReceiverBackend() = default;
  virtual std::string_view name() const = 0;
  virtual Status Init(const nlohmann::json& init_info) = 0;
  // Init as sent by the control-plane peer at `peer_address` (its IP address as text;
  // empty when unknown). A backend that dials an address named in init_info overrides
  // this and admits only the peer's own address, or hosts the server's flags allow
  // (backend_config "allowed_store_hosts"); the default ignores the peer.
  virtual Status InitFromPeer(const nlohmann::json& init_info, const std::string& peer_address) {
    return Init(init_info);
  }
  virtual Status Start() { return Status::Ok(); }
  virtual Status Update(const UpdateRequest& request) = 0;
  virtual Status Finish() { return Status::Ok(); }
  virtual Result<nlohmann::json> Fetch(const nlohmann::json& body) {
    return Unimplemented("backend has no /fetch_weights");
  }
  // True when update_info is not vLLM's tensor list (names/dtype_names/shapes) but the
  // backend's own (`delta`: {"target_version", ...}): the server then hands it over
  // unparsed, with UpdateRequest::tensors empty.
  virtual bool ParsesOwnUpdateInfo() const { return false; }
  // Whether a lora session's tensors (docs/lora.md) travel over this backend: its
  // update_info is then a tensor list, admitted against the adapter's declaration.
  virtual bool CarriesAdapters() const { return !ParsesOwnUpdateInfo(); }
  // The tensors the trainer digests by row ranges in line (no trainer rank holds them
  // whole: docs/protocol.md), by HF name, their ranges ascending; known from Init. The
  // server then digests those ranges as the tensor lands. Empty: none.
  virtual std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> RowDigestRanges() const { return {}; }
  // Whether the backend lands tensors as slices (WorkerSink::LoadPiece) rather than whole
  // (Load): a worker's own landing digests never see such a tensor whole, so a server
  // digests what it lands by its TP group's shards even at TP=1.
  virtual bool LandsSlices() const { return false; }
  // Releases communicators and mappings; later calls fail until Init.
  virtual void Shutdown() {}
};

using ReceiverFactory = std::function<Result<std::unique_ptr<ReceiverBackend>>(ReceiverContext*)>;

// Backends register once (one line each, in src/backends/registry.cc).
Result<std::unique_ptr<ReceiverBackend>> CreateReceiverBackend(std::string_view name,
                                                               ReceiverContext* context);
std::vector<std::string> ReceiverBackendNames();

}  // namespace wsync
