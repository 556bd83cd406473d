// End-to-end syncs from parallel trainers: `wsync push --trainer-ranks N
// --trainer-layout L` runs N trainer ranks (threads, each with its own Gloo trainer
// communicator and its own shards); rank 0 sends over `nccl`, the others only drain their
// sources. Every server's checksums must equal the original HF model's, which the test
// rebuilds itself.
#include <fmt/format.h>

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
}

}  // namespace
}  // namespace wsync::e2e
