// End-to-end syncs with shards and trainer tensors on CUDA devices (label `gpu`): real
// `wsync serve --device cuda:N` and `wsync push --device cuda:N` processes, checked bit
// for bit against digests this test computes itself. Each test says how many GPUs it
// needs and skips cleanly with fewer (CI has none; the device machine has 1 or more).
// NCCL refuses two ranks of one group on one GPU, so the NCCL tests need a GPU for the
// trainer and one per receiving worker.
#include <signal.h>

#include <fmt/format.h>

#include "cuda/device.h"
#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

class GpuNcclTest : public E2eTest {
 protected:
  void NeedGpus(int n) {
    gpus_ = cuda::DeviceCount();
    if (gpus_ < n) GTEST_SKIP() << "needs " << n << " CUDA device(s), this machine has " << gpus_;
  }
  int gpus_ = 0;
};

// A CPU trainer over Gloo into shards on the GPU: the host-to-device load path.
TEST_F(GpuNcclTest, GlooSyncFromCpuTrainerIntoShardsOnCudaIsBitExact) {
  NeedGpus(1);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("gpu", {"--model", "qwen3-tiny", "--device", "cuda:0"}));
  HttpReply health = HttpGet(s.url, "/health");
  ASSERT_EQ(health.status, 200) << health.Describe();
  EXPECT_EQ(health.json.value("device", ""), "cuda:0") << health.body;
  RunResult push = Push("push", {s}, {"--model", "qwen3-tiny", "--seed", "21", "--steps", "2",
                                      "--bucket-gb", "0.001", "--verify", "--timeout", "120"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 3));
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 21, 2, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

// `sharded` from four CPU trainer ranks (two pipeline stages, held passes) over Gloo into
// a worker on the GPU: its slices land host-to-device through LoadPiece.
TEST_F(GpuNcclTest, ShardedGlooSyncFromCpuTrainerRanksIntoShardsOnCudaIsBitExact) {
  NeedGpus(1);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("gpu_sharded", {"--backend", "sharded", "--model", "qwen3-moe-tiny",
                                                                  "--device", "cuda:0"}));
  RunResult push = Push("push", {s}, {"--backend", "sharded", "--model", "qwen3-moe-tiny", "--trainer-ranks", "4",
                                      "--trainer-layout", "tp1pp2ep2", "--seed", "24", "--steps", "2", "--verify",
                                      "--timeout", "120"});
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(push.out, 3));
  E2E_ASSERT_OK_AND_ASSIGN(Digests want,
                           ExpectedSyntheticDigests("qwen3-moe-tiny", 24, 2, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

// `sharded` over NCCL point to point: the trainer on cuda:0 sends each slice to the
// server's worker on cuda:1, which receives into device buffers and scatters on the GPU.
TEST_F(GpuNcclTest, ShardedNcclSyncFromTrainerOnCuda0IntoServerOnCuda1IsBitExact) {
  NeedGpus(2);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("gpu1_sharded", {"--backend", "sharded", "--model", "qwen3-tiny",
                                                                   "--device", "cuda:1"}));
  RunResult push = Push("push", {s}, {"--backend", "sharded", "--model", "qwen3-tiny", "--seed", "25", "--steps",
                                      "2", "--device", "cuda:0", "--verify", "--timeout", "120"});
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(push.out, 3));
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 25, 2, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

TEST_F(GpuNcclTest, ServeRefusesMoreWorkersThanDevices) {
  NeedGpus(1);
  if (IsSkipped()) return;
  RunResult r = RunWsync("serve_too_many", {"serve", "--model", "qwen3-tiny", "--tp", std::to_string(gpus_ + 1),
                                            "--device", "cuda:0", "--port", "0"}, 60);
  EXPECT_FALSE(r.success()) << r.description;
  EXPECT_NE(r.err.find("CUDA device(s)"), std::string::npos) << r.description;
}

// vLLM's GPU path: the trainer mints an NCCL unique id, the server's worker joins with it.
TEST_F(GpuNcclTest, NcclSyncFromTrainerOnCuda0IntoServerOnCuda1IsBitExact) {
  NeedGpus(2);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("gpu1", {"--model", "qwen3-tiny", "--device", "cuda:1"}));
  RunResult push = Push("push", {s}, {"--model", "qwen3-tiny", "--seed", "22", "--steps", "3",
                                      "--bucket-gb", "0.001", "--device", "cuda:0", "--verify",
                                      "--weight-version", "gpu-v3", "--timeout", "120"});
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(push.out, 4));
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 22, 3, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  EXPECT_NE(s.process->Stderr().find("nccl"), std::string::npos) << s.process->Describe();
  ExpectCleanShutdown(s);
}

// In-line verification of a trainer on the GPU: the packer digests each chunk on the
// device (small tensors whole, the embedding and the MLP weights by row ranges) and the
// server checks every tensor; no read-back on the trainer.
TEST_F(GpuNcclTest, TrainerOnCuda0DigestsOnTheDeviceAndEveryTensorIsVerifiedInLine) {
  NeedGpus(2);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("inline", {"--model", "qwen3-0.6b", "--device", "cuda:1"}));
  RunResult push = Push("push", {s}, {"--model", "qwen3-0.6b", "--seed", "25", "--steps", "2", "--device", "cuda:0",
                                      "--timeout", "300"}, 400);
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  EXPECT_EQ(InlineCells(push.out), std::vector<std::string>(3, fmt::format("1/1:{}", TensorCount("qwen3-0.6b"))))
      << push.out;
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-0.6b", 25, 2, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

// A server whose GPU landing of the embedding is one bit off: the device digests of a GPU
// trainer catch it, the finish is refused naming the tensor, and the old version stays.
TEST_F(GpuNcclTest, CorruptGpuLandingIsCaughtByTheTrainersDeviceDigests) {
  NeedGpus(2);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("bad", {"--model", "qwen3-0.6b", "--device", "cuda:1",
                                                         "--fault", "corrupt-landed"}));
  RunResult push = Push("push", {s}, {"--model", "qwen3-0.6b", "--seed", "26", "--device", "cuda:0",
                                      "--weight-version", "v1", "--timeout", "300"}, 400);
  ExpectRefusedInLine(push, s, "model.embed_tokens.weight");
  ExpectCleanShutdown(s);
}

TEST_F(GpuNcclTest, NcclSyncIntoTp2ServerOnCuda1And2IsBitExact) {
  NeedGpus(3);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("tp2", {"--model", "qwen3-tiny", "--tp", "2", "--device", "cuda:1"}));
  RunResult push = Push("push", {s}, {"--model", "qwen3-tiny", "--seed", "23", "--steps", "2",
                                      "--device", "cuda:0", "--verify", "--timeout", "120"});
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 23, 2, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

// A server process dies in the middle of an NCCL sync (a real SIGKILL after one chunk):
// the trainer must fail within its --timeout naming that server, and a fresh server on
// the same GPU (and, with 3 GPUs, the surviving server) must take the next session.
TEST_F(GpuNcclTest, ServerKilledMidNcclSyncFailsPushWithinItsTimeoutAndTheNextSessionSyncs) {
  NeedGpus(2);
  if (IsSkipped()) return;
  const bool survivor = gpus_ >= 3;
  std::vector<Server> servers;
  if (survivor) {
    E2E_ASSERT_OK_AND_ASSIGN(Server healthy, StartServer("healthy", {"--model", "qwen3-tiny", "--device", "cuda:2",
                                                                     "--timeout", "30"}));
    servers.push_back(healthy);
  }
  E2E_ASSERT_OK_AND_ASSIGN(Server dying, StartServer("dying", {"--model", "qwen3-tiny", "--device", "cuda:1",
                                                             "--fault", "die-mid-update", "--timeout", "30"}));
  servers.push_back(dying);
  RunResult push = Push("push_fault", servers, {"--model", "qwen3-tiny", "--seed", "3", "--bucket-gb", "0.0005",
                                                "--device", "cuda:0", "--timeout", "15"}, 90);
  EXPECT_FALSE(push.timed_out) << push.description;
  EXPECT_TRUE(push.exit.exited) << "push must exit, not die: " << push.description;
  EXPECT_NE(push.exit.code, 0) << push.description;
  EXPECT_LE(push.seconds, 15.0 + 15.0) << push.description;
  EXPECT_NE(push.err.find(dying.url), std::string::npos) << push.description;
  std::optional<ExitStatus> died = dying.process->Wait(Deadline::InSeconds(10));
  ASSERT_TRUE(died.has_value()) << "the faulty server must have killed itself";
  EXPECT_EQ(died->signal, SIGKILL) << died->ToString();

  std::vector<Server> next;
  if (survivor) {
    EXPECT_TRUE(servers[0].process->Running()) << servers[0].process->Describe();
    next.push_back(servers[0]);
  }
  E2E_ASSERT_OK_AND_ASSIGN(Server fresh, StartServer("fresh", {"--model", "qwen3-tiny", "--device", "cuda:1"}));
  next.push_back(fresh);
  RunResult retry = Push("push_next", next, {"--model", "qwen3-tiny", "--seed", "6", "--steps", "1",
                                             "--device", "cuda:0", "--verify", "--timeout", "120"});
  ASSERT_TRUE(retry.success()) << retry.description;
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 6, 1, DigestAlgorithm::kXxh3_128));
  ExpectServersHold(next, want, DigestAlgorithm::kXxh3_128);
}

}  // namespace
}  // namespace wsync::e2e
