// End-to-end syncs across server layouts: TP inside one server, a prefill/decode pair,
// external-LB DP ranks, TP x DP in one process, and an MoE model. Every sync is checked
// bit for bit against digests the test computes itself, on every server.
#include <signal.h>

#include <fmt/format.h>

#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;

class SyncTopologyTest : public E2eTest {};

int WorldSize(const Server& s, bool include_dp) {
  HttpReply r = HttpGet(s.url, include_dp ? "/get_world_size?include_dp=true"
                                          : "/get_world_size?include_dp=false");
  EXPECT_EQ(r.status, 200) << s.name << " GET /get_world_size " << r.Describe();
  if (r.status != 200 || !r.json.is_object() || !r.json.contains("world_size")) return -1;
  return r.json["world_size"].get<int>();
}

TEST_F(SyncTopologyTest, OneTp2ServerTwoStepsMatchesTrainerAndReportsWeightVersion) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("tp2", {"--model", "qwen3-tiny", "--tp", "2",
                                                         "--device", "cpu", "--backend", "nccl"}));
  EXPECT_NE(s.process->Stdout().find("listening on " + s.url), std::string::npos)
      << "serve must print 'listening on URL':\n" << s.process->Describe();
  EXPECT_EQ(WorldSize(s, true), 2);
  EXPECT_EQ(WorldSize(s, false), 2);

  RunResult push = Push("push", {s}, {"--model", "qwen3-tiny", "--seed", "11", "--steps", "2",
                                      "--verify", "--weight-version", "e2e-v2", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 3));

  // The steps must really change the weights, or the check below proves nothing.
  E2E_ASSERT_OK_AND_ASSIGN(Digests step0, ExpectedSyntheticDigests("qwen3-tiny", 11, 0,
                                                                   DigestAlgorithm::kXxh3_128));
  E2E_ASSERT_OK_AND_ASSIGN(Digests step2, ExpectedSyntheticDigests("qwen3-tiny", 11, 2,
                                                                   DigestAlgorithm::kXxh3_128));
  ASSERT_FALSE(DigestsEqual(step0, step2));
  ExpectServersHold({s}, step2, DigestAlgorithm::kXxh3_128);
  E2E_ASSERT_OK_AND_ASSIGN(Digests sha, ExpectedSyntheticDigests("qwen3-tiny", 11, 2,
                                                                 DigestAlgorithm::kSha256));
  ExpectServersHold({s}, sha, DigestAlgorithm::kSha256);

  HttpReply info = HttpGet(s.url, "/weight_info");
  ASSERT_EQ(info.status, 200) << info.Describe();
  EXPECT_EQ(info.json.value("weight_version", ""), "e2e-v2") << info.body;

  ExpectCleanShutdown(s);
}

TEST_F(SyncTopologyTest, PrefillDecodePairOfTp1ServersBothMatchTrainer) {
  E2E_ASSERT_OK_AND_ASSIGN(Server prefill, StartServer("prefill", {"--model", "qwen3-tiny"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server decode, StartServer("decode", {"--model", "qwen3-tiny"}));
  EXPECT_EQ(WorldSize(prefill, true), 1);
  EXPECT_EQ(WorldSize(decode, true), 1);

  // A small bucket forces many buckets per sync.
  RunResult push = Push("push", {prefill, decode},
                        {"--model", "qwen3-tiny", "--seed", "5", "--steps", "2", "--verify",
                         "--bucket-gb", "0.001", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 3));

  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 5, 2,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold({prefill, decode}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(prefill, SIGTERM);
  ExpectCleanShutdown(decode, SIGINT);
}

TEST_F(SyncTopologyTest, FourExternalLbDpRankServersWithDataParallelSize2AllMatchTrainer) {
  std::vector<Server> servers;
  const char* ranks[] = {"0", "1", "0", "1"};
  for (int i = 0; i < 4; ++i) {
    E2E_ASSERT_OK_AND_ASSIGN(Server s,
                             StartServer(fmt::format("dp{}_{}", i / 2, ranks[i]),
                                         {"--model", "qwen3-tiny", "--tp", "1", "--dp", "2",
                                          "--dp-rank", ranks[i]}));
    servers.push_back(s);
  }
  for (const Server& s : servers) {
    EXPECT_EQ(WorldSize(s, true), 2) << s.name;  // tp * dp: the deployment's world
    EXPECT_EQ(WorldSize(s, false), 1) << s.name;
  }

  RunResult push = Push("push", servers,
                        {"--model", "qwen3-tiny", "--seed", "21", "--steps", "1", "--verify",
                         "--data-parallel-size", "2", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 2));

  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 21, 1,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold(servers, want, DigestAlgorithm::kXxh3_128);
}

TEST_F(SyncTopologyTest, OneServerHostingTp2Dp2MatchesTrainerOnEveryReplica) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("tp2dp2", {"--model", "qwen3-tiny", "--tp", "2",
                                                            "--dp", "2"}));
  EXPECT_EQ(WorldSize(s, true), 4);
  EXPECT_EQ(WorldSize(s, false), 2);

  RunResult push = Push("push", {s}, {"--model", "qwen3-tiny", "--seed", "3", "--steps", "1",
                                      "--verify", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 2));

  // /weight_checker refuses to answer when the DP replicas differ, so a match here covers
  // both replicas.
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 3, 1,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

TEST_F(SyncTopologyTest, MoeModelWithTp2MatchesTrainer) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("moe", {"--model", "qwen3-moe-tiny", "--tp", "2"}));
  RunResult push = Push("push", {s}, {"--model", "qwen3-moe-tiny", "--seed", "9", "--steps", "1",
                                      "--verify", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 2));

  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-moe-tiny", 9, 1,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
}

}  // namespace
}  // namespace wsync::e2e
