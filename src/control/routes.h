// The control-plane routes, by name: the one place their paths are spelled.
//
// vLLM's dev-mode RLHF routes (reference/vllm_weight_transfer.md §2) plus wsync's
// /fetch_weights (delta), /metrics, /health and the reference server's toy /v1/completions. The server's router (http_routes.cc) and the
// trainer's session driver both name routes through these constants; no other code
// spells a route.
#pragma once

#include <string_view>

namespace wsync::route {

inline constexpr std::string_view kInitWeightTransfer = "/init_weight_transfer_engine";
inline constexpr std::string_view kShutdownWeightTransfer = "/shutdown_weight_transfer_engine";
inline constexpr std::string_view kStartWeightUpdate = "/start_weight_update";
inline constexpr std::string_view kStartDraftWeightUpdate = "/start_draft_weight_update";
inline constexpr std::string_view kUpdateWeights = "/update_weights";
inline constexpr std::string_view kFinishWeightUpdate = "/finish_weight_update";
inline constexpr std::string_view kUpdateWeightVersion = "/update_weight_version";
inline constexpr std::string_view kFetchWeights = "/fetch_weights";
inline constexpr std::string_view kPause = "/pause";
inline constexpr std::string_view kResume = "/resume";
inline constexpr std::string_view kResetPrefixCache = "/reset_prefix_cache";
inline constexpr std::string_view kWeightChecker = "/weight_checker";
inline constexpr std::string_view kGetWorldSize = "/get_world_size";
inline constexpr std::string_view kWeightInfo = "/weight_info";
inline constexpr std::string_view kIsPaused = "/is_paused";
inline constexpr std::string_view kHealth = "/health";
inline constexpr std::string_view kSleep = "/sleep";
inline constexpr std::string_view kWakeUp = "/wake_up";
inline constexpr std::string_view kReleaseKvCacheMemory = "/release_kv_cache_memory";
inline constexpr std::string_view kIsSleeping = "/is_sleeping";
inline constexpr std::string_view kAbortRequests = "/abort_requests";
inline constexpr std::string_view kServerInfo = "/server_info";
// The Prometheus text exposition (format 0.0.4) of the server's counters.
inline constexpr std::string_view kMetrics = "/metrics";
inline constexpr std::string_view kCollectiveRpc = "/collective_rpc";
// The toy generation route (OpenAI completions shape) of the reference server.
inline constexpr std::string_view kCompletions = "/v1/completions";
// OpenAI's model list (the base model and each LoRA adapter, as vLLM lists them), and
// vLLM's route that drops a LoRA adapter by name.
inline constexpr std::string_view kModels = "/v1/models";
inline constexpr std::string_view kUnloadLoraAdapter = "/v1/unload_lora_adapter";

}  // namespace wsync::route
