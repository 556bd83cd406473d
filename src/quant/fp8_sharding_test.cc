// Shard-aware FP8 quantization: which tensors are quantized, the grid check that refuses
// shard boundaries off the 128 grid (names checked), and the round trip that matters:
// every TP worker quantizes its own parameters (loaded by a real WorkerStore), the HF
// NAME / NAME_scale_inv reassembled from the group's primary pieces equal the whole HF
// tensor quantized at once and the independent reference, at tp 1, 2 and 4 (replicated KV
// heads, stacked experts, partial edge blocks included).
#include <bit>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype_convert.h"
#include "model/sharding.h"
#include "model/worker_store.h"
#include "quant/fp8_reference_testutil.h"
#include "quant/fp8_sharding.h"

namespace wsync {
namespace {

ModelConfig Config(std::string name, int64_t hidden, int64_t inter, int64_t heads, int64_t kv, int64_t head_dim) {
  ModelConfig c;
  c.name = std::move(name);
  c.architecture = std::string(kQwen3Dense);
  c.vocab_size = 512;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_hidden_layers = 2;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv;
  c.head_dim = head_dim;
  return c;
}

ModelConfig MoeConfig(std::string name, int64_t hidden, int64_t moe_inter, int64_t experts) {
  ModelConfig c = Config(std::move(name), hidden, 1024, 4, 2, 128);
  c.architecture = std::string(kQwen3Moe);
  c.moe_intermediate_size = moe_inter;
  c.num_experts = experts;
  return c;
}

ShardingTable Table(const ModelConfig& c, int rank, int tp) {
  Result<ShardingTable> t = ShardingTable::Build(c, rank, tp);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

TEST(Fp8ShardingTest, QuantizesTheLinearWeightsOnly) {
  for (const char* yes : {"model.layers.0.self_attn.q_proj.weight", "model.layers.12.self_attn.o_proj.weight",
                          "model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.down_proj.weight",
                          "model.layers.1.mlp.experts.127.up_proj.weight",
                          "model.layers.4.mlp.shared_experts.gate_proj.weight"}) {
    EXPECT_TRUE(IsFp8Quantized(yes)) << yes;
  }
  for (const char* no : {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                         "model.layers.0.self_attn.q_norm.weight", "model.layers.0.input_layernorm.weight",
                         "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
                         "model.layers.0.self_attn.q_proj.bias", "x.model.layers.0.mlp.up_proj.weight",
                         "model.layers..self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight.x",
                         "model.layers.0.mlp.experts..up_proj.weight", "model.layers.0.mlp.experts.up_proj.weight",
                         "model.layers.0.self_attn.qk_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
                         "model.layers.0.mlp.experts.w13_weight", "model.layers.0.self_attn.qkv_proj.weight",
                         "model.layers.3.eh_proj.weight", "model.layers.0.mlp.shared_experts.0.up_proj.weight"}) {
    EXPECT_FALSE(IsFp8Quantized(no)) << no;
  }
  EXPECT_EQ(Fp8ScaleInvName("model.layers.0.mlp.up_proj.weight"), "model.layers.0.mlp.up_proj.weight_scale_inv");
  auto w = ParseFp8HfName("model.layers.0.mlp.up_proj.weight");
  ASSERT_TRUE(w.has_value());
  EXPECT_FALSE(w->scale);
  auto s = ParseFp8HfName("model.layers.0.mlp.up_proj.weight_scale_inv");
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->scale);
  EXPECT_EQ(s->hf_name, "model.layers.0.mlp.up_proj.weight");
  EXPECT_FALSE(ParseFp8HfName("model.layers.0.mlp.gate.weight_scale_inv").has_value());
  EXPECT_FALSE(ParseFp8HfName("model.norm.weight").has_value());
}

TEST(Fp8ShardingTest, HfFp8TensorListHasScalesAfterEachWeight) {
  const ModelConfig c = *LookupModel("qwen3-0.6b");
  const std::vector<TensorMeta> hf = HfTensors(c), fp8 = Fp8HfTensors(c);
  EXPECT_EQ(fp8.size(), hf.size() + 7 * c.num_hidden_layers);
  for (size_t i = 0; i < fp8.size(); ++i) {
    if (!IsFp8Quantized(fp8[i].name)) continue;
    EXPECT_EQ(fp8[i].dtype, DType::kF8E4M3);
    ASSERT_LT(i + 1, fp8.size());
    EXPECT_EQ(fp8[i + 1].name, fp8[i].name + "_scale_inv");
    EXPECT_EQ(fp8[i + 1].dtype, DType::kF32);
    EXPECT_EQ(fp8[i + 1].shape, (Shape{(fp8[i].shape[0] + 127) / 128, (fp8[i].shape[1] + 127) / 128}));
  }
  // q_proj [2048, 1024] -> scales [16, 8]; embed_tokens unchanged.
  EXPECT_EQ(fp8[0], hf[0]);
  EXPECT_EQ(fp8[2].name, "model.layers.0.self_attn.q_proj.weight_scale_inv");
  EXPECT_EQ(fp8[2].shape, (Shape{16, 8}));
}

TEST(Fp8ShardingTest, AcceptsShardsOnTheGrid) {
  const ModelConfig small = *LookupModel("qwen3-0.6b");
  for (int tp : {1, 2, 4, 8}) {
    for (int r : {0, tp - 1}) EXPECT_TRUE(CheckFp8Sharding(Table(small, r, tp)).ok()) << tp;
  }
  // qwen3-8b at tp 16: each of the 8 KV heads replicated on two ranks.
  EXPECT_TRUE(CheckFp8Sharding(Table(*LookupModel("qwen3-8b"), 15, 16)).ok());
  EXPECT_TRUE(CheckFp8Sharding(Table(*LookupModel("qwen3-tiny"), 0, 1)).ok());
  EXPECT_TRUE(CheckFp8Sharding(Table(*LookupModel("qwen3-moe-tiny"), 0, 1)).ok());
  EXPECT_TRUE(CheckFp8Sharding(Table(*LookupModel("qwen3-30b-a3b"), 1, 2)).ok());
}

void ExpectRefused(const ShardingTable& t, const std::vector<std::string>& parts) {
  const Status st = CheckFp8Sharding(t);
  ASSERT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  for (const std::string& p : parts) EXPECT_NE(st.message().find(p), std::string::npos) << p << " in " << st.message();
}

TEST(Fp8ShardingTest, RefusesShardBoundariesOffTheGrid) {
  // qwen3-tiny: head_dim 64, 2 KV heads. tp 2: one 64-row KV head per rank.
  const ModelConfig tiny = *LookupModel("qwen3-tiny");
  ExpectRefused(Table(tiny, 1, 2),
                {"model qwen3-tiny, tp 2", "rows [64, 128) of model.layers.0.self_attn.k_proj.weight",
                 "rows [128, 192) of model.layers.0.self_attn.qkv_proj.weight", "tp rank 1",
                 "boundary 64 is not a multiple of 128"});
  // tp 4: KV heads replicated on two ranks each, still 64 rows.
  ExpectRefused(Table(tiny, 0, 4), {"model qwen3-tiny, tp 4", "model.layers.0.self_attn.q_proj.weight",
                                    "boundary 64 is not a multiple of 128"});
  // A dense MLP split into 576-row shards.
  ExpectRefused(Table(Config("mlp576", 256, 1152, 2, 2, 128), 0, 2),
                {"model mlp576, tp 2", "rows [0, 576) of model.layers.0.mlp.gate_proj.weight",
                 "model.layers.0.mlp.gate_up_proj.weight", "boundary 576"});
  // Experts: gate_proj's 192 rows end the HF tensor but not w13 (up_proj follows).
  ExpectRefused(Table(MoeConfig("moe192", 256, 192, 4), 0, 1),
                {"model moe192, tp 1", "rows [0, 192) of model.layers.0.mlp.experts.0.gate_proj.weight",
                 "model.layers.0.mlp.experts.w13_weight (expert 0)", "boundary 192"});
  // Qwen3-30B-A3B at tp 4: 192-row expert shards (vLLM refuses this model and tp too).
  ExpectRefused(Table(*LookupModel("qwen3-30b-a3b"), 0, 4),
                {"model qwen3-30b-a3b, tp 4", "model.layers.0.mlp.experts.0.gate_proj.weight", "boundary 192"});
  // A partial block at the end of a tensor that also ends the parameter is fine.
  EXPECT_TRUE(CheckFp8Sharding(Table(Config("edge", 320, 1024, 4, 2, 128), 0, 1)).ok());
  // Refused the same way by Fp8LayoutOf, naming the parameter.
  const ShardingTable t = Table(tiny, 0, 2);
  Result<Fp8ParamLayout> l = Fp8LayoutOf(t, t.FindParam("model.layers.0.self_attn.qkv_proj.weight"));
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("qkv_proj"), std::string::npos);
  Result<Fp8ParamLayout> n = Fp8LayoutOf(t, t.FindParam("model.norm.weight"));
  ASSERT_FALSE(n.ok());
  EXPECT_NE(n.status().message().find("model.norm.weight is not fp8-quantized"), std::string::npos)
      << n.status().message();
}

TEST(Fp8ShardingTest, LayoutsAndRunsFollowTheTable) {
  const ModelConfig c = MoeConfig("moe", 320, 512, 4);
  const ShardingTable t = Table(c, 1, 2);
  const int w13 = t.FindParam("model.layers.0.mlp.experts.w13_weight");
  Result<Fp8ParamLayout> l = Fp8LayoutOf(t, w13);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->weight, (TensorMeta{"model.layers.0.mlp.experts.w13_weight", DType::kF8E4M3, {4, 512, 320}}));
  EXPECT_EQ(l->scale_inv,
            (TensorMeta{"model.layers.0.mlp.experts.w13_weight_scale_inv", DType::kF32, {4, 4, 3}}));
  EXPECT_EQ(l->shape.count, 4);
  const int qkv = t.FindParam("model.layers.1.self_attn.qkv_proj.weight");
  Result<Fp8ParamLayout> q = Fp8LayoutOf(t, qkv);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->scale_inv.name, "model.layers.1.self_attn.qkv_proj.weight_scale_inv");
  EXPECT_EQ(q->scale_inv.shape, (Shape{4, 3}));  // 2 q heads + k + v = 512 rows, 320 cols
  // The e4m3 runs are the table's runs over one-byte elements.
  for (int i = 0; i < static_cast<int>(t.params().size()); ++i) {
    if (!IsFp8Param(t, i)) continue;
    for (int k = 0; k < static_cast<int>(t.params()[i].pieces.size()); ++k) {
      const PieceRuns a = t.Runs(i, k), b = Fp8WeightRuns(t, i, k);
      EXPECT_EQ(b.count, a.count);
      EXPECT_EQ(b.run_bytes * 2, a.run_bytes);
      EXPECT_EQ(b.hf_offset * 2, a.hf_offset);
      EXPECT_EQ(b.hf_stride * 2, a.hf_stride);
      EXPECT_EQ(b.dst_offset * 2, a.dst_offset);
      EXPECT_EQ(b.dst_stride * 2, a.dst_stride);
    }
  }
  // down_proj of expert 3 on rank 1: columns [256, 512) -> scale columns [2, 4) of a [3, 4]
  // grid, into expert 3's [3, 2] sub-grid of w2's scales.
  const int w2 = t.FindParam("model.layers.0.mlp.experts.w2_weight");
  const PieceRuns s = Fp8ScaleRuns(t, w2, 3);
  EXPECT_EQ(t.params()[w2].pieces[3].hf_name, "model.layers.0.mlp.experts.3.down_proj.weight");
  EXPECT_EQ(s.count, 3);
  EXPECT_EQ(s.run_bytes, 2 * 4);
  EXPECT_EQ(s.hf_offset, 2 * 4);
  EXPECT_EQ(s.hf_stride, 4 * 4);
  EXPECT_EQ(s.dst_offset, 3 * 3 * 2 * 4);
  EXPECT_EQ(s.dst_stride, 2 * 4);
}

// Random bf16 weights for every HF tensor of `c`, about one in eight zero, scales varying
// by tensor so blocks differ.
std::vector<HostTensor> RandomWeights(const ModelConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<HostTensor> out;
  int n = 0;
  for (TensorMeta m : HfTensors(c)) {
    HostTensor h = *HostTensor::Zeros(std::move(m));
    auto* x = reinterpret_cast<uint16_t*>(h.storage.data());
    const float scale = std::ldexp(1.0f, -(n++ % 12));
    for (int64_t i = 0; i < h.meta.numel(); ++i) x[i] = rng() % 8 == 0 ? 0 : FloatToBF16(normal(rng) * scale);
    out.push_back(std::move(h));
  }
  return out;
}

struct QuantizedWorker {
  std::unique_ptr<WorkerStore> store;
  std::vector<std::vector<uint8_t>> weight;
  std::vector<std::vector<float>> scale;
  std::vector<Fp8ParamView> views;
};

// `reference`: also compare with the (slow) independent reference; the weights are the
// same at every tp, so one tp per model suffices.
void ExpectShardedMatchesWhole(const ModelConfig& c, int tp, bool reference) {
  SCOPED_TRACE(::testing::Message() << c.name << " tp " << tp);
  const std::vector<HostTensor> hf = RandomWeights(c, 11);
  std::vector<QuantizedWorker> workers(tp);
  std::vector<Fp8WorkerView> group;
  for (int r = 0; r < tp; ++r) {
    QuantizedWorker& w = workers[r];
    auto store = WorkerStore::Create(c, r, tp);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    w.store = std::move(store).value();
    for (const HostTensor& h : hf) ASSERT_TRUE(w.store->Load(h.ref()).ok()) << h.meta.name;
    const ShardingTable& t = w.store->table();
    ASSERT_TRUE(CheckFp8Sharding(t).ok()) << CheckFp8Sharding(t).ToString();
    const size_t np = t.params().size();
    w.weight.resize(np);
    w.scale.resize(np);
    w.views.resize(np);
    for (size_t i = 0; i < np; ++i) {
      if (!IsFp8Param(t, static_cast<int>(i))) continue;
      Result<Fp8ParamLayout> l = Fp8LayoutOf(t, static_cast<int>(i));
      ASSERT_TRUE(l.ok()) << l.status().ToString();
      w.weight[i].resize(l->weight.numel());
      w.scale[i].resize(l->scale_inv.numel());
      const std::span<const std::byte> src(w.store->param_data(i), t.params()[i].meta.nbytes());
      ASSERT_TRUE(QuantizeFp8Param(t, static_cast<int>(i), src, w.weight[i], w.scale[i], 2).ok());
      w.views[i] = Fp8ParamView{w.weight[i], w.scale[i]};
    }
    group.push_back(Fp8WorkerView{&t, w.views});
  }
  int checked = 0;
  for (const HostTensor& h : hf) {
    if (!IsFp8Quantized(h.meta.name)) continue;
    const int64_t rows = h.meta.shape[0], cols = h.meta.shape[1];
    const Fp8MatrixShape shape{1, rows, cols};
    std::vector<uint8_t> got(rows * cols), whole(rows * cols);
    std::vector<float> got_s(shape.scales()), whole_s(shape.scales());
    ASSERT_TRUE(ReadBackFp8Hf(group, h.meta.name, std::as_writable_bytes(std::span(got))).ok()) << h.meta.name;
    ASSERT_TRUE(ReadBackFp8Hf(group, Fp8ScaleInvName(h.meta.name), std::as_writable_bytes(std::span(got_s))).ok())
        << h.meta.name;
    ASSERT_TRUE(QuantizeFp8Blocks(h.storage.span().first(h.meta.nbytes()), DType::kBF16, shape, whole, whole_s, 1,
                                  h.meta.name)
                    .ok());
    ASSERT_EQ(got, whole) << h.meta.name;
    ASSERT_EQ(std::memcmp(got_s.data(), whole_s.data(), got_s.size() * sizeof(float)), 0) << h.meta.name;
    ++checked;
    if (!reference) continue;
    // The independent reference, from the trainer's bf16 values.
    std::vector<float> x(rows * cols);
    const auto* b = reinterpret_cast<const uint16_t*>(h.storage.data());
    for (int64_t i = 0; i < rows * cols; ++i) x[i] = BF16ToFloat(b[i]);
    const fp8_reference::Quantized want = fp8_reference::Quantize(x, rows, cols);
    ASSERT_EQ(got, want.q) << h.meta.name;
    ASSERT_EQ(std::memcmp(got_s.data(), want.scale_inv.data(), got_s.size() * sizeof(float)), 0) << h.meta.name;
  }
  EXPECT_GT(checked, 0);
}

TEST(Fp8ShardingTest, ShardedQuantizationReassemblesToTheWholeTensorsQuantization) {
  ExpectShardedMatchesWhole(*LookupModel("qwen3-tiny"), 1, true);
  // head_dim 128, hidden 320 (partial column blocks), 2 KV heads: replicated at tp 4.
  const ModelConfig dense = Config("fp8-dense", 320, 1024, 8, 2, 128);
  const ModelConfig moe = MoeConfig("fp8-moe", 320, 512, 4);
  for (int tp : {1, 2, 4}) {
    ExpectShardedMatchesWhole(dense, tp, tp == 1);
    ExpectShardedMatchesWhole(moe, tp, tp == 1);
  }
}

TEST(Fp8ShardingTest, SourcesListWhereEachCheckpointTensorLives) {
  // tp 4 of 2 KV heads: rank 1 holds a replica of KV head 0.
  const ShardingTable t = Table(Config("fp8-dense", 320, 1024, 8, 2, 128), 1, 4);
  const std::vector<Fp8Source> k = Fp8SourcesOf(t, "model.layers.1.self_attn.k_proj.weight_scale_inv");
  ASSERT_EQ(k.size(), 1u);
  EXPECT_EQ(k[0].param, t.FindParam("model.layers.1.self_attn.qkv_proj.weight"));
  EXPECT_EQ(k[0].piece, 1);
  EXPECT_FALSE(k[0].primary);
  EXPECT_TRUE(k[0].scale);
  // k rows [0, 128) -> scale row 0 of a [1, 3] grid; at rows [256, 384) of qkv -> scale row 2.
  EXPECT_EQ(k[0].runs.count, 1);
  EXPECT_EQ(k[0].runs.run_bytes, 3 * 4);
  EXPECT_EQ(k[0].runs.hf_offset, 0);
  EXPECT_EQ(k[0].runs.dst_offset, 2 * 3 * 4);
  const std::vector<Fp8Source> o = Fp8SourcesOf(t, "model.layers.1.self_attn.o_proj.weight");
  ASSERT_EQ(o.size(), 1u);
  EXPECT_FALSE(o[0].scale);
  EXPECT_TRUE(o[0].primary);
  EXPECT_EQ(o[0].runs.count, 320);     // o_proj [320, 1024] split along columns
  EXPECT_EQ(o[0].runs.run_bytes, 256);  // 2 heads of 128
  EXPECT_EQ(o[0].runs.hf_offset, 256);
  EXPECT_TRUE(Fp8SourcesOf(t, "model.layers.1.mlp.gate.weight_scale_inv").empty());
  EXPECT_TRUE(Fp8SourcesOf(t, "model.norm.weight").empty());
}

TEST(Fp8ShardingTest, ReadBackErrorsNameTheTensor) {
  const ModelConfig c = *LookupModel("qwen3-tiny");
  const ShardingTable t = Table(c, 0, 1);
  std::vector<Fp8ParamView> views(t.params().size());
  const Fp8WorkerView group[] = {{&t, views}};
  std::vector<std::byte> w(256 * 256), s(4 * 4);
  Status st = ReadBackFp8Hf(group, "model.norm.weight", w);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("model.norm.weight"), std::string::npos) << st.message();
  st = ReadBackFp8Hf(group, "model.layers.0.self_attn.q_proj.weight", w);  // views are empty
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tp rank 0 holds too few bytes of model.layers.0.self_attn.qkv_proj.weight"),
            std::string::npos)
      << st.message();
  st = ReadBackFp8Hf(group, "model.layers.0.self_attn.q_proj.weight_scale_inv", w);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("output holds 65536 bytes, the tensor 16"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace wsync
