// The "wsync_lora" declaration (lora_spec.h) and LoraStore's staging and install.
#include "receiver/lora_store.h"

#include <gtest/gtest.h>

#include "core/digest.h"
#include "model/config.h"
#include "model/update_meta.h"
#include "receiver/lora_spec.h"

namespace wsync {
namespace {

using nlohmann::json;

const ModelConfig& Tiny() {
  static const ModelConfig m = *LookupModel("qwen3-tiny");
  return m;
}

json Spec() {
  return json{{"format", 1}, {"name", "math"}, {"version", "v1"}, {"r", 4}, {"alpha", 8},
              {"target_modules", {"q_proj", "v_proj"}}};
}

std::string Refusal(const json& j) {
  Result<LoraSpec> s = ParseLoraSpec(j, Tiny());
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  return s.ok() ? "" : std::string(s.status().message());
}

TEST(LoraSpec, ParsesAndFixesPeftNamedTensorsOfRankR) {
  Result<LoraSpec> s = ParseLoraSpec(Spec(), Tiny());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->dtype, Tiny().dtype);
  EXPECT_DOUBLE_EQ(s->scaling(), 2.0);
  s->use_rslora = true;
  EXPECT_DOUBLE_EQ(s->scaling(), 4.0);  // alpha / sqrt(r), as vLLM's PEFTHelper
  Result<std::vector<TensorMeta>> t = LoraTensors(*s, Tiny());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->size(), 4u * static_cast<size_t>(Tiny().num_hidden_layers));
  const int64_t q_out = Tiny().num_attention_heads * Tiny().head_dim;
  EXPECT_EQ((*t)[0], (TensorMeta{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", Tiny().dtype,
                                 {4, Tiny().hidden_size}}));
  EXPECT_EQ((*t)[1], (TensorMeta{"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", Tiny().dtype,
                                 {q_out, 4}}));
  EXPECT_EQ((*t)[2].name, "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight");
  // The JSON form round-trips.
  Result<LoraSpec> again = ParseLoraSpec(s->ToJson(), Tiny());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->target_modules, s->target_modules);
}

TEST(LoraSpec, RefusesWhatIsOutOfBoundsNamingTheField) {
  auto with = [](const char* field, json v) {
    json j = Spec();
    if (v.is_null()) {
      j.erase(field);
    } else {
      j[field] = std::move(v);
    }
    return j;
  };
  EXPECT_NE(Refusal(with("name", "../etc")).find("'name'"), std::string::npos);
  EXPECT_NE(Refusal(with("name", std::string(65, 'a'))).find("'name'"), std::string::npos);
  EXPECT_NE(Refusal(with("name", "qwen3-tiny")).find("base model"), std::string::npos);
  EXPECT_NE(Refusal(with("version", "a\nb")).find("'version'"), std::string::npos);
  EXPECT_NE(Refusal(with("r", 0)).find("'r'"), std::string::npos);
  EXPECT_NE(Refusal(with("r", 4294967297ull)).find("'r'"), std::string::npos);
  EXPECT_NE(Refusal(with("r", 2.5)).find("'r'"), std::string::npos);
  EXPECT_NE(Refusal(with("alpha", -1)).find("'alpha'"), std::string::npos);
  EXPECT_NE(Refusal(with("alpha", "8")).find("'alpha'"), std::string::npos);
  EXPECT_NE(Refusal(with("target_modules", json::array())).find("'target_modules'"), std::string::npos);
  EXPECT_NE(Refusal(with("target_modules", {"lm_head"})).find("q_proj"), std::string::npos);
  EXPECT_NE(Refusal(with("target_modules", {"q_proj", "q_proj"})).find("twice"), std::string::npos);
  EXPECT_NE(Refusal(with("dtype", "int8")).find("'dtype'"), std::string::npos);
  EXPECT_NE(Refusal(with("format", 2)).find("'format'"), std::string::npos);
  EXPECT_NE(Refusal(with("format", nullptr)).find("'format'"), std::string::npos);
  EXPECT_NE(Refusal(with("scaling", 2)).find("unknown field 'scaling'"), std::string::npos);
  EXPECT_NE(Refusal(json::array()).find("object"), std::string::npos);
}

TEST(LoraSpec, BoundsTheAdapterSize) {
  Result<LoraSpec> s = ParseLoraSpec(Spec(), Tiny());
  ASSERT_TRUE(s.ok());
  Result<std::vector<TensorMeta>> t = LoraTensors(*s, Tiny(), /*max_bytes=*/1000);
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
}

// Lands every staged tensor filled with `fill`, through the staging sink.
void LandAll(LoraStore& store, uint8_t fill, size_t skip_last = 0) {
  WorkerSink* sink = store.staging_sink();
  ASSERT_NE(sink, nullptr);
  const std::vector<TensorMeta> tensors = sink->hf_tensors();
  for (size_t i = 0; i + skip_last < tensors.size(); ++i) {
    const TensorMeta& m = tensors[i];
    std::vector<std::byte> bytes(m.nbytes(), std::byte{fill});
    ASSERT_TRUE(sink->Load(TensorRef{m.name, m.dtype, m.shape, bytes, Device{}}).ok());
  }
}

TEST(LoraStore, StagesBesideTheLiveVersionAndSwapsAtCommit) {
  Result<LoraSpec> spec = ParseLoraSpec(Spec(), Tiny());
  ASSERT_TRUE(spec.ok());
  Result<std::vector<TensorMeta>> tensors = LoraTensors(*spec, Tiny());
  ASSERT_TRUE(tensors.ok());
  LoraStore store;
  ASSERT_TRUE(store.Begin(*spec, *tensors).ok());
  LandAll(store, 1);
  ASSERT_TRUE(store.CheckStaged().ok());
  std::shared_ptr<const LoraAdapter> v1 = store.Commit();
  ASSERT_NE(v1, nullptr);
  EXPECT_EQ(v1->spec.version, "v1");
  EXPECT_EQ(v1->loads, 1);

  // v2 misses a tensor: finish is refused and v1 keeps serving.
  ASSERT_TRUE(store.Begin(*spec, *tensors).ok());
  LandAll(store, 2, /*skip_last=*/1);
  Status missing = store.CheckStaged();
  EXPECT_EQ(missing.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(missing.message().find(tensors->back().name), std::string::npos) << missing.ToString();
  store.Discard();
  EXPECT_EQ(store.Find("math"), v1);

  // v3 lands whole: a reader holding v1 keeps its bytes, new readers see v3.
  ASSERT_TRUE(store.Begin(*spec, *tensors).ok());
  LandAll(store, 3);
  ASSERT_TRUE(store.CheckStaged().ok());
  std::shared_ptr<const LoraAdapter> v3 = store.Commit("v3");
  EXPECT_EQ(store.Find("math"), v3);
  EXPECT_EQ(v3->spec.version, "v3");
  EXPECT_EQ(v3->loads, 2);
  EXPECT_NE(v3->key, v1->key);
  EXPECT_EQ(v1->bytes[0][0], std::byte{1});
  EXPECT_EQ(v3->bytes[0][0], std::byte{3});
  EXPECT_EQ(store.size(), 1u);
  EXPECT_TRUE(store.Unload("math").ok());
  EXPECT_EQ(store.Unload("math").code(), StatusCode::kNotFound);
}

TEST(LoraStore, StagingRefusesTensorsOutsideTheAdapter) {
  Result<LoraSpec> spec = ParseLoraSpec(Spec(), Tiny());
  Result<std::vector<TensorMeta>> tensors = LoraTensors(*spec, Tiny());
  LoraStore store;
  ASSERT_TRUE(store.Begin(*spec, *tensors).ok());
  const TensorMeta& a = tensors->front();
  std::vector<std::byte> bytes(a.nbytes());
  // Admission's view (what it finds, checked as admission checks it) and the sink's own
  // check agree.
  const HeldTensors* held = store.staging_tensors();
  ASSERT_NE(held->Find(a.name), nullptr);
  EXPECT_TRUE(CheckUpdateMeta(*held->Find(a.name), a.dtype, a.shape).ok());
  TensorMeta wrong = a;
  wrong.shape[0] += 1;
  EXPECT_EQ(CheckUpdateMeta(*held->Find(a.name), wrong.dtype, wrong.shape).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(held->Find("model.norm.weight"), nullptr);
  EXPECT_NE(held->Describe().find("adapter "), std::string::npos) << held->Describe();
  std::vector<std::byte> short_bytes(a.nbytes() - 1);
  EXPECT_EQ(store.staging_sink()->Load(TensorRef{"model.norm.weight", a.dtype, a.shape, bytes, Device{}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store.staging_sink()->Load(TensorRef{a.name, a.dtype, a.shape, short_bytes, Device{}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store.CheckStaged().code(), StatusCode::kFailedPrecondition);
}

// Row-range digests read the staged bytes of a landed tensor, one hex per range, joined
// by ','; a tensor not landed, or rows outside it, are refused.
TEST(LoraStore, StagedRowsDigestHashesEachRangeOfWhatLanded) {
  Result<LoraSpec> spec = ParseLoraSpec(Spec(), Tiny());
  Result<std::vector<TensorMeta>> tensors = LoraTensors(*spec, Tiny());
  ASSERT_TRUE(tensors.ok());
  LoraStore store;
  ASSERT_TRUE(store.Begin(*spec, *tensors).ok());
  LandAll(store, 5, /*skip_last=*/1);
  const TensorMeta& a = tensors->front();
  const int64_t rows = a.shape[0];
  const size_t row_bytes = a.nbytes() / static_cast<size_t>(rows);
  const std::vector<std::pair<int64_t, int64_t>> ranges{{0, 1}, {1, rows}};
  Result<std::string> got = store.StagedRowsDigest(a.name, ranges);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, HexDigest(DigestAlgorithm::kXxh3_128, std::vector<std::byte>(row_bytes, std::byte{5})) + "," +
                      HexDigest(DigestAlgorithm::kXxh3_128,
                                std::vector<std::byte>(row_bytes * static_cast<size_t>(rows - 1), std::byte{5})));
  EXPECT_EQ(store.StagedRowsDigest(tensors->back().name, ranges).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store.StagedRowsDigest("model.norm.weight", ranges).status().code(), StatusCode::kNotFound);
  const std::vector<std::pair<int64_t, int64_t>> past{{0, rows + 1}};
  EXPECT_EQ(store.StagedRowsDigest(a.name, past).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wsync
