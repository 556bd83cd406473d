// End-to-end syncs from parallel trainers: `wsync push --trainer-ranks N
// --trainer-layout L` runs N trainer ranks (threads, each with its own Gloo trainer
// communicator and its own shards); rank 0 sends over `nccl`, the others only drain their
// sources. Every server's checksums must equal the original HF model's, which the test
// rebuilds itself. A rank that fails stops the others at once, naming it.
#include <fmt/format.h>

#include <fstream>

#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

class SourcesTest : public E2eTest {
 protected:
  // Pushes `model` from `ranks` trainer ranks laid out as `layout` through `steps` RL
  // steps, verifying every sync, and checks the servers hold step `steps`' weights.
  void PushAndCheck(const std::vector<Server>& servers, const std::string& model, int ranks,
                    const std::string& layout, int steps, uint64_t seed) {
    RunResult push = Push("push-" + layout, servers,
                          {"--model", model, "--seed", std::to_string(seed), "--steps",
                           std::to_string(steps), "--verify", "--timeout", "60", "--trainer-ranks",
                           std::to_string(ranks), "--trainer-layout", layout});
    ASSERT_TRUE(push.success()) << push.description;
    EXPECT_TRUE(HasVerifiedTable(push.out, steps + 1)) << push.out;
    E2E_ASSERT_OK_AND_ASSIGN(Digests want,
                             ExpectedSyntheticDigests(model, seed, steps, DigestAlgorithm::kXxh3_128));
    ExpectServersHold(servers, want, DigestAlgorithm::kXxh3_128);
  }
};

TEST_F(SourcesTest, FsdpThreeRanksToTp2Server) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("tp2", {"--model", "qwen3-tiny", "--tp", "2"}));
  PushAndCheck({s}, "qwen3-tiny", 3, "fsdp", 2, 21);
}

TEST_F(SourcesTest, MegatronTp2Pp2ToTwoServers) {
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartServer("a", {"--model", "qwen3-tiny", "--tp", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server b, StartServer("b", {"--model", "qwen3-tiny", "--tp", "2"}));
  PushAndCheck({a, b}, "qwen3-tiny", 4, "tp2pp2ep1", 1, 22);
}

TEST_F(SourcesTest, MegatronMoeExpertParallelWithReplicas) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("moe", {"--model", "qwen3-moe-tiny", "--tp", "2"}));
  // pp2 x ep2, two data-parallel replicas: 8 trainer ranks.
  PushAndCheck({s}, "qwen3-moe-tiny", 8, "tp1pp2ep2", 1, 23);
}

// Megatron's expert tensor parallelism: each expert's fc1/fc2 split over the TP group.
TEST_F(SourcesTest, MegatronMoeExpertTensorParallel) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("moe", {"--model", "qwen3-moe-tiny", "--tp", "2"}));
  PushAndCheck({s}, "qwen3-moe-tiny", 4, "tp2pp1ep2etp2", 1, 24);
}

// A tied model (no lm_head.weight in HF or on the server): over two stages the last one
// holds a replica of the embedding as its output layer, which export must not send twice.
TEST_F(SourcesTest, MegatronTiedEmbeddingsOverTwoStages) {
  const auto model_dir = dir() / "qwen3-tiny-tied";
  std::filesystem::create_directories(model_dir);
  std::ofstream(model_dir / "config.json")
      << R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 4000, "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": true,
            "torch_dtype": "bfloat16"})";
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("tied", {"--model", model_dir.string(), "--tp", "2"}));
  PushAndCheck({s}, model_dir.string(), 4, "tp2pp2ep1", 1, 25);
  E2E_ASSERT_OK_AND_ASSIGN(Digests held, ServerChecksums(s.url, DigestAlgorithm::kXxh3_128));
  EXPECT_EQ(held.count("lm_head.weight"), 0u);
  EXPECT_EQ(held.count("model.embed_tokens.weight"), 1u);
}

// The sender fails outside its source (the server rejects the update: a model mismatch)
// after the others entered the transfer pass. It stops the trainer group, so the push
// exits at once, not at the 60 s timeout, and every other rank's error names rank 0 and
// the cause.
TEST_F(SourcesTest, SenderThatFailsStopsTheOtherRanksAtOnce) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("dense", {"--model", "qwen3-tiny"}));
  const std::string cause = s.url +
                            ": POST /update_weights -> 400: update_info names tensor "
                            "model.layers.0.mlp.gate.weight, which the worker does not hold";
  for (const std::string layout : {"fsdp", "tp1pp2ep1"}) {
    SCOPED_TRACE(layout);
    const int ranks = layout == "fsdp" ? 3 : 4;
    RunResult push = Push("stop-" + layout, {s},
                          {"--model", "qwen3-moe-tiny", "--trainer-ranks", std::to_string(ranks),
                           "--trainer-layout", layout, "--timeout", "60"},
                          90);
    EXPECT_FALSE(push.success()) << push.description;
    EXPECT_LT(push.seconds, 20.0) << push.description;
    EXPECT_NE(push.err.find("wsync push: error: " + cause), std::string::npos) << push.description;
    const std::string rank0 = layout == "fsdp" ? "trainer rank 0" : "trainer rank 0 (tp0 pp0 ep0 dp0)";
    for (int r = 1; r < ranks; ++r) {
      // tp1pp2ep1 over 4 ranks: two data-parallel replicas per stage.
      const std::string who = layout == "fsdp"
                                  ? fmt::format("trainer rank {}", r)
                                  : fmt::format("trainer rank {} (tp0 pp{} ep0 dp{})", r, r / 2, r % 2);
      // Normally in the transfer pass; a rank still finishing the check pass's last
      // collective when rank 0 stops fails there, for the same reason.
      const std::string head = fmt::format("{} failed too: ABORTED: trainer rank {} (", who, r);
      const size_t at = push.err.find(head);
      ASSERT_NE(at, std::string::npos) << push.description;
      const std::string line = push.err.substr(at, push.err.find('\n', at) - at);
      EXPECT_NE(line.find(": " + rank0 + " stopped: " + cause), std::string::npos) << line;
    }
  }
}

TEST_F(SourcesTest, LayoutErrorsAreClear) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("moe", {"--model", "qwen3-moe-tiny"}));
  RunResult ranks = Push("bad-ranks", {s}, {"--model", "qwen3-moe-tiny", "--trainer-ranks", "3",
                                            "--trainer-layout", "tp2pp1ep1", "--timeout", "20"});
  EXPECT_FALSE(ranks.success()) << ranks.description;
  EXPECT_NE(ranks.err.find("needs a multiple of tp*pp*ep = 2 ranks, got 3"), std::string::npos)
      << ranks.description;
  RunResult experts = Push("bad-ep", {s}, {"--model", "qwen3-moe-tiny", "--trainer-ranks", "3",
                                           "--trainer-layout", "tp1pp1ep3", "--timeout", "20"});
  EXPECT_FALSE(experts.success()) << experts.description;
  EXPECT_NE(experts.err.find("model.layers.0.mlp.experts) has 8 experts, not divisible by ep 3"),
            std::string::npos)
      << experts.description;
  RunResult etp = Push("bad-etp", {s}, {"--model", "qwen3-moe-tiny", "--trainer-ranks", "4",
                                        "--trainer-layout", "tp2pp1ep2etp4", "--timeout", "20"});
  EXPECT_FALSE(etp.success()) << etp.description;
  EXPECT_NE(etp.err.find("trainer layout 'tp2pp1ep2etp4': etp 4 must divide tp 2"), std::string::npos)
      << etp.description;
}

}  // namespace
}  // namespace wsync::e2e
