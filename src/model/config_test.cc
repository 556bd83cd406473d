#include "model/config.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace wsync {
namespace {

namespace fs = std::filesystem;

bool Contains(const std::string& s, std::string_view part) {
  return s.find(part) != std::string::npos;
}

// A fresh directory holding config.json with `text`; removed with the object.
class TempConfig {
 public:
  explicit TempConfig(const std::string& text) {
    dir_ = fs::temp_directory_path() /
           ("wsync_model_config_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::create_directories(dir_);
    std::ofstream(dir_ / "config.json") << text;
  }
  ~TempConfig() { fs::remove_all(dir_); }
  std::string dir() const { return dir_.string(); }
  std::string file() const { return (dir_ / "config.json").string(); }

 private:
  static inline int counter_ = 0;
  fs::path dir_;
};

// The fields of Qwen3-0.6B's config.json that wsync reads, plus some it ignores.
constexpr const char* kDenseJson = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "model_type": "qwen3",
  "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
  "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
  "head_dim": 128, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "rope_theta": 1000000, "rms_norm_eps": 1e-06
})";

constexpr const char* kMoeJson = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
  "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
  "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
  "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": false,
  "torch_dtype": "bfloat16"
})";

TEST(Registry, NamesAndLookups) {
  EXPECT_EQ(RegisteredModelNames(),
            (std::vector<std::string>{"deepseek-v3", "deepseek-v3-tiny", "glm-4.5-air",
                                      "glm4-moe-0.6b", "glm4-moe-tiny", "kimi-k2", "moe-2.8t", "qwen3-0.6b",
                                      "qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3-32b", "qwen3-8b", "qwen3-moe-tiny", "qwen3-tiny"}));
  for (const std::string& name : RegisteredModelNames()) {
    auto c = LookupModel(name);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->name, name);
    EXPECT_TRUE(ValidateConfig(*c).ok()) << name;
    EXPECT_EQ(c->dtype, DType::kBF16);
  }
  auto tiny = *LookupModel("qwen3-tiny");
  EXPECT_FALSE(tiny.is_moe());
  EXPECT_FALSE(tiny.tie_word_embeddings);
  EXPECT_EQ(tiny.head_dim, 64);
  auto moe = *LookupModel("qwen3-30b-a3b");
  EXPECT_TRUE(moe.is_moe());
  EXPECT_EQ(moe.num_experts, 128);
  EXPECT_EQ(moe.moe_intermediate_size, 768);
  EXPECT_TRUE(LookupModel("qwen3-0.6b")->tie_word_embeddings);
}

TEST(Registry, UnknownNameListsRegisteredNames) {
  auto c = LookupModel("llama-7b");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c.status().message(),
            "unknown model 'llama-7b': not a registered name (deepseek-v3, deepseek-v3-tiny, "
            "glm-4.5-air, glm4-moe-0.6b, glm4-moe-tiny, kimi-k2, moe-2.8t, qwen3-0.6b, qwen3-235b-a22b, qwen3-30b-a3b, "
            "qwen3-32b, qwen3-8b, qwen3-moe-tiny, qwen3-tiny) nor a directory with a config.json");
}

TEST(ConfigJson, DenseMatchesRegistry) {
  TempConfig t(kDenseJson);
  auto c = LookupModel(t.dir());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->name, t.dir());
  ModelConfig want = *LookupModel("qwen3-0.6b");
  want.name = t.dir();
  EXPECT_EQ(*c, want);
  // The file itself works too.
  EXPECT_TRUE(LookupModel(t.file()).ok());
}

TEST(ConfigJson, MoeMatchesRegistry) {
  TempConfig t(kMoeJson);
  auto c = LookupModel(t.dir());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ModelConfig want = *LookupModel("qwen3-30b-a3b");
  want.name = t.dir();
  EXPECT_EQ(*c, want);
}

// transformers 5 saves Qwen3-MoE's expert count as num_local_experts.
TEST(ConfigJson, MoeExpertCountUnderTransformers5Name) {
  std::string text = kMoeJson;
  const std::string key = "\"num_experts\"";
  text.replace(text.find(key), key.size(), "\"num_local_experts\"");
  TempConfig t(text);
  auto c = LookupModel(t.dir());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_experts, LookupModel("qwen3-30b-a3b")->num_experts);
}

TEST(ConfigJson, DefaultsForOptionalFields) {
  auto c = ParseHfConfig(R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000,
      "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
      "num_attention_heads": 8, "num_key_value_heads": 4, "torch_dtype": "float32"})",
                         "x/config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->head_dim, 64);  // hidden / heads
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->dtype, DType::kF32);
}

TEST(ConfigJson, UnknownArchitecture) {
  TempConfig t(R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 1})");
  auto c = LookupModel(t.dir());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            t.file() + ": unknown architecture 'LlamaForCausalLM' in field architectures "
                       "(supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
                       "DeepseekV3ForCausalLM, Glm4MoeForCausalLM)");
}

TEST(ConfigJson, MissingField) {
  std::string text = kDenseJson;
  text.replace(text.find("\"num_key_value_heads\": 8,"), 25, "");
  TempConfig t(text);
  auto c = LookupModel(t.dir());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(), t.file() + ": missing field num_key_value_heads");

  std::string moe = kMoeJson;
  moe.replace(moe.find("\"num_experts\": 128,"), 19, "");
  TempConfig m(moe);
  auto cm = LookupModel(m.dir());
  ASSERT_FALSE(cm.ok());
  EXPECT_EQ(cm.status().message(), m.file() + ": missing field num_experts");
}

TEST(ConfigJson, BadValues) {
  auto wrong_type = ParseHfConfig(R"({"architectures": ["Qwen3ForCausalLM"],
      "vocab_size": "many"})", "c.json");
  ASSERT_FALSE(wrong_type.ok());
  EXPECT_EQ(wrong_type.status().message(), "c.json: field vocab_size must be an integer, got \"many\"");
  auto not_json = ParseHfConfig("{", "c.json");
  ASSERT_FALSE(not_json.ok());
  EXPECT_TRUE(Contains(not_json.status().message(), "malformed JSON in c.json: ")) << not_json.status().message();
  auto not_object = ParseHfConfig("[1]", "c.json");
  ASSERT_FALSE(not_object.ok());
  EXPECT_EQ(not_object.status().message(), "c.json: not a JSON object");
  auto nested_arch = ParseHfConfig(R"({"architectures": [["Qwen3ForCausalLM"]]})", "c.json");
  ASSERT_FALSE(nested_arch.ok());
  EXPECT_EQ(nested_arch.status().message(),
            "c.json: field architectures must list exactly one architecture, got a list of 1 items");
  std::string text = kMoeJson;
  text.replace(text.find("\"mlp_only_layers\": []"), 21, "\"mlp_only_layers\": [0]");
  auto mixed = ParseHfConfig(text, "c.json");
  ASSERT_FALSE(mixed.ok());
  EXPECT_TRUE(Contains(mixed.status().message(), "mlp_only_layers")) << mixed.status().message();
  std::string fp8 = kDenseJson;
  fp8.replace(fp8.find("\"bfloat16\""), 10, "\"float8\"");
  auto bad_dtype = ParseHfConfig(fp8, "c.json");
  ASSERT_FALSE(bad_dtype.ok());
  EXPECT_TRUE(Contains(bad_dtype.status().message(), "torch_dtype")) << bad_dtype.status().message();
}

// A config.json comes with a checkpoint: sizes whose tensors' byte counts overflow int64,
// or that would make HfTensors allocate without bound, are refused before any product.
TEST(ConfigJson, SizesThatOverflowOrRunAwayAreRefused) {
  auto with = [](const std::string& field, const std::string& value) {
    std::string text = kDenseJson;
    size_t at = text.find("\"" + field + "\":");
    size_t end = text.find_first_of(",}", at);
    text.replace(at, end - at, "\"" + field + "\": " + value);
    return ParseHfConfig(text, "c.json");
  };
  ASSERT_TRUE(with("hidden_size", "1024").ok()) << with("hidden_size", "1024").status().ToString();
  for (const auto& [field, value] : std::vector<std::pair<std::string, std::string>>{
           {"vocab_size", "4294967296"},
           {"hidden_size", "4294967296"},
           {"num_hidden_layers", "1099511627776"},
           {"intermediate_size", "9223372036854775807"}}) {
    auto c = with(field, value);
    ASSERT_FALSE(c.ok()) << field;
    EXPECT_TRUE(Contains(c.status().message(), field)) << c.status().message();
  }
  // Every size within its bound, yet tensors too large for int64 byte counts.
  std::string text = kDenseJson;
  for (const char* field : {"hidden_size", "num_attention_heads", "head_dim"}) {  // q_proj: 2^72
    size_t at = text.find(std::string("\"") + field + "\":");
    size_t end = text.find_first_of(",}", at);
    text.replace(at, end - at, std::string("\"") + field + "\": 16777216");
  }
  auto huge = ParseHfConfig(text, "c.json");
  ASSERT_FALSE(huge.ok());
  EXPECT_TRUE(Contains(huge.status().message(), "overflow int64")) << huge.status().message();
}

// A config.json nested 100,000 deep is refused before parsing, naming the file and the
// field; no error path recurses over it.
TEST(ConfigJson, DeepNestingIsRefused) {
  const int kDepth = 100000;
  std::string text = R"({"architectures": ["Qwen3ForCausalLM"], "rope_scaling": )";
  text += std::string(kDepth, '[') + std::string(kDepth, ']') + "}";
  TempConfig t(text);
  auto c = LookupModel(t.dir());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(), t.file() + ": field 'rope_scaling' nests deeper than 64 levels");
  // The same value one level under the limit parses; the field is not one wsync reads.
  std::string shallow = kDenseJson;
  shallow.insert(shallow.rfind('}'), R"(, "rope_scaling": )" + std::string(63, '[') + std::string(63, ']'));
  EXPECT_TRUE(ParseHfConfig(shallow, "c.json").ok()) << ParseHfConfig(shallow, "c.json").status().ToString();
  // A deep value in a field wsync reads is described flat, never dumped.
  std::string deep_field = R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": )" +
                           std::string(60, '[') + std::string(60, ']') + "}";
  auto v = ParseHfConfig(deep_field, "c.json");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().message(), "c.json: field vocab_size must be an integer, got a list of 1 items");
}

TEST(ConfigJson, DirectoryWithoutConfig) {
  fs::path dir = fs::temp_directory_path() / ("wsync_model_empty_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto c = LookupModel(dir.string());
  fs::remove_all(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c.status().message(), "model directory " + dir.string() + " has no config.json");
}

bool HasTensor(const std::vector<TensorMeta>& ts, std::string_view name) {
  for (const TensorMeta& t : ts) {
    if (t.name == name) return true;
  }
  return false;
}

TEST(HfTensors, Qwen3_0_6bIsTied) {
  auto ts = HfTensors(*LookupModel("qwen3-0.6b"));
  EXPECT_FALSE(HasTensor(ts, "lm_head.weight"));
  EXPECT_EQ(ts.size(), 1u + 28 * 11 + 1);
  // V*H + 28 * (q 2048*1024 + k,v 1024*1024 + o 1024*2048 + norms 2*128
  //             + mlp 3*3072*1024 + layernorms 2*1024) + H
  // = 155,582,464 + 28 * 15,730,944 + 1024.
  const int64_t params = ModelParams(*LookupModel("qwen3-0.6b"));
  std::printf("qwen3-0.6b: %lld parameters, %lld bytes\n", static_cast<long long>(params),
              static_cast<long long>(ModelBytes(*LookupModel("qwen3-0.6b"))));
  EXPECT_EQ(params, 596049920);
  EXPECT_EQ(ModelBytes(*LookupModel("qwen3-0.6b")), 2 * 596049920LL);
}

TEST(HfTensors, ExactNamesAndShapesOfTiny) {
  auto ts = HfTensors(*LookupModel("qwen3-tiny"));
  ASSERT_EQ(ts.size(), 1u + 4 * 11 + 2);
  const std::vector<std::pair<std::string, Shape>> head = {
      {"model.embed_tokens.weight", {4096, 256}},
      {"model.layers.0.self_attn.q_proj.weight", {256, 256}},
      {"model.layers.0.self_attn.k_proj.weight", {128, 256}},
      {"model.layers.0.self_attn.v_proj.weight", {128, 256}},
      {"model.layers.0.self_attn.o_proj.weight", {256, 256}},
      {"model.layers.0.self_attn.q_norm.weight", {64}},
      {"model.layers.0.self_attn.k_norm.weight", {64}},
      {"model.layers.0.mlp.gate_proj.weight", {512, 256}},
      {"model.layers.0.mlp.up_proj.weight", {512, 256}},
      {"model.layers.0.mlp.down_proj.weight", {256, 512}},
      {"model.layers.0.input_layernorm.weight", {256}},
      {"model.layers.0.post_attention_layernorm.weight", {256}},
      {"model.layers.1.self_attn.q_proj.weight", {256, 256}},
  };
  for (size_t i = 0; i < head.size(); ++i) {
    EXPECT_EQ(ts[i].name, head[i].first);
    EXPECT_EQ(ts[i].shape, head[i].second) << ts[i].name;
    EXPECT_EQ(ts[i].dtype, DType::kBF16);
  }
  EXPECT_EQ(ts[ts.size() - 2].name, "model.norm.weight");
  EXPECT_EQ(ts.back().name, "lm_head.weight");
  EXPECT_EQ(ts.back().shape, (Shape{4096, 256}));
  // 2*V*H + 4 * (196,608 attn + 128 norms + 393,216 mlp + 512 layernorms) + H.
  EXPECT_EQ(ModelParams(*LookupModel("qwen3-tiny")), 4459264);
}

TEST(HfTensors, Qwen3_8bHasLmHead) {
  auto ts = HfTensors(*LookupModel("qwen3-8b"));
  ASSERT_TRUE(HasTensor(ts, "lm_head.weight"));
  EXPECT_EQ(ts.back().shape, (Shape{151936, 4096}));
  // 2*V*H + 36 * (41,943,040 attn + 256 + 150,994,944 mlp + 8192) + H.
  EXPECT_EQ(ModelParams(*LookupModel("qwen3-8b")), 8190735360LL);
}

TEST(HfTensors, MoeLayersListEveryExpert) {
  auto ts = HfTensors(*LookupModel("qwen3-moe-tiny"));
  ASSERT_EQ(ts.size(), 1u + 2 * (6 + 1 + 8 * 3 + 2) + 2);
  EXPECT_EQ(ts[7].name, "model.layers.0.mlp.gate.weight");
  EXPECT_EQ(ts[7].shape, (Shape{8, 256}));
  EXPECT_EQ(ts[8].name, "model.layers.0.mlp.experts.0.gate_proj.weight");
  EXPECT_EQ(ts[8].shape, (Shape{128, 256}));
  EXPECT_EQ(ts[9].name, "model.layers.0.mlp.experts.0.up_proj.weight");
  EXPECT_EQ(ts[10].name, "model.layers.0.mlp.experts.0.down_proj.weight");
  EXPECT_EQ(ts[10].shape, (Shape{256, 128}));
  EXPECT_EQ(ts[8 + 3 * 7 + 2].name, "model.layers.0.mlp.experts.7.down_proj.weight");
  EXPECT_EQ(ts[8 + 3 * 8].name, "model.layers.0.input_layernorm.weight");
  // 2*V*H + 2 * (196,608 + 128 + gate 2,048 + experts 786,432 + 512) + H.
  EXPECT_EQ(ModelParams(*LookupModel("qwen3-moe-tiny")), 4068864);
  // 2*V*H + 48 * (18,874,368 + 256 + 262,144 + 603,979,776 + 4,096) + H.
  EXPECT_EQ(ModelParams(*LookupModel("qwen3-30b-a3b")), 30532122624LL);
}


// The keys of deepseek-ai/DeepSeek-V3's config.json that fix its tensors (plus a few it
// carries that wsync ignores); q_lora_rank as published.
constexpr const char* kDeepseekV3Json = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
  "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
  "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
  "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_nextn_predict_layers": 1,
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "v_head_dim": 128, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}
})";

// moonshotai/Kimi-K2-Instruct: the same architecture, 384 experts, 64 heads, no MTP.
constexpr const char* kKimiK2Json = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 163840, "hidden_size": 7168,
  "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
  "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
  "n_routed_experts": 384, "first_k_dense_replace": 1, "moe_layer_freq": 1,
  "num_nextn_predict_layers": 0, "q_lora_rank": 1536, "kv_lora_rank": 512,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"
})";

// zai-org/GLM-4.5-Air.
constexpr const char* kGlm45AirJson = R"({
  "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552, "hidden_size": 4096,
  "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
  "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
  "n_shared_experts": 1, "n_routed_experts": 128, "first_k_dense_replace": 1,
  "num_nextn_predict_layers": 1, "attention_bias": true, "use_qk_norm": false,
  "partial_rotary_factor": 0.5, "tie_word_embeddings": false, "torch_dtype": "bfloat16"
})";

// Qwen/Qwen3-235B-A22B.
constexpr const char* kQwen3_235bJson = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
  "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
  "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
  "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": false,
  "torch_dtype": "bfloat16"
})";

ModelConfig Registered(const char* name) {
  auto c = LookupModel(name);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

TEST(ConfigJson, PublishedConfigsMatchTheRegistry) {
  const std::pair<const char*, const char*> cases[] = {{kDeepseekV3Json, "deepseek-v3"},
                                                       {kKimiK2Json, "kimi-k2"},
                                                       {kGlm45AirJson, "glm-4.5-air"},
                                                       {kQwen3_235bJson, "qwen3-235b-a22b"}};
  for (const auto& [json, name] : cases) {
    auto c = ParseHfConfig(json, name);
    ASSERT_TRUE(c.ok()) << name << ": " << c.status().ToString();
    EXPECT_EQ(*c, Registered(name)) << name;
  }
  ModelConfig ds = Registered("deepseek-v3");
  EXPECT_EQ(ds.head_dim, 192);  // qk_nope + qk_rope
  EXPECT_EQ(ds.num_nextn_predict_layers, 1);
  EXPECT_TRUE(ds.is_mla());
  EXPECT_FALSE(ds.is_moe_layer(2));
  EXPECT_TRUE(ds.is_moe_layer(3));
}

// Parameter counts as closed-form sums over the published sizes (per MLA layer:
// q_a 1536*7168 + 1536, q_b 128*192*1536, kv_a 576*7168 + 512, kv_b 128*256*512,
// o 7168*128*128, two norms; MoE: router 256*7168 + 256, 256 experts and 1 shared of
// 3*2048*7168; dense: 3*18432*7168; MTP: eh_proj 7168*14336, three norms, a MoE layer; its
// embed_tokens and shared_head.head are the target's, so the stream has no copy of them).
TEST(HfTensors, PublishedParameterCounts) {
  auto count = [](const ModelConfig& c, bool mtp) {
    int64_t n = 0;
    for (const TensorMeta& t : HfTensors(c)) {
      bool is_mtp = false;
      for (int64_t i = c.num_hidden_layers; i < c.total_layers(); ++i) {
        if (t.name.starts_with(fmt::format("model.layers.{}.", i))) is_mtp = true;
      }
      if (is_mtp == mtp) n += t.numel();
    }
    return n;
  };
  ModelConfig ds = Registered("deepseek-v3");
  EXPECT_EQ(count(ds, false), 671026419200);  // "671B"
  // "14B" of MTP on Hugging Face (685B in all) counts two V*H copies the stream does not.
  EXPECT_EQ(count(ds, true), 13463426304 - 2 * 129280 * 7168);
  EXPECT_EQ(count(Registered("kimi-k2"), false), 1026408232448);  // "1T"
  ModelConfig glm = Registered("glm-4.5-air");
  EXPECT_EQ(count(glm, false), 106852251264);  // "106B"
  EXPECT_EQ(count(glm, true), 3616573568 - 2 * 151552 * 4096);
  EXPECT_EQ(ModelParams(Registered("qwen3-235b-a22b")), 235093634560);  // "235B"
  // Bytes: bf16 everywhere but the float32 router bias of each MoE layer (58 + 1 MTP).
  EXPECT_EQ(ModelBytes(ds), (671026419200 + 13463426304 - 2 * 129280 * 7168) * 2 + 59 * 256 * 2);
}

TEST(HfTensors, DeepseekLayerNamesAndShapes) {
  ModelConfig c = Registered("deepseek-v3");
  std::vector<TensorMeta> t = HfTensors(c);
  auto shape_of = [&](const std::string& name) -> Shape {
    for (const TensorMeta& m : t) {
      if (m.name == name) return m.shape;
    }
    ADD_FAILURE() << "no tensor " << name;
    return {};
  };
  EXPECT_EQ(shape_of("model.layers.0.self_attn.q_a_proj.weight"), (Shape{1536, 7168}));
  EXPECT_EQ(shape_of("model.layers.0.self_attn.q_b_proj.weight"), (Shape{128 * 192, 1536}));
  EXPECT_EQ(shape_of("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), (Shape{576, 7168}));
  EXPECT_EQ(shape_of("model.layers.0.self_attn.kv_b_proj.weight"), (Shape{128 * 256, 512}));
  EXPECT_EQ(shape_of("model.layers.0.self_attn.o_proj.weight"), (Shape{7168, 128 * 128}));
  EXPECT_EQ(shape_of("model.layers.2.mlp.down_proj.weight"), (Shape{7168, 18432}));
  EXPECT_EQ(shape_of("model.layers.3.mlp.experts.255.up_proj.weight"), (Shape{2048, 7168}));
  EXPECT_EQ(shape_of("model.layers.3.mlp.shared_experts.down_proj.weight"), (Shape{7168, 2048}));
  EXPECT_EQ(shape_of("model.layers.61.eh_proj.weight"), (Shape{7168, 14336}));
  for (const TensorMeta& m : t) {
    EXPECT_NE(m.name, "model.layers.61.shared_head.head.weight");
    EXPECT_NE(m.name, "model.layers.61.embed_tokens.weight");
  }
  EXPECT_EQ(shape_of("model.layers.61.mlp.experts.0.gate_proj.weight"), (Shape{2048, 7168}));
  EXPECT_EQ(t.back().name, "lm_head.weight");
  EXPECT_EQ(t[t.size() - 2].name, "model.norm.weight");
  for (const TensorMeta& m : t) {
    EXPECT_EQ(m.dtype, m.name.ends_with("e_score_correction_bias") ? DType::kF32 : DType::kBF16) << m.name;
  }
  // Without q compression the layer has q_proj instead.
  c.q_lora_rank = 0;
  ASSERT_TRUE(ValidateConfig(c).ok());
  t = HfTensors(c);
  EXPECT_EQ(shape_of("model.layers.0.self_attn.q_proj.weight"), (Shape{128 * 192, 7168}));
}

TEST(ConfigJson, DeepseekGlmFieldsAreChecked) {
  std::string no_kv = kDeepseekV3Json;
  no_kv.replace(no_kv.find("\"kv_lora_rank\": 512,"), 20, "");
  TempConfig t(no_kv);
  auto c = LookupModel(t.dir());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(), t.file() + ": missing field kv_lora_rank");

  std::string freq = kDeepseekV3Json;
  freq.replace(freq.find("\"moe_layer_freq\": 1"), 19, "\"moe_layer_freq\": 2");
  auto f = ParseHfConfig(freq, "ds.json");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(), "ds.json: field moe_layer_freq is 2: only 1 is supported");

  ModelConfig g = Registered("glm-4.5-air");
  g.first_k_dense_replace = 47;
  EXPECT_EQ(ValidateConfig(g).message(),
            "model glm-4.5-air: first_k_dense_replace 47 is over num_hidden_layers 46");
  ModelConfig q = Registered("qwen3-8b");
  q.n_shared_experts = 1;
  EXPECT_EQ(ValidateConfig(q).message(),
            "model qwen3-8b: n_shared_experts is 1, but Qwen3ForCausalLM has none");
  ModelConfig d = Registered("deepseek-v3-tiny");
  d.v_head_dim = 0;
  EXPECT_EQ(ValidateConfig(d).message(), "model deepseek-v3-tiny: v_head_dim is 0, must be positive");
  d = Registered("deepseek-v3-tiny");
  d.num_nextn_predict_layers = int64_t{1} << 30;
  EXPECT_EQ(ValidateConfig(d).message(),
            "model deepseek-v3-tiny: num_nextn_predict_layers is 1073741824, over 16777216");
}

TEST(MtpLayerOf, NamesTheDrafterLayerOfATensor) {
  const ModelConfig ds = Registered("deepseek-v3");
  EXPECT_EQ(MtpLayerOf(ds, "model.layers.61.eh_proj.weight"), 61);
  EXPECT_EQ(MtpLayerOf(ds, "model.layers.61.mlp.experts.7.up_proj.weight"), 61);
  EXPECT_EQ(MtpLayerOf(ds, "model.layers.60.mlp.gate.weight"), -1);
  EXPECT_EQ(MtpLayerOf(ds, "model.layers.62.eh_proj.weight"), -1);  // past the MTP layers
  EXPECT_EQ(MtpLayerOf(ds, "model.embed_tokens.weight"), -1);
  EXPECT_EQ(MtpLayerOf(ds, "model.layers.61"), -1);
  EXPECT_EQ(MtpLayerOf(ds, "model.layers.x1.eh_proj.weight"), -1);
  EXPECT_EQ(MtpLayerOf(ds, "model.layers.00000000000061.eh_proj.weight"), -1);  // over 10 digits
  EXPECT_EQ(MtpLayerOf(Registered("kimi-k2"), "model.layers.61.eh_proj.weight"), -1);  // no MTP layers
  // Every MTP-layer tensor of the stream, and nothing else, has a layer.
  for (const TensorMeta& m : HfTensors(Registered("glm4-moe-tiny"))) {
    EXPECT_EQ(MtpLayerOf(Registered("glm4-moe-tiny"), m.name) >= 0, m.name.starts_with("model.layers.3."))
        << m.name;
  }
}

TEST(Registry, MtpFamilyAtBenchmarkSize) {
  const ModelConfig c = Registered("glm4-moe-0.6b");
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  const double params = static_cast<double>(ModelParams(c));
  EXPECT_GT(params, 0.5e9);
  EXPECT_LT(params, 0.75e9);
}

}  // namespace
}  // namespace wsync
