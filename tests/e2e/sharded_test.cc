// End-to-end syncs over the `sharded` backend: real `wsync serve --backend sharded`
// processes, trainers from `wsync push --backend sharded --trainer-ranks N` (or the
// library, for a degraded sync), every sync checked bit for bit against digests the test
// computes itself on every server.
#include <signal.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "core/parallel.h"
#include "core/stopwatch.h"
#include "e2e_test_base.h"
#include "model/config.h"
#include "synthetic/synthetic.h"
#include "wsync/trainer.h"

namespace wsync::e2e {
namespace {

class ShardedTest : public E2eTest {
 protected:
  Result<Server> Sharded(const std::string& name, const std::string& model, std::vector<std::string> more = {}) {
    std::vector<std::string> args = {"--backend", "sharded", "--model", model};
    args.insert(args.end(), more.begin(), more.end());
    return StartServer(name, args);
  }

  // A server on a port of our choosing (a restarted server keeps its URL).
  Result<Server> ShardedOnPort(const std::string& name, const std::string& url, const std::string& model,
                               const std::string& tp) {
    const std::string port = url.substr(url.rfind(':') + 1);
    std::filesystem::path ready = dir() / (name + ".url");
    WSYNC_ASSIGN_OR_RETURN(Subprocess * p, SpawnWsync(name, {"serve", "--host", "127.0.0.1", "--port", port,
                                                             "--ready-file", ready.string(), "--backend", "sharded",
                                                             "--model", model, "--tp", tp}));
    Deadline deadline = Deadline::InSeconds(60);
    while (!deadline.expired()) {
      if (!p->Running()) return Unavailable(fmt::format("{} exited:\n{}", name, p->Describe()));
      if (std::filesystem::exists(ready) && HttpGet(url, "/health", "", 5).status == 200) {
        return Server{name, url, p};
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return DeadlineExceeded(fmt::format("{} did not come up at {}", name, url));
  }
};

TEST_F(ShardedTest, MoeFromTp2Pp2Ep2TrainerIntoTwoTp2Servers) {
  E2E_ASSERT_OK_AND_ASSIGN(Server a, Sharded("a", "qwen3-moe-tiny", {"--tp", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server b, Sharded("b", "qwen3-moe-tiny", {"--tp", "2"}));
  RunResult push = Push("push", {a, b},
                        {"--backend", "sharded", "--model", "qwen3-moe-tiny", "--trainer-ranks", "8",
                         "--trainer-layout", "tp2pp2ep2", "--seed", "17", "--steps", "2", "--verify",
                         "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 3));
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-moe-tiny", 17, 2,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold({a, b}, want, DigestAlgorithm::kXxh3_128);
}

// Pipeline stages send concurrently (each worker receives from every rank at once) or
// take turns (plan order); both land the same bits, for two and four stages.
TEST_F(ShardedTest, PipelineStagesConcurrentOrInTurnFromTp2Pp2AndPp4Trainers) {
  E2E_ASSERT_OK_AND_ASSIGN(Server a, Sharded("a", "qwen3-tiny", {"--tp", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server b, Sharded("b", "qwen3-tiny", {"--tp", "2"}));
  int seed = 30;
  for (const char* layout : {"tp2pp2ep1", "tp1pp4ep1"}) {
    for (const char* concurrent : {"on", "off"}) {
      ++seed;
      RunResult push = Push(fmt::format("push-{}-{}", layout, concurrent), {a, b},
                            {"--backend", "sharded", "--model", "qwen3-tiny", "--trainer-ranks", "4",
                             "--trainer-layout", layout, "--backend-option",
                             fmt::format("concurrent_stages={}", concurrent), "--seed", std::to_string(seed),
                             "--steps", "2", "--verify", "--timeout", "60"});
      ASSERT_TRUE(push.success()) << layout << " concurrent_stages=" << concurrent << ": " << push.description;
      EXPECT_TRUE(HasVerifiedTable(push.out, 3));
      E2E_ASSERT_OK_AND_ASSIGN(Digests want,
                               ExpectedSyntheticDigests("qwen3-tiny", seed, 2, DigestAlgorithm::kXxh3_128));
      ExpectServersHold({a, b}, want, DigestAlgorithm::kXxh3_128);
    }
  }
}

TEST_F(ShardedTest, DenseFromThreeFsdpRanksIntoHeterogeneousTp2AndTp1Servers) {
  E2E_ASSERT_OK_AND_ASSIGN(Server prefill, Sharded("prefill", "qwen3-tiny", {"--tp", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server decode, Sharded("decode", "qwen3-tiny", {"--tp", "1"}));
  RunResult push = Push("push", {prefill, decode},
                        {"--backend", "sharded", "--model", "qwen3-tiny", "--trainer-ranks", "3",
                         "--trainer-layout", "fsdp", "--seed", "5", "--steps", "1", "--verify", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 2));
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 5, 1, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({prefill, decode}, want, DigestAlgorithm::kXxh3_128);
}

TEST_F(ShardedTest, FourServersWithDataParallelSize2) {
  std::vector<Server> servers;
  for (int i = 0; i < 4; ++i) {
    E2E_ASSERT_OK_AND_ASSIGN(Server s, Sharded(fmt::format("dep{}_dp{}", i / 2, i % 2), "qwen3-tiny",
                                               {"--tp", "2", "--dp", "2", "--dp-rank", std::to_string(i % 2)}));
    servers.push_back(s);
  }
  RunResult push = Push("push", servers,
                        {"--backend", "sharded", "--model", "qwen3-tiny", "--trainer-ranks", "2",
                         "--data-parallel-size", "2", "--seed", "23", "--steps", "1", "--verify", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 2));
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 23, 1, DigestAlgorithm::kXxh3_128));
  ExpectServersHold(servers, want, DigestAlgorithm::kXxh3_128);
}

TEST_F(ShardedTest, ProducerThatNeverSendsFailsTheSyncWithinTheTimeoutNamingIt) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, Sharded("s", "qwen3-tiny", {"--tp", "2"}));
  Stopwatch watch;
  // Two pipeline stages: each rank alone holds its stage, so every worker needs rank 1.
  RunResult push = Push("push", {s},
                        {"--backend", "sharded", "--model", "qwen3-tiny", "--trainer-ranks", "2",
                         "--trainer-layout", "tp1pp2ep1", "--backend-option", "stall_rank=1", "--timeout", "8"});
  const double seconds = watch.seconds();
  ASSERT_FALSE(push.success()) << push.description;
  const std::string text = push.out + push.err;
  EXPECT_NE(text.find("trainer rank 1"), std::string::npos) << text;
  EXPECT_NE(text.find("group"), std::string::npos) << text;
  EXPECT_LT(seconds, 40) << "the stall must end at the timeout, not hang:\n" << text;
  // The server ends the failed session and takes the next trainer's sync.
  RunResult again = Push("again", {s}, {"--backend", "sharded", "--model", "qwen3-tiny", "--seed", "2", "--verify",
                                        "--timeout", "60"});
  ASSERT_TRUE(again.success()) << again.description;
}

TEST_F(ShardedTest, AServerThatRefusesInitEndsEveryRanksInitAtOnce) {
  // The server holds another model: its plans cannot match the trainer's.
  E2E_ASSERT_OK_AND_ASSIGN(Server s, Sharded("s", "qwen3-moe-tiny", {"--tp", "2"}));
  Stopwatch watch;
  RunResult push = Push("push", {s}, {"--backend", "sharded", "--model", "qwen3-tiny", "--trainer-ranks", "4",
                                      "--trainer-layout", "tp1pp2ep1", "--timeout", "120"});
  const double seconds = watch.seconds();
  ASSERT_FALSE(push.success()) << push.description;
  EXPECT_NE(push.err.find(s.url), std::string::npos) << push.description;
  EXPECT_LT(seconds, 60) << "ranks 1..3 must not wait out the 120 s connect deadline:\n" << push.description;
}

TEST_F(ShardedTest, DegradedSyncToLiveServersThenTheFleetRestored) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s0, Sharded("s0", "qwen3-tiny", {"--tp", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server s1, Sharded("s1", "qwen3-tiny", {"--tp", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server s2, Sharded("s2", "qwen3-tiny", {"--tp", "1"}));
  E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel("qwen3-tiny"));
  E2E_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SyntheticTrainer> trainer,
                           SyntheticTrainer::FromMetadata(HfTensors(config), 31, DefaultThreads()));
  TrainerOptions o;
  o.backend = "sharded";
  o.servers = {s0.url, s1.url, s2.url};
  o.backend_options["model"] = "qwen3-tiny";
  o.timeout_seconds = 30;
  E2E_ASSERT_OK_AND_ASSIGN(std::unique_ptr<TrainerEngine> engine, CreateTrainerEngine(o));
  ASSERT_OK(engine->Init(trainer->source()));
  ASSERT_OK(engine->SendWeights(trainer->source(), "v0").status());
  E2E_ASSERT_OK_AND_ASSIGN(Digests v0, ExpectedSyntheticDigests("qwen3-tiny", 31, 0, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s0, s1, s2}, v0, DigestAlgorithm::kXxh3_128);

  // Server 1 dies; the next sync goes to the two that live, with the fleet's plan.
  s1.process->Signal(SIGKILL);
  ASSERT_TRUE(s1.process->Wait(Deadline::InSeconds(10)).has_value());
  ASSERT_TRUE(trainer->Step(1).ok());
  Result<SyncStats> degraded = engine->SendWeightsTo(trainer->source(), "v1", {0, 2});
  ASSERT_OK(degraded.status());
  E2E_ASSERT_OK_AND_ASSIGN(Digests v1, ExpectedSyntheticDigests("qwen3-tiny", 31, 1, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s0, s2}, v1, DigestAlgorithm::kXxh3_128);
  EXPECT_EQ(HttpGet(s2.url, "/weight_info").json.value("weight_version", ""), "v1");

  // A sync to every server while one is down fails, naming it.
  Result<SyncStats> all_while_down = engine->SendWeights(trainer->source(), "v1");
  ASSERT_FALSE(all_while_down.ok());
  EXPECT_NE(all_while_down.status().message().find(s1.url), std::string::npos) << all_while_down.status().ToString();

  // Server 1 comes back at its URL; a sync to every server restores the whole fleet.
  E2E_ASSERT_OK_AND_ASSIGN(Server back, ShardedOnPort("s1_back", s1.url, "qwen3-tiny", "2"));
  ASSERT_TRUE(trainer->Step(2).ok());
  ASSERT_OK(engine->SendWeights(trainer->source(), "v2").status());
  E2E_ASSERT_OK_AND_ASSIGN(Digests v2, ExpectedSyntheticDigests("qwen3-tiny", 31, 2, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s0, back, s2}, v2, DigestAlgorithm::kXxh3_128);
  engine->Shutdown();
}

}  // namespace
}  // namespace wsync::e2e
