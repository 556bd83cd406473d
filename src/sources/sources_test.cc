// Trainer-rank sources with every rank a thread of this process, each with its own Gloo
// communicator: lay an HF model out into rank shards, iterate on every rank, and compare
// every tensor's bytes with the original.
#include "sources/sources.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>

#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "comm/gloo_communicator.h"
#include "comm/store.h"
#include "sources/agreement.h"
#include "sources/trainer_ranks.h"
#include "trainer/synthetic.h"

namespace wsync {
namespace {

using RankFn = std::function<void(int rank, std::shared_ptr<Communicator> comm)>;
using GroupFn = std::function<void(int rank, std::shared_ptr<TrainerGroup> group)>;

// Runs `fn` on `n` threads, each joined to one trainer group of n ranks.
void RunGroups(const ParallelLayout& layout, double timeout_s, const GroupFn& fn) {
  static std::atomic<int> group{0};
  auto store = StoreServer::Start("127.0.0.1", 0);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TrainerGroupOptions o;
  o.store_port = (*store)->port();
  o.prefix = "sources-test/" + std::to_string(group++);
  o.timeout_seconds = timeout_s;
  std::vector<std::thread> threads;
  for (int r = 0; r < layout.world; ++r) {
    threads.emplace_back([&, r] {
      auto g = TrainerGroup::Connect(o, layout, r);
      ASSERT_TRUE(g.ok()) << g.status().ToString();
      fn(r, *g);
    });
  }
  for (auto& t : threads) t.join();
}

// The same with only each rank's communicator.
void RunRanks(const ParallelLayout& layout, double timeout_s, const RankFn& fn) {
  RunGroups(layout, timeout_s, [&](int rank, std::shared_ptr<TrainerGroup> g) { fn(rank, g->comm()); });
}

std::unique_ptr<SyntheticTrainer> Model(const ModelConfig& c) {
  auto t = SyntheticTrainer::FromMetadata(HfTensors(c), 7, 2);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(*t);
}

// Drains one pass and checks it equals `full` byte for byte.
void ExpectPassEquals(WeightSource& source, const std::vector<HostTensor>& full, const std::string& who) {
  auto stream = source.Iterate();
  ASSERT_TRUE(stream.ok()) << who << ": " << stream.status().ToString();
  auto checked = CheckedStream(std::move(*stream), source.metadata());
  TensorRef t;
  size_t i = 0;
  for (;; ++i) {
    auto more = checked->Next(&t);
    ASSERT_TRUE(more.ok()) << who << ": " << more.status().ToString();
    if (!*more) break;
    ASSERT_LT(i, full.size());
    ASSERT_EQ(t.name, full[i].meta.name) << who;
    ASSERT_EQ(0, std::memcmp(t.bytes.data(), full[i].storage.data(), t.bytes.size()))
        << who << ": bytes of " << t.name << " differ from the original";
  }
  EXPECT_EQ(i, full.size()) << who;
}

ModelConfig Config(const std::string& name) {
  auto c = LookupModel(name);
  EXPECT_TRUE(c.ok());
  return *c;
}

// qwen3-tiny with 4 KV heads, so that tp = 4 divides the query groups.
ModelConfig TinyKv4() {
  ModelConfig c = Config("qwen3-tiny");
  c.name = "qwen3-tiny-kv4";
  c.num_key_value_heads = 4;
  return c;
}

// qwen3-moe-tiny with 4 KV heads, for tp = 4.
ModelConfig MoeKv4() {
  ModelConfig c = Config("qwen3-moe-tiny");
  c.name = "qwen3-moe-tiny-kv4";
  c.num_key_value_heads = 4;
  return c;
}

const WorkerParam* FindParam(const MegatronLayout& l, int rank, const std::string& name) {
  for (const WorkerParam& p : l.params(rank)) {
    if (p.meta.name == name) return &p;
  }
  return nullptr;
}

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

void RoundTrip(const ModelConfig& c, const ParallelLayout& layout, int passes = 1) {
  auto model = Model(c);
  const auto& full = model->tensors();
  RunRanks(layout, 60, [&](int rank, std::shared_ptr<Communicator> comm) {
    std::string who = c.name + " " + layout.ToString() + " " + layout.Describe(rank);
    auto source = BuildRankSource(comm, layout, &c, full, 60);
    ASSERT_TRUE(source.ok()) << who << ": " << source.status().ToString();
    for (int p = 0; p < passes; ++p) ExpectPassEquals(**source, full, who);
  });
}

TEST(MegatronSource, RoundTripEveryLayout) {
  int ran = 0;
  for (const ModelConfig& c : {Config("qwen3-tiny"), TinyKv4(), Config("qwen3-moe-tiny")}) {
    for (int tp : {1, 2, 4}) {
      for (int pp : {1, 2}) {
        for (int ep : {1, 2, 4}) {
          auto layout = ParallelLayout::Parse(fmt::format("tp{}pp{}ep{}", tp, pp, ep), tp * pp * ep);
          ASSERT_TRUE(layout.ok());
          if (!MegatronLayout::Build(c, *layout).ok()) continue;  // does not divide
          SCOPED_TRACE(c.name + " " + layout->ToString());
          RoundTrip(c, *layout);
          ++ran;
        }
      }
    }
  }
  EXPECT_GE(ran, 20);
}

// Layout `text` with no data-parallel replicas: world = tp * pp * ep.
ParallelLayout OneReplica(const std::string& text) {
  ParallelLayout cell = *ParallelLayout::Parse(text, 64);  // 64: a multiple of every cell here
  return *ParallelLayout::Parse(text, cell.tp * cell.pp * cell.ep);
}

TEST(MegatronSource, RoundTripExpertTensorParallel) {
  for (const char* l : {"tp2pp1ep1etp2", "tp2pp2ep2etp2", "tp2pp1ep4etp2"}) {
    SCOPED_TRACE(l);
    RoundTrip(Config("qwen3-moe-tiny"), OneReplica(l));
  }
  for (const char* l : {"tp4pp1ep1etp2", "tp4pp1ep2etp4", "tp4pp2ep1etp4"}) {
    SCOPED_TRACE(l);
    RoundTrip(MoeKv4(), OneReplica(l));
  }
}

TEST(MegatronSource, DataParallelReplicasAndRepeatedPasses) {
  RoundTrip(Config("qwen3-moe-tiny"), *ParallelLayout::Parse("tp2pp1ep2", 8), 2);
  RoundTrip(TinyKv4(), *ParallelLayout::Parse("tp2pp2ep1", 8), 2);
  RoundTrip(Config("qwen3-moe-tiny"), *ParallelLayout::Parse("tp2pp1ep2etp2", 8), 2);
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
  EXPECT_EQ(0, std::memcmp(p1.storage.data(), hf("model.layers.1.mlp.experts.6.gate_proj.weight").storage.data() + 64 * row,
                           64 * row));
  EXPECT_EQ(0, std::memcmp(p1.storage.data() + 64 * row,
                           hf("model.layers.1.mlp.experts.6.up_proj.weight").storage.data() + 64 * row, 64 * row));
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

TEST(MegatronLayout, ExpertTensorParallelErrors) {
  auto dense = MegatronLayout::Build(Config("qwen3-tiny"), *ParallelLayout::Parse("tp2pp1ep1etp2", 2));
  EXPECT_EQ(dense.status().message(), "model qwen3-tiny, trainer layout tp2pp1ep1etp2: etp 2 needs a MoE model");
  ModelConfig c = Config("qwen3-moe-tiny");
  c.moe_intermediate_size = 129;
  auto odd = MegatronLayout::Build(c, *ParallelLayout::Parse("tp2pp1ep1etp2", 2));
  EXPECT_EQ(odd.status().message(),
            "model qwen3-moe-tiny, trainer layout tp2pp1ep1etp2: moe_intermediate_size 129 is not divisible by etp 2");
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
    EXPECT_EQ(0, std::memcmp(out.storage.data() + real * row, zeros.data(), zeros.size()));
  }
}

TEST(MegatronSource, TiedEmbeddings) {
  ModelConfig c = Config("qwen3-tiny");
  c.tie_word_embeddings = true;
  for (const char* l : {"tp2pp2ep1", "tp2pp1ep1", "tp1pp2ep1"}) {
    auto layout = *ParallelLayout::Parse(l, 4);
    SCOPED_TRACE(l);
    RoundTrip(c, layout);
  }
  ModelConfig moe = Config("qwen3-moe-tiny");
  moe.tie_word_embeddings = true;
  RoundTrip(moe, *ParallelLayout::Parse("tp1pp2ep2", 4));
}

TEST(FsdpSource, RoundTripOneToFourRanks) {
  for (const ModelConfig& c : {Config("qwen3-tiny"), Config("qwen3-moe-tiny")}) {
    for (int n = 1; n <= 4; ++n) {
      SCOPED_TRACE(c.name + " fsdp x" + std::to_string(n));
      RoundTrip(c, *ParallelLayout::Parse("fsdp", n), 2);
    }
  }
}

TEST(FsdpSource, UnevenRowsArePadded) {
  std::vector<TensorMeta> meta = {{"a", DType::kBF16, {5, 3}}, {"model.layers.0.b", DType::kF32, {7}},
                                  {"model.norm.weight", DType::kF32, {1}}};
  auto model = SyntheticTrainer::FromMetadata(meta, 1, 1);
  ASSERT_TRUE(model.ok());
  auto layout = *ParallelLayout::Parse("fsdp", 3);
  RunRanks(layout, 30, [&](int rank, std::shared_ptr<Communicator> comm) {
    auto source = BuildRankSource(comm, layout, nullptr, (*model)->tensors(), 30);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    ExpectPassEquals(**source, (*model)->tensors(), layout.Describe(rank));
  });
}

TEST(SourceErrors, MetadataDigestMismatch) {
  ModelConfig a = Config("qwen3-tiny"), b = a;
  b.num_hidden_layers = 3;
  auto ma = Model(a), mb = Model(b);
  auto layout = *ParallelLayout::Parse("fsdp", 3);
  std::atomic<int> failed{0};
  RunRanks(layout, 20, [&](int rank, std::shared_ptr<Communicator> comm) {
    auto source = BuildRankSource(comm, layout, nullptr, rank == 1 ? mb->tensors() : ma->tensors(), 20);
    ASSERT_FALSE(source.ok());
    EXPECT_NE(source.status().message().find("disagree on the model"), std::string::npos)
        << source.status().message();
    EXPECT_NE(source.status().message().find("trainer rank 1 has"), std::string::npos)
        << source.status().message();
    ++failed;
  });
  EXPECT_EQ(failed, 3);
}

TEST(SourceErrors, NameHeldByNobody) {
  auto meta = HfTensors(Config("qwen3-tiny"));
  auto layout = *ParallelLayout::Parse("fsdp", 2);
  RunRanks(layout, 20, [&](int rank, std::shared_ptr<Communicator> comm) {
    std::vector<std::string> held;
    for (const auto& m : meta) {
      if (m.name != "model.norm.weight") held.push_back(m.name);
    }
    Status s = CheckRanksAgree(*comm, meta, held, nullptr, Deadline::InSeconds(20));
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("held by no trainer rank: model.norm.weight"), std::string::npos) << s.message();
  });
}

TEST(SourceErrors, NonContiguousMetadata) {
  auto model = Model(Config("qwen3-tiny"));
  std::vector<HostTensor> shuffled;
  for (auto& t : model->tensors()) {
    auto c = HostTensor::Zeros(t.meta);
    std::memcpy(c->storage.data(), t.storage.data(), t.meta.nbytes());
    shuffled.push_back(std::move(*c));
  }
  std::swap(shuffled[1], shuffled[shuffled.size() - 2]);  // a layer-0 tensor near the end
  auto layout = *ParallelLayout::Parse("fsdp", 2);
  RunRanks(layout, 20, [&](int rank, std::shared_ptr<Communicator> comm) {
    auto source = BuildRankSource(comm, layout, nullptr, shuffled, 20);
    ASSERT_FALSE(source.ok());
    EXPECT_NE(source.status().message().find("not group-contiguous"), std::string::npos)
        << source.status().message();
  });
}

// Rank 2 stops after 3 tensors and holds its stream: the others time out naming it.
TEST(SourceErrors, RankThatStopsIteratingFailsTheOthersInTime) {
  for (const char* name : {"fsdp", "tp1pp1ep1"}) {
    ModelConfig c = Config("qwen3-tiny");
    auto model = Model(c);
    auto layout = *ParallelLayout::Parse(name, 3);
    if (!layout.fsdp) layout = *ParallelLayout::Parse("tp1pp1ep1", 3);  // 3 DP replicas
    SCOPED_TRACE(name);
    std::atomic<int> failed{0};
    RunRanks(layout, 1.5, [&](int rank, std::shared_ptr<Communicator> comm) {
      auto source = BuildRankSource(comm, layout, &c, model->tensors(), 1.5);
      ASSERT_TRUE(source.ok()) << source.status().ToString();
      auto stream = (*source)->Iterate();
      ASSERT_TRUE(stream.ok());
      TensorRef t;
      auto start = std::chrono::steady_clock::now();
      for (int i = 0;; ++i) {
        if (rank == 2 && i == 3) {
          std::this_thread::sleep_for(std::chrono::seconds(4));  // stuck, stream held
          return;
        }
        auto more = (*stream)->Next(&t);
        if (!more.ok()) {
          double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          EXPECT_LT(s, 4.0) << more.status().ToString();
          // Broadcasts name the rank waited for; Gloo's ring all-gather cannot.
          const std::string& m = more.status().message();
          EXPECT_TRUE(m.find("trainer rank 2") != std::string::npos ||
                      m.find("stopped iterating") != std::string::npos)
              << more.status().ToString();
          ++failed;
          return;
        }
        ASSERT_TRUE(*more) << "pass ended although rank 2 stopped";
      }
    });
    EXPECT_EQ(failed, 2);
  }
}

// A rank that drops its stream mid-pass aborts the group: the others fail at once.
TEST(SourceErrors, AbandonedPassFailsTheOthersFast) {
  ModelConfig c = Config("qwen3-tiny");
  auto model = Model(c);
  auto layout = *ParallelLayout::Parse("tp2pp1ep1", 2);
  RunRanks(layout, 30, [&](int rank, std::shared_ptr<Communicator> comm) {
    auto source = BuildRankSource(comm, layout, &c, model->tensors(), 30);
    ASSERT_TRUE(source.ok());
    auto stream = (*source)->Iterate();
    TensorRef t;
    auto start = std::chrono::steady_clock::now();
    if (rank == 1) {
      (void)(*stream)->Next(&t);
      stream->reset();  // abandons the pass
      EXPECT_FALSE((*source)->Iterate().ok());
      return;
    }
    for (;;) {
      auto more = (*stream)->Next(&t);
      if (!more.ok()) break;
      ASSERT_TRUE(*more) << "pass ended although rank 1 abandoned it";
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
  });
}

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// What a rank was doing when its first collective of a pass failed, as the sources word it.
std::string FirstCollective(const ParallelLayout& layout, const std::vector<TensorMeta>& meta, int rank) {
  if (layout.fsdp) {
    return fmt::format("fsdp source on trainer rank {}: all-gather of {} (tensor 1/{})", rank, meta[0].name,
                       meta.size());
  }
  // 'pre' holds the embedding, whose primary pieces are on dp 0 (rank 0 for tp1).
  return fmt::format("megatron export of group 'pre' on {}: broadcast of the {} bytes of pieces held by {}",
                     layout.Describe(rank), meta[0].nbytes(), layout.Describe(0));
}

// Rank 0 (the sender) drains the check pass, then fails outside its source (a server
// refused the update) and stops the group: ranks 1 and 2, already in the transfer pass,
// fail at once (not at the 30 s timeout) with kAborted naming rank 0 and its cause.
TEST(SourceErrors, SenderThatStopsFailsTheOthersAtOnce) {
  for (const char* name : {"fsdp", "tp1pp1ep1"}) {
    SCOPED_TRACE(name);
    ModelConfig c = Config("qwen3-tiny");
    auto model = Model(c);
    auto layout = *ParallelLayout::Parse(name, 3);
    const Status cause = Unavailable("POST /start_weight_update to http://127.0.0.1:9 refused");
    std::atomic<int> failed{0};
    RunGroups(layout, 30, [&](int rank, std::shared_ptr<TrainerGroup> group) {
      auto source = BuildRankSource(*group, layout, &c, model->tensors(), 30);
      ASSERT_TRUE(source.ok()) << source.status().ToString();
      ExpectPassEquals(**source, model->tensors(), layout.Describe(rank));  // the check pass
      if (rank == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the others are waiting
        EXPECT_TRUE(group->PeerStopped().ok());
        group->Stop(cause);
        return;
      }
      auto start = std::chrono::steady_clock::now();
      auto stream = (*source)->Iterate();
      ASSERT_TRUE(stream.ok());
      TensorRef t;
      auto more = (*stream)->Next(&t);
      ASSERT_FALSE(more.ok());
      EXPECT_LT(SecondsSince(start), 5.0) << more.status().ToString();
      EXPECT_EQ(more.status().code(), StatusCode::kAborted);
      EXPECT_EQ(more.status().message(),
                FirstCollective(layout, (*source)->metadata(), rank) + ": " + layout.Describe(0) +
                    " stopped: POST /start_weight_update to http://127.0.0.1:9 refused");
      // A new pass fails at once for the same reason.
      stream->reset();
      auto again = (*source)->Iterate();
      ASSERT_FALSE(again.ok());
      EXPECT_EQ(again.status().code(), StatusCode::kAborted);
      EXPECT_EQ(again.status().message(),
                std::string(layout.fsdp ? "fsdp" : "megatron") + " source: " + layout.Describe(0) +
                    " stopped: POST /start_weight_update to http://127.0.0.1:9 refused");
      ++failed;
    });
    EXPECT_EQ(failed, 2);
  }
}

// A non-sender rank fails mid-pass (holding its stream) and stops the group: rank 0 and
// the other non-sender fail at once naming it; later stops (consequences) do not replace
// the first cause on the board.
TEST(SourceErrors, NonSenderThatStopsFailsTheSenderAtOnce) {
  for (const char* name : {"fsdp", "tp1pp1ep1"}) {
    SCOPED_TRACE(name);
    ModelConfig c = Config("qwen3-tiny");
    auto model = Model(c);
    auto layout = *ParallelLayout::Parse(name, 3);
    std::atomic<int> failed{0};
    RunGroups(layout, 30, [&](int rank, std::shared_ptr<TrainerGroup> group) {
      auto source = BuildRankSource(*group, layout, &c, model->tensors(), 30);
      ASSERT_TRUE(source.ok()) << source.status().ToString();
      auto stream = (*source)->Iterate();
      ASSERT_TRUE(stream.ok());
      TensorRef t;
      auto start = std::chrono::steady_clock::now();
      size_t yielded = 0;
      for (;;) {
        if (rank == 2 && yielded == 3) {
          group->Stop(Internal("checksum of model.layers.0.mlp.up_proj.weight differs"));
          EXPECT_TRUE(group->PeerStopped().ok()) << "a rank does not see its own stop";
          std::this_thread::sleep_for(std::chrono::seconds(1));  // stream still held
          return;
        }
        auto more = (*stream)->Next(&t);
        if (!more.ok()) {
          EXPECT_LT(SecondsSince(start), 5.0) << more.status().ToString();
          EXPECT_EQ(more.status().code(), StatusCode::kAborted);
          const std::string want = layout.Describe(2) +
                                   " stopped: checksum of model.layers.0.mlp.up_proj.weight differs";
          const std::string& m = more.status().message();
          EXPECT_EQ(m.substr(m.size() - std::min(m.size(), want.size())), want) << m;
          // This failure is a consequence: stopping does not replace rank 2's cause.
          group->Stop(more.status());
          Status seen = group->PeerStopped();
          EXPECT_EQ(seen.message(), want);
          ++failed;
          return;
        }
        ASSERT_TRUE(*more) << "pass ended although rank 2 stopped";
        ++yielded;
      }
    });
    EXPECT_EQ(failed, 2);
  }
}

// The exact wording of the stop board, and its first-cause rule: rank 1 stopping after
// rank 3 (a consequence) does not replace rank 3's cause, though rank 1 is lower-numbered.
TEST(TrainerGroup, StopBoardNamesTheFirstRankAndCause) {
  auto layout = *ParallelLayout::Parse("tp2pp1ep1", 4);
  const std::string want = "trainer rank 3 (tp1 pp0 ep0 dp1) stopped: server http://h:1 did not answer /update_weights";
  std::atomic<int> phase{0}, checked{0};
  auto wait_for = [](std::atomic<int>& v, int n) {
    while (v.load() < n) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  };
  RunGroups(layout, 30, [&](int rank, std::shared_ptr<TrainerGroup> group) {
    EXPECT_TRUE(group->PeerStopped().ok());
    ++checked;
    wait_for(checked, 4);
    if (rank == 3) {
      group->Stop(DeadlineExceeded("server http://h:1 did not answer /update_weights"));
      EXPECT_TRUE(group->comm()->aborted());
      phase = 1;
    }
    wait_for(phase, 1);
    if (rank == 1) {
      group->Stop(Aborted("a consequence"));
      phase = 2;
    }
    wait_for(phase, 2);
    Status s = group->PeerStopped();
    if (rank == 3) {
      EXPECT_TRUE(s.ok()) << "a rank does not see its own stop: " << s.ToString();
    } else {
      EXPECT_EQ(s.code(), StatusCode::kAborted);
      EXPECT_EQ(s.message(), want);
    }
  });
}

}  // namespace
}  // namespace wsync
