// Server: the reference inference server behind `wsync serve`, as a library call.
//
// One process hosts one deployment of a model: a worker per TP x DP rank, each holding
// its own shards, receiving weights from a wsync trainer through the backend named in
// the options (nccl, ipc or delta) and answering vLLM's weight-transfer routes over
// HTTP (init_weight_transfer_engine, start/update/finish_weight_update, /health,
// /weight_checker, pause/resume, ...). Start() builds the workers, binds the HTTP port
// and returns once it is listening; the routes run on the server's own threads. Serve()
// blocks the calling thread until Stop(); Stop() stops accepting, lets in-flight calls
// finish (each bounded by the server's timeout) and joins every thread. Thread-safe:
// Stop() may be called from any thread, any number of times; the destructor stops.
//
//   ServerOptions o;
//   o.inference.model = "qwen3-tiny";
//   o.inference.backend = "ipc";
//   o.http.port = 8000;
//   WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Server> server, Server::Start(o));
//   server->Serve();  // until another thread calls server->Stop()
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/backend.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// What the server hosts and how it receives (`wsync serve` flags).
struct InferenceServerOptions {
  std::string model = "qwen3-tiny";  // registered name or a directory with config.json
  int tp = 1;
  int dp = 1;                  // data-parallel size of the deployment
  int dp_rank = -1;            // -1: host every DP rank; k: host only DP rank k (external LB)
  // Where the shards live: cpu, or cuda:N for the first worker and the next devices for
  // the others (worker i of this process, dp-major, on cuda:N+i), as vLLM gives each
  // worker its own GPU.
  Device device;
  std::string backend = kDefaultBackend;
  double timeout_seconds = 300;  // bound on every wait the server makes
  // A session (start_weight_update .. finish_weight_update) with no call for this many
  // seconds expires, so that the next trainer's start succeeds when the last trainer
  // vanished mid-session. Unset: timeout_seconds, the longest any call of a
  // live trainer waits. <= 0: sessions never expire. (`wsync serve --session-lease`)
  std::optional<double> session_lease_seconds;
  size_t digest_threads = 0;     // 0: hardware concurrency
  // An update whose tensors add up to more bytes is refused (ReceiverEngineOptions'
  // field of the same name). Default: no bound beyond the model's own size, which every
  // admitted update is within (each tensor is one of the model's, named once).
  uint64_t max_update_bytes = UINT64_MAX;
  // Fault injection for tests (`--fault never-join`), honest about what it fakes: the
  // control plane answers as usual, but init never joins the data plane and fails only
  // at the server's own deadline, like a server whose workers are wedged.
  bool fault_never_join = false;
  // Fault injection for tests (`--fault corrupt-landed`): the first worker (a host one)
  // lands model.embed_tokens.weight with one bit of its first byte flipped, every time it
  // lands it through WorkerStore::Load (every backend's full-tensor landing; delta's
  // planned copies only while in-line verification hashes landings). It fakes a landing
  // that wrote one wrong byte; only a check of the bytes landed or held (in-line
  // verification, a checksum read-back) can see it.
  bool fault_corrupt_landed = false;
  // The toy generation (/v1/completions): milliseconds between a request's tokens (0: as
  // fast as it goes; `--token-interval-ms`), so that requests stay in flight long enough
  // for pause modes to be observed; and the prefix cache's memory pool, allocated and
  // prefaulted at start (`--kv-cache-mib`; 0 disables prefix caching).
  double token_interval_ms = 0;
  size_t kv_cache_bytes = size_t{16} << 20;
  // Completions in flight at most (each holds an HTTP worker thread until it ends); more
  // are refused with 503. 0: no bound. Server::Start sets it below the HTTP worker
  // threads, so that requests frozen by a pause never hold every thread the
  // weight-transfer routes need.
  int max_requests = 0;
  // Backend settings from `wsync serve` flags; keys a backend does not use are ignored.
  // nccl: {"allowed_store_hosts": [HOST, ...]}; ipc: {"ipc_shm_dir": DIR}; delta:
  // {"base_checkpoint": DIR, "local_checkpoint_dir": DIR, "sync_root": DIR}.
  nlohmann::json backend_config = nlohmann::json::object();

  // Sleep, wake and the weights at start-up.
  // The weights every worker holds from start-up, as a vLLM server's after it loaded its
  // checkpoint: a Hugging Face safetensors checkpoint directory (`--checkpoint DIR`;
  // every tensor of the model, with its dtype and shape, and no other), or, when empty,
  // synthetic weights: SyntheticTrainer's values for `init_seed` (`--init-seed`), whose
  // default is no trainer's default seed, so that a sync visibly changes them.
  std::string checkpoint;
  static constexpr uint64_t kDefaultInitSeed = 0x5e4e5eed;
  uint64_t init_seed = kDefaultInitSeed;
  // Where sleep level 1 keeps host workers' weights, in an unlinked file per worker
  // (`--offload-dir`); empty: $TMPDIR, else /tmp. CUDA workers keep them in host memory.
  std::string offload_dir;

  // "none", or "fp8" (`--quantization fp8`): every linear weight of the decoder layers is
  // held as float8 e4m3 with float32 128x128 block scales, quantized per layer as soon as
  // the layer's tensors of an update have all landed (quant/fp8_sink.h); /weight_checker
  // checksums follow the HF FP8 checkpoint convention. Refused at start for a model and
  // tp whose shard boundaries are not multiples of 128.
  std::string quantization = "none";

  // "none", or "mtp" (`--speculative mtp`): the server holds the model's MTP drafter
  // beside the target. Its own layers (model.layers.<num_hidden_layers + k>.*) are
  // reloaded from the same update stream by every backend, in the same session; its
  // embed_tokens and shared_head.head are the target's embed_tokens and lm_head, not a
  // copy. Without a drafter an MTP model's MTP tensors are checked and dropped, as
  // vLLM's target model drops them. A model without MTP layers is refused.
  std::string speculative = "none";

  // LoRA adapters (`--max-loras N`, docs/lora.md): how many the server holds at once, by
  // name, each at one version, installed by lora sessions (/start_weight_update with
  // "wsync_lora") on every backend. A session for a new name while N are held
  // is refused (409 naming them; POST /v1/unload_lora_adapter frees one): an adapter
  // never disappears under requests that name it. 0: lora sessions are refused.
  int max_loras = 0;
};

// Where the server listens and what it accepts over HTTP.
struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                 // 0: pick a free port (Server::url() says which)
  std::string api_key;          // empty: no authentication
  size_t max_body_bytes = size_t{256} << 20;  // 256 MiB: room for MoE update_info lists
  // Seconds for a request's headers to arrive (from the connection's start, or from its
  // previous reply on a kept-alive connection). wsync's clients reuse idle
  // connections for a few seconds, well under this.
  double header_timeout_seconds = 10;
  // Seconds for a request's body to arrive once its headers have (the default
  // max_body_bytes in this time needs 9 MB/s).
  double body_timeout_seconds = 30;
  // Open connections at most; beyond it the server stops accepting and new connections
  // wait in the kernel's listen queue until one closes.
  int max_connections = 1024;
  // Threads that run the calls that last as long as generation does (/v1/completions,
  // /pause and /sleep with mode=wait): that many such calls at once, the rest queue. The
  // trainer's session and control calls (init, update, finish, ...) and the read-only
  // routes (GET /health, ...) have threads apart, so these never starve a sync.
  int worker_threads = 32;
  // Bytes of a body read and dropped past max_body_bytes, to answer 413 after it, before
  // the connection is cut instead.
  size_t discard_bytes = size_t{16} << 20;
  // Bytes of request bodies held at once (being read or handled); a body that would pass
  // it is answered 503. 0: twice max_body_bytes, at least 64 MiB.
  size_t body_budget_bytes = 0;
};

struct ServerOptions {
  InferenceServerOptions inference;
  HttpServerOptions http;
};

class Server {
 public:
  // InvalidArgument for options that cannot work (--tp 0, an unknown backend or model,
  // more CUDA workers than devices); Unavailable when the port cannot be bound.
  static Result<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // "http://HOST:PORT", the port as bound (options.http.port 0 picks one).
  const std::string& url() const;
  // What GET /health answers: model, backend, tp, dp, weight_version, syncs,
  // weights_consistent, session_active, ...
  nlohmann::json Health() const;
  int num_workers() const;
  // Blocks until Stop() has run (returns at once after it).
  void Serve();
  // Stops accepting, finishes in-flight calls, joins the HTTP threads; idempotent.
  void Stop();

 private:
  struct Impl;
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The backends a server can run (for --backend help and errors).
std::vector<std::string> ServerBackendNames();

}  // namespace wsync
