// In-line verification end to end: real `wsync serve` processes on loopback and `wsync
// push`, whose per-sync table reports how many servers verified every tensor in-line
// ("inline" column: verified servers / servers : tensors). A server started with `--fault
// corrupt-landed` lands one tensor with one bit flipped: its finish must be
// refused naming the tensor, /health must report weights_consistent false and the old
// weight version, and /metrics must count the failure. A server that does not declare
// in-line verification (fp8: it holds other bytes than it received) gets no digests and
// the push still succeeds, unverified.
#include <algorithm>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/parallel.h"
#include "e2e_test_base.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "synthetic/synthetic.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;

class InlineVerifyTest : public E2eTest {
 protected:
  // One TP=2 server of `backend` and one trainer rank: the push's three syncs (the full
  // one and two steps) are each verified in-line on every tensor.
  void ExpectOneServerVerifiesEverySync(const std::string& backend, const std::string& seed) {
    E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("s", {"--model", "qwen3-tiny", "--backend", backend, "--tp", "2"}));
    RunResult push = Push("push", {s}, {"--backend", backend, "--model", "qwen3-tiny", "--seed", seed, "--steps", "2",
                                        "--timeout", "60"});
    ASSERT_TRUE(push.success()) << push.description;
    EXPECT_EQ(InlineCells(push.out), std::vector<std::string>(3, fmt::format("1/1:{}", TensorCount("qwen3-tiny"))))
        << push.out;
  }
};

TEST_F(InlineVerifyTest, NcclTwoServersVerifyEveryTensorEverySync) {
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartServer("a", {"--model", "qwen3-tiny"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server b, StartServer("b", {"--model", "qwen3-tiny", "--tp", "2"}));
  HttpReply h = HttpGet(a.url, "/health");
  ASSERT_EQ(h.json.value("inline_verification", ""), "xxh3_128") << h.Describe();
  RunResult push = Push("push", {a, b}, {"--model", "qwen3-tiny", "--seed", "5", "--steps", "2", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  const std::string all = fmt::format("2/2:{}", TensorCount("qwen3-tiny"));
  EXPECT_EQ(InlineCells(push.out), std::vector<std::string>(3, all)) << push.out;
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 5, 2, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({a, b}, want, DigestAlgorithm::kXxh3_128);

  RunResult off = Push("off", {a, b}, {"--model", "qwen3-tiny", "--seed", "5", "--no-inline-verify"});
  ASSERT_TRUE(off.success()) << off.description;
  EXPECT_EQ(InlineCells(off.out), std::vector<std::string>(1, "off")) << off.out;
}

TEST_F(InlineVerifyTest, IpcVerifiesEveryTensor) { ExpectOneServerVerifiesEverySync("ipc", "6"); }

// A Megatron layout: each trainer rank holds part of the model; rank 0's finish carries
// every rank's digests, so every tensor is verified.
TEST_F(InlineVerifyTest, ShardedMegatronLayoutVerifiesEveryRanksTensors) {
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartServer("a", {"--model", "qwen3-tiny", "--backend", "sharded", "--tp", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server b, StartServer("b", {"--model", "qwen3-tiny", "--backend", "sharded"}));
  RunResult push = Push("push", {a, b}, {"--backend", "sharded", "--model", "qwen3-tiny", "--seed", "7",
                                         "--trainer-ranks", "4", "--trainer-layout", "tp2pp2ep1", "--steps", "2",
                                         "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_EQ(InlineCells(push.out), std::vector<std::string>(3, fmt::format("2/2:{}", TensorCount("qwen3-tiny"))))
      << push.out;
}

// One trainer rank: its packer hashes every tensor after packing it, as each of several
// ranks hashes its share.
TEST_F(InlineVerifyTest, ShardedOneTrainerRankVerifiesEveryTensor) { ExpectOneServerVerifiesEverySync("sharded", "9"); }

// FSDP ranks each read every tensor (an all-gather apiece), so each tensor of at least
// 1 MiB is hashed by row ranges, one per rank (wsync_split_digests): servers of either TP
// size verify every tensor, and a corrupt landing of the split embedding is refused
// naming it and showing its four range digests.
TEST_F(InlineVerifyTest, ShardedFsdpRanksShareEachLargeTensorsHashingByRows) {
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartServer("a", {"--model", "qwen3-tiny", "--backend", "sharded", "--tp", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server b, StartServer("b", {"--model", "qwen3-tiny", "--backend", "sharded"}));
  const std::vector<std::string> fsdp = {"--backend", "sharded", "--model", "qwen3-tiny", "--seed", "11",
                                         "--trainer-ranks", "4", "--trainer-layout", "fsdp", "--timeout", "60"};
  std::vector<std::string> steps = fsdp;
  steps.insert(steps.end(), {"--steps", "2"});
  RunResult push = Push("push", {a, b}, steps);
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_EQ(InlineCells(push.out), std::vector<std::string>(3, fmt::format("2/2:{}", TensorCount("qwen3-tiny"))))
      << push.out;

  E2E_ASSERT_OK_AND_ASSIGN(Server bad, StartServer("bad", {"--model", "qwen3-tiny", "--backend", "sharded", "--tp",
                                                           "2", "--fault", "corrupt-landed"}));
  RunResult refused = Push("refused", {bad}, fsdp);
  ASSERT_FALSE(refused.success()) << refused.description;
  const std::string& err = refused.err;
  const size_t at = err.find("model.embed_tokens.weight (");
  ASSERT_NE(at, std::string::npos) << refused.description;
  const size_t holds = err.find(" holds ", at), read = err.find(", the trainer read", at);
  ASSERT_TRUE(holds != std::string::npos && read != std::string::npos && holds < read) << err;
  EXPECT_EQ(std::count(err.begin() + holds, err.begin() + read, ','), 3) << err;
  EXPECT_EQ(HttpGet(bad.url, "/health").json.value("weights_consistent", true), false);
}

TEST_F(InlineVerifyTest, DeltaVerifiesChangedAndUnchangedTensors) {
  const std::string model = "qwen3-tiny";
  const uint64_t seed = 8;
  E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel(model));
  E2E_ASSERT_OK_AND_ASSIGN(auto trainer, SyntheticTrainer::FromMetadata(HfTensors(config), seed, DefaultThreads()));
  std::vector<TensorRef> refs;
  for (const HostTensor& t : trainer->tensors()) refs.push_back(t.ref());
  const std::filesystem::path base = dir() / "base", root = dir() / "shared";
  std::filesystem::create_directories(base);
  std::filesystem::create_directories(root);
  ASSERT_TRUE(WriteSafetensors((base / "model.safetensors").string(), refs).ok());
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("s", {"--model", model, "--backend", "delta", "--base-checkpoint",
                                                       base.string(), "--sync-root", root.string()}));
  // Each step changes a fraction of the tensors; the rest are verified from what the
  // server holds all the same.
  RunResult push = RunWsync("push", {"push", "--servers", s.url, "--backend", "delta", "--sync-dir",
                                     (root / "sync").string(), "--model", model, "--seed", std::to_string(seed),
                                     "--steps", "2", "--timeout", "60"},
                            180);
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_EQ(InlineCells(push.out), std::vector<std::string>(3, fmt::format("1/1:{}", TensorCount(model))))
      << push.out;
}

TEST_F(InlineVerifyTest, CorruptLandingIsRefusedAtFinishAndKeepsTheOldVersion) {
  E2E_ASSERT_OK_AND_ASSIGN(Server good, StartServer("good", {"--model", "qwen3-tiny"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server bad, StartServer("bad", {"--model", "qwen3-tiny", "--fault", "corrupt-landed"}));
  RunResult push = Push("push", {good, bad}, {"--model", "qwen3-tiny", "--seed", "3", "--weight-version", "v1",
                                              "--timeout", "60"});
  ASSERT_FALSE(push.success()) << push.description;
  EXPECT_NE(push.err.find("model.embed_tokens.weight"), std::string::npos) << push.description;
  EXPECT_NE(push.err.find("in-line verification"), std::string::npos) << push.description;
  EXPECT_NE(push.err.find(bad.url), std::string::npos) << push.description;
  HttpReply h = HttpGet(bad.url, "/health");
  EXPECT_EQ(h.json.value("weights_consistent", true), false) << h.Describe();
  EXPECT_EQ(h.json.value("weight_version", ""), "default") << h.Describe();
  EXPECT_EQ(h.json.value("session_active", true), false) << h.Describe();
  HttpReply g = HttpGet(good.url, "/health");
  EXPECT_EQ(g.json.value("weight_version", ""), "v1") << g.Describe();
  HttpReply m = HttpGet(bad.url, "/metrics");
  EXPECT_NE(m.body.find("wsync_verification_failures_total{backend=\"nccl\",check=\"inline\",model=\"qwen3-tiny\"} 1"),
            std::string::npos) << m.body;

  // Without in-line verification the same corruption goes unseen by the sync.
  RunResult off = Push("off", {bad}, {"--model", "qwen3-tiny", "--seed", "3", "--no-inline-verify"});
  EXPECT_TRUE(off.success()) << off.description;
}

TEST_F(InlineVerifyTest, ServerThatDoesNotDeclareGetsNoDigests) {
  E2E_ASSERT_OK_AND_ASSIGN(Server plain, StartServer("plain", {"--model", "qwen3-tiny"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server fp8, StartServer("fp8", {"--model", "qwen3-tiny", "--quantization", "fp8"}));
  HttpReply h = HttpGet(fp8.url, "/health");
  ASSERT_TRUE(h.json.contains("inline_verification") && h.json["inline_verification"].is_null()) << h.Describe();
  RunResult push = Push("push", {plain, fp8}, {"--model", "qwen3-tiny", "--seed", "4", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_EQ(InlineCells(push.out), std::vector<std::string>(1, fmt::format("1/2:{}", TensorCount("qwen3-tiny"))))
      << push.out;
}

}  // namespace
}  // namespace wsync::e2e
