// End-to-end syncs across server layouts: TP inside one server, a prefill/decode pair,
// external-LB DP ranks, TP x DP in one process, an MoE model, and heterogeneous fleets
// (servers or DP deployments of different TP sizes). Every sync is checked
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

// A heterogeneous fleet: a TP=2 server beside a TP=1 one, in both orders. Each server's
// rank offset follows the world sizes of the servers before it ([1, 3], then [1, 2]).
TEST_F(SyncTopologyTest, HeterogeneousFleetOfTp2AndTp1ServersBothMatchTrainer) {
  E2E_ASSERT_OK_AND_ASSIGN(Server tp2, StartServer("tp2", {"--model", "qwen3-tiny", "--tp", "2", "--device", "cpu",
                                                          "--backend", "nccl"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server tp1, StartServer("tp1", {"--model", "qwen3-tiny", "--tp", "1", "--device", "cpu",
                                                          "--backend", "nccl"}));
  EXPECT_EQ(WorldSize(tp2, true), 2);
  EXPECT_EQ(WorldSize(tp1, true), 1);

  struct Order {
    std::vector<Server> servers;
    int seed;
    std::string offsets;
  };
  for (const Order& order : {Order{{tp2, tp1}, 31, "world 4, rank offsets [1, 3]"},
                             Order{{tp1, tp2}, 32, "world 4, rank offsets [1, 2]"}}) {
    SCOPED_TRACE(order.offsets);
    // A small bucket forces many broadcasts per sync.
    RunResult push = Push(fmt::format("push_{}", order.seed), order.servers,
                          {"--model", "qwen3-tiny", "--seed", std::to_string(order.seed), "--steps", "2",
                           "--verify", "--bucket-gb", "0.001", "--timeout", "60"});
    ASSERT_TRUE(push.success()) << push.description;
    EXPECT_TRUE(HasVerifiedTable(push.out, 3));
    EXPECT_NE((push.out + push.err).find(order.offsets), std::string::npos) << push.description;
    E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", order.seed, 2,
                                                                    DigestAlgorithm::kXxh3_128));
    ExpectServersHold(order.servers, want, DigestAlgorithm::kXxh3_128);
  }
  ExpectCleanShutdown(tp2);
  ExpectCleanShutdown(tp1);
}

// --data-parallel-size 2 over deployments of different sizes: two DP-rank servers of TP=2
// (world 4), then two of TP=1 (world 2). A server list that mixes them inside one
// deployment is refused at init, naming both servers and their sizes.
TEST_F(SyncTopologyTest, DataParallelDeploymentsOfDifferentTpSizesAllMatchTrainer) {
  std::vector<Server> servers;
  for (int i = 0; i < 4; ++i) {
    const std::string tp = i < 2 ? "2" : "1", dp_rank = std::to_string(i % 2);
    E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer(fmt::format("tp{}_dp{}", tp, dp_rank),
                                                   {"--model", "qwen3-tiny", "--tp", tp, "--dp", "2", "--dp-rank",
                                                    dp_rank}));
    servers.push_back(s);
  }
  EXPECT_EQ(WorldSize(servers[0], true), 4);
  EXPECT_EQ(WorldSize(servers[2], true), 2);

  RunResult push = Push("push", servers,
                        {"--model", "qwen3-tiny", "--seed", "23", "--steps", "1", "--verify",
                         "--data-parallel-size", "2", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 2));
  EXPECT_NE((push.out + push.err).find("world 7, rank offsets [1, 1, 5, 5]"), std::string::npos)
      << push.description;
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 23, 1,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold(servers, want, DigestAlgorithm::kXxh3_128);

  RunResult mixed = Push("push_mixed", {servers[0], servers[2], servers[1], servers[3]},
                         {"--model", "qwen3-tiny", "--seed", "23", "--steps", "0", "--data-parallel-size", "2",
                          "--timeout", "60"});
  EXPECT_FALSE(mixed.success()) << mixed.description;
  EXPECT_LT(mixed.seconds, 30) << mixed.description;
  EXPECT_NE((mixed.out + mixed.err)
                .find(fmt::format("{} and {} form one deployment (data_parallel_size 2) but report world sizes 4 "
                                  "and 2",
                                  servers[0].url, servers[2].url)),
            std::string::npos)
      << mixed.description;
  // The refused push changed nothing.
  ExpectServersHold(servers, want, DigestAlgorithm::kXxh3_128);
}

}  // namespace
}  // namespace wsync::e2e
