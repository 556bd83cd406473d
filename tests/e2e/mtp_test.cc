// `wsync serve --speculative mtp` end to end: real servers and `wsync push` over nccl,
// ipc, delta and sharded. The MTP drafter's own layers are reloaded from the same stream
// in the same session by every backend (its /weight_checker digests equal the trainer's,
// computed here); its embed_tokens and head are the target's memory (the same address,
// and a server's weight bytes grow by the drafter's own layers only). A server without a
// drafter checks and drops the MTP tensors; a draft session carries the drafter alone; a
// drafter layer an update leaves incomplete fails the finish, naming the layer.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>

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
namespace fs = std::filesystem;

constexpr DigestAlgorithm kAlg = DigestAlgorithm::kXxh3_128;
constexpr const char* kModel = "deepseek-v3-tiny";  // layers 0-2, MTP layer 3

// The drafter's tensors by name, restated for the test: the layers past the target's.
bool IsMtp(const std::string& name) { return name.starts_with("model.layers.3."); }

class MtpTest : public E2eTest {
 protected:
  json Health(const Server& s) {
    HttpReply r = HttpGet(s.url, "/health");
    EXPECT_EQ(r.status, 200) << r.Describe();
    return r.json;
  }

  // The trainer's digests after `push --seed SEED --steps STEPS`, and those a server
  // without a drafter holds (the MTP layer's dropped).
  static Digests Want(uint64_t seed, int steps, bool drafter) {
    Result<Digests> all = ExpectedSyntheticDigests(kModel, seed, steps, kAlg);
    EXPECT_TRUE(all.ok()) << all.status().ToString();
    Digests out = std::move(all).value();
    if (!drafter) std::erase_if(out, [](const auto& kv) { return IsMtp(kv.first); });
    return out;
  }

  // The drafter was reloaded whole by the last sync, at `version`, and reads the
  // target's embed_tokens / lm_head memory.
  void ExpectFreshDrafter(const Server& s, const std::string& version) {
    const json spec = Health(s)["speculative"];
    ASSERT_TRUE(spec.is_object()) << spec.dump();
    EXPECT_EQ(spec["method"], "mtp");
    EXPECT_EQ(spec["layers"], json::array({3}));
    EXPECT_EQ(spec["weight_version"], version) << spec.dump();
    EXPECT_EQ(spec["stale"], false) << spec.dump();
    ASSERT_EQ(spec["shared_with_target"].size(), 2u) << spec.dump();
    for (const json& a : spec["shared_with_target"]) EXPECT_EQ(a["same_memory"], true) << a.dump();
    EXPECT_EQ(spec["shared_with_target"][0]["target"], "model.embed_tokens.weight");
    EXPECT_EQ(spec["shared_with_target"][1]["target"], "lm_head.weight");
  }
};

TEST_F(MtpTest, DrafterReloadsFromTheSameSyncOverNcclIpcDeltaAndSharded) {
  {  // nccl: a drafter server at tp 2 beside a plain one at tp 1, in one deployment list.
    SCOPED_TRACE("nccl");
    E2E_ASSERT_OK_AND_ASSIGN(Server mtp, StartServer("nccl-mtp", {"--model", kModel, "--tp", "2", "--speculative",
                                                                  "mtp"}));
    E2E_ASSERT_OK_AND_ASSIGN(Server plain, StartServer("nccl-plain", {"--model", kModel}));
    EXPECT_TRUE(Health(plain)["speculative"].is_null());
    // Before any sync the drafter holds start-up weights, not a trainer's.
    EXPECT_TRUE(Health(mtp)["speculative"]["weight_version"].is_null());
    EXPECT_EQ(Health(mtp)["speculative"]["stale"], true);
    RunResult push = Push("push-nccl", {mtp, plain},
                          {"--model", kModel, "--seed", "31", "--steps", "2", "--verify", "--weight-version", "s2"});
    ASSERT_TRUE(push.success()) << push.description;
    EXPECT_TRUE(HasVerifiedTable(push.out, 3)) << push.out;
    ExpectServersHold({mtp}, Want(31, 2, true), kAlg);
    ExpectServersHold({plain}, Want(31, 2, false), kAlg);
    ExpectFreshDrafter(mtp, "s2");
    EXPECT_EQ(Health(mtp)["speculative"]["reloads"], 3);  // the starting weights and two steps
  }
  {  // ipc
    SCOPED_TRACE("ipc");
    E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("ipc", {"--model", kModel, "--backend", "ipc", "--speculative",
                                                           "mtp"}));
    RunResult push = RunWsync("push-ipc", {"push", "--servers", s.url, "--backend", "ipc", "--model", kModel,
                                           "--seed", "32", "--steps", "2", "--weight-version", "i2"},
                              120);
    ASSERT_TRUE(push.success()) << push.description;
    ExpectServersHold({s}, Want(32, 2, true), kAlg);
    ExpectFreshDrafter(s, "i2");
  }
  {  // delta: the reload from the local checkpoint fills the drafter in the same pass.
    SCOPED_TRACE("delta");
    const fs::path base = dir() / "base", root = dir() / "shared";
    fs::create_directories(base);
    fs::create_directories(root);
    E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel(kModel));
    auto trainer = SyntheticTrainer::FromMetadata(HfTensors(config), 33, DefaultThreads());
    ASSERT_TRUE(trainer.ok());
    std::vector<TensorRef> refs;
    for (const HostTensor& t : (*trainer)->tensors()) refs.push_back(t.ref());
    ASSERT_TRUE(WriteSafetensors((base / "model.safetensors").string(), refs).ok());
    E2E_ASSERT_OK_AND_ASSIGN(
        Server s, StartServer("delta", {"--model", kModel, "--backend", "delta", "--base-checkpoint", base.string(),
                                        "--sync-root", root.string(), "--local-checkpoint-dir",
                                        (dir() / "local").string(), "--speculative", "mtp"}));
    RunResult push = RunWsync("push-delta", {"push", "--servers", s.url, "--backend", "delta", "--sync-dir",
                                             (root / "sync").string(), "--model", kModel, "--seed", "33", "--steps",
                                             "2", "--timeout", "120", "--weight-version", "d2"},
                              300);
    ASSERT_TRUE(push.success()) << push.description;
    ExpectServersHold({s}, Want(33, 2, true), kAlg);
    ExpectFreshDrafter(s, "d2");
  }
  {  // sharded: the plan routes the drafter's slices to drafter servers only.
    SCOPED_TRACE("sharded");
    E2E_ASSERT_OK_AND_ASSIGN(Server mtp, StartServer("sharded-mtp", {"--model", kModel, "--tp", "2", "--backend",
                                                                     "sharded", "--speculative", "mtp"}));
    E2E_ASSERT_OK_AND_ASSIGN(Server plain, StartServer("sharded-plain", {"--model", kModel, "--backend", "sharded"}));
    RunResult push = Push("push-sharded", {mtp, plain},
                          {"--backend", "sharded", "--model", kModel, "--seed", "34", "--steps", "2", "--verify",
                           "--weight-version", "p2", "--timeout", "60"});
    ASSERT_TRUE(push.success()) << push.description;
    ExpectServersHold({mtp}, Want(34, 2, true), kAlg);
    ExpectServersHold({plain}, Want(34, 2, false), kAlg);
    ExpectFreshDrafter(mtp, "p2");
  }
}

// An fp8 drafter: its decoder layer is quantized as it lands, like the target's; eh_proj
// (a plain linear in vLLM's MTP layer) and the norms stay bf16. push --verify quantizes
// the trainer's bf16 tensors to the servers' convention and compares every digest.
TEST_F(MtpTest, Fp8DrafterLayersAreQuantizedAsTheyLand) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("fp8", {"--model", "glm4-moe-tiny", "--quantization", "fp8",
                                                         "--speculative", "mtp"}));
  RunResult push = Push("push", {s}, {"--model", "glm4-moe-tiny", "--seed", "35", "--steps", "2", "--verify",
                                      "--weight-version", "f2"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 3)) << push.out;
  E2E_ASSERT_OK_AND_ASSIGN(Digests sums, ServerChecksums(s.url, kAlg));
  for (const char* quantized : {"model.layers.3.mlp.experts.0.up_proj.weight", "model.layers.3.self_attn.q_proj.weight",
                                "model.layers.3.mlp.shared_experts.down_proj.weight"}) {
    EXPECT_TRUE(sums.contains(std::string(quantized) + "_scale_inv")) << quantized;
  }
  EXPECT_TRUE(sums.contains("model.layers.3.eh_proj.weight"));
  EXPECT_FALSE(sums.contains("model.layers.3.eh_proj.weight_scale_inv"));
  EXPECT_EQ(Health(s)["speculative"]["weight_version"], "f2");
}

// No second copy of embed_tokens / lm_head: a drafter server's weights exceed a plain
// one's by exactly the MTP layer's own tensors (tp 1: each held once).
TEST_F(MtpTest, DrafterCostsItsOwnLayersOnly) {
  E2E_ASSERT_OK_AND_ASSIGN(Server mtp, StartServer("mtp", {"--model", kModel, "--speculative", "mtp"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server plain, StartServer("plain", {"--model", kModel}));
  E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel(kModel));
  int64_t own = 0, vocab_matrix = 0;
  for (const TensorMeta& m : HfTensors(config)) {
    if (IsMtp(m.name)) own += static_cast<int64_t>(m.nbytes());
    if (m.name == "lm_head.weight") vocab_matrix = static_cast<int64_t>(m.nbytes());
  }
  const int64_t grown = Health(mtp)["memory"]["weights_bytes"].get<int64_t>() -
                        Health(plain)["memory"]["weights_bytes"].get<int64_t>();
  EXPECT_EQ(grown, own);
  EXPECT_EQ(Health(mtp)["speculative"]["own_bytes"], own);
  EXPECT_GT(vocab_matrix, own / 8);  // a copy of embed_tokens or lm_head would show
  // The plain server's checksum reply says which tensors it drops.
  HttpReply r = HttpPostJson(plain.url, "/weight_checker", json{{"action", "checksum"}, {"algorithm", "xxh3_128"}});
  ASSERT_EQ(r.status, 200) << r.Describe();
  size_t mtp_tensors = 0;
  for (const TensorMeta& m : HfTensors(config)) mtp_tensors += IsMtp(m.name) ? 1 : 0;
  ASSERT_EQ(r.json["not_held"].size(), mtp_tensors) << r.Describe();
  for (const json& n : r.json["not_held"]) EXPECT_TRUE(IsMtp(n.get<std::string>())) << n;
}

TEST_F(MtpTest, DraftSessionsCarryTheDrafterAlone) {
  E2E_ASSERT_OK_AND_ASSIGN(Server plain, StartServer("plain", {"--model", kModel}));
  HttpReply no = HttpPost(plain.url, "/start_draft_weight_update", "");
  EXPECT_EQ(no.status, 400) << no.Describe();
  EXPECT_NE(no.body.find("this server has no draft model (start it with --speculative mtp)"), std::string::npos)
      << no.Describe();

  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("mtp", {"--model", kModel, "--speculative", "mtp"}));
  // A trainer sending its drafter tensors in a second session (SkyRL's draft session).
  E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel(kModel));
  auto trainer = SyntheticTrainer::FromMetadata(HfTensors(config), 41, DefaultThreads());
  ASSERT_TRUE(trainer.ok());
  ASSERT_TRUE((*trainer)->Step(1).ok());
  // A target tensor in a draft session is refused before any byte moves, naming it.
  HttpReply start = HttpPost(s.url, "/start_draft_weight_update", "");
  ASSERT_EQ(start.status, 200) << start.Describe();
  json info{{"names", {"model.layers.3.eh_proj.weight", "model.norm.weight"}},
            {"dtype_names", {"bfloat16", "bfloat16"}},
            {"shapes", {{256, 512}, {256}}}};
  HttpReply bad = HttpPostJson(s.url, "/update_weights", json{{"update_info", info}});
  EXPECT_EQ(bad.status, 400) << bad.Describe();
  EXPECT_NE(bad.body.find("draft session: tensor model.norm.weight (update_info entry 1) is not one of the MTP "
                          "drafter's"),
            std::string::npos)
      << bad.Describe();
  // A refused update ends the session; finishing a draft session that did not reload the
  // drafter is an error.
  ASSERT_EQ(HttpPost(s.url, "/start_draft_weight_update", "").status, 200);
  HttpReply fin = HttpPost(s.url, "/finish_weight_update", "");
  EXPECT_EQ(fin.status, 409) << fin.Describe();
  EXPECT_NE(fin.body.find("draft session: finish_weight_update before every MTP drafter layer landed"),
            std::string::npos)
      << fin.Describe();

  // A trainer that sends the target and the drafter apart: a target-only sync leaves the
  // drafter stale; a draft session of the MTP tensors alone reloads it and leaves the
  // target's weight version as it is.
  const auto write = [&](const std::string& name, bool mtp) {
    const fs::path d = dir() / name;
    fs::create_directories(d);
    std::vector<TensorRef> refs;
    for (const HostTensor& t : (*trainer)->tensors()) {
      if (IsMtp(t.meta.name) == mtp) refs.push_back(t.ref());
    }
    EXPECT_TRUE(WriteSafetensors((d / "model.safetensors").string(), refs).ok());
    return d.string();
  };
  RunResult target = Push("push-target", {s}, {"--checkpoint", write("target", false), "--steps", "0",
                                               "--weight-version", "v1"});
  ASSERT_TRUE(target.success()) << target.description;
  EXPECT_EQ(Health(s)["speculative"]["stale"], true);
  RunResult draft = Push("push-draft", {s}, {"--checkpoint", write("drafter", true), "--steps", "0",
                                             "--weight-version", "v1", "--draft-session"});
  ASSERT_TRUE(draft.success()) << draft.description;
  ExpectFreshDrafter(s, "v1");
  EXPECT_EQ(Health(s)["weight_version"], "v1");
  EXPECT_EQ(Health(s)["weights_consistent"], true);
  ExpectServersHold({s}, DigestTensors((*trainer)->tensors(), kAlg), kAlg);
  // A draft session's version does not move the target's.
  RunResult again = Push("push-draft-2", {s}, {"--checkpoint", write("drafter", true), "--steps", "0",
                                               "--weight-version", "v2", "--draft-session"});
  ASSERT_TRUE(again.success()) << again.description;
  EXPECT_EQ(Health(s)["weight_version"], "v1");
  EXPECT_EQ(Health(s)["speculative"]["weight_version"], "v2");
  // A draft session on a server without a drafter fails at its start, naming the fix.
  RunResult plain_draft = Push("push-plain-draft", {plain}, {"--checkpoint", write("drafter", true), "--steps", "0",
                                                             "--draft-session"});
  EXPECT_FALSE(plain_draft.success()) << plain_draft.description;
  EXPECT_NE((plain_draft.out + plain_draft.err).find("this server has no draft model"), std::string::npos)
      << plain_draft.description;
}

TEST_F(MtpTest, AnIncompleteDrafterLayerFailsTheFinishNamingIt) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("srv", {"--model", kModel, "--speculative", "mtp"}));
  E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel(kModel));
  auto trainer = SyntheticTrainer::FromMetadata(HfTensors(config), 42, DefaultThreads());
  ASSERT_TRUE(trainer.ok());
  const auto write = [&](const std::string& name, const std::function<bool(const std::string&)>& keep) {
    const fs::path d = dir() / name;
    fs::create_directories(d);
    std::vector<TensorRef> refs;
    for (const HostTensor& t : (*trainer)->tensors()) {
      if (keep(t.meta.name)) refs.push_back(t.ref());
    }
    EXPECT_TRUE(WriteSafetensors((d / "model.safetensors").string(), refs).ok());
    return d.string();
  };
  const std::string partial =
      write("partial", [](const std::string& n) { return n != "model.layers.3.mlp.experts.5.up_proj.weight"; });
  RunResult push = Push("push-partial", {s}, {"--checkpoint", partial, "--steps", "0"});
  EXPECT_FALSE(push.success()) << push.description;
  EXPECT_NE((push.out + push.err).find("model.layers.3: 1 of "), std::string::npos) << push.description;
  EXPECT_NE((push.out + push.err).find("mlp.experts.5.up_proj.weight"), std::string::npos) << push.description;
  EXPECT_EQ(Health(s)["weights_consistent"], false);

  // The target alone is a valid update: the drafter keeps its bytes and is reported stale.
  const std::string target = write("target", [](const std::string& n) { return !IsMtp(n); });
  RunResult ok = Push("push-target", {s}, {"--checkpoint", target, "--steps", "0", "--weight-version", "t1"});
  ASSERT_TRUE(ok.success()) << ok.description;
  EXPECT_EQ(Health(s)["weights_consistent"], true);
  EXPECT_EQ(Health(s)["speculative"]["stale"], true);
  // Then the whole stream: the drafter is fresh again.
  const std::string whole = write("whole", [](const std::string&) { return true; });
  RunResult full = Push("push-whole", {s}, {"--checkpoint", whole, "--steps", "0", "--weight-version", "w1"});
  ASSERT_TRUE(full.success()) << full.description;
  ExpectFreshDrafter(s, "w1");
}

// A Hugging Face MTP checkpoint (GLM-4.5 / DeepSeek-V3 layout) repeats embed_tokens and
// lm_head inside each MTP layer. push --checkpoint leaves the copies out (the servers drop
// them: model/dropped_names.h), and the drafter reads the target's two tensors.
TEST_F(MtpTest, AnHfCheckpointsPerLayerCopiesAreLeftOutAndTheDrafterSharesTheTargets) {
  const std::string model = "glm4-moe-tiny";  // layers 0-2, MTP layer 3
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("srv", {"--model", model, "--speculative", "mtp"}));
  E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel(model));
  auto trainer = SyntheticTrainer::FromMetadata(HfTensors(config), 45, DefaultThreads());
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  const std::vector<HostTensor>& tensors = (*trainer)->tensors();
  const auto find = [&](std::string_view name) -> const HostTensor& {
    return *std::find_if(tensors.begin(), tensors.end(), [&](const HostTensor& t) { return t.meta.name == name; });
  };
  // The copies, byte for byte, written where a checkpoint has them: first in layer 3.
  std::vector<HostTensor> copies;
  for (auto [copy, of] : {std::pair{"model.layers.3.embed_tokens.weight", "model.embed_tokens.weight"},
                          std::pair{"model.layers.3.shared_head.head.weight", "lm_head.weight"}}) {
    const HostTensor& src = find(of);
    HostTensor c = *HostTensor::Zeros(TensorMeta{copy, src.meta.dtype, src.meta.shape});
    std::memcpy(c.storage.data(), src.storage.data(), src.meta.nbytes());
    copies.push_back(std::move(c));
  }
  std::vector<TensorRef> refs;
  for (const HostTensor& t : tensors) {
    if (t.meta.name == "model.layers.3.enorm.weight") {
      for (const HostTensor& c : copies) refs.push_back(c.ref());
    }
    refs.push_back(t.ref());
  }
  ASSERT_EQ(refs.size(), tensors.size() + 2);
  const fs::path ckpt = dir() / "hf-mtp";
  fs::create_directories(ckpt);
  ASSERT_TRUE(WriteSafetensors((ckpt / "model.safetensors").string(), refs).ok());

  RunResult push = Push("push-hf-mtp", {s}, {"--checkpoint", ckpt.string(), "--steps", "0", "--verify",
                                             "--weight-version", "hf1"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_NE(push.err.find("not sending 2 tensor(s) the servers drop: model.layers.3.embed_tokens.weight, "
                          "model.layers.3.shared_head.head.weight"),
            std::string::npos)
      << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 1)) << push.out;
  ExpectServersHold({s}, DigestTensors(tensors, kAlg), kAlg);
  ExpectFreshDrafter(s, "hf1");
  // The drafter's embedding and head are the target's: the copies' digests.
  const Digests copied = DigestTensors(copies, kAlg);
  const Digests held = DigestTensors(tensors, kAlg);
  EXPECT_EQ(copied.at("model.layers.3.embed_tokens.weight"), held.at("model.embed_tokens.weight"));
  EXPECT_EQ(copied.at("model.layers.3.shared_head.head.weight"), held.at("lm_head.weight"));

  // serve --checkpoint skips the copies by the same rule.
  E2E_ASSERT_OK_AND_ASSIGN(Server loaded, StartServer("from-ckpt", {"--model", model, "--speculative", "mtp",
                                                                    "--checkpoint", ckpt.string()}));
  ExpectServersHold({loaded}, held, kAlg);
}

TEST_F(MtpTest, SleepLevel2LeavesTheDrafterStaleUntilASync) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("srv", {"--model", kModel, "--speculative", "mtp"}));
  RunResult push = Push("push-1", {s}, {"--model", kModel, "--seed", "43", "--steps", "1", "--weight-version", "v1"});
  ASSERT_TRUE(push.success()) << push.description;
  ExpectFreshDrafter(s, "v1");
  ASSERT_EQ(HttpPost(s.url, "/sleep?level=2", "").status, 200);
  ASSERT_EQ(HttpPost(s.url, "/wake_up", "").status, 200);
  EXPECT_TRUE(Health(s)["speculative"]["weight_version"].is_null());
  EXPECT_EQ(Health(s)["speculative"]["stale"], true);
  push = Push("push-2", {s}, {"--model", kModel, "--seed", "43", "--steps", "1", "--weight-version", "v2"});
  ASSERT_TRUE(push.success()) << push.description;
  ExpectFreshDrafter(s, "v2");
}

TEST_F(MtpTest, AModelWithoutMtpLayersIsRefused) {
  RunResult r = RunWsync("serve", {"serve", "--model", "qwen3-tiny", "--speculative", "mtp", "--host", "127.0.0.1",
                                   "--port", "0"},
                         60);
  EXPECT_FALSE(r.timed_out) << r.description;
  EXPECT_FALSE(r.exit.success()) << r.description;
  EXPECT_NE(r.err.find("--speculative mtp: model qwen3-tiny has no MTP layers (num_nextn_predict_layers is 0)"),
            std::string::npos)
      << r.description;
}

}  // namespace
}  // namespace wsync::e2e
