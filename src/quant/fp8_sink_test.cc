// Fp8LayerTracker's completion rule, and Fp8WorkerSink against an independent reference
// quantization (fp8_reference_testutil.h) of the bf16 tensors it was sent.
#include "quant/fp8_sink.h"

#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <random>

#include "quant/fp8_reference_testutil.h"

namespace wsync {
namespace {

// The registered tiny models, and variants whose shards sit on the 128 grid at tp 2
// (head_dim 128; MoE: moe_intermediate_size 256).
ModelConfig Model(const std::string& name) {
  if (name == "tiny-hd128" || name == "moe-tiny-hd128") {
    ModelConfig c = *LookupModel(name == "tiny-hd128" ? "qwen3-tiny" : "qwen3-moe-tiny");
    c.name = name;
    c.head_dim = 128;
    if (c.num_experts > 0) c.moe_intermediate_size = 256;
    return c;
  }
  Result<ModelConfig> c = LookupModel(name);
  EXPECT_TRUE(c.ok());
  return *c;
}

ShardingTable Table(const std::string& model, int rank, int tp) {
  Result<ShardingTable> t = ShardingTable::Build(Model(model), rank, tp);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

std::vector<std::string> LayerTensors(const ShardingTable& t, const std::string& layer) {
  std::vector<std::string> out;
  for (const TensorMeta& m : t.hf_tensors()) {
    if (m.name.starts_with(layer + ".")) out.push_back(m.name);
  }
  return out;
}

TEST(Fp8LayerTracker, LayerCompletesWhenEveryQuantizedTensorLanded) {
  const ShardingTable t = Table("qwen3-tiny", 0, 1);
  Fp8LayerTracker tr(t);
  EXPECT_EQ(tr.num_layers(), 4u);  // the four decoder layers
  const std::vector<std::string> names = LayerTensors(t, "model.layers.1");
  for (const std::string& n : names) {
    if (n == "model.layers.1.mlp.up_proj.weight") continue;
    tr.MarkHf(n);
  }
  EXPECT_TRUE(tr.TakeCompleted().empty());
  const Status s = tr.CheckComplete();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("model.layers.1: 1 of 7 quantized tensors incomplete (mlp.up_proj.weight)"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(s.message().find("model.layers.0"), std::string::npos) << s.message();  // untouched
  tr.MarkHf("model.layers.1.mlp.up_proj.weight");
  const std::vector<int> done = tr.TakeCompleted();
  std::vector<std::string> params;
  for (int p : done) params.push_back(t.params()[p].meta.name);
  EXPECT_EQ(params, (std::vector<std::string>{"model.layers.1.self_attn.qkv_proj.weight",
                                              "model.layers.1.self_attn.o_proj.weight",
                                              "model.layers.1.mlp.gate_up_proj.weight",
                                              "model.layers.1.mlp.down_proj.weight"}));
  EXPECT_TRUE(tr.TakeCompleted().empty());  // once per update
  EXPECT_TRUE(tr.CheckComplete().ok());
  tr.Reset();
  tr.MarkHf("model.layers.1.self_attn.q_proj.weight");
  EXPECT_TRUE(tr.TakeCompleted().empty());
  EXPECT_NE(tr.CheckComplete().message().find("model.layers.1: 6 of 7"), std::string::npos);
}

TEST(Fp8LayerTracker, ModelDtypeTensorsTouchNothing) {
  const ShardingTable t = Table("qwen3-tiny", 0, 1);
  Fp8LayerTracker tr(t);
  tr.MarkHf("model.layers.2.input_layernorm.weight");
  tr.MarkHf("model.embed_tokens.weight");
  tr.MarkHf("lm_head.weight");
  tr.MarkPiece(-1, 0);
  tr.MarkPiece(1 << 20, 0);
  EXPECT_TRUE(tr.TakeCompleted().empty());
  EXPECT_TRUE(tr.CheckComplete().ok());
}

TEST(Fp8LayerTracker, StackedExpertsCompletePieceByPiece) {
  // A tiny MoE at tp 2: every expert's gate/up/down lands as separate pieces of the
  // stacked w13 / w2 parameters; the router (mlp.gate) is not quantized.
  const ShardingTable t = Table("moe-tiny-hd128", 1, 2);
  ASSERT_TRUE(CheckFp8Sharding(t).ok());
  Fp8LayerTracker tr(t);
  std::vector<std::pair<int, int>> pieces;
  for (size_t i = 0; i < t.params().size(); ++i) {
    if (!t.params()[i].meta.name.starts_with("model.layers.0.") || !IsFp8Param(t, static_cast<int>(i))) continue;
    for (size_t k = 0; k < t.params()[i].pieces.size(); ++k) pieces.emplace_back(i, k);
  }
  ASSERT_GT(pieces.size(), 8u * 3);
  for (size_t n = 0; n + 1 < pieces.size(); ++n) {
    tr.MarkPiece(pieces[n].first, pieces[n].second);
    tr.MarkPiece(pieces[n].first, pieces[n].second);  // a repeated piece counts once
    ASSERT_TRUE(tr.TakeCompleted().empty()) << n;
  }
  const std::string last = t.params()[pieces.back().first].pieces[pieces.back().second].hf_name;
  EXPECT_NE(tr.CheckComplete().message().find("model.layers.0: 1 of 28 quantized tensors incomplete (" +
                                              last.substr(std::string("model.layers.0.").size()) + ")"),
            std::string::npos)
      << tr.CheckComplete().message();
  tr.MarkPiece(pieces.back().first, pieces.back().second);
  EXPECT_FALSE(tr.TakeCompleted().empty());
  EXPECT_TRUE(tr.CheckComplete().ok());
}

// Random bf16 bytes of `m` (values of a few magnitudes, so blocks differ in scale).
std::vector<std::byte> RandomBf16(const TensorMeta& m, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const size_t n = static_cast<size_t>(NumElements(m.shape));
  std::vector<std::byte> out(n * 2);
  for (size_t i = 0; i < n; ++i) {
    const float v = dist(rng) * std::ldexp(1.0f, static_cast<int>(i / 4096 % 7) - 3);
    const uint16_t b = static_cast<uint16_t>(std::bit_cast<uint32_t>(v) >> 16);
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

// Digests of the FP8 checkpoint of `tensors`, quantized by the reference.
std::map<std::string, std::string> ReferenceDigests(const std::map<std::string, std::vector<std::byte>>& tensors,
                                                    const ShardingTable& t) {
  std::map<std::string, std::string> out;
  for (const TensorMeta& m : t.hf_tensors()) {
    const std::vector<std::byte>& b = tensors.at(m.name);
    if (!IsFp8Quantized(m.name)) {
      out[m.name] = HexDigest(DigestAlgorithm::kSha256, b);
      continue;
    }
    const std::vector<float> x = fp8_reference::WidenBf16(b.data(), b.size() / 2);
    const fp8_reference::Quantized q = fp8_reference::Quantize(x, m.shape[0], m.shape[1]);
    out[m.name] = HexDigest(DigestAlgorithm::kSha256, std::as_bytes(std::span(q.q)));
    out[Fp8ScaleInvName(m.name)] = HexDigest(DigestAlgorithm::kSha256, std::as_bytes(std::span(q.scale_inv)));
  }
  return out;
}

TEST(Fp8WorkerSink, QuantizesLayersAsTheyLandAndDigestsMatchTheReference) {
  for (const auto& [model, tp] : std::vector<std::pair<std::string, int>>{
           {"qwen3-tiny", 1}, {"tiny-hd128", 2}, {"moe-tiny-hd128", 2}}) {
    SCOPED_TRACE(model);
    std::vector<std::unique_ptr<WorkerStore>> stores;
    std::vector<std::unique_ptr<Fp8WorkerSink>> sinks;
    for (int r = 0; r < tp; ++r) {
      auto store = WorkerStore::Create(Model(model), r, tp);
      ASSERT_TRUE(store.ok());
      auto sink = Fp8WorkerSink::Create(store->get(), 2);
      ASSERT_TRUE(sink.ok()) << sink.status().ToString();
      stores.push_back(std::move(store).value());
      sinks.push_back(std::move(sink).value());
    }
    std::vector<const Fp8WorkerSink*> group;
    for (auto& s : sinks) group.push_back(s.get());
    const ShardingTable& t = stores[0]->table();
    std::map<std::string, std::vector<std::byte>> sent;
    for (int update = 0; update < 2; ++update) {
      // Update 0 sends everything; update 1 only model.layers.1 (a partial update).
      for (auto& s : sinks) s->BeginUpdate();
      uint32_t seed = 100 * update;
      for (const TensorMeta& m : t.hf_tensors()) {
        ++seed;
        if (update == 1 && !m.name.starts_with("model.layers.1.")) continue;
        sent[m.name] = RandomBf16(m, seed);
        for (auto& s : sinks) {
          ASSERT_TRUE(s->Load(TensorRef{m.name, m.dtype, m.shape, sent[m.name], Device{}}).ok());
          ASSERT_TRUE(s->ChunkLanded().ok());
        }
      }
      for (auto& s : sinks) ASSERT_TRUE(s->FinishUpdate().ok());
      auto got = AllFp8HfDigests(group, DigestAlgorithm::kSha256, 2);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      const auto want = ReferenceDigests(sent, t);
      EXPECT_EQ(got->size(), Fp8HfTensors(t.config()).size());
      for (const auto& [name, hex] : want) EXPECT_EQ(got->at(name), hex) << name << " update " << update;
      // Row blocks smaller than a piece's runs (3 rows, and 1 byte: one row per block)
      // assemble the same bytes.
      for (size_t block : {size_t{3} * 128, size_t{1}}) {
        auto small = AllFp8HfDigests(group, DigestAlgorithm::kSha256, 2, block);
        ASSERT_TRUE(small.ok()) << small.status().ToString();
        EXPECT_EQ(*small, *got) << "block " << block;
      }
    }
    // The landing buffers of quantized parameters hold no memory between updates.
    for (size_t i = 0; i < t.params().size(); ++i) {
      if (!IsFp8Param(t, static_cast<int>(i))) continue;
      const std::span<std::byte> b = stores[0]->mutable_param_bytes(i);
      EXPECT_TRUE(std::all_of(b.begin(), b.end(), [](std::byte x) { return x == std::byte{0}; }))
          << t.params()[i].meta.name;
    }
  }
}

TEST(Fp8WorkerSink, AnIncompleteLayerIsNamedAtFinishAndLeftUnquantized) {
  auto store = WorkerStore::Create(*LookupModel("qwen3-tiny"), 0, 1);
  ASSERT_TRUE(store.ok());
  auto sink = Fp8WorkerSink::Create(store->get(), 2);
  ASSERT_TRUE(sink.ok());
  (*sink)->BeginUpdate();
  const ShardingTable& t = (*store)->table();
  std::vector<std::vector<std::byte>> keep;
  for (const TensorMeta& m : t.hf_tensors()) {
    if (m.name == "model.layers.3.self_attn.k_proj.weight" || m.name == "model.layers.3.mlp.down_proj.weight") continue;
    keep.push_back(RandomBf16(m, 7));
    ASSERT_TRUE((*sink)->Load(TensorRef{m.name, m.dtype, m.shape, keep.back(), Device{}}).ok());
  }
  ASSERT_TRUE((*sink)->ChunkLanded().ok());
  const Status s = (*sink)->FinishUpdate();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("model.layers.3: 2 of 7 quantized tensors incomplete (self_attn.k_proj.weight, "
                             "mlp.down_proj.weight)"),
            std::string::npos)
      << s.message();
  // The next update starts afresh.
  (*sink)->BeginUpdate();
  EXPECT_TRUE((*sink)->FinishUpdate().ok());
}

TEST(Fp8WorkerSink, RefusesShardsOffTheBlockGrid) {
  auto store = WorkerStore::Create(*LookupModel("qwen3-tiny"), 0, 2);
  ASSERT_TRUE(store.ok());
  auto sink = Fp8WorkerSink::Create(store->get(), 1);
  ASSERT_FALSE(sink.ok());
  EXPECT_EQ(sink.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(sink.status().message().find("model qwen3-tiny, tp 2"), std::string::npos) << sink.status().message();
}

}  // namespace
}  // namespace wsync
