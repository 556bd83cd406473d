// Servers that fail the trainer's group: one whose workers never join the data plane
// (`serve --fault never-join`), and one whose process dies in the middle of a sync
// (`serve --fault die-mid-update`: a real SIGKILL after one chunk has landed). The trainer
// must give up within its own --timeout with an error naming the server, the surviving
// server must stay up, and a later trainer run against it alone must sync bit-exact.
#include <signal.h>

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

TEST_F(FaultsTest, ServerKilledMidSyncFailsPushWithinItsTimeoutAndTheSurvivorTakesTheNextSession) {
  E2E_ASSERT_OK_AND_ASSIGN(Server healthy, StartServer("healthy", {"--model", "qwen3-tiny",
                                                                   "--timeout", "30"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server dying, StartServer("dying", {"--model", "qwen3-tiny",
                                                             "--fault", "die-mid-update",
                                                             "--timeout", "30"}));
  // Small buckets: many chunks, so the death lands in the middle of the sync.
  RunResult push = Push("push_both", {healthy, dying},
                        {"--model", "qwen3-tiny", "--seed", "3", "--bucket-gb", "0.0005",
                         "--timeout", "10"},
                        /*timeout_seconds=*/60);
  EXPECT_FALSE(push.timed_out) << push.description;
  EXPECT_TRUE(push.exit.exited) << "push must exit, not die: " << push.description;
  EXPECT_NE(push.exit.code, 0) << push.description;
  EXPECT_LE(push.seconds, 10.0 + 10.0) << "push --timeout 10 took " << push.seconds << " s\n"
                                       << push.description;
  EXPECT_NE(push.err.find(dying.url), std::string::npos)
      << "stderr must name the server that died (" << dying.url << "):\n" << push.description;
  std::optional<ExitStatus> died = dying.process->Wait(Deadline::InSeconds(10));
  ASSERT_TRUE(died.has_value()) << "the faulty server must have killed itself";
  EXPECT_EQ(died->signal, SIGKILL) << died->ToString();

  EXPECT_TRUE(healthy.process->Running()) << healthy.process->Describe();
  HttpReply h = HttpGet(healthy.url, "/health", "", 10);
  EXPECT_EQ(h.status, 200) << h.Describe();

  RunResult retry = Push("push_healthy", {healthy},
                         {"--model", "qwen3-tiny", "--seed", "6", "--steps", "1", "--verify",
                          "--timeout", "60"});
  ASSERT_TRUE(retry.success()) << retry.description << "\n--- healthy server ---\n"
                               << healthy.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(retry.out, 2));
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 6, 1,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold({healthy}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(healthy);
}

}  // namespace
}  // namespace wsync::e2e
