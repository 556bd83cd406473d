#include "model/config.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

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
            (std::vector<std::string>{"qwen3-0.6b", "qwen3-30b-a3b", "qwen3-8b", "qwen3-moe-tiny",
                                      "qwen3-tiny"}));
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
            "unknown model 'llama-7b': not a registered name (qwen3-0.6b, qwen3-30b-a3b, "
            "qwen3-8b, qwen3-moe-tiny, qwen3-tiny) nor a directory with a config.json");
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
                       "(supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM)");
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
  EXPECT_EQ(not_json.status().message(), "c.json: not a JSON object");
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

}  // namespace
}  // namespace wsync
