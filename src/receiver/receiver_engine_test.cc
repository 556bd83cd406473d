// ReceiverEngine driven by a real wsync trainer: a small control service in this process
// answers the trainer's HTTP routes (real HTTP on loopback) and hands each payload to one
// ReceiverEngine per worker; bytes move over the backends' real data planes (a Gloo group,
// a shared-memory region). Each callback hashes what it is lent; the digests must equal
// the trainer's own, sync after sync.
#include "wsync/receiver.h"

#include <gtest/gtest.h>

#include <future>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "control/control_service.h"
#include "control/http_server.h"
#include "core/digest.h"
#include "model/config.h"
#include "synthetic/synthetic.h"
#include "wsync/server.h"
#include "wsync/trainer.h"

namespace wsync {
namespace {

using nlohmann::json;

// The control plane of a server whose workers are ReceiverEngines (what
// python/wsync/worker_server.py is, in C++): every update runs on every worker at once.
class EngineService final : public ControlService {
 public:
  EngineService(const std::string& backend, int workers) {
    for (int r = 0; r < workers; ++r) {
      ReceiverEngineOptions o;
      o.backend = backend;
      o.worker_rank = r;
      o.timeout_seconds = 20;
      o.label = fmt::format("test worker {}", r);
      auto made = ReceiverEngine::Create(o);
      EXPECT_TRUE(made.ok()) << made.status().ToString();
      engines_.push_back(std::move(*made));
      digests_.emplace_back();
    }
  }

  Status InitWeightTransfer(const json& init_info, const std::string& peer) override {
    return OnEveryWorker([&](size_t i) { return engines_[i]->Init(init_info, peer); });
  }
  Status StartWeightUpdate() override { return Status::Ok(); }
  Status UpdateWeights(std::shared_ptr<const json> update_info) override {
    return OnEveryWorker([&](size_t i) {
      return engines_[i]->Receive(*update_info, [&, i](std::span<const TensorRef> chunk) -> Status {
        ++chunks_;
        if (fail_next_chunk_.exchange(false)) return Internal("load_weights raised ValueError: refused by the test");
        for (const TensorRef& t : chunk) {
          std::lock_guard lock(mu_);
          digests_[i][std::string(t.name)] = HexDigest(DigestAlgorithm::kXxh3_128, t.bytes);
        }
        return Status::Ok();
      });
    });
  }
  Status FinishWeightUpdate(const std::optional<std::string>& version) override {
    if (version) SetWeightVersion(*version);
    return Status::Ok();
  }
  int WorldSize(bool) const override { return static_cast<int>(engines_.size()); }
  std::string WeightVersion() const override {
    std::lock_guard lock(mu_);
    return version_;
  }
  void SetWeightVersion(std::string version) override {
    std::lock_guard lock(mu_);
    version_ = std::move(version);
  }
  // Generation is what pause stops, and this server generates nothing: the flag only.
  Status Pause(std::string_view, bool) override {
    paused_ = true;
    return Status::Ok();
  }
  Status Resume() override {
    paused_ = false;
    return Status::Ok();
  }
  bool IsPaused() const override { return paused_; }
  Result<bool> ResetPrefixCache(bool) override { return true; }
  // Worker 0's digests; every other worker must hold the same.
  Result<std::map<std::string, std::string>> Checksums(DigestAlgorithm) override {
    std::lock_guard lock(mu_);
    for (size_t i = 1; i < digests_.size(); ++i) {
      if (digests_[i] != digests_[0]) return DataLoss(fmt::format("worker {} differs from worker 0", i));
    }
    return digests_[0];
  }
  json Health() const override {
    return json{{"status", "ok"}, {"server", "wsync"}, {"backend", engines_[0]->options().backend},
                {"tp", static_cast<int>(engines_.size())}, {"dp", 1}};
  }

  void FailNextChunk() { fail_next_chunk_ = true; }
  int chunks() const { return chunks_; }

 private:
  Status OnEveryWorker(const std::function<Status(size_t)>& f) {
    std::vector<std::future<Status>> done;
    for (size_t i = 0; i < engines_.size(); ++i) done.push_back(std::async(std::launch::async, f, i));
    Status first;
    for (auto& d : done) {
      Status s = d.get();
      if (first.ok()) first = s;
    }
    return first;
  }

  std::vector<std::unique_ptr<ReceiverEngine>> engines_;
  mutable std::mutex mu_;
  std::vector<std::map<std::string, std::string>> digests_;  // GUARDED_BY(mu_)
  std::string version_ = "default";                           // GUARDED_BY(mu_)
  std::atomic<bool> paused_{false};
  std::atomic<bool> fail_next_chunk_{false};
  std::atomic<int> chunks_{0};
};

class ReceiverEngineTest : public ::testing::Test {
 protected:
  void Start(const std::string& backend, int workers) {
    service_ = std::make_unique<EngineService>(backend, workers);
    auto http = HttpControlServer::Start(HttpServerOptions{}, service_.get());
    ASSERT_TRUE(http.ok()) << http.status().ToString();
    http_ = std::move(*http);
    auto trainer = SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 5, 2);
    ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
    trainer_ = std::move(*trainer);
  }
  void TearDown() override {
    if (http_) http_->Stop();
  }
  TrainerOptions Options(const std::string& backend) {
    TrainerOptions o;
    o.backend = backend;
    o.servers = {http_->url()};
    o.timeout_seconds = 20;
    o.bucket_gb = 1.0 / 1024;  // 1 MiB chunks: many per sync
    return o;
  }
  // The server holds exactly the trainer's tensors, bit for bit.
  void ExpectHoldsTrainer() {
    auto sums = service_->Checksums(DigestAlgorithm::kXxh3_128);
    ASSERT_TRUE(sums.ok()) << sums.status().ToString();
    const auto& tensors = trainer_->tensors();
    ASSERT_EQ(sums->size(), tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const std::string& name = trainer_->metadata()[i].name;
      EXPECT_EQ((*sums)[name], HexDigest(DigestAlgorithm::kXxh3_128, tensors[i].storage.span())) << name;
    }
  }

  // Syncs the starting weights, then `steps` trained steps, each checked; the last sync
  // names `version`.
  void SyncSteps(const std::string& backend, int steps, const std::string& version) {
    auto engine = CreateTrainerEngine(Options(backend));
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    ASSERT_TRUE((*engine)->Init(trainer_->metadata()).ok());
    for (int step = 0; step <= steps; ++step) {
      if (step > 0) ASSERT_TRUE(trainer_->Step(static_cast<uint64_t>(step)).ok());
      std::optional<std::string> v;
      if (step == steps) v = version;
      auto stats = (*engine)->SendWeights(trainer_->source(), v);
      ASSERT_TRUE(stats.ok()) << stats.status().ToString();
      EXPECT_GT(stats->chunks, 1u);
      ExpectHoldsTrainer();
    }
    EXPECT_EQ(service_->WeightVersion(), version);
  }

  std::unique_ptr<EngineService> service_;
  std::unique_ptr<HttpControlServer> http_;
  std::unique_ptr<SyntheticTrainer> trainer_;
};

TEST_F(ReceiverEngineTest, GlooBroadcastLandsEverySyncInEveryWorker) {
  Start("nccl", 2);
  SyncSteps("nccl", 2, "step-2");
  EXPECT_GT(service_->chunks(), 2 * 3);
}

TEST_F(ReceiverEngineTest, SharedMemorySlotsLandEverySync) {
  Start("ipc", 1);
  SyncSteps("ipc", 1, "step-1");
}

TEST_F(ReceiverEngineTest, CallbackErrorFailsTheSyncWithItsTextAndTheNextSyncLands) {
  for (const char* backend : {"nccl", "ipc"}) {
    SCOPED_TRACE(backend);
    Start(backend, 1);
    auto engine = CreateTrainerEngine(Options(backend));
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    ASSERT_TRUE((*engine)->Init(trainer_->metadata()).ok());
    service_->FailNextChunk();
    auto failed = (*engine)->SendWeights(trainer_->source(), std::nullopt);
    ASSERT_FALSE(failed.ok());
    EXPECT_NE(failed.status().message().find("ValueError: refused by the test"), std::string::npos)
        << failed.status().ToString();
    ASSERT_TRUE(trainer_->Step(1).ok());
    auto stats = (*engine)->SendWeights(trainer_->source(), std::nullopt);
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    ExpectHoldsTrainer();
    http_->Stop();
  }
}

TEST(ReceiverEngine, RefusesAnUpdateOutsideItsMetadataNamingTheTensor) {
  ReceiverEngineOptions o;
  o.backend = "ipc";
  o.metadata = {TensorMeta{"model.norm.weight", DType::kBF16, {8}}};
  auto rx = ReceiverEngine::Create(o);
  ASSERT_TRUE(rx.ok()) << rx.status().ToString();
  json update = {{"names", {"model.norm.weight"}}, {"dtype_names", {"bfloat16"}}, {"shapes", {{16}}}};
  Status s = (*rx)->Receive(update, [](std::span<const TensorRef>) { return Status::Ok(); });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("model.norm.weight"), std::string::npos) << s.ToString();
  update["shapes"] = {{8}};
  update["names"] = {"lm_head.weight"};
  s = (*rx)->Receive(update, [](std::span<const TensorRef>) { return Status::Ok(); });
  EXPECT_NE(s.message().find("lm_head.weight, which worker does not hold"), std::string::npos) << s.ToString();
}

TEST(ReceiverEngine, RefusesBadOptions) {
  ReceiverEngineOptions o;
  o.backend = "carrier-pigeon";
  EXPECT_EQ(ReceiverEngine::Create(o).status().code(), StatusCode::kInvalidArgument);
  o.backend = "nccl";
  o.worker_rank = -1;
  EXPECT_NE(ReceiverEngine::Create(o).status().message().find("worker_rank -1"), std::string::npos);
}

}  // namespace
}  // namespace wsync
