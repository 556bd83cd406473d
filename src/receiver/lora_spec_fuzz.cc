// Fuzz target: the "wsync_lora" object of /start_weight_update (receiver/lora_spec.h),
// read as JSON and checked against qwen3-tiny. Every answer is a refusal or a spec within
// its bounds whose tensor list has an A and a B matrix of rank r per targeted module of
// every decoder layer (UBSan flags any overflow).
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "receiver/lora_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const wsync::ModelConfig model = *wsync::LookupModel("qwen3-tiny");
  if (size > 4096) return 0;
  nlohmann::json j = nlohmann::json::parse(std::string_view(reinterpret_cast<const char*>(data), size), nullptr,
                                           /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  wsync::Result<wsync::LoraSpec> spec = wsync::ParseLoraSpec(j, model);
  if (!spec.ok()) return 0;
  if (spec->r < 1 || spec->r > wsync::kMaxLoraRank || !(spec->alpha > 0) || spec->target_modules.empty()) std::abort();
  if (spec->name.empty() || spec->name.size() > wsync::kMaxLoraNameBytes) std::abort();
  wsync::Result<std::vector<wsync::TensorMeta>> tensors = wsync::LoraTensors(*spec, model);
  if (!tensors.ok()) return 0;
  if (tensors->size() != 2 * spec->target_modules.size() * static_cast<size_t>(model.num_hidden_layers)) std::abort();
  for (size_t i = 0; i < tensors->size(); ++i) {
    const wsync::TensorMeta& t = (*tensors)[i];
    if (t.shape.size() != 2 || t.shape[0] < 1 || t.shape[1] < 1) std::abort();
    if ((i % 2 == 0 ? t.shape[0] : t.shape[1]) != spec->r) std::abort();
  }
  // The spec's own JSON parses back to the same spec.
  wsync::Result<wsync::LoraSpec> again = wsync::ParseLoraSpec(spec->ToJson(), model);
  if (!again.ok() || again->name != spec->name || again->r != spec->r || again->target_modules != spec->target_modules) {
    std::abort();
  }
  return 0;
}
