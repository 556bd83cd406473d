// LoraAdapterSource: PEFT names, shape checks and deduplication across ranks.
#include "sources/lora_source.h"

#include <gtest/gtest.h>

#include <cstring>

#include <fmt/format.h>

namespace wsync {
namespace {

HostTensor Filled(std::string name, Shape shape, uint8_t fill) {
  HostTensor t = *HostTensor::Zeros(TensorMeta{std::move(name), DType::kF32, std::move(shape)});
  std::memset(t.storage.data(), fill, t.meta.nbytes());
  return t;
}

LoraAdapterOptions Options() {
  LoraAdapterOptions o;
  o.name = "math";
  o.r = 2;
  o.alpha = 4;
  o.target_modules = {"q_proj"};
  return o;
}

std::vector<HostTensor> Rank(uint8_t fill, int layer) {
  std::vector<HostTensor> out;
  const std::string m = fmt::format("model.layers.{}.self_attn.q_proj", layer);
  out.push_back(Filled(m + ".lora_A.default.weight", {2, 8}, fill));
  out.push_back(Filled(m + ".lora_B.default.weight", {16, 2}, fill));
  out.push_back(Filled(m + ".base_layer.weight", {16, 8}, fill));  // not the adapter's
  return out;
}

TEST(PeftLoraName, NamesAsPeftSaves) {
  EXPECT_EQ(PeftLoraName("model.layers.0.mlp.up_proj.lora_B.default.weight"),
            "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight");
  EXPECT_EQ(PeftLoraName("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"),
            "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight");
  EXPECT_EQ(PeftLoraName("model.layers.0.mlp.up_proj.weight"), std::nullopt);
  EXPECT_EQ(PeftLoraName("lora_A.weight"), std::nullopt);
  EXPECT_EQ(PeftLoraName("x.lora_C.weight"), std::nullopt);
}

TEST(LoraAdapterSource, KeepsEachTensorOnceAcrossRanks) {
  std::vector<std::vector<HostTensor>> ranks;
  ranks.push_back(Rank(1, 0));
  ranks.push_back(Rank(1, 0));  // a copy of rank 0's
  ranks.push_back(Rank(3, 1));
  Result<std::unique_ptr<HostTensorSource>> s = LoraAdapterSource(Options(), std::move(ranks));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ((*s)->metadata().size(), 4u);
  EXPECT_EQ((*s)->metadata()[0].name, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
}

TEST(LoraAdapterSource, RefusesCopiesThatDifferAndWrongShapes) {
  std::vector<std::vector<HostTensor>> ranks;
  ranks.push_back(Rank(1, 0));
  ranks.push_back(Rank(2, 0));
  Status differ = LoraAdapterSource(Options(), std::move(ranks)).status();
  EXPECT_EQ(differ.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(differ.message().find("between rank 0 and rank 1"), std::string::npos) << differ.ToString();

  LoraAdapterOptions r4 = Options();
  r4.r = 4;
  std::vector<std::vector<HostTensor>> one;
  one.push_back(Rank(1, 0));
  EXPECT_NE(LoraAdapterSource(r4, std::move(one)).status().message().find("rank 4"), std::string::npos);

  LoraAdapterOptions v_only = Options();
  v_only.target_modules = {"v_proj"};
  std::vector<std::vector<HostTensor>> two;
  two.push_back(Rank(1, 0));
  EXPECT_NE(LoraAdapterSource(v_only, std::move(two)).status().message().find("not one of target_modules"),
            std::string::npos);

  std::vector<std::vector<HostTensor>> half;
  half.emplace_back();
  half.back().push_back(Filled("model.layers.0.self_attn.q_proj.lora_A.weight", {2, 8}, 1));
  EXPECT_NE(LoraAdapterSource(Options(), std::move(half)).status().message().find("no lora_B"), std::string::npos);
}

}  // namespace
}  // namespace wsync
