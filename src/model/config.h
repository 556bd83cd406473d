// ModelConfig: the shape of a model wsync can sync, and the list of its Hugging Face tensors.
//
// A ModelConfig holds the handful of sizes that fix every tensor name and shape of a
// Qwen3 dense or Qwen3-MoE checkpoint. Configs come from a small built-in registry
// (`qwen3-tiny`, `qwen3-8b`, ...) or from a Hugging Face `config.json`. HfTensors() turns
// a config into the exact checkpoint tensor list, in layer-contiguous order; the sharding
// table (sharding.h) and everything above it derive from that list. Every MoE model here
// has a MoE MLP in every layer. All functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/dtype.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

inline constexpr std::string_view kQwen3Dense = "Qwen3ForCausalLM";
inline constexpr std::string_view kQwen3Moe = "Qwen3MoeForCausalLM";

struct ModelConfig {
  // A registered name ("qwen3-8b") or, for a config.json, the directory it came from.
  std::string name;
  // kQwen3Dense or kQwen3Moe.
  std::string architecture;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  // Dense MLP width; MoE configs carry it too but no tensor uses it.
  int64_t intermediate_size = 0;
  // Width of one expert's MLP (MoE only, else 0).
  int64_t moe_intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  // True when lm_head shares embed_tokens' storage: the checkpoint has no lm_head.weight.
  bool tie_word_embeddings = false;
  // Routed experts per layer (MoE only, else 0).
  int64_t num_experts = 0;
  DType dtype = DType::kBF16;

  bool is_moe() const { return architecture == kQwen3Moe; }
  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// The registered names, sorted.
std::vector<std::string> RegisteredModelNames();

// A registered name, or a directory holding a Hugging Face config.json (a path to the
// config.json file itself is accepted too). An unknown name is NotFound and lists the
// registered names; a bad config.json is InvalidArgument naming the file and the field.
Result<ModelConfig> LookupModel(std::string_view name_or_dir);

// Parses the text of a Hugging Face config.json. `origin` names the file in errors and
// becomes the config's name. Required: architectures, vocab_size, hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, and for
// MoE moe_intermediate_size and num_experts. Optional: head_dim (hidden/heads),
// tie_word_embeddings (false), torch_dtype or dtype (bfloat16; also float16, float32).
Result<ModelConfig> ParseHfConfig(std::string_view json_text, std::string_view origin);

// Checks sizes are positive and the MoE fields match the architecture; the error names
// the model and the field.
Status ValidateConfig(const ModelConfig& config);

// The checkpoint's tensors with exact Hugging Face names and shapes, layer by layer:
// embed_tokens; per layer q/k/v/o_proj, q_norm, k_norm, the MLP (gate/up/down_proj, or
// the router gate then each expert's gate/up/down_proj), input_layernorm,
// post_attention_layernorm; then model.norm and, unless tied, lm_head. All in config.dtype.
std::vector<TensorMeta> HfTensors(const ModelConfig& config);

// Total bytes of HfTensors(config).
int64_t ModelBytes(const ModelConfig& config);
// Total elements of HfTensors(config).
int64_t ModelParams(const ModelConfig& config);

}  // namespace wsync
