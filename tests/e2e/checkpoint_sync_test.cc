// `wsync push --checkpoint DIR`: a sharded Hugging Face checkpoint (two safetensors files
// and model.safetensors.index.json) is synced as is, then trained one step on top.
#include <algorithm>
#include <fstream>

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

class CheckpointSyncTest : public E2eTest {
 protected:
  // Writes a bf16 qwen3-tiny checkpoint whose weights come from seed `seed`, split over
  // two files in model order (or, `by_name`, sorted by name as Hugging Face's writers
  // store them), with an index and a config.json.
  Status WriteTinyCheckpoint(const std::filesystem::path& dir, uint64_t seed, bool by_name = false) {
    std::filesystem::create_directories(dir);
    WSYNC_ASSIGN_OR_RETURN(ModelConfig config, LookupModel("qwen3-tiny"));
    WSYNC_ASSIGN_OR_RETURN(auto trainer,
                           SyntheticTrainer::FromMetadata(HfTensors(config), seed, DefaultThreads()));
    std::vector<const HostTensor*> tensors;
    for (const HostTensor& t : trainer->tensors()) tensors.push_back(&t);
    if (by_name) {
      std::sort(tensors.begin(), tensors.end(),
                [](const HostTensor* a, const HostTensor* b) { return a->meta.name < b->meta.name; });
    }
    const std::string files[2] = {"model-00001-of-00002.safetensors",
                                  "model-00002-of-00002.safetensors"};
    std::vector<TensorRef> part[2];
    json weight_map = json::object();
    size_t total = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      int f = i < tensors.size() / 2 ? 0 : 1;
      if (tensors[i]->meta.dtype != DType::kBF16) {
        return Internal(fmt::format("{} is not bf16", tensors[i]->meta.name));
      }
      part[f].push_back(tensors[i]->ref());
      weight_map[tensors[i]->meta.name] = files[f];
      total += tensors[i]->meta.nbytes();
    }
    for (int f = 0; f < 2; ++f) {
      WSYNC_RETURN_IF_ERROR(WriteSafetensors((dir / files[f]).string(), part[f], {{"format", "pt"}}));
    }
    std::ofstream((dir / "model.safetensors.index.json"))
        << json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2);
    std::ofstream((dir / "config.json"))
        << json{{"architectures", {"Qwen3ForCausalLM"}},
                {"model_type", "qwen3"},
                {"vocab_size", config.vocab_size},
                {"hidden_size", config.hidden_size},
                {"intermediate_size", config.intermediate_size},
                {"num_hidden_layers", config.num_hidden_layers},
                {"num_attention_heads", config.num_attention_heads},
                {"num_key_value_heads", config.num_key_value_heads},
                {"head_dim", config.head_dim},
                {"tie_word_embeddings", config.tie_word_embeddings},
                {"torch_dtype", "bfloat16"}}
               .dump(2);
    return Status::Ok();
  }
};

TEST_F(CheckpointSyncTest, ShardedCheckpointSyncsAsIsThenOneStepMatchesFromCheckpointTrainer) {
  std::filesystem::path ckpt_dir = dir() / "ckpt";
  Status written = WriteTinyCheckpoint(ckpt_dir, /*seed=*/77);
  ASSERT_TRUE(written.ok()) << written.ToString();
  Result<CheckpointDir> ckpt = CheckpointDir::Open(ckpt_dir.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  ASSERT_EQ(ckpt->files().size(), 2u);

  // Step 0: the checkpoint's own bytes, read back from the files.
  Digests want0;
  for (const TensorMeta& t : ckpt->tensors()) {
    Result<std::span<const std::byte>> bytes = ckpt->Bytes(t.name);
    ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
    want0[t.name] = HexDigest(DigestAlgorithm::kXxh3_128, *bytes);
  }
  // Step 1: the checkpoint trained one step (updates keyed by the default seed 0).
  E2E_ASSERT_OK_AND_ASSIGN(auto trainer, SyntheticTrainer::FromCheckpoint(*ckpt, DefaultThreads()));
  Result<StepStats> step = trainer->Step(1);
  ASSERT_TRUE(step.ok()) << step.status().ToString();
  ASSERT_GT(step->changed_elements, 0u);
  Digests want1 = DigestTensors(trainer->tensors(), DigestAlgorithm::kXxh3_128);
  ASSERT_FALSE(DigestsEqual(want0, want1));

  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("tp2", {"--model", "qwen3-tiny", "--tp", "2"}));

  RunResult as_is = Push("push_step0", {s}, {"--checkpoint", ckpt_dir.string(), "--verify",
                                             "--timeout", "60"});
  ASSERT_TRUE(as_is.success()) << as_is.description;
  EXPECT_TRUE(HasVerifiedTable(as_is.out, 1));
  ExpectServersHold({s}, want0, DigestAlgorithm::kXxh3_128);

  // A second trainer run against the same, already synced server re-initializes it.
  RunResult trained = Push("push_step1", {s}, {"--checkpoint", ckpt_dir.string(), "--steps", "1",
                                               "--verify", "--timeout", "60"});
  ASSERT_TRUE(trained.success()) << trained.description;
  EXPECT_TRUE(HasVerifiedTable(trained.out, 2));
  ExpectServersHold({s}, want1, DigestAlgorithm::kXxh3_128);
}

// Hugging Face checkpoints store tensors sorted by name, not in the model's order: Megatron
// trainer ranks lay them out by name, and every sync lands bit-exact.
TEST_F(CheckpointSyncTest, NameSortedCheckpointSyncsFromMegatronRanks) {
  std::filesystem::path ckpt_dir = dir() / "ckpt";
  Status written = WriteTinyCheckpoint(ckpt_dir, /*seed=*/78, /*by_name=*/true);
  ASSERT_TRUE(written.ok()) << written.ToString();
  Result<CheckpointDir> ckpt = CheckpointDir::Open(ckpt_dir.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel("qwen3-tiny"));
  std::vector<std::string> file_order, model_order;
  for (const TensorMeta& t : ckpt->tensors()) file_order.push_back(t.name);
  for (const TensorMeta& t : HfTensors(config)) model_order.push_back(t.name);
  ASSERT_TRUE(std::is_sorted(file_order.begin(), file_order.end()));
  ASSERT_NE(file_order, model_order);

  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartServer("a", {"--model", "qwen3-tiny", "--tp", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server b, StartServer("b", {"--model", "qwen3-tiny", "--tp", "2"}));
  for (const char* layout : {"tp2pp2ep1", "tp1pp2ep1"}) {
    RunResult push = Push(std::string("push_") + layout, {a, b},
                          {"--checkpoint", ckpt_dir.string(), "--trainer-ranks", "4", "--trainer-layout",
                           layout, "--steps", "1", "--verify", "--timeout", "60"});
    ASSERT_TRUE(push.success()) << push.description;
    EXPECT_TRUE(HasVerifiedTable(push.out, 2)) << push.out;
  }
}

}  // namespace
}  // namespace wsync::e2e
