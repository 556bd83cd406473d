// `wsync serve --quantization fp8` end to end: real servers and `wsync push` over nccl,
// ipc and delta; the servers' /weight_checker digests (HF FP8 checkpoint convention) are
// compared with digests of an independent quantization of the trainer's bf16 weights
// written here (quant/fp8_reference_testutil.h, which shares no code with the server's).
// A model / tp off the 128 grid is refused at start; an update that leaves a layer
// incomplete fails its finish, naming the layer, and leaves weights_consistent false.
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/parallel.h"
#include "e2e_test_base.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "quant/fp8_reference_testutil.h"
#include "synthetic/synthetic.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr DigestAlgorithm kAlg = DigestAlgorithm::kXxh3_128;

bool Quantized(const std::string& name) {
  // The rule vLLM's Fp8 config applies to Qwen3, restated (not the server's function):
  // the decoder layers' linear weights (*_proj, experts' included); the MoE router
  // (mlp.gate.weight), norms and embeddings stay bf16.
  return name.starts_with("model.layers.") && name.ends_with("_proj.weight");
}

// The FP8 checkpoint digests of one bf16 tensor: NAME (e4m3 bytes), NAME_scale_inv
// (f32) for quantized ones, the bytes themselves otherwise.
void AddFp8Digests(const std::string& name, const Shape& shape, std::span<const std::byte> bf16, Digests* out) {
  if (!Quantized(name)) {
    (*out)[name] = HexDigest(kAlg, bf16);
    return;
  }
  const std::vector<float> x = fp8_reference::WidenBf16(bf16.data(), bf16.size() / 2);
  const fp8_reference::Quantized q = fp8_reference::Quantize(x, shape[0], shape[1]);
  (*out)[name] = HexDigest(kAlg, std::as_bytes(std::span(q.q)));
  std::string scale = name.substr(0, name.size() - std::string_view("weight").size()) + "weight_scale_inv";
  (*out)[scale] = HexDigest(kAlg, std::as_bytes(std::span(q.scale_inv)));
}

class Fp8Test : public E2eTest {
 protected:
  // A config.json directory `name` of a Qwen3 model with head_dim 128, whose shards are
  // on the 128 grid at tp 2 (one KV head of 128 rows per rank): qwen3-tiny's sizes, and
  // for MoE 8 experts of moe_intermediate_size 256.
  std::string Hd128Model(const std::string& name, bool moe = false) {
    const fs::path d = dir() / name;
    fs::create_directories(d);
    json c{{"architectures", {moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"}},
           {"vocab_size", 4096},
           {"hidden_size", 256},
           {"intermediate_size", 512},
           {"num_hidden_layers", moe ? 2 : 3},
           {"num_attention_heads", 4},
           {"num_key_value_heads", 2},
           {"head_dim", 128},
           {"tie_word_embeddings", false},
           {"torch_dtype", "bfloat16"}};
    if (moe) {
      c["moe_intermediate_size"] = 256;
      c["num_experts"] = 8;
      c["num_experts_per_tok"] = 2;
    }
    std::ofstream(d / "config.json") << c.dump();
    return d.string();
  }

  static std::unique_ptr<SyntheticTrainer> Trainer(const std::string& model, uint64_t seed, int steps) {
    Result<ModelConfig> config = LookupModel(model);
    EXPECT_TRUE(config.ok()) << config.status().ToString();
    auto trainer = SyntheticTrainer::FromMetadata(HfTensors(*config), seed, DefaultThreads());
    EXPECT_TRUE(trainer.ok());
    for (int s = 1; s <= steps; ++s) EXPECT_TRUE((*trainer)->Step(static_cast<uint64_t>(s)).ok());
    return std::move(trainer).value();
  }

  // What an fp8 server holds after `push --model MODEL --seed SEED --steps STEPS`.
  static Digests Want(const std::string& model, uint64_t seed, int steps) {
    Digests out;
    const std::unique_ptr<SyntheticTrainer> trainer = Trainer(model, seed, steps);
    for (const HostTensor& t : trainer->tensors()) {
      AddFp8Digests(t.meta.name, t.meta.shape, t.storage.span(), &out);
    }
    return out;
  }

  json Health(const Server& s) {
    HttpReply r = HttpGet(s.url, "/health");
    EXPECT_EQ(r.status, 200) << r.Describe();
    return r.json;
  }
};

TEST_F(Fp8Test, StepsSyncIntoFp8ServersOverNcclIpcAndDelta) {
  const std::string hd128 = Hd128Model("tiny-hd128");
  {  // nccl: tp 2 and tp 1 servers of one deployment list.
    SCOPED_TRACE("nccl");
    E2E_ASSERT_OK_AND_ASSIGN(Server a, StartServer("nccl-tp2", {"--model", hd128, "--tp", "2", "--quantization",
                                                                "fp8"}));
    E2E_ASSERT_OK_AND_ASSIGN(Server b, StartServer("nccl-tp1", {"--model", hd128, "--quantization", "fp8"}));
    EXPECT_EQ(Health(a)["quantization"], "fp8");
    // --verify: the trainer quantizes its own bf16 tensors to the servers' FP8 convention.
    RunResult push = Push("push-nccl", {a, b}, {"--model", hd128, "--seed", "11", "--steps", "2", "--verify"});
    ASSERT_TRUE(push.success()) << push.description;
    EXPECT_TRUE(HasVerifiedTable(push.out, 3)) << push.out;
    ExpectServersHold({a, b}, Want(hd128, 11, 2), kAlg);
    EXPECT_EQ(Health(a)["weights_consistent"], true);
    // Between syncs a host worker holds its quantized weights in fp8 only: the landing
    // buffers of the quantized parameters are released (at most a page per parameter
    // of slack for the others).
    const json mem = Health(b)["memory"];
    int64_t quantized = 0, e4m3 = 0, scales = 0, params = 0;
    E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel(hd128));
    for (const TensorMeta& m : HfTensors(config)) {
      ++params;
      if (!Quantized(m.name)) continue;
      quantized += static_cast<int64_t>(m.nbytes());
      e4m3 += m.shape[0] * m.shape[1];
      scales += 4 * ((m.shape[0] + 127) / 128) * ((m.shape[1] + 127) / 128);
    }
    EXPECT_EQ(mem["fp8_weights_bytes"].get<int64_t>(), e4m3 + scales) << mem.dump();
    EXPECT_LE(mem["weights_resident_bytes"].get<int64_t>(),
              mem["weights_bytes"].get<int64_t>() - quantized + params * 4096)
        << mem.dump();
  }
  {  // ipc, qwen3-tiny at tp 1.
    SCOPED_TRACE("ipc");
    E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("ipc", {"--model", "qwen3-tiny", "--backend", "ipc",
                                                           "--quantization", "fp8"}));
    RunResult push = RunWsync("push-ipc", {"push", "--servers", s.url, "--backend", "ipc", "--model", "qwen3-tiny",
                                           "--seed", "12", "--steps", "2"},
                              120);
    ASSERT_TRUE(push.success()) << push.description;
    ExpectServersHold({s}, Want("qwen3-tiny", 12, 2), kAlg);
  }
  {  // delta: a base checkpoint of the trainer's seed, then two deltas.
    SCOPED_TRACE("delta");
    const fs::path base = dir() / "base", root = dir() / "shared";
    fs::create_directories(base);
    fs::create_directories(root);
    auto trainer = Trainer("qwen3-tiny", 13, 0);
    std::vector<TensorRef> refs;
    for (const HostTensor& t : trainer->tensors()) refs.push_back(t.ref());
    ASSERT_TRUE(WriteSafetensors((base / "model.safetensors").string(), refs).ok());
    E2E_ASSERT_OK_AND_ASSIGN(
        Server s, StartServer("delta", {"--model", "qwen3-tiny", "--backend", "delta", "--base-checkpoint",
                                        base.string(), "--sync-root", root.string(), "--local-checkpoint-dir",
                                        (dir() / "local").string(), "--quantization", "fp8"}));
    RunResult push = RunWsync("push-delta", {"push", "--servers", s.url, "--backend", "delta", "--sync-dir",
                                             (root / "sync").string(), "--model", "qwen3-tiny", "--seed", "13",
                                             "--steps", "2", "--timeout", "120"},
                              300);
    ASSERT_TRUE(push.success()) << push.description;
    ExpectServersHold({s}, Want("qwen3-tiny", 13, 2), kAlg);
  }
}

TEST_F(Fp8Test, ShardedSlicesOfStackedExpertsLandAndQuantize) {
  // The sharded backend lands pieces (LoadPiece), stacked experts included, from a
  // tp2pp2ep2 trainer.
  const std::string moe = Hd128Model("moe-tiny-hd128", /*moe=*/true);
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("sharded", {"--model", moe, "--tp", "2", "--backend", "sharded",
                                                             "--quantization", "fp8"}));
  RunResult push = Push("push-sharded", {s},
                        {"--backend", "sharded", "--model", moe, "--trainer-ranks", "8", "--trainer-layout",
                         "tp2pp2ep2", "--seed", "14", "--steps", "2", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  ExpectServersHold({s}, Want(moe, 14, 2), kAlg);
}

TEST_F(Fp8Test, AModelOffTheBlockGridIsRefusedAtStart) {
  // qwen3-tiny at tp 2: each rank holds one 64-row KV head.
  RunResult r = RunWsync("serve-tp2", {"serve", "--model", "qwen3-tiny", "--tp", "2", "--quantization", "fp8",
                                       "--host", "127.0.0.1", "--port", "0"},
                         60);
  EXPECT_FALSE(r.timed_out) << r.description;
  EXPECT_FALSE(r.exit.success()) << r.description;
  for (const char* needle : {"--quantization fp8", "model qwen3-tiny, tp 2",
                             "fp8 block quantization needs shard boundaries at multiples of 128",
                             "model.layers.0.self_attn.k_proj.weight"}) {
    EXPECT_NE(r.err.find(needle), std::string::npos) << needle << "\n" << r.description;
  }
}

TEST_F(Fp8Test, AnUpdateLeavingALayerIncompleteFailsItsFinishNamingTheLayer) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("srv", {"--model", "qwen3-tiny", "--quantization", "fp8"}));
  E2E_ASSERT_OK_AND_ASSIGN(Digests before, ServerChecksums(s.url, kAlg));
  auto trainer = Trainer("qwen3-tiny", 21, 0);
  // A trainer that sends a subset: checkpoint directories the push sends as they are.
  const auto write = [&](const std::string& name, const std::function<bool(const std::string&)>& keep) {
    const fs::path d = dir() / name;
    fs::create_directories(d);
    std::vector<TensorRef> refs;
    for (const HostTensor& t : trainer->tensors()) {
      if (keep(t.meta.name)) refs.push_back(t.ref());
    }
    EXPECT_TRUE(WriteSafetensors((d / "model.safetensors").string(), refs).ok());
    return d.string();
  };
  // Layer 1 without mlp.up_proj, and layer 2 whole.
  const std::string partial = write("partial", [](const std::string& n) {
    return (n.starts_with("model.layers.1.") && n != "model.layers.1.mlp.up_proj.weight") ||
           n.starts_with("model.layers.2.");
  });
  RunResult push = Push("push-partial", {s}, {"--checkpoint", partial, "--steps", "0"});
  EXPECT_FALSE(push.success()) << push.description;
  EXPECT_NE((push.out + push.err).find("model.layers.1: 1 of 7 quantized tensors incomplete (mlp.up_proj.weight)"),
            std::string::npos)
      << push.description;
  EXPECT_EQ((push.out + push.err).find("model.layers.2:"), std::string::npos) << push.description;
  EXPECT_EQ(Health(s)["weights_consistent"], false);

  // A complete subset (layer 2 alone) is a valid partial update: layer 2 is requantized,
  // the layers it did not touch keep their fp8 bytes.
  const std::string layer2 = write("layer2", [](const std::string& n) { return n.starts_with("model.layers.2."); });
  RunResult ok = Push("push-layer2", {s}, {"--checkpoint", layer2, "--steps", "0"});
  ASSERT_TRUE(ok.success()) << ok.description;
  EXPECT_EQ(Health(s)["weights_consistent"], true);
  E2E_ASSERT_OK_AND_ASSIGN(Digests after, ServerChecksums(s.url, kAlg));
  Digests layer2_want;
  for (const HostTensor& t : trainer->tensors()) {
    if (t.meta.name.starts_with("model.layers.2.")) AddFp8Digests(t.meta.name, t.meta.shape, t.storage.span(), &layer2_want);
  }
  for (const auto& [name, hex] : after) {
    if (name.starts_with("model.layers.2.")) {
      EXPECT_EQ(hex, layer2_want.at(name)) << name;
    } else if (name.starts_with("model.layers.0.") || name.starts_with("model.layers.3.")) {
      EXPECT_EQ(hex, before.at(name)) << name;
    }
  }
  EXPECT_EQ(after.size(), before.size());
}

}  // namespace
}  // namespace wsync::e2e
