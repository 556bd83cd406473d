// LoRA adapters end to end over the backends whose update_info is not a tensor list of
// its own: real `wsync serve --max-loras` processes (TP=2: each worker holds the whole
// adapter), the library's trainer with TrainerOptions::lora. Each version must be what
// every worker holds, byte for byte (/weight_checker with "lora", digests the test takes
// itself), verified in line; the delta trainer's file must be gone once a session ends.
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/parallel.h"
#include "e2e_test_base.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "synthetic/synthetic.h"
#include "wsync/source.h"
#include "wsync/trainer.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr int64_t kRank = 4;

// qwen3-tiny's rank-4 adapter on q_proj and v_proj (docs/lora.md: PEFT names, A [r, in],
// B [out, r], the model's bf16), every byte drawn from `seed`.
std::vector<HostTensor> Adapter(uint64_t seed) {
  std::vector<HostTensor> out;
  Result<ModelConfig> config = LookupModel("qwen3-tiny");
  if (!config.ok()) return out;
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (const TensorMeta& m : HfTensors(*config)) {
    const std::string& n = m.name;
    if (!n.starts_with("model.layers.") || !(n.ends_with(".q_proj.weight") || n.ends_with(".v_proj.weight"))) continue;
    const std::string module = "base_model.model." + n.substr(0, n.size() - std::string(".weight").size());
    for (auto [suffix, shape] : {std::pair{".lora_A.weight", Shape{kRank, m.shape[1]}},
                                 std::pair{".lora_B.weight", Shape{m.shape[0], kRank}}}) {
      Result<HostTensor> t = HostTensor::Zeros(TensorMeta{module + suffix, DType::kBF16, shape});
      if (!t.ok()) return {};
      for (std::byte& b : t->storage.span().first(t->meta.nbytes())) {
        state ^= state << 13, state ^= state >> 7, state ^= state << 17;
        b = static_cast<std::byte>(state >> 24);
      }
      out.push_back(std::move(*t));
    }
  }
  return out;
}

class LoraBackendsTest : public E2eTest {
 protected:
  // Syncs versions v0..v2 of the adapter (new bytes each) through one engine and checks
  // each on `server`.
  void SyncThreeVersions(const Server& server, const std::string& backend,
                         std::map<std::string, std::string> backend_options) {
    TrainerOptions o;
    o.backend = backend;
    o.servers = {server.url};
    o.backend_options = std::move(backend_options);
    o.timeout_seconds = 60;
    o.lora = LoraAdapterOptions{.name = "math", .r = kRank, .alpha = 8, .target_modules = {"q_proj", "v_proj"}};
    E2E_ASSERT_OK_AND_ASSIGN(std::unique_ptr<TrainerEngine> engine, CreateTrainerEngine(o));
    for (int v = 0; v < 3; ++v) {
      std::vector<HostTensor> tensors = Adapter(40 + v);
      ASSERT_EQ(tensors.size(), 16u);  // 4 layers x 2 modules x A, B
      const Digests want = DigestTensors(tensors, DigestAlgorithm::kXxh3_128);
      HostTensorSource source(std::move(tensors));
      if (v == 0) ASSERT_OK(engine->Init(source));
      const std::string version = fmt::format("v{}", v);
      Result<SyncStats> stats = engine->SendWeights(source, version);
      ASSERT_TRUE(stats.ok()) << backend << " " << version << ": " << stats.status().ToString();
      EXPECT_EQ(stats->inline_verified_servers, 1u) << backend << " " << version;
      HttpReply held = HttpPostJson(server.url, "/weight_checker",
                                    json{{"action", "checksum"}, {"algorithm", "xxh3_128"}, {"lora", "math"}});
      ASSERT_EQ(held.status, 200) << held.Describe();
      EXPECT_EQ(held.json.value("version", ""), version);
      EXPECT_EQ(held.json["checksums"].get<Digests>(), want) << backend << " " << version;
    }
    HttpReply health = HttpGet(server.url, "/health");
    EXPECT_TRUE(health.json.value("weights_consistent", false)) << health.Describe();
  }
};

TEST_F(LoraBackendsTest, ShardedAdapterGroupInstallsEachVersionOnBothWorkers) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("s", {"--model", "qwen3-tiny", "--backend", "sharded", "--tp", "2",
                                                       "--max-loras", "1"}));
  SyncThreeVersions(s, "sharded", {{"model", "qwen3-tiny"}});
}

TEST_F(LoraBackendsTest, DeltaAdapterFileInstallsEachVersionAndIsRemoved) {
  // The server's base: qwen3-tiny's synthetic weights (the adapter never touches them).
  E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel("qwen3-tiny"));
  E2E_ASSERT_OK_AND_ASSIGN(auto base, SyntheticTrainer::FromMetadata(HfTensors(config), 3, DefaultThreads()));
  std::vector<TensorRef> refs;
  for (const HostTensor& t : base->tensors()) refs.push_back(t.ref());
  fs::create_directories(dir() / "base");
  fs::create_directories(dir() / "shared");
  ASSERT_OK(WriteSafetensors((dir() / "base" / "model.safetensors").string(), refs));
  E2E_ASSERT_OK_AND_ASSIGN(
      Server s, StartServer("s", {"--model", "qwen3-tiny", "--backend", "delta", "--tp", "2", "--max-loras", "1",
                                  "--base-checkpoint", (dir() / "base").string(), "--sync-root",
                                  (dir() / "shared").string()}));
  const fs::path sync = dir() / "shared" / "sync";
  SyncThreeVersions(s, "delta", {{"sync_dir", sync.string()}});
  EXPECT_TRUE(fs::is_empty(sync / "lora" / "math")) << "the trainer leaves no adapter file behind";
}

}  // namespace
}  // namespace wsync::e2e
