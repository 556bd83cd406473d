// ControlService: what an inference server does for each control-plane route.
//
// The HTTP layer (http_server.h) parses requests, checks the API key and maps Status
// codes to HTTP status codes; everything else is here, behind an interface that knows
// nothing about HTTP. Routes follow vLLM's dev-mode RLHF routes
// (reference/vllm_weight_transfer.md §2). Implementations must be thread-safe: the HTTP
// server calls them from its worker threads, and long calls (init, update) block one
// worker until their own deadline. The read-only calls (WorldSize, WeightVersion,
// IsPaused, Health) run on a few threads of their own so that /health answers during
// long calls: they must not wait for those calls (no lock held across a slow call).
// Implementations answer every failure as a Status; an exception escaping one is a bug
// (the HTTP layer still answers it with 500).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/digest.h"
#include "wsync/status.h"

namespace wsync {

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
  // POST /start_weight_update; FailedPrecondition if a session is already active.
  virtual Status StartWeightUpdate() = 0;
  // POST /update_weights {"update_info": {...}}; returns after the data has landed. A
  // byte-identical body arrives as the same object as the previous one (the HTTP layer
  // keeps the last parsed body), so what a service derives from it may be kept and
  // reused while it holds the pointer.
  virtual Status UpdateWeights(std::shared_ptr<const nlohmann::json> update_info) = 0;
  // POST /finish_weight_update [{"weight_version": "..."}].
  virtual Status FinishWeightUpdate(const std::optional<std::string>& weight_version) = 0;
  // POST /fetch_weights (delta backend); other backends answer Unimplemented.
  virtual Result<nlohmann::json> FetchWeights(const nlohmann::json& body) {
    return Unimplemented("this server's backend has no /fetch_weights");
  }

  // GET /get_world_size?include_dp=: TP*PP*DP, or TP*PP.
  virtual int WorldSize(bool include_dp) const = 0;
  // GET /weight_info, POST /update_weight_version.
  virtual std::string WeightVersion() const = 0;
  virtual void SetWeightVersion(std::string version) = 0;

  // POST /pause?mode=abort|wait|keep, /resume, GET /is_paused, POST /reset_prefix_cache.
  virtual Status Pause(std::string_view mode, bool clear_cache) = 0;
  virtual Status Resume() = 0;
  virtual bool IsPaused() const = 0;
  virtual Status ResetPrefixCache() = 0;

  // POST /weight_checker {"action":"checksum"}: digest of every full HF tensor.
  virtual Result<std::map<std::string, std::string>> Checksums(DigestAlgorithm algorithm) = 0;

  // GET /health body (liveness; never requires the API key).
  virtual nlohmann::json Health() const = 0;
};

}  // namespace wsync
