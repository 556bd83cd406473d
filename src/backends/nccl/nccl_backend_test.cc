// The `nccl` backend end to end inside one process: real HTTP servers on loopback, real
// Gloo groups, a trainer engine, and checksums read back from the servers' shards.
#include <gtest/gtest.h>
#include <httplib.h>

#include <thread>

#include <fmt/format.h>

#include "control/session_driver.h"
#include "control/http_server.h"
#include "core/digest.h"
#include "model/config.h"
#include "server/inference_server.h"
#include "receiver/backend.h"
#include "synthetic/synthetic.h"
#include "testing/faulty_source.h"
#include "testing/test_server.h"
#include "wsync/trainer.h"

namespace wsync {
namespace {

using nlohmann::json;

using testing::ExpectServerHolds;
using testing::FaultySource;
using Server = testing::TestServer;

Server StartServer(const std::string& model, int tp) {
  InferenceServerOptions o;
  o.model = model;
  o.tp = tp;
  o.timeout_seconds = 20;
  auto made = Server::Start(o, CreateReceiverBackend);
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  return std::move(*made);
}

class NcclBackend : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = *LookupModel("qwen3-tiny");
    trainer_ = std::move(*SyntheticTrainer::FromMetadata(HfTensors(config_), 11, 2));
  }
  TrainerOptions Options(const std::vector<Server*>& servers) {
    TrainerOptions o;
    for (Server* s : servers) o.servers.push_back(s->http->url());
    o.timeout_seconds = 20;
    return o;
  }
  ModelConfig config_;
  std::unique_ptr<SyntheticTrainer> trainer_;
};

TEST_F(NcclBackend, ManySmallChunksAndUnpackedBothLandBitExact) {
  Server a = StartServer("qwen3-tiny", 2);
  for (bool packed : {true, false}) {
    TrainerOptions o = Options({&a});
    o.packed = packed;
    o.bucket_gb = 256.0 / (1 << 30);  // 256-byte buckets: a chunk per tensor or so
    auto engine = *CreateTrainerEngine(o);
    ASSERT_TRUE(engine->Init(trainer_->metadata()).ok());
    auto stats = engine->SendWeights(trainer_->source(), "v1");
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    // Buckets are at least the largest tensor (the 2 MiB embedding): a few chunks packed,
    // one per tensor unpacked.
    if (packed) {
      EXPECT_GE(stats->chunks, 3u);
    } else {
      EXPECT_EQ(stats->chunks, trainer_->metadata().size());
    }
    ExpectServerHolds(*a.service, trainer_->source());
    ASSERT_TRUE(trainer_->Step(packed ? 1 : 2).ok());
  }
}

TEST_F(NcclBackend, LyingSourceFailsBeforeAnythingIsSent) {
  Server a = StartServer("qwen3-tiny", 1);
  auto engine = *CreateTrainerEngine(Options({&a}));
  ASSERT_TRUE(engine->Init(trainer_->metadata()).ok());
  FaultySource liar(&trainer_->source(), {.lie_shape_at = 3});
  auto r = engine->SendWeights(liar, std::nullopt);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(trainer_->metadata()[3].name), std::string::npos) << r.status().message();
  // Nothing was started on the server, and the group is still usable.
  EXPECT_EQ(a.service->Health()["syncs"], 0);
  ASSERT_TRUE(engine->SendWeights(trainer_->source(), std::nullopt).ok());
  ExpectServerHolds(*a.service, trainer_->source());
}

TEST_F(NcclBackend, RejectedUpdateStopsEveryoneAndTheGroupSurvives) {
  // The second server serves a different model: it rejects the update with a 400 naming
  // a tensor, the preflight vote stops the other server too, and the next sync to a
  // matching pair works without a new init.
  Server a = StartServer("qwen3-tiny", 1);
  Server b = StartServer("qwen3-moe-tiny", 1);
  auto engine = *CreateTrainerEngine(Options({&a, &b}));
  ASSERT_TRUE(engine->Init(trainer_->metadata()).ok());
  auto t0 = std::chrono::steady_clock::now();
  auto r = engine->SendWeights(trainer_->source(), std::nullopt);
  ASSERT_FALSE(r.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find(b.http->url()), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("which the worker does not hold"), std::string::npos) << r.status().message();
  EXPECT_EQ(a.service->Health()["weights_consistent"], true);
  // Both sessions are closed: a raw start on each succeeds.
  SessionDriver driver({a.http->url(), b.http->url()}, "", 5);
  EXPECT_TRUE(driver.Start().ok());
  EXPECT_TRUE(driver.Finish(std::nullopt).ok());
}

TEST_F(NcclBackend, SendWithoutInitIsAClearError) {
  Server a = StartServer("qwen3-tiny", 1);
  auto engine = *CreateTrainerEngine(Options({&a}));
  auto r = engine->SendWeights(trainer_->source(), std::nullopt);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
}

TEST_F(NcclBackend, ServerRejectsBadInitNamingTheField) {
  Server a = StartServer("qwen3-tiny", 2);
  SessionDriver driver({a.http->url()}, "", 5);
  json init = {{"rank_offset", 1}, {"world_size", 2}, {"gloo_store_host", "127.0.0.1"},
               {"gloo_store_port", 1}, {"gloo_prefix", "x"}};
  Status r = driver.InitAll(init);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.message().find("outside world_size 2"), std::string::npos) << r.message();
  init["world_size"] = 3;
  init["nccl_unique_id_b64"] = "AAAA";
  r = driver.InitAll(init);
  EXPECT_NE(r.message().find("exactly one rendezvous"), std::string::npos);
}

// A server that is not wsync (here: an HTTP server answering /health and
// /get_world_size as a vLLM server would, with no "server": "wsync") cannot take the CPU
// data plane; the trainer says so, naming it, before it builds anything.
TEST(NcclTrainer, CpuTrainerRefusesAServerThatIsNotWsync) {
  httplib::Server other;
  other.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("", "text/plain"); });
  other.Get("/get_world_size", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"world_size": 1})", "application/json");
  });
  int port = other.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread serving([&] { other.listen_after_bind(); });
  TrainerOptions o;
  o.servers = {fmt::format("http://127.0.0.1:{}", port)};
  o.timeout_seconds = 10;
  auto engine = CreateTrainerEngine(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  Status s = (*engine)->Init(HfTensors(*LookupModel("qwen3-tiny")));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find(o.servers[0] + " is not a wsync server"), std::string::npos) << s.ToString();
  other.stop();
  serving.join();
}

}  // namespace
}  // namespace wsync
