#include "model/config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

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

const std::map<std::string, ModelConfig, std::less<>>& Registry() {
  static const auto* registry = [] {
    auto* m = new std::map<std::string, ModelConfig, std::less<>>;
    for (ModelConfig c : {
             Dense("qwen3-tiny", 4096, 256, 512, 4, 4, 2, 64, false),
             Dense("qwen3-0.6b", 151936, 1024, 3072, 28, 16, 8, 128, true),
             Dense("qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 128, false),
             Moe(Dense("qwen3-moe-tiny", 4096, 256, 512, 2, 4, 2, 64, false), 128, 8),
             Moe(Dense("qwen3-30b-a3b", 151936, 2048, 6144, 48, 32, 4, 128, false), 768, 128),
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
        fmt::format("{}: field {} must be an integer, got {}", origin, field, it->dump()));
  }
  return it->get<int64_t>();
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

Status ValidateConfig(const ModelConfig& c) {
  if (c.architecture != kQwen3Dense && c.architecture != kQwen3Moe) {
    return InvalidArgument(fmt::format("model {}: unknown architecture '{}' (supported: {}, {})",
                                       c.name, c.architecture, kQwen3Dense, kQwen3Moe));
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
  // Tensors per layer: 6 attention, 2 norms, and 3 MLP ones (MoE: a router and 3 per expert).
  const int64_t per_layer = 8 + (c.is_moe() ? 1 + 3 * c.num_experts : 3);
  if (c.num_hidden_layers * per_layer > kMaxConfigTensors) {
    return InvalidArgument(fmt::format("model {}: {} layers of {} tensors are over {} tensors", c.name,
                                       c.num_hidden_layers, per_layer, kMaxConfigTensors));
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
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgument(fmt::format("{}: not a JSON object", origin));
  }
  ModelConfig c;
  c.name = std::string(origin);
  auto arch = j.find("architectures");
  if (arch == j.end()) return InvalidArgument(fmt::format("{}: missing field architectures", origin));
  if (!arch->is_array() || arch->size() != 1 || !(*arch)[0].is_string()) {
    return InvalidArgument(fmt::format(
        "{}: field architectures must list exactly one architecture, got {}", origin, arch->dump()));
  }
  c.architecture = (*arch)[0].get<std::string>();
  if (c.architecture != kQwen3Dense && c.architecture != kQwen3Moe) {
    return InvalidArgument(fmt::format("{}: unknown architecture '{}' in field architectures "
                                       "(supported: {}, {})",
                                       origin, c.architecture, kQwen3Dense, kQwen3Moe));
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
  if (c.is_moe()) {
    WSYNC_ASSIGN_OR_RETURN(c.moe_intermediate_size,
                           IntField(j, origin, "moe_intermediate_size", true));
    WSYNC_ASSIGN_OR_RETURN(c.num_experts, IntField(j, origin, "num_experts", true));
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
                                         origin, tie->dump()));
    }
    c.tie_word_embeddings = tie->get<bool>();
  }
  for (const char* field : {"torch_dtype", "dtype"}) {
    auto it = j.find(field);
    if (it == j.end() || it->is_null()) continue;
    std::string name = it->is_string() ? it->get<std::string>() : it->dump();
    if (name == "bfloat16") c.dtype = DType::kBF16;
    else if (name == "float16") c.dtype = DType::kF16;
    else if (name == "float32") c.dtype = DType::kF32;
    else {
      return InvalidArgument(fmt::format(
          "{}: field {} is '{}', expected bfloat16, float16 or float32", origin, field, name));
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

std::vector<TensorMeta> HfTensors(const ModelConfig& c) {
  const int64_t V = c.vocab_size, H = c.hidden_size, D = c.head_dim;
  const int64_t q_rows = c.num_attention_heads * D, kv_rows = c.num_key_value_heads * D;
  std::vector<TensorMeta> out;
  auto add = [&](std::string name, Shape shape) {
    out.push_back(TensorMeta{std::move(name), c.dtype, std::move(shape)});
  };
  add("model.embed_tokens.weight", {V, H});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    add(p + "self_attn.q_proj.weight", {q_rows, H});
    add(p + "self_attn.k_proj.weight", {kv_rows, H});
    add(p + "self_attn.v_proj.weight", {kv_rows, H});
    add(p + "self_attn.o_proj.weight", {H, q_rows});
    add(p + "self_attn.q_norm.weight", {D});
    add(p + "self_attn.k_norm.weight", {D});
    if (c.is_moe()) {
      const int64_t I = c.moe_intermediate_size;
      add(p + "mlp.gate.weight", {c.num_experts, H});
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string x = fmt::format("{}mlp.experts.{}.", p, e);
        add(x + "gate_proj.weight", {I, H});
        add(x + "up_proj.weight", {I, H});
        add(x + "down_proj.weight", {H, I});
      }
    } else {
      const int64_t I = c.intermediate_size;
      add(p + "mlp.gate_proj.weight", {I, H});
      add(p + "mlp.up_proj.weight", {I, H});
      add(p + "mlp.down_proj.weight", {H, I});
    }
    add(p + "input_layernorm.weight", {H});
    add(p + "post_attention_layernorm.weight", {H});
  }
  add("model.norm.weight", {H});
  if (!c.tie_word_embeddings) add("lm_head.weight", {V, H});
  return out;
}

int64_t ModelParams(const ModelConfig& config) {
  int64_t n = 0;
  for (const TensorMeta& t : HfTensors(config)) n += t.numel();
  return n;
}

int64_t ModelBytes(const ModelConfig& config) {
  return ModelParams(config) * static_cast<int64_t>(ItemSize(config.dtype));
}

}  // namespace wsync
