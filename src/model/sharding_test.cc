#include "model/sharding.h"

#include <algorithm>
#include <map>
#include <string>

#include <gtest/gtest.h>

namespace wsync {
namespace {

ModelConfig Model(const std::string& name) { return *LookupModel(name); }

// The TP group; with `ep`, rank r is also EP rank r of tp (a deployment with dp 1).
std::vector<ShardingTable> Group(const ModelConfig& c, int tp, bool ep = false, Drafter drafter = Drafter::kNone) {
  std::vector<ShardingTable> g;
  for (int r = 0; r < tp; ++r) {
    auto t = ShardingTable::Build(c, r, tp, ep ? ExpertSplit{r, tp} : ExpertSplit{}, drafter);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    g.push_back(std::move(t).value());
  }
  return g;
}

struct Interval {
  int64_t start, length;
  bool operator<(const Interval& o) const { return start < o.start; }
};

// For every HF tensor the group serves, the primary pieces across the group slice one
// dim and tile it exactly; every piece (replicas too) fits its HF tensor and its
// parameter; no piece fills a tensor the group does not serve.
void CheckCoverage(const ModelConfig& c, int tp, bool ep = false, Drafter drafter = Drafter::kNone) {
  SCOPED_TRACE(c.name + " tp=" + std::to_string(tp) + (ep ? " ep" : "") +
               (drafter == Drafter::kMtp ? " mtp" : ""));
  auto group = Group(c, tp, ep, drafter);
  std::map<std::string, std::vector<Interval>> primary;
  std::map<std::string, int> dims;
  for (const ShardingTable& t : group) {
    for (const WorkerParam& wp : t.params()) {
      for (const ShardPiece& p : wp.pieces) {
        int hf = t.FindHf(p.hf_name);
        ASSERT_GE(hf, 0) << p.hf_name;
        const Shape& s = t.hf_tensors()[hf].shape;
        ASSERT_LT(p.dim, static_cast<int>(s.size()));
        ASSERT_GE(p.hf_start, 0);
        ASSERT_GT(p.length, 0);
        ASSERT_LE(p.hf_start + p.length, s[p.dim]) << p.hf_name;
        Shape dst(wp.meta.shape.begin() + (p.dst_index >= 0 ? 1 : 0), wp.meta.shape.end());
        ASSERT_EQ(dst.size(), s.size()) << wp.meta.name;
        if (p.dst_index >= 0) {
          ASSERT_LT(p.dst_index, wp.meta.shape[0]);
        }
        for (size_t d = 0; d < s.size(); ++d) {
          if (static_cast<int>(d) == p.dim) {
            ASSERT_LE(p.dst_start + p.length, dst[d]) << wp.meta.name;
          } else {
            ASSERT_EQ(dst[d], s[d]) << wp.meta.name << " <- " << p.hf_name;
          }
        }
        if (!p.primary) continue;
        auto [it, fresh] = dims.emplace(p.hf_name, p.dim);
        ASSERT_EQ(it->second, p.dim) << p.hf_name << " is sliced on two dims";
        primary[p.hf_name].push_back({p.hf_start, p.length});
      }
    }
  }
  const auto hf = group[0].served_hf_tensors();
  ASSERT_EQ(primary.size(), hf.size());
  for (const TensorMeta& m : hf) {
    auto& iv = primary[m.name];
    std::sort(iv.begin(), iv.end());
    int64_t next = 0;
    for (const Interval& i : iv) {
      ASSERT_EQ(i.start, next) << m.name << ": gap or overlap";
      next += i.length;
    }
    ASSERT_EQ(next, m.shape[dims[m.name]]) << m.name;
  }
}

TEST(ShardingTable, PrimaryPiecesTileEveryTensorOnce) {
  for (const char* name : {"qwen3-tiny", "qwen3-0.6b", "qwen3-moe-tiny"}) {
    for (int tp : {1, 2, 4}) CheckCoverage(Model(name), tp);
  }
  CheckCoverage(Model("qwen3-8b"), 8);
  CheckCoverage(Model("qwen3-30b-a3b"), 8);  // 4 KV heads, each on 2 ranks
}

TEST(ShardingTable, DeepseekAndGlmPiecesTileEveryTensorOnce) {
  for (const char* name : {"deepseek-v3-tiny", "glm4-moe-tiny"}) {
    for (int tp : {1, 2, 4}) {
      CheckCoverage(Model(name), tp);
      CheckCoverage(Model(name), tp, /*ep=*/true);
      CheckCoverage(Model(name), tp, /*ep=*/false, Drafter::kMtp);
      CheckCoverage(Model(name), tp, /*ep=*/true, Drafter::kMtp);
    }
  }
  ModelConfig no_q_lora = Model("deepseek-v3-tiny");
  no_q_lora.q_lora_rank = 0;
  CheckCoverage(no_q_lora, 2);
  CheckCoverage(Model("glm-4.5-air"), 8);  // 8 KV heads, GLM's biases
  CheckCoverage(Model("glm-4.5-air"), 16);  // each KV head on 2 ranks
}

// The MLA parameters of DeepSeek-V3 at TP 8, rank 3, as vLLM holds them.
TEST(ShardingTable, DeepseekMlaParamsAtTp8) {
  auto t = ShardingTable::Build(Model("deepseek-v3"), 3, 8, {}, Drafter::kMtp);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto param = [&](const std::string& name) -> const WorkerParam& {
    int i = t->FindParam(name);
    EXPECT_GE(i, 0) << name;
    return t->params()[std::max(i, 0)];
  };
  const std::string a = "model.layers.5.self_attn.";
  const WorkerParam& qkv_a = param(a + "fused_qkv_a_proj.weight");
  EXPECT_EQ(qkv_a.meta.shape, (Shape{1536 + 576, 7168}));
  ASSERT_EQ(qkv_a.pieces.size(), 2u);
  EXPECT_EQ(qkv_a.pieces[1], (ShardPiece{a + "kv_a_proj_with_mqa.weight", 0, 0, 576, -1, 1536, false}));
  // 16 heads per rank of 192 (q) and 256 (k nope + v) rows; o_proj takes 16 * 128 columns.
  EXPECT_EQ(param(a + "q_b_proj.weight").pieces[0],
            (ShardPiece{a + "q_b_proj.weight", 0, 3 * 16 * 192, 16 * 192, -1, 0, true}));
  EXPECT_EQ(param(a + "kv_b_proj.weight").meta.shape, (Shape{16 * 256, 512}));
  EXPECT_EQ(param(a + "o_proj.weight").pieces[0],
            (ShardPiece{a + "o_proj.weight", 1, 3 * 16 * 128, 16 * 128, -1, 0, true}));
  EXPECT_EQ(param("model.layers.5.mlp.shared_experts.gate_up_proj.weight").meta.shape,
            (Shape{2 * 256, 7168}));
  EXPECT_EQ(param("model.layers.5.mlp.experts.w13_weight").meta.shape, (Shape{256, 2 * 256, 7168}));
  EXPECT_EQ(param("model.layers.5.mlp.gate.e_score_correction_bias").meta.dtype, DType::kF32);
  EXPECT_EQ(param("model.layers.2.mlp.gate_up_proj.weight").meta.shape, (Shape{2 * 2304, 7168}));
  EXPECT_EQ(param("model.layers.61.mtp_block.self_attn.o_proj.weight").pieces[0].hf_name,
            "model.layers.61.self_attn.o_proj.weight");
  // The drafter's embed_tokens and head are the target's parameters, not its own.
  EXPECT_LT(t->FindParam("model.layers.61.shared_head.head.weight"), 0);
  EXPECT_LT(t->FindParam("model.layers.61.embed_tokens.weight"), 0);
  // Bytes of the rank: the model's bytes split 8 ways, plus what every rank holds whole.
  int64_t whole = 0, split = 0;
  for (const TensorMeta& m : t->hf_tensors()) {
    auto ps = t->PiecesOf(m.name);
    const ShardPiece& p = t->params()[ps[0].first].pieces[ps[0].second];
    (p.length == m.shape[p.dim] ? whole : split) += static_cast<int64_t>(m.nbytes());
  }
  EXPECT_EQ(t->param_bytes(), whole + split / 8);
}

// Without a drafter the MTP layers' tensors are the model's but no parameter holds them;
// with one, its own layers are parameters and its embed_tokens / head alias the target's.
TEST(ShardingTable, MtpDrafterOwnsItsLayersAndAliasesEmbedAndHead) {
  const ModelConfig c = Model("deepseek-v3-tiny");  // 3 layers + MTP layer 3
  auto plain = ShardingTable::Build(c, 0, 2);
  auto mtp = ShardingTable::Build(c, 0, 2, {}, Drafter::kMtp);
  ASSERT_TRUE(plain.ok() && mtp.ok());
  EXPECT_EQ(plain->hf_tensors(), mtp->hf_tensors());  // the same stream either way
  const std::string eh = "model.layers.3.eh_proj.weight";
  ASSERT_GE(plain->FindHf(eh), 0);
  EXPECT_TRUE(plain->PiecesOf(eh).empty());
  EXPECT_FALSE(plain->Serves(eh));
  EXPECT_TRUE(plain->Serves("model.layers.2.mlp.gate.weight"));
  EXPECT_TRUE(mtp->Serves(eh));
  ASSERT_EQ(mtp->PiecesOf(eh).size(), 1u);
  const auto mtp_tensors = std::ranges::count_if(
      plain->hf_tensors(), [&](const TensorMeta& m) { return MtpLayerOf(c, m.name) >= 0; });
  EXPECT_GT(mtp_tensors, 0);
  EXPECT_EQ(plain->served_hf_tensors().size(), plain->hf_tensors().size() - static_cast<size_t>(mtp_tensors));
  EXPECT_EQ(mtp->served_hf_tensors().size(), mtp->hf_tensors().size());
  // The drafter's own parameters are exactly the MTP layer's, and the target's are unchanged.
  int64_t own = 0;
  for (size_t i = 0; i < mtp->params().size(); ++i) {
    const std::string& name = mtp->params()[i].meta.name;
    EXPECT_EQ(mtp->IsDrafterParam(static_cast<int>(i)), name.starts_with("model.layers.3.")) << name;
    if (mtp->IsDrafterParam(static_cast<int>(i))) {
      own += static_cast<int64_t>(mtp->params()[i].meta.nbytes());
    } else {
      EXPECT_GE(plain->FindParam(name), 0) << name;
    }
  }
  EXPECT_EQ(mtp->param_bytes(), plain->param_bytes() + own);
  const auto own_params = std::ranges::count_if(
      mtp->params(), [](const WorkerParam& p) { return p.meta.name.starts_with("model.layers.3."); });
  EXPECT_EQ(mtp->params().size(), plain->params().size() + static_cast<size_t>(own_params));
  const std::vector<DrafterAlias> aliases = mtp->drafter_aliases();
  ASSERT_EQ(aliases.size(), 2u);
  EXPECT_EQ(aliases[0].name, "model.layers.3.embed_tokens.weight");
  EXPECT_EQ(mtp->params()[aliases[0].param].meta.name, "model.embed_tokens.weight");
  EXPECT_EQ(aliases[1].name, "model.layers.3.shared_head.head.weight");
  EXPECT_EQ(mtp->params()[aliases[1].param].meta.name, "lm_head.weight");
  EXPECT_TRUE(plain->drafter_aliases().empty());
  // A model without MTP layers has no drafter to hold.
  EXPECT_EQ(ShardingTable::Build(Model("qwen3-tiny"), 0, 1, {}, Drafter::kMtp).status().message(),
            "model qwen3-tiny has no MTP layers (num_nextn_predict_layers is 0), so it has no MTP drafter");
}

// With expert parallelism a worker holds its experts whole, and no one else's.
TEST(ShardingTable, ExpertParallelHoldsWholeExperts) {
  ModelConfig c = Model("deepseek-v3-tiny");  // 8 experts of width 128
  auto t = ShardingTable::Build(c, 1, 2, ExpertSplit{3, 4});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const WorkerParam& w13 = t->params()[t->FindParam("model.layers.1.mlp.experts.w13_weight")];
  EXPECT_EQ(w13.meta.shape, (Shape{2, 256, 256}));
  EXPECT_EQ(w13.pieces[2], (ShardPiece{"model.layers.1.mlp.experts.7.gate_proj.weight", 0, 0, 128, 1, 0, true}));
  EXPECT_TRUE(t->PiecesOf("model.layers.1.mlp.experts.5.up_proj.weight").empty());
  EXPECT_EQ(ShardingTable::Build(c, 0, 2, ExpertSplit{0, 3}).status().message(),
            "model deepseek-v3-tiny: num_experts 8 is not divisible by ep_size 3");
  EXPECT_EQ(ShardingTable::Build(c, 0, 2, ExpertSplit{4, 4}).status().message(),
            "model deepseek-v3-tiny: ep_rank 4 is outside ep_size 4");
  EXPECT_EQ(ShardingTable::Build(Model("qwen3-tiny"), 0, 1, ExpertSplit{0, 2}).status().message(),
            "model qwen3-tiny: ep_size 2 needs a MoE model");
}

// Element-level check on small models: inside each parameter, pieces never overlap, and
// only vocab padding rows stay uncovered.
TEST(ShardingTable, PiecesFillParamsExactlyOnce) {
  for (const char* name : {"qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "glm4-moe-tiny"}) {
    for (int tp : {1, 2, 4}) {
      for (const ShardingTable& t : Group(Model(name), tp, /*ep=*/tp == 4 && Model(name).is_moe())) {
        for (size_t i = 0; i < t.params().size(); ++i) {
          const WorkerParam& wp = t.params()[i];
          const int64_t item = ItemSize(wp.meta.dtype);
          std::vector<uint8_t> hits(wp.meta.numel(), 0);
          for (size_t k = 0; k < wp.pieces.size(); ++k) {
            PieceRuns r = t.Runs(i, k);
            for (int64_t o = 0; o < r.count; ++o) {
              for (int64_t b = 0; b < r.run_bytes; b += item) {
                ++hits[(r.dst_offset + o * r.dst_stride + b) / item];
              }
            }
          }
          const bool vocab = wp.meta.name.ends_with("embed_tokens.weight") ||
                             wp.meta.name.ends_with("head.weight");
          int64_t covered = std::count(hits.begin(), hits.end(), 1);
          ASSERT_EQ(std::count_if(hits.begin(), hits.end(), [](uint8_t h) { return h > 1; }), 0)
              << wp.meta.name;
          if (!vocab) {
            ASSERT_EQ(covered, wp.meta.numel()) << wp.meta.name;
          }
        }
      }
    }
  }
}

const ShardPiece& Piece(const ShardingTable& t, std::string_view hf_name, size_t n = 0) {
  auto ps = t.PiecesOf(hf_name);
  EXPECT_GT(ps.size(), n) << hf_name;
  return t.params()[ps[n].first].pieces[ps[n].second];
}

TEST(ShardingTable, HandCheckedTinyTp2Rank1) {
  // qwen3-tiny: Hq=4, Hkv=2, D=64, H=256, I=512. TP 2: 2 q heads and 1 KV head per rank.
  ShardingTable t = *ShardingTable::Build(Model("qwen3-tiny"), 1, 2);
  const WorkerParam& qkv = t.params()[t.FindParam("model.layers.2.self_attn.qkv_proj.weight")];
  EXPECT_EQ(qkv.meta.shape, (Shape{(2 + 2 * 1) * 64, 256}));
  ASSERT_EQ(qkv.pieces.size(), 3u);
  // q rows [Hq*D/2, Hq*D) of q_proj land first, then k and v of KV head 1.
  EXPECT_EQ(qkv.pieces[0], (ShardPiece{"model.layers.2.self_attn.q_proj.weight", 0, 128, 128, -1, 0, true}));
  EXPECT_EQ(qkv.pieces[1], (ShardPiece{"model.layers.2.self_attn.k_proj.weight", 0, 64, 64, -1, 128, true}));
  EXPECT_EQ(qkv.pieces[2], (ShardPiece{"model.layers.2.self_attn.v_proj.weight", 0, 64, 64, -1, 192, true}));

  const int o = t.FindParam("model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(t.params()[o].meta.shape, (Shape{256, 128}));
  EXPECT_EQ(t.params()[o].pieces[0],
            (ShardPiece{"model.layers.0.self_attn.o_proj.weight", 1, 128, 128, -1, 0, true}));
  PieceRuns runs = t.Runs(o, 0);  // 256 rows of 128 bf16 columns from column 128 on
  EXPECT_EQ(runs.count, 256);
  EXPECT_EQ(runs.run_bytes, 256);
  EXPECT_EQ(runs.hf_offset, 256);
  EXPECT_EQ(runs.hf_stride, 512);
  EXPECT_EQ(runs.dst_offset, 0);
  EXPECT_EQ(runs.dst_stride, 256);

  const WorkerParam& gate_up = t.params()[t.FindParam("model.layers.0.mlp.gate_up_proj.weight")];
  EXPECT_EQ(gate_up.meta.shape, (Shape{512, 256}));
  EXPECT_EQ(gate_up.pieces[0], (ShardPiece{"model.layers.0.mlp.gate_proj.weight", 0, 256, 256, -1, 0, true}));
  EXPECT_EQ(gate_up.pieces[1], (ShardPiece{"model.layers.0.mlp.up_proj.weight", 0, 256, 256, -1, 256, true}));
  EXPECT_EQ(Piece(t, "model.layers.0.mlp.down_proj.weight"),
            (ShardPiece{"model.layers.0.mlp.down_proj.weight", 1, 256, 256, -1, 0, true}));
  // Replicated tensors are whole on every rank and primary only on rank 0.
  EXPECT_EQ(Piece(t, "model.norm.weight"), (ShardPiece{"model.norm.weight", 0, 0, 256, -1, 0, false}));
  // Vocab 4096 is already a multiple of 64: 2048 rows per rank.
  EXPECT_EQ(Piece(t, "lm_head.weight"), (ShardPiece{"lm_head.weight", 0, 2048, 2048, -1, 0, true}));
  EXPECT_EQ(t.params().back().meta.shape, (Shape{2048, 256}));
}

TEST(ShardingTable, ParamOrderAndNames) {
  ShardingTable t = *ShardingTable::Build(Model("qwen3-tiny"), 0, 1);
  std::vector<std::string> names;
  for (size_t i = 0; i < 9; ++i) names.push_back(t.params()[i].meta.name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                       "model.layers.0.self_attn.o_proj.weight",
                       "model.layers.0.self_attn.q_norm.weight",
                       "model.layers.0.self_attn.k_norm.weight",
                       "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
                       "model.layers.0.input_layernorm.weight",
                       "model.layers.0.post_attention_layernorm.weight"}));
  EXPECT_EQ(t.params().size(), 1u + 4 * 8 + 2);
  EXPECT_EQ(t.param_bytes(), 2 * 4459264);  // TP 1 holds exactly the model
  EXPECT_TRUE(t.PiecesOf("no.such.weight").empty());
  EXPECT_EQ(t.FindHf("no.such.weight"), -1);

  // Tied: no lm_head parameter at all.
  ShardingTable tied = *ShardingTable::Build(Model("qwen3-0.6b"), 0, 2);
  EXPECT_EQ(tied.FindParam("lm_head.weight"), -1);
  EXPECT_EQ(tied.params().back().meta.name, "model.norm.weight");
}

TEST(ShardingTable, KvHeadsReplicatedWhenTpExceedsThem) {
  // qwen3-tiny at TP 4: Hkv=2, so KV head h lives on ranks 2h and 2h+1; the first is primary.
  auto g = Group(Model("qwen3-tiny"), 4);
  for (int r = 0; r < 4; ++r) {
    const WorkerParam& qkv = g[r].params()[g[r].FindParam("model.layers.0.self_attn.qkv_proj.weight")];
    EXPECT_EQ(qkv.meta.shape, (Shape{(1 + 2) * 64, 256}));
    EXPECT_EQ(qkv.pieces[0].hf_start, r * 64);
    EXPECT_EQ(qkv.pieces[1], (ShardPiece{"model.layers.0.self_attn.k_proj.weight", 0, (r / 2) * 64,
                                         64, -1, 64, r % 2 == 0}));
    EXPECT_EQ(qkv.pieces[2].dst_start, 128);
    EXPECT_EQ(qkv.pieces[2].primary, r % 2 == 0);
  }
}

TEST(ShardingTable, MoeExpertsStack) {
  // qwen3-moe-tiny at TP 2: Im=128, so each rank holds 64 rows of every expert.
  ShardingTable t = *ShardingTable::Build(Model("qwen3-moe-tiny"), 1, 2);
  const int w13 = t.FindParam("model.layers.1.mlp.experts.w13_weight");
  const int w2 = t.FindParam("model.layers.1.mlp.experts.w2_weight");
  ASSERT_GE(w13, 0);
  ASSERT_GE(w2, 0);
  EXPECT_EQ(t.params()[w13].meta.shape, (Shape{8, 128, 256}));
  EXPECT_EQ(t.params()[w2].meta.shape, (Shape{8, 256, 64}));
  EXPECT_EQ(Piece(t, "model.layers.1.mlp.experts.3.up_proj.weight"),
            (ShardPiece{"model.layers.1.mlp.experts.3.up_proj.weight", 0, 64, 64, 3, 64, true}));
  EXPECT_EQ(Piece(t, "model.layers.1.mlp.experts.3.gate_proj.weight"),
            (ShardPiece{"model.layers.1.mlp.experts.3.gate_proj.weight", 0, 64, 64, 3, 0, true}));
  EXPECT_EQ(Piece(t, "model.layers.1.mlp.experts.3.down_proj.weight"),
            (ShardPiece{"model.layers.1.mlp.experts.3.down_proj.weight", 1, 64, 64, 3, 0, true}));
  PieceRuns r = t.Runs(w2, 3);  // expert 3's down_proj
  EXPECT_EQ(r.count, 256);
  EXPECT_EQ(r.run_bytes, 128);
  EXPECT_EQ(r.hf_offset, 128);
  EXPECT_EQ(r.hf_stride, 256);
  EXPECT_EQ(r.dst_offset, 3 * 256 * 64 * 2);
  EXPECT_EQ(r.dst_stride, 128);
  EXPECT_EQ(Piece(t, "model.layers.1.mlp.gate.weight"),
            (ShardPiece{"model.layers.1.mlp.gate.weight", 0, 0, 8, -1, 0, false}));
}

TEST(ShardingTable, VocabPaddingRows) {
  ModelConfig c = Model("qwen3-tiny");
  c.name = "odd-vocab";
  c.vocab_size = 4000;  // padded to 4032: 1008 rows per rank at TP 4
  EXPECT_EQ(ShardingTable::PaddedVocab(4000), 4032);
  auto g = Group(c, 4);
  for (int r = 0; r < 4; ++r) {
    const WorkerParam& e = g[r].params()[0];
    EXPECT_EQ(e.meta.shape, (Shape{1008, 256}));
    ASSERT_EQ(e.pieces.size(), 1u);
    EXPECT_EQ(e.pieces[0].hf_start, r * 1008);
    EXPECT_EQ(e.pieces[0].length, r < 3 ? 1008 : 4000 - 3 * 1008);
  }
  CheckCoverage(c, 4);
}

Status BuildStatus(const ModelConfig& c, int rank, int tp) {
  return ShardingTable::Build(c, rank, tp).status();
}

TEST(ShardingTable, DivisibilityErrors) {
  Status s = BuildStatus(Model("qwen3-tiny"), 0, 3);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "model qwen3-tiny: num_attention_heads 4 is not divisible by tp_size 3");

  ModelConfig c = Model("qwen3-tiny");
  c.name = "odd";
  c.num_attention_heads = 12;
  c.num_key_value_heads = 3;
  EXPECT_EQ(BuildStatus(c, 0, 2).message(),
            "model odd: num_key_value_heads 3 is not divisible by tp_size 2");
  c.num_key_value_heads = 4;
  EXPECT_EQ(BuildStatus(c, 0, 6).message(),
            "model odd: tp_size 6 is above num_key_value_heads 4 and not a multiple of it, so KV "
            "heads cannot be replicated evenly");

  c = Model("qwen3-tiny");
  c.name = "odd";
  c.intermediate_size = 510;
  EXPECT_EQ(BuildStatus(c, 0, 4).message(),
            "model odd: intermediate_size 510 is not divisible by tp_size 4");

  ModelConfig m = Model("qwen3-moe-tiny");
  m.moe_intermediate_size = 102;
  EXPECT_EQ(BuildStatus(m, 0, 4).message(),
            "model qwen3-moe-tiny: moe_intermediate_size 102 is not divisible by tp_size 4");

  c = Model("qwen3-tiny");
  c.name = "wide";
  c.vocab_size = 64;
  c.num_attention_heads = c.num_key_value_heads = 128;
  c.intermediate_size = 128;
  EXPECT_EQ(BuildStatus(c, 0, 128).message(),
            "model wide: padded vocab_size 64 is not divisible by tp_size 128");

  EXPECT_EQ(BuildStatus(Model("qwen3-tiny"), 2, 2).message(),
            "model qwen3-tiny: tp_rank 2 is outside tp_size 2");
  EXPECT_EQ(BuildStatus(Model("qwen3-tiny"), 0, 0).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wsync
