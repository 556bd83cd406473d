// Generator: the reference server's toy generation (POST /v1/completions), whose tokens
// depend on the weights the server holds at the moment each token is produced.
//
// It exists so that what an RL loop does around a weight sync is observable on a CPU:
// pause abort|wait|keep with requests in flight, /abort_requests, a prefix cache that
// goes stale across a sync until it is reset, and the weight version of every token.
//
// The token function (exact, so that a test can compute the tokens itself):
//
//   Mix(x)            splitmix64's finalizer on 64 bits (GenerationMix).
//   Probe(t)          the weights token t reads: h = kProbeSeed, then h = Mix(h ^ w) for
//                     every 8-byte little-endian word w of t's row of
//                     model.embed_tokens.weight, then of model.norm.weight (a last partial
//                     word zero-padded) (WeightProbe), read at the moment of the step.
//   Absorb(s, t, p)   Mix((s ^ p) + (t + 1) * kGolden), mod 2^64 (AbsorbToken).
//   Sample(s)         s % vocab_size (SampleToken).
//
//   A request's first step starts from s = kInitialState (or from the state a prefix-cache
//   hit holds), absorbs every remaining prompt token t as s = Absorb(s, t, Probe(t)),
//   and produces y1 = Sample(s). Step k > 1 absorbs the previous token with the weights
//   of now, s = Absorb(s, y(k-1), Probe(y(k-1))), and produces yk = Sample(s). The weight
//   version of yk is the server's version at that step.
//
//   A request whose "model" names a LoRA adapter reads Probe_a(t) = Mix(Probe(t) ^ K) in
//   place of Probe(t), where K is the key of the adapter's version live at that step
//   (LoraAdapter::key, receiver/lora_store.h: it folds the digests of the adapter's
//   tensors), and the weight version of each of its tokens is that adapter version. Such
//   a request neither reads nor fills the prefix cache.
//
// Prefix cache (prefix_cache.h): the first step looks up the longest cached prefix of
// whole blocks of 16 prompt tokens, ending at most at the prompt's last token but one
// (the last token is always computed, as in vLLM), reports it as cached_tokens, and
// caches the state after every whole prompt block it computed. A request whose running
// state is reset (ResetPrefixCache with reset_running_requests, vLLM's preemption)
// recomputes its whole state, prompt and tokens so far, with the weights of its next step.
//
// Scheduling: one scheduler thread steps every running request whose pace allows
// (token_interval_ms between a request's tokens; 0: as fast as it goes), all of one
// step's reads under one WithWeights call. A step runs only while generation is not
// paused in mode keep and WithWeights lets it (no weight session, weights awake);
// otherwise requests wait, each for at most timeout_seconds, then end with an error
// naming the request and what it waited for. Pause follows vLLM: abort ends the requests
// in flight now with finish_reason "abort" and their partial tokens; wait lets them run
// to completion and returns when they have (bounded by timeout_seconds); keep freezes
// them until Resume; every mode queues new requests until Resume. Pause returns only
// when no step is in progress, so that the caller may then change or release the weights.
//
// Thread-safe: HTTP threads call every method concurrently; Complete blocks its caller
// until the request ends, every wait bounded.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/prefix_cache.h"
#include "wsync/status.h"

namespace wsync {

// ---- The token function ----
inline constexpr uint64_t kInitialState = 0x243f6a8885a308d3ULL;
inline constexpr uint64_t kProbeSeed = 0x13198a2e03707344ULL;
inline constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
uint64_t GenerationMix(uint64_t x);
uint64_t WeightProbe(std::span<const std::byte> embed_row, std::span<const std::byte> norm);
uint64_t AbsorbToken(uint64_t state, int64_t token, uint64_t probe);
int64_t SampleToken(uint64_t state, int64_t vocab_size);
// The printable rendering of token ids a reply's "text" holds: a printable ASCII id
// (32..126) is its character, any other id is "<id>".
std::string RenderTokens(std::span<const int32_t> tokens);

// ---- Requests (the untrusted body of POST /v1/completions) ----
struct CompletionLimits {
  std::string model;            // the served model's name; "model" must be it when given
  int64_t vocab_size = 0;       // token ids must be below it
  int max_tokens = 4096;        // the largest "max_tokens"
  size_t max_prompt_tokens = 32768;
  size_t max_request_id_bytes = 256;
  // Whether "model" names a LoRA adapter the server holds (null: none does).
  std::function<bool(std::string_view)> is_adapter;
};
struct CompletionRequest {
  std::string request_id;       // empty: the generator names it "cmpl-<n>"
  std::vector<int32_t> prompt;  // token ids; a string prompt's UTF-8 bytes
  int max_tokens = 16;
  std::string adapter;          // the LoRA adapter "model" names; empty: the base model
};
// Parses an OpenAI completions body: "prompt" (a string or a list of token ids, non-empty),
// "max_tokens" (default 16, in [1, limits.max_tokens]), "model" (optional: limits.model, or
// an adapter limits.is_adapter knows; NotFound otherwise, as OpenAI servers answer 404),
// "request_id" (optional string).
// "stream": true and "n" other than 1 are refused. InvalidArgument naming the field.
Result<CompletionRequest> ParseCompletionRequest(const nlohmann::json& body, const CompletionLimits& limits);

// ---- The generator ----
struct GeneratorOptions {
  CompletionLimits limits;
  // The key and version of the live version of an adapter (generation's K above), read
  // inside a step; NotFound once it is unloaded. Null: no request names an adapter.
  std::function<Result<std::pair<uint64_t, std::string>>(const std::string& adapter)> adapter;
  double token_interval_ms = 0;       // pause between a request's tokens; 0: none
  double timeout_seconds = 300;       // the bound on any wait (a frozen request, a drain)
  size_t kv_cache_bytes = size_t{16} << 20;  // prefix cache pool; 0 disables prefix caching
  size_t kv_block_bytes = 0;          // bytes one block of 16 tokens takes in the pool
};

class Generator {
 public:
  // The weights as one step reads them: Probe(t) as above, and the weight version now.
  using Probe = std::function<Result<uint64_t>(int64_t token)>;
  using Step = std::function<void(const Probe& probe, const std::string& version)>;
  // Runs `step` with the weights held still (no weight session starts and the weights
  // stay awake until it returns) and returns true; returns false with `*why` ("a weight
  // session is active") without running it when the weights may not be read now.
  using WithWeights = std::function<bool(const Step& step, std::string* why)>;

  static Result<std::unique_ptr<Generator>> Create(const GeneratorOptions& options, WithWeights with_weights);
  ~Generator();  // Shutdown(), then joins the scheduler
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // POST /v1/completions: parses `body`, runs the request and answers vLLM's reply:
  // {"id", "object": "text_completion", "created", "model", "choices": [{"index": 0,
  // "text", "token_ids", "finish_reason": "length"|"abort", "weight_versions", "logprobs":
  // null, "stop_reason": null}], "usage": {"prompt_tokens", "completion_tokens",
  // "total_tokens", "prompt_tokens_details": {"cached_tokens"}}, "weight_version"}.
  // Blocks until the request ends. A request that waited longer than timeout_seconds is
  // DeadlineExceeded naming it; Unavailable once the generator shuts down.
  Result<nlohmann::json> Complete(const nlohmann::json& body);
  Result<nlohmann::json> Run(CompletionRequest request);

  // vLLM's pause_generation (see the header comment). InvalidArgument for an unknown mode;
  // DeadlineExceeded naming what still runs when `wait` does not drain in time (the
  // generator stays paused). clear_cache resets the prefix cache for abort and wait.
  Status Pause(std::string_view mode, bool clear_cache);
  Status Resume();  // OK when not paused
  bool IsPaused() const;
  // Ends the named requests (all of them when empty) with finish_reason "abort"; unknown
  // ids are skipped. The number ended.
  int Abort(const std::vector<std::string>& request_ids);
  // Clears the prefix cache: false (and the cache kept) while requests run, unless
  // reset_running_requests, which also makes every running request recompute its state.
  bool ResetPrefixCache(bool reset_running_requests);
  // Sleep and wake_up of the KV cache: Drop releases the pool's memory (entries gone),
  // Restore maps it again, empty.
  Status DropKvCache();
  Status RestoreKvCache();
  size_t kv_cache_bytes_resident() const;
  bool prefix_caching() const { return cache_->enabled(); }
  // The "generation" object of /health: running, waiting, paused, pause_mode, completed,
  // aborted, token_interval_ms, prefix_cache {...}.
  nlohmann::json Health() const;
  // Ends every request with Unavailable, refuses new ones. Idempotent.
  void Shutdown();

 private:
  using Clock = std::chrono::steady_clock;
  struct Request;
  Generator(GeneratorOptions options, WithWeights with_weights);
  void Loop();
  void FinishLocked(const std::shared_ptr<Request>& r, std::string_view reason, Status error = Status::Ok());
  nlohmann::json ReplyLocked(const Request& r) const;
  // Waits, bounded by timeout_seconds, until no step is in progress. Needs `lock` on mu_.
  Status WaitStepLocked(std::unique_lock<std::mutex>& lock, std::string_view what);

  const GeneratorOptions options_;
  const WithWeights with_weights_;
  std::unique_ptr<PrefixCache> cache_;

  mutable std::mutex mu_;
  std::condition_variable wake_cv_;  // the scheduler: a request, a resume, a shutdown
  std::condition_variable done_cv_;  // waiters: a request ended, a step ended, a drain
  std::deque<std::shared_ptr<Request>> queued_;                 // GUARDED_BY(mu_)
  std::vector<std::shared_ptr<Request>> running_;               // GUARDED_BY(mu_)
  std::map<std::string, std::shared_ptr<Request>> by_id_;       // GUARDED_BY(mu_)
  bool paused_ = false;                                         // GUARDED_BY(mu_)
  std::string pause_mode_;                                      // GUARDED_BY(mu_)
  bool in_step_ = false;                                        // GUARDED_BY(mu_)
  bool stopping_ = false;                                       // GUARDED_BY(mu_)
  uint64_t next_id_ = 0;                                        // GUARDED_BY(mu_)
  uint64_t completed_ = 0;                                      // GUARDED_BY(mu_)
  uint64_t aborted_ = 0;                                        // GUARDED_BY(mu_)
  uint64_t failed_ = 0;                                         // GUARDED_BY(mu_)
  std::thread scheduler_;
};

}  // namespace wsync
