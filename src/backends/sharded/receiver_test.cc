// The `sharded` backend's inference side against real peers: an in-process server (HTTP
// control plane, tp 2) joins a Gloo point-to-point group on loopback with producers the
// test plays, on threads of its own. The producers plan every worker's chunks from the
// same model (PlanConsumer, PlanProducer), pack them from synthetic full weights
// (PackSliceHost) and send them as the protocol says; the server's read-back digests
// then equal the synthetic weights'. Also: a plan digest that disagrees fails init naming
// both digests, and a producer that never sends fails the update within the timeout,
// naming it and the group. Receiving in plan order and in concurrent lanes (lanes.h) land
// the same bits.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include <fmt/format.h>

#include "backends/sharded/init_info.h"
#include "comm/communicator.h"
#include "comm/connect.h"
#include "comm/store.h"
#include "control/session_driver.h"
#include "model/config.h"
#include "model/sharding.h"
#include "plan/sharded_plan.h"
#include "receiver/backend.h"
#include "sources/groups.h"
#include "synthetic/synthetic.h"
#include "testing/test_server.h"

namespace wsync {
namespace {

using nlohmann::json;
using testing::ExpectServerHolds;
using Server = testing::TestServer;

constexpr int kProducers = 3;
constexpr int kTp = 2;
constexpr double kServerTimeout = 20;

class ShardedReceiver : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    config_ = *LookupModel(GetParam());
    auto trainer = SyntheticTrainer::FromMetadata(HfTensors(config_), 7, 2);
    ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
    trainer_ = std::move(*trainer);
    std::vector<std::string> names;
    for (const TensorMeta& m : trainer_->metadata()) names.push_back(m.name);
    auto groups = LayerGroups(names);
    ASSERT_TRUE(groups.ok()) << groups.status().ToString();
    // Owner classes of every kind: one rank, two ranks, rank 0 with rank 2 for "pre".
    std::vector<std::vector<bool>> held(kProducers, std::vector<bool>(names.size()));
    for (size_t g = 0; g < groups->size(); ++g) {
      group_lens_.push_back(static_cast<int>((*groups)[g].size()));
      for (size_t i = (*groups)[g].begin; i < (*groups)[g].end; ++i) {
        held[0][i] = g % 3 != 2;
        held[1][i] = g % 3 != 0;
        held[2][i] = g % 3 == 2 || g == 0;
      }
    }
    auto ownership = ResolveOwnership(names, held);
    ASSERT_TRUE(ownership.ok()) << ownership.status().ToString();
    stream_ = ShardedStream{trainer_->metadata(), group_lens_, *ownership, kProducers};
    for (int r = 0; r < kTp; ++r) {
      auto table = ShardingTable::Build(config_, r, kTp);
      ASSERT_TRUE(table.ok()) << table.status().ToString();
      tables_.push_back(std::move(*table));
    }
    for (int r = 0; r < kTp; ++r) {
      auto plan = PlanConsumer(stream_, tables_[r], ConsumerSpot{r, r, kTp});
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      plans_.push_back(std::move(*plan));
    }
    auto store = StoreServer::Start("127.0.0.1", 0);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
    InferenceServerOptions o;
    o.model = GetParam();
    o.tp = kTp;
    o.backend = "sharded";
    o.timeout_seconds = kServerTimeout;
    auto server = Server::Start(o, CreateReceiverBackend);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::make_unique<Server>(std::move(*server));
    driver_ = std::make_unique<SessionDriver>(std::vector<std::string>{server_->url()}, "", kServerTimeout);
  }

  ShardedInitInfo Info(double timeout_seconds) {
    ShardedInitInfo info;
    info.tensors = stream_.tensors;
    info.group_lens = group_lens_;
    info.owner_sets = stream_.ownership.owner_sets;
    info.name_owner_class = stream_.ownership.name_owner_class;
    info.num_producers = kProducers;
    info.num_consumers = kTp;
    info.workers_per_replica = kTp;
    info.consumer_offset = 0;
    info.deployment_workers = kTp;
    for (const ConsumerPlan& p : plans_) info.plan_digests.push_back(p.digest);
    info.world_size = kProducers + kTp;
    info.num_buffers = 2;
    info.gloo_store_host = "127.0.0.1";
    info.gloo_store_port = store_->port();
    info.gloo_prefix = fmt::format("sharded-test/{}", ++attempt_);
    for (int r = 0; r < kProducers; ++r) info.rank_labels.push_back(fmt::format("fsdp{}", r));
    for (int r = 0; r < kTp; ++r) info.rank_labels.push_back(fmt::format("server worker tp{}", r));
    info.timeout_seconds = timeout_seconds;
    return info;
  }

  // The server's init over HTTP while the producers join the group on threads.
  Status InitGroup(const ShardedInitInfo& info) {
    comms_.clear();
    comms_.resize(kProducers);
    std::vector<std::future<Status>> joins;
    for (int p = 0; p < kProducers; ++p) {
      joins.push_back(std::async(std::launch::async, [this, p, &info]() -> Status {
        CommSpec spec;
        spec.store = CommSpec::Store{"127.0.0.1", store_->port(), *info.gloo_prefix};
        spec.rank = p;
        spec.size = info.world_size;
        spec.connect_deadline = Deadline::InSeconds(kServerTimeout);
        WSYNC_ASSIGN_OR_RETURN(comms_[p], Connect(spec));
        return Status::Ok();
      }));
    }
    Status init = driver_->InitAll(info.ToJson());
    for (auto& j : joins) {
      Status s = j.get();
      if (init.ok() && !s.ok()) init = s;
    }
    return init;
  }

  // Producer p packs every chunk it owes from the trainer's current weights and sends
  // them all, one message per (consumer, chunk), tag = the chunk's index in its plan.
  Status Produce(int p, Deadline deadline) {
    ProducerPlan mine = PlanProducer(p, static_cast<int>(group_lens_.size()), plans_);
    std::vector<std::vector<std::byte>> packed;
    std::vector<Communicator::PeerMessage> sends;
    for (const std::vector<ProducerSend>& group : mine.by_group) {
      for (const ProducerSend& send : group) {
        std::vector<std::byte>& buf = packed.emplace_back(send.bytes);
        const PlanChunk& chunk = plans_[send.plan].chunks[send.chunk];
        for (const PlanSlice& s : chunk.slices) {
          PackSliceHost(tables_[send.plan], s, trainer_->tensors()[s.tensor].storage.data(), buf.data());
        }
      }
    }
    size_t next = 0;
    for (const std::vector<ProducerSend>& group : mine.by_group) {
      for (const ProducerSend& send : group) {
        std::vector<std::byte>& buf = packed[next++];
        for (size_t j = 0; j < send.consumers.size(); ++j) {
          sends.push_back({kProducers + send.consumers[j], static_cast<uint32_t>(send.chunks[j]), std::span(buf)});
        }
      }
    }
    return comms_[p]->ExchangePeers(sends, {}, deadline);
  }

  // One sync: start, update_weights {} in the background while the producers in
  // `sending` send, finish. Returns the update's status (and finishes only when it is OK).
  Status Sync(const std::vector<int>& sending, std::vector<Status>* produced = nullptr) {
    WSYNC_RETURN_IF_ERROR(driver_->Start());
    auto update = std::async(std::launch::async, [this] { return driver_->Update(json::object()); });
    std::vector<std::future<Status>> producers;
    for (int p : sending) {
      producers.push_back(std::async(std::launch::async, [this, p] {
        return Produce(p, Deadline::InSeconds(kServerTimeout));
      }));
    }
    Status s = update.get();
    if (!s.ok()) {
      for (auto& c : comms_) c->Abort();  // the trainer tears its group down
    }
    for (auto& f : producers) {
      Status ps = f.get();
      if (produced) produced->push_back(ps);
    }
    if (!s.ok()) {
      driver_->Close();
      return s;
    }
    return driver_->Finish(std::nullopt);
  }

  ModelConfig config_;
  std::unique_ptr<SyntheticTrainer> trainer_;
  std::vector<int> group_lens_;
  ShardedStream stream_;
  std::vector<ShardingTable> tables_;
  std::vector<ConsumerPlan> plans_;
  std::unique_ptr<StoreServer> store_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<SessionDriver> driver_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  int attempt_ = 0;
};

TEST_P(ShardedReceiver, EveryWorkerLandsItsSlicesBitExactSyncAfterSync) {
  ASSERT_TRUE(InitGroup(Info(kServerTimeout)).ok());
  EXPECT_EQ(server_->service->Health()["tp"], kTp);
  std::vector<int> all(kProducers);
  for (int p = 0; p < kProducers; ++p) all[p] = p;
  for (uint64_t step = 1; step <= 2; ++step) {
    std::vector<Status> produced;
    Status s = Sync(all, &produced);
    ASSERT_TRUE(s.ok()) << s.ToString();
    for (const Status& ps : produced) EXPECT_TRUE(ps.ok()) << ps.ToString();
    ExpectServerHolds(*server_->service, trainer_->tensors());
    ASSERT_TRUE(trainer_->Step(step).ok());
  }
  EXPECT_EQ(server_->service->Health()["syncs"], 2);
  // update_info takes no fields: a tensor list is refused by name, and the group lives on.
  ASSERT_TRUE(driver_->Start().ok());
  Status refused = driver_->Update(json{{"names", json::array()}, {"shapes", json::array()}});
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  EXPECT_NE(refused.message().find("takes no fields (the plan is fixed at init); got names, shapes"),
            std::string::npos)
      << refused.message();
  driver_->Close();
  ASSERT_TRUE(Sync(all).ok());
  ExpectServerHolds(*server_->service, trainer_->tensors());
}

TEST_P(ShardedReceiver, PlanOrderAndConcurrentLanesLandTheSameBits) {
  std::vector<int> all(kProducers);
  for (int p = 0; p < kProducers; ++p) all[p] = p;
  uint64_t step = 1;
  // Plan order, a lane per producer, lanes merged under a 1 MB staging bound, plan order.
  for (auto [concurrent, budget_mb] : {std::pair{false, 0}, {true, 0}, {true, 1}, {false, 0}}) {
    ShardedInitInfo info = Info(kServerTimeout);
    info.concurrent_stages = concurrent;
    info.receive_staging_mb = budget_mb;
    ASSERT_TRUE(InitGroup(info).ok());
    Status s = Sync(all);
    ASSERT_TRUE(s.ok()) << (concurrent ? "concurrent: " : "plan order: ") << budget_mb << " MB: " << s.ToString();
    ExpectServerHolds(*server_->service, trainer_->tensors());
    ASSERT_TRUE(trainer_->Step(step++).ok());
  }
}

TEST_P(ShardedReceiver, APlanDigestThatDisagreesFailsInitNamingBothDigests) {
  ShardedInitInfo info = Info(kServerTimeout);
  const std::string theirs(64, 'f');
  info.plan_digests[1] = theirs;
  Status s = driver_->InitAll(info.ToJson());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find(fmt::format("{} worker dp0/tp1 (consumer 1): the trainer's plan for it has digest {}, "
                                         "this server's has digest {}",
                                         server_->url(), theirs, plans_[1].digest)),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("same model and --tp on both sides?"), std::string::npos) << s.message();
  // Nothing joined: an update has no group.
  ASSERT_TRUE(driver_->Start().ok());
  Status u = driver_->Update(json::object());
  EXPECT_EQ(u.code(), StatusCode::kFailedPrecondition) << u.ToString();
  EXPECT_NE(u.message().find("no live sharded group"), std::string::npos) << u.message();
  driver_->Close();
}

TEST_P(ShardedReceiver, AWorkerOutsideItsDeploymentFailsInitNamingIt) {
  ShardedInitInfo info = Info(kServerTimeout);
  info.workers_per_replica = 0;
  info.deployment_workers = 1;  // the trainer thinks the server has one worker
  info.plan_digests.resize(1);
  Status s = driver_->InitAll(info.ToJson());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(fmt::format("{} worker dp0/tp1 would be consumer 1 (consumer_offset 0 + deployment "
                                         "index 1), outside the fleet's 2 consumers or its deployment's 1 workers",
                                         server_->url())),
            std::string::npos)
      << s.message();
}

TEST_P(ShardedReceiver, AProducerThatNeverSendsFailsTheUpdateInTimeNamingItAndTheGroup) {
  constexpr double kTimeout = 2;
  ASSERT_TRUE(InitGroup(Info(kTimeout)).ok());
  // Worker 0's first chunk from producer 1 is the one it waits for in vain.
  const ConsumerPlan& plan = plans_[0];
  size_t k = 0;
  while (k < plan.chunks.size() && plan.chunks[k].producer != 1) ++k;
  ASSERT_LT(k, plan.chunks.size());
  const PlanChunk& stuck = plan.chunks[k];
  int first = 0;
  for (int g = 0; g < stuck.group; ++g) first += group_lens_[g];
  auto t0 = std::chrono::steady_clock::now();
  Status s = Sync({0, 2});
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(s.ok());
  EXPECT_LT(took, kTimeout + 5);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find(fmt::format("{} worker dp0/tp0: receiving chunk {}/{} of group {} ({}, {} bytes) from "
                                         "trainer rank 1 (fsdp1)",
                                         server_->url(), k + 1, plan.chunks.size(), stuck.group,
                                         trainer_->metadata()[first].name, stuck.bytes)),
            std::string::npos)
      << s.message();
  // The group is gone for every worker: the next update says so at once.
  ASSERT_TRUE(driver_->Start().ok());
  Status u = driver_->Update(json::object());
  EXPECT_EQ(u.code(), StatusCode::kFailedPrecondition) << u.ToString();
  driver_->Close();
  // A fresh init recovers.
  ASSERT_TRUE(InitGroup(Info(kServerTimeout)).ok());
  ASSERT_TRUE(Sync({0, 1, 2}).ok());
  ExpectServerHolds(*server_->service, trainer_->tensors());
}

INSTANTIATE_TEST_SUITE_P(Models, ShardedReceiver, ::testing::Values("qwen3-tiny", "qwen3-moe-tiny"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string name = i.param;
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace wsync
