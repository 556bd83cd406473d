// Fuzz target: a tensor name from a request body (update_info names, a checkpoint's
// header), as MtpLayerOf and ShardingTable::Serves read it to route a tensor to the MTP
// drafter. The answer is -1 or one of the model's MTP layers, exactly when the name starts
// with that layer's "model.layers.N." prefix.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "model/config.h"
#include "model/sharding.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const wsync::ModelConfig config = *wsync::LookupModel("deepseek-v3-tiny");
  static const wsync::ShardingTable plain = *wsync::ShardingTable::Build(config, 0, 1);
  std::string_view name(reinterpret_cast<const char*>(data), size);
  const int64_t layer = wsync::MtpLayerOf(config, name);
  if (layer != -1 && (layer < config.num_hidden_layers || layer >= config.total_layers())) std::abort();
  bool prefixed = false;
  for (int64_t l = config.num_hidden_layers; l < config.total_layers(); ++l) {
    const std::string prefix = fmt::format("model.layers.{}.", l);
    if (name.starts_with(prefix)) prefixed = true;
  }
  // A name with leading zeros ("model.layers.03.x") is an MTP layer's too.
  if (layer >= 0 && !prefixed && name.find("layers.0") == std::string_view::npos) std::abort();
  if (prefixed && layer < 0) std::abort();
  if (plain.Serves(name) != (layer < 0)) std::abort();
  return 0;
}
