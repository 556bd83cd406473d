// ReceiverEngine driven by a real wsync trainer: a small control service in this process
// answers the trainer's HTTP routes (real HTTP on loopback) and hands each payload to one
// ReceiverEngine per worker; bytes move over the backends' real data planes (a Gloo group,
// a shared-memory region, Gloo point-to-point slices). Each callback hashes what it is
// lent (sharded: puts each primary slice back into the whole HF tensor, then hashes);
// the digests must equal the trainer's own, sync after sync.
#include "wsync/receiver.h"

#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "control/control_service.h"
#include "control/http_server.h"
#include "core/digest.h"
#include "model/config.h"
#include "model/sharding.h"
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
  // `model` non-empty: the workers are one TP group of that model and land slices.
  EngineService(const std::string& backend, int workers, const std::string& model = "",
                size_t lend_batch_bytes = ReceiverEngineOptions{}.lend_batch_bytes) {
    for (int r = 0; r < workers; ++r) {
      ReceiverEngineOptions o;
      o.lend_batch_bytes = lend_batch_bytes;
      o.backend = backend;
      o.worker_rank = r;
      o.timeout_seconds = 20;
      o.label = fmt::format("test worker {}", r);
      o.model = model;
      o.tp_size = workers;
      auto made = ReceiverEngine::Create(o);
      EXPECT_TRUE(made.ok()) << made.status().ToString();
      engines_.push_back(std::move(*made));
      digests_.emplace_back();
      if (!model.empty()) {
        auto table = ShardingTable::Build(*LookupModel(model), r, workers);
        EXPECT_TRUE(table.ok()) << table.status().ToString();
        tables_.push_back(std::move(*table));
      }
    }
  }

  Status InitWeightTransfer(const json& init_info, const std::string& peer) override {
    return OnEveryWorker([&](size_t i) { return engines_[i]->Init(init_info, peer); });
  }
  Status StartWeightUpdate() override { return Status::Ok(); }
  Status UpdateWeights(std::shared_ptr<const json> update_info) override {
    if (!tables_.empty()) {
      whole_.clear();
      Status s = OnEveryWorker([&](size_t i) {
        return engines_[i]->Receive(
            *update_info, [](std::span<const TensorRef>) { return Internal("a whole tensor arrived"); },
            [&, i](std::span<const SliceRef> slices) { return PutBack(tables_[i], slices); });
      });
      std::lock_guard lock(mu_);
      for (auto& d : digests_) d.clear();
      for (const auto& [name, bytes] : whole_) {
        digests_[0][name] = HexDigest(DigestAlgorithm::kXxh3_128, std::span<const std::byte>(bytes));
      }
      for (size_t i = 1; i < digests_.size(); ++i) digests_[i] = digests_[0];
      return s;
    }
    {
      std::lock_guard lock(mu_);
      batches_.clear();
    }
    return OnEveryWorker([&](size_t i) {
      return engines_[i]->Receive(*update_info, [&, i](std::span<const TensorRef> chunk) -> Status {
        ++chunks_;
        if (fail_next_chunk_.exchange(false)) return Internal("load_weights raised ValueError: refused by the test");
        std::lock_guard lock(mu_);
        if (i == 0) batches_.emplace_back();
        for (const TensorRef& t : chunk) {
          digests_[i][std::string(t.name)] = HexDigest(DigestAlgorithm::kXxh3_128, t.bytes);
          if (i == 0) batches_.back().emplace_back(t.name);
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
  // The names worker 0 was lent in each callback call of the last update.
  std::vector<std::vector<std::string>> batches() const {
    std::lock_guard lock(mu_);
    return batches_;
  }

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

  // Copies each primary slice to its place in the whole HF tensor (whole_).
  Status PutBack(const ShardingTable& table, std::span<const SliceRef> slices) {
    std::lock_guard lock(mu_);
    for (const SliceRef& sl : slices) {
      const ShardPiece& p = table.params()[sl.param].pieces[sl.piece];
      const TensorMeta& hf = table.hf_tensors()[table.PieceHf(sl.param, sl.piece)];
      if (sl.hf_name != hf.name || sl.shape[p.dim] != p.length) return Internal(fmt::format("slice of {}", hf.name));
      if (!p.primary) continue;
      const size_t item = ItemSize(sl.dtype);
      int64_t outer = 1, inner = 1;
      for (int d = 0; d < p.dim; ++d) outer *= hf.shape[d];
      for (size_t d = p.dim + 1; d < hf.shape.size(); ++d) inner *= hf.shape[d];
      std::vector<std::byte>& whole = whole_[hf.name];
      whole.resize(static_cast<size_t>(outer * hf.shape[p.dim] * inner) * item);
      const size_t run = static_cast<size_t>(p.length * inner) * item;
      for (int64_t o = 0; o < outer; ++o) {
        std::memcpy(whole.data() + static_cast<size_t>((o * hf.shape[p.dim] + p.hf_start) * inner) * item,
                    sl.bytes.data() + static_cast<size_t>(o) * run, run);
      }
      ++slices_;
    }
    return Status::Ok();
  }

 public:
  int slices() const { return slices_; }

 private:
  std::vector<std::unique_ptr<ReceiverEngine>> engines_;
  std::vector<ShardingTable> tables_;                        // by worker, when they land slices
  std::map<std::string, std::vector<std::byte>> whole_;      // GUARDED_BY(mu_)
  std::atomic<int> slices_{0};
  mutable std::mutex mu_;
  std::vector<std::map<std::string, std::string>> digests_;  // GUARDED_BY(mu_)
  std::vector<std::vector<std::string>> batches_;             // GUARDED_BY(mu_)
  std::string version_ = "default";                           // GUARDED_BY(mu_)
  std::atomic<bool> paused_{false};
  std::atomic<bool> fail_next_chunk_{false};
  std::atomic<int> chunks_{0};
};

class ReceiverEngineTest : public ::testing::Test {
 protected:
  void Start(const std::string& backend, int workers, const std::string& model = "",
             size_t lend_batch_bytes = ReceiverEngineOptions{}.lend_batch_bytes) {
    service_ = std::make_unique<EngineService>(backend, workers, model, lend_batch_bytes);
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
    if (backend == "sharded") o.backend_options["model"] = "qwen3-tiny";
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

// One chunk holds the whole model; the callback gets it in batches as it arrives, each of
// whole decoder layers (or other modules), every tensor once, bit for bit.
TEST_F(ReceiverEngineTest, LendsAChunkInBatchesOfWholeModules) {
  constexpr size_t kBatch = 64 << 10;
  Start("nccl", 2, "", kBatch);
  TrainerOptions o = Options("nccl");
  o.bucket_gb = 1;
  auto engine = CreateTrainerEngine(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE((*engine)->Init(trainer_->metadata()).ok());
  // "model.layers.N." for a decoder layer's tensors, else the name up to its last dot.
  auto module = [](const std::string& name) {
    const std::string layers = "model.layers.";
    if (name.rfind(layers, 0) == 0) return name.substr(0, name.find('.', layers.size()) + 1);
    return name.substr(0, name.rfind('.'));
  };
  size_t total = 0;
  for (const TensorMeta& m : trainer_->metadata()) total += m.nbytes();
  ASSERT_GT(total, 4 * kBatch);
  for (int step = 0; step < 2; ++step) {
    if (step > 0) {
      ASSERT_TRUE(trainer_->Step(1).ok());
    }
    auto stats = (*engine)->SendWeights(trainer_->source(), std::nullopt);
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    EXPECT_EQ(stats->chunks, 1u);
    ExpectHoldsTrainer();
    const std::vector<std::vector<std::string>> batches = service_->batches();
    EXPECT_GT(batches.size(), 2u);
    std::map<std::string, size_t> batch_of_module;
    std::vector<std::string> lent;
    for (size_t b = 0; b < batches.size(); ++b) {
      for (const std::string& name : batches[b]) {
        auto [it, fresh] = batch_of_module.emplace(module(name), b);
        EXPECT_EQ(it->second, b) << name << " is lent apart from the rest of its module";
        lent.push_back(name);
      }
    }
    std::vector<std::string> want;
    for (const TensorMeta& m : trainer_->metadata()) want.push_back(m.name);
    EXPECT_EQ(lent, want);  // each once, in the trainer's order
  }
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
  EXPECT_NE(s.message().find("lm_head.weight, which the worker does not hold"), std::string::npos) << s.ToString();
}

TEST_F(ReceiverEngineTest, ShardedSlicesOfATpGroupPutBackEqualEverySync) {
  Start("sharded", 2, "qwen3-tiny");
  SyncSteps("sharded", 2, "v-sharded");
  EXPECT_GT(service_->slices(), 0);
}

TEST(ReceiverEngine, RefusesATpSizeTheModelDoesNotDivideNamingTheModel) {
  ReceiverEngineOptions o;
  o.backend = "sharded";
  o.model = "qwen3-tiny";
  o.tp_size = 3;  // does not divide the heads
  Status bad = ReceiverEngine::Create(o).status();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
  EXPECT_NE(bad.message().find("the sharding table of qwen3-tiny"), std::string::npos) << bad.ToString();
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
