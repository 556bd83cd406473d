// One sync of a real-size model (qwen3-0.6b, 1.2 GB of bf16 with tied embeddings) into a
// TP=2 server, checked bit-exact. Labelled "slow".
#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

class Qwen3_0_6bTest : public E2eTest {};

TEST_F(Qwen3_0_6bTest, OneStepIntoTp2ServerMatchesTrainer) {
  // Computed first, so the test's own copy of the model is freed before the CLI runs.
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-0.6b", 17, 1,
                                                                  DigestAlgorithm::kXxh3_128));
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("tp2", {"--model", "qwen3-0.6b", "--tp", "2"},
                                                 {}, /*ready_seconds=*/120));
  RunResult push = Push("push", {s}, {"--model", "qwen3-0.6b", "--seed", "17", "--steps", "1",
                                      "--verify", "--timeout", "300"},
                        /*timeout_seconds=*/480);
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 2));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  std::cout << "[e2e] qwen3-0.6b push took " << push.seconds << " s\n";
}

}  // namespace
}  // namespace wsync::e2e
