// InferenceServer: the reference inference server behind `wsync serve`.
//
// One process, one worker per TP x DP rank, each holding ITS shards of the model (a
// WorkerStore laid out by the sharding table) and running on its own WorkerThread. It
// hosts the receiving engine (src/receiver): the session rules every host shares
// (ReceiverSession, receiver/session.h: start -> update* -> finish, 409 on a second start
// or an update outside a session, a failed update ending the session, a lease that
// expires the session of a trainer that vanished) and update admission
// (receiver/admission.h, against the first worker's model). Of its own it keeps the
// weight version, pause/resume, and HF-level checksums read back from the shards. A toy generation (generation.h: /v1/completions, driven by pause,
// resume, /abort_requests and /reset_prefix_cache) reads the shards between sessions.
// The data plane belongs to its ReceiverBackend. Every call answers a Status: an
// exception from a backend becomes Internal naming the route, and never leaves the
// server held. Thread-safe: HTTP threads call it concurrently; the backend is called by
// one thread at a time.
#pragma once

#include <cstdint>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/process_memory.h"
#include "control/control_service.h"
#include "model/config.h"
#include "model/group_landing.h"
#include "receiver/admission.h"
#include "receiver/lora_spec.h"
#include "receiver/session.h"
#include "receiver/update_info.h"
#include "receiver/backend.h"
#include "server/generation.h"
#include "server/server_metrics.h"
#include "wsync/server.h"

namespace wsync {

class WorkerStore;   // model/worker_store.h
class WorkerThread;  // receiver/worker_thread.h

class InferenceServer : public ControlService {
 public:
  // `make_backend` is CreateReceiverBackend (src/backends) in production; it is passed in
  // so that this library does not depend on every backend.
  using BackendMaker = std::function<Result<std::unique_ptr<ReceiverBackend>>(std::string_view, ReceiverContext*)>;
  static Result<std::unique_ptr<InferenceServer>> Create(const InferenceServerOptions& options,
                                                         const BackendMaker& make_backend);
  ~InferenceServer() override;

  // The URL this server answers on, used in worker labels and messages.
  void set_url(const std::string& url);
  const ModelConfig& model() const { return model_; }
  size_t num_workers() const { return workers_.size(); }

  Status InitWeightTransfer(const nlohmann::json& init_info, const std::string& peer_address) override;
  Status StartWeightUpdate() override;
  Status StartWeightUpdateInlineVerified() override;
  // --speculative mtp: a session whose updates carry only the MTP drafter's tensors
  // (SkyRL's draft session); it must reload every drafter layer and leaves the target's
  // weight version as it is. Without a drafter: InvalidArgument.
  Status StartDraftWeightUpdate() override;
  // --- LoRA adapters (inference_server_lora.cc; options_.max_loras, docs/lora.md) ---
  // A lora session: the spec is parsed and checked against the model, the adapter is
  // staged on every worker and the backends land its tensors there (admission against
  // the adapter's own tensor list); finish checks every tensor landed (and the in-line
  // digests), then installs the version on every worker at once. A failed or abandoned
  // session leaves the previous version serving and the base weights' state untouched.
  // Refused: without --max-loras, on a backend that parses its own update_info (its
  // plane carries the model's tensors only), and for a new name while max_loras are held.
  Status StartLoraWeightUpdate(const nlohmann::json& lora, bool inline_verify) override;
  Result<nlohmann::json> Models() const override;
  Status UnloadLoraAdapter(const std::string& name) override;
  Result<nlohmann::json> LoraChecksums(const std::string& name, DigestAlgorithm algorithm) override;
  Status UpdateWeights(std::shared_ptr<const nlohmann::json> update_info) override;
  Status UpdateWeights(const nlohmann::json& update_info) {  // a copy; for tests
    return UpdateWeights(std::make_shared<const nlohmann::json>(update_info));
  }
  Status FinishWeightUpdate(const std::optional<std::string>& weight_version) override;
  // In-line verification (control_service.h): before the session finishes, the HF digest
  // of every named tensor is computed from what every replica's shards hold (and the
  // TP-replicated copies are checked against their primaries); any difference fails the
  // finish with DataLoss naming the tensors and the replica, the session ends with the
  // weights inconsistent and the weight version unchanged. The reply says
  // {"verified": {"tensors": N, "algorithm": A, "unverifiable": {name: why}}}; names
  // this server does not hold are unverifiable, not verified.
  Result<nlohmann::json> FinishWeightUpdateVerified(const std::optional<std::string>& weight_version,
                                                    const nlohmann::json& digests,
                                                    std::string_view algorithm) override;
  // The algorithm /health declares under "inline_verification" ("" when none: an fp8
  // server holds other bytes than it received).
  std::string_view InlineVerification() const;
  Result<nlohmann::json> FetchWeights(const nlohmann::json& body) override;
  int WorldSize(bool include_dp) const override;
  std::string WeightVersion() const override;
  void SetWeightVersion(std::string version) override;
  Status Pause(std::string_view mode, bool clear_cache) override;
  Status Resume() override;
  bool IsPaused() const override;
  Result<bool> ResetPrefixCache(bool reset_running_requests) override;
  Result<std::map<std::string, std::string>> Checksums(DigestAlgorithm algorithm) override;
  std::vector<std::string> TensorsNotHeld() const override;
  nlohmann::json Health() const override;
  // GET /metrics (server_metrics.h): the weight-update operations measured as they run,
  // how sessions ended, the weights' state and the generation's queue, as of now.
  Result<std::string> Metrics() const override;

  // --- vLLM's runtime weight checker (conf; server/runtime_checker.h) ---
  // POST /weight_checker without an "algorithm": "checksum" -> {"checksums", "engines"
  // (one object per DP engine)}, "reset" -> {"status": "reset"} (random values;
  // weights_consistent false until a sync finishes), "compare" -> {"match", "mismatches"}
  // against `baseline` (InvalidArgument without one, as vLLM). FailedPrecondition (409)
  // while sleeping (the weights are not resident) or while a weight session is open.
  Result<nlohmann::json> CheckRuntimeWeights(std::string_view action, const nlohmann::json* baseline) override;
  // ---- Generation (generation.h): /v1/completions, pause, /abort_requests, the prefix
  // cache. Pause/Resume/IsPaused/ResetPrefixCache above drive the same Generator.
  Result<nlohmann::json> Complete(const nlohmann::json& request) override;
  Result<int> AbortRequests(const std::vector<std::string>& request_ids) override;
  // Whether the toy generation caches prefixes (`--kv-cache-mib` > 0).
  bool prefix_caching() const { return generator_->prefix_caching(); }
  Generator& generator() { return *generator_; }
  // Ends every request in flight (Unavailable) before the HTTP server stops.
  void StopGenerating() { generator_->Shutdown(); }
  // Sleep, wake, memory and server info (inference_server_sleep.cc). Sleep pauses
  // scheduling first (Pause(mode, level >= 1)); level 1 offloads the weights and drops
  // the KV cache, level 2 discards both. 409 while a weight update is active. A failed
  // sleep puts back what it released, or says exactly what sleeps. WakeUp brings back
  // the named tags (weights, kv_cache, scheduling; none: all) and resumes scheduling once
  // nothing sleeps. Weights woken without their bytes leave weights_consistent false
  // until a weight update finishes.
  Status Sleep(int level, std::string_view mode) override;
  Status WakeUp(const std::vector<std::string>& tags) override;
  bool IsSleeping() const override;
  Status ReleaseKvCacheMemory() override;
  Status ShutdownWeightTransfer() override;
  nlohmann::json ServerInfo() const override;
  // The "memory" object of /health and /server_info: host_rss_bytes (this process),
  // weights_bytes (every worker's parameters), weights_resident_bytes (backed by memory
  // now), weights_offloaded_bytes, kv_cache_bytes, on CUDA device_used_bytes and
  // device_total_bytes ({"cuda:N": bytes} per device of a worker), and "sleep":
  // {"weights": awake|offloaded|discarded, "kv_cache": awake|discarded,
  //  "scheduling": awake|asleep}.
  nlohmann::json Memory() const;
  // FailedPrecondition naming `what` while the weights sleep ("... POST
  // /wake_up?tags=weights first") or hold discarded bytes (woken without them, not yet
  // refilled by a finished weight update): for whatever reads the weights (checksums,
  // the runtime weight checker, generation).
  Status CheckWeightsReadable(std::string_view what) const;

 private:
  struct Worker;
  InferenceServer() = default;
  // Runs `call` as operation `op` of the metrics (duration, in flight, outcome); a
  // DataLoss answer counts as a verification failure of the received data.
  Status Measured(WeightOperation op, const std::function<Status()>& call);
  // The bodies of the measured calls.
  Status InitNow(const nlohmann::json& init_info, const std::string& peer_address);
  Status UpdateNow(std::shared_ptr<const nlohmann::json> update_info);
  // `digests` (null: none) are checked as FinishWeightUpdateVerified says; `verified`
  // receives the reply's "verified" object.
  Status FinishNow(const std::optional<std::string>& weight_version, const nlohmann::json* digests = nullptr,
                   std::string_view algorithm = {}, nlohmann::json* verified = nullptr);
  // The comparison itself: DataLoss on a difference, InvalidArgument on a malformed map.
  Status VerifyInline(const nlohmann::json& digests, std::string_view algorithm, nlohmann::json* verified);
  Result<std::map<std::string, std::string>> ChecksumsHeld(DigestAlgorithm algorithm);
  // --quantization fp8: waits for any layer quantization still running on the workers
  // (a failed or expired update may leave some) before the weights are read or released.
  void SettleFp8();
  // Opens a session (StartWeightUpdate); `draft`: a draft session
  // (/start_draft_weight_update), whose updates carry the drafter's tensors only.
  Status StartSession(bool draft, bool inline_verify = false);
  // The "speculative" object of /health: null without a drafter.
  nlohmann::json Speculative() const;
  // The "lora" object of /health: null without --max-loras.
  nlohmann::json Loras() const;
  // Whether the open session is a lora session (its spec then in lora_session_).
  bool InLoraSession() const;
  // The lora session's update admission and finish (inference_server_lora.cc).
  AdmittedUpdate AdmitLora(std::shared_ptr<const nlohmann::json> update_info);
  Status FinishLora(const std::optional<std::string>& weight_version, const nlohmann::json* digests,
                    std::string_view algorithm, nlohmann::json* verified);
  // Points every worker's backend sink at its store (the weights) or at its adapter
  // staging. Only while no backend call runs.
  void UseWeightSinks();
  // Forgets a lora session that ended without its finish (expired, taken over, or
  // followed by another session): its staging is discarded, the weights' sinks restored.
  void EndLoraSession();
  void UseLoraSinks();
  // The generation's view of adapter `name`: its key and version (generation.h).
  Result<std::pair<uint64_t, std::string>> AdapterForGeneration(const std::string& name) const;
  std::optional<LoraSpec> lora_session_;         // GUARDED_BY(mu_)
  std::unique_ptr<UpdateAdmission> lora_admission_;  // the lora session's; used as admission_ is

  InferenceServerOptions options_;
  ModelConfig model_;
  std::vector<std::unique_ptr<Worker>> workers_;
  // By dp replica, for TP groups of host stores: landing digests of the tensors split
  // across the group (made at the first in-line verified session; before workers_ in
  // destruction, which waits for digests in flight).
  std::vector<std::unique_ptr<GroupLandingDigests>> group_landing_;
  ReceiverContext context_;
  std::unique_ptr<ReceiverBackend> backend_;
  std::unique_ptr<ReceiverSession> session_;
  std::unique_ptr<ServerMetrics> metrics_;  // set once in Create; thread-safe itself
  // What updates are admitted against: the first worker's model (every worker holds the
  // same one). Used by the update call that holds the session (ReceiverSession::BeginUpdate);
  // its identity cache does not own a body: the HTTP router decides how long a parsed body
  // lives.
  std::unique_ptr<StoreTensors> held_;
  std::unique_ptr<UpdateAdmission> admission_;

  mutable std::mutex mu_;
  std::string weight_version_ = "default";  // GUARDED_BY(mu_)
  int syncs_ = 0;             // GUARDED_BY(mu_): finished sessions
  // --speculative mtp: whether the session open now is a draft session, and the weight
  // version the drafter's layers were last reloaded whole at ("" while they hold no
  // trainer's bytes: start-up weights, or discarded by sleep).
  bool draft_session_ = false;               // GUARDED_BY(mu_)
  std::string drafter_version_;              // GUARDED_BY(mu_)
  int drafter_reloads_ = 0;                  // GUARDED_BY(mu_)
  // Peak extra memory (core/process_memory.h) of the session now open, of the last
  // finished sync and of the last checksum read-back; /health reports the last two.
  std::optional<MemoryWindow> sync_window_;         // GUARDED_BY(mu_)
  std::optional<MemoryPeak> last_sync_memory_;      // GUARDED_BY(mu_)
  std::optional<MemoryPeak> last_checksum_memory_;  // GUARDED_BY(mu_)
  bool shutting_down_ = false;  // GUARDED_BY(mu_)
  std::condition_variable shutdown_cv_;
  // Expires the session of a vanished trainer as soon as its lease runs out (not only when
  // the next call looks), and resumes a pause that trainer left behind.
  void WatchSessions();
  // Resumes generation if it is paused: the trainer that paused it is gone (`why`).
  void ResumeAfterLostTrainer(const char* why);
  std::thread watchdog_;

  // --- runtime weight checker (conf) ---
  Result<nlohmann::json> CheckRuntimeWeightsHeld(std::string_view action, const nlohmann::json* baseline);
  // Seeds each reset's values.
  uint64_t runtime_resets_ = 0;  // GUARDED_BY(mu_)
  // ---- Generation (inference_server_generation.cc) ----
  Status CreateGenerator();
  // Worker i's store and thread (workers_ is dp-major: the first replica comes first).
  const WorkerStore& GenerationStore(size_t worker) const;
  WorkerThread& GenerationThread(size_t worker) const;
  // Runs one generation step with the weights held still (Generator::WithWeights).
  bool WithWeightsForGeneration(const Generator::Step& step, std::string* why);
  // The probe of the weights token `token` reads (generation.h's WeightProbe), from the
  // first replica this server hosts: the row of model.embed_tokens.weight on the worker
  // whose vocabulary shard holds it, and that worker's model.norm.weight. A CUDA store's
  // bytes are copied to host on the worker's thread, bounded by timeout_seconds.
  Result<uint64_t> ProbeWeights(int64_t token);
  // Whether generation may read the weights: nothing sleeps (weights, KV cache,
  // scheduling) and the weights hold a trainer's bytes (not discarded and unrefilled).
  bool WeightsAwakeForGeneration() const;
  // Keeps generation from reading the weights while the returned lock lives: waits for a
  // step in progress (bounded by its probes' timeout) and holds later steps back. Whatever
  // changes the weights outside a session takes it (StartWeightUpdate, before the session
  // opens; a checker's reset; sleep after its pause).
  std::unique_lock<std::shared_mutex> ExcludeGeneration();
  // Held shared by a generation step, exclusively through ExcludeGeneration().
  std::shared_mutex weights_read_mu_;
  // Writers waiting for weights_read_mu_: generation steps wait while there are any, so
  // that a stream of steps cannot starve a session's start.
  std::atomic<int> weights_writers_waiting_{0};
  std::atomic<int> completions_in_flight_{0};  // bounded by options_.max_requests
  int embed_param_ = -1;  // index of model.embed_tokens.weight in every worker's table
  int norm_param_ = -1;   // index of model.norm.weight
  // Sleep, wake and the weights at start-up (inference_server_sleep.cc).
  enum class WeightsSleep { kAwake, kOffloaded, kDiscarded };
  // Fills every worker's weights from options_.checkpoint, else synthetic ones.
  Status FillWeightsAtStart();
  Status LoadCheckpointAtStart();
  Status FillSyntheticAtStart();
  // Loads one full HF tensor into every worker, each on its own thread.
  Status LoadOnEveryWorker(const TensorRef& hf);
  // Runs fn on every worker's thread (RunOnEveryWorker; `what` names the work in logs);
  // the outcome of each, in worker order.
  std::vector<Status> OnEachWorker(std::string_view what, const std::function<Status(Worker&)>& fn);
  Status SleepWeights(int level);
  Status WakeWeights();
  // The KV cache of the toy generation: hooks the Generator's DropKvCache /
  // RestoreKvCache / kv_cache_bytes_resident and prefix-caching flag sit behind.
  Status DropKvCache();
  Status RestoreKvCache();
  size_t KvCacheBytes() const;
  bool PrefixCaching() const;
  std::mutex sleep_call_mu_;  // one Sleep or WakeUp at a time
  WeightsSleep weights_sleep_ = WeightsSleep::kAwake;  // GUARDED_BY(mu_)
  bool kv_asleep_ = false;          // GUARDED_BY(mu_)
  bool scheduling_asleep_ = false;  // GUARDED_BY(mu_)
  bool sleep_paused_ = false;       // GUARDED_BY(mu_): a sleep paused scheduling; the last wake resumes it

  std::unique_ptr<Generator> generator_;  // declared last: its thread stops first
};

}  // namespace wsync
