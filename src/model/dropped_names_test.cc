#include "model/dropped_names.h"

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "model/config.h"
#include "model/worker_store.h"

namespace wsync {
namespace {

TEST(DroppedNameReason, DropsRotaryBuffersTiedHeadsAndMtpCopies) {
  EXPECT_NE(DroppedNameReason("model.layers.0.self_attn.rotary_emb.inv_freq", false), "");
  EXPECT_NE(DroppedNameReason("model.rotary_emb.inv_freq", false), "");
  EXPECT_NE(DroppedNameReason("rotary_emb.inv_freq", false), "");
  EXPECT_NE(DroppedNameReason("model.layers.3.self_attn.rotary_emb.cos_cached", false), "");
  EXPECT_NE(DroppedNameReason("model.layers.3.self_attn.rotary_emb.sin_cached", false), "");
  EXPECT_EQ(DroppedNameReason("model.layers.0.self_attn.my_rotary_emb.inv_freq", false), "");

  EXPECT_NE(DroppedNameReason("lm_head.weight", true), "");
  EXPECT_EQ(DroppedNameReason("lm_head.weight", false), "");
  EXPECT_EQ(DroppedNameReason("model.lm_head.weight", true), "");

  EXPECT_EQ(DroppedNameReason("model.layers.61.embed_tokens.weight", false),
            "an MTP layer's copy of model.embed_tokens.weight, which the drafter shares");
  EXPECT_EQ(DroppedNameReason("model.layers.61.shared_head.head.weight", false),
            "an MTP layer's copy of lm_head.weight, which the drafter shares");
  EXPECT_EQ(DroppedNameReason("model.layers.61.shared_head.norm.weight", false), "");
  EXPECT_EQ(DroppedNameReason("model.embed_tokens.weight", true), "");
  EXPECT_EQ(DroppedNameReason("model.layers..embed_tokens.weight", false), "");
  EXPECT_EQ(DroppedNameReason("model.layers.x.embed_tokens.weight", false), "");
  EXPECT_EQ(DroppedNameReason("model.layers.00000000061.embed_tokens.weight", false), "");  // over 10 digits
  EXPECT_EQ(DroppedNameReason("model.layers.1.2.embed_tokens.weight", false), "");

  // No name of a registered model's checkpoint is dropped.
  for (const std::string& name : RegisteredModelNames()) {
    const ModelConfig c = *LookupModel(name);
    if (ModelParams(c) > (int64_t{1} << 31)) continue;  // the list alone is large
    for (const TensorMeta& m : HfTensors(c)) EXPECT_EQ(DroppedNameReason(m.name, c), "") << name << " " << m.name;
  }
}

HostTensor Filled(TensorMeta m, uint8_t byte) {
  HostTensor h = *HostTensor::Zeros(std::move(m));
  std::memset(h.storage.data(), byte, h.meta.nbytes());
  return h;
}

std::vector<std::byte> ReadBack(const WorkerStore& store, const TensorMeta& m) {
  std::vector<std::byte> out(m.nbytes());
  const WorkerStore* group[] = {&store};
  EXPECT_TRUE(ReadBackHf(group, m.name, out).ok());
  return out;
}

// A dropped name lands nothing: the shared tensors keep the bytes they were sent.
TEST(WorkerStore, DroppedNamesLandNothing) {
  const ModelConfig c = *LookupModel("deepseek-v3-tiny");  // MTP layer 3
  auto store = WorkerStore::Create(c, 0, 1, Device{}, Drafter::kMtp);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  for (const TensorMeta& m : HfTensors(c)) ASSERT_TRUE((*store)->Load(Filled(m, 0x11).ref()).ok()) << m.name;
  const TensorMeta embed = HfTensors(c).front();
  const TensorMeta head{"lm_head.weight", c.dtype, embed.shape};
  const std::vector<TensorMeta> copies = {
      {"model.layers.3.embed_tokens.weight", c.dtype, embed.shape},
      {"model.layers.3.shared_head.head.weight", c.dtype, embed.shape},
      {"model.layers.3.self_attn.rotary_emb.inv_freq", DType::kF32, {32}},
  };
  for (const TensorMeta& m : copies) {
    HostTensor t = Filled(m, 0x77);
    EXPECT_TRUE((*store)->Load(t.ref()).ok()) << m.name;
    std::vector<WorkerStore::ByteCopy> planned;
    EXPECT_TRUE((*store)->PlanLoad(t.ref(), &planned).ok()) << m.name;
    EXPECT_TRUE(planned.empty()) << m.name;
  }
  const std::vector<std::byte> want(embed.nbytes(), std::byte{0x11});
  EXPECT_EQ(ReadBack(**store, embed), want);
  EXPECT_EQ(ReadBack(**store, head), want);
  // An unknown name is still refused.
  EXPECT_FALSE((*store)->Load(Filled({"model.layers.3.embed_tokens.bias", c.dtype, {4}}, 0).ref()).ok());

  // A tied model: lm_head.weight is dropped, embed_tokens keeps its bytes.
  ModelConfig tied = *LookupModel("qwen3-tiny");
  tied.tie_word_embeddings = true;
  auto t = WorkerStore::Create(tied, 0, 1);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const TensorMeta tied_embed = HfTensors(tied).front();
  ASSERT_TRUE((*t)->Load(Filled(tied_embed, 0x22).ref()).ok());
  EXPECT_TRUE((*t)->Load(Filled({"lm_head.weight", tied.dtype, tied_embed.shape}, 0x55).ref()).ok());
  EXPECT_EQ(ReadBack(**t, tied_embed), std::vector<std::byte>(tied_embed.nbytes(), std::byte{0x22}));
}

}  // namespace
}  // namespace wsync
