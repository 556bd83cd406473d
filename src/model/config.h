// ModelConfig: the shape of a model wsync can sync, and the list of its Hugging Face tensors.
//
// A ModelConfig holds the handful of sizes that fix every tensor name and shape of a
// checkpoint of one of four architectures: Qwen3 dense, Qwen3-MoE (a MoE MLP in every
// layer), DeepSeek-V3 (multi-head latent attention, shared experts, the first
// `first_k_dense_replace` layers dense, multi-token-prediction layers; Kimi-K2 has this
// architecture) and GLM-4.5 MoE (grouped-query attention with q/k/v biases, shared
// experts, dense first layers, MTP layers). Configs come from a small built-in registry
// (`qwen3-tiny`, `qwen3-8b`, `deepseek-v3`, ...) or from a Hugging Face `config.json`.
// HfTensors() turns a config into the exact checkpoint tensor list, in layer-contiguous
// order; the sharding table (sharding.h) and everything above it derive from that list.
// All functions are pure and thread-safe.
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
inline constexpr std::string_view kDeepseekV3 = "DeepseekV3ForCausalLM";
inline constexpr std::string_view kGlm4Moe = "Glm4MoeForCausalLM";

struct ModelConfig {
  // A registered name ("qwen3-8b") or, for a config.json, the directory it came from.
  std::string name;
  // kQwen3Dense, kQwen3Moe, kDeepseekV3 or kGlm4Moe.
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
  // Routed experts per MoE layer (MoE only, else 0); config.json's num_experts (Qwen3) or
  // n_routed_experts (DeepSeek-V3, GLM-4.5).
  int64_t num_experts = 0;
  DType dtype = DType::kBF16;

  // DeepSeek-V3 and GLM-4.5 only (0 for Qwen3):
  // Shared experts per MoE layer, held as ONE MLP of width moe_intermediate_size * n.
  int64_t n_shared_experts = 0;
  // Layers [0, first_k_dense_replace) have a dense MLP of width intermediate_size.
  int64_t first_k_dense_replace = 0;
  // Multi-token-prediction layers, numbered after the last decoder layer: each is enorm,
  // hnorm, eh_proj, shared_head.norm and a MoE decoder layer; its embed_tokens and
  // shared_head.head are the target's embed_tokens and lm_head (the drafter aliases them).
  int64_t num_nextn_predict_layers = 0;
  // Multi-head latent attention (DeepSeek-V3 only, else 0). q_lora_rank 0: no query
  // compression (q_proj instead of q_a_proj / q_a_layernorm / q_b_proj).
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // GLM-4.5 only: q/k/v_proj carry biases; q_norm/k_norm exist (Qwen3 always has them).
  bool attention_bias = false;
  bool use_qk_norm = false;

  bool is_moe() const { return architecture != kQwen3Dense; }
  bool is_mla() const { return architecture == kDeepseekV3; }
  // Whether decoder layer `layer` (MTP layers included) has a routed-expert MLP.
  bool is_moe_layer(int64_t layer) const { return is_moe() && layer >= first_k_dense_replace; }
  // Whether q_norm / k_norm exist.
  bool has_qk_norm() const {
    return architecture == kQwen3Dense || architecture == kQwen3Moe || use_qk_norm;
  }
  // Decoder layers in the checkpoint, MTP layers included.
  int64_t total_layers() const { return num_hidden_layers + num_nextn_predict_layers; }
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
// Qwen3-MoE moe_intermediate_size and num_experts. DeepSeek-V3 and GLM-4.5 also need
// moe_intermediate_size, n_routed_experts, n_shared_experts, first_k_dense_replace;
// DeepSeek-V3 kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim (q_lora_rank
// may be null). Optional: head_dim (hidden/heads), tie_word_embeddings (false),
// num_nextn_predict_layers (0), attention_bias and use_qk_norm (GLM, false), torch_dtype
// or dtype (bfloat16; also float16, float32). A checkpoint's quantization_config is
// ignored: tensors are listed in the unquantized dtype.
Result<ModelConfig> ParseHfConfig(std::string_view json_text, std::string_view origin);

// Checks sizes are positive and the MoE fields match the architecture; the error names
// the model and the field.
Status ValidateConfig(const ModelConfig& config);

// The checkpoint's tensors with exact Hugging Face names and shapes, layer by layer:
// embed_tokens; per layer the attention (Qwen3/GLM: q/k/v_proj (+ biases), o_proj, q_norm,
// k_norm; DeepSeek-V3: q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa,
// kv_a_layernorm, kv_b_proj, o_proj), the MLP (dense gate/up/down_proj, or the router
// gate (+ e_score_correction_bias, float32), each expert's gate/up/down_proj, then the
// shared_experts' gate/up/down_proj), input_layernorm, post_attention_layernorm; then
// each MTP layer (enorm, hnorm, eh_proj, shared_head.norm, then a decoder layer as above,
// under model.layers.<num_hidden_layers + k>.; a checkpoint's per-layer embed_tokens and
// shared_head.head copies are the target's embed_tokens and lm_head, sent once); then
// model.norm and, unless tied, lm_head. All in config.dtype except the float32 router bias.
std::vector<TensorMeta> HfTensors(const ModelConfig& config);

// The MTP layer (num_hidden_layers + k) an HF tensor belongs to, or -1 for a target
// tensor: the drafter's own tensors are exactly those with a layer here.
int64_t MtpLayerOf(const ModelConfig& config, std::string_view hf_name);

// Total bytes of HfTensors(config).
int64_t ModelBytes(const ModelConfig& config);
// Total elements of HfTensors(config).
int64_t ModelParams(const ModelConfig& config);

}  // namespace wsync
