#include "planner/m2n.h"

#include <string>

#include <gtest/gtest.h>

#include "model/config.h"

namespace wsync::planner {
namespace {

// The NCCL M2N benchmark's H100 preset for NeMo-RL's Qwen3-32B (its numbers; the
// benchmark's file also carries a "_comment").
constexpr char kQwen32bH100[] = R"({
  "_comment": "Qwen3-32B: 4 trainer nodes, 4 generator nodes, 8 H100 each",
  "train": {"num_gpus": 32, "tp_size": 4, "cp_size": 1, "ep_size": 1, "pp_size": 4, "fsdp_size": 1, "dp_size": 2},
  "generation": {"num_gpus": 32, "tp_size": 4, "cp_size": 1, "ep_size": 1, "pp_size": 1, "fsdp_size": 1, "dp_size": 8}
})";

TEST(M2nSystem, PublishedPresetReadsAsAFleet) {
  auto s = ParseM2nSystem(kQwen32bH100, "preset.json");
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->train, (M2nParallel{32, 4, 1, 1, 4, 1, 2}));
  EXPECT_EQ(s->generation, (M2nParallel{32, 4, 1, 1, 1, 1, 8}));
  auto specs = FleetSpecsOfM2n(*s, "h100");
  ASSERT_TRUE(specs.ok()) << specs.status().message();
  EXPECT_EQ(specs->trainer, "tp4pp4:32@h100");
  EXPECT_EQ(specs->servers, "8x(4,1,1)@h100");
  // Written back, it reads the same, and the fleet writes the same system.
  EXPECT_EQ(*ParseM2nSystem(WriteM2nSystem(*s), "written"), *s);
  auto fleet = M2nSystemOf(*ParseTrainerSpec(specs->trainer), *ParseServerSpec(specs->servers));
  ASSERT_TRUE(fleet.ok()) << fleet.status().message();
  EXPECT_EQ(fleet->train, s->train);
  EXPECT_EQ(fleet->generation, s->generation);
}

TEST(M2nSystem, ExpertParallelFoldingAndFsdp) {
  M2nSystem s;
  s.train = {256, 8, 1, 32, 8, 1, 4};
  s.generation = {128, 32, 1, 1, 1, 1, 4};
  EXPECT_EQ(FleetSpecsOfM2n(s, "h100")->trainer, "tp8pp8ep32:256@h100");
  s.train = {16, 1, 1, 1, 1, 16, 1};
  EXPECT_EQ(FleetSpecsOfM2n(s, "h800")->trainer, "fsdp:16@h800");
}

TEST(M2nSystem, NamesWhatItCannotRead) {
  auto msg = [](std::string_view text) { return ParseM2nSystem(text, "s.json").status().message(); };
  EXPECT_EQ(msg(R"({"train": {"num_gpus": 8}})"), "s.json: missing field generation");
  EXPECT_EQ(msg(R"({"train": {"tp_size": 2}, "generation": {"num_gpus": 2}})"), "s.json: train: missing field num_gpus");
  EXPECT_EQ(msg(R"({"train": {"num_gpus": 8, "tp_size": 0}, "generation": {"num_gpus": 2}})"),
            "s.json: train: field tp_size is 0, expected an integer in [1, 1048576]");
  EXPECT_EQ(msg(R"({"train": {"num_gpus": 8, "etp_size": 2}, "generation": {"num_gpus": 2}})"),
            "s.json: train: unknown field 'etp_size' (expected num_gpus, tp_size, cp_size, ep_size, pp_size, "
            "fsdp_size, dp_size)");
  EXPECT_EQ(msg("[1]"), "s.json: not a JSON object");
  M2nSystem s;
  s.train = {32, 4, 1, 1, 4, 1, 1};
  s.generation = {8, 8, 1, 1, 1, 1, 1};
  EXPECT_EQ(FleetSpecsOfM2n(s, "h100").status().message(),
            "train: tp_size 4 x cp_size 1 x dp_size 1 is not num_gpus / pp_size = 8");
  s.train.dp = 2;
  s.generation.ep = 8;
  EXPECT_NE(FleetSpecsOfM2n(s, "h100").status().message().find("generation: cp_size 1, pp_size 1, fsdp_size 1, "
                                                                "ep_size 8"),
            std::string::npos);
}

TEST(M2nSystem, FleetsWithoutAnM2nMeshAreRefused) {
  EXPECT_EQ(M2nSystemOf(*ParseTrainerSpec("tp2pp2ep2etp2:8@h100"), *ParseServerSpec("1x(2,1,1)@h100")).status().message(),
            "trainer tp2pp2ep2etp2:8@h100: the M2N benchmark has no expert TP");
  EXPECT_FALSE(M2nSystemOf(*ParseTrainerSpec("tp8pp8ep32:256@h100"), *ParseServerSpec("4x(32,1,32)@h100")).ok());
  auto fsdp = M2nSystemOf(*ParseTrainerSpec("fsdp:16@h800"), *ParseServerSpec("2x(8,1,1)@h800"));
  ASSERT_TRUE(fsdp.ok());
  EXPECT_EQ(FleetSpecsOfM2n(*fsdp, "h800")->trainer, "fsdp:16@h800");
  EXPECT_EQ(FleetSpecsOfM2n(*fsdp, "h800")->servers, "2x(8,1,1)@h800");
}

// A model file written from a registered config reads back as that config, for every
// architecture wsync knows.
TEST(M2nModel, RoundTripsEveryArchitecture) {
  for (const char* name : {"qwen3-tiny", "qwen3-32b", "qwen3-moe-tiny", "deepseek-v3-tiny", "glm4-moe-tiny",
                           "qwen3-0.6b"}) {
    SCOPED_TRACE(name);
    const ModelConfig want = *LookupModel(name);
    auto tensors = ParseM2nModel(WriteM2nModel(HfTensors(want)), "model.json");
    ASSERT_TRUE(tensors.ok()) << tensors.status().message();
    auto got = ModelOfM2n(*tensors, name);
    ASSERT_TRUE(got.ok()) << got.status().message();
    EXPECT_EQ(HfTensors(*got), HfTensors(want));
    EXPECT_EQ(ModelBytes(*got), ModelBytes(want));
  }
}

// The full-size models' sizes read off their tensors (the JSON text aside).
TEST(M2nModel, FullSizeModelsReadOffTheirTensors) {
  for (const char* name : {"qwen3-30b-a3b", "deepseek-v3", "kimi-k2", "glm-4.5-air"}) {
    SCOPED_TRACE(name);
    const ModelConfig want = *LookupModel(name);
    auto got = ModelOfM2n(HfTensors(want), name);
    ASSERT_TRUE(got.ok()) << got.status().message();
    EXPECT_EQ(ModelBytes(*got), ModelBytes(want));
  }
}

TEST(M2nModel, NamesTheFirstDifference) {
  std::vector<TensorMeta> t = HfTensors(*LookupModel("qwen3-tiny"));
  t.push_back(TensorMeta{"model.layers.0.extra.weight", DType::kBF16, {4}});
  auto c = ModelOfM2n(t, "m.json");
  EXPECT_EQ(c.status().message(), "m.json: read as Qwen3ForCausalLM, tensor model.layers.0.extra.weight is not one of "
                                  "its tensors");
  auto bad = ParseM2nModel(R"({"a": {"shape": [0], "dtype": "BF16"}})", "m.json");
  EXPECT_EQ(bad.status().message(), "m.json: tensor a: dimension 0 is not an integer in [1, 4294967296]");
  bad = ParseM2nModel(R"({"a": {"shape": [2], "dtype": "Q4"}})", "m.json");
  EXPECT_FALSE(bad.ok());
}

}  // namespace
}  // namespace wsync::planner
