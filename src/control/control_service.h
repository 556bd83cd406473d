// ControlService: what an inference server does for each control-plane route.
//
// The HTTP layer (http_server.h) parses requests, checks the API key and maps Status
// codes to HTTP status codes; everything else is here, behind an interface that knows
// nothing about HTTP. Routes follow vLLM's dev-mode RLHF routes
// (reference/vllm_weight_transfer.md §2). Implementations must be thread-safe: the HTTP
// server calls them from its worker threads, and long calls (init, update) block one
// worker until their own deadline. The read-only calls (WorldSize, WeightVersion,
// IsPaused, Health, Metrics) run on a few threads of their own so that /health answers during
// long calls: they must not wait for those calls (no lock held across a slow call;
// IsSleeping and ServerInfo too).
// Implementations answer every failure as a Status; an exception escaping one is a bug
// (the HTTP layer still answers it with 500).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/digest.h"
#include "wsync/status.h"

namespace wsync {

// The keys of `baseline` whose digest differs in `current` or that `current` lacks, and
// the keys of `current` that `baseline` lacks, sorted (as vLLM lists them):
// /weight_checker's "mismatches", for both checkers. Non-string baseline values never match.
std::vector<std::string> DigestMismatches(const std::map<std::string, std::string>& current,
                                          const nlohmann::json& baseline);

class ControlService {
 public:
  virtual ~ControlService() = default;

  // POST /init_weight_transfer_engine {"init_info": {...}}. May block in a rendezvous.
  // `peer_address` is the IP address (as text, e.g. "10.0.0.7" or "::1") of the HTTP peer
  // that sent the request, empty when the call does not come from the network. A backend
  // that dials an address named in init_info (the nccl backend's Gloo store) dials only
  // the peer's own address, or hosts the server's flags admit.
  virtual Status InitWeightTransfer(const nlohmann::json& init_info,
                                    const std::string& peer_address) = 0;
  // POST /shutdown_weight_transfer_engine: releases the data plane init set up (the
  // trainer's connection) without stopping the server; a later init sets it up again.
  // FailedPrecondition while a weight update is active.
  virtual Status ShutdownWeightTransfer() { return Unimplemented("this server cannot release its data plane"); }
  // POST /start_weight_update; FailedPrecondition if a session is already active.
  virtual Status StartWeightUpdate() = 0;
  // POST /start_weight_update {"wsync_inline_verify": true}: the trainer will send in-line
  // digests with this session's finish; a service that verifies in-line hashes what it
  // lands from now on. Without it a finish that carries digests is still verified, from
  // what the service holds at finish.
  virtual Status StartWeightUpdateInlineVerified() { return StartWeightUpdate(); }
  // POST /start_weight_update {"wsync_lora": {...}}: a session for one LoRA adapter
  // (docs/lora.md), `lora` the untrusted "wsync_lora" object; its updates carry the
  // adapter's tensors only and its finish installs that adapter version.
  virtual Status StartLoraWeightUpdate(const nlohmann::json& lora, bool inline_verify) {
    return InvalidArgument("this server holds no LoRA adapters");
  }
  // GET /v1/models: {"object": "list", "data": [...]}, the base model and its adapters.
  virtual Result<nlohmann::json> Models() const { return Unimplemented("this server lists no models"); }
  // POST /v1/unload_lora_adapter {"lora_name": ...}: NotFound when none is loaded.
  virtual Status UnloadLoraAdapter(const std::string& name) {
    return NotFound(fmt::format("no LoRA adapter named {} is loaded", name));
  }
  // POST /weight_checker {"action": "checksum", "algorithm": A, "lora": NAME}: the digest
  // of each of the adapter's tensors as held now, checked equal on every worker.
  virtual Result<nlohmann::json> LoraChecksums(const std::string& name, DigestAlgorithm algorithm) {
    return NotFound(fmt::format("no LoRA adapter named {} is loaded", name));
  }
  // /start_draft_weight_update: a session for the speculative drafter's weights.
  virtual Status StartDraftWeightUpdate() { return InvalidArgument("this server has no draft model"); }
  // POST /update_weights {"update_info": {...}}; returns after the data has landed.
  // `update_info` is an object, or vLLM's list form: an array of objects (the HTTP layer
  // checks that much), one per worker indexed by global worker rank (dp_index * TP +
  // tp_rank), which the service bounds by its world size before using any entry. A
  // byte-identical body arrives as the same object as the previous one (the HTTP layer
  // keeps the last parsed body), so what a service derives from it may be kept and
  // reused while it holds the pointer.
  virtual Status UpdateWeights(std::shared_ptr<const nlohmann::json> update_info) = 0;
  // POST /finish_weight_update [{"weight_version": "..."}].
  virtual Status FinishWeightUpdate(const std::optional<std::string>& weight_version) = 0;
  // POST /finish_weight_update carrying the trainer's in-line digests: `digests` is the
  // body's "wsync_digests" object ({HF name: lowercase hex}, untrusted) under
  // `algorithm` (its "digest_algorithm"). A service that declares
  // "inline_verification" in its /health compares them with what it holds before the
  // session may finish (a mismatch fails the finish and leaves the weight version as it
  // was) and returns the fields its reply adds ({"verified": {...}}). Default: the
  // digests are ignored, as by a server that never declared support.
  virtual Result<nlohmann::json> FinishWeightUpdateVerified(const std::optional<std::string>& weight_version,
                                                            const nlohmann::json& digests,
                                                            std::string_view algorithm) {
    WSYNC_RETURN_IF_ERROR(FinishWeightUpdate(weight_version));
    return nlohmann::json::object();
  }
  // POST /fetch_weights (delta backend); other backends answer Unimplemented.
  virtual Result<nlohmann::json> FetchWeights(const nlohmann::json& body) {
    return Unimplemented("this server's backend has no /fetch_weights");
  }

  // GET /get_world_size?include_dp=: TP*PP*DP, or TP*PP.
  virtual int WorldSize(bool include_dp) const = 0;
  // GET /weight_info, POST /update_weight_version.
  virtual std::string WeightVersion() const = 0;
  virtual void SetWeightVersion(std::string version) = 0;

  // POST /pause?mode=abort|wait|keep, /resume, GET /is_paused (vLLM's pause_generation:
  // abort ends requests in flight, wait drains them, keep freezes them until /resume).
  virtual Status Pause(std::string_view mode, bool clear_cache) = 0;
  virtual Status Resume() = 0;
  virtual bool IsPaused() const = 0;
  // POST /reset_prefix_cache?reset_running_requests=: whether the cache was reset (vLLM
  // answers {"success": false} when requests still run and may not be reset).
  virtual Result<bool> ResetPrefixCache(bool reset_running_requests) = 0;

  // POST /weight_checker {"action": "checksum"|"compare", "algorithm": ...}: wsync's digest
  // of every full HF tensor, keyed by HF name.
  virtual Result<std::map<std::string, std::string>> Checksums(DigestAlgorithm algorithm) = 0;
  // The model's HF tensors this server checks and drops instead of holding (an MTP
  // layer's without a drafter): Checksums has no digest of them. The checksum reply lists
  // them as "not_held" when there are any.
  virtual std::vector<std::string> TensorsNotHeld() const { return {}; }
  // POST /weight_checker with no "algorithm": vLLM's weight checker over each worker's
  // runtime parameters (keys "dp{d}:pp{p}:pcp{c}:tp{t}:{param}", SHA-256).
  // `action` is "checksum", "reset" or "compare"; `baseline` is the compare body's
  // baseline, an object of strings, never nullptr for compare (the HTTP layer answers
  // vLLM's 400 without one). The reply body.
  virtual Result<nlohmann::json> CheckRuntimeWeights(std::string_view action, const nlohmann::json* baseline) {
    return Unimplemented("this server has no runtime weight checker; name an 'algorithm'");
  }

  // POST /sleep?level=0|1|2&mode=: vLLM's sleep (level 0 pauses scheduling; 1 also
  // offloads the weights and drops the KV cache; 2 discards both). The HTTP layer answers
  // vLLM's {"status": "sleeping", "level": N}.
  virtual Status Sleep(int level, std::string_view mode) {
    return Unimplemented("this server has no sleep mode");
  }
  // POST /wake_up[?tags=weights&tags=kv_cache&tags=scheduling]: brings back what is
  // named, or everything when `tags` is empty.
  virtual Status WakeUp(const std::vector<std::string>& tags) {
    return Unimplemented("this server has no sleep mode");
  }
  // POST /release_kv_cache_memory: vLLM's discard of the KV cache (the prefix cache with
  // it) after a completed pause: FailedPrecondition unless generation is paused with no
  // request left, or while any memory sleeps. The cache then sleeps (tag kv_cache) until
  // /wake_up brings it back, which also resumes scheduling once nothing sleeps.
  virtual Status ReleaseKvCacheMemory() { return Unimplemented("this server has no KV cache to release"); }
  // GET /is_sleeping: true until every tag is awake.
  virtual bool IsSleeping() const { return false; }
  // POST /abort_requests {"request_ids": [...]} (empty: all): the number aborted.
  virtual Result<int> AbortRequests(const std::vector<std::string>& request_ids) {
    return Unimplemented("this server runs no requests");
  }
  // POST /v1/completions: the reference server's toy generation (OpenAI completions
  // shape); returns once the request has finished.
  virtual Result<nlohmann::json> Complete(const nlohmann::json& request) {
    return Unimplemented("this server does not generate");
  }
  // GET /server_info: configuration, capabilities and memory (read-only, quick).
  virtual nlohmann::json ServerInfo() const { return Health(); }
  // GET /metrics: the Prometheus text exposition (format 0.0.4, valid UTF-8) of the
  // server's counters (read-only, quick: it must not wait for a long call).
  virtual Result<std::string> Metrics() const { return Unimplemented("this server exports no metrics"); }

  // GET /health body (liveness; never requires the API key).
  virtual nlohmann::json Health() const = 0;
};

}  // namespace wsync
