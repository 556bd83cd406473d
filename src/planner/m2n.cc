#include "planner/m2n.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/json_limits.h"

namespace wsync::planner {
namespace {

constexpr std::string_view kSizeFields[] = {"tp_size", "cp_size", "ep_size", "pp_size", "fsdp_size", "dp_size"};

Result<int> SizeField(const nlohmann::json& j, std::string_view where, std::string_view field, bool required) {
  auto it = j.find(field);
  if (it == j.end()) {
    if (required) return InvalidArgument(fmt::format("{}: missing field {}", where, field));
    return 1;
  }
  if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > kMaxM2nSize) {
    return InvalidArgument(fmt::format("{}: field {} is {}, expected an integer in [1, {}]", where, field,
                                       JsonExcerpt(*it), kMaxM2nSize));
  }
  return static_cast<int>(it->get<int64_t>());
}

Result<M2nParallel> ParseParallel(const nlohmann::json& j, std::string_view where) {
  if (!j.is_object()) return InvalidArgument(fmt::format("{}: expected an object, got {}", where, JsonExcerpt(j)));
  for (const auto& [key, value] : j.items()) {
    if (key != "num_gpus" && std::find(std::begin(kSizeFields), std::end(kSizeFields), key) == std::end(kSizeFields)) {
      return InvalidArgument(fmt::format("{}: unknown field '{}' (expected num_gpus, tp_size, cp_size, ep_size, "
                                         "pp_size, fsdp_size, dp_size)",
                                         where, key.substr(0, kMaxNameBytes)));
    }
  }
  M2nParallel p;
  WSYNC_ASSIGN_OR_RETURN(p.num_gpus, SizeField(j, where, "num_gpus", true));
  int* sizes[] = {&p.tp, &p.cp, &p.ep, &p.pp, &p.fsdp, &p.dp};
  for (size_t i = 0; i < std::size(kSizeFields); ++i) {
    WSYNC_ASSIGN_OR_RETURN(*sizes[i], SizeField(j, where, kSizeFields[i], false));
  }
  return p;
}

nlohmann::ordered_json ParallelJson(const M2nParallel& p) {
  nlohmann::ordered_json j;
  j["num_gpus"] = p.num_gpus;
  j["tp_size"] = p.tp;
  j["cp_size"] = p.cp;
  j["ep_size"] = p.ep;
  j["pp_size"] = p.pp;
  j["fsdp_size"] = p.fsdp;
  j["dp_size"] = p.dp;
  return j;
}

// Tensors by name, for matching a file against a config.
using ByName = std::map<std::string_view, const TensorMeta*>;

const TensorMeta* Get(const ByName& t, const std::string& name) {
  auto it = t.find(name);
  return it == t.end() ? nullptr : it->second;
}

int64_t Dim(const TensorMeta* m, size_t d) { return m && d < m->shape.size() ? m->shape[d] : 0; }

// The decoder-layer index a name starts with ("model.layers.<n>."), or -1.
int64_t LayerOf(std::string_view name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (!name.starts_with(kPrefix)) return -1;
  name.remove_prefix(kPrefix.size());
  int64_t layer = 0;
  size_t digits = 0;
  while (digits < name.size() && digits < 9 && name[digits] >= '0' && name[digits] <= '9') {
    layer = layer * 10 + (name[digits++] - '0');
  }
  return digits > 0 && digits < name.size() && name[digits] == '.' ? layer : -1;
}

// Reads the config's sizes off the tensors' shapes; HfTensors of the result is then
// compared with the file, so a guess that does not reproduce it is refused there.
Result<ModelConfig> Infer(const ByName& t, std::string_view name) {
  ModelConfig c;
  c.name = std::string(name);
  const TensorMeta* embed = Get(t, "model.embed_tokens.weight");
  if (!embed || embed->shape.size() != 2) {
    return InvalidArgument(fmt::format("{}: no 2-D model.embed_tokens.weight", name));
  }
  c.dtype = embed->dtype;
  c.vocab_size = embed->shape[0];
  c.hidden_size = embed->shape[1];
  c.tie_word_embeddings = Get(t, "lm_head.weight") == nullptr;
  std::set<int64_t> layers, mtp;
  for (const auto& [n, m] : t) {
    const int64_t layer = LayerOf(n);
    if (layer < 0) continue;
    layers.insert(layer);
    if (n.ends_with(".enorm.weight")) mtp.insert(layer);
  }
  c.num_hidden_layers = static_cast<int64_t>(layers.size() - mtp.size());
  c.num_nextn_predict_layers = static_cast<int64_t>(mtp.size());
  const std::string a = "model.layers.0.self_attn.";
  const bool mla = Get(t, a + "kv_a_proj_with_mqa.weight") != nullptr;
  // Dense first layers, then the MoE layout of the first MoE layer.
  int64_t dense = 0;
  while (dense < c.num_hidden_layers && Get(t, fmt::format("model.layers.{}.mlp.gate_proj.weight", dense))) ++dense;
  const std::string moe = fmt::format("model.layers.{}.mlp.", dense);
  const bool routed = Get(t, moe + "experts.0.gate_proj.weight") != nullptr;
  const bool corrected = Get(t, moe + "gate.e_score_correction_bias") != nullptr;
  c.architecture = std::string(mla ? kDeepseekV3 : corrected ? kGlm4Moe : routed ? kQwen3Moe : kQwen3Dense);
  if (routed) {
    c.moe_intermediate_size = Dim(Get(t, moe + "experts.0.gate_proj.weight"), 0);
    c.num_experts = Dim(Get(t, moe + "gate.weight"), 0);
    if (c.is_mla() || corrected) {
      c.first_k_dense_replace = dense;
      const int64_t shared = Dim(Get(t, moe + "shared_experts.gate_proj.weight"), 0);
      c.n_shared_experts = c.moe_intermediate_size > 0 ? shared / c.moe_intermediate_size : 0;
    }
  }
  // Qwen3-MoE configs carry an unused dense width; the routed one stands in for it.
  c.intermediate_size = dense > 0 ? Dim(Get(t, "model.layers.0.mlp.gate_proj.weight"), 0)
                                  : std::max<int64_t>(c.moe_intermediate_size, 1);
  if (mla) {
    c.q_lora_rank = Dim(Get(t, a + "q_a_proj.weight"), 0);
    c.kv_lora_rank = Dim(Get(t, a + "kv_a_layernorm.weight"), 0);
    c.qk_rope_head_dim = Dim(Get(t, a + "kv_a_proj_with_mqa.weight"), 0) - c.kv_lora_rank;
    const int64_t q_rows = Dim(Get(t, a + (c.q_lora_rank > 0 ? "q_b_proj.weight" : "q_proj.weight")), 0);
    const int64_t kv_b = Dim(Get(t, a + "kv_b_proj.weight"), 0), o_cols = Dim(Get(t, a + "o_proj.weight"), 1);
    // q rows = heads*(nope+rope), kv_b rows = heads*(nope+v), o_proj columns = heads*v.
    const int64_t heads_rope = q_rows - (kv_b - o_cols);
    if (c.qk_rope_head_dim <= 0 || heads_rope <= 0 || heads_rope % c.qk_rope_head_dim != 0) {
      return InvalidArgument(fmt::format("{}: the MLA shapes of layer 0 do not give a head count", name));
    }
    c.num_attention_heads = c.num_key_value_heads = heads_rope / c.qk_rope_head_dim;
    c.qk_nope_head_dim = (kv_b - o_cols) / c.num_attention_heads;
    c.v_head_dim = o_cols / c.num_attention_heads;
    c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
  } else {
    const TensorMeta* q_norm = Get(t, a + "q_norm.weight");
    if (q_norm && q_norm->shape.empty()) return InvalidArgument(fmt::format("{}: q_norm of layer 0 has no shape", name));
    c.use_qk_norm = c.architecture == kGlm4Moe && q_norm != nullptr;
    c.attention_bias = Get(t, a + "q_proj.bias") != nullptr;
    c.head_dim = q_norm ? Dim(q_norm, 0) : 128;
    if (c.head_dim <= 0) return InvalidArgument(fmt::format("{}: q_norm of layer 0 has no width", name));
    c.num_attention_heads = Dim(Get(t, a + "q_proj.weight"), 0) / c.head_dim;
    c.num_key_value_heads = Dim(Get(t, a + "k_proj.weight"), 0) / c.head_dim;
  }
  return c;
}

}  // namespace

Result<M2nSystem> ParseM2nSystem(std::string_view json, std::string_view origin) {
  if (json.size() > kMaxM2nBytes) return InvalidArgument(fmt::format("{}: over {} bytes", origin, kMaxM2nBytes));
  WSYNC_ASSIGN_OR_RETURN(nlohmann::json j, ParseUntrustedJson(json, origin));
  if (!j.is_object()) return InvalidArgument(fmt::format("{}: not a JSON object", origin));
  for (const auto& [key, value] : j.items()) {
    if (key != "_comment" && key != "train" && key != "generation") {
      return InvalidArgument(fmt::format("{}: unknown field '{}' (expected _comment, train, generation)", origin,
                                         key.substr(0, kMaxNameBytes)));
    }
  }
  M2nSystem s;
  WSYNC_ASSIGN_OR_RETURN(s.comment, BoundedStringField(j, "_comment", origin, kMaxNameBytes));
  for (auto [field, side] : {std::pair{"train", &s.train}, std::pair{"generation", &s.generation}}) {
    auto it = j.find(field);
    if (it == j.end()) return InvalidArgument(fmt::format("{}: missing field {}", origin, field));
    WSYNC_ASSIGN_OR_RETURN(*side, ParseParallel(*it, fmt::format("{}: {}", origin, field)));
  }
  return s;
}

std::string WriteM2nSystem(const M2nSystem& s) {
  nlohmann::ordered_json j;
  if (!s.comment.empty()) j["_comment"] = s.comment;
  j["train"] = ParallelJson(s.train);
  j["generation"] = ParallelJson(s.generation);
  return j.dump(4) + "\n";
}

Result<M2nFleetSpecs> FleetSpecsOfM2n(const M2nSystem& s, std::string_view hw) {
  const M2nParallel& t = s.train;
  const M2nParallel& g = s.generation;
  M2nFleetSpecs out;
  if (t.fsdp > 1 && t.tp == 1 && t.pp == 1 && t.ep == 1 && t.cp == 1) {
    if (t.fsdp * static_cast<int64_t>(t.dp) != t.num_gpus) {
      return InvalidArgument(fmt::format("train: fsdp_size {} x dp_size {} is not num_gpus {}", t.fsdp, t.dp,
                                         t.num_gpus));
    }
    out.trainer = fmt::format("fsdp:{}@{}", t.num_gpus, hw);
  } else {
    if (t.fsdp > 1) return InvalidArgument("train: fsdp_size > 1 beside tp, pp, ep or cp > 1 is not a wsync layout");
    if (t.num_gpus % t.pp != 0) {
      return InvalidArgument(fmt::format("train: pp_size {} does not divide num_gpus {}", t.pp, t.num_gpus));
    }
    const int stage = t.num_gpus / t.pp;
    if (static_cast<int64_t>(t.tp) * t.cp * t.dp != stage) {
      return InvalidArgument(fmt::format("train: tp_size {} x cp_size {} x dp_size {} is not num_gpus / pp_size = {}",
                                         t.tp, t.cp, t.dp, stage));
    }
    if (stage % t.ep != 0) {
      return InvalidArgument(fmt::format("train: ep_size {} does not divide a stage's {} ranks", t.ep, stage));
    }
    out.trainer = fmt::format("tp{}pp{}{}:{}@{}", t.tp, t.pp, t.ep > 1 ? fmt::format("ep{}", t.ep) : "", t.num_gpus,
                              hw);
  }
  if (g.cp != 1 || g.pp != 1 || g.fsdp != 1 || g.ep != 1) {
    return InvalidArgument(fmt::format(
        "generation: cp_size {}, pp_size {}, fsdp_size {}, ep_size {}: wsync's servers are vLLM deployments of "
        "tp_size workers, dp_size of them (every other size 1)",
        g.cp, g.pp, g.fsdp, g.ep));
  }
  if (static_cast<int64_t>(g.tp) * g.dp != g.num_gpus) {
    return InvalidArgument(fmt::format("generation: tp_size {} x dp_size {} is not num_gpus {}", g.tp, g.dp,
                                       g.num_gpus));
  }
  out.servers = fmt::format("{}x({},1,1)@{}", g.dp, g.tp, hw);
  return out;
}

Result<M2nSystem> M2nSystemOf(const TrainerSpec& t, const ServerSpec& s) {
  M2nSystem out;
  out.train.num_gpus = t.world;
  if (t.fsdp) {
    out.train.fsdp = t.world;
  } else {
    if (t.etp > 1) return InvalidArgument(fmt::format("trainer {}: the M2N benchmark has no expert TP", t.ToString()));
    out.train.tp = t.tp;
    out.train.pp = t.pp;
    out.train.ep = t.ep;
    out.train.dp = t.world / t.pp / t.tp;
  }
  if (s.ep > 1 || s.dp > 1) {
    return InvalidArgument(fmt::format("servers {}: the M2N benchmark has no mesh for vLLM's expert or data "
                                       "parallelism inside a deployment",
                                       s.ToString()));
  }
  out.generation.num_gpus = s.count * s.tp;
  out.generation.tp = s.tp;
  out.generation.dp = s.count;
  return out;
}

Result<std::vector<TensorMeta>> ParseM2nModel(std::string_view json, std::string_view origin) {
  if (json.size() > kMaxM2nBytes) return InvalidArgument(fmt::format("{}: over {} bytes", origin, kMaxM2nBytes));
  WSYNC_ASSIGN_OR_RETURN(nlohmann::json j, ParseUntrustedJson(json, origin));
  if (!j.is_object()) return InvalidArgument(fmt::format("{}: not a JSON object", origin));
  if (j.size() > kMaxM2nTensors) {
    return InvalidArgument(fmt::format("{}: {} tensors, over {}", origin, j.size(), kMaxM2nTensors));
  }
  std::vector<TensorMeta> out;
  out.reserve(j.size());
  for (const auto& [name, entry] : j.items()) {  // sorted by name
    if (name.empty() || name.size() > kMaxNameBytes) {
      return InvalidArgument(fmt::format("{}: a tensor name of {} bytes (1 to {})", origin, name.size(), kMaxNameBytes));
    }
    const std::string where = fmt::format("{}: tensor {}", origin, name);
    if (!entry.is_object()) return InvalidArgument(fmt::format("{}: expected an object, got {}", where, JsonExcerpt(entry)));
    TensorMeta m;
    m.name = name;
    auto shape = entry.find("shape");
    if (shape == entry.end() || !shape->is_array() || shape->size() > kMaxM2nDims) {
      return InvalidArgument(fmt::format("{}: field shape must be a list of at most {} dimensions", where, kMaxM2nDims));
    }
    for (const nlohmann::json& d : *shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 1 || d.get<int64_t>() > kMaxM2nDim) {
        return InvalidArgument(fmt::format("{}: dimension {} is not an integer in [1, {}]", where, JsonExcerpt(d),
                                           kMaxM2nDim));
      }
      m.shape.push_back(d.get<int64_t>());
    }
    WSYNC_ASSIGN_OR_RETURN(std::string dtype, BoundedStringField(entry, "dtype", where, 32, "BF16"));
    auto parsed = DTypeFromSafetensorsName(dtype);
    if (!parsed.ok()) return InvalidArgument(fmt::format("{}: {}", where, parsed.status().message()));
    m.dtype = *parsed;
    out.push_back(std::move(m));
  }
  return out;
}

std::string WriteM2nModel(const std::vector<TensorMeta>& tensors) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const TensorMeta& m : tensors) {
    j[m.name] = {{"shape", m.shape}, {"dtype", SafetensorsName(m.dtype)}, {"shard", "synthetic"}};
  }
  return j.dump(2) + "\n";
}

Result<ModelConfig> ModelOfM2n(const std::vector<TensorMeta>& tensors, std::string_view name) {
  ByName by_name;
  for (const TensorMeta& m : tensors) {
    if (!by_name.emplace(m.name, &m).second) return InvalidArgument(fmt::format("{}: tensor {} twice", name, m.name));
  }
  WSYNC_ASSIGN_OR_RETURN(ModelConfig c, Infer(by_name, name));
  if (Status ok = ValidateConfig(c); !ok.ok()) {
    return InvalidArgument(fmt::format("{}: the tensors read as a {} model that is not valid: {}", name,
                                       c.architecture, ok.message()));
  }
  const std::vector<TensorMeta> want = HfTensors(c);
  for (const TensorMeta& w : want) {
    const TensorMeta* got = Get(by_name, w.name);
    if (!got) {
      return InvalidArgument(fmt::format("{}: read as {} ({} layers), it lacks tensor {}", name, c.architecture,
                                         c.num_hidden_layers, w.name));
    }
    if (Status same = CheckSameMeta(w, *got); !same.ok()) {
      return InvalidArgument(fmt::format("{}: read as {}: {}", name, c.architecture, same.message()));
    }
  }
  if (want.size() != tensors.size()) {
    std::set<std::string_view> known;
    for (const TensorMeta& w : want) known.insert(w.name);
    for (const TensorMeta& m : tensors) {
      if (!known.count(m.name)) {
        return InvalidArgument(fmt::format("{}: read as {}, tensor {} is not one of its tensors", name,
                                           c.architecture, m.name));
      }
    }
  }
  return c;
}

}  // namespace wsync::planner
