// Fuzz target: the body of POST /v1/completions as JSON text. ParseCompletionRequest()
// either refuses it or yields a request within the limits it was given (a non-empty
// prompt of ids below the vocabulary, max_tokens in range, a bounded request id), and a
// reply rendered from its prompt is valid JSON.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <nlohmann/json.hpp>

#include "control/http_routes.h"
#include "server/generation.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // As the router reads the body: depth-bounded, only the fields the route reads.
  wsync::Result<nlohmann::json> parsed = wsync::HttpRouter::ParseBody(
      "/v1/completions", std::string_view(reinterpret_cast<const char*>(data), size));
  if (!parsed.ok()) return 0;
  const nlohmann::json& j = *parsed;
  wsync::CompletionLimits limits;
  limits.model = "qwen3-tiny";
  limits.vocab_size = 4096;
  limits.max_tokens = 64;
  limits.max_prompt_tokens = 512;
  limits.max_request_id_bytes = 32;
  wsync::Result<wsync::CompletionRequest> r = wsync::ParseCompletionRequest(j, limits);
  if (!r.ok()) {
    if (r.status().message().empty()) std::abort();
    return 0;
  }
  if (r->prompt.empty() || r->prompt.size() > limits.max_prompt_tokens) std::abort();
  for (int32_t t : r->prompt) {
    if (t < 0 || t >= limits.vocab_size) std::abort();
  }
  if (r->max_tokens < 1 || r->max_tokens > limits.max_tokens) std::abort();
  if (r->request_id.size() > limits.max_request_id_bytes) std::abort();
  std::string text = wsync::RenderTokens(r->prompt);
  if (text.size() < r->prompt.size()) std::abort();
  (void)nlohmann::json{{"text", text}, {"id", r->request_id}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return 0;
}
