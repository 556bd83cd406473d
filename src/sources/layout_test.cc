// Layout tables and layer groups: the layout grammar, Megatron's per-rank parameters and
// their HF pieces (fused QKV, expert placement and expert TP, tied embeddings over pipeline
// stages), checked against exact shapes, offsets and bytes.
#include "sources/layout.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <set>

#include "sources/groups.h"
#include "sources/test_util.h"

namespace wsync {
namespace {

using namespace sources_test;

TEST(LayerGroups, PrePerLayerPost) {
  ModelConfig c = Config("qwen3-moe-tiny");
  std::vector<std::string> names;
  for (const auto& m : HfTensors(c)) names.push_back(m.name);
  auto groups = LayerGroups(names);
  ASSERT_TRUE(groups.ok()) << groups.status().ToString();
  ASSERT_EQ(groups->size(), static_cast<size_t>(c.num_hidden_layers + 2));
  EXPECT_EQ(groups->front().key, "pre");
  EXPECT_EQ(groups->front().size(), 1u);
  EXPECT_EQ((*groups)[1].key, "model.layers.0");
  // A MoE layer stays whole: attention (6) + router + 3 per expert + 2 norms.
  EXPECT_EQ((*groups)[1].size(), static_cast<size_t>(6 + 1 + 3 * c.num_experts + 2));
  EXPECT_EQ(groups->back().key, "post");
  EXPECT_EQ(groups->back().end, names.size());
}

TEST(LayerGroups, NonContiguousIsAnError) {
  std::vector<std::string> names = {"model.embed_tokens.weight", "model.layers.0.a", "model.layers.1.a",
                                    "model.layers.0.b", "model.norm.weight"};
  auto groups = LayerGroups(names);
  ASSERT_FALSE(groups.ok());
  EXPECT_NE(groups.status().message().find("not group-contiguous"), std::string::npos);
  EXPECT_NE(groups.status().message().find("model.layers.1.a"), std::string::npos) << groups.status().message();
  // A post tensor before a layer is out of place too.
  auto late = LayerGroups({"model.layers.0.a", "model.norm.weight", "model.layers.1.a"});
  EXPECT_FALSE(late.ok());
}

TEST(ParallelLayout, ParseAndCoordinates) {
  auto l = ParallelLayout::Parse("tp2pp2ep1", 8);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->dp(), 2);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(l->RankOf(l->CoordOf(r)), r);
  EXPECT_EQ(l->Describe(5), "trainer rank 5 (tp1 pp1 ep0 dp0)");
  EXPECT_FALSE(ParallelLayout::Parse("tp2pp2ep1", 6).ok());
  EXPECT_FALSE(ParallelLayout::Parse("tp2", 2).ok());
  EXPECT_TRUE(ParallelLayout::Parse("fsdp", 3)->fsdp);
}

TEST(ParallelLayout, ExpertTensorParallel) {
  auto l = ParallelLayout::Parse("tp2pp1ep2etp2", 4);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->etp, 2);
  EXPECT_EQ(l->dp(), 1);
  EXPECT_EQ(l->ToString(), "tp2pp1ep2etp2");
  EXPECT_EQ(ParallelLayout::Parse("tp2pp1ep2", 4)->etp, 1);
  EXPECT_EQ(ParallelLayout::Parse("tp2pp1ep2etp1", 4)->ToString(), "tp2pp1ep2");
  EXPECT_EQ(ParallelLayout::Parse("tp2pp1ep2etp4", 4).status().message(),
            "trainer layout 'tp2pp1ep2etp4': etp 4 must divide tp 2 (expert shards are split over the TP group)");
  EXPECT_EQ(ParallelLayout::Parse("tp2pp1ep2etp0", 4).status().message(),
            "trainer layout 'tp2pp1ep2etp0': tp, pp, ep and etp must be at least 1");
  EXPECT_EQ(ParallelLayout::Parse("tp2pp1ep2etp", 4).status().message(),
            "trainer layout 'tp2pp1ep2etp': expected 'fsdp' or 'tpXppYepZ[etpW]' such as 'tp2pp2ep1' or "
            "'tp2pp1ep2etp2'");
}

TEST(MegatronLayout, QkvInterleavedPerQueryGroup) {
  ModelConfig c = Config("qwen3-tiny");  // 4 heads, 2 groups, head_dim 64
  auto l = MegatronLayout::Build(c, *ParallelLayout::Parse("tp2pp1ep1", 2));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const auto& params = l->params(1);
  const WorkerParam* qkv = nullptr;
  for (const auto& p : params) {
    if (p.meta.name == "decoder.layers.0.self_attention.linear_qkv.weight") qkv = &p;
  }
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->meta.shape, (Shape{(2 + 2) * 64, 256}));
  // tp rank 1 holds query group 1: q heads 2,3 then k head 1 then v head 1.
  ASSERT_EQ(qkv->pieces.size(), 3u);
  EXPECT_EQ(qkv->pieces[0].hf_start, 2 * 64);
  EXPECT_EQ(qkv->pieces[1].hf_name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(qkv->pieces[1].hf_start, 64);
  EXPECT_EQ(qkv->pieces[1].dst_start, 2 * 64);
  EXPECT_EQ(qkv->pieces[2].dst_start, 3 * 64);
}

TEST(MegatronLayout, ExpertsNotDivisibleByEpNamesTheLayer) {
  auto l = MegatronLayout::Build(Config("qwen3-moe-tiny"), *ParallelLayout::Parse("tp1pp1ep3", 3));
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("model.layers.0.mlp.experts"), std::string::npos) << l.status().message();
  EXPECT_NE(l.status().message().find("not divisible by ep 3"), std::string::npos);
}

TEST(MegatronLayout, HeldNamesFollowStagesAndExperts) {
  ModelConfig c = Config("qwen3-moe-tiny");  // 2 layers, 8 experts
  auto l = MegatronLayout::Build(c, *ParallelLayout::Parse("tp1pp2ep2", 4));
  ASSERT_TRUE(l.ok());
  // Rank 1 = pp0 ep1: the embedding, layer 0, experts 4..7 of layer 0; no final norm.
  auto held = l->HeldNames(1);
  auto has = [&](const std::string& n) { return std::find(held.begin(), held.end(), n) != held.end(); };
  EXPECT_TRUE(has("model.embed_tokens.weight"));
  EXPECT_TRUE(has("model.layers.0.mlp.experts.4.up_proj.weight"));
  EXPECT_FALSE(has("model.layers.0.mlp.experts.3.up_proj.weight"));
  EXPECT_FALSE(has("model.layers.1.self_attn.q_proj.weight"));
  EXPECT_FALSE(has("model.norm.weight"));
  // Every name is held by some rank.
  std::set<std::string> all;
  for (int r = 0; r < 4; ++r) {
    for (auto& n : l->HeldNames(r)) all.insert(n);
  }
  EXPECT_EQ(all.size(), l->hf_tensors().size());
}

// tp2pp1ep2etp2 over qwen3-moe-tiny (8 experts, moe_intermediate_size 128, hidden 256):
// rank 3 (tp1 ep1) holds the second 64-row half of gate and up, and the second 64-column
// half of down, of experts 4..7; its bytes are exactly those slices.
TEST(MegatronLayout, ExpertTensorParallelShards) {
  ModelConfig c = Config("qwen3-moe-tiny");
  auto layout = *ParallelLayout::Parse("tp2pp1ep2etp2", 4);
  auto l = MegatronLayout::Build(c, layout);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const WorkerParam* fc1 = FindParam(*l, 3, "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight");
  const WorkerParam* fc2 = FindParam(*l, 3, "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight");
  ASSERT_NE(fc1, nullptr);
  ASSERT_NE(fc2, nullptr);
  EXPECT_EQ(fc1->meta.shape, (Shape{128, 256}));
  EXPECT_EQ(fc2->meta.shape, (Shape{256, 64}));
  ASSERT_EQ(fc1->pieces.size(), 2u);
  EXPECT_EQ(fc1->pieces[0].hf_name, "model.layers.1.mlp.experts.6.gate_proj.weight");
  EXPECT_EQ(fc1->pieces[1].hf_name, "model.layers.1.mlp.experts.6.up_proj.weight");
  EXPECT_EQ(fc1->pieces[1].hf_start, 64);
  EXPECT_EQ(fc1->pieces[1].dst_start, 64);
  EXPECT_EQ(fc2->pieces[0].dim, 1);
  EXPECT_EQ(fc2->pieces[0].hf_start, 64);
  // One copy per shard (tp / etp = 1): every expert piece is primary.
  EXPECT_TRUE(fc1->pieces[0].primary && fc2->pieces[0].primary);

  auto model = Model(c);
  auto params = LayOutMegatron(*l, 3, model->tensors());
  ASSERT_TRUE(params.ok()) << params.status().ToString();
  auto hf = [&](const std::string& name) -> const HostTensor& { return model->tensors()[l->FindHf(name)]; };
  auto param = [&](const std::string& name) -> const HostTensor& {
    for (size_t i = 0; i < l->params(3).size(); ++i) {
      if (l->params(3)[i].meta.name == name) return (*params)[i];
    }
    ADD_FAILURE() << name;
    return (*params)[0];
  };
  const size_t row = 256 * 2;  // bf16
  const HostTensor& p1 = param("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight");
  const std::byte* gate = hf("model.layers.1.mlp.experts.6.gate_proj.weight").storage.data();
  const std::byte* up = hf("model.layers.1.mlp.experts.6.up_proj.weight").storage.data();
  EXPECT_EQ(0, std::memcmp(p1.storage.data(), gate + 64 * row, 64 * row));
  EXPECT_EQ(0, std::memcmp(p1.storage.data() + 64 * row, up + 64 * row, 64 * row));
  const HostTensor& p2 = param("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight");
  const std::byte* down = hf("model.layers.1.mlp.experts.6.down_proj.weight").storage.data();
  for (int h = 0; h < 256; ++h) {
    ASSERT_EQ(0, std::memcmp(p2.storage.data() + h * 64 * 2, down + h * 128 * 2 + 64 * 2, 64 * 2)) << "row " << h;
  }
}

// tp4 with etp2: two copies of each expert shard; export spreads experts over them.
TEST(MegatronLayout, ExpertTensorParallelReplicasSpreadExport) {
  auto l = MegatronLayout::Build(MoeKv4(), *ParallelLayout::Parse("tp4pp1ep1etp2", 4));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  for (int rank = 0; rank < 4; ++rank) {
    for (int i : {0, 1, 2, 3}) {
      const WorkerParam* fc2 =
          FindParam(*l, rank, fmt::format("decoder.layers.0.mlp.experts.local_experts.{}.linear_fc2.weight", i));
      ASSERT_NE(fc2, nullptr);
      EXPECT_EQ(fc2->pieces[0].hf_start, (rank % 2) * 64);
      EXPECT_EQ(fc2->pieces[0].primary, rank / 2 == i % 2) << "rank " << rank << " expert " << i;
    }
  }
}

// Megatron's expert grid (etp fastest, then ep, then expert-dp) with etp 1 < tp 2: rank 1,
// the second TP rank of EP coordinate 0, holds EP rank 1's experts; ranks 2 and 3 copy
// ranks 0 and 1, and export alternates experts between the two copies.
TEST(MegatronLayout, ExpertGridFoldsOverTensorParallelRanks) {
  auto l = MegatronLayout::Build(Config("qwen3-moe-tiny"), *ParallelLayout::Parse("tp2pp1ep2", 4));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const int first_expert[] = {0, 4, 0, 4};
  for (int rank = 0; rank < 4; ++rank) {
    for (int i = 0; i < 4; ++i) {
      const WorkerParam* fc1 =
          FindParam(*l, rank, fmt::format("decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight", i));
      ASSERT_NE(fc1, nullptr);
      EXPECT_EQ(fc1->meta.shape, (Shape{256, 256}));  // whole: [gate; up]
      EXPECT_EQ(fc1->pieces[0].hf_name,
                fmt::format("model.layers.1.mlp.experts.{}.gate_proj.weight", first_expert[rank] + i));
      EXPECT_EQ(fc1->pieces[0].primary, rank / 2 == i % 2) << "rank " << rank << " expert " << i;
    }
  }
  // Each rank holds the experts it has whole (etp 1), not its TP peer's: rank 0 experts
  // 0..3, rank 1 (same TP group) experts 4..7.
  auto has = [&](int rank, const std::string& n) {
    auto held = l->HeldNames(rank);
    return std::find(held.begin(), held.end(), n) != held.end();
  };
  EXPECT_TRUE(has(0, "model.layers.0.mlp.experts.3.down_proj.weight"));
  EXPECT_FALSE(has(0, "model.layers.0.mlp.experts.7.down_proj.weight"));
  EXPECT_TRUE(has(1, "model.layers.0.mlp.experts.7.down_proj.weight"));
  EXPECT_TRUE(has(1, "model.layers.0.self_attn.q_proj.weight"));
}

TEST(MegatronLayout, ExpertTensorParallelErrors) {
  auto dense = MegatronLayout::Build(Config("qwen3-tiny"), *ParallelLayout::Parse("tp2pp1ep1etp2", 2));
  EXPECT_EQ(dense.status().message(), "model qwen3-tiny, trainer layout tp2pp1ep1etp2: etp 2 needs a MoE model");
  ModelConfig c = Config("qwen3-moe-tiny");
  c.moe_intermediate_size = 129;
  auto odd = MegatronLayout::Build(c, *ParallelLayout::Parse("tp2pp1ep1etp2", 2));
  EXPECT_EQ(odd.status().message(),
            "model qwen3-moe-tiny, trainer layout tp2pp1ep1etp2: moe_intermediate_size 129 is not "
            "divisible by etp 2");
}

// qwen3-0.6b ties its embeddings (HF has no lm_head.weight, nor does vLLM's table). With
// pp > 1 Megatron's last stage keeps output_layer.weight, a vocab-parallel replica of the
// embedding: held there, never exported from there.
TEST(MegatronLayout, TiedEmbeddingsHaveAReplicaOnTheLastStage) {
  ModelConfig c = Config("qwen3-0.6b");
  ASSERT_TRUE(c.tie_word_embeddings);
  auto l = MegatronLayout::Build(c, *ParallelLayout::Parse("tp2pp2ep1", 4));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_LT(l->FindHf("model.embed_tokens.weight"), l->FindHf("model.norm.weight"));
  EXPECT_EQ(l->FindHf("lm_head.weight"), -1);
  // Ranks 2 and 3 are the last stage; 151936 rows padded to 152064 = 594 * 256.
  for (int rank : {2, 3}) {
    const WorkerParam* out = FindParam(*l, rank, "output_layer.weight");
    ASSERT_NE(out, nullptr) << rank;
    EXPECT_EQ(out->meta.shape, (Shape{76032, 1024}));
    ASSERT_EQ(out->pieces.size(), 1u);
    const ShardPiece& p = out->pieces[0];
    EXPECT_EQ(p.hf_name, "model.embed_tokens.weight");
    EXPECT_EQ(p.hf_start, (rank - 2) * 76032);
    EXPECT_EQ(p.length, rank == 2 ? 76032 : 151936 - 76032);
    EXPECT_FALSE(p.primary);
    auto held = l->HeldNames(rank);
    EXPECT_NE(std::find(held.begin(), held.end(), "model.embed_tokens.weight"), held.end());
    EXPECT_EQ(FindParam(*l, rank - 2, "output_layer.weight"), nullptr);
  }
  // Export reads the first stage's copy only.
  auto pieces = l->ExportPieces(l->FindHf("model.embed_tokens.weight"));
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].rank, 0);
  EXPECT_EQ(pieces[1].rank, 1);
  // One stage: the output layer is the embedding itself, no parameter of its own.
  auto one = MegatronLayout::Build(c, *ParallelLayout::Parse("tp2pp1ep1", 2));
  ASSERT_TRUE(one.ok());
  for (int rank : {0, 1}) EXPECT_EQ(FindParam(*one, rank, "output_layer.weight"), nullptr);
  // Untied, the last stage's output layer is lm_head.
  ModelConfig untied = c;
  untied.tie_word_embeddings = false;
  auto u = MegatronLayout::Build(untied, *ParallelLayout::Parse("tp2pp2ep1", 4));
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(FindParam(*u, 3, "output_layer.weight")->pieces[0].hf_name, "lm_head.weight");
  EXPECT_TRUE(FindParam(*u, 3, "output_layer.weight")->pieces[0].primary);
}

// The last stage's replica holds exactly the first stage's embedding bytes, padding zero.
TEST(MegatronLayout, TiedReplicaBytesEqualTheEmbeddingShard) {
  ModelConfig c = Config("qwen3-tiny");
  c.tie_word_embeddings = true;
  c.vocab_size = 4000;  // 4096 padded rows: the tail of tp rank 1's shard is padding
  auto layout = *ParallelLayout::Parse("tp2pp2ep1", 4);
  auto l = MegatronLayout::Build(c, layout);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  auto model = Model(c);
  for (int tp = 0; tp < 2; ++tp) {
    auto first = LayOutMegatron(*l, tp, model->tensors());
    auto last = LayOutMegatron(*l, 2 + tp, model->tensors());
    ASSERT_TRUE(first.ok() && last.ok());
    const HostTensor& emb = first->front();
    const HostTensor& out = last->back();
    EXPECT_EQ(emb.meta.name, "embedding.word_embeddings.weight");
    ASSERT_EQ(out.meta.name, "output_layer.weight");
    ASSERT_EQ(out.meta.shape, (Shape{2048, 256}));
    ASSERT_EQ(emb.meta.nbytes(), out.meta.nbytes());
    EXPECT_EQ(0, std::memcmp(emb.storage.data(), out.storage.data(), out.meta.nbytes())) << tp;
    // Rows [tp*2048, ...) of the HF embedding; tp rank 1 has 1952 real rows then zeros.
    const size_t row = 256 * 2, real = tp == 0 ? 2048 : 1952;
    EXPECT_EQ(0, std::memcmp(out.storage.data(), model->tensors()[0].storage.data() + tp * 2048 * row,
                             real * row));
    std::vector<std::byte> zeros((2048 - real) * row);
    if (!zeros.empty()) {  // memcmp with a null pointer is undefined even for 0 bytes
      EXPECT_EQ(0, std::memcmp(out.storage.data() + real * row, zeros.data(), zeros.size()));
    }
  }
}

// A checkpoint need not store its tensors in the model's order (Hugging Face files are
// sorted by name): laying out matches tensors by name, and every rank's parameters are
// bit-exact whatever the order of the HF tensors given.
TEST(MegatronLayout, LayOutIgnoresTheOrderOfTheHfTensors) {
  const std::pair<const char*, const char*> cases[] = {{"qwen3-tiny", "tp2pp2ep1"},
                                                       {"qwen3-moe-tiny", "tp2pp1ep2"}};
  for (const auto& [name, grid] : cases) {
    ModelConfig c = Config(name);
    auto layout = *ParallelLayout::Parse(grid, 4);
    auto l = MegatronLayout::Build(c, layout);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    auto model = Model(c);
    for (const char* order : {"by name", "shuffled"}) {
      auto copy = Model(c);  // same seed: the same bytes, in the model's order
      std::vector<size_t> perm(copy->tensors().size());
      std::iota(perm.begin(), perm.end(), 0);
      if (std::string(order) == "by name") {
        std::sort(perm.begin(), perm.end(), [&](size_t a, size_t b) {
          return copy->tensors()[a].meta.name < copy->tensors()[b].meta.name;
        });
      } else {
        std::shuffle(perm.begin(), perm.end(), std::mt19937(5));
      }
      ASSERT_FALSE(std::is_sorted(perm.begin(), perm.end())) << name << " " << order;
      std::vector<HostTensor> reordered;
      for (size_t i : perm) reordered.push_back(std::move(copy->tensors()[i]));
      for (int rank = 0; rank < layout.world; ++rank) {
        auto want = LayOutMegatron(*l, rank, model->tensors());
        auto got = LayOutMegatron(*l, rank, reordered);
        ASSERT_TRUE(want.ok()) << want.status().ToString();
        ASSERT_TRUE(got.ok()) << name << " " << order << " rank " << rank << ": " << got.status().ToString();
        ASSERT_EQ(want->size(), got->size());
        for (size_t p = 0; p < want->size(); ++p) {
          const size_t n = (*want)[p].meta.nbytes();
          ASSERT_EQ(n, (*got)[p].meta.nbytes());
          EXPECT_EQ(0, std::memcmp((*want)[p].storage.data(), (*got)[p].storage.data(), n))
              << name << " " << order << " rank " << rank << ": " << (*want)[p].meta.name;
        }
      }
    }
  }
}

TEST(MegatronLayout, LayOutNamesAMissingOrRepeatedTensor) {
  ModelConfig c = Config("qwen3-tiny");
  auto l = MegatronLayout::Build(c, *ParallelLayout::Parse("tp2pp1ep1", 2));
  ASSERT_TRUE(l.ok());
  auto model = Model(c);
  auto twice = Model(c);
  // The norm in place of the embedding: one tensor twice, one missing.
  std::vector<HostTensor>& t = twice->tensors();
  size_t norm = l->FindHf("model.norm.weight");
  size_t embed = l->FindHf("model.embed_tokens.weight");
  t[embed] = std::move(model->tensors()[norm]);
  auto r = LayOutMegatron(*l, 0, t);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("model.norm.weight is given twice"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace wsync
