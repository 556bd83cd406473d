#include "model/config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/checked_math.h"
#include "core/json_limits.h"
#include "core/shape_math.h"

namespace wsync {
namespace {

ModelConfig Dense(std::string name, int64_t vocab, int64_t hidden, int64_t inter, int64_t layers,
                  int64_t heads, int64_t kv_heads, int64_t head_dim, bool tied) {
  ModelConfig c;
  c.name = std::move(name);
  c.architecture = std::string(kQwen3Dense);
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.tie_word_embeddings = tied;
  return c;
}

ModelConfig Moe(ModelConfig c, int64_t moe_inter, int64_t experts) {
  c.architecture = std::string(kQwen3Moe);
  c.moe_intermediate_size = moe_inter;
  c.num_experts = experts;
  return c;
}

// A DeepSeek-V3 / GLM-4.5 MoE config: routed and shared experts, dense first layers, MTP.
ModelConfig Routed(ModelConfig c, std::string_view architecture, int64_t moe_inter, int64_t experts,
                   int64_t shared, int64_t first_dense, int64_t nextn) {
  c.architecture = std::string(architecture);
  c.moe_intermediate_size = moe_inter;
  c.num_experts = experts;
  c.n_shared_experts = shared;
  c.first_k_dense_replace = first_dense;
  c.num_nextn_predict_layers = nextn;
  return c;
}

// A DeepSeek-V3-architecture config (MLA; Kimi-K2 shares it): heads of nope + rope width.
ModelConfig Mla(ModelConfig c, int64_t q_lora, int64_t kv_lora, int64_t nope, int64_t rope, int64_t v) {
  c.head_dim = nope + rope;
  c.q_lora_rank = q_lora;
  c.kv_lora_rank = kv_lora;
  c.qk_nope_head_dim = nope;
  c.qk_rope_head_dim = rope;
  c.v_head_dim = v;
  return c;
}

// GLM-4.5: q/k/v biases, no q/k norms.
ModelConfig Glm(ModelConfig c) {
  c.attention_bias = true;
  return c;
}

const std::map<std::string, ModelConfig, std::less<>>& Registry() {
  static const auto* registry = [] {
    auto* m = new std::map<std::string, ModelConfig, std::less<>>;
    for (ModelConfig c : {
             Dense("qwen3-tiny", 4096, 256, 512, 4, 4, 2, 64, false),
             Dense("qwen3-0.6b", 151936, 1024, 3072, 28, 16, 8, 128, true),
             Dense("qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 128, false),
             // Qwen/Qwen3-32B config.json (the NCCL M2N benchmark's model).
             Dense("qwen3-32b", 151936, 5120, 25600, 64, 64, 8, 128, false),
             Moe(Dense("qwen3-moe-tiny", 4096, 256, 512, 2, 4, 2, 64, false), 128, 8),
             Moe(Dense("qwen3-30b-a3b", 151936, 2048, 6144, 48, 32, 4, 128, false), 768, 128),
             // Qwen/Qwen3-235B-A22B config.json.
             Moe(Dense("qwen3-235b-a22b", 151936, 4096, 12288, 94, 64, 4, 128, false), 1536, 128),
             // deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2-Instruct config.json.
             Mla(Routed(Dense("deepseek-v3", 129280, 7168, 18432, 61, 128, 128, 0, false), kDeepseekV3,
                        2048, 256, 1, 3, 1), 1536, 512, 128, 64, 128),
             Mla(Routed(Dense("kimi-k2", 163840, 7168, 18432, 61, 64, 64, 0, false), kDeepseekV3,
                        2048, 384, 1, 1, 0), 1536, 512, 128, 64, 128),
             // A 2.8T-parameter class for planning (no published checkpoint): Kimi-K2's
             // architecture with 1024 routed experts over 64 layers.
             Mla(Routed(Dense("moe-2.8t", 163840, 7168, 18432, 64, 64, 64, 0, false), kDeepseekV3,
                        2048, 1024, 1, 1, 0), 1536, 512, 128, 64, 128),
             Mla(Routed(Dense("deepseek-v3-tiny", 4096, 256, 512, 3, 4, 4, 0, false), kDeepseekV3,
                        128, 8, 1, 1, 1), 64, 32, 32, 16, 32),
             // zai-org/GLM-4.5-Air config.json.
             Glm(Routed(Dense("glm-4.5-air", 151552, 4096, 10944, 46, 96, 8, 128, false), kGlm4Moe,
                        1408, 128, 1, 1, 1)),
             Glm(Routed(Dense("glm4-moe-tiny", 4096, 256, 512, 3, 4, 2, 64, false), kGlm4Moe,
                        128, 8, 1, 1, 1)),
             // GLM-4.5's architecture at 0.6B parameters, one MTP layer (a benchmark size).
             Glm(Routed(Dense("glm4-moe-0.6b", 151552, 1024, 2816, 12, 16, 4, 64, false), kGlm4Moe,
                        256, 16, 1, 1, 1)),
         }) {
      std::string name = c.name;
      m->emplace(std::move(name), std::move(c));
    }
    return m;
  }();
  return *registry;
}

// Reads an integer field; `required` false returns `fallback` when it is absent.
Result<int64_t> IntField(const nlohmann::json& j, std::string_view origin, const char* field,
                         bool required, int64_t fallback = 0) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (!required) return fallback;
    return InvalidArgument(fmt::format("{}: missing field {}", origin, field));
  }
  if (!it->is_number_integer()) {
    return InvalidArgument(
        fmt::format("{}: field {} must be an integer, got {}", origin, field, JsonExcerpt(*it)));
  }
  return it->get<int64_t>();
}

// Reads a boolean field that defaults to false.
Result<bool> BoolField(const nlohmann::json& j, std::string_view origin, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return false;
  if (!it->is_boolean()) {
    return InvalidArgument(
        fmt::format("{}: field {} must be a boolean, got {}", origin, field, JsonExcerpt(*it)));
  }
  return it->get<bool>();
}

// The DeepSeek-V3 / GLM-4.5 fields of a config.json (ValidateConfig checks their ranges).
Status ParseDeepseekGlm(const nlohmann::json& j, std::string_view origin, ModelConfig& c) {
  WSYNC_ASSIGN_OR_RETURN(c.moe_intermediate_size, IntField(j, origin, "moe_intermediate_size", true));
  WSYNC_ASSIGN_OR_RETURN(c.num_experts, IntField(j, origin, "n_routed_experts", true));
  WSYNC_ASSIGN_OR_RETURN(c.n_shared_experts, IntField(j, origin, "n_shared_experts", false, 0));
  WSYNC_ASSIGN_OR_RETURN(c.first_k_dense_replace, IntField(j, origin, "first_k_dense_replace", false, 0));
  WSYNC_ASSIGN_OR_RETURN(c.num_nextn_predict_layers,
                         IntField(j, origin, "num_nextn_predict_layers", false, 0));
  // wsync models every layer from first_k_dense_replace on as MoE.
  WSYNC_ASSIGN_OR_RETURN(int64_t freq, IntField(j, origin, "moe_layer_freq", false, 1));
  if (freq != 1) {
    return InvalidArgument(fmt::format("{}: field moe_layer_freq is {}: only 1 is supported", origin, freq));
  }
  if (c.architecture == kGlm4Moe) {
    WSYNC_ASSIGN_OR_RETURN(c.attention_bias, BoolField(j, origin, "attention_bias"));
    WSYNC_ASSIGN_OR_RETURN(c.use_qk_norm, BoolField(j, origin, "use_qk_norm"));
    return Status::Ok();
  }
  WSYNC_ASSIGN_OR_RETURN(c.q_lora_rank, IntField(j, origin, "q_lora_rank", false, 0));
  WSYNC_ASSIGN_OR_RETURN(c.kv_lora_rank, IntField(j, origin, "kv_lora_rank", true));
  WSYNC_ASSIGN_OR_RETURN(c.qk_nope_head_dim, IntField(j, origin, "qk_nope_head_dim", true));
  WSYNC_ASSIGN_OR_RETURN(c.qk_rope_head_dim, IntField(j, origin, "qk_rope_head_dim", true));
  WSYNC_ASSIGN_OR_RETURN(c.v_head_dim, IntField(j, origin, "v_head_dim", true));
  // MLA has no head_dim of its own: a query/key head is nope + rope wide.
  std::optional<int64_t> qk = CheckedAdd(c.qk_nope_head_dim, c.qk_rope_head_dim);
  if (!qk) return InvalidArgument(fmt::format("{}: qk_nope_head_dim + qk_rope_head_dim overflows", origin));
  c.head_dim = *qk;
  return Status::Ok();
}

}  // namespace

std::vector<std::string> RegisteredModelNames() {
  std::vector<std::string> names;
  for (const auto& [name, config] : Registry()) names.push_back(name);
  return names;
}

// Bounds on a config's sizes and counts, and on its number of HF tensors: far above any
// real model, low enough that no shape product or per-layer allocation can run away.
constexpr int64_t kMaxConfigDim = int64_t{1} << 24;
constexpr int64_t kMaxConfigTensors = int64_t{1} << 18;
constexpr int64_t kMaxNextnLayers = 64;

namespace {

bool KnownArchitecture(std::string_view a) {
  return a == kQwen3Dense || a == kQwen3Moe || a == kDeepseekV3 || a == kGlm4Moe;
}

std::string SupportedArchitectures() {
  return fmt::format("{}, {}, {}, {}", kQwen3Dense, kQwen3Moe, kDeepseekV3, kGlm4Moe);
}

// The DeepSeek-V3 / GLM-4.5 fields: shared experts, dense first layers, MTP layers, MLA.
Status ValidateDeepseekGlm(const ModelConfig& c) {
  const bool qwen = c.architecture == kQwen3Dense || c.architecture == kQwen3Moe;
  const std::pair<const char*, int64_t> extra[] = {
      {"n_shared_experts", c.n_shared_experts},
      {"first_k_dense_replace", c.first_k_dense_replace},
      {"num_nextn_predict_layers", c.num_nextn_predict_layers},
      {"q_lora_rank", c.q_lora_rank},
      {"kv_lora_rank", c.kv_lora_rank},
      {"qk_nope_head_dim", c.qk_nope_head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim},
      {"v_head_dim", c.v_head_dim},
  };
  for (const auto& [field, value] : extra) {
    if (value < 0) return InvalidArgument(fmt::format("model {}: {} is {}, must not be negative", c.name, field, value));
    if (value > kMaxConfigDim) {
      return InvalidArgument(fmt::format("model {}: {} is {}, over {}", c.name, field, value, kMaxConfigDim));
    }
    if (qwen && value != 0) {
      return InvalidArgument(fmt::format("model {}: {} is {}, but {} has none", c.name, field, value, c.architecture));
    }
  }
  if (qwen && (c.attention_bias || c.use_qk_norm)) {
    return InvalidArgument(fmt::format("model {}: attention_bias/use_qk_norm are GLM-4.5 fields", c.name));
  }
  if (qwen) return Status::Ok();
  if (c.first_k_dense_replace > c.num_hidden_layers) {
    return InvalidArgument(fmt::format("model {}: first_k_dense_replace {} is over num_hidden_layers {}",
                                       c.name, c.first_k_dense_replace, c.num_hidden_layers));
  }
  if (c.num_nextn_predict_layers > kMaxNextnLayers) {
    return InvalidArgument(fmt::format("model {}: num_nextn_predict_layers {} is over {}", c.name,
                                       c.num_nextn_predict_layers, kMaxNextnLayers));
  }
  if (c.is_mla()) {
    const std::pair<const char*, int64_t> mla[] = {{"kv_lora_rank", c.kv_lora_rank},
                                                   {"qk_nope_head_dim", c.qk_nope_head_dim},
                                                   {"qk_rope_head_dim", c.qk_rope_head_dim},
                                                   {"v_head_dim", c.v_head_dim}};
    for (const auto& [field, value] : mla) {
      if (value <= 0) return InvalidArgument(fmt::format("model {}: {} is {}, must be positive", c.name, field, value));
    }
    if (c.attention_bias || c.use_qk_norm) {
      return InvalidArgument(fmt::format("model {}: attention_bias/use_qk_norm are GLM-4.5 fields", c.name));
    }
  } else if (c.q_lora_rank != 0 || c.kv_lora_rank != 0 || c.qk_nope_head_dim != 0 ||
             c.qk_rope_head_dim != 0 || c.v_head_dim != 0) {
    return InvalidArgument(fmt::format("model {}: MLA sizes (q_lora_rank, kv_lora_rank, qk_*_head_dim, "
                                       "v_head_dim) belong to {} only", c.name, kDeepseekV3));
  }
  return Status::Ok();
}

}  // namespace

Status ValidateConfig(const ModelConfig& c) {
  if (!KnownArchitecture(c.architecture)) {
    return InvalidArgument(fmt::format("model {}: unknown architecture '{}' (supported: {})",
                                       c.name, c.architecture, SupportedArchitectures()));
  }
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
  };
  for (const auto& [field, value] : sizes) {
    if (value <= 0) return InvalidArgument(fmt::format("model {}: {} is {}, must be positive", c.name, field, value));
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return InvalidArgument(fmt::format(
        "model {}: num_attention_heads {} is not a multiple of num_key_value_heads {}", c.name,
        c.num_attention_heads, c.num_key_value_heads));
  }
  if (c.is_moe()) {
    if (c.moe_intermediate_size <= 0 || c.num_experts <= 0) {
      return InvalidArgument(fmt::format(
          "model {}: a MoE model needs positive moe_intermediate_size and num_experts, got {} and {}",
          c.name, c.moe_intermediate_size, c.num_experts));
    }
  } else if (c.num_experts != 0) {
    return InvalidArgument(
        fmt::format("model {}: dense model has num_experts {}", c.name, c.num_experts));
  }
  WSYNC_RETURN_IF_ERROR(ValidateDeepseekGlm(c));
  // A config.json comes with a checkpoint: bound its numbers, far above any real model,
  // before HfTensors allocates per layer and per expert and before any shape product.
  const std::pair<const char*, int64_t> bounded[] = {
      {"vocab_size", c.vocab_size},         {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size}, {"head_dim", c.head_dim},
      {"moe_intermediate_size", c.moe_intermediate_size}, {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads}, {"num_key_value_heads", c.num_key_value_heads},
      {"num_experts", c.num_experts},
  };
  for (const auto& [field, value] : bounded) {
    if (value > kMaxConfigDim) {
      return InvalidArgument(fmt::format("model {}: {} is {}, over {}", c.name, field, value, kMaxConfigDim));
    }
  }
  // Tensors per layer: 6 attention, 2 norms, and 3 MLP ones (MoE: a router and 3 per
  // expert); DeepSeek-V3 / GLM-4.5 layers at most 20 besides the experts' (MTP included).
  const bool qwen = c.architecture == kQwen3Dense || c.architecture == kQwen3Moe;
  const int64_t per_layer =
      qwen ? 8 + (c.is_moe() ? 1 + 3 * c.num_experts : 3) : 20 + 3 * c.num_experts;
  if (c.total_layers() * per_layer > kMaxConfigTensors) {
    return InvalidArgument(fmt::format("model {}: {} layers of {} tensors are over {} tensors", c.name,
                                       c.total_layers(), per_layer, kMaxConfigTensors));
  }
  // Every tensor's byte count, and the model's, must fit int64 (core/shape_math.h).
  int64_t total = 0;
  for (const TensorMeta& t : HfTensors(c)) {
    std::optional<int64_t> bytes = CheckedNumBytes(t.shape, t.dtype);
    std::optional<int64_t> sum = bytes ? CheckedAdd(total, *bytes) : std::nullopt;
    if (!sum) {
      return InvalidArgument(fmt::format("model {}: {} of shape {} makes the model's byte count overflow int64",
                                         c.name, t.name, ShapeString(t.shape)));
    }
    total = *sum;
  }
  return Status::Ok();
}

Result<ModelConfig> ParseHfConfig(std::string_view json_text, std::string_view origin) {
  // A config.json is untrusted: it comes with a checkpoint from anywhere.
  WSYNC_ASSIGN_OR_RETURN(nlohmann::json j, ParseUntrustedJson(json_text, origin));
  if (!j.is_object()) return InvalidArgument(fmt::format("{}: not a JSON object", origin));
  ModelConfig c;
  c.name = std::string(origin);
  auto arch = j.find("architectures");
  if (arch == j.end()) return InvalidArgument(fmt::format("{}: missing field architectures", origin));
  if (!arch->is_array() || arch->size() != 1 || !(*arch)[0].is_string()) {
    return InvalidArgument(fmt::format(
        "{}: field architectures must list exactly one architecture, got {}", origin, JsonExcerpt(*arch)));
  }
  c.architecture = (*arch)[0].get<std::string>();
  if (!KnownArchitecture(c.architecture)) {
    return InvalidArgument(fmt::format("{}: unknown architecture '{}' in field architectures "
                                       "(supported: {})",
                                       origin, c.architecture, SupportedArchitectures()));
  }
  WSYNC_ASSIGN_OR_RETURN(c.vocab_size, IntField(j, origin, "vocab_size", true));
  WSYNC_ASSIGN_OR_RETURN(c.hidden_size, IntField(j, origin, "hidden_size", true));
  WSYNC_ASSIGN_OR_RETURN(c.intermediate_size, IntField(j, origin, "intermediate_size", true));
  WSYNC_ASSIGN_OR_RETURN(c.num_hidden_layers, IntField(j, origin, "num_hidden_layers", true));
  WSYNC_ASSIGN_OR_RETURN(c.num_attention_heads, IntField(j, origin, "num_attention_heads", true));
  WSYNC_ASSIGN_OR_RETURN(c.num_key_value_heads, IntField(j, origin, "num_key_value_heads", true));
  if (c.num_attention_heads <= 0) {
    return InvalidArgument(fmt::format("{}: field num_attention_heads is {}, must be positive",
                                       origin, c.num_attention_heads));
  }
  WSYNC_ASSIGN_OR_RETURN(c.head_dim, IntField(j, origin, "head_dim", false,
                                              c.hidden_size / c.num_attention_heads));
  if (c.architecture == kDeepseekV3 || c.architecture == kGlm4Moe) {
    WSYNC_RETURN_IF_ERROR(ParseDeepseekGlm(j, origin, c));
  } else if (c.is_moe()) {
    WSYNC_ASSIGN_OR_RETURN(c.moe_intermediate_size,
                           IntField(j, origin, "moe_intermediate_size", true));
    // transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
    const char* experts_field = !j.contains("num_experts") && j.contains("num_local_experts") ? "num_local_experts"
                                                                                               : "num_experts";
    WSYNC_ASSIGN_OR_RETURN(c.num_experts, IntField(j, origin, experts_field, true));
    // wsync models every layer as sparse; configs that mix dense layers in are refused.
    WSYNC_ASSIGN_OR_RETURN(int64_t step, IntField(j, origin, "decoder_sparse_step", false, 1));
    auto dense_layers = j.find("mlp_only_layers");
    bool has_dense = dense_layers != j.end() && dense_layers->is_array() && !dense_layers->empty();
    if (step != 1 || has_dense) {
      return InvalidArgument(fmt::format(
          "{}: fields decoder_sparse_step/mlp_only_layers: only all-MoE layers are supported", origin));
    }
  }
  if (auto tie = j.find("tie_word_embeddings"); tie != j.end() && !tie->is_null()) {
    if (!tie->is_boolean()) {
      return InvalidArgument(fmt::format("{}: field tie_word_embeddings must be a boolean, got {}",
                                         origin, JsonExcerpt(*tie)));
    }
    c.tie_word_embeddings = tie->get<bool>();
  }
  for (const char* field : {"torch_dtype", "dtype"}) {
    auto it = j.find(field);
    if (it == j.end() || it->is_null()) continue;
    const std::string name = it->is_string() ? it->get<std::string>() : std::string();
    if (name == "bfloat16") c.dtype = DType::kBF16;
    else if (name == "float16") c.dtype = DType::kF16;
    else if (name == "float32") c.dtype = DType::kF32;
    else {
      return InvalidArgument(fmt::format("{}: field {} is {}, expected bfloat16, float16 or float32", origin,
                                         field, JsonExcerpt(*it)));
    }
    break;
  }
  WSYNC_RETURN_IF_ERROR(ValidateConfig(c));  // its errors name the model, here the file
  return c;
}

Result<ModelConfig> LookupModel(std::string_view name_or_dir) {
  const auto& registry = Registry();
  if (auto it = registry.find(name_or_dir); it != registry.end()) return it->second;

  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path path(name_or_dir);
  fs::path file = fs::is_directory(path, ec) ? path / "config.json" : path;
  if (!fs::is_regular_file(file, ec)) {
    if (fs::is_directory(path, ec)) {
      return NotFound(fmt::format("model directory {} has no config.json", name_or_dir));
    }
    return NotFound(fmt::format("unknown model '{}': not a registered name ({}) nor a directory "
                                "with a config.json",
                                name_or_dir, fmt::join(RegisteredModelNames(), ", ")));
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return InvalidArgument(fmt::format("cannot open {}", file.string()));
  std::stringstream text;
  text << in.rdbuf();
  WSYNC_ASSIGN_OR_RETURN(ModelConfig c, ParseHfConfig(text.str(), file.string()));
  c.name = std::string(name_or_dir);
  return c;
}

namespace {

// Appends one decoder layer's tensors (attention, MLP, norms) under prefix `p`.
void AddLayer(const ModelConfig& c, int64_t layer, const std::string& p,
              std::vector<TensorMeta>& out) {
  const int64_t H = c.hidden_size, D = c.head_dim;
  auto add = [&](std::string name, Shape shape, DType dtype) {
    out.push_back(TensorMeta{std::move(name), dtype, std::move(shape)});
  };
  const DType t = c.dtype;
  const std::string a = p + "self_attn.";
  if (c.is_mla()) {
    const int64_t heads = c.num_attention_heads;
    const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    if (c.q_lora_rank > 0) {
      add(a + "q_a_proj.weight", {c.q_lora_rank, H}, t);
      add(a + "q_a_layernorm.weight", {c.q_lora_rank}, t);
      add(a + "q_b_proj.weight", {heads * qk, c.q_lora_rank}, t);
    } else {
      add(a + "q_proj.weight", {heads * qk, H}, t);
    }
    add(a + "kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, H}, t);
    add(a + "kv_a_layernorm.weight", {c.kv_lora_rank}, t);
    add(a + "kv_b_proj.weight", {heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, t);
    add(a + "o_proj.weight", {H, heads * c.v_head_dim}, t);
  } else {
    const int64_t q_rows = c.num_attention_heads * D, kv_rows = c.num_key_value_heads * D;
    add(a + "q_proj.weight", {q_rows, H}, t);
    if (c.attention_bias) add(a + "q_proj.bias", {q_rows}, t);
    add(a + "k_proj.weight", {kv_rows, H}, t);
    if (c.attention_bias) add(a + "k_proj.bias", {kv_rows}, t);
    add(a + "v_proj.weight", {kv_rows, H}, t);
    if (c.attention_bias) add(a + "v_proj.bias", {kv_rows}, t);
    add(a + "o_proj.weight", {H, q_rows}, t);
    if (c.has_qk_norm()) {
      add(a + "q_norm.weight", {D}, t);
      add(a + "k_norm.weight", {D}, t);
    }
  }
  if (c.is_moe_layer(layer)) {
    const int64_t I = c.moe_intermediate_size;
    add(p + "mlp.gate.weight", {c.num_experts, H}, t);
    if (c.architecture == kDeepseekV3 || c.architecture == kGlm4Moe) {
      add(p + "mlp.gate.e_score_correction_bias", {c.num_experts}, DType::kF32);
    }
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string x = fmt::format("{}mlp.experts.{}.", p, e);
      add(x + "gate_proj.weight", {I, H}, t);
      add(x + "up_proj.weight", {I, H}, t);
      add(x + "down_proj.weight", {H, I}, t);
    }
    if (c.n_shared_experts > 0) {
      const int64_t S = I * c.n_shared_experts;
      add(p + "mlp.shared_experts.gate_proj.weight", {S, H}, t);
      add(p + "mlp.shared_experts.up_proj.weight", {S, H}, t);
      add(p + "mlp.shared_experts.down_proj.weight", {H, S}, t);
    }
  } else {
    const int64_t I = c.intermediate_size;
    add(p + "mlp.gate_proj.weight", {I, H}, t);
    add(p + "mlp.up_proj.weight", {I, H}, t);
    add(p + "mlp.down_proj.weight", {H, I}, t);
  }
  add(p + "input_layernorm.weight", {H}, t);
  add(p + "post_attention_layernorm.weight", {H}, t);
}

}  // namespace

std::vector<TensorMeta> HfTensors(const ModelConfig& c) {
  const int64_t V = c.vocab_size, H = c.hidden_size;
  std::vector<TensorMeta> out;
  auto add = [&](std::string name, Shape shape) {
    out.push_back(TensorMeta{std::move(name), c.dtype, std::move(shape)});
  };
  add("model.embed_tokens.weight", {V, H});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    AddLayer(c, i, fmt::format("model.layers.{}.", i), out);
  }
  for (int64_t i = c.num_hidden_layers; i < c.total_layers(); ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    // The layer's embed_tokens and shared_head.head are the target's embed_tokens and
    // lm_head, which the drafter aliases: the stream carries each once.
    add(p + "enorm.weight", {H});
    add(p + "hnorm.weight", {H});
    add(p + "eh_proj.weight", {H, 2 * H});
    add(p + "shared_head.norm.weight", {H});
    AddLayer(c, i, p, out);
  }
  add("model.norm.weight", {H});
  if (!c.tie_word_embeddings) add("lm_head.weight", {V, H});
  return out;
}

int64_t MtpLayerOf(const ModelConfig& c, std::string_view hf_name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (c.num_nextn_predict_layers == 0 || !hf_name.starts_with(kPrefix)) return -1;
  hf_name.remove_prefix(kPrefix.size());
  int64_t layer = 0;
  size_t digits = 0;
  while (digits < hf_name.size() && digits < 10 && hf_name[digits] >= '0' && hf_name[digits] <= '9') {
    layer = layer * 10 + (hf_name[digits] - '0');
    ++digits;
  }
  if (digits == 0 || digits >= hf_name.size() || hf_name[digits] != '.') return -1;
  return layer >= c.num_hidden_layers && layer < c.total_layers() ? layer : -1;
}

int64_t ModelParams(const ModelConfig& config) {
  int64_t n = 0;
  for (const TensorMeta& t : HfTensors(config)) n += t.numel();
  return n;
}

int64_t ModelBytes(const ModelConfig& config) {
  int64_t n = 0;
  for (const TensorMeta& t : HfTensors(config)) n += static_cast<int64_t>(t.nbytes());
  return n;
}

}  // namespace wsync
