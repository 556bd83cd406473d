// Trainer-rank sources with every rank a thread of this process, each with its own Gloo
// communicator: lay an HF model out into rank shards, iterate on every rank, and compare
// every tensor's bytes with the original.
#include "sources/sources.h"

#include "sources/test_util.h"

namespace wsync {
namespace {

using namespace sources_test;

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

}  // namespace
}  // namespace wsync
