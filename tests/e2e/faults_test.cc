// A server whose workers never join the data plane (`serve --fault never-join`): the
// trainer must give up at its own --timeout with an error naming what it waited for,
// leave both servers up, and a later trainer run against the healthy server alone must
// sync bit-exact.
#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

class FaultsTest : public E2eTest {};

TEST_F(FaultsTest, NeverJoiningServerFailsPushAtItsTimeoutNamingItAndLeavesBothServersUp) {
  E2E_ASSERT_OK_AND_ASSIGN(Server healthy, StartServer("healthy", {"--model", "qwen3-tiny",
                                                                   "--timeout", "20"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server stuck, StartServer("stuck", {"--model", "qwen3-tiny",
                                                               "--fault", "never-join",
                                                               "--timeout", "20"}));

  RunResult push = Push("push_both", {healthy, stuck},
                        {"--model", "qwen3-tiny", "--seed", "2", "--verify", "--timeout", "5"},
                        /*timeout_seconds=*/60);
  EXPECT_FALSE(push.timed_out) << push.description;
  EXPECT_TRUE(push.exit.exited) << "push must exit, not die: " << push.description;
  EXPECT_NE(push.exit.code, 0) << push.description;
  EXPECT_LE(push.seconds, 5.0 + 10.0) << "push --timeout 5 took " << push.seconds << " s\n"
                                      << push.description;
  EXPECT_NE(push.err.find(stuck.url), std::string::npos)
      << "stderr must name the server it waited for (" << stuck.url << "):\n" << push.description;

  for (const Server* s : {&healthy, &stuck}) {
    EXPECT_TRUE(s->process->Running()) << s->name << " died:\n" << s->process->Describe();
    HttpReply h = HttpGet(s->url, "/health", "", 10);
    EXPECT_EQ(h.status, 200) << s->name << " GET /health " << h.Describe();
  }

  RunResult retry = Push("push_healthy", {healthy},
                         {"--model", "qwen3-tiny", "--seed", "4", "--steps", "1", "--verify",
                          "--timeout", "60"});
  ASSERT_TRUE(retry.success()) << retry.description << "\n--- healthy server ---\n"
                               << healthy.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(retry.out, 2));
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 4, 1,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold({healthy}, want, DigestAlgorithm::kXxh3_128);

  // The stuck server still has an init call waiting for workers that never join (until
  // its --timeout 20); SIGTERM must still shut it down cleanly and promptly.
  ExpectCleanShutdown(stuck);
  ExpectCleanShutdown(healthy);
}

}  // namespace
}  // namespace wsync::e2e
