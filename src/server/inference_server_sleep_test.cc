// InferenceServer's sleep and wake, memory report, server info and start-up weights:
// sleep levels and wake tags with is_sleeping and the scheduler's pause at each step,
// the 409s (a sleep during a weight update, a start / init / checksum while the weights
// sleep), a failed sleep that leaves everything awake, discarded weights that stay
// inconsistent until a sync refills them, and weights resident from start-up (synthetic
// from a seed, or a safetensors checkpoint, whose errors name the file and tensor).
// Digests are the test's own (Hasher over the tensors it made).
#include <unistd.h>

#include <filesystem>

#include <gtest/gtest.h>

#include "core/digest.h"
#include "core/parallel.h"
#include "format/safetensors.h"
#include "model/worker_sink.h"
#include "server/inference_server.h"
#include "synthetic/synthetic.h"

namespace wsync {
namespace {

using nlohmann::json;

// Lands `source`'s tensors in every worker on each update.
class LoadingBackend : public ReceiverBackend {
 public:
  LoadingBackend(ReceiverContext* ctx, const std::vector<HostTensor>* source) : ctx_(ctx), source_(source) {}
  std::string_view name() const override { return "loading"; }
  Status Init(const json&) override { return Status::Ok(); }
  Status Update(const UpdateRequest& req) override {
    WSYNC_RETURN_IF_ERROR(req.reject);
    for (const ReceiverWorker& w : ctx_->workers) {
      for (const HostTensor& t : *source_) WSYNC_RETURN_IF_ERROR(w.sink->Load(t.ref()));
    }
    return Status::Ok();
  }
  bool ParsesOwnUpdateInfo() const override { return true; }

 private:
  ReceiverContext* ctx_;
  const std::vector<HostTensor>* source_;
};

std::map<std::string, std::string> Digests(const std::vector<HostTensor>& tensors) {
  std::map<std::string, std::string> out;
  for (const HostTensor& t : tensors) out[t.meta.name] = HexDigest(DigestAlgorithm::kSha256, t.storage.span().first(t.meta.nbytes()));
  return out;
}

std::vector<HostTensor> Synthetic(uint64_t seed) {
  auto trainer = *SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), seed, 2);
  return std::move(trainer->tensors());
}

class SleepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) / ("wsync_sleep_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    options_.model = "qwen3-tiny";
    options_.tp = 2;
    options_.offload_dir = dir_.string();
    trained_ = Synthetic(11);
  }
  void TearDown() override {
    server_.reset();
    std::filesystem::remove_all(dir_);
  }
  Result<std::unique_ptr<InferenceServer>> Make() {
    return InferenceServer::Create(options_, [this](std::string_view, ReceiverContext* ctx)
                                                 -> Result<std::unique_ptr<ReceiverBackend>> {
      return std::unique_ptr<ReceiverBackend>(std::make_unique<LoadingBackend>(ctx, &trained_));
    });
  }
  void Start() {
    auto s = Make();
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(*s);
  }
  Status Sync(const std::string& version) {
    WSYNC_RETURN_IF_ERROR(server_->StartWeightUpdate());
    WSYNC_RETURN_IF_ERROR(server_->UpdateWeights(json::object()));
    return server_->FinishWeightUpdate(version);
  }
  json Mem() { return server_->Health()["memory"]; }
  std::map<std::string, std::string> Held() {
    auto r = server_->Checksums(DigestAlgorithm::kSha256);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : std::map<std::string, std::string>{};
  }
  static void ExpectRefusedToWake(const Status& s, const char* what) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << what << ": " << s.ToString();
    EXPECT_NE(s.message().find("POST /wake_up?tags=weights first"), std::string::npos) << what << ": " << s.ToString();
  }

  std::filesystem::path dir_;
  InferenceServerOptions options_;
  std::vector<HostTensor> trained_;
  std::unique_ptr<InferenceServer> server_;
};

TEST_F(SleepTest, WeightsAreResidentSyntheticFromStartUp) {
  Start();
  EXPECT_EQ(Held(), Digests(Synthetic(InferenceServerOptions::kDefaultInitSeed)));
  EXPECT_NE(Held(), Digests(Synthetic(0)));  // not the trainers' default seed
  options_.init_seed = 11;
  Start();
  EXPECT_EQ(Held(), Digests(trained_));
  json m = Mem();
  EXPECT_EQ(m["weights_bytes"], m["weights_resident_bytes"]);
  // Two TP shards hold the model once, plus the copies of the replicated tensors.
  EXPECT_GT(m["weights_bytes"].get<size_t>(), static_cast<size_t>(ModelBytes(server_->model()))) << m.dump();
  EXPECT_LT(m["weights_bytes"].get<size_t>(), static_cast<size_t>(ModelBytes(server_->model())) * 11 / 10);
}

TEST_F(SleepTest, LevelOneOffloadsAndWakeTagsBringBackOnlyWhatTheyName) {
  Start();
  const auto before = Held();
  json m = Mem();
  const size_t weights = m["weights_bytes"];
  EXPECT_EQ(m["sleep"], (json{{"weights", "awake"}, {"kv_cache", "awake"}, {"scheduling", "awake"}}));
  EXPECT_EQ(m["weights_offloaded_bytes"], 0);
  EXPECT_GT(m["host_rss_bytes"].get<size_t>(), weights);
  EXPECT_FALSE(m.contains("device_used_bytes"));

  ASSERT_TRUE(server_->Sleep(1, "abort").ok());
  EXPECT_TRUE(server_->IsSleeping());
  EXPECT_TRUE(server_->IsPaused());
  m = Mem();
  EXPECT_EQ(m["sleep"], (json{{"weights", "offloaded"}, {"kv_cache", "discarded"}, {"scheduling", "asleep"}}));
  EXPECT_EQ(m["weights_offloaded_bytes"], weights);
  EXPECT_LT(m["weights_resident_bytes"].get<size_t>(), weights / 20) << m.dump();
  ExpectRefusedToWake(server_->Checksums(DigestAlgorithm::kSha256).status(), "weight_checker");
  ExpectRefusedToWake(server_->StartWeightUpdate(), "start_weight_update");
  ExpectRefusedToWake(server_->InitWeightTransfer(json::object(), "::1"), "init");
  // Sleeping deeper at level 1 again changes nothing.
  ASSERT_TRUE(server_->Sleep(1, "abort").ok());

  ASSERT_TRUE(server_->WakeUp({"weights"}).ok());
  EXPECT_TRUE(server_->IsSleeping());  // the KV cache still sleeps
  EXPECT_TRUE(server_->IsPaused());
  m = Mem();
  EXPECT_EQ(m["sleep"], (json{{"weights", "awake"}, {"kv_cache", "discarded"}, {"scheduling", "asleep"}}));
  EXPECT_EQ(m["weights_resident_bytes"], weights);
  EXPECT_EQ(m["weights_offloaded_bytes"], 0);
  EXPECT_EQ(Held(), before);  // offloaded bytes came back exactly
  EXPECT_TRUE(server_->Health()["weights_consistent"].get<bool>());

  ASSERT_TRUE(server_->WakeUp({"kv_cache"}).ok());
  EXPECT_FALSE(server_->IsSleeping());
  EXPECT_FALSE(server_->IsPaused());  // nothing sleeps: scheduling resumed
  EXPECT_TRUE(Sync("v1").ok());
  EXPECT_EQ(Held(), Digests(trained_));
}

TEST_F(SleepTest, DiscardedWeightsStayInconsistentUntilASyncRefillsThem) {
  Start();
  ASSERT_TRUE(server_->Sleep(2, "wait").ok());
  json m = Mem();
  EXPECT_EQ(m["sleep"]["weights"], "discarded");
  EXPECT_EQ(m["weights_offloaded_bytes"], 0);
  ASSERT_TRUE(server_->WakeUp({}).ok());
  EXPECT_FALSE(server_->IsSleeping());
  EXPECT_FALSE(server_->IsPaused());
  EXPECT_EQ(Mem()["weights_resident_bytes"], Mem()["weights_bytes"]);
  EXPECT_FALSE(server_->Health()["weights_consistent"].get<bool>());
  Status checked = server_->Checksums(DigestAlgorithm::kSha256).status();
  EXPECT_EQ(checked.code(), StatusCode::kFailedPrecondition) << checked.ToString();
  EXPECT_NE(checked.message().find("discarded"), std::string::npos) << checked.ToString();
  // A session that lands nothing does not make the weights consistent.
  ASSERT_TRUE(server_->StartWeightUpdate().ok());
  ASSERT_TRUE(server_->FinishWeightUpdate(std::nullopt).ok());
  EXPECT_FALSE(server_->Health()["weights_consistent"].get<bool>());
  ASSERT_TRUE(Sync("v2").ok());
  EXPECT_TRUE(server_->Health()["weights_consistent"].get<bool>());
  EXPECT_EQ(Held(), Digests(trained_));
}

TEST_F(SleepTest, LevelTwoAfterLevelOneDropsTheOffloadedCopy) {
  Start();
  ASSERT_TRUE(server_->Sleep(1, "abort").ok());
  ASSERT_TRUE(server_->Sleep(2, "abort").ok());
  json m = Mem();
  EXPECT_EQ(m["sleep"]["weights"], "discarded");
  EXPECT_EQ(m["weights_offloaded_bytes"], 0);
  ASSERT_TRUE(server_->WakeUp({"weights", "kv_cache"}).ok());
  EXPECT_FALSE(server_->IsSleeping());
  EXPECT_FALSE(server_->Health()["weights_consistent"].get<bool>());
}

TEST_F(SleepTest, LevelZeroPausesSchedulingOnly) {
  Start();
  ASSERT_TRUE(server_->Sleep(0, "keep").ok());
  EXPECT_TRUE(server_->IsSleeping());
  EXPECT_TRUE(server_->IsPaused());
  EXPECT_EQ(Mem()["sleep"], (json{{"weights", "awake"}, {"kv_cache", "awake"}, {"scheduling", "asleep"}}));
  EXPECT_TRUE(server_->Checksums(DigestAlgorithm::kSha256).ok());
  ASSERT_TRUE(server_->WakeUp({"scheduling"}).ok());
  EXPECT_FALSE(server_->IsSleeping());
  EXPECT_FALSE(server_->IsPaused());
}

TEST_F(SleepTest, ASleepDuringAWeightUpdateIs409AndAppliesNothing) {
  Start();
  ASSERT_TRUE(server_->StartWeightUpdate().ok());
  Status s = server_->Sleep(1, "abort");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("active weight update"), std::string::npos) << s.ToString();
  EXPECT_FALSE(server_->IsSleeping());
  EXPECT_FALSE(server_->IsPaused());
  ASSERT_TRUE(server_->UpdateWeights(json::object()).ok());
  ASSERT_TRUE(server_->FinishWeightUpdate(std::string("v1")).ok());
  EXPECT_EQ(Held(), Digests(trained_));
}

TEST_F(SleepTest, BadLevelsTagsAndModesAre400sAndAFailedOffloadLeavesEverythingAwake) {
  Start();
  EXPECT_EQ(server_->Sleep(3, "abort").code(), StatusCode::kInvalidArgument);
  Status tag = server_->WakeUp({"weights", "gpu"});
  EXPECT_EQ(tag.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(tag.message().find("'gpu'"), std::string::npos) << tag.ToString();
  Status mode = server_->Sleep(1, "later");
  EXPECT_EQ(mode.code(), StatusCode::kInvalidArgument) << mode.ToString();
  EXPECT_FALSE(server_->IsSleeping());
  EXPECT_TRUE(server_->StartWeightUpdate().ok());  // no refusal was left behind
  ASSERT_TRUE(server_->FinishWeightUpdate(std::nullopt).ok());

  options_.offload_dir = (dir_ / "missing").string();
  Start();
  const auto before = Held();
  Status s = server_->Sleep(1, "abort");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(options_.offload_dir), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("the weights are awake as before"), std::string::npos) << s.ToString();
  EXPECT_FALSE(server_->IsSleeping());
  EXPECT_FALSE(server_->IsPaused());
  EXPECT_EQ(Mem()["weights_resident_bytes"], Mem()["weights_bytes"]);
  EXPECT_EQ(Held(), before);
  EXPECT_TRUE(Sync("v1").ok());
}

TEST_F(SleepTest, ServerInfoNamesConfigCapabilitiesAndMemory) {
  Start();
  json info = server_->ServerInfo();
  EXPECT_EQ(info["server"], "wsync");
  EXPECT_EQ(info["model"], "qwen3-tiny");
  EXPECT_EQ(info["backend"], "loading");
  EXPECT_EQ(info["tp"], 2);
  EXPECT_EQ(info["device"], "cpu");
  EXPECT_EQ(info["weight_version"], "default");
  EXPECT_EQ(info["config"]["weights"], "synthetic");
  EXPECT_EQ(info["config"]["init_seed"], InferenceServerOptions::kDefaultInitSeed);
  EXPECT_EQ(info["config"]["offload_dir"], dir_.string());
  EXPECT_EQ(info["capabilities"], (json{{"weight_transfer_backend", "loading"},
                                       {"sleep_mode", true},
                                       {"generation", true},
                                       {"prefix_caching", true},
                                       {"runtime_weight_checker", true},
                                       {"draft_weight_updates", false}}));
  EXPECT_EQ(info["memory"]["weights_bytes"], Mem()["weights_bytes"]);
}

TEST_F(SleepTest, ACheckpointLoadsAtStartAndItsErrorsNameTheFileAndTensor) {
  const std::filesystem::path ckpt = dir_ / "ckpt";
  std::filesystem::create_directories(ckpt);
  std::vector<TensorRef> refs;
  for (const HostTensor& t : trained_) refs.push_back(t.ref());
  ASSERT_TRUE(WriteSafetensors((ckpt / "model.safetensors").string(), refs).ok());
  options_.checkpoint = ckpt.string();
  Start();
  EXPECT_EQ(Held(), Digests(trained_));
  EXPECT_EQ(server_->ServerInfo()["config"]["checkpoint"], ckpt.string());

  // A shape the model does not have.
  HostTensor wrong = *HostTensor::Zeros(TensorMeta{trained_.back().meta.name, trained_.back().meta.dtype, {7}});
  std::vector<TensorRef> bad(refs.begin(), refs.end() - 1);
  bad.push_back(wrong.ref());
  ASSERT_TRUE(WriteSafetensors((ckpt / "model.safetensors").string(), bad).ok());
  auto shape = Make();
  ASSERT_EQ(shape.status().code(), StatusCode::kInvalidArgument) << shape.status().ToString();
  EXPECT_NE(shape.status().message().find("model.safetensors"), std::string::npos) << shape.status().ToString();
  EXPECT_NE(shape.status().message().find(trained_.back().meta.name), std::string::npos);
  // A tensor missing.
  bad.pop_back();
  ASSERT_TRUE(WriteSafetensors((ckpt / "model.safetensors").string(), bad).ok());
  auto missing = Make();
  ASSERT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();
  EXPECT_NE(missing.status().message().find(trained_.back().meta.name), std::string::npos);
  // A tensor the model lacks.
  bad = refs;
  HostTensor extra = *HostTensor::Zeros(TensorMeta{"model.rotary.inv_freq", DType::kF32, {4}});
  bad.push_back(extra.ref());
  ASSERT_TRUE(WriteSafetensors((ckpt / "model.safetensors").string(), bad).ok());
  auto unknown = Make();
  ASSERT_EQ(unknown.status().code(), StatusCode::kInvalidArgument) << unknown.status().ToString();
  EXPECT_NE(unknown.status().message().find("model.rotary.inv_freq"), std::string::npos);
}

}  // namespace
}  // namespace wsync
